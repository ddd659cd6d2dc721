// Top-p and min-p without k, decided from a frontier of candidates instead of the binned cut of
// filter_kernel (launchers: sampling.cu; design and measurements: docs/design/top-p-frontier.md).
//
// With z-order = (z desc, id asc), top-p and min-p both keep a prefix of it, and the token sampled
// is the kept token with the largest exact score z + g. A token that has, ahead of it in z-order,
// a token with a larger score never wins: whenever it is kept, so is that one. The frontier is the
// set of tokens not beaten that way; for every possible cut the winner is on it. Along z-order its
// scores increase, and it is short (about ln V records on flat rows, a few on spiky ones).
//
// frontier_kernel, one read: the row's stats (what stats_kernel writes, for rows handed on to the
// exact filter) and, per block, the tokens that may be on the frontier, screened with the fast
// proxy P = x / T + g_fast: a token is dropped only when a token surely ahead of it in z-order has a
// proxy larger by more than both proxies' error. The last block scores the survivors exactly and
// keeps the exact frontier. min-p alone is decided there (z is known once the max is). top-p needs
// the mass ahead of the last frontier tokens: nucleus_mass_kernel, a second read that starts on each
// row as soon as its frontier is merged, sums it with fast exponentials and decides wherever the sums
// are clear of the cut by their error bound; a second, exact instance re-reads the rare rows they are
// not (filter_kernel's fixed point either way). Rows these kernels cannot settle (k > 0, a frontier
// longer than kFrontierCap, logits beyond kFrontierBound, extreme temperatures, a cut before the
// summed tokens, NaN or +inf where the mass pass would read them) are left to filter_kernel, which
// runs after them and skips the rows marked kRowDecided.
#pragma once
#include "sampling.cuh"

namespace tokensampler {

constexpr int kFrontierCap = 32;        // frontier tokens a block reports, and a row keeps
constexpr int kBlockCandidates = 512;   // screened tokens a block ranks
constexpr int kMergeCap = 1024;         // block reports the last block merges (19 x 32 at V = 151936)
constexpr float kFrontierBound = 1024.f;  // |row max| the screen's margins assume
constexpr float kMinTemperature = 0x1p-6f;  // the pilot levels' T / 4 gap must dwarf the rounding

struct FrontierPartial {
  Stats stats;
  uint32_t count;  // entries below, or kFrontierCap + 1 when the block had more
  float x[kFrontierCap];
  uint32_t id[kFrontierCap];
};

// The frontier tokens whose mass ahead the mass pass sums: the last ones (nucleus_mass_kernel).
constexpr int kMassFrontier = 4;

// A row's frontier in z-order, for the mass pass. Entry j of x_lo, x_above, id_of and ahead is of
// frontier token count - 1 - j (x_lo = x_above = +inf and id_of = 0 when count <= j): the logits whose z
// is its z ([x_lo, x_above), logit_of_z), its id, and the mass of the
// tokens ahead of it; total: of every token min-p keeps. Masses in the fixed point of mass_fixed,
// summed from approximate token masses (kMassTolerance). Zeroed by frontier_kernel, summed by
// nucleus_mass_kernel's blocks.
struct RowFrontier {
  uint32_t count;
  uint64_t order[kFrontierCap];  // rank_key(z, id), descending
  uint64_t score[kFrontierCap];  // rank_key(z + g, id), exact
  float x_lo[kMassFrontier], x_above[kMassFrontier];
  uint32_t id_of[kMassFrontier];
  unsigned long long ahead[kMassFrontier];
  unsigned long long total;
};

__host__ __device__ inline size_t frontier_scratch_bytes(int32_t num_work_rows, int64_t vocab) {
  return sizeof(FrontierPartial) * static_cast<size_t>(num_work_rows) * num_splits(vocab) +
         sizeof(RowFrontier) * static_cast<size_t>(num_work_rows);
}

__device__ __forceinline__ RowFrontier* row_frontier(const TsWorkspace& ws, int w, int splits, int num_work) {
  char* base = static_cast<char*>(ws.scratch) + sizeof(FrontierPartial) * static_cast<size_t>(num_work) * splits;
  return reinterpret_cast<RowFrontier*>(base) + w;
}

// z_j > z_i for z = (x - max) / T in fp32 and every |max| <= kFrontierBound: the gap exceeds what
// the rounding of x - max and of the division can close.
__device__ __forceinline__ bool clearly_above(float xj, float xi) {
  return xj > xi + 0x1p-21f * (fabsf(xi) + fabsf(xj) + kFrontierBound);
}

// Token j is ahead of token i in z-order (z desc, id asc) whatever the row max within the bound.
__device__ __forceinline__ bool surely_ahead(float xj, uint32_t j, float xi, uint32_t i) {
  return clearly_above(xj, xi) || (xj >= xi && j < i);
}

// A bound on the difference between the exact scores' gap (z_j + g_j) - (z_i + g_i) and the
// proxies' gap P_j - P_i: the rounding of x / T, x - max, the division and the sums (|max| <=
// kFrontierBound, |g| <= 17.4), and g_fast's error, with a factor of 4 to spare.
__device__ __forceinline__ float score_margin(float xi, float xj, float inv_t) {
  return 0x1p-19f * ((fabsf(xi) + fabsf(xj) + 2.f * kFrontierBound) * inv_t + 64.f) + 8.f * kGumbelFastError;
}

// Whether beats(j) holds for some j < n, kStep entries a step: a step's shared-memory loads are independent
// and the early exit is tested once a step, not once an entry (the loops this serves ran at a load latency
// an entry). Past the end a step reads the last entry again, which cannot change an "any".
template <int kStep, typename Beats>
__device__ __forceinline__ bool any_entry(unsigned int n, Beats beats) {
  bool any = false;
  for (unsigned int j0 = 0; j0 < n && !any; j0 += kStep) {
#pragma unroll
    for (unsigned int k = 0; k < kStep; ++k) any |= beats(min(j0 + k, n - 1));
  }
  return any;
}

constexpr int kLevels = 16;  // pilot levels: quarter-nat bands of x / T below the block's max

// A thread's part of the chunk as the block stage reads it: its pilot (pick_pilot: the group with the largest
// logit) and its share of the row stats, taken from the groups' maxima where they suffice: the thread max is
// the pilot's largest logit, and its lowest id lies in the pilot, the first group that holds it.
struct ThreadChunk {
  float gx[kGroupsPerThread];  // each group's largest logit
  float x[4];                  // the pilot's logits
  float max, min;              // the largest logit, the smallest finite one (+inf: none)
  int pilot;
  uint32_t argmax;             // lowest id of max (INT_MAX: no finite logit)
};

__device__ __forceinline__ ThreadChunk thread_chunk(const float (&v)[kGroupsPerThread][4], int64_t g0) {
  ThreadChunk c;
  c.pilot = pick_pilot(v, c.gx, c.x, c.max);
  c.min = kInf;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (v[j][e] > -kInf) c.min = fminf(c.min, v[j][e]);
  int first = 3;
#pragma unroll
  for (int e = 3; e >= 0; --e)
    if (c.x[e] == c.max) first = e;
  c.argmax = c.max > -kInf ? static_cast<uint32_t>(token_of(g0, c.pilot, first)) : static_cast<uint32_t>(INT_MAX);
  return c;
}

// What the block stage needs of the whole block at its first barrier: the row stats of the chunk and the best
// pilot key (rank_key of a pilot proxy; 0: no finite logit). As 32-bit keys, so that a warp reduces each with
// one REDUX instead of a five-step butterfly of shuffles.
struct BlockHead {
  uint32_t max, argmax, min, nan;  // order keys of max and min
  uint64_t best;

