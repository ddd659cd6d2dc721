// The workload kernels as framework-free device templates (launchers: workloads.cu): diffusion steps,
// top-k probabilities, speculative verification. Built on the logits-path pieces of sampling.cuh:
// rows cut into kChunk-token chunks, one block each, merged in a fixed order by the row's last block
// (batch-invariant); the Gumbel-max proxy and its exact re-score; rank keys (value desc, id asc).
// Semantics: docs/semantics.md, choices 14-16.
#pragma once
#include <climits>
#include <cstdint>

#include "common.cuh"
#include "philox.cuh"
#include "sampling.cuh"
#include "workloads.h"

namespace tokensampler {

// ---------------------------------------------------------------------------------------------
// Row statistics in one read: max and argmax, sum exp(c (x - max)) (c = 1 / T), the Gumbel-max sample
// of the drawn slots (gumbel_screened's proxy, re-scored exactly when the gap test fails), and the
// sums of the optional aux rows (the draft probabilities of a verification). Aux rows are work rows
// of their own (grid rows num_rows and up): a block then streams one array, not two in turn.

struct RowPartial {
  Proxy proxy;
  float max, sum;
  int32_t argmax;
};

__device__ __forceinline__ RowPartial no_tokens() { return RowPartial{{-kInf, -kInf, INT_MAX}, -kInf, 0.f, INT_MAX}; }

// exp2 of a scaled difference: the sums only need ~1e-6 relative accuracy (confidences, q = e / S).
__device__ __forceinline__ RowPartial merge_row(RowPartial a, const RowPartial& b, float c2) {
  a.proxy = merge_proxy(a.proxy, b.proxy);
  const float m = fmaxf(a.max, b.max);
  a.sum = m == -kInf ? 0.f : a.sum * exp2f((a.max - m) * c2) + b.sum * exp2f((b.max - m) * c2);
  if (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) a.argmax = b.argmax;
  a.max = m;
  return a;
}

// A thread's share of the row statistics over its chunk values: their max, the first token at the max
// when `argmax` (block-uniform), and the sum of exp2((x - max) c2). On the values as loaded: a NaN or
// +inf makes the sum NaN (or leaves no finite max), and only then does the caller sanitize and redo.
__device__ __forceinline__ void add_thread_stats(const float (&v)[kGroupsPerThread][4], int64_t g0, float c2,
                                                 bool argmax, RowPartial& s) {
  if (argmax) {
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (v[j][e] > s.max) s.max = v[j][e], s.argmax = static_cast<int32_t>(token_of(g0, j, e));
  } else {
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s.max = fmaxf(s.max, v[j][e]);
  }
  if (s.max > -kInf) {  // four partial sums: four chains of additions rather than one
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[e] += fast_exp2((v[j][e] - s.max) * c2);
    s.sum += (part[0] + part[1]) + (part[2] + part[3]);
  }
}

// A warp's statistics merged: the max first, then each lane's sum rescaled to it and added (one
// exponential a lane, where merge_row takes two a shuffle level); the argmax and the Gumbel proxy only
// where they are used (block-uniform flags).
__device__ __forceinline__ RowPartial warp_merge_row(const RowPartial& s, float c2, bool argmax, bool draw) {
  RowPartial w;
  w.max = warp_allreduce(s.max, MaxOp{});
  w.sum = warp_allreduce(s.max > -kInf ? s.sum * exp2f((s.max - w.max) * c2) : 0.f, SumOp{});
  w.argmax = argmax ? warp_allreduce(s.max == w.max ? s.argmax : INT_MAX, MinOp{}) : INT_MAX;
  w.proxy = s.proxy;
  if (draw) {  // a warp that drew nothing (every p1 -inf, one p2: the screen's cut) has its merge already
    const float p2 = __shfl_sync(0xffffffffu, s.proxy.p2, 0);
    if (!__all_sync(0xffffffffu, s.proxy.p1 == -kInf && s.proxy.p2 == p2)) {
#pragma unroll
      for (int o = 16; o; o >>= 1)
        w.proxy = merge_proxy(w.proxy, shfl_xor_proxy(w.proxy, o));
    }
  }
  return w;
}

struct JobRow {
  int b, slot;
  float temperature, inv_t;  // inv_t = 1 for greedy rows (the confidence of a greedy row uses T = 1)
  bool greedy;
};

__device__ __forceinline__ JobRow job_row(const TsRowJob& job, int w) {
  const int b = w / job.per_request;
  const float t = job.temperature[b];
  const bool greedy = !(t > 0.f);
  return JobRow{b, w - b * job.per_request, t, greedy ? 1.f : 1.f / t, greedy};
}

__device__ __forceinline__ NoiseStream job_noise(const TsRowJob& job, const JobRow& jr) {
  const int64_t base = job.position ? job.position[jr.b] : 0;
  return NoiseStream::make(job.seed[jr.b], base + jr.slot, job.iteration[jr.b], 0u);
}

template <typename T>
__device__ __forceinline__ RowView<T> job_view(const TsRowJob& job, int w) {
  return view_of_row(static_cast<const T*>(job.logits) + static_cast<int64_t>(w) * job.vocab, w);
}

// visit(x, word, id) for every token of the row, by the whole block: x sanitized, word the token's noise word. The
// exact passes over a row, where a screened pass could not decide it.
template <typename T, typename Visit>
__device__ __forceinline__ void for_each_row_token(const RowView<T>& rv, int64_t vocab, const NoiseStream& noise,
                                                   Visit visit) {
  for (int64_t g = threadIdx.x; g < (vocab + 3) / 4; g += kThreads) {
    float x[4];
    load_group(rv.row, g, vocab, rv.aligned, x);
    const uint4 words = noise.group(static_cast<uint32_t>(g));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sanitize(x[e]);
      visit(x[e], word_of(words, e), static_cast<uint32_t>(4 * g + e));
    }
  }
}

