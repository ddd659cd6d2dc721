// The local samplers of step 5 (docs/semantics.md L4-L6) as row transforms of float32 logits, from per-row
// statistics (launchers: local_samplers.cu; the design: docs/design/kernel-routing.md, "Local samplers"). A removal
// is -inf written into the logits in place, or a bit cleared in a row's kept bits while the logits are only read
// (Row::keep): the same kept set either way.
//
// Rows are cut into chunks of kChunk tokens, one block each, so that every statistic is summed in an order fixed by
// the vocabulary alone: a row gives the same kept set alone or in any batch. Each block writes its chunk's partial
// statistics; the blocks of the next kernel merge a row's partials in a fixed tree (merge_row), and where a row needs
// one block to finish it, the last of its blocks to arrive does (a self-resetting counter). The statistics are float64
// from the float32 logits, as the torch reference computes them; probability masses that decide a cut are summed in
// 2^-62 fixed point, whose sums do not depend on the order of accumulation.
//
// Top-n-sigma alone takes sigma_floor_kernel instead: its cut as a per-row floor that the sampling kernels apply.
//
// Kernels, in launch order (a row takes the ones of its samplers; the others leave at once):
//   stats_kernel<false>  the statistics of the row's first sampler (by the row's last block: typical-p's merged into
//                        the row's constants, XTC decided)
//   sigma_kernel         top-n-sigma's cut, written; the statistics of the next sampler (merged or decided likewise)
//   typical_hist_kernel  typical-p: mass by bins of the score |log q + H|; the last block finds the cut bin
//   typical_cut_kernel   typical-p: bins past the cut written; the last block sorts the cut bin and cuts it
//   stats_kernel<true>   XTC after typical-p: statistics and decision
#pragma once
#include <cfloat>
#include <climits>
#include <cstdint>

#include "common.cuh"
#include "local_samplers.h"
#include "philox.cuh"

namespace tokensampler {
namespace local {

constexpr int kThreads = 256;
constexpr int kGroups = 8;                               // groups of four tokens a thread holds
constexpr int64_t kChunkGroups = int64_t{kThreads} * kGroups;
constexpr int64_t kChunk = 4 * kChunkGroups;             // 8192 tokens a block
constexpr int kBins = 2048;                              // typical-p's score bins
constexpr int kCutCap = 4096;                            // cut-bin tokens sorted in shared memory
constexpr int kSubBins = 2048;                           // radix sub-bins of a crowded cut bin
constexpr int kXtcCap = 64;                              // XTC candidates listed a chunk
constexpr double kMassScale = 0x1p62;                    // fixed-point unit of probability mass: 2^-62
constexpr size_t kCutSmemBytes = kCutCap * (sizeof(uint64_t) + sizeof(uint32_t));
static_assert(kSubBins * (sizeof(uint64_t) + sizeof(uint32_t)) <= kCutSmemBytes, "sub-bins fit in the cut buffer");

// XTC's coin: counter (0xFFFFFFFE, position, iteration, 0xFFFFFFFF), word 0 (docs/semantics.md L6).
constexpr uint32_t kXtcBlock = 0xFFFFFFFEu;
constexpr uint32_t kXtcSample = 0xFFFFFFFFu;

__host__ __device__ inline int num_chunks(int64_t vocab) { return static_cast<int>((vocab + kChunk - 1) / kChunk); }
// The cut-bin ids a row lists (a bin holds at most the vocabulary).
__host__ __device__ inline int64_t cut_capacity(int64_t vocab) { return vocab < kCutCap ? vocab : kCutCap; }

// ---------------------------------------------------------------------------------------------
// Rows and their parameters.

struct Row {
  float* x;
  int64_t vocab;
  bool aligned;    // groups of four are 16-byte loads and stores
  uint32_t* keep;  // null: removals are -inf written into x. Else the row's kept bits (token i at bit i % 32 of word
                   // i / 32): removals clear bits, x is only read, and a cleared token reads as -inf

  __device__ static Row of(float* logits, uint32_t* keep, int64_t r, int64_t vocab) {
    float* x = logits + r * vocab;
    return Row{x, vocab, reinterpret_cast<uintptr_t>(x) % 16 == 0, keep ? keep + r * words_of(vocab) : nullptr};
  }
  // The kept bits of group g (bit e: token 4g + e; g inside the row) through L2: other blocks of the kernel may have
  // cleared them.
  __device__ uint32_t kept(int64_t g) const { return __ldcg(keep + (g >> 3)) >> (4 * static_cast<uint32_t>(g & 7)); }
  // Group g as the samplers see it so far, through L2 (other blocks of the kernel may have removed tokens).
  __device__ void load_fresh(int64_t g, float (&v)[4]) const {
    const int64_t i0 = 4 * g;
    if (aligned && i0 + 4 <= vocab) {
      const float4 q = __ldcg(reinterpret_cast<const float4*>(x + i0));
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = i0 + e < vocab ? __ldcg(x + i0 + e) : -kInf;
    }
    if (keep && i0 < vocab) mask_group(kept(g), v);
  }
  // Token id removed (a scattered removal; groups go through store_removed).
  __device__ void remove(int64_t id) const {
    if (keep) atomicAnd(keep + (id >> 5), ~(1u << (id & 31)));
    else x[id] = -kInf;
  }
};

// The u of the row's XTC coin, exact in float64 (its 25 significant bits).
__device__ __forceinline__ double xtc_uniform(int64_t seed, int64_t position, int64_t iteration) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint4 w = philox4x32_10(make_uint4(kXtcBlock, static_cast<uint32_t>(position), static_cast<uint32_t>(iteration),
                                           kXtcSample),
                                static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return (static_cast<double>(w.x >> 8) + 0.5) * 0x1p-24;
}

struct Samplers {
  float n, p, t;
  bool sigma, typical, xtc;  // xtc: on and the row's coin came up
};

__device__ __forceinline__ Samplers row_samplers(const TsLocalRows& rows, int64_t r) {
  Samplers s;
  s.n = rows.top_n_sigma[r];
  s.p = rows.typical_p[r];
  s.t = rows.xtc_threshold[r];
  const float q = rows.xtc_probability[r];
  s.sigma = s.n > 0.f;
  s.typical = s.p < 1.f;
  s.xtc = q > 0.f && xtc_uniform(rows.seed[r], rows.position[r], rows.iteration[r]) < static_cast<double>(q);
  return s;
}

__device__ __forceinline__ bool finite(float x) { return x > -kInf && x < kInf; }

// The block's chunk as the samplers see it: v[j][e] is token 4 (g0 + threadIdx.x + j kThreads) + e, -inf past the
// vocabulary. `removed_before`: an earlier kernel may have removed tokens of the row; without it the kept bits are
// all ones and not read. The kept bits are read after every group's logits, so that no load waits for another.
__device__ __forceinline__ void load_chunk(const Row& row, int chunk, float (&v)[kGroups][4], bool removed_before) {
  const int64_t g0 = chunk * kChunkGroups + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) load_group(row.x, g0 + j * kThreads, row.vocab, row.aligned, v[j]);
  if (!row.keep || !removed_before) return;
  uint32_t bits[kGroups];
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int64_t g = g0 + j * kThreads;
    bits[j] = 4 * g < row.vocab ? row.kept(g) : 0u;
  }
#pragma unroll
  for (int j = 0; j < kGroups; ++j) mask_group(bits[j], v[j]);
}

