// The scoring kernel as a framework-free device template (launcher: score.cu; semantics: docs/semantics.md,
// choice 18; design: docs/design/scoring.md). Rows are cut into the sampling kernels' kChunk-token chunks, one
// block each (sampling.cuh). Each block reads its chunk once and reduces it to a partial: the max of x, the sums
// of e^c and e^c·c with c = (x - max) / T (the online softmax, rescaled as partials merge), and the chunk's top n
// by rank key (x desc, id asc: z's order, T > 0). The owner of the scored token stores its x. The row's last block
// (counter) merges the partials in chunk order with the row's running state, then writes the state (a slice
// before the row's last) or the outputs. Sums about the largest x, never of x / T: x / T overflows for a small T,
// and max(z) + log S loses log S in float32 for a large |z| (the reference's form, workloads/score.py).
#pragma once
#include <cfloat>
#include <cstdint>

#include "sampling.cuh"
#include "score.h"

namespace tokensampler {

constexpr int kScoreMaxTop = TS_SCORE_MAX_TOP;
// A block's candidates lie in the top_n threads whose best token reaches the threshold, 32 tokens each; a merge
// batch holds at most this many keys too.
constexpr int kScoreCandidates = 32 * kScoreMaxTop;
static_assert((kScoreCandidates & (kScoreCandidates - 1)) == 0, "the candidates sort as a power of two");

// A row's (or a partial's) running state: max of x, sum = Σ e^c, terms = Σ e^c·c with c = (x - max) / T, the
// numerator of the entropy; target = the scored token's x (the state's only; written by the block that holds it).
struct ScoreState {
  float max, sum, terms, target;
};

struct Moments {
  float max, sum, terms;
};

// c = (x - m) / T correctly rounded, as the reference divides (T = 1 leaves the difference as it is). Where it is
// -inf (and where x - m is NaN: no finite x at all) it clamps to -FLT_MAX: a term of 0, e^c·c = 0.
__device__ __forceinline__ float centred(float x, float m, float t) {
  const float d = x - m;
  return fmaxf(t != 1.f ? __fdiv_rn(d, t) : d, -FLT_MAX);
}

// p's sums rescaled to r.max (>= p.max, finite) and added: e^(c') = e^c·e^d, c' = c + d, d = (p.max - r.max) / T.
// 2^x by the hardware approximation, as the sampling kernels' sums: ~1e-7 relative a term. A scale of 0 (d far below
// the float range's exponent) adds nothing: d·p.sum may be -inf there.
__device__ __forceinline__ void add_rescaled(Moments& r, const Moments& p, float t) {
  if (!(p.max > -kInf)) return;
  const float d = centred(p.max, r.max, t);
  const float s = fast_exp2(d * kLog2e);
  if (s == 0.f) return;
  r.sum += s * p.sum;
  r.terms += s * (p.terms + d * p.sum);
}

__device__ __forceinline__ Moments merge_moments(const Moments& a, const Moments& b, float t) {
  Moments r{fmaxf(a.max, b.max), 0.f, 0.f};
  if (r.max > -kInf) {
    add_rescaled(r, a, t);
    add_rescaled(r, b, t);
  }
  return r;
}

// Every thread gets the block's merge of the threads' moments (warps by butterfly, then the 8 warps in order).
__device__ __forceinline__ Moments block_moments(Moments m, float t) {
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const Moments other{__shfl_xor_sync(0xffffffffu, m.max, o), __shfl_xor_sync(0xffffffffu, m.sum, o),
                        __shfl_xor_sync(0xffffffffu, m.terms, o)};
    m = merge_moments(m, other, t);
  }
  __shared__ Moments warp_moments[kThreads / 32];
  __syncthreads();  // the previous call's readers are done
  if ((threadIdx.x & 31) == 0) warp_moments[threadIdx.x >> 5] = m;
  __syncthreads();
  Moments r = warp_moments[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) r = merge_moments(r, warp_moments[i], t);
  return r;
}

// The first n of the nc distinct keys cand[0, nc) (shared; nc <= kScoreCandidates) in descending order into
// out[0, n), zero padded. By counting when every thread holds at most one candidate, else by a block sort.
__device__ __forceinline__ void rank_candidates(uint64_t* cand, int nc, int n, uint64_t* out) {
  if (nc <= kThreads) {
    if (threadIdx.x < nc) {
      const uint64_t key = cand[threadIdx.x];
      int rank = 0;
      for (int j = 0; j < nc; ++j) rank += cand[j] > key;
      if (rank < n) out[rank] = key;
    }
  } else {
    const int padded = pow2_at_least(nc);
    for (int i = nc + threadIdx.x; i < padded; i += kThreads) cand[i] = 0;
    block_sort_desc<kThreads>(cand, padded);
    for (int i = threadIdx.x; i < n; i += kThreads) out[i] = cand[i];
  }
  for (int i = nc + threadIdx.x; i < n; i += kThreads) out[i] = 0;
}

