/* The routes of one sampling call over logits (docs/design/kernel-routing.md): which kernel samples each row,
 * decided from the rows' parameters on the host (so routing costs no synchronisation), and the launches of a call
 * in their one order. The CUDA backend (server/tokensampler_server/backends/cuda.py) and the native path
 * (native_path.cpp) both sample through here: this is the one place that routes rows and launches the logits
 * kernels.
 *
 * A call: the caller writes the rows' parameters into a host stage laid out by ts_stage_layout (pinned memory,
 * later copied to the device in one copy), ts_plan groups the rows and writes the groups' row lists (and, for
 * log-prob calls, three row masks) into the same stage, the caller copies the stage up, and ts_launch_plan
 * launches every kernel of the plan on the device copy. Plain C types, no framework.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TS_NUM_BUCKETS 5 /* the top-k kernel's candidate buckets: 16, 32, 64, 128, 256 */
/* Top-p rows from this many up take the frontier route (TS_EXACT_FRONTIER): slower than the filter at B = 1 and 8,
 * 2x faster on spiky rows from B = 32 (docs/design/kernel-routing.md). */
#define TS_FRONTIER_MIN_ROWS 32
/* Calls of several samples a row take the cut route (TS_EXACT_CUT) for rows with top-p too, where the filter would
 * run a pass a sample: from 2 samples when a row has a k (1.35-1.8x faster at 2 samples), from 8 for top-p without k
 * below TS_FRONTIER_MIN_ROWS rows, whose filter pass is cheaper (the two cross at 4-6 samples; H200 measurements in
 * docs/design/kernel-routing.md). */
#define TS_CUT_MIN_SAMPLES_WITH_K 2
#define TS_CUT_MIN_SAMPLES_TOP_P 8

/* Byte offsets, in the stage of num_rows rows, of each per-row array: the parameters first, back to back in
 * TS_ROW_PARAMS' order (temperature as given; ts_plan makes it T_eff, 1 in greedy rows), then the planner's. */
typedef struct {
#define TS_ROW_OFFSET(type, name) size_t name;
  TS_ROW_PARAMS(TS_ROW_OFFSET)
#undef TS_ROW_OFFSET
  size_t masks;                     /* bool [3, B]: use_filt, through, need_raw (written for log-prob calls) */
  size_t lists;                     /* int32 [3B]: the groups' row ids (ts_plan) */
  size_t row_start;                 /* int64 [B]: TsLogits.row_start, for rows gathered from anywhere */
  size_t bitmask_row;               /* int32 [B]: TsBitmask.row */
  size_t bitmask_words;             /* token-bitmask words from here to the end */
} TsStageLayout;

TsStageLayout ts_stage_layout(int64_t num_rows);

/* What a call wants beside tokens. */
typedef enum {
  TS_TOKENS = 0,            /* tokens and flags alone: every group writes the main outputs */
  TS_LOGPROBS_RAW = 1,      /* log-probs of the input logits */
  TS_LOGPROBS_PROCESSED = 2 /* log-probs of the processed distribution: exact kept mass, greedy rows filtered too */
} TsCallKind;

/* How ts_plan routes the filtered rows. */
typedef enum {
  TS_ROUTES_EXACT = 0,   /* every filtered row to the exact group: the second pass over rows a fast kernel flagged */
  TS_ROUTES_FAST = 1,    /* the top-k buckets where they apply; the rows they flag (flag 4) go back to the caller */
  TS_ROUTES_SETTLED = 2, /* the top-k buckets, then stats + filter on the device for just the rows they flagged:
                            nothing is left for the host to decide (TS_TOKENS calls only) */
  TS_ROUTES_FLAGGED = 3  /* another kernel (fused.h's) has sampled every row into the main outputs: only the settle
                            group runs, every filtered row in it, to redo the rows that kernel flagged (TS_TOKENS
                            calls only) */
} TsRouting;

/* Rows ids lists[first .. first + n) of the stage; first -1: every row (no list); n 0: no row. */
typedef struct {
  int32_t first;
  int32_t n;
} TsGroup;