__device__ __forceinline__ int64_t token_of(int chunk, int j, int e) {
  return 4 * (chunk * kChunkGroups + threadIdx.x + j * kThreads) + e;
}

// Non-finite entries read as -inf (the statistics' view of the chunk).
__device__ __forceinline__ void sanitize_chunk(float (&v)[kGroups][4]) {
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) sanitize(v[j][e]);
}

// Removes the tokens of group j (of the block's chunk) whose bit e of `removed` is set. Called by every thread of
// the block together. Into x: -inf, one 16-byte store where the group lies whole in an aligned row (v: the group as
// stored, so that NaN and +inf are written back as they were). Into keep: the 8 groups of a word lie in 8 adjacent
// lanes, whose bits are merged and written by one lane: a plain store where the row's first cut writes its words
// (`first`: they are all ones yet), an atomic AND after an earlier cut.
__device__ __forceinline__ void store_removed(const Row& row, int chunk, int j, const float (&v)[4], uint32_t removed,
                                              bool first) {
  const int64_t i0 = token_of(chunk, j, 0);
  if (row.keep) {
    const uint32_t slot = threadIdx.x & 7;
    uint32_t bits = removed << (4 * slot);
    bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
    bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
    bits |= __shfl_xor_sync(0xffffffffu, bits, 4);
    if (slot == 0 && bits) {
      if (first) row.keep[i0 >> 5] = ~bits;
      else atomicAnd(row.keep + (i0 >> 5), ~bits);
    }
    return;
  }
  if (!removed) return;
  if (row.aligned && i0 + 4 <= row.vocab) {
    float4 q;
    q.x = removed & 1u ? -kInf : v[0];
    q.y = removed & 2u ? -kInf : v[1];
    q.z = removed & 4u ? -kInf : v[2];
    q.w = removed & 8u ? -kInf : v[3];
    *reinterpret_cast<float4*>(row.x + i0) = q;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (removed >> e & 1u) row.x[i0 + e] = -kInf;
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions in a fixed order. Block ones (common.cuh block_allreduce) give every thread the same value; a row's
// partials are merged by every warp in the same tree (lane l takes chunks l, l + 32, ... in order, then a butterfly
// in which both lanes of a pair merge (lower, upper)), so every thread of every block gets the same bits.

template <typename P, typename Merge>
__device__ __forceinline__ P warp_merge(P p, Merge merge) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const P other = P::shfl_xor(p, o);
    p = (lane & o) ? merge(other, p) : merge(p, other);
  }
  return p;
}

template <typename P, typename Merge>
__device__ __forceinline__ P merge_row(const P* parts, int chunks, Merge merge) {
  P acc = P::empty();
  for (int c = threadIdx.x & 31; c < chunks; c += 32) acc = merge(acc, P::load(parts + c));
  return warp_merge(acc, merge);
}

// Exclusive prefix sum of one value a thread, in thread order, and the block's total. scratch: kThreads / 32 values.
__device__ __forceinline__ uint64_t block_exclusive_scan(uint64_t v, uint64_t* scratch, uint64_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint64_t incl = warp_inclusive_scan(v, lane);
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  uint64_t before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += scratch[w];
    total += scratch[w];
  }
  return before + incl - v;
}

struct Scratch {  // the block reductions' shared memory, and words a block shares
  double d[kThreads / 32];
  uint64_t u64[kThreads / 32];
  float f[kThreads / 32];
  uint32_t u32[kThreads / 32];
  uint32_t word;
  int pick;
  float floor;  // XTC's candidates' floor, set by thread 0
};

// ---------------------------------------------------------------------------------------------
// L4 top-n-sigma: count, mean and sum of squared deviations of the finite logits (merged by Chan et al.'s update),
// and their max.

struct SigmaPart {
  double mean, m2;
  float max;
  uint32_t count;

  __device__ static SigmaPart empty() { return SigmaPart{0.0, 0.0, -kInf, 0u}; }
  __device__ static SigmaPart load(const SigmaPart* p) {
    return SigmaPart{__ldcg(&p->mean), __ldcg(&p->m2), __ldcg(&p->max), __ldcg(&p->count)};
  }
  __device__ static SigmaPart shfl_xor(const SigmaPart& p, int o) {
    return SigmaPart{__shfl_xor_sync(0xffffffffu, p.mean, o), __shfl_xor_sync(0xffffffffu, p.m2, o),
                     __shfl_xor_sync(0xffffffffu, p.max, o), __shfl_xor_sync(0xffffffffu, p.count, o)};
  }
};

struct MergeSigma {
  __device__ SigmaPart operator()(const SigmaPart& a, const SigmaPart& b) const {
    if (b.count == 0) return a;
    if (a.count == 0) return b;
    const double na = a.count, nb = b.count, n = na + nb, d = b.mean - a.mean;
    return SigmaPart{a.mean + d * (nb / n), a.m2 + b.m2 + d * d * (na * nb / n), fmaxf(a.max, b.max),
                     a.count + b.count};
  }
};

// The chunk's part (v sanitized): its mean first, then the squared deviations from it (both in float64).
__device__ SigmaPart sigma_part(const float (&v)[kGroups][4], Scratch& s) {
  uint32_t count = 0;
  double sum = 0.0;
  float mx = -kInf;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > -kInf) ++count, sum += v[j][e], mx = fmaxf(mx, v[j][e]);
  count = block_allreduce<kThreads>(count, SumOp{}, s.u32);
  if (count == 0) return SigmaPart::empty();
  sum = block_allreduce<kThreads>(sum, SumOp{}, s.d);
  mx = block_allreduce<kThreads>(mx, MaxOp{}, s.f);
  const double mean = sum / count;
  double m2 = 0.0;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > -kInf) {
        const double d = static_cast<double>(v[j][e]) - mean;
        m2 += d * d;
      }
  m2 = block_allreduce<kThreads>(m2, SumOp{}, s.d);
  return SigmaPart{mean, m2, mx, count};
}

