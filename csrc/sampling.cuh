// The logits-path sampling kernels as framework-free device templates (launchers: sampling.cu).
//
// Rows are cut into fixed chunks of kChunk tokens, one block each, so the number of blocks per row
// depends on the vocabulary alone: every reduction runs in the same order whatever the batch, which
// keeps results batch-invariant. The last block of a row (self-resetting counter) merges the
// chunks' partial results in chunk order. Token order everywhere is (value desc, id asc), encoded
// as one 64-bit rank key (common.cuh). Semantics: docs/semantics.md.
#pragma once
#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "philox.cuh"
#include "sampling.h"

namespace tokensampler {

constexpr int kThreads = 256;
constexpr int kGroupsPerThread = 8;
constexpr int kChunkGroups = kThreads * kGroupsPerThread;
constexpr int64_t kChunk = 4 * kChunkGroups;  // 8192 tokens per block

__host__ __device__ inline int num_splits(int64_t vocab) {
  return static_cast<int>((vocab + kChunk - 1) / kChunk);
}

template <typename T>
struct RowView {
  const T* row;
  int64_t r;
  bool aligned;
  RowCut cut;  // the row's allowed-token words or floor (row_cut); none outside the masked instances
};

// Row r starting at `row`, and whether its groups of four can be loaded 16 bytes at a time.
template <typename T>
__device__ __forceinline__ RowView<T> view_of_row(const T* row, int64_t r, RowCut cut = RowCut{0}) {
  return {row, r, reinterpret_cast<uintptr_t>(row) % (4 * sizeof(T)) == 0, cut};
}

// Logits row r: contiguous rows, or rows gathered by TsLogits.row_start.
template <typename T>
__device__ __forceinline__ RowView<T> logits_row(const TsLogits& logits, int64_t r, RowCut cut = RowCut{0}) {
  const int64_t start = logits.row_start ? logits.row_start[r] : r * logits.vocab;
  return view_of_row(static_cast<const T*>(logits.data) + start, r, cut);
}

// The row work row w samples (TsRows.rows, or row w itself). kMask: with its token bitmask and floor, so that every
// load through the view reads the tokens they remove as -inf and the kernel samples the masked row. Each kernel
// has an instance with and one without (the launcher picks by TsRows.bitmask): a batch without masks runs
// the kernels as they were, with no register for a mask (the 48-register kernels spilled 4-20 bytes with a
// run-time test).
template <typename T, bool kMask>
__device__ __forceinline__ RowView<T> row_view(const TsLogits& logits, const TsRows& rows, int w) {
  const int64_t r = rows.rows ? rows.rows[w] : w;
  return logits_row<T>(logits, r, kMask ? row_cut(rows.bitmask, r) : RowCut{0});
}

// Group g of the row, as load_group reads it, with the row's mask and floor.
template <typename T>
__device__ __forceinline__ void load_row_group(const RowView<T>& rv, int64_t g, int64_t vocab, float (&v)[4]) {
  load_group(rv.row, g, vocab, rv.aligned, v, false, rv.cut.words());
  floor_group(rv.cut.floor_or_none(), v);
}

// A launch whose rows hold more bytes than this cannot keep them in L2 (50 MB on H100 / H200) until a later
// read, so the one-read kernels mark their chunk loads evict-first there: greedy, Gumbel and min-p ran
// 5-8 % faster at 155 MB (docs/design/logits-kernels.md). Smaller launches keep normal loads, so
// that the second kernel of a two-pass route can find their rows in L2 (not settled: the one A/B at
// B = 1-32 was confounded by two-valued timings). The top-k, frontier and workload kernels other than the
// row pass gained nothing and keep normal loads (the flag cost them registers).
constexpr int64_t kEvictFirstBytes = int64_t{64} << 20;

template <typename T>
__device__ __forceinline__ bool rows_exceed_l2(int64_t rows, int64_t vocab) {
  return rows * vocab * static_cast<int64_t>(sizeof(T)) > kEvictFirstBytes;
}

// The allowed bits of this lane's groups g_first + lane + j kStride, j < kGroups (bit 4j + e: token
// 4 (g_first + lane + j kStride) + e), g_first warp-uniform. The warp's 32 groups of one j lie in 4 consecutive
// words when g_first is a multiple of 8 (kWordAligned), in 5 otherwise: each lane loads one of the 32 / kGroups
// words read for its j = lane / (32 / kGroups), and the lanes exchange them. One load and one register a thread,
// where a word a group kept in flight beside the logits spilled (topk_kernel: 4-20 bytes; filter_kernel's screen:
// 88). The whole warp calls it.
template <int kGroups, int kStride, bool kWordAligned>
__device__ __forceinline__ uint32_t warp_groups_mask_bits(const uint32_t* mask, int64_t vocab, int64_t g_first) {
  constexpr int kLanesPerJ = 32 / kGroups;
  static_assert(kGroups * 4 <= 32 && kLanesPerJ >= (kWordAligned ? 4 : 5) && kStride % 8 == 0,
                "a j's words within its lanes, a lane's bits in one word");
  const int lane = threadIdx.x & 31;
  const int offset = kWordAligned ? 0 : static_cast<int>(g_first & 7);
  const int64_t word = ((g_first + static_cast<int64_t>(lane / kLanesPerJ) * kStride) >> 3) + lane % kLanesPerJ;
  const uint32_t mine = 32 * word < vocab ? __ldg(mask + word) : 0u;  // past the vocabulary: no word to read
  const int from = (offset + lane) >> 3, shift = 4 * ((offset + lane) & 7);
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
    bits |= ((__shfl_sync(0xffffffffu, mine, j * kLanesPerJ + from) >> shift) & 0xFu) << (4 * j);
  return bits;
}

// Bit 4j + e set where v[j][e] is not below `floor` (kGroups <= 8).
template <int kGroups>
__device__ __forceinline__ uint32_t floor_bits(const float (&v)[kGroups][4], float floor) {
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) bits |= static_cast<uint32_t>(!(v[j][e] < floor)) << (4 * j + e);
  return bits;
}

// This block's chunk as stored (NaN and +inf not yet sanitized): v[j][e] is token
// 4 * (g0 + threadIdx.x + j * kThreads) + e.
template <typename T>
__device__ __forceinline__ void load_chunk_raw(const RowView<T>& rv, int64_t vocab, int64_t g0,
                                               float (&v)[kGroupsPerThread][4], bool evict_first = false) {
  // Every chunk of an aligned fp32 row but its last loads with no bounds test a group (~2 instructions a token
  // of every kernel's main path). Not for 2-byte types: there the second copy of the loads spilled in topk_kernel.
  if (sizeof(T) == 4 && rv.aligned && 4 * (g0 + kChunkGroups) <= vocab) {
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
      load_whole_group(rv.row, g0 + threadIdx.x + j * kThreads, v[j], evict_first);
  } else {
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
      load_group(rv.row, g0 + threadIdx.x + j * kThreads, vocab, rv.aligned, v[j], evict_first);
  }
  if (rv.cut.bits != 0) {
    // The floor as the bits a mask would give (set: kept), so that both take one path.
    const uint32_t bits =
        rv.cut.has_floor()
            ? floor_bits(v, rv.cut.floor())
            : warp_groups_mask_bits<kGroupsPerThread, kThreads, true>(rv.cut.words(), vocab, g0 + (threadIdx.x & ~31u));
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j) mask_group(bits >> (4 * j), v[j]);
  }
}

// Returns whether any value was NaN or +inf.
__device__ __forceinline__ bool sanitize_chunk(float (&v)[kGroupsPerThread][4]) {
  bool nan = false;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) nan |= sanitize(v[j][e]);
  return nan;
}

// This block's chunk, sanitized.
template <typename T>
__device__ __forceinline__ bool load_chunk(const RowView<T>& rv, int64_t vocab, int64_t g0,
                                           float (&v)[kGroupsPerThread][4], bool evict_first = false) {
  load_chunk_raw(rv, vocab, g0, v, evict_first);
  return sanitize_chunk(v);
}

__device__ __forceinline__ int64_t token_of(int64_t g0, int j, int e) {
  return 4 * (g0 + threadIdx.x + j * kThreads) + e;
}

// z = (x - max) / T exactly as the reference evaluates it (two correctly rounded operations).
__device__ __forceinline__ float scaled(float x, float row_max, float temperature) {
  return __fdiv_rn(__fsub_rn(x, row_max), temperature);
}

// The score Gumbel-max ranks: z + g, correctly rounded, as a rank key.
template <typename Noise>
__device__ __forceinline__ uint64_t gumbel_key(float z, uint32_t id, const Noise& noise) {
  return rank_key(__fadd_rn(z, gumbel_exact(noise.word(id))), id);
}

__device__ __forceinline__ NoiseStream row_noise(const TsRows& rows, int64_t r, uint32_t sample) {
  return NoiseStream::make(rows.seed[r], rows.position[r], rows.iteration[r], sample);
}

// ---------------------------------------------------------------------------------------------
// Row statistics: max (with the lowest argmax), min of the finite values, nan flag, and optionally
// log sum exp(c * (x - max)). With out.tokens it is the greedy sampler.

struct Stats {
  float max, min, sum;
  int32_t argmax;
  uint32_t nan;
};

__device__ __forceinline__ Stats merge_stats(Stats a, const Stats& b, float c, bool lse) {
  const float m = fmaxf(a.max, b.max);
  if (lse) a.sum = m == -kInf ? 0.f : a.sum * expf((a.max - m) * c) + b.sum * expf((b.max - m) * c);
  if (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) a.argmax = b.argmax;
  a.max = m;
  a.min = fminf(a.min, b.min);
  a.nan |= b.nan;
  return a;
}

__device__ __forceinline__ Stats shfl_stats(const Stats& s, int o) {
  return Stats{__shfl_xor_sync(0xffffffffu, s.max, o), __shfl_xor_sync(0xffffffffu, s.min, o),
               __shfl_xor_sync(0xffffffffu, s.sum, o), __shfl_xor_sync(0xffffffffu, s.argmax, o),
               __shfl_xor_sync(0xffffffffu, s.nan, o)};
}

// A thread's share of the row stats from its part of the chunk: max with the lowest argmax (ids
// ascend with j and e), min of the finite values.
__device__ __forceinline__ void chunk_stats(const float (&v)[kGroupsPerThread][4], int64_t g0, Stats& s) {
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = v[j][e];
      if (x > s.max) {
        s.max = x;
        s.argmax = static_cast<int32_t>(token_of(g0, j, e));
      }
      if (x > -kInf) s.min = fminf(s.min, x);
    }
}

__device__ __forceinline__ Stats no_stats() { return Stats{-kInf, kInf, 0.f, INT_MAX, 0u}; }

// Every lane of a warp gets the merge of the warp's stats (a butterfly, fixed order).
__device__ __forceinline__ Stats warp_stats_allmerge(Stats s, float c, bool lse) {
#pragma unroll
  for (int o = 16; o; o >>= 1) s = merge_stats(s, shfl_stats(s, o), c, lse);
  return s;
}

