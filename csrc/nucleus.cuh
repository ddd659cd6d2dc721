// Top-p and min-p without k, decided from a frontier of candidates instead of the binned cut of
// filter_kernel (launchers: sampling.cu; notes: benchmarks/NOTES.md, "frontier").
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
// the mass ahead of each frontier token: nucleus_mass_kernel, a second read, sums it exactly in the
// fixed point of filter_kernel and decides. Rows these kernels cannot settle (k > 0, a frontier
// longer than kFrontierCap, logits beyond kFrontierBound, extreme temperatures) are left to
// filter_kernel, which runs after them and skips the rows marked kRowDecided.
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

// A row's frontier in z-order, for the mass pass. ahead[i]: the mass of the tokens ahead of
// frontier token i but not of token i - 1; total: of every token min-p keeps. Zeroed by
// frontier_kernel, summed by nucleus_mass_kernel's blocks.
struct RowFrontier {
  uint32_t count;
  uint64_t order[kFrontierCap];  // rank_key(z, id), descending
  uint64_t score[kFrontierCap];  // rank_key(z + g, id), exact
  unsigned long long ahead[kFrontierCap];
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

constexpr int kLevels = 16;  // pilot levels: quarter-nat bands of x / T below the block's max

// The block's frontier candidates (x, P, id) into cand_*: every token whose proxy was computed and
// that no pilot surely beats. Pilots as in gumbel_screened (each thread's group with the largest
// logit). A pilot j beats token i surely when x_j is clearly above x_i and P_j - P_i exceeds
// score_margin. Two kinds of pilots are used, so that both the tokens below the best pilot l and
// the few above it get screened: l itself, for every token clearly below x_l; and for a token in
// level k (x / T in [M/T - (k+1)/4, M/T - k/4), M the block max), the best pilot of levels 0 .. k-2,
// which lie at least T/4 higher: clearly above it for T >= kMinTemperature. A group is screened by
// its largest logit (a bound for each of its tokens), and a token is kept only if its own bound
// does not drop it.
template <typename T>
__device__ __forceinline__ void frontier_candidates(const float (&v)[kGroupsPerThread][4], const RowView<T>& rv,
                                                    int64_t vocab, int64_t g0, float temperature, float inv_t,
                                                    const NoiseStream& noise, float* cand_x, float* cand_p,
                                                    uint32_t* cand_id, unsigned int* num_cand) {
  constexpr int kSlots = kGroupsPerThread - 1;
  const uint32_t gbase = static_cast<uint32_t>(g0) + threadIdx.x;
  float gx[kGroupsPerThread];
  float x[4];
  float thread_max;
  const int pilot = pick_pilot(v, gx, x, thread_max);
  const uint32_t pg = gbase + pilot * kThreads;
  float p[4];
  uint64_t best = 0;  // (order_key(P), ~id) of the thread's best pilot token
  {
    const uint4 words = noise.group(pg);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = fmaf(x[e], inv_t, gumbel_fast(word_of(words, e)));
      if (x[e] > -kInf) best = max(best, rank_key(p[e], 4 * pg + e));
    }
  }
  __shared__ uint64_t warp_best[kThreads / 32];
  __shared__ float warp_max[kThreads / 32], best_x;
  __shared__ unsigned int level_best[kLevels];  // order keys of the levels' best pilot proxies
  if (threadIdx.x < kLevels) level_best[threadIdx.x] = 0;
  best = warp_allreduce(best, MaxOp{});
  thread_max = warp_allreduce(thread_max, MaxOp{});
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best, warp_max[threadIdx.x >> 5] = thread_max;
  __syncthreads();
  best = warp_best[0];
  float block_max = warp_max[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) best = max(best, warp_best[i]), block_max = fmaxf(block_max, warp_max[i]);
  if (best == 0) return;  // no finite logit in the chunk
  if (!(fabsf(block_max) <= kFrontierBound)) {  // the margins assume it: leave the row to the filter
    if (threadIdx.x == 0) *num_cand = kBlockCandidates + 1;
    return;
  }
  auto level_of = [&](float y) { return static_cast<int>(fminf(fmaxf((block_max - y) * inv_t * 4.f, 0.f), kLevels - 1.f)); };
  // Only levels 0 .. kLevels - 3 bound anything; a warp posts one maximum per level it holds.
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (rank_key(p[e], 4 * pg + e) == best) best_x = x[e];
    const int level = x[e] > -kInf ? level_of(x[e]) : kLevels;
    const unsigned int peers = __match_any_sync(0xffffffffu, level);
    const unsigned int top = __reduce_max_sync(peers, order_key(p[e]));
    if (level < kLevels - 2 && (threadIdx.x & 31) == __ffs(peers) - 1) atomicMax(&level_best[level], top);
  }
  __syncthreads();
  __shared__ float level_bound[kLevels];  // the best pilot proxy of levels 0 .. k-2 (-inf: none)
  if (threadIdx.x < kLevels) {
    float t = -kInf;
    for (int i = 0; i + 2 <= static_cast<int>(threadIdx.x); ++i)
      if (level_best[i]) t = fmaxf(t, key_to_float(level_best[i]));
    level_bound[threadIdx.x] = t;
  }
  __syncthreads();
  const float xl = best_x, L = key_value(best);
  // |x| of any pilot that screens: l, or one within 3.5 T of the block max
  const float pilot_abs = fmaxf(fabsf(xl), fabsf(block_max) + 4.f * temperature);
  // The best proxy of a pilot that surely beats a token at x, minus the margin (-inf: none).
  auto bound = [&](float y) {
    float t = level_bound[level_of(y)];
    if (clearly_above(xl, y)) t = fmaxf(t, L);
    return t - score_margin(y, pilot_abs, inv_t);
  };
  auto push = [&](float xe, float pe, uint32_t id) {
    if (!(xe > -kInf) || pe < bound(xe)) return;
    const unsigned int slot = atomicAdd(num_cand, 1u);
    if (slot < kBlockCandidates) cand_x[slot] = xe, cand_p[slot] = pe, cand_id[slot] = id;
  };