// Shared memory of the top-n stages (dynamic): the threads' best keys, the candidates, the merged list.
struct TopShared {
  uint64_t thread_max[kThreads];
  uint64_t cand[kScoreCandidates];
  uint64_t acc[kScoreMaxTop];
};

// This block's top n (x desc, id asc; absolute ids) into list[0, n). The threshold is the n-th largest of the
// threads' best keys, so exactly n threads hold the tokens that reach it: at most 32 n candidates, ranked in
// shared memory. Tokens at -inf count (a row with fewer than n finite logits lists them by id, as the reference).
__device__ __forceinline__ void block_top(const float (&v)[kGroupsPerThread][4], int64_t g0, int64_t width,
                                          int64_t offset, int n, uint64_t* list, TopShared& sh) {
  __shared__ uint64_t threshold;
  __shared__ int num_cand;
  // Ids rise along (j, e): the first maximum has the lowest id. A thread whose first token lies past the slice
  // holds none (tokens there read as -inf and never replace the first).
  const int64_t first = token_of(g0, 0, 0);
  float best_x = v[0][0];
  int64_t best = first;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > best_x) best_x = v[j][e], best = token_of(g0, j, e);
  const uint64_t sorted = warp_sort_desc(first < width ? rank_key(best_x, static_cast<uint32_t>(offset + best)) : 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  sh.thread_max[threadIdx.x] = sorted;
  if (threadIdx.x == 0) {
    threshold = 1;  // fewer than n threads hold tokens: every token is a candidate
    num_cand = 0;
  }
  __syncthreads();
  if (sorted != 0) {
    int above = lane;
    for (int w2 = 0; w2 < kThreads / 32; ++w2)
      if (w2 != warp) above += count_greater(sh.thread_max + 32 * w2, 32, sorted);
    if (above == n - 1) threshold = sorted;
  }
  __syncthreads();
  const uint64_t th = threshold;
  const float th_x = th == 1 ? -kInf : key_value(th);  // a float test first, the full key on a pass
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!(v[j][e] >= th_x)) continue;
      const int64_t i = token_of(g0, j, e);
      if (i >= width) continue;
      const uint64_t key = rank_key(v[j][e], static_cast<uint32_t>(offset + i));
      if (key >= th) sh.cand[atomicAdd(&num_cand, 1)] = key;
    }
  __syncthreads();
  rank_candidates(sh.cand, num_cand, n, list);
}

// The top n of `count` descending lists of n keys (lists + l n) and of `extra` (one more such list, or null)
// into sh.acc[0, n), batch by batch: a batch's keys below its largest n-th entry cannot be among the top n.
__device__ __forceinline__ void merge_top(const uint64_t* lists, int count, const uint64_t* extra, int n,
                                          TopShared& sh) {
  __shared__ uint64_t reduce[kThreads / 32];
  __shared__ int num_cand;
  const int total = count + (extra != nullptr ? 1 : 0);
  const int per_batch = kScoreCandidates / n - 1;  // lists a batch merges into the n kept so far
  for (int i = threadIdx.x; i < n; i += kThreads) sh.acc[i] = 0;
  for (int b0 = 0; b0 < total; b0 += per_batch) {
    const int nb = min(per_batch, total - b0);
    auto list = [&](int l) { return l < count ? lists + static_cast<int64_t>(l) * n : extra; };
    uint64_t tau = 0;
    for (int l = threadIdx.x; l < nb; l += kThreads) tau = max(tau, __ldcg(list(b0 + l) + n - 1));
    __syncthreads();  // sh.acc written
    tau = block_allreduce<kThreads>(max(tau, sh.acc[n - 1]), MaxOp{}, reduce);
    if (threadIdx.x == 0) num_cand = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < (nb + 1) * n; i += kThreads) {
      const uint64_t key = i < nb * n ? __ldcg(list(b0 + i / n) + i % n) : sh.acc[i - nb * n];
      if (key != 0 && key >= tau) sh.cand[atomicAdd(&num_cand, 1)] = key;
    }
    __syncthreads();
    rank_candidates(sh.cand, num_cand, n, sh.acc);
  }
  __syncthreads();
}

