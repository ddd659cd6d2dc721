// The routes of a sampling call (routes.h): the plan on the host, the launches on the caller's stream. Host code
// only: the launchers are sampling.h's.
#include "routes.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int32_t kBuckets[TS_NUM_BUCKETS] = {16, 32, 64, 128, 256};
// The top-k kernel merges chunks x bucket candidate keys of a row in shared memory.
constexpr int64_t kMaxMergedCandidates = 16384;
// Filter blocks to aim for: two per multiprocessor of an H100/H200. After the frontier the filter gets only the rows
// the frontier left (rare) and most of its blocks find their row decided: one block a multiprocessor took 0.5 us off
// flat top-p at B = 256 (docs/design/top-p-frontier.md).
constexpr int32_t kFilterBlocksTarget = 264;
constexpr int32_t kFrontierFilterBlocksTarget = kFilterBlocksTarget / 2;

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// The index in kBuckets of the top-k kernel's bucket for k (ts_topk_bucket), -1 when none applies.
int bucket_index(int32_t k, int64_t vocab) {
  const int32_t bucket = k > 0 ? ts_topk_bucket(k) : 0;
  if (!bucket || ts_num_splits(vocab) * bucket > kMaxMergedCandidates) return -1;
  return static_cast<int>(std::find(kBuckets, kBuckets + TS_NUM_BUCKETS, bucket) - kBuckets);
}

// The cut route's kept keys (int64 [num_rows]) lie in the scratch, after what its stats and sampling kernels use (the
// sampling kernel draws every sample at once: a partial each).
size_t cut_keys_offset(const TsPlan* plan) {
  return align16(std::max(ts_stats_scratch_bytes(plan->exact.n, plan->vocab),
                          ts_gumbel_scratch_bytes(plan->exact.n, plan->vocab) * static_cast<size_t>(plan->num_samples)));
}

// Row ids gathered for one group while planning; placed into the stage's lists when the plan is complete.
struct Collector {
  int32_t* lists;
  int32_t used = 0;
  TsGroup place(const int32_t* ids, int32_t n, int64_t num_rows) {
    if (n == 0) return TsGroup{0, 0};
    if (n == num_rows) return TsGroup{-1, n};
    std::memcpy(lists + used, ids, sizeof(int32_t) * static_cast<size_t>(n));
    const TsGroup group{used, n};
    used += n;
    return group;
  }
};

}  // namespace