// Aux rows of a job (0 without aux): grid rows num_rows .. num_rows + aux_rows - 1.
__host__ __device__ inline int aux_rows(const TsRowJob& job) {
  return job.aux ? job.num_rows / job.per_request * job.aux_per_request : 0;
}

// Sum of aux row a's positive entries over this block's chunk, the chunks added in order by the
// row's last block (counter num_rows + a). Partials follow the RowPartials in the scratch.
__device__ __forceinline__ void aux_sum_block(const TsRowJob& job, const TsRowStats& st, const TsWorkspace& ws, int a,
                                              int split, int splits) {
  const int b = a / job.aux_per_request, w = b * job.per_request + (a - b * job.aux_per_request);
  if (job.active && !job.active[w]) return;
  const int64_t vocab = job.vocab, g0 = static_cast<int64_t>(split) * kChunkGroups;
  const float* row = job.aux + static_cast<int64_t>(a) * vocab;
  const bool aligned = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  float p[kGroupsPerThread][4];
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j) load_group(row, g0 + threadIdx.x + j * kThreads, vocab, aligned, p[j]);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s += p[j][e] > 0.f ? p[j][e] : 0.f;  // padding reads as -inf
  __shared__ float scratch[kThreads / 32];
  s = block_allreduce<kThreads>(s, SumOp{}, scratch);
  float* partial = reinterpret_cast<float*>(static_cast<RowPartial*>(ws.scratch) +
                                            static_cast<int64_t>(job.num_rows) * splits) +
                   static_cast<int64_t>(a) * splits;
  if (threadIdx.x == 0) partial[split] = s;
  if (!finish_by_thread0_and_elect_last(ws.counters + job.num_rows + a, splits)) return;
  if (threadIdx.x != 0) return;
  float total = 0.f;
  for (int i = 0; i < splits; ++i) total += __ldcg(partial + i);
  st.aux_sum[w] = total;
}

// ---------------------------------------------------------------------------------------------
// Diffusion commit, one block per request. Confidence of a masked position = exp(z_tok - log S) with
// z = (x - max) / T (T = 1 for greedy), as the row pass wrote it (TsRowStats.confidence), then choice
// 14's rule: threshold, the `count` most confident (confidence desc, index asc), at least one while a
// committable position remains. Run by the row pass itself, in the block that finishes a request's last
// row, for steps of up to kFoldedCommitMaxLength positions; by diffusion_commit_kernel after it otherwise.

constexpr int kCommitThreads = kThreads;
constexpr int kFoldedCommitMaxLength = 1024;  // the row pass keeps a request's confidences in shared memory

// The diffusion step's mailbox (ts_diffusion_mailbox_bytes): a row's blocks pass their chunk partials to
// the row's last block, and post their screening bounds, without a memory fence. Each 64-bit word
// carries the step's tag in its upper half and aligned 64-bit relaxed accesses are single-copy atomic,
// so a reader knows a word is this step's from the word alone (stale words carry older tags, zeroed
// ones 0). The tag is the epoch + 1, which each block reads as it starts; the block that commits the
// step's last request advances the epoch, by then read by every block of the step.
struct Mailbox {
  unsigned int* epoch;
  unsigned long long* bound;    // [num_rows]: tag | order_key of the row's best posted proxy
  unsigned long long* partial;  // [num_rows, splits, kPartialWords]
};
constexpr int kPartialWords = 6;  // a RowPartial, a 32-bit field a word

__host__ __device__ inline size_t mailbox_words(int num_rows, int64_t vocab) {
  return 1 + static_cast<size_t>(num_rows) * (1 + static_cast<size_t>(num_splits(vocab)) * kPartialWords);
}

__device__ __forceinline__ uint64_t load_relaxed(const unsigned long long* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void store_relaxed(unsigned long long* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v));
}
__device__ __forceinline__ uint32_t step_tag(const Mailbox& mb) {
  uint32_t e;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(e) : "l"(mb.epoch));
  return e + 1u;
}
__device__ __forceinline__ uint64_t tagged(uint32_t tag, uint32_t value) {
  return static_cast<uint64_t>(tag) << 32 | value;
}

// By one thread: the partial's words, fire and forget.
__device__ __forceinline__ void publish_partial(unsigned long long* slot, const RowPartial& p, uint32_t tag) {
  const uint32_t words[kPartialWords] = {__float_as_uint(p.proxy.p1), __float_as_uint(p.proxy.p2),
                                         static_cast<uint32_t>(p.proxy.i1), __float_as_uint(p.max),
                                         __float_as_uint(p.sum), static_cast<uint32_t>(p.argmax)};
#pragma unroll
  for (int i = 0; i < kPartialWords; ++i) store_relaxed(slot + i, tagged(tag, words[i]));
}

// The partial at slot once all its words carry the tag (all loads in flight at once, then the check).
__device__ __forceinline__ RowPartial collect_partial(const unsigned long long* slot, uint32_t tag) {
  uint64_t v[kPartialWords];
  bool ready;
  do {
#pragma unroll
    for (int i = 0; i < kPartialWords; ++i) v[i] = load_relaxed(slot + i);
    ready = true;
#pragma unroll
    for (int i = 0; i < kPartialWords; ++i) ready &= static_cast<uint32_t>(v[i] >> 32) == tag;
  } while (!ready);
  return RowPartial{{__uint_as_float(static_cast<uint32_t>(v[0])), __uint_as_float(static_cast<uint32_t>(v[1])),
                     static_cast<int32_t>(v[2])},
                    __uint_as_float(static_cast<uint32_t>(v[3])), __uint_as_float(static_cast<uint32_t>(v[4])),
                    static_cast<int32_t>(v[5])};
}