// The block's stats in thread 0 (warp 0 merges the warps' stats across its lanes rather than thread 0
// one by one: the diffusion row pass lost ~10 us to that chain, docs/design/logits-kernels.md);
// one barrier, which every thread reaches.
__device__ __forceinline__ Stats block_stats(Stats s, float c, bool lse) {
  s = warp_stats_allmerge(s, c, lse);
  __shared__ Stats warp_stats[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_stats[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x < 32)
    s = warp_stats_allmerge(threadIdx.x < kThreads / 32 ? warp_stats[threadIdx.x] : no_stats(), c, lse);
  return s;
}

// Bits of the stats flags beyond stats_kernel's 1 (nan) and 2 (not valid), set by the kernels that run before the
// filter on its rows: stats_kernel for rows no fast kernel flagged (ts_stats_flagged), the frontier kernels
// (nucleus.cuh).
constexpr uint8_t kRowDecided = 8;     // the token is written: filter_kernel skips the row
constexpr uint8_t kRowNeedsMass = 16;  // top-p: nucleus_mass_kernel decides the row
constexpr uint8_t kRowNeedsExact = 32;  // top-p: nucleus_exact_mass_kernel decides the row
constexpr uint8_t kRowFlaggedExact = 4;  // a fast kernel's flag: the row needs the exact filter

// only_flagged (NULL: every row): the rows whose flag there lacks kRowFlaggedExact are decided already; all of a
// row's blocks leave at once (its counter untouched) and the first marks it kRowDecided for the filter after.
template <typename T, bool kMask>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(TsLogits logits, TsRows rows, const float* lse_scale, const uint8_t* only_flagged, TsOutputs out,
                 TsWorkspace ws) {
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  let_next_grid_launch();  // the exact filter after it may take the SMs this grid's last wave leaves idle
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  if (only_flagged && !(only_flagged[rv.r] & kRowFlaggedExact)) {
    if (split == 0 && threadIdx.x == 0) out.flags[rv.r] = kRowDecided;
    return;
  }
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  const bool lse = lse_scale != nullptr;
  const float c = lse ? lse_scale[rv.r] : 0.f;

  float v[kGroupsPerThread][4];
  Stats s = no_stats();
  s.nan = load_chunk(rv, logits.vocab, g0, v, rows_exceed_l2<T>(rows.num_work_rows, logits.vocab));
  chunk_stats(v, g0, s);
  if (lse && s.max > -kInf) {
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s.sum += expf((v[j][e] - s.max) * c);
  }
  s = block_stats(s, c, lse);
  Stats* partial = static_cast<Stats*>(ws.scratch) + static_cast<int64_t>(w) * splits;
  if (threadIdx.x == 0) partial[split] = s;
  if (!finish_and_elect_last(ws.counters + w, splits) || threadIdx.x >= 32) return;

  // warp 0: each lane merges the partials lane, lane + 32, ... in order, then the lanes merge
  Stats row = no_stats();
  for (int i = threadIdx.x; i < splits; i += 32) {
    const Stats* p = partial + i;
    const Stats b{__ldcg(&p->max), __ldcg(&p->min), __ldcg(&p->sum), __ldcg(&p->argmax), __ldcg(&p->nan)};
    row = merge_stats(row, b, c, lse);
  }
  row = warp_stats_allmerge(row, c, lse);
  if (threadIdx.x != 0) return;
  const bool valid = row.max > -kInf;
  if (out.row_max) out.row_max[rv.r] = row.max;
  if (out.row_min) out.row_min[rv.r] = row.min;
  if (out.row_logz && lse) out.row_logz[rv.r] = logf(row.sum);
  if (out.flags) out.flags[rv.r] = static_cast<uint8_t>((row.nan ? TS_ROW_NAN : 0) | (valid ? 0 : TS_ROW_INVALID));
  if (out.tokens)
    for (int i = 0; i < out.num_samples; ++i)
      out.tokens[rv.r * out.num_samples + i] = valid ? row.argmax : -1;
}

// ---------------------------------------------------------------------------------------------
// Gumbel-max over the whole vocabulary in one read. z = (x - max) / T needs the row max, known only
// at the end, so blocks rank tokens by the proxy P = x / T + g_fast (a pure function of the token)
// and keep the best and the second best P. The winner by P is the winner by the exact score
// (z + g_exact) whenever the gap to the second exceeds the proxy's error bound; otherwise the last
// block re-scores the row exactly (counted in ws.fallback_count).

struct Proxy {
  float p1, p2;
  int32_t i1;
};

__device__ __forceinline__ Proxy merge_proxy(Proxy a, const Proxy& b) {
  if (b.p1 > a.p1 || (b.p1 == a.p1 && b.i1 < a.i1)) {
    a.p2 = fmaxf(b.p2, a.p1);
    a.p1 = b.p1;
    a.i1 = b.i1;
  } else {
    a.p2 = fmaxf(a.p2, b.p1);
  }
  return a;
}

// The proxy of the lane `o` away (xor) in the warp.
__device__ __forceinline__ Proxy shfl_xor_proxy(const Proxy& p, int o) {
  return Proxy{__shfl_xor_sync(0xffffffffu, p.p1, o), __shfl_xor_sync(0xffffffffu, p.p2, o),
               __shfl_xor_sync(0xffffffffu, p.i1, o)};
}

// Proxy, max and (LSE) sum of exp(c (x - max)) merged across lanes xor kFirst, kFirst / 2, ..., 1: a
// butterfly in a fixed order, every lane ending with the merge of its group of 2 kFirst lanes.
template <bool LSE, int kFirst>
__device__ __forceinline__ void butterfly_merge_gumbel(Proxy& px, float& mx, float& sum, float c) {
#pragma unroll
  for (int o = kFirst; o; o >>= 1) {
    px = merge_proxy(px, shfl_xor_proxy(px, o));
    const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
    if (LSE) {
      const float s2 = __shfl_xor_sync(0xffffffffu, sum, o);
      const float m = fmaxf(mx, m2);
      sum = m == -kInf ? 0.f : sum * expf((mx - m) * c) + s2 * expf((m2 - m) * c);
    }
    mx = fmaxf(mx, m2);
  }
}

struct GumbelPartial {
  Proxy proxy;
  float max, sum;
  uint32_t nan;
};

// Bound on |(f_i - f_j) - (P_i - P_j)| for the tokens that can win (|z| <= 21, |g| <= 17.4):
// fp32 rounding of x / T, of the sums, and the error of g_fast, with a factor 2 to spare.
__device__ __forceinline__ float proxy_margin(float row_max, float inv_t) {
  return 0x1p-20f * (fabsf(row_max) * inv_t + 64.f) + 4.f * kGumbelFastError;
}

// Screening of the LSE-free kernel (docs/design/logits-kernels.md, "The Gumbel screen"). Each block first scores
// every thread's pilot in full, the group of four holding the thread's largest logit; L, the
// block's best proxy among them, is a real token's proxy, so the block's best proxy is >= L (and L
// is about the chunk's max + its noise, which on spiky rows rules out nearly every other group).
// With thr = L - delta (delta above the gap test's margin), a token whose proxy is below thr can
// neither win nor be the runner-up that the gap test needs: p2 = max(p2, thr) is reported, and such
// tokens need no g_fast at all.
// screen_word gives, for a group whose largest logit is gx, a Philox word threshold below which no
// token of the group can reach thr:
//   n = thr - gx / T - slack (slack: 2e-4 + 2^-19 (|thr| + |gx / T|) covers g_fast's error < 1e-5 and
//   every fp32 rounding of P, gx / T and n), k = floor(n log2 e - 1e-3) clamped to [0, 31], so
//   k ln 2 < n. A word w with ~w >= 2^(32 - k) has b = w >> 8 <= 2^24 - 2^(24 - k) - 1, hence
//   1 - u > 2^-k, -log(u) >= 1 - u > 2^-k and g = -log(-log(u)) < k ln 2 < n (for k >= 25 any
//   word: g < 25 ln 2). So only w >= ~(0xFFFFFFFF >> k) can pass; k = 0 keeps every word, and a
//   threshold >= kNoWordPasses (k >= 25) rules the group out before any Philox word is drawn.
constexpr uint32_t kNoWordPasses = ~(0xFFFFFFFFu >> 25);

__device__ __forceinline__ uint32_t screen_word(float gx, float inv_t, float a) {
  const float gxs = fmaxf(gx * inv_t, -0x1p30f);  // -inf groups: a huge n, nothing passes
  const float n = fmaf(-0x1p-19f, fabsf(gxs), a - gxs);
  const int k = min(max(__float2int_rd(fmaf(n, 1.44269504f, -1e-3f)), 0), 31);  // NaN -> 0: keep all
  return ~(0xFFFFFFFFu >> k);
}

// min-p keeps a token when expf(z) >= m (docs/semantics.md); the argmax (z = 0) always.
__device__ __forceinline__ bool passes_min_p(float z, float m) { return m <= 0.f || expf(z) >= m; }

// min-p alone as a mask on the logits, once the row max is known (gumbel_kernel<T, false, true>, after
// stats_kernel): kept tokens keep their logit, the others become -inf, so Gumbel-max over the masked
// row is the min-p sample. The test is x against two floors around M + T log m, which decide every
// token whose z is clear of log m by delta; the tokens between them get the exact test. The screen
// needs a token's masked logit only where it computes its proxy (pilot and re-done groups); the other
// groups need only a bound of their kept logits (group_bound).
// Why delta = 2^-18 (1 + |M| / T + |log m|) suffices: logf, the rounding of keep (one fma), of x - M
// and of the division move z by less than 2^-21 (|M| / T + |log m| + delta), so x >= keep gives
// z >= log m + 2^-18 and x < drop gives z <= log m - 2^-18, far beyond expf's 2 ulp (2^-22).
// Floors that do not come out finite leave every token to the exact test.
struct MinPMask {
  float keep, drop;  // x >= keep: kept; x < drop: dropped; between them: the exact test
  float row_max, temperature, m;

  // Out of line: the band is rare, and its division and expf would crowd the screen's registers.
  __device__ __noinline__ bool exact_keeps(float x) const {
    return passes_min_p(scaled(x, row_max, temperature), m);
  }
  __device__ __forceinline__ void apply(float& x, uint32_t) const {
    if (x < keep && (x < drop || !exact_keeps(x))) x = -kInf;
  }
  // A bound on the kept logits of a group whose largest logit is gx (-inf: the group keeps none).
  __device__ __forceinline__ float group_bound(float gx) const { return gx >= drop ? gx : -kInf; }
};

// No filter: gumbel_kernel's plain instance.
struct NoMask {
  __device__ __forceinline__ void apply(float&, uint32_t) const {}
  __device__ __forceinline__ float group_bound(float gx) const { return gx; }
};

// A kept set given by its last token's rank key (filter_kernel<T, kMask, true>: any k, top-p and min-p): token id
// is kept when rank_key(z, id) >= key. As MinPMask, two floors around M + T z_key decide every token whose z is
// clear of z_key by delta (the same bound: the roundings of the floor, of x - M and of the division move z by less
// than 2^-21 (|M| / T + |z_key| + delta)); the tokens between them get the exact test, which breaks ties by id.
// kNothingKept: the row has no finite logit, or its cut found no token (flag 4).
constexpr uint64_t kNothingKept = ~0ull;
struct CutMask {
  float keep, drop;
  float row_max, temperature;
  uint64_t key;

  __device__ __noinline__ bool exact_keeps(float x, uint32_t id) const {
    return rank_key(scaled(x, row_max, temperature), id) >= key;
  }
  __device__ __forceinline__ void apply(float& x, uint32_t id) const {
    if (x < keep && (x < drop || !exact_keeps(x, id))) x = -kInf;
  }
  __device__ __forceinline__ float group_bound(float gx) const { return gx >= drop ? gx : -kInf; }
};

// The two floors of a mask around z = z0 (MinPMask, CutMask): x >= keep has z clear above z0, x < drop clear below;
// floors that do not come out finite leave every token to the exact test.
template <typename Mask>
__device__ __forceinline__ void set_floors(Mask& mask, float row_max, float temperature, float z0) {
  const float delta = 0x1p-18f * (1.f + fabsf(row_max) / temperature + fabsf(z0));
  mask.keep = fmaf(temperature, z0 + delta, row_max);
  mask.drop = fmaf(temperature, z0 - delta, row_max);
  if (!(fabsf(mask.keep) < kInf && fabsf(mask.drop) < kInf)) mask.keep = kInf, mask.drop = -kInf;
}

__device__ __forceinline__ CutMask cut_mask(float row_max, float temperature, uint64_t key) {
  CutMask c{kInf, kInf, row_max, temperature, key};  // nothing to keep
  if (!(row_max > -kInf) || key == kNothingKept) return c;
  set_floors(c, row_max, temperature, key_value(key));
  return c;
}

__device__ __forceinline__ MinPMask min_p_mask(float row_max, float temperature, float m) {
  MinPMask k{kInf, kInf, row_max, temperature, m};  // no finite logit: nothing to keep
  if (!(row_max > -kInf)) return k;
  if (!(m > 0.f)) {  // min-p off: keep every finite logit
    k.keep = k.drop = -kInf;
    return k;
  }
  set_floors(k, row_max, temperature, logf(m));
  return k;
}

__device__ __forceinline__ void proxy_update(Proxy& px, float p, uint32_t id) {
  const bool better = p > px.p1;
  px.p2 = better ? px.p1 : fmaxf(px.p2, p);
  px.i1 = better ? static_cast<int32_t>(id) : px.i1;
  px.p1 = better ? p : px.p1;
}

__device__ __forceinline__ float max_of_group(const float (&x)[4]) {
  return fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
}

// The screen's cut from a bound L, a real token's proxy of the row (|L| < 2^20): a token whose proxy
// is below thr can neither win nor be the runner-up that the gap test needs; a: screen_word's argument.
struct ScreenCut {
  float thr, a;
};
__device__ __forceinline__ ScreenCut screen_cut(float L) {
  const float thr = L - (0x1p-18f * (fabsf(L) + 64.f) + 1e-4f);
  return {thr, fmaf(-0x1p-19f, fabsf(thr), thr - 2e-4f)};
}

// Scores the tokens of group g whose Philox words reach th (0: all of them).
__device__ __forceinline__ void score_passing_words(Proxy& px, const float (&x)[4], const uint4& words, uint32_t g,
                                                    float inv_t, uint32_t th) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t word = word_of(words, e);
    if (word >= th) proxy_update(px, fmaf(x[e], inv_t, gumbel_fast(word)), 4 * g + e);
  }
}

// A thread's pilot: its group with the largest logit (the first on ties). gx: each group's largest
// logit; x: the pilot's four logits, picked by selects (no run-time register indexing); pilot_max:
// the thread's largest logit.
__device__ __forceinline__ int pick_pilot(const float (&v)[kGroupsPerThread][4], float (&gx)[kGroupsPerThread],
                                          float (&x)[4], float& pilot_max) {
  int pilot = 0;
  pilot_max = -kInf;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j) {
    gx[j] = max_of_group(v[j]);
    if (gx[j] > pilot_max) pilot_max = gx[j], pilot = j;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = v[0][e];
#pragma unroll
  for (int j = 1; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = j == pilot ? v[j][e] : x[e];
  return pilot;
}

// The screen's word pass over a thread's non-pilot groups (slot i is group i + (i >= pilot)): bit j
// of the result is set when some Philox word of group j reaches th of its slot. need: the slots
// whose th < kNoWordPasses. When most slots of the warp need words (flat rows) their Philox chains
// run unconditionally and interleaved; otherwise only the slots some lane needs,
// warp by warp (spiky rows: few).
template <int kSlots, typename Noise>
__device__ __forceinline__ uint32_t groups_with_passing_words(const uint32_t (&th)[kSlots], uint32_t need, int pilot,
                                                              uint32_t gbase, const Noise& noise) {
  const uint32_t warp_need = __reduce_or_sync(0xffffffffu, need);
  uint32_t gmask = 0;
  if (__popc(warp_need) > kSlots / 2) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int j = i + (i >= pilot);
      const uint4 w = noise.group(gbase + j * kThreads);
      if (max(max(w.x, w.y), max(w.z, w.w)) >= th[i]) gmask |= 1u << j;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (!(warp_need >> i & 1u)) continue;  // warp-uniform
      const int j = i + (i >= pilot);
      const uint4 w = noise.group(gbase + j * kThreads);
      if ((need >> i & 1u) && max(max(w.x, w.y), max(w.z, w.w)) >= th[i]) gmask |= 1u << j;
    }
  }
  return gmask;
}