// Tokens below this are removed: M - n sigma in float64, as the reference (-inf: none, a row without a finite logit).
__device__ __forceinline__ double sigma_cut(const SigmaPart& row, float n) {
  if (row.count == 0) return -HUGE_VAL;
  return static_cast<double>(row.max) - static_cast<double>(n) * sqrt(row.m2 / row.count);
}

// The least float32 f >= cut: a float32 x lies below the float64 cut exactly when x < f (no float32 lies in between),
// so the sampling kernels remove top-n-sigma's tokens with one float32 comparison (TsBitmask.floor).
__device__ __forceinline__ float floor_of(double cut) {
  const float f = __double2float_rn(cut);
  return static_cast<double>(f) < cut ? nextafterf(f, kInf) : f;
}

// ---------------------------------------------------------------------------------------------
// L5 typical-p: with d = x - m (m the part's max), s = sum e^d, t = sum e^d d, u = sum e^d d^2 over the finite
// logits, and their min. Over the row (m = M): log-sum-exp L = log s, -H = t / s - L, and the variance of the
// surprisal u / s - (t / s)^2.

struct TypicalPart {
  double s, t, u;
  float max, min;
  uint32_t count, unused;

  __device__ static TypicalPart empty() { return TypicalPart{0.0, 0.0, 0.0, -kInf, kInf, 0u, 0u}; }
  __device__ static TypicalPart load(const TypicalPart* p) {
    return TypicalPart{__ldcg(&p->s), __ldcg(&p->t), __ldcg(&p->u), __ldcg(&p->max), __ldcg(&p->min),
                       __ldcg(&p->count), 0u};
  }
  __device__ static TypicalPart shfl_xor(const TypicalPart& p, int o) {
    return TypicalPart{__shfl_xor_sync(0xffffffffu, p.s, o), __shfl_xor_sync(0xffffffffu, p.t, o),
                       __shfl_xor_sync(0xffffffffu, p.u, o), __shfl_xor_sync(0xffffffffu, p.max, o),
                       __shfl_xor_sync(0xffffffffu, p.min, o), __shfl_xor_sync(0xffffffffu, p.count, o), 0u};
  }
};

struct MergeTypical {
  __device__ TypicalPart operator()(const TypicalPart& a, const TypicalPart& b) const {
    if (b.count == 0) return a;
    if (a.count == 0) return b;
    const float m = fmaxf(a.max, b.max);
    const double da = static_cast<double>(a.max) - m, db = static_cast<double>(b.max) - m;
    const double ka = exp(da), kb = exp(db);
    return TypicalPart{a.s * ka + b.s * kb, (a.t + da * a.s) * ka + (b.t + db * b.s) * kb,
                       (a.u + 2.0 * da * a.t + da * da * a.s) * ka + (b.u + 2.0 * db * b.t + db * db * b.s) * kb, m,
                       fminf(a.min, b.min), a.count + b.count, 0u};
  }
};

__device__ TypicalPart typical_part(const float (&v)[kGroups][4], Scratch& s) {
  float mx = -kInf, mn = kInf;
  uint32_t count = 0;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > -kInf) ++count, mx = fmaxf(mx, v[j][e]), mn = fminf(mn, v[j][e]);
  count = block_allreduce<kThreads>(count, SumOp{}, s.u32);
  if (count == 0) return TypicalPart::empty();
  mx = block_allreduce<kThreads>(mx, MaxOp{}, s.f);
  mn = block_allreduce<kThreads>(mn, MinOp{}, s.f);
  double ss = 0.0, st = 0.0, su = 0.0;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > -kInf) {
        const double d = static_cast<double>(v[j][e]) - mx, w = exp(d);
        ss += w, st += w * d, su += w * d * d;
      }
  ss = block_allreduce<kThreads>(ss, SumOp{}, s.d);
  st = block_allreduce<kThreads>(st, SumOp{}, s.d);
  su = block_allreduce<kThreads>(su, SumOp{}, s.d);
  return TypicalPart{ss, st, su, mx, mn, count, 0u};
}

// What typical-p's passes compute a token from, the same in every block: log q = (x - M) - L and the score
// |log q - (-H)| in the reference's float64 operations, and the bin of the score. The bins are uniform in the score
// over [0, hi], the last one open-ended, hi the smaller of the row's spread and a Chebyshev bound on the cut's score:
// the mass at score >= k is at most Var / k^2, so from k = 1.01 sqrt(Var / (1 - p)) (2047/2048 of it: the last bin)
// on lies less than 0.99 (1 - p), and the cut comes before. With the bound (`bounded`), the last bin's tokens need
// no mass (no exp: on spiky rows, nearly all of them); should rounding leave the cut unfound before it, the last
// bin is the cut bin, cut exactly like any other.
struct TypicalRow {
  double max, logsum, neg_entropy, scale;
  uint64_t target;  // p in mass units: the cut is the first token whose cumulative mass exceeds it
  uint64_t before;  // the mass of the bins before the cut bin
  int32_t cut;      // the cut bin; -1: none (every token kept)
  uint32_t bounded;  // hi is the Chebyshev bound: the last bin's mass is not summed
  uint32_t finite;   // the row has a finite logit (without one, nothing is cut)

  __device__ double log_q(float x) const { return (static_cast<double>(x) - max) - logsum; }
  __device__ double score(double lq) const { return fabs(lq - neg_entropy); }
  __device__ int bin(double score) const {
    return scale > 0.0 ? static_cast<int>(fmin(score * scale, static_cast<double>(kBins - 1))) : 0;
  }
  // A score as an order-preserving key (scores are >= +0).
  __device__ static uint64_t key(double score) { return static_cast<uint64_t>(__double_as_longlong(score)); }
  __device__ static uint64_t mass(double lq) { return __double2ull_rn(exp(lq) * kMassScale); }

  __device__ static TypicalRow load(const TypicalRow* p) {
    return TypicalRow{__ldcg(&p->max), __ldcg(&p->logsum), __ldcg(&p->neg_entropy), __ldcg(&p->scale),
                      __ldcg(reinterpret_cast<const unsigned long long*>(&p->target)),
                      __ldcg(reinterpret_cast<const unsigned long long*>(&p->before)), __ldcg(&p->cut),
                      __ldcg(&p->bounded), __ldcg(&p->finite)};
  }
};

// The row's constants from its merged parts.
__device__ TypicalRow typical_row(const TypicalPart& row, float p) {
  TypicalRow c{};
  c.cut = -1;
  if (row.count == 0) return c;
  c.finite = 1;
  c.max = row.max;
  c.logsum = log(row.s);
  const double mean = row.t / row.s, second = row.u / row.s;
  c.neg_entropy = mean - c.logsum;
  // The variance, with room for the cancellation of its two terms.
  const double variance = fmax(second - mean * mean, 0.0) + 0x1p-40 * second;
  const double span = static_cast<double>(row.max) - static_cast<double>(row.min);
  const double bound = 1.01 * sqrt(variance / (1.0 - static_cast<double>(p)));
  const double hi = fmin(span, bound);
  c.bounded = bound < span;
  const double scale = kBins / hi;
  c.scale = hi > 0.0 && isfinite(scale) ? scale : 0.0;
  c.target = static_cast<uint64_t>(static_cast<double>(p) * kMassScale);
  return c;
}