struct DiffusionStep {
  const float* threshold;
  const int64_t* count;
  int64_t* tokens;
  uint8_t* mask_out;
  bool fold_commit;             // the row pass commits each request (L <= kFoldedCommitMaxLength)
  unsigned int* request_done;   // [B] rows done per request, then [1] requests committed; left zeroed
  Mailbox mailbox;
};

__device__ __forceinline__ bool ranks_before(float cj, int j, float ci, int i) {
  return cj > ci || (cj == ci && j < i);
}

// Request b's commit by the whole block, once every row of the request has its token and confidence
// (read through L2: other blocks wrote them). conf_key, commit_of: [L] in shared memory.
__device__ __forceinline__ void commit_request(const TsRowJob& job, const TsRowStats& st, const DiffusionStep& step, int b,
                                               float* conf_key, uint8_t* commit_of) {
  const int L = job.per_request;
  const float tau = step.threshold[b];
  const int64_t c = step.count[b];
  bool any_eligible = false;
  for (int l = threadIdx.x; l < L; l += kCommitThreads) {
    const int w = b * L + l;
    // all three loaded at once; token and confidence mean something at masked positions only
    const bool masked = job.active[w] != 0;
    const int64_t row_token = __ldcg(st.token + w);
    const float row_conf = __ldcg(st.confidence + w);
    const int64_t tok = masked ? row_token : -1;
    const float conf = tok >= 0 ? row_conf : 0.f;
    step.tokens[w] = tok;
    st.confidence[w] = conf;
    conf_key[l] = tok >= 0 ? conf : -1.f;
    any_eligible |= tok >= 0;
  }
  any_eligible = __syncthreads_or(any_eligible);
  // The most confident committable position (the at-least-one rule), by (confidence desc, index asc).
  __shared__ float best_c[kCommitThreads / 32];
  __shared__ int best_i[kCommitThreads / 32];
  float bc = -2.f;
  int bi = INT_MAX;
  for (int l = threadIdx.x; l < L; l += kCommitThreads)
    if (ranks_before(conf_key[l], l, bc, bi)) bc = conf_key[l], bi = l;
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float oc = __shfl_xor_sync(0xffffffffu, bc, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ranks_before(oc, oi, bc, bi)) bc = oc, bi = oi;
  }
  if ((threadIdx.x & 31) == 0) best_c[threadIdx.x >> 5] = bc, best_i[threadIdx.x >> 5] = bi;
  __syncthreads();
  for (int i = 0; i < kCommitThreads / 32; ++i)
    if (ranks_before(best_c[i], best_i[i], bc, bi)) bc = best_c[i], bi = best_i[i];

  bool committed_any = false;
  for (int l = threadIdx.x; l < L; l += kCommitThreads) {
    const float k = conf_key[l];
    bool commit = false;
    if (k >= 0.f) {
      commit = k >= tau;  // NaN: no threshold
      if (!commit && c > 0) {
        int64_t rank = 0;
        for (int j = 0; j < L && rank < c; ++j) rank += ranks_before(conf_key[j], j, k, l);
        commit = rank < c;
      }
    }
    committed_any |= commit;
    commit_of[l] = commit;
  }
  committed_any = __syncthreads_or(committed_any);
  for (int l = threadIdx.x; l < L; l += kCommitThreads) {
    const int w = b * L + l;
    const bool commit = commit_of[l] || (any_eligible && !committed_any && l == bi);
    step.mask_out[w] = job.active[w] && !commit;
  }
}

// After a request's commit, by its block: the block that commits the step's last request advances the
// mailbox's epoch (the step's end: every block of the step has read the epoch before its row finished).
__device__ __forceinline__ void end_step_after_last_request(const TsRowJob& job, const DiffusionStep& step) {
  if (threadIdx.x != 0) return;
  const unsigned int requests = job.num_rows / job.per_request;
  unsigned int* committed = step.request_done + requests;
  if (atomicAdd(committed, 1u) != requests - 1) return;
  *committed = 0u;
  *step.mailbox.epoch += 1u;
}

__global__ void __launch_bounds__(kCommitThreads) diffusion_commit_kernel(TsRowJob job, TsRowStats st, DiffusionStep step) {
  extern __shared__ float conf_key[];  // [L] confidences of committable positions (-1 elsewhere), then [L] bytes
  wait_for_previous_grid();            // launched to overlap row_stats' tail
  commit_request(job, st, step, blockIdx.x, conf_key, reinterpret_cast<uint8_t*>(conf_key + job.per_request));
  end_step_after_last_request(job, step);
}

// A diffusion row pass with the commit folded in: each row, once done (an inactive row: by its first
// block), counts itself in its request's counter, and the block that counts a request's last row commits it.
__device__ __forceinline__ void commit_if_request_done(const TsRowJob& job, const TsRowStats& st,
                                                       const DiffusionStep& step, int w) {
  if (!step.fold_commit) return;
  const int b = w / job.per_request;
  if (!finish_by_thread0_and_elect_last(step.request_done + b, job.per_request)) return;
  __shared__ float conf_key[kFoldedCommitMaxLength];
  __shared__ uint8_t commit_of[kFoldedCommitMaxLength];
  commit_request(job, st, step, b, conf_key, commit_of);
  end_step_after_last_request(job, step);
}