template <typename T, bool kTop>
__global__ void __launch_bounds__(kThreads, 4)
    score_slice_kernel(TsLogits logits, int64_t offset, TsScoreRows rows, int first, int last, void* state,
                       TsWorkspace ws) {
  extern __shared__ uint64_t smem[];
  TopShared& sh = *reinterpret_cast<TopShared*>(smem);
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const int64_t width = logits.vocab, g0 = static_cast<int64_t>(split) * kChunkGroups;
  const int n = kTop ? rows.top_n : 0;
  ScoreState* row_state = static_cast<ScoreState*>(state);
  uint64_t* state_lists = reinterpret_cast<uint64_t*>(row_state + logits.num_rows);
  ScoreState* partials = static_cast<ScoreState*>(ws.scratch);
  uint64_t* lists = reinterpret_cast<uint64_t*>(partials + logits.num_rows * splits);

  const RowView<T> rv = logits_row<T>(logits, w);
  const float t = rows.temperature != nullptr ? rows.temperature[w] : 1.f;
  // The slices before this one, loaded by every thread (one broadcast) while the chunk loads.
  Moments before{-kInf, 0.f, 0.f};
  if (!first) before = Moments{__ldcg(&row_state[w].max), __ldcg(&row_state[w].sum), __ldcg(&row_state[w].terms)};
  float v[kGroupsPerThread][4];
  load_chunk(rv, width, g0, v, rows_exceed_l2<T>(logits.num_rows, width));
  // The scored token's x, by one thread of the block that holds it (one load, not a search of the registers).
  if (threadIdx.x == 0) {
    const int64_t target = rows.token[w] - offset;
    if (target >= 4 * g0 && target < min(width, 4 * (g0 + kChunkGroups))) {
      float x = to_f32(rv.row[target]);
      sanitize(x);
      row_state[w].target = x;
    }
  }
  // The thread's moments about its own max: no barrier before the exponentials.
  Moments m{-kInf, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) m.max = fmaxf(m.max, v[j][e]);
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float d = centred(v[j][e], m.max, t);
      const float p = fast_exp2(d * kLog2e);
      m.sum += p;
      m.terms = fmaf(p, d, m.terms);
    }
  m = block_moments(m, t);
  const int64_t block = static_cast<int64_t>(w) * splits + split;
  if constexpr (kTop) block_top(v, g0, width, offset, n, lists + block * n, sh);
  Moments row = m;  // a block that reads the whole slice is its row's last, without a partial
  if (splits > 1) {
    if (threadIdx.x == 0) partials[block] = ScoreState{m.max, m.sum, m.terms, 0.f};
    if (!finish_and_elect_last(ws.counters + w, splits)) return;
    // ---- the row's last block: the partials in chunk order
    row = Moments{-kInf, 0.f, 0.f};
    for (int i = threadIdx.x; i < splits; i += kThreads) {
      const ScoreState* p = partials + static_cast<int64_t>(w) * splits + i;
      row = merge_moments(row, Moments{__ldcg(&p->max), __ldcg(&p->sum), __ldcg(&p->terms)}, t);
    }
    row = block_moments(row, t);
  } else if (kTop) {
    __syncthreads();  // the block's own list, read back below
  }
  row = merge_moments(row, before, t);  // the same in every thread
  if constexpr (kTop)
    merge_top(lists + static_cast<int64_t>(w) * splits * n, splits, first ? nullptr : state_lists + w * n, n, sh);
  if (!last) {
    if (threadIdx.x == 0) {
      row_state[w].max = row.max;
      row_state[w].sum = row.sum;
      row_state[w].terms = row.terms;
    }
    if constexpr (kTop)
      for (int i = threadIdx.x; i < n; i += kThreads) state_lists[w * n + i] = sh.acc[i];
    return;
  }
  const bool valid = row.max > -kInf;
  const float log_sum = logf(row.sum);
  const float nan = __int_as_float(0x7fc00000);
  // (x - max) / T - log S, as the reference: the scored token's -inf stays -inf (centred clamps only the sums').
  auto logprob_of = [&](float x) { return (t != 1.f ? __fdiv_rn(x - row.max, t) : x - row.max) - log_sum; };
  if (threadIdx.x == 0) {
    rows.logprob[w] = valid ? logprob_of(__ldcg(&row_state[w].target)) : nan;
    if (rows.entropy != nullptr) rows.entropy[w] = valid ? log_sum - row.terms / row.sum : nan;
  }
  if constexpr (kTop)
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const uint64_t key = sh.acc[i];
      const bool listed = valid && key != 0;
      rows.top_ids[static_cast<int64_t>(w) * n + i] = listed ? static_cast<int64_t>(key_index(key)) : -1;
      rows.top_values[static_cast<int64_t>(w) * n + i] = listed ? logprob_of(key_value(key)) : nan;
    }
}

}  // namespace tokensampler