// ---------------------------------------------------------------------------------------------
// L6 XTC: the chunk's max m and s = sum e^(x - m) over the finite logits, and its candidates: every token that can
// have q >= t over the row. The row's sum is at least e^(m - M) s, so such a token has e^(x - m) >= t s; listed with
// room for rounding, a chunk lists at most about 1 / t of them (kXtcCap: more make the row's last block re-read
// the chunk).
//
// s is summed from float32 terms. A float64 exp a token had made the kernel bound by float64 throughput (an H200's
// statistics pass took 174 us at B = 256, V = 151936, against 56 us for top-n-sigma's), and expf's accurate form then
// by instruction issue (106 us); __expf and one float32 comparison a token cut the instructions by about half
// (docs/design/kernel-routing.md). The sum's relative error is below kXtcSumError: __expf(d) is within
// (2 + 1.173 |d|) ulp (2^-23), 77 ulp for |d| <= 64; the float32 difference d = x - m within 2^-24 |d|, 2^-18 for
// |d| <= 64 (the terms of e^-64 and less, 8192 at most, weigh under 2^-79 against the chunk's max term, 1); and the
// sums of a thread's 32 terms within 31 x 2^-24: 1.5e-5 in all. The row's last block takes a candidate's side of t
// from these sums only where it is certain within that error, and otherwise sums the row again in float64
// (xtc_finish), so the kept set is the float64 one.
constexpr double kXtcSumError = 0x1p-15;

struct XtcPart {
  double s;
  float max;
  uint32_t listed;  // candidates found (more than kXtcCap: not all listed)

  __device__ static XtcPart empty() { return XtcPart{0.0, -kInf, 0u}; }
  __device__ static XtcPart load(const XtcPart* p) {
    return XtcPart{__ldcg(&p->s), __ldcg(&p->max), __ldcg(&p->listed)};
  }
  __device__ static XtcPart shfl_xor(const XtcPart& p, int o) {
    return XtcPart{__shfl_xor_sync(0xffffffffu, p.s, o), __shfl_xor_sync(0xffffffffu, p.max, o),
                   __shfl_xor_sync(0xffffffffu, p.listed, o)};
  }
};

struct MergeXtc {
  __device__ XtcPart operator()(const XtcPart& a, const XtcPart& b) const {
    if (b.max == -kInf) return a;
    if (a.max == -kInf) return b;
    const float m = fmaxf(a.max, b.max);
    return XtcPart{a.s * exp(static_cast<double>(a.max) - m) + b.s * exp(static_cast<double>(b.max) - m), m,
                   a.listed + b.listed};
  }
};

struct XtcCandidate {
  float x;
  uint32_t id;
};

// Writes the chunk's part and candidates (v sanitized, the logits left by the samplers before).
__device__ void xtc_part(const float (&v)[kGroups][4], int chunk, float t, XtcPart* part, XtcCandidate* listed,
                         Scratch& s) {
  uint32_t& found = s.word;
  float mx = -kInf;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx = fmaxf(mx, v[j][e]);
  mx = block_allreduce<kThreads>(mx, MaxOp{}, s.f);
  if (mx == -kInf) {
    if (threadIdx.x == 0) *part = XtcPart::empty();
    return;
  }
  float mine = 0.f;  // float32 terms and sums, -inf tokens adding e^-inf = 0: within kXtcSumError (see there)
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine += __expf(v[j][e] - mx);
  const double sum = block_allreduce<kThreads>(static_cast<double>(mine), SumOp{}, s.d);
  if (threadIdx.x == 0) {
    // The chunk's true sum is at least sum / (1 + kXtcSumError): the floor is lowered by that much more
    // (kXtcSumError >= log1p(kXtcSumError)). A float32 x lies at or above it exactly when x >= floor_of(it); never
    // -inf, so that -inf tokens are not listed.
    const double log_ts = log(static_cast<double>(t) * sum) - kXtcSumError;
    const double floor = mx + log_ts - 0x1p-30 * (1.0 + fabs(static_cast<double>(mx)) + fabs(log_ts));
    s.floor = fmaxf(floor_of(floor), -FLT_MAX);
    found = 0;
  }
  __syncthreads();
  const float floor = s.floor;
  uint32_t listing = 0;  // bit 4 j + e: v[j][e] is a candidate
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) listing |= static_cast<uint32_t>(v[j][e] >= floor) << (4 * j + e);
  if (listing) {  // rare: about 1 / t tokens a row
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (listing >> (4 * j + e) & 1u) {
          const uint32_t at = atomicAdd(&found, 1u);
          if (at < kXtcCap) listed[at] = XtcCandidate{v[j][e], static_cast<uint32_t>(token_of(chunk, j, e))};
        }
  }
  __syncthreads();
  if (threadIdx.x == 0) *part = XtcPart{sum, mx, found};
}

// The row's listed candidates, gathered into the finishing block's shared memory once: every chunk's list read by its
// own thread, so that xtc_finish's three passes do not walk the chunks one after another (a chain of dependent L2
// reads that cost ~40 us a row at V = 151936 on an H200, a pass each). Order does not matter: the passes count, take
// a min and a max, and remove.
constexpr int kXtcGathered = 2048;

struct XtcRowCandidates {
  XtcCandidate at[kXtcGathered];
  uint32_t n;
  uint32_t spilled;  // a chunk listed more than kXtcCap, or the row more than kXtcGathered: read from the chunks
};

__device__ void gather_xtc_candidates(const XtcPart* parts, const XtcCandidate* listed, int chunks,
                                      XtcRowCandidates& g) {
  if (threadIdx.x == 0) g.n = 0, g.spilled = 0;
  __syncthreads();
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const uint32_t n = __ldcg(&parts[c].listed);
    if (n > kXtcCap) {
      g.spilled = 1;
      continue;
    }
    if (n == 0) continue;
    const uint32_t first = atomicAdd(&g.n, n);
    for (uint32_t i = 0; i < n && first + i < kXtcGathered; ++i) {
      const XtcCandidate* at = listed + static_cast<int64_t>(c) * kXtcCap + i;
      g.at[first + i] = XtcCandidate{__ldcg(&at->x), __ldcg(&at->id)};
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && g.n > kXtcGathered) g.spilled = 1;
  __syncthreads();
}