// kRowsFastest: the grid's order, and with it how a row's blocks share their screening bound and partials.
// Rows fastest (diffusion steps, every slot draws; `step` in use): a row's later chunks start after its
// first ones posted their bound, which they load with their chunk, and its last chunk's block starts
// after all the others and merges; bounds and partials go through the mailbox. Chunks fastest
// (verification: one drawing slot a request, and aux rows): a row's blocks run side by side, exchange
// their bounds, and the last to finish (a counter) merges the partials from the scratch.
template <typename T, bool kRowsFastest>
__global__ void __launch_bounds__(kThreads, 5)
    row_stats_kernel(TsRowJob job, TsRowStats st, TsWorkspace ws, DiffusionStep step) {
  const int w = kRowsFastest ? blockIdx.x : blockIdx.y, split = kRowsFastest ? blockIdx.y : blockIdx.x;
  const int splits = kRowsFastest ? gridDim.y : gridDim.x;
  let_next_grid_launch();  // a dependent kernel may take SMs this grid's last wave leaves idle
  if (w >= job.num_rows) return aux_sum_block(job, st, ws, w - job.num_rows, split, splits);
  if (job.active && !job.active[w]) {  // every block of the row leaves
    if (kRowsFastest && split == 0) commit_if_request_done(job, st, step, w);
    return;
  }
  const JobRow jr = job_row(job, w);
  const bool draw = !jr.greedy && (job.draw_slot < 0 || jr.slot == job.draw_slot);
  const RowView<T> rv = job_view<T>(job, w);
  const int64_t vocab = job.vocab, g0 = static_cast<int64_t>(split) * kChunkGroups;
  const float c2 = jr.inv_t * kLog2e;

  unsigned int* row_best = ws.counters + 2 * job.num_rows + w;  // chunks fastest: after the rows' and aux rows' counters
  // Rows fastest: thread 0 reads the step's tag and the row's bound as its earlier blocks posted it beside
  // the chunk, and shares the bound, since it picks the screen (block-uniform: only the pilot's screen
  // has a block barrier). Both in shared memory, where they cost no register through the chunk's work.
  const bool read_posted = draw && kRowsFastest;
  __shared__ uint32_t posted, tag;
  if (kRowsFastest && threadIdx.x == 0) {
    const uint32_t t = step_tag(step.mailbox);
    tag = t;
    if (read_posted) {
      const uint64_t b = load_relaxed(step.mailbox.bound + w);
      posted = static_cast<uint32_t>(b >> 32) == t ? static_cast<uint32_t>(b) : 0u;
    }
  }
  const bool track_argmax = !draw || st.argmax;  // a drawing row's argmax is only reported when asked for
  RowPartial s = no_tokens();
  {
    float v[kGroupsPerThread][4];
    load_chunk_raw(rv, vocab, g0, v, rows_exceed_l2<T>(job.num_rows, vocab));
    if (read_posted) __syncthreads();  // costs one thread's L2 reads, which return before the chunk does
    add_thread_stats(v, g0, c2, track_argmax, s);
    if (!(s.sum < kInf) || !(s.max > -kInf)) {  // a NaN or +inf among the values, or no finite one
      sanitize_chunk(v);
      s = no_tokens();
      add_thread_stats(v, g0, c2, track_argmax, s);
    }
    if (draw) {  // block-uniform
      if (read_posted && posted) {
        gumbel_screened_by_bound(v, rv, vocab, g0, jr.inv_t, job_noise(job, jr), s.max, key_to_float(posted), s.proxy);
      } else {  // gumbel_screened synchronises the block
        float unused_max = -kInf;
        gumbel_screened(v, rv, vocab, g0, jr.inv_t, job_noise(job, jr), s.proxy, unused_max,
                        kRowsFastest ? RowBound{} : RowBound{row_best, -kInf, true});
      }
    }
  }
  s = warp_merge_row(s, c2, track_argmax, draw);
  __shared__ RowPartial warp_part[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = s;
  __syncthreads();
  // warp 0 merges the warps' partials across its lanes: a chain of log2(32) steps, where thread 0
  // merging them one by one cost the diffusion step ~10 us (docs/design/workload-kernels.md)
  if (threadIdx.x < 32)
    s = warp_merge_row(threadIdx.x < kThreads / 32 ? warp_part[threadIdx.x] : no_tokens(), c2, track_argmax, draw);
  unsigned long long* mailed = step.mailbox.partial + static_cast<int64_t>(w) * splits * kPartialWords;
  RowPartial* partial = static_cast<RowPartial*>(ws.scratch) + static_cast<int64_t>(w) * splits;
  if (threadIdx.x == 0) {
    if (kRowsFastest) {
      // the block's best proxy as the row's bound for its later blocks, then its partial, neither waited for
      if (draw && fabsf(s.proxy.p1) < 0x1p20f) atomicMax(step.mailbox.bound + w, tagged(tag, order_key(s.proxy.p1)));
      publish_partial(mailed + split * kPartialWords, s, tag);
    } else {
      partial[split] = s;
    }
  }
  if (kRowsFastest ? split != splits - 1 : !finish_by_thread0_and_elect_last(ws.counters + w, splits)) return;

  __shared__ RowPartial row;
  __shared__ bool rescore;
  if (threadIdx.x < 32) {  // warp 0 fetches 32 partials at once and merges them across its lanes
    const int lane = threadIdx.x;
    RowPartial acc = no_tokens();
    for (int base = 0; base < splits; base += 32) {
      RowPartial mine = no_tokens();
      if (base + lane < splits) {
        if (kRowsFastest) {
          mine = collect_partial(mailed + (base + lane) * kPartialWords, tag);
        } else {
          const RowPartial* p = partial + base + lane;
          mine = RowPartial{{__ldcg(&p->proxy.p1), __ldcg(&p->proxy.p2), __ldcg(&p->proxy.i1)},
                            __ldcg(&p->max), __ldcg(&p->sum), __ldcg(&p->argmax)};
        }
      }
      const RowPartial batch = warp_merge_row(mine, c2, track_argmax, draw);
      acc = base == 0 ? batch : merge_row(acc, batch, c2);
    }
    if (lane == 0) {
      row = acc;
      if (!kRowsFastest && draw) *row_best = 0u;  // every block of the row has posted: zero for the next launch
      const bool valid = acc.max > -kInf;
      rescore = draw && valid &&
                !(fabsf(acc.proxy.p1) < kInf && fabsf(acc.max) * jr.inv_t < 0x1p20f &&
                  acc.proxy.p1 - acc.proxy.p2 > proxy_margin(acc.max, jr.inv_t));
      if (rescore && ws.fallback_count) atomicAdd(ws.fallback_count, 1ull);
    }
  }
  __syncthreads();
  const bool valid = row.max > -kInf;
  int64_t token = !valid ? -1 : draw ? row.proxy.i1 : row.argmax;
  if (rescore) {  // the exact scores z + g of the whole row, as Sample's reference computes them
    const NoiseStream noise = job_noise(job, jr);
    uint64_t best = 0;
    for_each_row_token(rv, vocab, noise, [&](float x, uint32_t, uint32_t id) {
      if (x > -kInf) best = max(best, gumbel_key(scaled(x, row.max, jr.temperature), id, noise));
    });
    __shared__ uint64_t scratch[kThreads / 32];
    token = key_index(block_allreduce<kThreads>(best, MaxOp{}, scratch));
  }
  if (threadIdx.x == 0) {
    if (st.row_max) st.row_max[w] = row.max;
    if (st.row_sum) st.row_sum[w] = row.sum;
    if (st.argmax) st.argmax[w] = valid ? row.argmax : -1;
    if (st.token) st.token[w] = token;
    if (st.confidence) {  // here rather than in the commit: one dependent load fewer after the pass
      const float t = jr.greedy ? 1.f : jr.temperature;
      st.confidence[w] = token < 0 ? 0.f : expf(__fsub_rn(scaled(to_f32(rv.row[token]), row.max, t), logf(row.sum)));
    }
  }
  if (kRowsFastest) commit_if_request_done(job, st, step, w);
}


// ---------------------------------------------------------------------------------------------
// Verification after row_stats. Every block of a request settles the accepted prefix itself, the n
// acceptance tests on n threads at once (the first rejection counts). After a rejection the blocks
// draw the correction from the residual r = max(0, q - p) at that position over their chunk, merged
// by the request's last block. Screening as in gumbel_screened: a pilot (one token of every thread's
// first group, scored exactly) gives L, a real token's score; as r <= q, a token with log q + g < L
// cannot win, which the logit and the Philox word decide alone (no draft read, no division or log).
// The few groups that pass are re-scored exactly by the whole block.

__device__ __forceinline__ double acceptance_uniform(int64_t seed, int64_t position, int64_t iteration) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint4 w = philox4x32_10(make_uint4(0xFFFFFFFFu, static_cast<uint32_t>(position),
                                           static_cast<uint32_t>(iteration), 0xFFFFFFFFu),
                                static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return (static_cast<double>(w.x >> 8) + 0.5) * 0x1p-24;
}

// q_j(i) for T > 0 without filters: softmax(z), z = (x - max) / T, as the reference's fp32 softmax.
__device__ __forceinline__ float target_prob(float x, float row_max, float temperature, float row_sum) {
  return x > -kInf ? __fdiv_rn(expf(scaled(x, row_max, temperature)), row_sum) : 0.f;
}

// Draft token j of request b passes u_j * p_j(d_j) < q_j(d_j).
template <typename T>
__device__ __forceinline__ bool draft_accepted(const TsRowJob& job, const TsRowStats& st, const int64_t* draft_ids,
                                               const JobRow& jr, int j) {
  const int n = job.per_request - 1, w = jr.b * job.per_request + j;
  const int64_t d = draft_ids[static_cast<int64_t>(jr.b) * n + j];
  float q;
  if (jr.greedy) {
    q = d == st.argmax[w] ? 1.f : 0.f;
  } else {
    float x = to_f32(static_cast<const T*>(job.logits)[static_cast<int64_t>(w) * job.vocab + d]);
    sanitize(x);
    q = target_prob(x, st.row_max[w], jr.temperature, st.row_sum[w]);
  }
  const float p = __fdiv_rn(job.aux[(static_cast<int64_t>(jr.b) * n + j) * job.vocab + d], st.aux_sum[w]);
  const int64_t pos = (job.position ? job.position[jr.b] : 0) + j;
  // u has 25 significant bits and p 24: u * p is exact in double, the comparison too.
  return acceptance_uniform(job.seed[jr.b], pos, job.iteration[jr.b]) * p < static_cast<double>(q);
}

struct ResidualRow {
  float row_max, row_sum, temperature, draft_sum;
};

// The exact score log r + g of token `id` as a rank key; 0 where r <= 0 (the token cannot be drawn).
__device__ __forceinline__ uint64_t residual_key(float x, float p, uint32_t word, uint32_t id, const ResidualRow& rr) {
  sanitize(x);
  const float r = __fsub_rn(target_prob(x, rr.row_max, rr.temperature, rr.row_sum),
                            p > 0.f ? __fdiv_rn(p, rr.draft_sum) : 0.f);  // padding reads as -inf
  return r > 0.f ? rank_key(__fadd_rn(logf(r), gumbel_exact(word)), id) : 0;
}

// Words below the returned threshold give every token of a group whose largest logit is gx a score
// below L, where a = L - residual_slack(L, log_s). f = log r + g <= log q + g, and
// log q <= max((gx - max) / T - log S, -87) (q < 2^-126 has log q < -87.3), up to the rounding of
// z, q, the logarithms and f, which the slack and screen_word's 2^-19 |zc| cover many times over.
__device__ __forceinline__ float residual_slack(float L, float log_s) {
  return 2e-4f + 0x1p-19f * (fabsf(L) + log_s + 32.f);
}
__device__ __forceinline__ uint32_t residual_screen(float gx, float row_max, float inv_t, float log_s, float a) {
  const float zc = (gx - row_max) * inv_t - log_s;
  if (zc != zc) return 0u;  // 0 * inf (a subnormal T): every word passes
  return screen_word(fmaxf(zc, -87.f), 1.f, a);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 5)
    verify_finish_kernel(TsRowJob job, TsRowStats st, const int64_t* draft_ids, int64_t* accepted_out,
                         int64_t* tokens, TsWorkspace ws) {
  const int b = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const int P = job.per_request, n = P - 1;
  const int64_t vocab = job.vocab;
  const JobRow jr = job_row(job, b * P);
  wait_for_previous_grid();  // launched to overlap row_stats' tail: its results are complete from here
  __shared__ int first_rejected;
  if (threadIdx.x == 0) first_rejected = n;
  __syncthreads();
  bool invalid = false;
  for (int j = threadIdx.x; j <= n; j += kThreads) {
    invalid |= !(st.row_max[b * P + j] > -kInf);
    if (j < n && !draft_accepted<T>(job, st, draft_ids, jr, j)) atomicMin(&first_rejected, j);
  }
  const bool valid = !__syncthreads_or(invalid);
  const int a = valid ? first_rejected : 0;
  int64_t* out = tokens + static_cast<int64_t>(b) * P;
  auto write_row = [&](int64_t last) {
    for (int j = 0; j < P; ++j) out[j] = !valid ? -1 : j < a ? draft_ids[static_cast<int64_t>(b) * n + j] : j == a ? last : -1;
    accepted_out[b] = a;
  };
  const int w = b * P + a;
  if (!valid || a == n || jr.greedy) {  // bonus token, or the greedy correction (the argmax)
    if (split == 0 && threadIdx.x == 0) write_row(!valid ? -1 : a == n ? st.token[w] : st.argmax[w]);
    return;
  }
  // The residual at position a over this block's chunk, with the noise of position + a.
  const RowView<T> rv = job_view<T>(job, w);
  const float* draft = job.aux + (static_cast<int64_t>(b) * n + a) * vocab;
  const bool draft_aligned = reinterpret_cast<uintptr_t>(draft) % 16 == 0;
  const ResidualRow rr{st.row_max[w], st.row_sum[w], jr.temperature, st.aux_sum[w]};
  const NoiseStream noise = job_noise(job, JobRow{b, a, jr.temperature, jr.inv_t, false});
  const int64_t g0 = static_cast<int64_t>(split) * kChunkGroups;
  const uint32_t gbase = static_cast<uint32_t>(g0) + threadIdx.x;
  const float inv_t = jr.inv_t, log_s = logf(rr.row_sum);
  __shared__ uint64_t scratch[kThreads / 32];
  __shared__ uint32_t flagged[kChunkGroups];  // the groups that pass the screen
  __shared__ int num_flagged;
  if (threadIdx.x == 0) num_flagged = 0;
  float gx[kGroupsPerThread];
  uint64_t pilot = 0;
  {
    float v[kGroupsPerThread][4], p[4];
    load_chunk(rv, vocab, g0, v);
    load_group(draft, gbase, vocab, draft_aligned, p);
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j) gx[j] = fmaxf(fmaxf(v[j][0], v[j][1]), fmaxf(v[j][2], v[j][3]));
    // The thread's pilot: the token of its first group with the best approximate score (fast
    // intrinsics: they only choose it), scored exactly.
    const uint4 words = noise.group(gbase);
    const float c2 = inv_t * kLog2e, inv_s = 1.f / rr.row_sum, inv_ds = 1.f / rr.draft_sum;
    float best_a = -kInf, px = 0.f, pp = 0.f;
    uint32_t pw = 0, pid = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float r = fast_exp2((v[0][e] - rr.row_max) * c2) * inv_s - fmaxf(p[e], 0.f) * inv_ds;
      const float sa = r > 0.f ? __logf(r) + gumbel_fast(word_of(words, e)) : -kInf;
      if (sa > best_a) best_a = sa, px = v[0][e], pp = p[e], pw = word_of(words, e), pid = 4 * gbase + e;
    }
    if (best_a > -kInf) pilot = residual_key(px, pp, pw, pid, rr);
  }
  pilot = block_allreduce<kThreads>(pilot, MaxOp{}, scratch);
  const float L = pilot ? key_value(pilot) : -kInf;  // -inf: no screen (every group is flagged)
  const float a_screen = L - residual_slack(L, log_s);
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kGroupsPerThread; ++j) {
    const uint32_t th = residual_screen(gx[j], rr.row_max, inv_t, log_s, a_screen);
    const uint4 wd = noise.group(gbase + j * kThreads);
    const bool pass = max(max(wd.x, wd.y), max(wd.z, wd.w)) >= th;
    const uint32_t ballot = __ballot_sync(0xffffffffu, pass);
    if (ballot) {  // one shared atomic per warp
      int slot = 0;
      if (lane == 0) slot = atomicAdd(&num_flagged, __popc(ballot));
      slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(ballot & ((1u << lane) - 1));
      if (pass) flagged[slot] = gbase + j * kThreads;
    }
  }
  __syncthreads();
  // The flagged groups, spread over the block (one round of loads): the tokens that pass the screen
  // on their own logit, exactly, with the draft.
  uint64_t best = 0;
  for (int i = threadIdx.x; i < num_flagged; i += kThreads) {
    const uint32_t g = flagged[i];
    float x[4], p[4];
    load_group(rv.row, g, vocab, rv.aligned, x);
    load_group(draft, g, vocab, draft_aligned, p);
    const uint4 words = noise.group(g);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sanitize(x[e]);
      const uint32_t word = word_of(words, e);
      if (word >= residual_screen(x[e], rr.row_max, inv_t, log_s, a_screen))
        best = max(best, residual_key(x[e], p[e], word, 4 * g + e, rr));
    }
  }
  best = block_allreduce<kThreads>(best, MaxOp{}, scratch);
  uint64_t* partial = static_cast<uint64_t*>(ws.scratch) + static_cast<int64_t>(b) * splits;
  if (threadIdx.x == 0) partial[split] = best;
  if (!finish_and_elect_last(ws.counters + b, splits)) return;
  best = 0;
  for (int i = threadIdx.x; i < splits; i += kThreads) best = max(best, __ldcg(partial + i));
  best = block_allreduce<kThreads>(best, MaxOp{}, scratch);
  if (best == 0) {  // the residual rounded to zero everywhere (q == p up to rounding): draw from q
    for_each_row_token(rv, vocab, noise, [&](float x, uint32_t word, uint32_t id) {
      const float q = target_prob(x, rr.row_max, jr.temperature, rr.row_sum);
      if (q > 0.f) best = max(best, rank_key(__fadd_rn(logf(q), gumbel_exact(word)), id));
    });
    best = block_allreduce<kThreads>(best, MaxOp{}, scratch);
  }
  if (threadIdx.x == 0) write_row(key_index(best));
}