  __device__ __forceinline__ Stats stats() const {
    return Stats{key_to_float(max), key_to_float(min), 0.f, static_cast<int32_t>(argmax), nan};
  }
};

__device__ __forceinline__ BlockHead warp_head(const BlockHead& h) {
  constexpr unsigned int kAll = 0xffffffffu;
  const uint32_t max = __reduce_max_sync(kAll, h.max);
  return BlockHead{max, __reduce_min_sync(kAll, h.max == max ? h.argmax : ~0u), __reduce_min_sync(kAll, h.min),
                   __reduce_or_sync(kAll, h.nan), warp_max_key(h.best)};
}

// The block's head in every thread: each warp reduces its lanes, then the warps' heads (lane l takes warp l % 8's).
// One barrier.
__device__ __forceinline__ BlockHead block_head(const ThreadChunk& c, bool nan, uint64_t best) {
  __shared__ BlockHead warps[kThreads / 32];
  const BlockHead h = warp_head(BlockHead{order_key(c.max), c.argmax, order_key(c.min), nan ? 1u : 0u, best});
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = h;
  __syncthreads();
  return warp_head(warps[threadIdx.x % (kThreads / 32)]);
}

// The block's frontier candidates (x, P, id) into cand_*: every token whose proxy was computed and
// that no pilot surely beats. Pilots as in gumbel_screened (each thread's group with the largest
// logit; p: its proxies, best: the thread's best pilot key, head.best the block's). A pilot j beats token i
// surely when x_j is clearly above x_i and P_j - P_i exceeds score_margin. Two kinds of pilots are used, so
// that both the tokens below the best pilot l and the few above it get screened: l itself, for every token
// clearly below x_l; and for a token in level k (x / T in [M/T - (k+1)/4, M/T - k/4), M the block max), the
// best posted pilot of levels 0 .. k-2, which lie at least T/4 higher: clearly above it for T >=
// kMinTemperature. A group is screened by its largest logit (a bound for each of its tokens), and a token is
// kept only if its own bound does not drop it. level_best: kLevels zeroed words, ordered before this call.
template <typename T, typename Noise>
__device__ __forceinline__ void frontier_candidates(const ThreadChunk& c, const float (&p)[4], uint64_t best,
                                                    const BlockHead& head, unsigned int* level_best,
                                                    const RowView<T>& rv, int64_t vocab, int64_t g0,
                                                    float temperature, float inv_t, const Noise& noise,
                                                    float* cand_x, float* cand_p, uint32_t* cand_id,
                                                    unsigned int* num_cand) {
  if (head.best == 0) return;  // no finite logit in the chunk
  const float block_max = key_to_float(head.max);
  if (!(fabsf(block_max) <= kFrontierBound)) {  // the margins assume it: leave the row to the filter
    if (threadIdx.x == 0) *num_cand = kBlockCandidates + 1;
    return;
  }
  const uint32_t gbase = static_cast<uint32_t>(g0) + threadIdx.x;
  const uint32_t pg = gbase + c.pilot * kThreads;
  auto level_of = [&](float y) {
    return static_cast<int>(fminf(fmaxf((block_max - y) * inv_t * 4.f, 0.f), kLevels - 1.f));
  };
  __shared__ float best_x;
  if (best == head.best) {  // this thread holds the block's best pilot token
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (rank_key(p[e], 4 * pg + e) == best) best_x = c.x[e];
  }
  // Only levels 0 .. kLevels - 3 bound anything. Each thread's pilot token with the largest proxy stands
  // for its group; a thread posts it where it beats what its level holds.
  float top_x = c.x[0], top_p = p[0];
#pragma unroll
  for (int e = 1; e < 4; ++e)
    if (p[e] > top_p) top_x = c.x[e], top_p = p[e];
  if (top_x > -kInf) {
    const int level = level_of(top_x);
    const uint32_t key = order_key(top_p);
    if (level < kLevels - 2 && key > level_best[level]) atomicMax(level_best + level, key);
  }
  __syncthreads();
  __shared__ float level_bound[kLevels];  // the best pilot proxy of levels 0 .. k-2 (-inf: none)
  if (threadIdx.x < 32) {  // a prefix max of the levels' keys by warp 0 (0: none; posted keys are above it)
    const int lane = threadIdx.x;
    uint32_t key = lane < kLevels ? level_best[lane] : 0u;
#pragma unroll
    for (int o = 1; o < kLevels; o <<= 1) {
      const uint32_t below = __shfl_up_sync(0xffffffffu, key, o);
      if (lane >= o) key = max(key, below);
    }
    const uint32_t two_below = __shfl_up_sync(0xffffffffu, key, 2);
    if (lane < kLevels) level_bound[lane] = lane >= 2 && two_below ? key_to_float(two_below) : -kInf;
  }
  __syncthreads();
  const float xl = best_x, L = key_value(head.best);
  // |x| of any pilot that screens: l, or one within 3.5 T of the block max
  const float pilot_abs = fmaxf(fabsf(xl), fabsf(block_max) + 4.f * temperature);
  // One margin and one "clearly below x_l" cut for all of the thread's tokens, from a bound of their |x|:
  // score_margin grows with |x|, and x < below_l gives x_l - x > 2^-20 (|x_l| + |x| + kFrontierBound) less
  // the cut's rounding, more than clearly_above asks. Both only keep more tokens than per-token tests would.
  const float abs_bound = fmaxf(fabsf(c.max), fabsf(c.min));
  const float margin = score_margin(abs_bound, pilot_abs, inv_t);
  const float below_l = xl - 0x1p-20f * (fabsf(xl) + abs_bound + kFrontierBound);
  // The best proxy of a pilot that surely beats a token at x, minus the margin (-inf: none).
  auto bound = [&](float y) {
    float t = level_bound[level_of(y)];
    if (y < below_l) t = fmaxf(t, L);
    return t - margin;
  };
  auto push = [&](float xe, float pe, uint32_t id) {
    if (!(xe > -kInf) || pe < bound(xe)) return;
    const unsigned int slot = atomicAdd(num_cand, 1u);
    if (slot < kBlockCandidates) cand_x[slot] = xe, cand_p[slot] = pe, cand_id[slot] = id;
  };
#pragma unroll
  for (int e = 0; e < 4; ++e) push(c.x[e], p[e], 4 * pg + e);

  // Word thresholds of the other groups from the bound at their largest logit (screen_word:
  // words below it leave every token of the group under that bound).
  redo_screened_groups(
      c.gx, c.pilot, gbase, rv, vocab, noise,
      [&](float g) {
        const float thr = bound(g);
        return !(g > -kInf) ? ~0u : screen_word(g, inv_t, fmaf(-0x1p-19f, fabsf(thr), thr - 2e-4f));
      },
      [&](float (&y)[4], const uint4& words, uint32_t g) {
#pragma unroll
        for (int e = 0; e < 4; ++e) push(y[e], fmaf(y[e], inv_t, gumbel_fast(word_of(words, e))), 4 * g + e);
      });
}

// The largest (upper) or smallest logit x whose z = scaled(x, row_max, t) is z0. scaled is non-decreasing
// in x, so a token's z compares with z0 as its x compares with the range these two ends bound. In range: z(x)
// <= z0 (upper) or z(x) < z0 (lower); the answer is the last float in range (upper) or the first out of it
// (lower). A walk over adjacent floats from x = z0 t + max finds it in a step or two; a longer walk gives way
// to a bisection over the ordered keys of the floats from -inf to +inf. (The two may differ in the sign of a
// zero, which no comparison of x tells apart.)
__device__ __forceinline__ float logit_of_z(float z0, float row_max, float t, bool upper) {
  auto in_range = [&](float x) {
    const float z = scaled(x, row_max, t);
    return upper ? z <= z0 : z < z0;
  };
  float x = fmaf(z0, t, row_max);
  if (fabsf(x) < kInf) {
    const bool start_in = in_range(x);
    for (int step = 0; step < 16; ++step) {
      if (start_in) {  // up while the next float is in range
        const float up = nextafterf(x, kInf);
        if (!in_range(up)) return upper ? x : up;
        x = up;
      } else {  // down until a float is in range
        const float down = nextafterf(x, -kInf);
        if (in_range(down)) return upper ? down : x;
        x = down;
      }
    }
  }
  uint32_t below = order_key(-kInf), above = order_key(kInf);
  while (above - below > 1) {  // below in range, above out of it
    const uint32_t mid = below + (above - below) / 2;
    if (in_range(key_to_float(mid))) below = mid;
    else above = mid;
  }
  return key_to_float(upper ? below : above);
}

// Writes a decided row's token.
__device__ __forceinline__ void decide_row(const TsOutputs& pre, const TsOutputs& out, int64_t r, uint8_t sflags,
                                           int64_t token) {
  out.tokens[r * out.num_samples + out.sample] = token;
  out.flags[r] = sflags & 3u;
  pre.flags[r] = sflags | kRowDecided;
}

// The last block of a row: row stats, then the exact frontier of the blocks' reports (pool: kernel's shared keys);
// the row decided, left to filter_kernel, or marked kRowNeedsMass with the RowFrontier the mass pass sums against.
// Warp 0 merges the blocks' partials across its lanes (lane i: block i, or i, i + 32, ... when there are more
// blocks than lanes).
template <typename T, typename Noise>
__device__ __forceinline__ void merge_row_frontier(const FrontierPartial* partial, const RowView<T>& rv, int w,
                                                   int splits, const TsRows& rows, const TsOutputs& pre,
                                                   const TsOutputs& out, const TsWorkspace& ws, bool usable,
                                                   float temperature, const Noise& noise, uint64_t* pool) {
  constexpr int kMaxSplits = kMergeCap / kFrontierCap;
  static_assert(kMaxSplits <= 32, "a lane a block's reports");
  __shared__ Stats row;
  __shared__ unsigned int first[kMaxSplits + 1];  // where each block's reports start
  __shared__ bool settle;
  if (threadIdx.x < 32) {
    const bool mergeable = splits <= kMaxSplits;  // then each lane holds one block's partial at most
    Stats acc = no_stats();
    unsigned int count = 0;
    for (int i = threadIdx.x; i < splits; i += 32) {
      const FrontierPartial* q = partial + i;
      acc = merge_stats(acc, Stats{__ldcg(&q->stats.max), __ldcg(&q->stats.min), 0.f, __ldcg(&q->stats.argmax),
                                   __ldcg(&q->stats.nan)}, 0.f, false);
      count = __ldcg(&q->count);
    }
    acc = warp_stats_allmerge(acc, 0.f, false);
    unsigned int end = count;  // the counts' inclusive prefix sum
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned int t = __shfl_up_sync(0xffffffffu, end, o);
      if (static_cast<int>(threadIdx.x) >= o) end += t;
    }
    const bool counts_fit = __all_sync(0xffffffffu, count <= kFrontierCap);
    const unsigned int total = __shfl_sync(0xffffffffu, end, 31);
    if (mergeable && static_cast<int>(threadIdx.x) < splits) first[threadIdx.x] = end - count;
    if (threadIdx.x == 0) {
      row = acc;
      const bool valid = acc.max > -kInf;
      const uint8_t sflags = static_cast<uint8_t>((acc.nan ? TS_ROW_NAN : 0) | (valid ? 0 : TS_ROW_INVALID));
      pre.row_max[rv.r] = acc.max;
      pre.row_min[rv.r] = acc.min;
      pre.tokens[rv.r] = valid ? acc.argmax : -1;
      pre.flags[rv.r] = sflags;
      const bool fits = usable && mergeable && counts_fit && fabsf(acc.max) <= kFrontierBound;
      settle = valid && fits;
      if (!valid) decide_row(pre, out, rv.r, sflags, -1);
      else if (!fits && ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
      if (mergeable) first[splits] = total;
    }
  }
  __syncthreads();
  if (!settle) return;

  const float row_max = row.max;
  const unsigned int total = first[splits];
  uint64_t* order = pool;
  uint64_t* score = pool + kMergeCap;
  __shared__ bool on_frontier[kMergeCap];
  for (unsigned int i = threadIdx.x; i < total; i += kThreads) {
    int b = 0;
    while (first[b + 1] <= i) ++b;
    const FrontierPartial* q = partial + b;
    const uint32_t id = __ldcg(&q->id[i - first[b]]);
    const float z = scaled(__ldcg(&q->x[i - first[b]]), row_max, temperature);
    order[i] = rank_key(z, id);
    score[i] = gumbel_key(z, id, noise);
  }
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < total; i += kThreads) {
    const uint64_t oi = order[i], si = score[i];
    on_frontier[i] = !any_entry<8>(total, [&](unsigned int j) { return (order[j] > oi) & (score[j] > si); });
  }
  __syncthreads();
  __shared__ uint64_t f_order[kFrontierCap], f_score[kFrontierCap];
  __shared__ unsigned int num_frontier;
  if (threadIdx.x == 0) num_frontier = 0;
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < total; i += kThreads) {
    if (!on_frontier[i]) continue;
    atomicAdd(&num_frontier, 1u);
    const uint64_t oi = order[i];
    unsigned int pos = 0;  // its place in z-order among the frontier
#pragma unroll 8
    for (unsigned int j = 0; j < total; ++j) pos += on_frontier[j] & (order[j] > oi);
    if (pos < kFrontierCap) f_order[pos] = order[i], f_score[pos] = score[i];
  }
  __syncthreads();
  const float p = rows.top_p[rv.r], m = rows.min_p[rv.r];
  if (threadIdx.x == 0) {
    // The tokens min-p drops, a tail of z-order, never win: the frontier that matters is the rest
    // (the argmax always passes min-p). num_frontier is read inside the branch: as `threadIdx.x == 0 &&
    // num_frontier <= kFrontierCap` every thread loaded it while thread 0 stored it (racecheck).
    unsigned int c = num_frontier;
    if (c <= kFrontierCap) {
      while (c > 1 && !passes_min_p(key_value(f_order[c - 1]), m)) --c;
      num_frontier = c;
    }
  }
  __syncthreads();
  const unsigned int count = num_frontier;
  RowFrontier* rf = row_frontier(ws, w, splits, gridDim.y);
  if (count <= kFrontierCap && count > 1 && p < 1.f && threadIdx.x < 2 * kFrontierCap) {
    // the mass pass's x ranges, one bisection a thread: x_above by threads 0.., x_lo by threads 32..
    const unsigned int j = threadIdx.x % kFrontierCap;
    const bool upper = threadIdx.x < kFrontierCap;
    if (j < min(count, static_cast<unsigned int>(kMassFrontier))) {
      const float x = logit_of_z(key_value(f_order[count - 1 - j]), row_max, temperature, upper);
      if (upper) rf->x_above[j] = key_to_float(order_key(x) + 1);  // the next float up (x < +inf)
      else rf->x_lo[j] = x;
    }
  }
  if (threadIdx.x != 0) return;
  const uint8_t sflags = pre.flags[rv.r];
  if (count > kFrontierCap) {
    if (ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
    return;
  }
  if (!(p < 1.f) || count == 1) {  // min-p alone, or one token left: the last has the best score
    decide_row(pre, out, rv.r, sflags, key_index(f_score[count - 1]));
    return;
  }
  if (sflags & 1u) {  // NaN or +inf in the row: the mass pass reads logits unsanitized, so filter_kernel decides
    if (ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
    return;
  }
  rf->count = count;
  for (unsigned int i = 0; i < count; ++i) rf->order[i] = f_order[i], rf->score[i] = f_score[i];
  for (unsigned int j = 0; j < kMassFrontier; ++j) {
    rf->id_of[j] = j < count ? key_index(f_order[count - 1 - j]) : 0u;
    if (j >= count) rf->x_lo[j] = rf->x_above[j] = kInf;
    rf->ahead[j] = 0;
  }
  rf->total = 0;
  pre.flags[rv.r] = sflags | kRowNeedsMass;
}

// The mass pass waits for each row's merge, not for the whole frontier grid (programmatic dependent launch starts
// it once every frontier block has started, so none of them can be kept from finishing): frontier_kernel's blocks
// leave the row's counter at splits (finish_by_thread0_and_elect_last without the reset), its last block marks the
// merge by one more, and the mass pass's blocks count on from splits + 1; its last block returns the counter to 0.
__device__ __forceinline__ void mark_row_merged(unsigned int* counter) {
  __syncthreads();  // the merge's writes ordered before thread 0's fence
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

__device__ __forceinline__ void wait_until_row_merged(const unsigned int* counter, unsigned int merged) {
  if (threadIdx.x == 0) {
    unsigned int seen;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      if (seen >= merged) break;
      __nanosleep(256);
    }
  }
  __syncthreads();  // with thread 0's acquire, the other threads' reads of the row's results come after the merge
}

// Five blocks a SM at 48 registers, with Philox's split products (philox.cuh, PhiloxProducts): with the wide form
// the kernel needs 64 registers (four blocks), or spills at 48.
template <typename T, bool kMask>
__global__ void __launch_bounds__(kThreads, 5)
    frontier_kernel(TsLogits logits, TsRows rows, TsOutputs pre, TsOutputs out, TsWorkspace ws) {
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  let_next_grid_launch();  // the mass pass waits for each row's merge (wait_until_row_merged), not the grid
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  const float temperature = rows.temperature[rv.r];
  const float inv_t = 1.f / temperature;
  // Rows the frontier can settle: no top-k, and temperatures that keep the proxies and the
  // rounding bounds above valid (the last block also checks the row max).
  const bool usable = rows.top_k[rv.r] <= 0 && temperature >= kMinTemperature && temperature <= 0x1p20f;
  const auto noise =
      row_noise(rows, rv.r, static_cast<uint32_t>(out.sample)).template with_products<PhiloxProducts::kSplit>();

  float v[kGroupsPerThread][4];
  const bool nan = load_chunk(rv, logits.vocab, g0, v);
  const ThreadChunk chunk = thread_chunk(v, g0);
  // The pilot's proxies (rows the frontier can settle only).
  float pilot_p[4] = {-kInf, -kInf, -kInf, -kInf};
  uint64_t best = 0;
  if (usable) {
    const uint32_t pg = static_cast<uint32_t>(g0) + threadIdx.x + chunk.pilot * kThreads;
    const uint4 words = noise.group(pg);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pilot_p[e] = fmaf(chunk.x[e], inv_t, gumbel_fast(word_of(words, e)));
      if (chunk.x[e] > -kInf) best = max(best, rank_key(pilot_p[e], 4 * pg + e));
    }
  }

  // One pool: the block's candidates, then (last block) the merged reports' keys.
  __shared__ uint64_t pool[2 * kMergeCap];
  float* cand_x = reinterpret_cast<float*>(pool);
  float* cand_p = cand_x + kBlockCandidates;
  uint32_t* cand_id = reinterpret_cast<uint32_t*>(cand_p + kBlockCandidates);
  __shared__ unsigned int num_cand, num_kept, level_best[kLevels];
  if (threadIdx.x == 0) num_cand = 0, num_kept = 0;
  if (threadIdx.x < kLevels) level_best[threadIdx.x] = 0;
  const BlockHead head = block_head(chunk, nan, best);  // its barrier orders the zeroing above
  if (usable)
    frontier_candidates(chunk, pilot_p, best, head, level_best, rv, logits.vocab, g0, temperature, inv_t, noise, cand_x,
                        cand_p, cand_id, &num_cand);
  __syncthreads();

  FrontierPartial* partial = static_cast<FrontierPartial*>(ws.scratch) + static_cast<int64_t>(w) * splits;
  FrontierPartial& mine = partial[split];
  const unsigned int n = min(num_cand, static_cast<unsigned int>(kBlockCandidates));
  for (unsigned int i = threadIdx.x; i < n; i += kThreads) {
    const float xi = cand_x[i], pi = cand_p[i];
    const uint32_t id = cand_id[i];
    const bool beaten = any_entry<4>(n, [&](unsigned int j) {
      const float xj = cand_x[j];
      return (j != i) & surely_ahead(xj, cand_id[j], xi, id) & (cand_p[j] - pi > score_margin(xi, xj, inv_t));
    });
    if (!beaten) {
      const unsigned int slot = atomicAdd(&num_kept, 1u);
      if (slot < kFrontierCap) mine.x[slot] = xi, mine.id[slot] = id;
    }
  }
  __syncthreads();  // num_kept final; the reports ordered before thread 0's fence (finish_by_thread0_and_elect_last)
  if (threadIdx.x == 0) {
    mine.stats = head.stats();
    mine.count = num_cand > kBlockCandidates ? kFrontierCap + 1 : min(num_kept, kFrontierCap + 1u);
  }
  if (!finish_by_thread0_and_elect_last(ws.counters + w, splits, 0, false)) return;  // not reset: mark_row_merged
  merge_row_frontier(partial, rv, w, splits, rows, pre, out, ws, usable, temperature, noise, pool);
  mark_row_merged(ws.counters + w);
}