// Calls fn(x, id) for every candidate of the row, spread over the block's threads: from the gathered candidates, or
// when they spilled, from the chunks' lists (a chunk whose list overflowed, re-read whole).
template <typename Fn>
__device__ void for_each_xtc_candidate(const Row& row, const XtcPart* parts, const XtcCandidate* listed, int chunks,
                                       const XtcRowCandidates& g, Fn&& fn) {
  if (!g.spilled) {
    for (uint32_t i = threadIdx.x; i < g.n; i += kThreads) fn(g.at[i].x, g.at[i].id);
    return;
  }
  for (int c = 0; c < chunks; ++c) {
    const uint32_t n = __ldcg(&parts[c].listed);
    if (n <= kXtcCap) {
      for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
        const XtcCandidate* at = listed + static_cast<int64_t>(c) * kXtcCap + i;
        fn(__ldcg(&at->x), __ldcg(&at->id));
      }
    } else {
      for (int j = 0; j < kGroups; ++j) {
        float v[4];
        const int64_t g4 = c * kChunkGroups + threadIdx.x + j * kThreads;
        row.load_fresh(g4, v);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (finite(v[e])) fn(v[e], static_cast<uint32_t>(4 * g4 + e));
      }
    }
  }
}

// sum e^(x - top) over the finite logits the row has left, in float64, by the whole block.
__device__ double row_sum(const Row& row, double top, Scratch& s) {
  double sum = 0.0;
  const int64_t groups = (row.vocab + 3) / 4;
  for (int64_t g = threadIdx.x; g < groups; g += kThreads) {
    float v[4];
    row.load_fresh(g, v);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (finite(v[e])) sum += exp(static_cast<double>(v[e]) - top);
  }
  return block_allreduce<kThreads>(sum, SumOp{}, s.d);
}

// XTC on a row whose coin came up, by one block once every chunk's part is written: A = {i : q_i >= t}, q the
// softmax of what L4 and L5 left, in float64 as the reference (exp(x - M) / sum; the merged sum where it decides
// every candidate's side of t within kXtcSumError, else the row summed again); with |A| >= 2 every token of A is
// removed but the least likely (the lowest q, the highest id among equal ones).
__device__ void xtc_finish(const Row& row, const XtcPart* parts, const XtcCandidate* listed, int chunks, float t,
                           Scratch& s) {
  const XtcPart all = merge_row(parts, chunks, MergeXtc{});
  if (all.max == -kInf) return;
  __shared__ XtcRowCandidates gathered;
  gather_xtc_candidates(parts, listed, chunks, gathered);
  const double top = all.max, threshold = t;
  double total = all.s;
  bool unsure = false;  // a candidate's q within the sum's error of t
  for_each_xtc_candidate(row, parts, listed, chunks, gathered, [&](float x, uint32_t) {
    const double w = exp(static_cast<double>(x) - top);
    unsure |= w >= threshold * total * (1.0 - kXtcSumError) && w < threshold * total * (1.0 + kXtcSumError);
  });
  if (__syncthreads_or(unsure)) total = row_sum(row, top, s);
  auto prob = [&](float x) { return exp(static_cast<double>(x) - top) / total; };
  uint32_t count = 0;
  double least = HUGE_VAL;
  for_each_xtc_candidate(row, parts, listed, chunks, gathered, [&](float x, uint32_t) {
    const double q = prob(x);
    if (q >= threshold) ++count, least = fmin(least, q);
  });
  count = block_allreduce<kThreads>(count, SumOp{}, s.u32);
  if (count < 2) return;
  least = block_allreduce<kThreads>(least, MinOp{}, s.d);
  uint32_t kept = 0;
  for_each_xtc_candidate(row, parts, listed, chunks, gathered, [&](float x, uint32_t id) {
    if (prob(x) == least) kept = max(kept, id);
  });
  kept = block_allreduce<kThreads>(kept, MaxOp{}, s.u32);
  for_each_xtc_candidate(row, parts, listed, chunks, gathered, [&](float x, uint32_t id) {
    if (id != kept && prob(x) >= threshold) row.remove(id);
  });
}

// ---------------------------------------------------------------------------------------------
// The workspace of a launch over B rows of C chunks.

struct Workspace {
  SigmaPart* sigma;        // [B, C]
  TypicalPart* typical;    // [B, C]
  XtcPart* xtc;            // [B, C]
  XtcCandidate* listed;    // [B, C, kXtcCap]
  TypicalRow* rows;        // [B]
  uint32_t* cut_ids;       // [B, cut_capacity(V)]
  // zeroed
  unsigned int* counters;  // [B]: the last block of a row
  uint32_t* cut_count;     // [B]: tokens of the cut bin
  unsigned long long* hist;  // [B, kBins]: typical-p's mass by bin
};

__host__ __device__ inline size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

__host__ __device__ inline Workspace workspace_at(void* scratch, void* zeroed, int64_t rows, int64_t vocab) {
  const size_t parts = static_cast<size_t>(rows) * num_chunks(vocab);
  char* p = static_cast<char*>(scratch);
  Workspace w;
  w.sigma = reinterpret_cast<SigmaPart*>(p);
  p += align_up(parts * sizeof(SigmaPart));
  w.typical = reinterpret_cast<TypicalPart*>(p);
  p += align_up(parts * sizeof(TypicalPart));
  w.xtc = reinterpret_cast<XtcPart*>(p);
  p += align_up(parts * sizeof(XtcPart));
  w.listed = reinterpret_cast<XtcCandidate*>(p);
  p += align_up(parts * kXtcCap * sizeof(XtcCandidate));
  w.rows = reinterpret_cast<TypicalRow*>(p);
  p += align_up(rows * sizeof(TypicalRow));
  w.cut_ids = reinterpret_cast<uint32_t*>(p);
  char* z = static_cast<char*>(zeroed);
  w.counters = reinterpret_cast<unsigned int*>(z);
  z += align_up(rows * sizeof(unsigned int));
  w.cut_count = reinterpret_cast<uint32_t*>(z);
  z += align_up(rows * sizeof(uint32_t));
  w.hist = reinterpret_cast<unsigned long long*>(z);
  return w;
}

__host__ __device__ inline TsLocalWorkspaceBytes workspace_bytes(int64_t rows, int64_t vocab) {
  const size_t parts = static_cast<size_t>(rows) * num_chunks(vocab);
  const size_t scratch = align_up(parts * sizeof(SigmaPart)) + align_up(parts * sizeof(TypicalPart)) +
                         align_up(parts * sizeof(XtcPart)) + align_up(parts * kXtcCap * sizeof(XtcCandidate)) +
                         align_up(rows * sizeof(TypicalRow)) +
                         static_cast<size_t>(rows * cut_capacity(vocab)) * sizeof(uint32_t);
  const size_t zeroed = 2 * align_up(rows * sizeof(uint32_t)) + static_cast<size_t>(rows) * kBins * sizeof(uint64_t);
  return TsLocalWorkspaceBytes{scratch, zeroed};
}