// Hands each group j of gmask (bit j: group gbase + j * kThreads) to redo(x, words, g), its four
// logits re-read from L1/L2 and sanitized (a run-time j cannot index the chunk's registers).
template <typename T, typename Noise, typename Redo>
__device__ __forceinline__ void redo_groups(uint32_t gmask, uint32_t gbase, const RowView<T>& rv, int64_t vocab,
                                            const Noise& noise, Redo redo) {
  while (gmask) {
    const int j = __ffs(gmask) - 1;
    gmask &= gmask - 1;
    const uint32_t g = gbase + j * kThreads;
    float x[4];
    load_row_group(rv, g, vocab, x);
#pragma unroll
    for (int e = 0; e < 4; ++e) sanitize(x[e]);
    redo(x, noise.group(g), g);
  }
}

// The screen's second half (gumbel_screened, frontier_candidates): a word threshold per non-pilot
// group from its largest logit (word_threshold; kNoWordPasses or more: no word can pass), the groups
// where some Philox word passes, and for each of those its four sanitized logits (re-read from
// L1/L2) and its words, handed to redo(x, words, g).
template <typename T, typename Noise, typename WordThreshold, typename Redo>
__device__ __forceinline__ void redo_screened_groups(const float (&gx)[kGroupsPerThread], int pilot, uint32_t gbase,
                                                     const RowView<T>& rv, int64_t vocab, const Noise& noise,
                                                     WordThreshold word_threshold, Redo redo) {
  constexpr int kSlots = kGroupsPerThread - 1;
  uint32_t th[kSlots];
  uint32_t need = 0;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    th[i] = word_threshold(i >= pilot ? gx[i + 1] : gx[i]);
    if (th[i] < kNoWordPasses) need |= 1u << i;
  }
  redo_groups(groups_with_passing_words(th, need, pilot, gbase, noise), gbase, rv, vocab, noise, redo);
}

// A row's screening bound shared by its blocks through `slot` (order keys of L; the row's last block
// zeroes it). Two ways to use it, by the grid's order:
// - posted: the slot as loaded with this block's chunk (-inf if none; no round trip of its own); the
//   block then posts its L with a reduction nothing waits for. Suits rows that vary fastest in the
//   grid: a row's first blocks have posted by the time its later ones load.
// - exchange: the block posts its L with a returning atomicMax and takes the larger value (a round
//   trip after the pilot). Suits chunks that vary fastest: a row's blocks run side by side.
struct RowBound {
  unsigned int* slot = nullptr;
  float posted = -kInf;
  bool exchange = false;
};

// The block stage of the LSE-free kernel: px holds every token whose proxy may reach thr, and
// p2 >= thr (no thr when the screen is off: all tokens scored).
// rb (optional): the row's shared bound. Any block's L is a real token's proxy of the row, so the
// largest L the row's other blocks have posted is a valid L here too (the screen's strength then
// depends on timing, never the result); a warp whose logits cannot reach the posted L skips its pilot.
// A thread's other seven groups sit in slots 0..6 (slot i is group i + (i >= pilot)). A slot needs
// its Philox words only where the logits leave some word able to pass (th < kNoWordPasses). When
// most slots of a warp need them (flat rows), the words of all seven are computed unconditionally
// and interleaved; otherwise only the slots some lane needs, warp by warp (spiky rows: few). Either
// way only a per-group "some word passes" bit is kept; the rare groups with a bit set are re-done
// afterwards (Philox again, the four logits re-read from L1/L2).
// v: the block's chunk as load_chunk gives it (a caller that has read it for other statistics
// passes its registers; the chunk is not read again). mask (min-p alone): applied to each token the
// screen scores (the pilot's, the re-done groups'); the other groups are bounded by group_bound.
template <typename T, typename Mask = NoMask>
__device__ __forceinline__ void gumbel_screened(const float (&v)[kGroupsPerThread][4], const RowView<T>& rv,
                                                int64_t vocab, int64_t g0, float inv_t, const NoiseStream& noise,
                                                Proxy& px, float& mx, RowBound rb = {},
                                                const Mask& mask = Mask{}) {
  const uint32_t gbase = static_cast<uint32_t>(g0) + threadIdx.x;
  float gx[kGroupsPerThread];
  float x[4];
  float pilot_max;
  const int pilot = pick_pilot(v, gx, x, pilot_max);
  mx = fmaxf(mx, pilot_max);
#pragma unroll
  for (int e = 0; e < 4; ++e) mask.apply(x[e], 4 * (gbase + pilot * kThreads) + e);
  // g < 25 ln 2 < 18: a warp whose largest logit cannot reach the posted L needs no pilot.
  if (!(rb.posted > -kInf) ||
      warp_allreduce(pilot_max, MaxOp{}) * inv_t + 18.f >= rb.posted - 0x1p-16f * fabsf(rb.posted)) {
    // the pilot scored in full
    const uint32_t g = gbase + pilot * kThreads;
    score_passing_words(px, x, noise.group(g), g, inv_t, 0u);
  }
  __shared__ float pilot_best[kThreads / 32];
  float L = warp_allreduce(px.p1, MaxOp{});
  if ((threadIdx.x & 31) == 0) pilot_best[threadIdx.x >> 5] = L;
  __syncthreads();
  L = pilot_best[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) L = fmaxf(L, pilot_best[i]);
  L = fmaxf(L, rb.posted);
  if (rb.slot && fabsf(L) < 0x1p20f) {
    if (rb.exchange) {
      uint32_t seen = 0;
      if ((threadIdx.x & 31) == 0) seen = atomicMax(rb.slot, order_key(L));
      seen = __shfl_sync(0xffffffffu, seen, 0);
      if (seen) L = fmaxf(L, key_to_float(seen));
    } else if (threadIdx.x == 0) {
      atomicMax(rb.slot, order_key(L));  // the result is not waited for
    }
  }
  const bool screen = fabsf(L) < 0x1p20f;  // finite and far from overflow; else score everything
  const ScreenCut cut = screen_cut(L);
  redo_screened_groups(
      gx, pilot, gbase, rv, vocab, noise,
      [&](float gmax) {
        const float g = mask.group_bound(gmax);
        return screen ? screen_word(g, inv_t, cut.a) : (g > -kInf ? 0u : ~0u);
      },
      [&](float (&x)[4], const uint4& words, uint32_t g) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mask.apply(x[e], 4 * g + e);
        score_passing_words(px, x, words, g, inv_t, screen ? screen_word(max_of_group(x), inv_t, cut.a) : 0u);
      });
  if (screen) px.p2 = fmaxf(px.p2, cut.thr);  // tokens the screen skipped have proxies below thr
}

// The screen when the row's bound L (a real token's proxy, |L| < 2^20) is known before the chunk is
// read, as rows that vary fastest find it posted by their earlier blocks: no pilot and no block
// barrier, every group screened against L. A warp none of whose threads' largest logits
// (thread_max) can reach thr, as most warps of a spiky row, draws no Philox word at all; the other
// warps draw the words of the groups that need them and re-do the groups where one passes, as
// gumbel_screened does.
template <typename T>
__device__ __forceinline__ void gumbel_screened_by_bound(const float (&v)[kGroupsPerThread][4], const RowView<T>& rv,
                                                         int64_t vocab, int64_t g0, float inv_t,
                                                         const NoiseStream& noise, float thread_max, float L,
                                                         Proxy& px) {
  const ScreenCut cut = screen_cut(L);
  if (__any_sync(0xffffffffu, screen_word(thread_max, inv_t, cut.a) < kNoWordPasses)) {
    const uint32_t gbase = static_cast<uint32_t>(g0) + threadIdx.x;
    uint32_t th[kGroupsPerThread];
    uint32_t need = 0;
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j) {
      th[j] = screen_word(max_of_group(v[j]), inv_t, cut.a);
      if (th[j] < kNoWordPasses) need |= 1u << j;
    }
    redo_groups(groups_with_passing_words(th, need, kGroupsPerThread, gbase, noise), gbase, rv, vocab, noise,
                [&](float (&x)[4], const uint4& words, uint32_t g) {
                  score_passing_words(px, x, words, g, inv_t, screen_word(max_of_group(x), inv_t, cut.a));
                });
  }
  px.p2 = fmaxf(px.p2, cut.thr);
}

// Which mask gumbel_kernel puts on its rows. Either mask comes after another kernel on the same rows (launched to
// overlap its tail: the chunk is read first, then the mask is made from that kernel's results).
enum RowMaskKind : int {
  kNoRowMask = 0,
  kMinPRowMask = 1,  // min-p alone, after stats_kernel (stats_row_max: its row max): MinPMask
  kCutRowMask = 2    // the kept set of filter_kernel<T, kMask, true> (cut_keys), after it: CutMask
};

template <typename T, bool kMask, bool LSE, int kRowMask>
__global__ void __launch_bounds__(kThreads, LSE || kRowMask != kNoRowMask ? 4 : 5)
    gumbel_kernel(TsLogits logits, TsRows rows, const float* lse_scale, const float* stats_row_max,
                  const int64_t* cut_keys, TsOutputs out, TsWorkspace ws) {
  static_assert(!(LSE && kRowMask != kNoRowMask), "the masked instances have no log-sum-exp");
  using RowMask = std::conditional_t<kRowMask == kCutRowMask, CutMask, MinPMask>;
  // A masked instance takes the rows in reverse order: its first blocks read the rows the kernel before read last,
  // from L2.
  const int w = kRowMask != kNoRowMask ? gridDim.y - 1 - blockIdx.y : blockIdx.y, split = blockIdx.x,
            splits = gridDim.x;
  // blockIdx.z draws sample out.sample + z: every (sample, row) has its own partials and counter.
  const int sample = out.sample + static_cast<int>(blockIdx.z);
  const int64_t slot = static_cast<int64_t>(blockIdx.z) * rows.num_work_rows + w;
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  const float temperature = rows.temperature[rv.r];
  const float inv_t = 1.f / temperature;
  const float c = LSE ? lse_scale[rv.r] : 0.f;
  const NoiseStream noise = row_noise(rows, rv.r, static_cast<uint32_t>(sample));
  const bool evict_first = rows_exceed_l2<T>(rows.num_work_rows, logits.vocab);

  Proxy px{-kInf, -kInf, INT_MAX};
  float mx = -kInf, sum = 0.f;
  bool nan;
  __shared__ RowMask row_mask;  // in shared memory: its few uses reload it rather than hold its registers
  if constexpr (kRowMask != kNoRowMask) {
    float v[kGroupsPerThread][4];
    nan = load_chunk(rv, logits.vocab, g0, v, evict_first);
    wait_for_previous_grid();  // the kernel before has written what the mask is made of, and is done with the workspace
    if (threadIdx.x == 0) {
      if constexpr (kRowMask == kCutRowMask)
        row_mask = cut_mask(stats_row_max[rv.r], temperature, static_cast<uint64_t>(cut_keys[rv.r]));
      else
        row_mask = min_p_mask(stats_row_max[rv.r], temperature, rows.min_p[rv.r]);
    }
    __syncthreads();
    gumbel_screened(v, rv, logits.vocab, g0, inv_t, noise, px, mx, RowBound{}, row_mask);
  } else if constexpr (!LSE) {
    float v[kGroupsPerThread][4];
    nan = load_chunk(rv, logits.vocab, g0, v, evict_first);
    gumbel_screened(v, rv, logits.vocab, g0, inv_t, noise, px, mx);
  } else {
    float v[kGroupsPerThread][4];
    nan = load_chunk(rv, logits.vocab, g0, v, evict_first);
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j) {
      const uint32_t g = static_cast<uint32_t>(g0) + threadIdx.x + j * kThreads;
      const uint4 words = noise.group(g);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mx = fmaxf(mx, v[j][e]);
        proxy_update(px, fmaf(v[j][e], inv_t, gumbel_fast(word_of(words, e))), 4 * g + e);
      }
    }
    if (mx > -kInf) {
#pragma unroll
      for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sum += expf((v[j][e] - mx) * c);
    }
  }
  butterfly_merge_gumbel<LSE, 16>(px, mx, sum, c);
  const bool any_nan = __syncthreads_or(nan);
  __shared__ GumbelPartial warp_part[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = GumbelPartial{px, mx, sum, 0u};
  __syncthreads();
  GumbelPartial* partial = static_cast<GumbelPartial*>(ws.scratch) + slot * splits;
  if (threadIdx.x < 32) {  // warp 0 merges the warps' partials across its lanes (see block_stats)
    GumbelPartial acc =
        threadIdx.x < kThreads / 32 ? warp_part[threadIdx.x] : GumbelPartial{{-kInf, -kInf, INT_MAX}, -kInf, 0.f, 0u};
    butterfly_merge_gumbel<LSE, kThreads / 64>(acc.proxy, acc.max, acc.sum, c);
    acc.nan = any_nan;
    if (threadIdx.x == 0) partial[split] = acc;
  }
  if (!finish_and_elect_last(ws.counters + slot, splits)) return;

  __shared__ GumbelPartial row;
  __shared__ bool rescore;
  if (threadIdx.x == 0) {
    GumbelPartial acc{{-kInf, -kInf, INT_MAX}, -kInf, 0.f, 0u};
    for (int i = 0; i < splits; ++i) {
      const GumbelPartial* p = partial + i;
      const Proxy b{__ldcg(&p->proxy.p1), __ldcg(&p->proxy.p2), __ldcg(&p->proxy.i1)};
      acc.proxy = merge_proxy(acc.proxy, b);
      const float bmax = __ldcg(&p->max), bsum = __ldcg(&p->sum);
      const float m = fmaxf(acc.max, bmax);
      if (LSE) acc.sum = m == -kInf ? 0.f : acc.sum * expf((acc.max - m) * c) + bsum * expf((bmax - m) * c);
      acc.max = m;
      acc.nan |= __ldcg(&p->nan);
    }
    row = acc;
    const bool valid = acc.max > -kInf;
    rescore = valid && !(fabsf(acc.proxy.p1) < kInf && fabsf(acc.max) * inv_t < 0x1p20f &&
                         acc.proxy.p1 - acc.proxy.p2 > proxy_margin(acc.max, inv_t));
    if (rescore && ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
  }
  __syncthreads();
  const float row_max = row.max;
  int64_t token = row_max > -kInf ? row.proxy.i1 : -1;
  if (rescore) {
    uint64_t best = 0;
    const int64_t groups = (logits.vocab + 3) / 4;
    for (int64_t g = threadIdx.x; g < groups; g += kThreads) {
      float x[4];
      load_row_group(rv, g, logits.vocab, x);
      const uint4 words = noise.group(static_cast<uint32_t>(g));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sanitize(x[e]);
        if constexpr (kRowMask != kNoRowMask) row_mask.apply(x[e], static_cast<uint32_t>(4 * g + e));
        if (x[e] > -kInf) {
          const float f = __fadd_rn(scaled(x[e], row_max, temperature), gumbel_exact(word_of(words, e)));
          best = max(best, rank_key(f, static_cast<uint32_t>(4 * g + e)));
        }
      }
    }
    __shared__ uint64_t scratch[kThreads / 32];
    best = block_allreduce<kThreads>(best, MaxOp{}, scratch);
    token = best ? static_cast<int64_t>(key_index(best)) : -1;  // none: a cut that kept nothing
  }
  if (threadIdx.x != 0) return;
  uint8_t flags = (row.nan ? TS_ROW_NAN : 0) | (row_max > -kInf ? 0 : TS_ROW_INVALID);
  if constexpr (kRowMask == kCutRowMask)
    if (row_max > -kInf && row_mask.key == kNothingKept) flags |= TS_ROW_UNSETTLED;
  out.tokens[rv.r * out.num_samples + sample] = token;
  if (out.row_max) out.row_max[rv.r] = row_max;
  if (LSE && out.row_logz) out.row_logz[rv.r] = logf(row.sum);
  if (out.flags) out.flags[rv.r] = flags;
}