#pragma unroll
  for (int e = 0; e < 4; ++e) push(x[e], p[e], 4 * pg + e);

  // Word thresholds of the other groups from the bound at their largest logit (screen_word:
  // words below it leave every token of the group under that bound).
  uint32_t th[kSlots];
  uint32_t need = 0;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const float g = i >= pilot ? gx[i + 1] : gx[i];
    const float thr = bound(g);
    th[i] = !(g > -kInf) ? ~0u : screen_word(g, inv_t, fmaf(-0x1p-19f, fabsf(thr), thr - 2e-4f));
    if (th[i] < kNoWordPasses) need |= 1u << i;
  }
  uint32_t gmask = groups_with_passing_words(th, need, pilot, gbase, noise);
  while (gmask) {
    const int j = __ffs(gmask) - 1;
    gmask &= gmask - 1;
    const uint32_t g = gbase + j * kThreads;
    float y[4];
    load_group(rv.row, g, vocab, rv.aligned, y);
#pragma unroll
    for (int e = 0; e < 4; ++e) sanitize(y[e]);
    const uint4 words = noise.group(g);
#pragma unroll
    for (int e = 0; e < 4; ++e) push(y[e], fmaf(y[e], inv_t, gumbel_fast(word_of(words, e))), 4 * g + e);
  }
}

__device__ __forceinline__ bool passes_min_p(float z, float m) { return m <= 0.f || expf(z) >= m; }