// The statistics of `stage` over the chunk v (sanitized, the logits left so far), written as the chunk's part; the
// row's last block merges typical-p's into the row's constants once (rather than every block of the next kernel:
// that merge, float64 exps in every warp, was a quarter of typical_hist_kernel's instructions), and decides XTC's.
enum class Stage { kNone, kTypical, kXtc };

__device__ void stage_stats(Stage stage, const float (&v)[kGroups][4], const Row& row, int64_t r, int chunk,
                            int chunks, const Samplers& smp, const Workspace& ws, Scratch& s) {
  const int64_t at = r * chunks + chunk;
  if (stage == Stage::kTypical) {
    const TypicalPart part = typical_part(v, s);
    if (threadIdx.x == 0) ws.typical[at] = part;
    if (finish_and_elect_last(ws.counters + r, chunks) && threadIdx.x < 32) {
      const TypicalRow c = typical_row(merge_row(ws.typical + r * chunks, chunks, MergeTypical{}), smp.p);
      if (threadIdx.x == 0) ws.rows[r] = c;
    }
  } else if (stage == Stage::kXtc) {
    xtc_part(v, chunk, smp.t, ws.xtc + at, ws.listed + at * kXtcCap, s);
    if (finish_and_elect_last(ws.counters + r, chunks))
      xtc_finish(row, ws.xtc + r * chunks, ws.listed + r * chunks * kXtcCap, chunks, smp.t, s);
  }
}

// ---------------------------------------------------------------------------------------------
// The kernels (grid: chunks x rows, kThreads threads).

// A block's place in that grid: row r, and its chunk among the row's chunks.
struct ChunkPlace {
  int64_t r;
  int chunk, chunks;
};

__device__ __forceinline__ ChunkPlace chunk_place() {
  return ChunkPlace{blockIdx.y, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)};
}

// kAfterTypical false: the statistics of the row's first sampler (top-n-sigma's, typical-p's or XTC's, then XTC
// decided). true: XTC's after typical-p. Four blocks an SM (64 registers, some spilled in the rows' finishing paths):
// XTC's statistics took 74.5 us at B = 256 on an H200, against 82.8 us at three blocks an SM (80 registers).
template <bool kAfterTypical, bool kKeep>
__global__ void __launch_bounds__(kThreads, 4)
stats_kernel(float* logits, uint32_t* keep, int64_t vocab, TsLocalRows rows, Workspace ws) {
  __shared__ Scratch s;
  const auto [r, chunk, chunks] = chunk_place();
  const Samplers smp = row_samplers(rows, r);
  const Row row = Row::of(logits, kKeep ? keep : nullptr, r, vocab);
  float v[kGroups][4];
  if (kAfterTypical) {
    if (!(smp.typical && smp.xtc)) return;
    load_chunk(row, chunk, v, true);  // after typical-p's cut
    sanitize_chunk(v);
    stage_stats(Stage::kXtc, v, row, r, chunk, chunks, smp, ws, s);
    return;
  }
  if (!(smp.sigma || smp.typical || smp.xtc)) return;
  load_chunk(row, chunk, v, false);  // the row's first sampler: nothing removed yet
  sanitize_chunk(v);
  if (smp.sigma) {
    const SigmaPart part = sigma_part(v, s);
    if (threadIdx.x == 0) ws.sigma[r * chunks + chunk] = part;
    return;
  }
  stage_stats(smp.typical ? Stage::kTypical : Stage::kXtc, v, row, r, chunk, chunks, smp, ws, s);
}

// top-n-sigma's cut written, then the next sampler's statistics over the tokens it keeps.
template <bool kKeep>
__global__ void __launch_bounds__(kThreads)
sigma_kernel(float* logits, uint32_t* keep, int64_t vocab, TsLocalRows rows, Workspace ws) {
  __shared__ Scratch s;
  const auto [r, chunk, chunks] = chunk_place();
  const Samplers smp = row_samplers(rows, r);
  if (!smp.sigma) return;
  const Row row = Row::of(logits, kKeep ? keep : nullptr, r, vocab);
  const double cut = sigma_cut(merge_row(ws.sigma + r * chunks, chunks, MergeSigma{}), smp.n);
  float v[kGroups][4];
  load_chunk(row, chunk, v, false);  // top-n-sigma is the first sampler to cut
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    uint32_t removed = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (finite(v[j][e]) && static_cast<double>(v[j][e]) < cut) removed |= 1u << e;
    store_removed(row, chunk, j, v[j], removed, true);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (removed >> e & 1u) v[j][e] = -kInf;
  }
  sanitize_chunk(v);
  stage_stats(smp.typical ? Stage::kTypical : smp.xtc ? Stage::kXtc : Stage::kNone, v, row, r, chunk, chunks, smp,
              ws, s);
}

// Top-n-sigma as the call's only local sampler: the chunk's statistics, and the row's last block writes its cut as the
// row's floor (floor_of; -inf where the sampler is off), for the sampling kernels to apply as they read the logits.
// One read of the logits instead of sigma_kernel's second.
__global__ void __launch_bounds__(kThreads)
sigma_floor_kernel(const float* logits, float* floor, int64_t vocab, TsLocalRows rows, Workspace ws) {
  __shared__ Scratch s;
  const auto [r, chunk, chunks] = chunk_place();
  const float n = rows.top_n_sigma[r];
  if (!(n > 0.f)) {
    if (chunk == 0 && threadIdx.x == 0) floor[r] = -kInf;
    return;
  }
  const Row row = Row::of(const_cast<float*>(logits), nullptr, r, vocab);  // only read: nothing is removed here
  float v[kGroups][4];
  load_chunk(row, chunk, v, false);
  sanitize_chunk(v);
  const SigmaPart part = sigma_part(v, s);
  if (threadIdx.x == 0) ws.sigma[r * chunks + chunk] = part;
  if (finish_and_elect_last(ws.counters + r, chunks) && threadIdx.x < 32) {
    const float f = floor_of(sigma_cut(merge_row(ws.sigma + r * chunks, chunks, MergeSigma{}), n));
    if (threadIdx.x == 0) floor[r] = f;
  }
}