// The approximate mass pass sums token masses 2^((x - max) * log2(e) / T) by the hardware exp2.
// Against expf(z) of filter_kernel's exact z the relative error is below 4 |z| 2^-24 (the roundings of
// the product) + 2^-21 (exp2, expf): under 2^-17 for |z| <= 20, where all but 2^-25 of any sum lies;
// under 2^-15 for every result not flushed (|z| <= 87.4). Fp32 sums of a thread's <= 64 terms (two chunks) add 63
// roundings (2^-18); each thread's sums then move to the units of mass_fixed, where integer sums are exact,
// with half a unit a thread, less than half a unit a token against the exact fixed point (2^-23 of a total
// >= 1, the argmax's mass). Every sum is within 2^-16 of the row's total of the exact fixed-point sum;
// kMassTolerance leaves a factor of 4.
constexpr double kMassTolerance = 0x1p-14;

__device__ __forceinline__ unsigned long long mass_units(float mass) { return __float2ull_rn(mass * 0x1p40f); }

// Whether min-p keeps a token (expf(z) >= m), from its approximate mass a when that is clear of m by
// more than its error (a > 0 is a normal number, within 2^-15 of expf(z); a flushed 0 stands for
// less than 2^-126); otherwise from the exact z. For m > 0.
__device__ __forceinline__ bool min_p_keeps(float a, float x, float row_max, float temperature, float m) {
  if (a >= m * (1.f + 0x1p-14f)) return true;
  if (a < m * (1.f - 0x1p-14f) && m >= 0x1p-100f) return false;
  return passes_min_p(scaled(x, row_max, temperature), m);
}