extern "C" {

TsStageLayout ts_stage_layout(int64_t num_rows) {
  // The parameters back to back (each array stays aligned to its element: int64 first), so that a caller fills the
  // int64 and the float32 ones with one copy each; the rest 16-byte aligned.
  const size_t b = static_cast<size_t>(num_rows);
  TsStageLayout s{};
  size_t at = 0;
#define TS_PLACE(type, name) s.name = at, at += sizeof(type) * b;
  TS_ROW_PARAMS(TS_PLACE)
#undef TS_PLACE
  s.masks = at;
  s.lists = align16(s.masks + 3 * b);
  s.row_start = align16(s.lists + 12 * b);
  s.bitmask_row = align16(s.row_start + 8 * b);
  s.bitmask_words = align16(s.bitmask_row + 4 * b);
  return s;
}

int ts_plan(void* host_stage, int64_t num_rows, int64_t vocab, int32_t num_samples, int32_t kind, int32_t processing,
            int32_t routing, TsPlan* plan) {
  if (num_rows < 0 || vocab < 1 || num_samples < 1 || kind < TS_TOKENS || kind > TS_LOGPROBS_PROCESSED)
    return cudaErrorInvalidValue;
  const bool flagged_only = routing == TS_ROUTES_FLAGGED, settles = routing == TS_ROUTES_SETTLED || flagged_only;
  if (routing < TS_ROUTES_EXACT || routing > TS_ROUTES_FLAGGED || (settles && kind != TS_TOKENS))
    return cudaErrorInvalidValue;
  const bool use_buckets = routing == TS_ROUTES_FAST || routing == TS_ROUTES_SETTLED;
  const TsStageLayout layout = ts_stage_layout(num_rows);
  char* stage = static_cast<char*>(host_stage);
  auto* t_eff = reinterpret_cast<float*>(stage + layout.temperature);
  const auto* top_p = reinterpret_cast<const float*>(stage + layout.top_p);
  const auto* min_p = reinterpret_cast<const float*>(stage + layout.min_p);
  const auto* top_k = reinterpret_cast<const int32_t*>(stage + layout.top_k);
  const bool log_probs = kind != TS_TOKENS, processed = kind == TS_LOGPROBS_PROCESSED;
  bool* use_filt = log_probs ? reinterpret_cast<bool*>(stage + layout.masks) : nullptr;
  bool* through_mask = use_filt ? use_filt + num_rows : nullptr;
  bool* need_raw_mask = use_filt ? use_filt + 2 * num_rows : nullptr;

  // Each group's ids in its own scratch list (four lists of B, then the buckets'), placed at the end in the plan's
  // launch order so that a group of every row needs no list at all.
  std::vector<int32_t> ids(static_cast<size_t>(4 + TS_NUM_BUCKETS) * static_cast<size_t>(num_rows));
  int32_t* greedy = ids.data();
  int32_t* unfiltered = greedy + num_rows;
  int32_t* exact = unfiltered + num_rows;
  int32_t* need_raw = exact + num_rows;
  int32_t* bucket_ids[TS_NUM_BUCKETS];
  for (int i = 0; i < TS_NUM_BUCKETS; ++i) bucket_ids[i] = need_raw + (i + 1) * num_rows;
  std::vector<int32_t> settle;  // the bucket rows (TS_ROUTES_SETTLED) or the filtered ones (FLAGGED), in row order
  int32_t n_greedy = 0, n_unfiltered = 0, n_exact = 0, n_raw = 0, n_bucket[TS_NUM_BUCKETS] = {};
  bool exact_has_k = false, exact_has_top_p = false;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float t = t_eff[r], p = top_p[r], m = min_p[r];
    const int32_t k = top_k[r];
    const int32_t id = static_cast<int32_t>(r);
    const bool is_greedy = t == 0.f, filtered = k > 0 || p < 1.f || m > 0.f;
    // Greedy rows never go through the filters, except for the kept set of processed log-probs (at T = 1).
    const bool through = filtered && (!is_greedy || processed);
    if (is_greedy) {
      if (!flagged_only) greedy[n_greedy++] = id;
      t_eff[r] = 1.f;
    } else if (!filtered && !flagged_only) {
      unfiltered[n_unfiltered++] = id;
    }
    if (through && flagged_only) {
      settle.push_back(id);
    } else if (through) {
      const int bucket = use_buckets ? bucket_index(k, vocab) : -1;
      if (bucket >= 0) {
        bucket_ids[bucket][n_bucket[bucket]++] = id;
        if (routing == TS_ROUTES_SETTLED) settle.push_back(id);
      } else {
        exact[n_exact++] = id;
        exact_has_k |= k > 0;
        exact_has_top_p |= p < 1.f;
      }
    }
    const bool raw_pass = processing || (!is_greedy && filtered);
    if (kind == TS_LOGPROBS_RAW && raw_pass) need_raw[n_raw++] = id;
    if (use_filt) {
      use_filt[r] = through && !is_greedy;
      through_mask[r] = through;
      need_raw_mask[r] = raw_pass;
    }
  }
  Collector lists{reinterpret_cast<int32_t*>(stage + layout.lists)};
  TsPlan p{};
  p.num_rows = num_rows, p.vocab = vocab, p.num_samples = num_samples, p.kind = kind, p.processing = processing;
  p.greedy = lists.place(greedy, n_greedy, num_rows);
  p.unfiltered = lists.place(unfiltered, n_unfiltered, num_rows);
  for (int i = 0; i < TS_NUM_BUCKETS; ++i) p.buckets[i] = lists.place(bucket_ids[i], n_bucket[i], num_rows);
  p.settle = lists.place(settle.data(), static_cast<int32_t>(settle.size()), num_rows);
  p.exact = lists.place(exact, n_exact, num_rows);
  p.need_raw = lists.place(need_raw, n_raw, num_rows);
  p.lists_used = lists.used;
  // Most settle rows are decided (flags are rare): their filter blocks leave at once, as after the frontier.
  p.settle_splits = ts_filter_splits(p.settle.n, 1);
  // Unless the kept mass itself is wanted (processed log-probs, the filter's), the kept set is a mask on Gumbel-max:
  // a k without top-p is found once for every sample by a pass of counts alone (no mass, no Philox); min-p alone
  // needs only the row max; top-p without k goes to the frontier from TS_FRONTIER_MIN_ROWS rows. Other rows with
  // top-p stay on the filter, whose one pass beat the cut's pass plus a Gumbel-max, unless the call draws enough
  // samples that the cut's pass (with the mass) once and a Gumbel-max a sample beat a filter pass a sample
  // (docs/design/kernel-routing.md).
  p.exact_route = processed ? TS_EXACT_FILTER
                  : exact_has_k ? (exact_has_top_p && num_samples < TS_CUT_MIN_SAMPLES_WITH_K ? TS_EXACT_FILTER
                                                                                              : TS_EXACT_CUT)
                  : !exact_has_top_p ? TS_EXACT_MIN_P
                  : n_exact >= TS_FRONTIER_MIN_ROWS ? TS_EXACT_FRONTIER
                  : num_samples >= TS_CUT_MIN_SAMPLES_TOP_P ? TS_EXACT_CUT
                                                            : TS_EXACT_FILTER;
  p.filter_splits = ts_filter_splits(n_exact, p.exact_route == TS_EXACT_FRONTIER);
  *plan = p;
  return cudaSuccess;
}