// typical-p's mass by score bin (fixed point, the last bin a register sum a thread); the row's last block finds the
// cut bin (the first whose cumulative mass exceeds p) and returns the row's bins to zero.
template <bool kKeep>
__global__ void __launch_bounds__(kThreads)
typical_hist_kernel(float* logits, uint32_t* keep, int64_t vocab, TsLocalRows rows, Workspace ws) {
  __shared__ Scratch s;
  __shared__ unsigned long long hist[kBins];
  __shared__ int cut;
  const auto [r, chunk, chunks] = chunk_place();
  const Samplers smp = row_samplers(rows, r);
  if (!smp.typical) return;
  TypicalRow c = TypicalRow::load(ws.rows + r);
  if (!c.finite) return;  // nothing to cut: the row's constants say so (cut -1)
  const Row row = Row::of(logits, kKeep ? keep : nullptr, r, vocab);
  for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0;
  __syncthreads();
  float v[kGroups][4];
  load_chunk(row, chunk, v, smp.sigma);
  sanitize_chunk(v);
  unsigned long long last = 0;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > -kInf) {
        const double lq = c.log_q(v[j][e]);
        const int b = c.bin(c.score(lq));
        if (b == kBins - 1) {
          if (!c.bounded) last += TypicalRow::mass(lq);
        } else if (const unsigned long long m = TypicalRow::mass(lq)) {
          atomicAdd(hist + b, m);
        }
      }
  last = block_allreduce<kThreads>(static_cast<uint64_t>(last), SumOp{}, s.u64);
  if (threadIdx.x == 0) hist[kBins - 1] += last;
  __syncthreads();
  unsigned long long* row_hist = ws.hist + r * kBins;
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (hist[b]) atomicAdd(row_hist + b, hist[b]);
  if (!finish_and_elect_last(ws.counters + r, chunks)) return;
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    hist[b] = __ldcg(row_hist + b);
    row_hist[b] = 0;
  }
  if (threadIdx.x == 0) cut = -1;
  block_inclusive_scan<kThreads>(reinterpret_cast<uint64_t*>(hist), kBins, s.u64);
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (hist[b] > c.target && (b == 0 || hist[b - 1] <= c.target)) cut = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    c.cut = cut < 0 && c.bounded ? kBins - 1 : cut;
    c.before = c.cut > 0 ? hist[c.cut - 1] : 0;
    ws.rows[r] = c;
  }
}

// Sorts pairs (key, id) of shared memory ascending, n a power of two, by the whole block (bitonic).
__device__ void sort_pairs(uint64_t* keys, uint32_t* ids, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < (n >> 1); i += kThreads) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        const bool greater = keys[lo] > keys[hi] || (keys[lo] == keys[hi] && ids[lo] > ids[hi]);
        if (greater == ascending) {
          const uint64_t k = keys[lo];
          keys[lo] = keys[hi], keys[hi] = k;
          const uint32_t d = ids[lo];
          ids[lo] = ids[hi], ids[hi] = d;
        }
      }
    }
  }
  __syncthreads();
}

// The cut in the cut bin from its n <= kCutCap tokens (ids): sorted by (score, id), their masses summed in that
// order from the bins' before; every token after the first whose sum exceeds the target is removed.
__device__ void cut_listed(const Row& row, const TypicalRow& c, const uint32_t* cut_ids, uint32_t n, uint64_t* keys,
                           uint32_t* ids, Scratch& s) {
  const int padded = static_cast<int>(next_pow2(n));
  for (int i = threadIdx.x; i < padded; i += kThreads) {
    if (i < static_cast<int>(n)) {
      const uint32_t id = __ldcg(cut_ids + i);
      ids[i] = id;
      keys[i] = TypicalRow::key(c.score(c.log_q(__ldcg(row.x + id))));
    } else {
      ids[i] = UINT_MAX, keys[i] = ~0ull;
    }
  }
  sort_pairs(keys, ids, padded);
  for (int i = threadIdx.x; i < static_cast<int>(n); i += kThreads)
    keys[i] = TypicalRow::mass(c.log_q(__ldcg(row.x + ids[i])));
  block_inclusive_scan<kThreads>(keys, static_cast<int>(n), s.u64);
  uint32_t first = n - 1;  // the bins' sums say one exists; kept whole otherwise
  for (int i = threadIdx.x; i < static_cast<int>(n); i += kThreads)
    if (c.before + keys[i] > c.target) first = min(first, static_cast<uint32_t>(i));
  first = block_allreduce<kThreads>(first, MinOp{}, s.u32);
  for (uint32_t i = first + 1 + threadIdx.x; i < n; i += kThreads) row.remove(ids[i]);
}

// fn(key, id, log q) for every finite token of the cut bin, the row read whole by the block.
template <typename Fn>
__device__ void for_each_in_cut_bin(const Row& row, const TypicalRow& c, Fn&& fn) {
  const int64_t groups = (row.vocab + 3) / 4;
  for (int64_t g = threadIdx.x; g < groups; g += kThreads) {
    float v[4];
    row.load_fresh(g, v);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!finite(v[e])) continue;
      const double lq = c.log_q(v[e]), score = c.score(lq);
      if (c.bin(score) == c.cut) fn(TypicalRow::key(score), static_cast<uint32_t>(4 * g + e), lq);
    }
  }
}