// What a mass pass needs of its row (RowFrontier's fields, the row's max, T and min-p).
struct MassRow {
  RowFrontier* rf;
  float x_lo[kMassFrontier], x_above[kMassFrontier];
  uint32_t id_of[kMassFrontier];
  float row_max, temperature, min_p;
  float c2;  // log2(e) / T: a mass is 2^((x - max) c2)
};

__device__ __forceinline__ MassRow mass_row(RowFrontier* rf, float row_max, float temperature, float min_p) {
  MassRow m;
  m.rf = rf;
#pragma unroll
  for (int j = 0; j < kMassFrontier; ++j) m.x_lo[j] = rf->x_lo[j], m.x_above[j] = rf->x_above[j], m.id_of[j] = rf->id_of[j];
  m.row_max = row_max, m.temperature = temperature, m.min_p = min_p;
  m.c2 = kLog2e / temperature;
  return m;
}

// A token's mass in a pass's units: mass_fixed of the exact z (exact pass), or the hardware exp2 (0 for
// the tokens min-p drops, and for -inf).
template <bool kExact, bool kMinP>
__device__ __forceinline__ std::conditional_t<kExact, unsigned long long, float> token_mass(float x, const MassRow& m) {
  if constexpr (kExact) {
    const float z = scaled(x, m.row_max, m.temperature);
    return x > -kInf && passes_min_p(z, m.min_p) ? mass_fixed(z) : 0ull;
  } else {
    // -inf gives 0 unasked: x - max stays -inf (the rows here have a finite max), and ex2 of -inf is +0
    const float a = fast_exp2(__fsub_rn(x, m.row_max) * m.c2);
    return kMinP && !min_p_keeps(a, x, m.row_max, m.temperature, m.min_p) ? 0.f : a;
  }
}