// ---------------------------------------------------------------------------------------------
// top-k (k + 1 <= K) with optional top-p and min-p in one read. Each block finds its chunk's exact
// top K by rank key: a threshold (the K-th largest of the threads' maxima, so at least K tokens pass
// it) selects a few candidates, which are ranked in shared memory. The last block merges the sorted
// lists by warps (warp_merge_list), takes the first k + 1, re-sorts them by z, applies min-p and
// top-p and draws every sample by Gumbel-max.

constexpr int kTopkCap = 2048;  // candidates one block of the workloads' top-k collects; more flags the row
// Candidates one topk_kernel block collects; more flag the row for the exact filter. At K = 256 the threshold is the
// least of the 256 thread maxima: on flat rows a few chunks in a hundred passed 2048 candidates, while 4096 (half the
// chunk) needs a thread whose 32 logits all lie below the chunk's median. 4096 keys keep five blocks a SM (34 KB).
constexpr int kChunkCandidates = 4096;

__host__ __device__ inline int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Keys a merging warp holds per list: K, at least one per lane.
__host__ __device__ constexpr int merge_width(int K) { return K < 32 ? 32 : K; }

__host__ __device__ inline size_t topk_smem_bytes(int bucket) {
  const size_t block_stage = (kThreads + kChunkCandidates) * sizeof(uint64_t);
  const size_t merge_stage = static_cast<size_t>(kThreads / 32 * merge_width(bucket) + 2 * bucket) * sizeof(uint64_t);
  return block_stage > merge_stage ? block_stage : merge_stage;
}

// One warp keeps in a[0, N) (shared, descending) the N largest keys of a and b, where b(j) is entry j
// of another descending list. max(a[i], b[N - 1 - i]) is bitonic and holds them; log2(N) half-cleaner
// passes sort it. Latency of a few shuffles-worth per pass, no block barrier: the last block of a
// row merges its lists warp by warp, then pairwise across warps.
template <int N, typename Entry>
__device__ __forceinline__ void warp_merge_list(uint64_t* a, int lane, Entry b) {
  uint64_t other[N / 32];
#pragma unroll
  for (int e = 0; e < N / 32; ++e) other[e] = b(N - 1 - (lane + 32 * e));  // all loads in flight at once
#pragma unroll
  for (int e = 0; e < N / 32; ++e) a[lane + 32 * e] = max(a[lane + 32 * e], other[e]);
#pragma unroll
  for (int stride = N / 2; stride; stride >>= 1) {
    __syncwarp();
#pragma unroll
    for (int i = lane; i < N / 2; i += 32) {
      const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
      const uint64_t x = a[lo], y = a[hi];
      if (x < y) {
        a[lo] = y;
        a[hi] = x;
      }
    }
  }
  __syncwarp();
}

// Entries of a descending list with a larger key than `key` (zeros, the padding, sort last).
__device__ __forceinline__ int count_greater(const uint64_t* list, int n, uint64_t key) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (list[mid] > key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// The K-th largest of the block's thread maxima: each warp's maxima sorted in descending lane order
// (`sorted`, this thread's), all of them in thread_max[kThreads]. The thread holding it writes it to
// `threshold`, which keeps the caller's value when fewer than K threads hold a token.
template <int K>
__device__ __forceinline__ void rank_thread_maxima(const uint64_t* thread_max, uint64_t sorted, int lane, int warp,
                                                   uint64_t& threshold) {
  if (sorted == 0) return;
  int above = lane;
  for (int w2 = 0; w2 < kThreads / 32; ++w2)
    if (w2 != warp) above += count_greater(thread_max + 32 * w2, 32, sorted);
  if (above == K - 1) threshold = sorted;
}

// Appends to cand[0, Cap) the keys of the chunk's tokens (v, ids base + 4 kThreads j + e) that reach th, counting
// them in num_cand (past Cap: counted, not stored). th_x, a float no candidate lies below, spares most tokens the key.
template <int Cap>
__device__ __forceinline__ void collect_candidates(const float (&v)[kGroupsPerThread][4], uint32_t base, int64_t vocab,
                                                   uint64_t th, float th_x, uint64_t* cand, int& num_cand) {
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!(v[j][e] >= th_x)) continue;
      const uint32_t id = base + 4 * kThreads * j + e;
      if (id >= vocab) continue;
      const uint64_t key = rank_key(v[j][e], id);
      if (key >= th) {
        const int pos = atomicAdd(&num_cand, 1);
        if (pos < Cap) cand[pos] = key;
      }
    }
}

// The first k of the n distinct keys cand[0, n) in descending order into out: a key's rank is the count of larger
// ones. Entries of out past n are not written.
__device__ __forceinline__ void rank_by_counting(const uint64_t* cand, int n, int k, uint64_t* out) {
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const uint64_t key = cand[i];
    int rank = 0;
    for (int j = 0; j < n; ++j) rank += cand[j] > key;
    if (rank < k) out[rank] = key;
  }
}

// The rank key of the thread's best token (v, ids base + 4 kThreads j + e): ids rise along the loop, so the first
// maximum has the lowest id. Tokens past the vocabulary read as -inf and never replace the first (real) token; a
// thread whose first token is past the vocabulary holds none (0).
__device__ __forceinline__ uint64_t thread_best_key(const float (&v)[kGroupsPerThread][4], uint32_t base,
                                                    int64_t vocab) {
  float best_x = v[0][0];
  uint32_t best_id = base;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (j == 0 && e == 0) continue;
      if (v[j][e] > best_x) best_x = v[j][e], best_id = base + 4 * kThreads * j + e;
    }
  return base < vocab ? rank_key(best_x, best_id) : 0;
}

// Lane i gets the i-th largest of the warp's 32 values (bitonic network on shuffles).
__device__ __forceinline__ uint64_t warp_sort_desc(uint64_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1)
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, v, stride);
      const bool keep_max = ((lane & stride) == 0) == ((lane & size) == 0);
      v = keep_max ? max(v, other) : min(v, other);
    }
  return v;
}