/* How the exact group's rows are sampled. */
typedef enum {
  TS_EXACT_FILTER = 0,   /* ts_stats, then ts_filter: any k, p and min-p */
  TS_EXACT_MIN_P = 1,    /* ts_stats, then ts_min_p: min-p alone */
  TS_EXACT_FRONTIER = 2, /* ts_nucleus, then ts_filter for the rows it leaves: top-p without k, many rows */
  TS_EXACT_CUT = 3       /* ts_stats, ts_cut once, then ts_sample_kept a sample: any k, p and min-p; no kept mass */
} TsExactRoute;

typedef struct {
  int64_t num_rows, vocab;
  int32_t num_samples; /* samples a row */
  int32_t kind;        /* TsCallKind */
  int32_t processing;  /* the logits were processed before sampling: RAW log-probs need the input's own pass */
  TsGroup greedy;      /* T = 0: ts_stats (argmax) */
  TsGroup unfiltered;  /* T > 0, no filter: ts_gumbel */
  TsGroup buckets[TS_NUM_BUCKETS]; /* 0 < k, k + 1 <= bucket: ts_topk, with top-p / min-p on its candidates */
  TsGroup exact;       /* every other filtered row: TsExactRoute */
  TsGroup need_raw;    /* RAW log-prob rows whose input log-sum-exp needs its own ts_stats pass */
  TsGroup settle;      /* TS_ROUTES_SETTLED: every bucket row, TS_ROUTES_FLAGGED: every filtered row;
                          ts_stats_flagged and ts_filter redo the flagged ones */
  int32_t exact_route; /* TsExactRoute */
  int32_t filter_splits; /* ts_filter's blocks a row */
  int32_t settle_splits; /* the same for the settle group */
  int32_t lists_used;  /* row ids written at the stage's lists */
} TsPlan;

/* Groups the rows of the host stage (its parameter arrays filled) for a call of `kind` drawing num_samples samples a
 * row, the filtered rows as `routing` (TsRouting) says. Writes the row lists, T_eff and, for log-prob calls, the masks
 * into the stage. Returns 0, or cudaErrorInvalidValue for a call it cannot plan. */
int ts_plan(void* host_stage, int64_t num_rows, int64_t vocab, int32_t num_samples, int32_t kind, int32_t processing,
            int32_t routing, TsPlan* plan);

/* ts_filter's blocks a row for a launch over num_work_rows rows, after the frontier (1) or after ts_stats (0). */
int32_t ts_filter_splits(int32_t num_work_rows, int32_t after_frontier);

/* The workspace ts_launch_plan needs for a plan (TsWorkspace's buffers, in bytes). */
typedef struct {
  size_t counters, hist, scratch;
} TsWorkspaceBytes;

TsWorkspaceBytes ts_plan_workspace(const TsPlan* plan);

/* Where a call's kernels write: main (greedy and unfiltered rows; with TS_TOKENS every row), filt (filtered rows of
 * log-prob calls; with TS_TOKENS the same tokens and flags as main), pre (the exact group's row statistics, passed
 * between its two kernels: tokens [B, 1], flags, row_max, row_min), raw (the need_raw pass: flags, row_max,
 * row_min, row_logz), and exact_bits (uint8 [B] scratch: with several samples on the filter or frontier route, every
 * sample's exact-filter flag; NULL otherwise). */
typedef struct {
  TsOutputs main, filt, pre, raw;
  uint8_t* exact_bits;
} TsCallOutputs;

/* The logits the kernels read (processed or not; `bitmask` read with them), the per-row log-sum-exp scales of the
 * greedy and unfiltered launches (NULL: none), and, for the need_raw pass, the input logits and their scale. */
typedef struct {
  TsLogits logits;
  TsBitmask bitmask;
  const float* lse_scale;
  TsLogits raw_logits;
  const float* raw_lse_scale;
} TsCallInputs;

/* Every launch of the plan, in order: greedy, unfiltered, the top-k buckets, the settle group, the exact group, the
 * need_raw pass; each sampler draws the plan's num_samples samples a row.
 * dev_stage: the device copy of the planned stage. */
int ts_launch_plan(const TsPlan* plan, const TsCallInputs* in, const void* dev_stage, const TsCallOutputs* out,
                   const TsWorkspace* ws, void* stream);

#ifdef __cplusplus
}
#endif