// The approximate sums of this thread's tokens (load_chunk_raw's v: the mass pass's rows hold no NaN or +inf;
// g0: the chunk's first group). Token i is ahead of summed frontier token f when x >= x_above[f], or x >= x_lo[f]
// and i < id_of[f]. A group of four ids lies wholly on one side of id_of[f] but for the one group a row that holds
// it, so a group tests x against one threshold a frontier token: x_lo[f] when its ids are below, else x_above[f].
// The group holding id_of[f] takes the latter, and its thread first adds what that leaves out: its tokens below
// id_of[f] with x in [x_lo[f], x_above[f]). Each token still enters each sum at most once. kSplit: some id_of[f]
// lies inside the chunk (chunk_is_split), so the threshold varies by group; otherwise one threshold serves the
// whole chunk, and the token loop is the exp2, the total and a compare and an add a frontier token.
template <typename T, bool kMinP, bool kSplit>
__device__ __forceinline__ void approximate_sums(const float (&v)[kGroupsPerThread][4], int64_t g0, const RowView<T>& rv,
                                                 int64_t vocab, const MassRow& m, float& total,
                                                 float (&ahead)[kMassFrontier]) {
  const uint32_t chunk_end = static_cast<uint32_t>(4 * (g0 + kChunkGroups));
  float uniform[kMassFrontier];
#pragma unroll
  for (int f = 0; f < kMassFrontier; ++f) uniform[f] = m.id_of[f] >= chunk_end ? m.x_lo[f] : m.x_above[f];
#pragma unroll
  for (int f = 0; f < kMassFrontier && kSplit; ++f) {
    const uint32_t id = m.id_of[f];
    // kThreads x the holding group's j, in 32 bits as every group index is
    const int held = static_cast<int>(id / 4 - static_cast<uint32_t>(g0) - threadIdx.x);
    static_assert((kThreads & (kThreads - 1)) == 0, "held % kThreads as a mask");
    if (id % 4 != 0 && held >= 0 && (held & (kThreads - 1)) == 0 && held < kThreads * kGroupsPerThread) {
      float y[4];
      load_row_group(rv, id / 4, vocab, y);
      for (uint32_t e = 0; e < id % 4; ++e)
        if (y[e] >= m.x_lo[f] && y[e] < m.x_above[f]) ahead[f] += token_mass<false, kMinP>(y[e], m);
    }
  }
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j) {
    const uint32_t first = static_cast<uint32_t>(token_of(g0, j, 0));
    float threshold[kMassFrontier];
#pragma unroll
    for (int f = 0; f < kMassFrontier; ++f)
      threshold[f] = !kSplit ? uniform[f] : first + 3 < m.id_of[f] ? m.x_lo[f] : m.x_above[f];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = v[j][e], a = token_mass<false, kMinP>(x, m);
      total += a;
#pragma unroll
      for (int f = 0; f < kMassFrontier; ++f)
        if (x >= threshold[f]) ahead[f] += a;
    }
  }
}