template <typename T, bool kMask, int K>
__global__ void __launch_bounds__(kThreads, 5)
    topk_kernel(TsLogits logits, TsRows rows, TsOutputs out, TsWorkspace ws) {
  extern __shared__ uint64_t smem[];
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  const int64_t vocab = logits.vocab;
  uint64_t* lists = static_cast<uint64_t*>(ws.scratch);
  uint32_t* block_flags = reinterpret_cast<uint32_t*>(lists + static_cast<int64_t>(rows.num_work_rows) * splits * K);

  // ---- block stage: this chunk's top K
  uint64_t* thread_max = smem;
  uint64_t* cand = smem + kThreads;
  __shared__ uint64_t threshold;
  __shared__ int num_cand;
  float v[kGroupsPerThread][4];
  const bool nan = load_chunk(rv, vocab, g0, v);
  const uint32_t base = 4 * (static_cast<uint32_t>(g0) + threadIdx.x);
  const uint64_t sorted = warp_sort_desc(thread_best_key(v, base, vocab));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if constexpr (K <= 128) {
    // Per-warp threshold: the (K/8)-th largest thread maximum of each warp, then the minimum over the
    // 8 warps: every warp has K/8 tokens at or above it, so at least K tokens pass (the chunk's top K
    // among them). No cross-warp ranking. A warp with fewer than K/8 tokens (a chunk of < 1024
    // tokens): take them all.
    __shared__ uint64_t warp_tau[kThreads / 32];
    const uint64_t tau = __shfl_sync(0xffffffffu, sorted, K / 8 - 1);
    if (lane == 0) warp_tau[warp] = tau;
    if (threadIdx.x == 0) num_cand = 0;
    __syncthreads();
    uint64_t t = warp_tau[0];
#pragma unroll
    for (int i = 1; i < kThreads / 32; ++i) t = min(t, warp_tau[i]);
    if (threadIdx.x == 0) threshold = t == 0 ? 1 : t;
  } else {
    // The K-th largest thread maximum: each warp sorts its 32 in registers, then every thread counts
    // the larger ones in the other warps' sorted lists by binary search.
    thread_max[threadIdx.x] = sorted;
    if (threadIdx.x == 0) {
      threshold = 1;  // fewer than K threads hold tokens: take them all
      num_cand = 0;
    }
    __syncthreads();
    rank_thread_maxima<K>(thread_max, sorted, lane, warp, threshold);
  }
  __syncthreads();
  const uint64_t th = threshold;
  // A float test first, the full key on a pass. No -inf token is a candidate: -inf is never kept, and where the
  // threshold is 1 or a -inf token's key (a chunk of few finite tokens, as masks leave), the -inf tokens would
  // pass it by id and overflow the candidates.
  const float th_x = fmaxf(th == 1 ? -kInf : key_value(th), -FLT_MAX);
  collect_candidates<kChunkCandidates>(v, base, vocab, th, th_x, cand, num_cand);
  __syncthreads();
  const int n = min(num_cand, kChunkCandidates);
  uint64_t* my_list = lists + (static_cast<int64_t>(w) * splits + split) * K;
  rank_by_counting(cand, n, K, my_list);
  for (int i = n + threadIdx.x; i < K; i += kThreads) my_list[i] = 0;
  const bool any_nan = __syncthreads_or(nan);
  if (threadIdx.x == 0)
    block_flags[static_cast<int64_t>(w) * splits + split] =
        (any_nan ? TS_ROW_NAN : 0u) | (num_cand > kChunkCandidates ? TS_ROW_UNSETTLED : 0u);
  if (!finish_and_elect_last(ws.counters + w, splits)) return;

  // ---- merge stage (last block of the row): warp v folds lists v, v + 8, ... into its slot of
  // `tree`, then the slots merge pairwise; tree[0, N) ends as the row's top N by x.
  const int64_t r = rv.r;
  const int k = rows.top_k[r];
  const int kk = min(k + 1, K);
  // The row's parameters, loaded now so that their latency hides behind the merge.
  const float temperature = rows.temperature[r], top_p = rows.top_p[r], min_p = rows.min_p[r];
  const int64_t seed = rows.seed[r], position = rows.position[r], iteration = rows.iteration[r];
  constexpr int N = merge_width(K);
  uint64_t* tree = smem;             // [8][N]
  uint64_t* top = tree;              // the merged list, its first kk by x
  uint64_t* zkey = tree + kThreads / 32 * N;  // [K] rank keys of z, x order
  uint64_t* zsorted = zkey + K;               // [K] by z
  const uint64_t* row_lists = lists + static_cast<int64_t>(w) * splits * K;
  auto list_entry = [=](int sl) {
    return [=](int j) { return j < K ? __ldcg(row_lists + static_cast<int64_t>(sl) * K + j) : uint64_t{0}; };
  };
  uint64_t* mine = tree + warp * N;
  for (int i = lane; i < N; i += 32) mine[i] = warp < splits ? list_entry(warp)(i) : 0;
  for (int sl = warp + kThreads / 32; sl < splits; sl += kThreads / 32) warp_merge_list<N>(mine, lane, list_entry(sl));
  for (int half = kThreads / 64; half; half >>= 1) {
    __syncthreads();
    if (warp < half) warp_merge_list<N>(mine, lane, [=](int j) { return tree[(warp + half) * N + j]; });
  }
  uint32_t row_flags = 0;  // every warp folds all blocks' flags
  for (int sl = lane; sl < splits; sl += 32) row_flags |= __ldcg(block_flags + static_cast<int64_t>(w) * splits + sl);
  row_flags = __reduce_or_sync(0xffffffffu, row_flags);
  for (int i = threadIdx.x; i < K; i += kThreads) zsorted[i] = 0;
  __syncthreads();

  const float row_max = key_value(top[0]);
  const bool valid = top[0] != 0 && row_max > -kInf;
  const int ns = out.num_samples;
  if (!valid) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < ns; ++s) out.tokens[r * ns + s] = -1;
      out.flags[r] = static_cast<uint8_t>((row_flags & 1u) | 2u);
      if (out.row_max) out.row_max[r] = row_max;
    }
    return;
  }
  // The entries ranked by z: z is monotone in x, so tokens past the k-th by x have z <= zk, its z; equal logits,
  // or rounding of x - max or of the division, can make it equal (then ids order them, not x). Let j be the first
  // entry past the k-th whose z is below zk (or that holds no token): every token of the row with z >= zk lies in
  // [0, j), for those outside the list have x <= x(top[j]). Ranking [0, j) by z gives the first k exactly.
  // When the list ends inside the tie (j = K), tokens outside it may tie too: those with a smaller x only if the next
  // value below the last entry's x that the input type holds still reaches zk; those with the last entry's x follow
  // it by id, so they displace none of the c = k - k0 tied entries the cut keeps (k0: the tie's first entry) when at
  // least c of the tied entries have ids up to the last's. Otherwise the row takes the exact filter.
  __shared__ int z_len;
  __shared__ bool z_tie;
  if (threadIdx.x == 0) {
    const float zk = scaled(key_value(top[k - 1]), row_max, temperature);
    int j = k;
    if (zk > -kInf)
      while (j < K && top[j] != 0 && scaled(key_value(top[j]), row_max, temperature) == zk) ++j;
    bool tie = false;
    if (j == K && vocab > K) {
      const float x_last = key_value(top[K - 1]);
      const uint32_t id_last = key_index(top[K - 1]);
      tie = scaled(next_below<T>(x_last), row_max, temperature) == zk;
      int k0 = k - 1;
      while (k0 > 0 && scaled(key_value(top[k0 - 1]), row_max, temperature) == zk) --k0;
      int up_to_last = 0;
      for (int i = k0; i < K; ++i) up_to_last += key_index(top[i]) <= id_last;
      tie |= up_to_last < k - k0;
    }
    z_tie = tie;
    z_len = max(j, kk);
  }
  __syncthreads();
  const int zn = z_len;
  for (int i = threadIdx.x; i < zn; i += kThreads) {
    const uint64_t key = top[i];
    zkey[i] = key ? rank_key(scaled(key_value(key), row_max, temperature), key_index(key)) : 0;
  }
  __syncthreads();
  // The x order is the z order unless rounding made two z equal (then ids decide): rank by z only then.
  bool out_of_order = false;
  for (int i = threadIdx.x; i + 1 < zn; i += kThreads) out_of_order |= zkey[i] < zkey[i + 1];
  const uint64_t* by_z = zkey;
  if (__syncthreads_or(out_of_order)) {
    for (int i = threadIdx.x; i < zn; i += kThreads) {
      const uint64_t key = zkey[i];
      if (key == 0) continue;
      int rank = 0;
      for (int j = 0; j < zn; ++j) rank += zkey[j] > key;
      zsorted[rank] = key;
    }
    by_z = zsorted;
  }

  // min-p and top-p over the first k in z order (warp 0: 8 entries a lane, in order)
  __shared__ int kept;
  __shared__ double kept_sum;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float p = top_p, m = min_p;
    double q[8];
    int n1 = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int j = lane * 8 + i;
      const uint64_t key = j < k ? by_z[j] : 0;
      const float z = key ? key_value(key) : -kInf;
      const float ez = expf(z);
      const bool keep = z > -kInf && (m <= 0.f || ez >= m);
      n1 += keep;
      q[i] = ez;
    }
    const int l1 = warp_allreduce(n1, SumOp{});
    double local = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (lane * 8 + i >= l1) q[i] = 0.0;
      local += q[i];
    }
    double incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    const double total = __shfl_sync(0xffffffffu, incl, 31);
    int l2 = l1;
    if (p < 1.f) {
      const double target = static_cast<double>(p) * total;
      double cum = incl - local;
      int first = INT_MAX;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int j = lane * 8 + i;
        cum += q[i];
        if (j < l1 && cum >= target && first == INT_MAX) first = j;
      }
      first = warp_allreduce(first, MinOp{});
      if (first != INT_MAX) l2 = first + 1;
    }
    double mass = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (lane * 8 + i < l2) mass += q[i];
    mass = warp_allreduce(mass, SumOp{});
    if (lane == 0) {
      kept = l2;
      kept_sum = mass;
    }
  }
  __syncthreads();

  __shared__ uint64_t scratch[kThreads / 32];
  for (int s = 0; s < ns; ++s) {
    const NoiseStream noise = NoiseStream::make(seed, position, iteration, static_cast<uint32_t>(s));
    uint64_t win = 0;
    for (int j = threadIdx.x; j < kept; j += kThreads) {
      const uint64_t key = by_z[j];
      win = max(win, gumbel_key(key_value(key), key_index(key), noise));
    }
    win = block_allreduce<kThreads>(win, MaxOp{}, scratch);
    if (threadIdx.x == 0) out.tokens[r * ns + s] = key_index(win);
  }
  if (threadIdx.x == 0) {
    const bool fallback = z_tie || (row_flags & 4u);
    out.flags[r] = static_cast<uint8_t>((row_flags & TS_ROW_NAN) | (fallback ? TS_ROW_UNSETTLED : 0u));
    if (out.row_max) out.row_max[r] = row_max;
    if (out.kept_mass) out.kept_mass[r] = static_cast<float>(kept_sum);
    if (out.kept_min_key) out.kept_min_key[r] = static_cast<int64_t>(by_z[kept - 1]);
    if (fallback && ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
  }
}

// ---------------------------------------------------------------------------------------------
// Exact filtering where the kept set is not bounded by a small k: min-p alone, top-p without k,
// k above the largest bucket. Needs the row max and min (stats_kernel). One read: tokens that pass
// min-p go to kBins bins uniform in z over [z_min, 0] with their count, their mass (fixed point)
// and the bin's Gumbel winner (exact score). Blocks of a row add their bins up with integer
// atomics and max (order-free, so any number of blocks per row gives the same answer). The last
// block finds the k and p cut bins from the prefix sums. Bins above the cuts are kept whole; the
// cut bin matters only if its winner beats theirs or the exact kept mass is needed; then, unless the
// bin holds one token (kept by top-p), that block re-reads the row, collects the cut range's tokens,
// sorts them and resolves the cut exactly.

constexpr int kFilterThreads = 512;
constexpr int kBins = 2048;
constexpr int kResolveCap = 4096;
constexpr size_t kHistRowBytes = kBins * (sizeof(uint32_t) + 2 * sizeof(uint64_t)) + 4 * sizeof(uint64_t);

// A group of four logits that passed the min-p screen, queued for exact work on a full warp.
struct ScreenedGroup {
  uint32_t g;
  float x[4];
};
// A warp screens kScreenBatch loads a lane at once, queues the survivors, then scores 32 at a time
// while it holds 32: it never holds more than 31 + 32 kScreenBatch.
constexpr int kScreenBatch = 4;
constexpr int kQueuePerWarp = 32 * (kScreenBatch + 1);
// After the bins: the pass's queues, then (the same bytes) the resolution buffer of kResolveCap keys.
constexpr size_t kQueueBytes = kFilterThreads / 32 * kQueuePerWarp * sizeof(ScreenedGroup);
constexpr size_t kFilterTailBytes = kQueueBytes > kResolveCap * sizeof(uint64_t) ? kQueueBytes : kResolveCap * sizeof(uint64_t);
constexpr size_t kFilterSmemBytes = kBins * (sizeof(uint32_t) + 2 * sizeof(uint64_t)) + kFilterTailBytes;
// A cut whose range holds more than kResolveCap tokens (a crowded bin: equal logits, or a far outlier that squeezes
// the row into a few bins) is found in its bin by radix passes over the rank keys (a histogram of kBins sub-bins a
// pass in the tail), then its last kCrowdedCap tokens are collected with their mass prefix (both in the tail).
constexpr int kCrowdedCap = 2048;
static_assert(kBins * (sizeof(uint32_t) + 2 * sizeof(uint64_t)) <= kFilterTailBytes, "sub-bins fit in the tail");
static_assert(2 * kCrowdedCap * sizeof(uint64_t) <= kFilterTailBytes, "keys and their mass prefix fit in the tail");

struct HistView {
  uint32_t* count;
  uint64_t* mass;
  uint64_t* win;
  uint64_t* extra;  // [best, ~min key, mass sum, unused]
  __device__ static HistView at(void* base) {
    char* p = static_cast<char*>(base);
    return {reinterpret_cast<uint32_t*>(p), reinterpret_cast<uint64_t*>(p + kBins * 4),
            reinterpret_cast<uint64_t*>(p + kBins * 12), reinterpret_cast<uint64_t*>(p + kBins * 20)};
  }
};

// First bin whose inclusive prefix, plus `offset`, reaches `target` (a bin exists: target <= offset + the total;
// the last bin otherwise).
template <typename T>
__device__ int first_bin_reaching(const T* cum, double target, int* result, uint64_t offset = 0) {
  if (threadIdx.x == 0) *result = kBins - 1;
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kFilterThreads) {
    const bool reach = static_cast<double>(offset + cum[b]) >= target;
    const bool before = b > 0 && static_cast<double>(offset + cum[b - 1]) >= target;
    if (reach && !before) *result = b;
  }
  __syncthreads();
  const int found = *result;
  __syncthreads();  // every thread has read it before a next call resets it
  return found;
}

constexpr int kResolveBatch = 2;  // groups a thread loads at once when the cut range is collected (2, 4, 8 measured)

// A closed interval of logits [lo, hi] that holds every x whose bin (filter_kernel's bin_of(scaled(x))) lies in
// [c_lo, c_hi]: the cut range's tokens are collected from it, the rest skip the division.
struct LogitInterval {
  float lo, hi;
  __device__ __forceinline__ bool holds(float x) const { return x >= lo && x <= hi; }
  // Whether a group may hold a logit in the interval: its largest is not below it and its smallest not above it
  // (fmaxf and fminf pass NaN over, and a group of NaNs fails both).
  __device__ __forceinline__ bool meets_group(const float (&x)[4]) const {
    return fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3])) >= lo && fminf(fminf(x[0], x[1]), fminf(x[2], x[3])) <= hi;
  }
};

// Bins count down from z = 0, so bin_of(scaled(x)) does not increase with x. With w = T / bin_scale, a token in a bin
// at most c has max - x below (c + 1) w, and one in a bin at least c has max - x at least c w, each up to roundings
// of a few parts in 2^24: one bin more on each side, plus 2^-20 of the magnitudes for the roundings of the ends
// themselves, holds them all. Without a bin scale (every token in bin 0) or when an end overflows, every logit.
__device__ __forceinline__ LogitInterval logits_of_bins(int c_lo, int c_hi, float row_max, float temperature,
                                                        float bin_scale) {
  LogitInterval all{-kInf, kInf};
  if (!(bin_scale > 0.f)) return all;
  const float w = temperature / bin_scale;
  const float below = static_cast<float>(c_hi + 2) * w, above = static_cast<float>(c_lo - 1) * w;
  const float slack = 0x1p-20f * (fabsf(row_max) + below);
  LogitInterval range{c_hi >= kBins - 1 ? -kInf : row_max - below - slack, c_lo <= 1 ? kInf : row_max - above + slack};
  return range.lo <= range.hi ? range : all;  // NaN or inf ends fail the test
}

// filter_kernel's bin of z: kBins uniform in z over [z_min, 0], counting down from z = 0 (bin_scale = kBins / -z_min;
// 0: every token in bin 0).
__device__ __forceinline__ int filter_bin(float z, float bin_scale) {
  return bin_scale > 0.f ? static_cast<int>(fminf(-z * bin_scale, static_cast<float>(kBins - 1))) : 0;
}
// min-p keeps the token (and it is finite).
__device__ __forceinline__ bool keeps_min_p(float x, float z, float m) {
  return x > -kInf && (m <= 0.f || expf(z) >= m);
}