// ---------------------------------------------------------------------------------------------
// Top-k probabilities in one read. Each block keeps its chunk's top K by x (rank keys; a threshold
// that at least K tokens pass selects the candidates) with the chunk's max and sum exp(c (x - max)).
// The row's last block ranks the first k + 1 of every list among all of them at once, computes
// p = exp(z - log S) for the row's first k + 1, sorts them by (p desc, id asc) and writes the first k.
// A token outside the candidates has p <= the (k + 1)-th's: the answer is exact unless the k-th and
// (k + 1)-th p are equal (a tie at the cut, or p underflowing to 0): such rows are flagged.

struct ChunkSum {
  float max, sum;
};

// Entries larger than `key` in a descending list of n keys (n a power of two) whose last entry is 0.
__device__ __forceinline__ int count_above(const uint64_t* list, int n, uint64_t key) {
  int c = 0;
  for (int step = n >> 1; step; step >>= 1)
    if (list[c + step - 1] > key) c += step;
  return c;
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads, 5)
    topk_probs_kernel(TsLogits logits, const float* temperature, int k, float* probs, int64_t* ids,
                      uint8_t* flags, TsWorkspace ws) {
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const int64_t vocab = logits.vocab, g0 = static_cast<int64_t>(split) * kChunkGroups;
  const RowView<T> rv = logits_row<T>(logits, w);
  const float t = temperature[w], c2 = kLog2e / t;
  uint64_t* lists = static_cast<uint64_t*>(ws.scratch);
  ChunkSum* sums = reinterpret_cast<ChunkSum*>(lists + static_cast<int64_t>(logits.num_rows) * splits * K);
  uint32_t* block_flags = reinterpret_cast<uint32_t*>(sums + static_cast<int64_t>(logits.num_rows) * splits);

  __shared__ uint64_t cand[kTopkCap];
  __shared__ uint64_t warp_top[kThreads / 32];  // each warp's largest thread maximum
  __shared__ float warp_sum[kThreads / 32];
  __shared__ int num_cand;
  float v[kGroupsPerThread][4];
  load_chunk(rv, vocab, g0, v);
  const uint32_t base = 4 * (static_cast<uint32_t>(g0) + threadIdx.x);
  const uint64_t sorted = warp_sort_desc(thread_best_key(v, base, vocab));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_top[warp] = sorted;
  if (threadIdx.x == 0) num_cand = 0;
  uint64_t th;  // 1: fewer than K tokens, take them all
  if constexpr (K <= 128) {
    // The (K/8)-th largest thread maximum of each warp, then the least of the 8: every warp has K/8
    // tokens at or above it. No ranking across warps.
    __shared__ uint64_t warp_tau[kThreads / 32];
    if (lane == K / 8 - 1) warp_tau[warp] = sorted;
    __syncthreads();
    th = warp_tau[0];
#pragma unroll
    for (int i = 1; i < kThreads / 32; ++i) th = min(th, warp_tau[i]);
    th = th ? th : 1;
  } else {
    // The K-th largest thread maximum: ranked by binary search in the other warps' sorted lists.
    __shared__ uint64_t thread_max[kThreads];
    __shared__ uint64_t threshold;
    thread_max[threadIdx.x] = sorted;
    if (threadIdx.x == 0) threshold = 1;
    __syncthreads();
    rank_thread_maxima<K>(thread_max, sorted, lane, warp, threshold);
    __syncthreads();
    th = threshold;
  }
  uint64_t top = warp_top[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) top = max(top, warp_top[i]);
  const float chunk_max = top ? key_value(top) : -kInf;
  float sum = 0.f;
  if (chunk_max > -kInf) {
#pragma unroll
    for (int j = 0; j < kGroupsPerThread; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sum += fast_exp2((v[j][e] - chunk_max) * c2);
  }
  sum = warp_allreduce(sum, SumOp{});
  if (lane == 0) warp_sum[warp] = sum;
  const float th_x = th == 1 ? -kInf : key_value(th);  // a float test first, the full key on a pass
  collect_candidates<kTopkCap>(v, base, vocab, th, th_x, cand, num_cand);
  __syncthreads();
  const int n = min(num_cand, kTopkCap);
  uint64_t* my_list = lists + (static_cast<int64_t>(w) * splits + split) * K;
  if (n <= 4 * K) {
    rank_by_counting(cand, n, K, my_list);
  } else {
    const int padded = pow2_at_least(n);
    for (int i = n + threadIdx.x; i < padded; i += kThreads) cand[i] = 0;
    block_sort_desc<kThreads>(cand, padded);
    for (int i = threadIdx.x; i < K && i < n; i += kThreads) my_list[i] = cand[i];
  }
  for (int i = n + threadIdx.x; i < K; i += kThreads) my_list[i] = 0;
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < kThreads / 32; ++i) s += warp_sum[i];
    sums[static_cast<int64_t>(w) * splits + split] = ChunkSum{chunk_max, s};
    block_flags[static_cast<int64_t>(w) * splits + split] = num_cand > kTopkCap ? TS_ROW_UNSETTLED : 0u;
  }
  if (!finish_and_elect_last(ws.counters + w, splits)) return;

  // ---- merge stage. Row max, sum and flags: each thread folds its splits (one when splits <= kThreads).
  const int64_t first = static_cast<int64_t>(w) * splits;
  float m = -kInf;
  double s = 0.0;
  bool overflow = false;
  for (int i = threadIdx.x; i < splits; i += kThreads) {
    const float cm = __ldcg(&sums[first + i].max), cs = __ldcg(&sums[first + i].sum);
    overflow |= __ldcg(block_flags + first + i) != 0;
    if (cm > -kInf) {
      const float nm = fmaxf(m, cm);
      s = s * exp2(static_cast<double>((m - nm) * c2)) + cs * exp2(static_cast<double>((cm - nm) * c2));
      m = nm;
    }
  }
  // The top kk by x: the lists' first kk entries in slots of `stride` keys (zero padded), batch by
  // batch; slot 0 holds the top kk so far. An entry's rank is its place in its list plus the entries
  // above it in the other slots; the kk with rank < kk are the batch's top kk.
  const int kk = min(k + 1, K);
  const int stride = pow2_at_least(kk + 1), per_batch = kTopkCap / stride - 1;
  __shared__ uint64_t buf[2][K];
  uint64_t *acc = buf[0], *next = buf[1];
  for (int s0 = 0; s0 < splits; s0 += per_batch) {
    const int nb = min(per_batch, splits - s0), slots = nb + 1;
    for (int i = threadIdx.x; i < slots * stride; i += kThreads) {
      const int j = i / stride, e = i - j * stride;
      cand[i] = e >= kk ? 0 : j ? __ldcg(lists + (first + s0 + j - 1) * K + e) : s0 ? acc[e] : 0;
    }
    for (int i = threadIdx.x; i < kk; i += kThreads) next[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < slots * stride; i += kThreads) {
      const int j = i / stride, e = i - j * stride;
      const uint64_t key = cand[i];
      if (e >= kk || !key) continue;
      int r = e;
      for (int j2 = 0; j2 < slots && r < kk; ++j2)
        if (j2 != j) r += count_above(cand + j2 * stride, stride, key);
      if (r < kk) next[r] = key;
    }
    __syncthreads();
    uint64_t* tmp = acc;
    acc = next, next = tmp;
  }
  __shared__ double dscratch[kThreads / 32];
  const float row_max = block_allreduce<kThreads>(m, MaxOp{}, warp_sum);
  const double total =
      block_allreduce<kThreads>(m > -kInf ? s * exp2(static_cast<double>((m - row_max) * c2)) : 0.0, SumOp{}, dscratch);
  overflow = __syncthreads_or(overflow);
  const float lse = static_cast<float>(log(total));
  const bool valid = row_max > -kInf;
  // p of the first k + 1 by x, ranked by (p desc, id asc) into `ranked`
  uint64_t *pkey = cand, *ranked = cand + K;
  for (int i = threadIdx.x; i < kk; i += kThreads) {
    const uint64_t key = acc[i];
    pkey[i] = key ? rank_key(expf(__fsub_rn(scaled(key_value(key), row_max, t), lse)), key_index(key)) : 0;
    ranked[i] = 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kk; i += kThreads) {
    const uint64_t key = pkey[i];
    if (!key) continue;
    int rank = 0;
    for (int j = 0; j < kk; ++j) rank += pkey[j] > key;
    ranked[rank] = key;
  }
  __syncthreads();
  const int64_t o = static_cast<int64_t>(w) * k;
  for (int i = threadIdx.x; i < k; i += kThreads) {
    const uint64_t key = ranked[i];
    probs[o + i] = valid && key ? key_value(key) : 0.f;
    ids[o + i] = valid && key ? static_cast<int64_t>(key_index(key)) : -1;
  }
  if (threadIdx.x == 0) {
    const bool cut_tie = valid && kk == k + 1 && ranked[k] != 0 && key_value(ranked[k]) == key_value(ranked[k - 1]);
    flags[w] = static_cast<uint8_t>(overflow || cut_tie ? TS_ROW_UNSETTLED : 0u);
  }
}

}  // namespace tokensampler