// The cut in a cut bin of more than kCutCap tokens (equal or near-equal logits, or a row squeezed into few bins),
// by the row's last block reading the row: radix passes over the score keys (kSubBins sub-bins of count and mass a
// pass, the key range shrinking 2^11-fold) until at most kCutCap tokens remain, which are sorted as cut_listed
// does; or, when they all share one score, the cut among them by id, in id order. Then the tokens of the bin after
// the cut are removed. Not inlined: it runs on crowded rows only, and keeps its registers out of the kernel's pass.
__device__ __noinline__ void cut_crowded(const Row& row, const TypicalRow& c, uint64_t* keys, uint32_t* ids,
                                         Scratch& s) {
  uint64_t lo = ~0ull, hi = 0;
  for_each_in_cut_bin(row, c, [&](uint64_t key, uint32_t, double) { lo = min(lo, key), hi = max(hi, key); });
  lo = block_allreduce<kThreads>(lo, MinOp{}, s.u64);
  hi = block_allreduce<kThreads>(hi, MaxOp{}, s.u64);
  uint64_t before = c.before;
  uint32_t n = UINT_MAX;
  uint32_t* sub_count = ids;
  unsigned long long* sub_mass = reinterpret_cast<unsigned long long*>(keys);
  while (n > kCutCap && lo < hi) {
    int shift = 0;
    while (((hi - lo) >> shift) >= static_cast<uint64_t>(kSubBins)) ++shift;
    __syncthreads();
    for (int b = threadIdx.x; b < kSubBins; b += kThreads) sub_count[b] = 0, sub_mass[b] = 0;
    __syncthreads();
    for_each_in_cut_bin(row, c, [&](uint64_t key, uint32_t, double lq) {
      if (key < lo || key > hi) return;
      const int b = static_cast<int>((key - lo) >> shift);
      atomicAdd(sub_count + b, 1u);
      atomicAdd(sub_mass + b, static_cast<unsigned long long>(TypicalRow::mass(lq)));
    });
    block_inclusive_scan<kThreads>(sub_count, kSubBins, s.u32);
    block_inclusive_scan<kThreads>(reinterpret_cast<uint64_t*>(sub_mass), kSubBins, s.u64);
    if (threadIdx.x == 0) s.pick = kSubBins - 1;
    __syncthreads();
    for (int b = threadIdx.x; b < kSubBins; b += kThreads)
      if (before + sub_mass[b] > c.target && (b == 0 || before + sub_mass[b - 1] <= c.target)) s.pick = b;
    __syncthreads();
    const int b = s.pick;
    n = sub_count[b] - (b ? sub_count[b - 1] : 0);
    before += b ? sub_mass[b - 1] : 0;
    const uint64_t first = lo + (static_cast<uint64_t>(b) << shift);
    hi = min(hi, first + ((uint64_t{1} << shift) - 1));
    lo = first;
  }
  uint64_t cut_key = lo;
  uint32_t cut_id = UINT_MAX;
  if (n <= kCutCap) {
    const int padded = static_cast<int>(next_pow2(n));
    __syncthreads();
    for (int i = threadIdx.x; i < padded; i += kThreads) keys[i] = ~0ull, ids[i] = UINT_MAX;
    if (threadIdx.x == 0) s.word = 0;
    __syncthreads();
    for_each_in_cut_bin(row, c, [&](uint64_t key, uint32_t id, double) {
      if (key < lo || key > hi) return;
      const uint32_t at = atomicAdd(&s.word, 1u);
      if (at < n) keys[at] = key, ids[at] = id;
    });
    sort_pairs(keys, ids, padded);
    for (int i = threadIdx.x; i < static_cast<int>(n); i += kThreads)
      keys[i] = TypicalRow::mass(c.log_q(__ldcg(row.x + ids[i])));
    block_inclusive_scan<kThreads>(keys, static_cast<int>(n), s.u64);
    uint32_t first = n - 1;
    for (int i = threadIdx.x; i < static_cast<int>(n); i += kThreads)
      if (before + keys[i] > c.target) first = min(first, static_cast<uint32_t>(i));
    first = block_allreduce<kThreads>(first, MinOp{}, s.u32);
    // The sort's keys are spent: the cut token's key again from its logit.
    cut_id = ids[first];
    cut_key = TypicalRow::key(c.score(c.log_q(__ldcg(row.x + cut_id))));
  } else {
    // Every remaining token has the score lo: they follow in id order. A tile of kThreads groups at a time, each
    // thread's four tokens in order, until the cumulative mass exceeds the target.
    const int64_t groups = (row.vocab + 3) / 4;
    for (int64_t g0 = 0; g0 < groups && cut_id == UINT_MAX; g0 += kThreads) {
      const int64_t g = g0 + threadIdx.x;
      float v[4];
      uint64_t m[4] = {0, 0, 0, 0}, mine = 0;
      if (g < groups) {
        row.load_fresh(g, v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!finite(v[e])) continue;
          const double lq = c.log_q(v[e]), score = c.score(lq);
          if (c.bin(score) == c.cut && TypicalRow::key(score) == lo) m[e] = TypicalRow::mass(lq), mine += m[e];
        }
      }
      uint64_t total;
      uint64_t run = before + block_exclusive_scan(mine, s.u64, total);
      uint32_t found = UINT_MAX;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        run += m[e];
        if (m[e] && run > c.target && found == UINT_MAX) found = static_cast<uint32_t>(4 * g + e);
      }
      cut_id = block_allreduce<kThreads>(found, MinOp{}, s.u32);
      before += total;
    }
  }
  // Every token of the bin after (cut_key, cut_id) is removed (none when no cut was found: kept whole).
  for_each_in_cut_bin(row, c, [&](uint64_t key, uint32_t id, double) {
    if (key > cut_key || (key == cut_key && id > cut_id)) row.remove(id);
  });
}

// typical-p's cut written: bins after the cut bin removed by every block, the cut bin's tokens listed; the row's
// last block cuts the cut bin.
template <bool kKeep>
__global__ void __launch_bounds__(kThreads)
typical_cut_kernel(float* logits, uint32_t* keep, int64_t vocab, TsLocalRows rows, Workspace ws) {
  extern __shared__ uint64_t cut_smem[];
  __shared__ Scratch s;
  const auto [r, chunk, chunks] = chunk_place();
  const Samplers smp = row_samplers(rows, r);
  if (!smp.typical) return;
  const TypicalRow c = TypicalRow::load(ws.rows + r);
  if (c.cut < 0) return;  // every token kept (no finite logit, or the cut is past them all)
  const Row row = Row::of(logits, kKeep ? keep : nullptr, r, vocab);
  float v[kGroups][4];
  load_chunk(row, chunk, v, smp.sigma);
  uint32_t in_cut = 0;  // bit 4j + e: token (j, e) lies in the cut bin
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    uint32_t removed = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!finite(v[j][e])) continue;
      const int b = c.bin(c.score(c.log_q(v[j][e])));
      if (b > c.cut) removed |= 1u << e;
      else if (b == c.cut) in_cut |= 1u << (4 * j + e);
    }
    store_removed(row, chunk, j, v[j], removed, !smp.sigma);
  }
  // The cut bin's ids, appended to the row's list: one reservation a block.
  uint64_t total;
  const uint32_t at = static_cast<uint32_t>(block_exclusive_scan(__popc(in_cut), s.u64, total));
  if (threadIdx.x == 0 && total) s.word = atomicAdd(ws.cut_count + r, static_cast<uint32_t>(total));
  __syncthreads();
  const uint32_t block_base = s.word;
  const int64_t capacity = cut_capacity(vocab);
  uint32_t* cut_ids = ws.cut_ids + r * capacity;
  for (uint32_t bits = in_cut, k = at; bits; bits &= bits - 1, ++k) {
    const int i = __ffs(bits) - 1;
    if (block_base + k < capacity) cut_ids[block_base + k] = static_cast<uint32_t>(token_of(chunk, i >> 2, i & 3));
  }
  if (!finish_and_elect_last(ws.counters + r, chunks)) return;
  const uint32_t n = __ldcg(ws.cut_count + r);
  __syncthreads();
  if (threadIdx.x == 0) ws.cut_count[r] = 0;
  uint64_t* keys = cut_smem;
  uint32_t* ids = reinterpret_cast<uint32_t*>(cut_smem + kCutCap);
  if (n <= capacity) cut_listed(row, c, cut_ids, n, keys, ids, s);
  else cut_crowded(row, c, keys, ids, s);
}

}  // namespace local
}  // namespace tokensampler