// Groups [begin, end) of a row.
struct GroupSpan {
  int64_t begin, end;
};

// The bins a re-read collects: [lo, hi], and bin `also` below them (-1: none).
struct BinSet {
  int lo, hi, also;
  __device__ __forceinline__ bool holds(int b) const { return (b >= lo && b <= hi) || b == also; }
};

// The tokens min-p keeps whose bin lies in `bins` and whose rank key in [key_lo, key_hi], found by the block
// re-reading its groups of the row: fn(key, z, id) for each. One block may read the whole row here, so the loop is
// kept lean:
// kResolveBatch loads in flight a thread, a group skipped by its largest and smallest logit, and the exact z only for
// logits in the bins' intervals (one load at a time and a division a token, it took ~50 us of a 600 KB row on an H200).
template <typename T, typename Fn>
__device__ __forceinline__ void for_each_in_bins(const T* row, int64_t vocab, GroupSpan span, bool aligned, RowCut cut,
                                                 float row_max, float temperature, float bin_scale, float m,
                                                 BinSet bins, uint64_t key_lo, uint64_t key_hi, Fn&& fn) {
  const LogitInterval range = logits_of_bins(bins.lo, bins.hi, row_max, temperature, bin_scale);
  const LogitInterval also = bins.also < 0 ? LogitInterval{kInf, -kInf}  // holds nothing
                                           : logits_of_bins(bins.also, bins.also, row_max, temperature, bin_scale);
  for (int64_t g0 = span.begin + threadIdx.x; g0 < span.end; g0 += kResolveBatch * kFilterThreads) {
    float x[kResolveBatch][4];
#pragma unroll
    for (int u = 0; u < kResolveBatch; ++u)
      if (g0 + u * kFilterThreads < span.end)
        load_group(row, g0 + u * kFilterThreads, vocab, aligned, x[u], false, cut.words());
#pragma unroll
    for (int u = 0; u < kResolveBatch; ++u) {
      const int64_t g = g0 + u * kFilterThreads;
      if (g >= span.end) continue;
      if (cut.has_floor()) floor_group(cut.floor(), x[u]);
      if (!range.meets_group(x[u]) && !also.meets_group(x[u])) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sanitize(x[u][e]);
        if (!range.holds(x[u][e]) && !also.holds(x[u][e])) continue;
        const float z = scaled(x[u][e], row_max, temperature);
        if (!keeps_min_p(x[u][e], z, m)) continue;
        if (!bins.holds(filter_bin(z, bin_scale))) continue;
        const uint32_t id = static_cast<uint32_t>(4 * g + e);
        const uint64_t key = rank_key(z, id);
        if (key >= key_lo && key <= key_hi) fn(key, z, id);
      }
    }
  }
}

// What the crowded-cut passes need of filter_kernel's row (kMask: filter_kernel's; the passes then read the row
// through its mask).
template <typename T, bool kMask>
struct FilterRow {
  const T* row;
  int64_t vocab;
  bool aligned;
  RowCut cut;
  float row_max, temperature, bin_scale, z_min, min_p, floor_score;
  NoiseStream noise;

  template <typename Fn>
  __device__ __forceinline__ void for_each_in_bins(int c, uint64_t key_lo, uint64_t key_hi, Fn&& fn) const {
    tokensampler::for_each_in_bins(row, vocab, GroupSpan{0, (vocab + 3) / 4}, aligned, kMask ? cut : RowCut{0},
                                   row_max, temperature, bin_scale, min_p, BinSet{c, c, -1}, key_lo, key_hi, fn);
  }
};

// A cut of the row: its last kept key, the count and mass from the row's top to it (inclusive), and the best
// Gumbel key among the kept tokens considered.
struct Cut {
  uint64_t key, mass, win;
  uint32_t count;
};

// The cut inside bin c of a crowded range (more than kResolveCap tokens): the first token, in key order from the
// bin's top down to key_lo, at which count_above + the count (by_count) or mass_above + the mass reaches `target`.
// Radix passes narrow the bin's keys by kBins sub-bins a pass (the span shrinks 2^11-fold: at most six) until at
// most kCrowdedCap tokens remain, which are collected, sorted and walked. `win`: the bin's kept tokens only.
// Not inlined: in filter_kernel its registers spilled into the main pass. tail: the shared memory after the bins.
template <typename T, bool kMask>
__device__ __noinline__ Cut cut_in_bin(const FilterRow<T, kMask>& fr, int c, uint64_t key_lo, uint32_t n,
                                       uint32_t count_above, uint64_t mass_above, bool by_count, double target,
                                       uint64_t* tail, uint64_t* scratch, int* result, int* num_cand) {
  const LogitInterval range = logits_of_bins(c, c, fr.row_max, fr.temperature, fr.bin_scale);
  const float z_lo = fmaxf(fr.z_min, scaled(range.lo, fr.row_max, fr.temperature));  // z is monotone in x
  const float z_hi = fminf(0.f, scaled(range.hi, fr.row_max, fr.temperature));
  key_lo = max(key_lo, static_cast<uint64_t>(order_key(z_lo)) << 32);
  uint64_t key_hi = static_cast<uint64_t>(order_key(z_hi)) << 32 | 0xFFFFFFFFull;
  uint32_t* sub_count = reinterpret_cast<uint32_t*>(tail);
  uint64_t* sub_mass = tail + kBins / 2;
  uint64_t* sub_win = sub_mass + kBins;
  uint64_t win = 0;
  while (n > kCrowdedCap) {
    int shift = 0;
    while (((key_hi - key_lo) >> shift) >= static_cast<uint64_t>(kBins)) ++shift;
    __syncthreads();
    for (int b = threadIdx.x; b < kBins; b += kFilterThreads) sub_count[b] = 0, sub_mass[b] = 0, sub_win[b] = 0;
    __syncthreads();
    fr.for_each_in_bins(c, key_lo, key_hi, [&](uint64_t key, float z, uint32_t id) {
      const int sb = static_cast<int>((key_hi - key) >> shift);
      atomicAdd(sub_count + sb, 1u);
      atomicAdd(reinterpret_cast<unsigned long long*>(sub_mass + sb), static_cast<unsigned long long>(mass_fixed(z)));
      const uint32_t word = fr.noise.word(id);
      if (!(z + gumbel_upper_bound(word) < fr.floor_score))
        atomicMax(reinterpret_cast<unsigned long long*>(sub_win + sb),
                  static_cast<unsigned long long>(rank_key(__fadd_rn(z, gumbel_exact(word)), id)));
    });
    block_inclusive_scan<kFilterThreads>(sub_count, kBins, reinterpret_cast<uint32_t*>(scratch));
    block_inclusive_scan<kFilterThreads>(sub_mass, kBins, scratch);
    const int sb = by_count ? first_bin_reaching(sub_count, target, result, count_above)
                            : first_bin_reaching(sub_mass, target, result, mass_above);
    uint64_t w = 0;
    for (int b = threadIdx.x; b < sb; b += kFilterThreads) w = max(w, sub_win[b]);
    win = max(win, block_allreduce<kFilterThreads>(w, MaxOp{}, scratch));
    const uint32_t count_before = sb ? sub_count[sb - 1] : 0;
    const uint64_t mass_before = sb ? sub_mass[sb - 1] : 0;
    count_above += count_before;
    mass_above += mass_before;
    n = sub_count[sb] - count_before;
    const uint64_t top = key_hi - (static_cast<uint64_t>(sb) << shift), width = (uint64_t{1} << shift) - 1;
    key_hi = top;
    if (top - key_lo > width) key_lo = top - width;
  }
  uint64_t* keys = tail;                  // [kCrowdedCap]
  uint64_t* prefix = tail + kCrowdedCap;  // [kCrowdedCap]
  const unsigned int padded = next_pow2(n);
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < padded; i += kFilterThreads) keys[i] = 0;
  if (threadIdx.x == 0) *num_cand = 0;
  __syncthreads();
  fr.for_each_in_bins(c, key_lo, key_hi, [&](uint64_t key, float, uint32_t) {
    const int pos = atomicAdd(num_cand, 1);
    if (pos < kCrowdedCap) keys[pos] = key;
  });
  block_sort_desc<kFilterThreads>(keys, padded);
  for (uint32_t i = threadIdx.x; i < n; i += kFilterThreads) prefix[i] = mass_fixed(key_value(keys[i]));
  block_inclusive_scan<kFilterThreads>(prefix, static_cast<int>(n), scratch);
  uint32_t j = n - 1;
  if (by_count) {
    j = static_cast<uint32_t>(target) - count_above - 1;
  } else {
    uint32_t first = UINT_MAX;
    for (uint32_t i = threadIdx.x; i < n; i += kFilterThreads)
      if (static_cast<double>(mass_above + prefix[i]) >= target) first = min(first, i);
    first = block_allreduce<kFilterThreads>(first, MinOp{}, reinterpret_cast<uint32_t*>(scratch));
    if (first != UINT_MAX) j = first;
  }
  uint64_t w = 0;
  for (uint32_t i = threadIdx.x; i <= j; i += kFilterThreads)
    w = max(w, gumbel_key(key_value(keys[i]), key_index(keys[i]), fr.noise));
  win = max(win, block_allreduce<kFilterThreads>(w, MaxOp{}, scratch));
  return Cut{keys[j], mass_above + prefix[j], win, count_above + j + 1};
}

// The kept set of a crowded cut range from the bins' prefix sums h (k: 0 without a k cut; p: 1 without a p cut):
// the k cut in its bin, then the p cut in its own (the k cut's bin too, above the k cut). Returns the last cut, its
// `win` the row's winner: the bins above the cut's bin are kept whole.
template <typename T, bool kMask>
__device__ __noinline__ Cut crowded_cuts(const FilterRow<T, kMask>& fr, const HistView& h, int k, float p, int c_k,
                                         uint32_t total_count, uint64_t total_mass, uint64_t* tail,
                                         uint64_t* scratch, int* result, int* num_cand) {
  Cut last{0, total_mass, 0, total_count};
  if (k > 0) {
    const uint32_t before = c_k ? h.count[c_k - 1] : 0;
    last = cut_in_bin(fr, c_k, 0, h.count[c_k] - before, before, c_k ? h.mass[c_k - 1] : 0, true,
                      static_cast<double>(k), tail, scratch, result, num_cand);
  }
  int c_cut = c_k;
  if (p < 1.f) {
    const double target = static_cast<double>(p) * last.mass;
    const bool in_k_bin = k > 0 && !(static_cast<double>(c_k ? h.mass[c_k - 1] : 0) >= target);
    c_cut = in_k_bin ? c_k : first_bin_reaching(h.mass, target, result);
    const uint32_t before = c_cut ? h.count[c_cut - 1] : 0;
    last = cut_in_bin(fr, c_cut, in_k_bin ? last.key : 0, (in_k_bin ? last.count : h.count[c_cut]) - before, before,
                      c_cut ? h.mass[c_cut - 1] : 0, false, target, tail, scratch, result, num_cand);
  }
  uint64_t win = last.win;
  for (int b = threadIdx.x; b < c_cut; b += kFilterThreads) win = max(win, h.win[b]);
  last.win = block_allreduce<kFilterThreads>(win, MaxOp{}, scratch);
  return last;
}

// Where a cut range lies in its row: its bins' tokens (n of them) follow count_above tokens of mass mass_above; the
// k cut keeps l1 tokens (k_cut), top-p (p_cut) the first whose mass reaches p x the mass of those l1 (total_mass
// without a k cut). A range in two pieces (plan_cut) has gap_count tokens of mass gap_mass, kept whole and not
// collected, between its first n_a tokens and the rest; n_a = n when it is in one piece.
struct CutBounds {
  uint32_t n, count_above, l1, n_a, gap_count;
  uint64_t mass_above, total_mass, gap_mass;
  float p;
  bool k_cut, p_cut;
};

// The kept tokens of a cut range: cand[0, jk) of the sorted range; mass: from the row's top through cand[jk - 1].
struct RangeWalk {
  uint32_t jk;
  bool unsettled;  // top-p's cut lies above the range: impossible
  uint64_t mass;
};

// The cut range's keys (cand: b.n of them, zero up to next_pow2(b.n)) sorted and walked exactly; prefix[i]: the mass of
// cand[0, i].
__device__ __forceinline__ RangeWalk walk_range(uint64_t* cand, uint64_t* prefix, const CutBounds& b,
                                                uint64_t* scratch) {
  const uint32_t n = b.n;
  block_sort_desc<kFilterThreads>(cand, next_pow2(n));
  for (uint32_t i = threadIdx.x; i < n; i += kFilterThreads) prefix[i] = mass_fixed(key_value(cand[i]));
  block_inclusive_scan<kFilterThreads>(prefix, static_cast<int>(n), scratch);
  // the mass from the row's top through cand[i], the gap's included past the first piece
  auto mass_through = [&](uint32_t i) { return b.mass_above + prefix[i] + (i >= b.n_a ? b.gap_mass : 0); };
  const uint32_t from_top = b.l1 - b.count_above;  // the k cut's place, counted from the range's first token
  const uint32_t j1 = min(n, from_top <= b.n_a ? from_top : from_top - b.gap_count);
  // Without a k cut the prefix L1 runs to the last kept bin, past the collected range.
  const uint64_t l1_mass = b.k_cut ? (j1 ? mass_through(j1 - 1) : b.mass_above) : b.total_mass;
  RangeWalk walk{j1, false, 0};
  if (b.p_cut) {
    const double target = static_cast<double>(b.p) * l1_mass;
    uint32_t first = UINT_MAX;
    for (uint32_t i = threadIdx.x; i < j1; i += kFilterThreads)
      if (static_cast<double>(mass_through(i)) >= target) first = min(first, i);
    first = block_allreduce<kFilterThreads>(first, MinOp{}, reinterpret_cast<uint32_t*>(scratch));
    walk.unsettled = static_cast<double>(b.mass_above) >= target;
    if (first != UINT_MAX) walk.jk = first + 1;
  }
  walk.mass = walk.jk ? mass_through(walk.jk - 1) : b.mass_above;
  return walk;
}