// Whether some summed frontier token's id lies inside the chunk from group g0 (past its first token): then
// approximate_sums' threshold varies by group. At most kMassFrontier of a row's chunks are.
__device__ __forceinline__ bool chunk_is_split(const MassRow& m, int64_t g0) {
  const uint32_t begin = static_cast<uint32_t>(4 * g0), end = static_cast<uint32_t>(4 * (g0 + kChunkGroups));
  bool split = false;
#pragma unroll
  for (int f = 0; f < kMassFrontier; ++f) split |= m.id_of[f] > begin && m.id_of[f] < end;
  return split;
}

// The exact sums of this thread's group g (ids 4 g ..): the plain test of each token against each frontier token.
__device__ __forceinline__ void exact_sums(const float (&x)[4], int64_t g, const MassRow& m, unsigned long long& total,
                                           unsigned long long (&ahead)[kMassFrontier]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const unsigned long long a = token_mass<true, true>(x[e], m);
    const uint32_t id = static_cast<uint32_t>(4 * g + e);
    total += a;
#pragma unroll
    for (int f = 0; f < kMassFrontier; ++f)
      if (x[e] >= m.x_above[f] || (x[e] >= m.x_lo[f] && id < m.id_of[f])) ahead[f] += a;
  }
}

// A warp's sum of mass units (< 2^51 a lane), exact: REDUX adds the 24-bit low parts and the high parts apart,
// and 32 of either cannot carry out of 32 bits.
__device__ __forceinline__ unsigned long long warp_sum_units(unsigned long long u) {
  const uint32_t lo = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(u & 0xFFFFFFu));
  const uint32_t hi = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(u >> 24));
  return (static_cast<unsigned long long>(hi) << 24) + lo;
}