int32_t ts_filter_splits(int32_t num_work_rows, int32_t after_frontier) {
  const int32_t target = after_frontier ? kFrontierFilterBlocksTarget : kFilterBlocksTarget;
  const int32_t rows = std::max(num_work_rows, 1);
  return std::max(1, std::min(64, (target + rows - 1) / rows));
}

TsWorkspaceBytes ts_plan_workspace(const TsPlan* plan) {
  TsWorkspaceBytes w{0, 0, 0};
  const int64_t vocab = plan->vocab;
  auto need = [&](const TsGroup& g, size_t scratch) {
    if (!g.n) return;
    w.counters = std::max(w.counters, sizeof(uint32_t) * static_cast<size_t>(g.n));
    w.scratch = std::max(w.scratch, scratch);
  };
  // A Gumbel-max launch of every sample: a partial and a counter each (sampling.h).
  auto need_draws = [&](const TsGroup& g) {
    if (!g.n) return;
    const size_t draws = static_cast<size_t>(g.n) * static_cast<size_t>(plan->num_samples);
    w.counters = std::max(w.counters, sizeof(uint32_t) * draws);
    w.scratch = std::max(w.scratch, ts_gumbel_scratch_bytes(g.n, vocab) * static_cast<size_t>(plan->num_samples));
  };
  need(plan->greedy, ts_stats_scratch_bytes(plan->greedy.n, vocab));
  need_draws(plan->unfiltered);
  for (int i = 0; i < TS_NUM_BUCKETS; ++i)
    need(plan->buckets[i], ts_topk_scratch_bytes(plan->buckets[i].n, vocab, kBuckets[i]));
  const TsGroup& exact = plan->exact;
  if (exact.n) {
    switch (plan->exact_route) {
      case TS_EXACT_FRONTIER: need(exact, ts_nucleus_scratch_bytes(exact.n, vocab)); break;
      case TS_EXACT_MIN_P:
        need(exact, ts_stats_scratch_bytes(exact.n, vocab));
        need_draws(exact);
        break;
      case TS_EXACT_CUT:
        need(exact, cut_keys_offset(plan) + sizeof(int64_t) * static_cast<size_t>(plan->num_rows));
        need_draws(exact);
        break;
      default: need(exact, ts_stats_scratch_bytes(exact.n, vocab));
    }
    if (plan->exact_route != TS_EXACT_MIN_P && plan->filter_splits > 1) w.hist = ts_hist_bytes(exact.n);
  }
  need(plan->need_raw, ts_stats_scratch_bytes(plan->need_raw.n, vocab));
  need(plan->settle, ts_stats_scratch_bytes(plan->settle.n, vocab));
  if (plan->settle.n && plan->settle_splits > 1) w.hist = std::max(w.hist, ts_hist_bytes(plan->settle.n));
  return w;
}