// The bins a cut range's re-read collects, and where they lie in the row. The range runs from top-p's cut bin c_lo
// to the k cut's bin c_hi. When it holds more than kResolveCap tokens and top-p's cut lies well above the k cut's
// bin (top-p's mass reached long before the k-th token), it is collected in two pieces instead: the bins top-p's cut
// can lie in whatever the k cut's exact mass (up to the first bin reaching p x the mass through c_hi), and bin c_hi;
// the bins between are kept whole (the gap). A range still over kResolveCap is crowded_cuts'. Every thread calls it,
// after the bins' prefix sums.
struct CutPlan {
  BinSet bins;
  CutBounds bounds;
};
__device__ inline CutPlan plan_cut(const HistView& h, int c_lo, int c_hi, uint32_t l1, uint64_t total_mass, float p,
                                   bool k_cut, bool p_cut, int* result) {
  const uint32_t count_above = c_lo ? h.count[c_lo - 1] : 0;
  const uint64_t mass_above = c_lo ? h.mass[c_lo - 1] : 0;
  const uint32_t n = h.count[c_hi] - count_above;
  CutPlan plan{{c_lo, c_hi, -1}, {n, count_above, l1, n, 0, mass_above, total_mass, 0, p, k_cut, p_cut}};
  if (n <= kResolveCap || !k_cut || !p_cut || c_lo == c_hi) return plan;
  const int c_p = first_bin_reaching(h.mass, static_cast<double>(p) * h.mass[c_hi], result);
  if (c_p >= c_hi) return plan;
  const uint32_t n_a = h.count[c_p] - count_above, n_b = h.count[c_hi] - h.count[c_hi - 1];
  if (n_a + n_b > kResolveCap) return plan;
  plan.bins.hi = c_p, plan.bins.also = c_hi;
  plan.bounds.n = n_a + n_b, plan.bounds.n_a = n_a;
  plan.bounds.gap_count = h.count[c_hi - 1] - h.count[c_p];
  plan.bounds.gap_mass = h.mass[c_hi - 1] - h.mass[c_p];
  return plan;
}

// A cut range that filter_kernel leaves to cut_collect_kernel (several blocks a row): in the row's histogram bytes,
// which both kernels leave zeroed, its keys in the bytes of the mass and winner bins. flags and best_above: the
// filter's row flags so far and best Gumbel key of the bins above the range (a sample's filter, not the cut's).
struct CutRange {
  uint32_t pending, num;
  BinSet bins;
  uint32_t flags;
  uint64_t best_above;
  CutBounds bounds;
};
static_assert(sizeof(CutRange) <= kBins * sizeof(uint32_t) && sizeof(CutRange) % sizeof(uint64_t) == 0,
              "the cut range fits the count bins, in whole words");
static_assert(kResolveCap <= 2 * kBins, "its keys fit the mass and winner bins");

// A row's bins, as filter_kernel and cut_collect_kernel both place its tokens: z = (x - row_max) / temperature, kBins
// bins over [z_min, 0] (bin_scale 0: every token in bin 0).
struct RowBins {
  float row_max, temperature, z_min, bin_scale;
};
__device__ __forceinline__ RowBins row_bins(const TsRows& rows, const float* row_max_in, const float* row_min_in,
                                            int64_t r) {
  const float row_max = row_max_in[r], temperature = rows.temperature[r];
  const float z_min = scaled(row_min_in[r], row_max, temperature);
  return {row_max, temperature, z_min, z_min < 0.f ? static_cast<float>(kBins) / -z_min : 0.f};
}

// Block `split` of `splits`' share of a row's groups.
__device__ __forceinline__ GroupSpan split_span(int64_t groups, int split, int splits) {
  const int64_t per = (groups + splits - 1) / splits;
  return {min(groups, split * per), min(groups, split * per + per)};
}

// The winner of a sample's kept set: best_above (the bins above the cut range) against cand[0, jk) by exact score.
__device__ __forceinline__ uint64_t kept_winner(const uint64_t* cand, uint32_t jk, uint64_t best_above,
                                                const NoiseStream& noise, uint64_t* scratch) {
  uint64_t win = best_above;
  for (uint32_t i = threadIdx.x; i < jk; i += kFilterThreads)
    win = max(win, gumbel_key(key_value(cand[i]), key_index(cand[i]), noise));
  return block_allreduce<kFilterThreads>(win, MaxOp{}, scratch);
}

// What filter_kernel leaves of a row, written by one thread of the block that settles it (the filter's or
// cut_collect_kernel's). kCut: the last kept key alone (kNothingKept: none); a sample's filter: the token, the flags,
// and the kept mass and last kept key where asked for.
template <bool kCut>
__device__ __forceinline__ void write_filter_row(const TsOutputs& out, int64_t r, uint32_t flags, int64_t token,
                                                 double kept_mass, uint64_t kept_min) {
  const bool unsettled = flags & TS_ROW_UNSETTLED;
  if (kCut) {
    out.kept_min_key[r] = static_cast<int64_t>(unsettled ? kNothingKept : kept_min);
    return;
  }
  out.tokens[r * out.num_samples + out.sample] = unsettled ? -1 : token;
  out.flags[r] = static_cast<uint8_t>(flags);
  if (out.kept_mass) out.kept_mass[r] = static_cast<float>(kept_mass);
  if (out.kept_min_key) out.kept_min_key[r] = static_cast<int64_t>(kept_min);
}