// The block's sums into the row's (integer units, so the order of the blocks cannot change them), then
// finish_by_thread0_and_elect_last. Each lane's sums move to units, each warp adds its lanes', and lanes
// 0 .. kMassFrontier of warp 0 add the warps' and post them: two barriers in all.
template <typename Mass>
__device__ __forceinline__ bool post_block_sums_and_elect_last(Mass total, const Mass (&ahead)[kMassFrontier],
                                                               RowFrontier* rf, unsigned int* counter,
                                                               unsigned int blocks, unsigned int start) {
  auto units = [](Mass s) -> unsigned long long {
    if constexpr (std::is_same_v<Mass, float>) return mass_units(s);
    else return s;
  };
  __shared__ unsigned long long warp_sums[kMassFrontier + 1][kThreads / 32];  // ahead[0 ..], total
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long warp_total = warp_sum_units(units(total));
  if (lane == 0) warp_sums[kMassFrontier][warp] = warp_total;
#pragma unroll
  for (int f = 0; f < kMassFrontier; ++f) {
    const unsigned long long sum = warp_sum_units(units(ahead[f]));
    if (lane == 0) warp_sums[f][warp] = sum;
  }
  __syncthreads();
  if (threadIdx.x <= kMassFrontier) {
    unsigned long long sum = 0;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) sum += warp_sums[threadIdx.x][i];
    if (sum) atomicAdd(threadIdx.x < kMassFrontier ? &rf->ahead[threadIdx.x] : &rf->total, sum);
  }
  __syncwarp();  // the sums ordered before thread 0's fence (finish_by_thread0_and_elect_last)
  return finish_by_thread0_and_elect_last(counter, blocks, start);
}