// Writes a decided row's token.
__device__ __forceinline__ void decide_row(const TsOutputs& pre, const TsOutputs& out, int64_t r, uint8_t sflags,
                                           int64_t token) {
  out.tokens[r * out.num_samples + out.sample] = token;
  out.flags[r] = sflags & 3u;
  pre.flags[r] = sflags | kRowDecided;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 4)
    frontier_kernel(TsLogits logits, TsRows rows, TsOutputs pre, TsOutputs out, TsWorkspace ws) {
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  let_next_grid_launch();  // the mass pass and the filter after it wait for this grid's results
  const RowView<T> rv = row_view<T>(logits, rows, w);
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  const float temperature = rows.temperature[rv.r];
  const float inv_t = 1.f / temperature;
  // Rows the frontier can settle: no top-k, and temperatures that keep the proxies and the
  // rounding bounds above valid (the last block also checks the row max).
  const bool usable = rows.top_k[rv.r] <= 0 && temperature >= kMinTemperature && temperature <= 0x1p20f;
  const NoiseStream noise = row_noise(rows, rv.r, static_cast<uint32_t>(out.sample));

  float v[kGroupsPerThread][4];
  Stats s{-kInf, kInf, 0.f, INT_MAX, 0u};
  s.nan = load_chunk(rv, logits.vocab, g0, v);
  chunk_stats(v, g0, s);

  // One pool: the block's candidates, then (last block) the merged reports' keys.
  __shared__ uint64_t pool[2 * kMergeCap];
  float* cand_x = reinterpret_cast<float*>(pool);
  float* cand_p = cand_x + kBlockCandidates;
  uint32_t* cand_id = reinterpret_cast<uint32_t*>(cand_p + kBlockCandidates);
  __shared__ unsigned int num_cand, num_kept;
  if (threadIdx.x == 0) num_cand = 0, num_kept = 0;
  __syncthreads();
  if (usable)
    frontier_candidates(v, rv, logits.vocab, g0, temperature, inv_t, noise, cand_x, cand_p, cand_id, &num_cand);
  __syncthreads();

  FrontierPartial* partial = static_cast<FrontierPartial*>(ws.scratch) + static_cast<int64_t>(w) * splits;
  FrontierPartial& mine = partial[split];
  const unsigned int n = min(num_cand, static_cast<unsigned int>(kBlockCandidates));
  for (unsigned int i = threadIdx.x; i < n; i += kThreads) {
    const float xi = cand_x[i], pi = cand_p[i];
    const uint32_t id = cand_id[i];
    bool beaten = false;
    for (unsigned int j = 0; j < n && !beaten; ++j)
      beaten = j != i && surely_ahead(cand_x[j], cand_id[j], xi, id) && cand_p[j] - pi > score_margin(xi, cand_x[j], inv_t);
    if (!beaten) {
      const unsigned int slot = atomicAdd(&num_kept, 1u);
      if (slot < kFrontierCap) mine.x[slot] = xi, mine.id[slot] = id;
    }
  }
  s = block_stats(s, 0.f, false);  // its barrier also orders num_kept
  if (threadIdx.x == 0) {
    mine.stats = s;
    mine.count = num_cand > kBlockCandidates ? kFrontierCap + 1 : min(num_kept, kFrontierCap + 1u);
  }
  if (!finish_and_elect_last(ws.counters + w, splits)) return;

  // ---- the last block: row stats, then the exact frontier of the blocks' reports
  constexpr int kMaxSplits = kMergeCap / kFrontierCap;
  __shared__ Stats row, block_stats[kMaxSplits];
  __shared__ unsigned int first[kMaxSplits + 1];  // where each block's reports start (counts first)
  __shared__ bool settle;
  const bool mergeable = splits <= kMaxSplits;
  if (mergeable && threadIdx.x < splits) {  // every block's partial in one round trip
    const FrontierPartial* q = partial + threadIdx.x;
    block_stats[threadIdx.x] = Stats{__ldcg(&q->stats.max), __ldcg(&q->stats.min), 0.f, __ldcg(&q->stats.argmax),
                                     __ldcg(&q->stats.nan)};
    first[threadIdx.x] = __ldcg(&q->count);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Stats acc{-kInf, kInf, 0.f, INT_MAX, 0u};
    unsigned int total = 0;
    bool fits = usable && mergeable;
    for (int i = 0; i < splits; ++i) {
      Stats b;
      unsigned int c = 0;
      if (mergeable) {
        b = block_stats[i], c = first[i];
      } else {
        const FrontierPartial* q = partial + i;
        b = Stats{__ldcg(&q->stats.max), __ldcg(&q->stats.min), 0.f, __ldcg(&q->stats.argmax), __ldcg(&q->stats.nan)};
      }
      acc = merge_stats(acc, b, 0.f, false);
      fits = fits && c <= kFrontierCap;
      if (mergeable) first[i] = total;
      total += c;
    }
    row = acc;
    const bool valid = acc.max > -kInf;
    const uint8_t sflags = static_cast<uint8_t>((acc.nan ? 1 : 0) | (valid ? 0 : 2));
    pre.row_max[rv.r] = acc.max;
    pre.row_min[rv.r] = acc.min;
    pre.tokens[rv.r] = valid ? acc.argmax : -1;
    pre.flags[rv.r] = sflags;
    fits = fits && fabsf(acc.max) <= kFrontierBound;
    settle = valid && fits;
    if (!valid) decide_row(pre, out, rv.r, sflags, -1);
    else if (!fits && ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
    if (mergeable) first[splits] = total;
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
    bool beaten = false;
    for (unsigned int j = 0; j < total && !beaten; ++j) beaten = order[j] > order[i] && score[j] > score[i];
    on_frontier[i] = !beaten;
  }
  __syncthreads();
  __shared__ uint64_t f_order[kFrontierCap], f_score[kFrontierCap];
  __shared__ unsigned int num_frontier;
  if (threadIdx.x == 0) num_frontier = 0;
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < total; i += kThreads) {
    if (!on_frontier[i]) continue;
    atomicAdd(&num_frontier, 1u);
    unsigned int pos = 0;  // its place in z-order among the frontier
    for (unsigned int j = 0; j < total; ++j) pos += on_frontier[j] && order[j] > order[i];
    if (pos < kFrontierCap) f_order[pos] = order[i], f_score[pos] = score[i];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const unsigned int count = num_frontier;
  const uint8_t sflags = pre.flags[rv.r];
  const float p = rows.top_p[rv.r], m = rows.min_p[rv.r];
  if (count > kFrontierCap) {
    if (ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
    return;
  }
  if (!(p < 1.f) || count == 1) {  // min-p alone, or the argmax beats every other token
    uint64_t win = 0;
    for (unsigned int i = 0; i < count; ++i)
      if (passes_min_p(key_value(f_order[i]), m)) win = max(win, f_score[i]);
    decide_row(pre, out, rv.r, sflags, key_index(win));
    return;
  }
  RowFrontier* rf = row_frontier(ws, w, splits, gridDim.y);
  rf->count = count;
  for (unsigned int i = 0; i < count; ++i) rf->order[i] = f_order[i], rf->score[i] = f_score[i], rf->ahead[i] = 0;
  rf->total = 0;
  pre.flags[rv.r] = sflags | kRowNeedsMass;
}

// The top-p decision of the rows frontier_kernel left with kRowNeedsMass: one read summing, in
// filter_kernel's fixed point, the mass min-p keeps and the mass ahead of each frontier token; the
// winner is the frontier token with the largest score among those top-p keeps (mass ahead < p x total).
template <typename T>
__global__ void __launch_bounds__(kThreads, 4)
    nucleus_mass_kernel(TsLogits logits, TsRows rows, TsOutputs pre, TsOutputs out, TsWorkspace ws) {
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  wait_for_previous_grid();
  const RowView<T> rv = row_view<T>(logits, rows, w);
  const uint8_t sflags = pre.flags[rv.r];
  if (!(sflags & kRowNeedsMass)) return;
  RowFrontier* rf = row_frontier(ws, w, splits, gridDim.y);
  const unsigned int count = rf->count;
  __shared__ uint64_t order[kFrontierCap];
  if (threadIdx.x < count) order[threadIdx.x] = rf->order[threadIdx.x];
  __syncthreads();
  const uint64_t last = order[count - 1];
  const float row_max = pre.row_max[rv.r], temperature = rows.temperature[rv.r], m = rows.min_p[rv.r];
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  float v[kGroupsPerThread][4];
  load_chunk(rv, logits.vocab, g0, v);
  // Most tokens ahead of the last frontier token lie behind one of the last few: those sums stay in
  // registers (near[d]: behind frontier token count - 1 - d); the rest go to the row's sums directly.
  constexpr int kNear = 4;
  unsigned long long total = 0, near[kNear] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = v[j][e];
      if (!(x > -kInf)) continue;
      const float z = scaled(x, row_max, temperature);
      if (!passes_min_p(z, m)) continue;
      const unsigned long long q = mass_fixed(z);
      total += q;
      const uint64_t key = rank_key(z, static_cast<uint32_t>(token_of(g0, j, e)));
      if (key <= last) continue;
      unsigned int lo = 0, hi = count - 1;  // the first frontier token behind this one: order[hi] < key
      while (lo < hi) {
        const unsigned int mid = (lo + hi) >> 1;
        if (order[mid] < key) hi = mid;
        else lo = mid + 1;
      }
      const unsigned int d = count - 1 - lo;
      if (d >= kNear) atomicAdd(&rf->ahead[lo], q);
#pragma unroll
      for (int i = 0; i < kNear; ++i) near[i] += d == i ? q : 0ull;
    }
  total = warp_allreduce(total, SumOp{});
#pragma unroll
  for (int i = 0; i < kNear; ++i) near[i] = warp_allreduce(near[i], SumOp{});
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&rf->total, total);
#pragma unroll
    for (int i = 0; i < kNear; ++i)
      if (near[i]) atomicAdd(&rf->ahead[count - 1 - i], near[i]);
  }
  if (!finish_and_elect_last(ws.counters + w, splits) || threadIdx.x != 0) return;

  const double target = static_cast<double>(rows.top_p[rv.r]) * static_cast<double>(__ldcg(&rf->total));
  unsigned long long before = 0;  // the mass ahead of frontier token i
  uint64_t win = 0;
  for (unsigned int i = 0; i < count; ++i) {
    before += __ldcg(&rf->ahead[i]);
    if (static_cast<double>(before) < target && passes_min_p(key_value(order[i]), m)) win = max(win, rf->score[i]);
  }
  decide_row(pre, out, rv.r, sflags & ~kRowNeedsMass, key_index(win));
}

}  // namespace tokensampler