// kCut: the kept set alone, for a masked Gumbel-max after it (gumbel_kernel<..., kCutRowMask>, every sample): the
// pass keeps counts (and masses under top-p) but no Philox word and no winner, every cut is resolved, and the row's
// last kept key is written to out.kept_min_key (kNothingKept: none), nothing else.
template <typename T, bool kMask, bool kCut>
__global__ void __launch_bounds__(kFilterThreads, 2)  // two blocks a SM: kFilterBlocksTarget (routes.cpp)
    filter_kernel(TsLogits logits, TsRows rows, const float* row_max_in, const float* row_min_in,
                  const int64_t* row_argmax, const uint8_t* stats_flags, int need_exact_mass, TsOutputs out,
                  TsWorkspace ws) {
  extern __shared__ uint64_t smem[];
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  const int64_t r = rv.r;
  const int64_t vocab = logits.vocab, groups = (vocab + 3) / 4;
  const int ns = out.num_samples;
  wait_for_previous_grid();  // launched to overlap stats_kernel's tail: its results are complete from here
  const uint8_t sflags = stats_flags[r];
  if (sflags & kRowDecided) return;
  if (sflags & 2u) {  // no finite logit: every block leaves, the first writes the row
    if (split == 0 && threadIdx.x == 0) {
      if (kCut) {
        out.kept_min_key[r] = static_cast<int64_t>(kNothingKept);
      } else {
        out.tokens[r * ns + out.sample] = -1;
        out.flags[r] = sflags & 3u;
      }
    }
    return;
  }
  const RowBins bins = row_bins(rows, row_max_in, row_min_in, r);
  const float row_max = bins.row_max, temperature = bins.temperature, z_min = bins.z_min, bin_scale = bins.bin_scale;
  const int k = rows.top_k[r];
  const float p = rows.top_p[r], m = rows.min_p[r];
  const bool use_bins = k > 0 || p < 1.f;
  const bool need_mass = !kCut || p < 1.f;  // the cut's own need: top-p's target
  const NoiseStream noise = row_noise(rows, r, static_cast<uint32_t>(out.sample));
  // The argmax (z = 0) is always kept, so the winner scores at least its f = g: a token whose
  // z + (upper bound of g) is below that cannot win, and its exact noise is never computed.
  const float floor_score = gumbel_exact(noise.word(static_cast<uint32_t>(row_argmax[r])));

  HistView h{reinterpret_cast<uint32_t*>(smem), smem + kBins / 2, smem + kBins / 2 + kBins, nullptr};
  uint64_t* cand = h.win + kBins;  // [kResolveCap]
  __shared__ uint64_t scratch[kFilterThreads / 32];
  __shared__ int cut, num_cand;
  if (use_bins)
    for (int b = threadIdx.x; b < kBins; b += kFilterThreads) h.count[b] = 0, h.mass[b] = 0, h.win[b] = 0;
  __syncthreads();

  auto bin_of = [&](float z) { return filter_bin(z, bin_scale); };
  auto passes_min_p = [&](float x, float z) { return keeps_min_p(x, z, m); };
  const float inv_t = 1.f / temperature;
  const float z_skip = m > 0.f ? logf(m) - 1e-4f : -kInf;

  uint64_t best = 0, min_key = ~0ull, mass_sum = 0;
  const GroupSpan span = split_span(groups, split, splits);
  const int64_t g_begin = span.begin, g_end = span.end;
  // The exact work of one group: z, min-p, mass, bins and the winner, for each of its tokens.
  auto score_group = [&](uint32_t g, const float (&x)[4]) {
    const uint4 words = kCut ? uint4{} : noise.group(g);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float z = scaled(x[e], row_max, temperature);
      if (!passes_min_p(x[e], z)) continue;
      const uint32_t id = 4 * g + e;
      min_key = min(min_key, rank_key(z, id));
      if (kCut) {
        if (use_bins) {
          const int b = bin_of(z);
          atomicAdd(h.count + b, 1u);
          if (need_mass) {
            const auto q = static_cast<unsigned long long>(mass_fixed(z));
            atomicAdd(reinterpret_cast<unsigned long long*>(h.mass + b), q);
          }
        }
        continue;
      }
      const uint64_t q = mass_fixed(z);
      const uint32_t word = word_of(words, e);
      const bool may_win = !(z + gumbel_upper_bound(word) < floor_score);
      if (use_bins) {
        const int b = bin_of(z);
        atomicAdd(h.count + b, 1u);
        atomicAdd(reinterpret_cast<unsigned long long*>(h.mass + b), static_cast<unsigned long long>(q));
        if (may_win) {
          const uint64_t f = rank_key(__fadd_rn(z, gumbel_exact(word)), id);
          if (f > h.win[b]) atomicMax(reinterpret_cast<unsigned long long*>(h.win + b), static_cast<unsigned long long>(f));
        }
      } else {
        if (may_win) best = max(best, rank_key(__fadd_rn(z, gumbel_exact(word)), id));
        mass_sum += q;
      }
    }
  };
  const int lane = threadIdx.x & 31;
  if (kCut && use_bins && !(m > 0.f)) {
    // The cut's bins alone: a token's z, its bin and the count (and mass), the division skipped at T = 1, where it
    // is exact, and a rank key only for the tokens at the row's least z, where min_key lies (stats_kernel's row_min
    // is the least finite logit of the same loads, and z is monotone in x). Two groups in flight a thread. What
    // score_group does for these rows, in fewer instructions: the pass was bound by their issue
    // (docs/design/kernel-routing.md).
    const bool unit_t = temperature == 1.f;
    for (int64_t g = g_begin + threadIdx.x; g < g_end; g += 2 * kFilterThreads) {
      float x[2][4];
      const bool second = g + kFilterThreads < g_end;
      load_row_group(rv, g, vocab, x[0]);
      if (second) load_row_group(rv, g + kFilterThreads, vocab, x[1]);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (u == 1 && !second) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sanitize(x[u][e]);
          if (!(x[u][e] > -kInf)) continue;
          const float d = __fsub_rn(x[u][e], row_max);
          const float z = unit_t ? d : __fdiv_rn(d, temperature);
          if (z <= z_min) min_key = min(min_key, rank_key(z, static_cast<uint32_t>(4 * (g + u * kFilterThreads) + e)));
          const int b = bin_of(z);
          atomicAdd(h.count + b, 1u);
          if (need_mass)
            atomicAdd(reinterpret_cast<unsigned long long*>(h.mass + b),
                      static_cast<unsigned long long>(mass_fixed(z)));
        }
      }
    }
  } else if (!(m > 0.f)) {
    for (int64_t g = g_begin + threadIdx.x; g < g_end; g += kFilterThreads) {
      float x[4];
      load_row_group(rv, g, vocab, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) sanitize(x[e]);
      score_group(static_cast<uint32_t>(g), x);
    }
  } else {
    // min-p screen on the group's largest logit: z <= z(gx), and the approximate z of gx is within
    // 2e-7 |z| of the exact one, so a group rejected here has every exact z < log(m) - 1e-4, where
    // expf(z) < m: no token of it passes min-p (no division, no exp, no Philox). The groups that
    // pass are queued per warp and scored 32 at a time: with few survivors scattered over the lanes,
    // scoring them in place would cost the warp a full pass for each one.
    // Screening is load-bound once scoring is off the lanes, so each lane keeps kScreenBatch loads
    // in flight.
    ScreenedGroup* queue = reinterpret_cast<ScreenedGroup*>(cand) + (threadIdx.x >> 5) * kQueuePerWarp;
    int queued = 0;  // warp-uniform
    for (int64_t gw = g_begin + (threadIdx.x & ~31); gw < g_end; gw += kScreenBatch * kFilterThreads) {
      float x[kScreenBatch][4];
#pragma unroll
      for (int u = 0; u < kScreenBatch; ++u) {
        const int64_t g = gw + u * kFilterThreads + lane;
        if (g < g_end) load_group(rv.row, g, vocab, rv.aligned, x[u]);
      }
      if (const uint32_t* words = rv.cut.words()) {
        const uint32_t bits = warp_groups_mask_bits<kScreenBatch, kFilterThreads, false>(words, vocab, gw);
#pragma unroll
        for (int u = 0; u < kScreenBatch; ++u)
          if (gw + u * kFilterThreads + lane < g_end) mask_group(bits >> (4 * u), x[u]);
      }
      if (rv.cut.has_floor()) {
#pragma unroll
        for (int u = 0; u < kScreenBatch; ++u)
          if (gw + u * kFilterThreads + lane < g_end) floor_group(rv.cut.floor(), x[u]);
      }
#pragma unroll
      for (int u = 0; u < kScreenBatch; ++u) {
        const int64_t g = gw + u * kFilterThreads + lane;
        bool pass = false;
        if (g < g_end) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sanitize(x[u][e]);
          const float gx = fmaxf(fmaxf(x[u][0], x[u][1]), fmaxf(x[u][2], x[u][3]));
          const float zg = (gx - row_max) * inv_t;
          pass = gx > -kInf && !(zg + 1e-5f * fabsf(zg) < z_skip);
        }
        const uint32_t ballot = __ballot_sync(0xffffffffu, pass);
        if (pass) {
          ScreenedGroup& slot = queue[queued + __popc(ballot & ((1u << lane) - 1))];
          slot.g = static_cast<uint32_t>(g);
#pragma unroll
          for (int e = 0; e < 4; ++e) slot.x[e] = x[u][e];
        }
        queued += __popc(ballot);
      }
      while (queued >= 32) {
        __syncwarp();
        const ScreenedGroup mine = queue[queued - 32 + lane];
        score_group(mine.g, mine.x);
        queued -= 32;
        __syncwarp();
      }
    }
    __syncwarp();
    if (lane < queued) {
      const ScreenedGroup mine = queue[lane];
      score_group(mine.g, mine.x);
    }
  }
  best = block_allreduce<kFilterThreads>(best, MaxOp{}, scratch);
  min_key = block_allreduce<kFilterThreads>(min_key, MinOp{}, scratch);
  mass_sum = block_allreduce<kFilterThreads>(mass_sum, SumOp{}, scratch);

  if (splits > 1) {
    HistView g = HistView::at(static_cast<char*>(ws.hist) + static_cast<int64_t>(w) * kHistRowBytes);
    if (use_bins) {
      for (int b = threadIdx.x; b < kBins; b += kFilterThreads) {
        if (!h.count[b]) continue;
        atomicAdd(g.count + b, h.count[b]);
        atomicAdd(reinterpret_cast<unsigned long long*>(g.mass + b), static_cast<unsigned long long>(h.mass[b]));
        atomicMax(reinterpret_cast<unsigned long long*>(g.win + b), static_cast<unsigned long long>(h.win[b]));
      }
    }
    if (threadIdx.x == 0) {
      atomicMax(reinterpret_cast<unsigned long long*>(g.extra), static_cast<unsigned long long>(best));
      atomicMax(reinterpret_cast<unsigned long long*>(g.extra + 1), static_cast<unsigned long long>(~min_key));
      atomicAdd(reinterpret_cast<unsigned long long*>(g.extra + 2), static_cast<unsigned long long>(mass_sum));
    }
    if (!finish_and_elect_last(ws.counters + w, splits)) return;
    if (use_bins) {
      for (int b = threadIdx.x; b < kBins; b += kFilterThreads) {
        h.count[b] = __ldcg(g.count + b);
        h.mass[b] = __ldcg(g.mass + b);
        h.win[b] = __ldcg(g.win + b);
        g.count[b] = 0, g.mass[b] = 0, g.win[b] = 0;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      scratch[0] = __ldcg(g.extra), scratch[1] = ~__ldcg(g.extra + 1), scratch[2] = __ldcg(g.extra + 2);
      g.extra[0] = g.extra[1] = g.extra[2] = 0;
    }
    __syncthreads();
    best = scratch[0], min_key = scratch[1], mass_sum = scratch[2];
    __syncthreads();
  }

  int64_t token = -1;
  uint32_t flags = sflags & TS_ROW_NAN;
  // The row's cut (words or floor) for the re-reads below, read again from the rows' parameters rather than kept in
  // registers through the bins (the masked instance spilled 4 more bytes).
  const RowCut row_cut_bits = kMask ? row_cut(rows.bitmask, r) : RowCut{0};
  double kept_mass = __builtin_nan("");
  uint64_t kept_min = 0;
  if (!use_bins) {
    token = key_index(best);
    kept_mass = mass_sum * kMassUnit;
    kept_min = min_key;
  } else {
    // ---- cuts from the prefix sums
    block_inclusive_scan<kFilterThreads>(h.count, kBins, reinterpret_cast<uint32_t*>(scratch));
    block_inclusive_scan<kFilterThreads>(h.mass, kBins, scratch);
    const uint32_t total_count = h.count[kBins - 1];
    const uint64_t total_mass = h.mass[kBins - 1];
    const bool k_cut = k > 0 && static_cast<uint32_t>(k) < total_count;
    const int c_k = k_cut ? first_bin_reaching(h.count, static_cast<double>(k), &cut) : kBins - 1;
    const uint64_t l1_lo = k_cut ? (c_k ? h.mass[c_k - 1] : 0) : total_mass;
    const bool p_cut = p < 1.f;
    const int c_p_lo = p_cut ? first_bin_reaching(h.mass, static_cast<double>(p) * l1_lo, &cut) : c_k;
    const int c_lo = c_p_lo, c_hi = k_cut ? c_k : c_p_lo;
    uint64_t best_above = 0;
    for (int b = threadIdx.x; b < c_lo; b += kFilterThreads) best_above = max(best_above, h.win[b]);
    best_above = block_allreduce<kFilterThreads>(best_above, MaxOp{}, scratch);
    const uint64_t cut_win = h.win[c_lo];
    const bool whole = !k_cut && !p_cut;
    const bool resolve = !whole && (kCut || k_cut || need_exact_mass || best_above == 0 || cut_win > best_above);
    if (whole) {
      uint64_t b = 0;
      for (int i = threadIdx.x; i < kBins; i += kFilterThreads) b = max(b, h.win[i]);
      token = key_index(block_allreduce<kFilterThreads>(b, MaxOp{}, scratch));
      kept_mass = total_mass * kMassUnit;
      kept_min = min_key;
    } else if (!resolve) {
      token = key_index(best_above);
    } else {
      const uint32_t l1 = k_cut ? static_cast<uint32_t>(k) : total_count;
      const CutPlan plan = plan_cut(h, c_lo, c_hi, l1, total_mass, p, k_cut, p_cut, &cut);
      const uint32_t n = plan.bounds.n;
      // The cut bin holds one token (on spiky rows, often the spike whose mass reaches p x the total): top-p keeps
      // it, and its exact score is the bin's winner unless it cannot beat the argmax. No re-read.
      const bool one_token = !kCut && !k_cut && n == 1 && !need_exact_mass;
      if (!one_token && threadIdx.x == 0 && ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
      if (one_token) {
        token = key_index(max(best_above, cut_win));
      } else if (n > kResolveCap) {
        // ---- a crowded cut range: the k cut, then the p cut, each found in its own bin
        const FilterRow<T, kMask> fr{rv.row,    vocab,    rv.aligned, row_cut_bits, row_max, temperature,
                                     bin_scale, z_min, m,          floor_score,  noise};
        const Cut last = crowded_cuts(fr, h, k_cut ? k : 0, p_cut ? p : 1.f, c_k, total_count, total_mass, cand,
                                      scratch, &cut, &num_cand);
        token = key_index(last.win);
        kept_mass = last.mass * kMassUnit;
        kept_min = last.key;
      } else if (splits > 1) {
        // ---- every block of the row reads its groups for the range (cut_collect_kernel), not this one alone
        if (threadIdx.x == 0) {
          CutRange* range = reinterpret_cast<CutRange*>(static_cast<char*>(ws.hist) + w * kHistRowBytes);
          *range = CutRange{1u, 0u, plan.bins, flags, best_above, plan.bounds};
        }
        return;
      } else {
        // ---- re-read the row, collect the cut range, sort, walk the prefix exactly
        const unsigned int padded = next_pow2(n);
        __syncthreads();
        for (unsigned int i = threadIdx.x; i < padded; i += kFilterThreads) cand[i] = 0;
        if (threadIdx.x == 0) num_cand = 0;
        __syncthreads();
        for_each_in_bins(rv.row, vocab, GroupSpan{0, groups}, rv.aligned, row_cut_bits, row_max, temperature,
                         bin_scale, m, plan.bins, 0, ~0ull, [&](uint64_t key, float, uint32_t) {
          const int pos = atomicAdd(&num_cand, 1);
          if (pos < kResolveCap) cand[pos] = key;
        });
        uint64_t* prefix = h.mass;  // the bins are no longer needed: reuse for the masses
        const RangeWalk walk = walk_range(cand, prefix, plan.bounds, scratch);
        if (walk.unsettled) flags |= TS_ROW_UNSETTLED;
        if (!kCut) token = key_index(kept_winner(cand, walk.jk, best_above, noise, scratch));
        kept_mass = walk.mass * kMassUnit;
        kept_min = walk.jk ? cand[walk.jk - 1] : 0;
      }
    }
  }
  if (threadIdx.x == 0) write_filter_row<kCut>(out, r, flags, token, kept_mass, kept_min);
}

// The cut ranges filter_kernel left (CutRange), read by every block of their row over its own groups rather than by
// the row's last block alone, which took ~50 us a 600 KB row on an H200 on the way of every row
// (docs/design/kernel-routing.md): each block appends the range's keys of its groups, the last sorts and walks them
// and settles the row as the filter does for a range it reads itself. Launched after the filter with the same grid.
template <typename T, bool kMask, bool kCut>
__global__ void __launch_bounds__(kFilterThreads, 3)  // three blocks a SM, as its shared memory allows: it is a read
    cut_collect_kernel(TsLogits logits, TsRows rows, const float* row_max_in, const float* row_min_in, TsOutputs out,
                       TsWorkspace ws) {
  extern __shared__ uint64_t smem[];  // [kResolveCap] keys, then [kResolveCap] their mass prefix
  __shared__ uint64_t scratch[kFilterThreads / 32];
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  wait_for_previous_grid();
  char* row_hist = static_cast<char*>(ws.hist) + w * kHistRowBytes;
  CutRange* range = reinterpret_cast<CutRange*>(row_hist);
  uint64_t* keys = HistView::at(row_hist).mass;
  if (!range->pending) return;  // the filter settled the row: every block of it leaves
  const CutRange record = *range;
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  const int64_t r = rv.r, vocab = logits.vocab;
  const RowBins bins = row_bins(rows, row_max_in, row_min_in, r);
  const RowCut row_cut_bits = kMask ? row_cut(rows.bitmask, r) : RowCut{0};
  for_each_in_bins(rv.row, vocab, split_span((vocab + 3) / 4, split, splits), rv.aligned, row_cut_bits, bins.row_max,
                   bins.temperature, bins.bin_scale, rows.min_p[r], record.bins, 0, ~0ull,
                   [&](uint64_t key, float, uint32_t) {
    const uint32_t pos = atomicAdd(&range->num, 1u);
    if (pos < kResolveCap) keys[pos] = key;
  });
  if (!finish_and_elect_last(ws.counters + w, splits)) return;
  uint64_t* cand = smem;
  uint64_t* prefix = smem + kResolveCap;
  const uint32_t n = record.bounds.n, padded = next_pow2(n);
  const uint32_t written = min(__ldcg(&range->num), static_cast<uint32_t>(kResolveCap));  // n, as the bins counted
  for (uint32_t i = threadIdx.x; i < padded; i += kFilterThreads) cand[i] = i < n ? __ldcg(keys + i) : 0;
  for (uint32_t i = threadIdx.x; i < written; i += kFilterThreads) keys[i] = 0;
  __syncthreads();  // every thread has read `num` before the record is cleared, its padding too
  if (threadIdx.x < sizeof(CutRange) / sizeof(uint64_t)) reinterpret_cast<uint64_t*>(range)[threadIdx.x] = 0;
  const RangeWalk walk = walk_range(cand, prefix, record.bounds, scratch);
  const uint32_t flags = record.flags | (walk.unsettled ? TS_ROW_UNSETTLED : 0u);
  int64_t token = -1;
  if (!kCut) {
    const NoiseStream noise = row_noise(rows, r, static_cast<uint32_t>(out.sample));
    token = key_index(kept_winner(cand, walk.jk, record.best_above, noise, scratch));
  }
  if (threadIdx.x == 0)
    write_filter_row<kCut>(out, r, flags, token, walk.mass * kMassUnit, walk.jk ? cand[walk.jk - 1] : 0);
}

}  // namespace tokensampler