// The top-p decision from a row's summed masses, by the last block of the row (thread 0): the winner is the last
// frontier token top-p keeps (mass ahead < p x total; scores grow along the frontier), as filter_kernel's fixed
// point decides it. The approximate pass decides when its sums are clear of p x total by kMassTolerance and lists
// the closer rows for the exact pass (tolerance 0). The mass ahead grows along the frontier, so the earlier
// tokens are kept whenever the first summed one is; a cut before it (the mass ahead of the fourth last frontier
// token above p: under 1 % of flat rows at p = 0.5) goes to filter_kernel.
template <bool kExact>
__device__ __forceinline__ void decide_top_p(const MassRow& m, float p, int64_t r, uint8_t sflags, const TsOutputs& pre,
                                             const TsOutputs& out, const TsWorkspace& ws) {
  RowFrontier* rf = m.rf;
  const unsigned int count = rf->count;
  const double total_mass = static_cast<double>(__ldcg(&rf->total));
  const double tol = kExact ? 0. : kMassTolerance * total_mass;
  const unsigned int first_summed = count > kMassFrontier ? count - kMassFrontier : 0;
  unsigned int kept = first_summed;  // frontier tokens 0 .. kept - 1 are kept
  bool clear = true;                 // every summed token's side of the cut is certain
  for (unsigned int i = first_summed; i < count; ++i) {
    const double before = static_cast<double>(__ldcg(&rf->ahead[count - 1 - i]));
    // nothing ahead (the argmax): kept at any p > 0; a token with mass ahead has a sum above 0
    if (before == 0. || before + tol < p * (total_mass - tol)) {
      kept = i + 1;
      continue;
    }
    clear = before - tol >= p * (total_mass + tol);
    break;
  }
  if (!clear) {  // too near the cut for the approximate sums (never with tol 0): the exact pass sums the row again
    if constexpr (!kExact) {
      for (int j = 0; j < kMassFrontier; ++j) rf->ahead[j] = 0;
      rf->total = 0;
      pre.flags[r] = sflags | kRowNeedsExact;
    }
  } else if (kept > first_summed) {
    decide_row(pre, out, r, sflags & ~kRowNeedsMass, key_index(rf->score[kept - 1]));
  } else {  // the cut lies before the summed tokens: filter_kernel places it
    pre.flags[r] = sflags & ~kRowNeedsMass;
    if (ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
  }
}

// One chunk's approximate sums (from group g0) added to the thread's, by the variant of approximate_sums that the
// chunk and the row need.
template <typename T>
__device__ __forceinline__ void add_chunk_sums(const float (&v)[kGroupsPerThread][4], int64_t g0, const RowView<T>& rv,
                                               int64_t vocab, const MassRow& m, float& total,
                                               float (&ahead)[kMassFrontier]) {
  const bool split_chunk = chunk_is_split(m, g0);
  if (m.min_p > 0.f) {
    if (split_chunk) approximate_sums<T, true, true>(v, g0, rv, vocab, m, total, ahead);
    else approximate_sums<T, true, false>(v, g0, rv, vocab, m, total, ahead);
  } else {
    if (split_chunk) approximate_sums<T, false, true>(v, g0, rv, vocab, m, total, ahead);
    else approximate_sums<T, false, false>(v, g0, rv, vocab, m, total, ahead);
  }
}

// Chunks a mass-pass block sums. The work a block does once (the wait for its row, the row's parameters, posting
// the sums and the count) is about 45 % of a one-chunk block's instructions, so grids of several waves take two
// chunks a block; smaller ones keep one, so that their blocks still fill the GPU.
constexpr int kMassChunksPerBlockFrom = 2048;  // rows x chunks

// Every block gets a chunk: with b = ceil(splits / 2) blocks, 2 (b - 1) < splits.
__host__ __device__ inline int mass_blocks_per_row(int32_t num_work_rows, int splits) {
  const bool two = static_cast<int64_t>(num_work_rows) * splits >= kMassChunksPerBlockFrom;
  return two ? (splits + 1) / 2 : splits;
}

// The approximate mass pass over the rows frontier_kernel left with kRowNeedsMass: one read summing the mass
// min-p keeps and the mass ahead of each of the last kMassFrontier frontier tokens, one or two chunks a block
// (mass_blocks_per_row). A block's sums are fp32 over at most 64 tokens a thread (kMassTolerance's bound).
template <typename T, bool kMask>
__global__ void __launch_bounds__(kThreads, 5)
    nucleus_mass_kernel(TsLogits logits, TsRows rows, TsOutputs pre, TsOutputs out, TsWorkspace ws) {
  // Rows in order: the first rows' merges are long done when the grid starts, while the frontier kernel's last
  // wave still reads the last rows (an order starting from the rows just before that wave, the likeliest still in
  // L2, measured 2 % slower at B = 256: docs/design/top-p-frontier.md).
  const int w = blockIdx.y, blocks = gridDim.x, splits = num_splits(logits.vocab);
  const int per_block = (splits + blocks - 1) / blocks;
  const int first_chunk = blockIdx.x * per_block, end_chunk = min(splits, first_chunk + per_block);
  unsigned int* counter = ws.counters + w;
  const unsigned int merged = splits + 1;
  wait_until_row_merged(counter, merged);
  const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
  const uint8_t sflags = pre.flags[rv.r];
  if (!(sflags & kRowNeedsMass)) {
    finish_by_thread0_and_elect_last(counter, blocks, merged);  // the count still returns to 0
    return;
  }
  const MassRow m = mass_row(row_frontier(ws, w, splits, gridDim.y), pre.row_max[rv.r], rows.temperature[rv.r],
                             rows.min_p[rv.r]);
  float total = 0.f, ahead[kMassFrontier] = {0.f, 0.f, 0.f, 0.f};
  for (int chunk = first_chunk; chunk < end_chunk; ++chunk) {
    // Each chunk's read and its sums in one basic block: with the first read ahead of the loop, ptxas took every
    // token's exponent as ready at once, scheduled them all first and spilled.
    const int64_t g0 = static_cast<int64_t>(chunk) * kChunkGroups;
    float v[kGroupsPerThread][4];
    load_chunk_raw(rv, logits.vocab, g0, v);
    add_chunk_sums(v, g0, rv, logits.vocab, m, total, ahead);
  }
  if (post_block_sums_and_elect_last(total, ahead, m.rf, counter, blocks, merged) && threadIdx.x == 0)
    decide_top_p<false>(m, rows.top_p[rv.r], rv.r, sflags, pre, out, ws);
}

// The exact mass pass over the rows the approximate one marked kRowNeedsExact (rare: cuts within kMassTolerance of
// a summed token's mass ahead), in filter_kernel's own fixed point. Each chunk is split kExactParts ways, one group
// of four a thread, and the blocks loop over (marked row, chunk, part): the exact arithmetic is a long chain a
// token, so a row's sums take the latency of a few tokens instead of 32, and a launch with no marked row costs a
// small grid of blocks that exit after reading the flags.
constexpr int kExactParts = kGroupsPerThread;
constexpr int kExactRowsAtOnce = 2;  // marked rows whose blocks the grid holds at once

template <typename T, bool kMask>
__global__ void __launch_bounds__(kThreads)
    nucleus_exact_mass_kernel(TsLogits logits, TsRows rows, TsOutputs pre, TsOutputs out, TsWorkspace ws) {
  wait_for_previous_grid();
  const int splits = num_splits(logits.vocab), num_work = rows.num_work_rows;
  const unsigned int parts = static_cast<unsigned int>(splits) * kExactParts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ int32_t marked_rows[kThreads];
  __shared__ unsigned int warp_marked[kThreads / 32];
  for (int w0 = 0; w0 < num_work; w0 += kThreads) {
    // The marked rows of work rows w0 .., in row order, so that every block lists them alike.
    const int mine = w0 + static_cast<int>(threadIdx.x);
    const bool marked = mine < num_work && (pre.flags[row_view<T, false>(logits, rows, mine).r] & kRowNeedsExact);
    const unsigned int ballot = __ballot_sync(0xffffffffu, marked);
    if (lane == 0) warp_marked[warp] = __popc(ballot);
    __syncthreads();
    unsigned int before = __popc(ballot & ((1u << lane) - 1u)), num_marked = 0;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) {
      before += i < warp ? warp_marked[i] : 0u;
      num_marked += warp_marked[i];
    }
    if (marked) marked_rows[before] = mine;
    __syncthreads();
    for (unsigned int item = blockIdx.x; item < num_marked * parts; item += gridDim.x) {
      const int w = marked_rows[item / parts];
      const RowView<T> rv = row_view<T, kMask>(logits, rows, w);
      const MassRow m = mass_row(row_frontier(ws, w, splits, num_work), pre.row_max[rv.r], rows.temperature[rv.r],
                                 rows.min_p[rv.r]);
      const int64_t g = (item % parts) * static_cast<int64_t>(kThreads) + threadIdx.x;  // chunk-major, as the chunks
      float x[4];
      load_row_group(rv, g, logits.vocab, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) sanitize(x[e]);
      unsigned long long total = 0, ahead[kMassFrontier] = {0, 0, 0, 0};
      exact_sums(x, g, m, total, ahead);
      if (post_block_sums_and_elect_last(total, ahead, m.rf, ws.counters + w, parts, 0) && threadIdx.x == 0)
        decide_top_p<true>(m, rows.top_p[rv.r], rv.r, pre.flags[rv.r] & ~kRowNeedsExact, pre, out, ws);
    }
    __syncthreads();  // marked_rows and warp_marked read before the next rows' are written
  }
}

}  // namespace tokensampler