int ts_launch_plan(const TsPlan* plan, const TsCallInputs* in, const void* dev_stage, const TsCallOutputs* out,
                   const TsWorkspace* ws, void* stream) {
  const int32_t num_samples = plan->num_samples;
  // The exact routes that launch once a sample rewrite the flags each time: out->exact_bits keeps every sample's
  // exact-filter bit. Min-p and the cut draw every sample in one launch.
  const bool keep_bits = num_samples > 1 && plan->exact.n && plan->exact_route != TS_EXACT_MIN_P &&
                         plan->exact_route != TS_EXACT_CUT;
  if (num_samples < 1 || (keep_bits && !out->exact_bits)) return cudaErrorInvalidValue;
  void* s = stream;
  const TsStageLayout layout = ts_stage_layout(plan->num_rows);
  const char* stage = static_cast<const char*>(dev_stage);
  const auto* lists = reinterpret_cast<const int32_t*>(stage + layout.lists);
  auto rows_of = [&](const TsGroup& g, const TsBitmask& bitmask) {
    TsRows r{};
    r.rows = g.first < 0 ? nullptr : lists + g.first, r.num_work_rows = g.n, r.bitmask = bitmask;
#define TS_POINT(type, name) r.name = reinterpret_cast<const type*>(stage + layout.name);
    TS_ROW_PARAMS(TS_POINT)
#undef TS_POINT
    return r;
  };
  const TsLogits* x = &in->logits;
  auto with_sample = [](TsOutputs o, int32_t ns, int32_t sample) {
    o.num_samples = ns, o.sample = sample;
    return o;
  };
  int err = 0;
  if (plan->greedy.n) {
    const TsRows r = rows_of(plan->greedy, in->bitmask);
    const TsOutputs o = with_sample(out->main, num_samples, 0);
    if ((err = ts_stats(x, &r, in->lse_scale, &o, ws, s))) return err;
  }
  if (plan->unfiltered.n) {
    const TsRows r = rows_of(plan->unfiltered, in->bitmask);
    const TsOutputs o = with_sample(out->main, num_samples, 0);
    if ((err = ts_gumbel(x, &r, in->lse_scale, num_samples, &o, ws, s))) return err;
  }
  for (int i = 0; i < TS_NUM_BUCKETS; ++i) {
    if (!plan->buckets[i].n) continue;
    const TsRows r = rows_of(plan->buckets[i], in->bitmask);
    const TsOutputs o = with_sample(out->filt, num_samples, 0);
    if ((err = ts_topk(x, &r, kBuckets[i], &o, ws, s))) return err;
  }
  const TsOutputs pre = with_sample(out->pre, 1, 0);
  auto filter = [&](const TsRows& r, int32_t need_exact_mass, int32_t splits, const TsOutputs& o) {
    return ts_filter(x, &r, pre.row_max, pre.row_min, pre.tokens, pre.flags, need_exact_mass, splits, &o, ws, s);
  };
  if (plan->settle.n) {  // the rows the buckets flagged, sampled again exact; the others leave both kernels at once
    const TsRows r = rows_of(plan->settle, in->bitmask);
    if ((err = ts_stats_flagged(x, &r, out->filt.flags, &pre, ws, s))) return err;
    for (int32_t sample = 0; sample < num_samples; ++sample)
      if ((err = filter(r, 0, plan->settle_splits, with_sample(out->filt, num_samples, sample)))) return err;
  }
  if (plan->exact.n) {
    const TsRows r = rows_of(plan->exact, in->bitmask);
    const int32_t route = plan->exact_route;
    if (route != TS_EXACT_FRONTIER && (err = ts_stats(x, &r, nullptr, &pre, ws, s))) return err;
    const TsOutputs all = with_sample(out->filt, num_samples, 0);
    if (route == TS_EXACT_MIN_P) {  // exact in the kernel, every sample in one launch
      if ((err = ts_min_p(x, &r, pre.row_max, num_samples, &all, ws, s))) return err;
    } else if (route == TS_EXACT_CUT) {  // the kept set once, then every sample in one launch
      auto* kept_keys = reinterpret_cast<int64_t*>(static_cast<char*>(ws->scratch) + cut_keys_offset(plan));
      if ((err = ts_cut(x, &r, pre.row_max, pre.row_min, pre.tokens, pre.flags, plan->filter_splits, kept_keys, ws,
                        s)) ||
          (err = ts_sample_kept(x, &r, pre.row_max, kept_keys, num_samples, &all, ws, s)))
        return err;
    } else {
      if (keep_bits && (err = cudaMemsetAsync(out->exact_bits, 0, static_cast<size_t>(plan->num_rows),
                                               static_cast<cudaStream_t>(s))))
        return err;
      for (int32_t sample = 0; sample < num_samples; ++sample) {
        const TsOutputs o = with_sample(out->filt, num_samples, sample);
        if (route == TS_EXACT_FRONTIER && (err = ts_nucleus(x, &r, &pre, &o, ws, s))) return err;
        const int32_t need_exact_mass = route == TS_EXACT_FILTER && plan->kind == TS_LOGPROBS_PROCESSED;
        if ((err = filter(r, need_exact_mass, plan->filter_splits, o))) return err;
        if (keep_bits && (err = ts_or_flags(out->exact_bits, o.flags, plan->num_rows, TS_ROW_UNSETTLED, s))) return err;
      }
      if (keep_bits && (err = ts_or_flags(out->filt.flags, out->exact_bits, plan->num_rows, 0xFF, s))) return err;
    }
  }
  if (plan->need_raw.n) {  // the input's log-sum-exp: no bitmask (step 1 precedes step 2)
    const TsRows r = rows_of(plan->need_raw, TsBitmask{});
    const TsOutputs o = with_sample(out->raw, 1, 0);
    if ((err = ts_stats(&in->raw_logits, &r, in->raw_lse_scale, &o, ws, s))) return err;
  }
  return cudaSuccess;
}

}  // extern "C"
