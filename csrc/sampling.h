/* C API of the logits-path sampling kernels (csrc/sampling.cu). Plain C types only, so that any
 * host code (the torch binding in bindings.cpp, a C++ server, a test program) can launch them.
 * Every array is device memory. Per-row arrays are indexed by the logits row r; kernels run over
 * the work list `rows` (r of each work row; NULL means rows 0 .. num_work_rows-1).
 * Semantics: docs/semantics.md. Every launcher returns a cudaError_t as int (0 = success).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* data;  /* [num_rows, vocab], contiguous unless row_start is given */
  int64_t num_rows;
  int64_t vocab;
  int32_t dtype; /* 0 fp32, 1 fp16, 2 bf16 */
  const int64_t* row_start; /* device [num_rows]: row r begins row_start[r] elements past data (rows
                               gathered from a region, no copy); NULL: r * vocab */
} TsLogits;

/* Structured output (docs/semantics.md, step 2 and choice 17): packed allowed-token words, token i of a row
 * allowed when bit i % 32 of its word i / 32 is set. The kernels read a disallowed token as -inf, so all they
 * write (row statistics and log-sum-exp included) is of the masked row. Row r's words
 * begin at words + m * row_words, m = row[r] (-1: row r has no mask), or m = r when row is NULL. Bits of tokens
 * >= vocab are ignored. */
typedef struct {
  const int32_t* words;  /* NULL: no row has a mask */
  const int32_t* row;
  int64_t row_words;     /* >= ceil(vocab / 32) */
  const float* floor;    /* NULL: none. Else, and words NULL, float [num_rows] by logits row: a token whose logit is
                            below its row's floor reads as -inf, as if its bit were clear (top-n-sigma's cut:
                            local_samplers.h); NaN and +inf are not below it. Logits-path kernels only */
} TsBitmask;

/* The per-row sampling parameters, declared once as X(type, name) (docs/semantics.md): temperature (0: greedy),
 * top_k (0: off; callers map -1 and k >= V to 0), top_p (1: off), min_p (0: off), and the noise stream's seed,
 * position and iteration. TsRows holds a device array of each, the route planner's stage an offset of each
 * (routes.h TsStageLayout) and a prepared request of the native path a host vector of each (native_path.h). The
 * 8-byte types come first, so that arrays laid out back to back in this order stay aligned. The Python side lists
 * the same names in the same order (model/sampling.py ROW_FIELDS; tests/test_cuda_buffers.py holds the two equal). */
#define TS_ROW_PARAMS(X) \
  X(int64_t, seed)         \
  X(int64_t, position)     \
  X(int64_t, iteration)    \
  X(float, temperature)    \
  X(float, top_p)          \
  X(float, min_p)          \
  X(int32_t, top_k)

typedef struct {
  const int32_t* rows;
  int32_t num_work_rows;
#define TS_ROW_ARRAY(type, name) const type* name;
  TS_ROW_PARAMS(TS_ROW_ARRAY)
#undef TS_ROW_ARRAY
  TsBitmask bitmask;
} TsRows;

/* The bits of a row's flags, which every sampling kernel writes (TsOutputs.flags, TsFusedOutputs.flags, the
 * workloads' flags); backends/cuda_buffers.py holds Python's copy. UNSETTLED: the kernel could not settle the row
 * exactly (z-order ties past its candidates, a kept set reaching past them) and a slower route must sample it. */
enum { TS_ROW_NAN = 1, TS_ROW_INVALID = 2, TS_ROW_UNSETTLED = 4 };

/* Outputs; a NULL pointer is not written. tokens is [num_rows, num_samples]. */
typedef struct {
  int64_t* tokens;
  int32_t num_samples;
  int32_t sample;       /* the sample (Philox word 3) this launch draws, where one launch draws one */
  uint8_t* flags;       /* TS_ROW_* bits */
  float* row_max;       /* max of the sanitized logits */
  float* row_min;       /* min of the finite logits */
  float* row_logz;      /* log sum exp(scale * (x - max)) */
  float* kept_mass;     /* sum over the kept set of exp(z), z = (x - max) / T */
  int64_t* kept_min_key; /* rank key (z desc, id asc) of the last kept token */
} TsOutputs;

/* Persistent zeroed buffers (the kernels leave them zeroed) and per-call scratch. */
typedef struct {
  unsigned int* counters;  /* >= num_work_rows, zeroed */
  void* hist;              /* >= ts_hist_bytes(num_work_rows), zeroed */
  void* scratch;           /* >= the launcher's ts_*_scratch_bytes */
  unsigned long long* fallback_count; /* incremented once per exact re-evaluation in a kernel */
} TsWorkspace;

int ts_num_splits(int64_t vocab);
size_t ts_stats_scratch_bytes(int32_t num_work_rows, int64_t vocab);
size_t ts_gumbel_scratch_bytes(int32_t num_work_rows, int64_t vocab);
size_t ts_topk_scratch_bytes(int32_t num_work_rows, int64_t vocab, int32_t bucket);
size_t ts_hist_bytes(int32_t num_work_rows);
int ts_topk_bucket(int32_t k); /* smallest bucket holding k + 1 candidates, 0 if none */

/* Row max/min, argmax, nan flag, optional log-sum-exp with a per-row scale (lse_scale NULL: none);
 * with out->tokens, writes the argmax (or -1) to every sample column: the greedy sampler. */
int ts_stats(const TsLogits* logits, const TsRows* rows, const float* lse_scale,
             const TsOutputs* out, const TsWorkspace* ws, void* stream);

/* ts_stats of the rows whose flag in `flagged` (a fast kernel's flags) has bit 2 set; every other row of the launch
 * gets flag 8 in out->flags, which ts_filter on the same rows afterwards skips: the exact filter for just the rows
 * the top-k kernel left, decided on the device. */
int ts_stats_flagged(const TsLogits* logits, const TsRows* rows, const uint8_t* flagged, const TsOutputs* out,
                     const TsWorkspace* ws, void* stream);

/* The Gumbel-max samplers below draw samples out->sample .. + num_draws - 1 in one launch, each (sample, row) with its
 * own partials and counter: scratch num_draws x ts_gumbel_scratch_bytes, counters num_draws x the rows'. */

/* Gumbel-max over the whole vocabulary (no filter); optional lse as ts_stats. */
int ts_gumbel(const TsLogits* logits, const TsRows* rows, const float* lse_scale, int32_t num_draws,
              const TsOutputs* out, const TsWorkspace* ws, void* stream);

/* min-p alone (no k, no top-p): Gumbel-max over the tokens min-p keeps, given ts_stats' row_max of the same rows.
 * Launched to overlap the end of the kernel before it on the stream (programmatic dependent launch), like
 * ts_filter. */
int ts_min_p(const TsLogits* logits, const TsRows* rows, const float* row_max, int32_t num_draws,
             const TsOutputs* out, const TsWorkspace* ws, void* stream);

/* Gumbel-max over each row's kept set as ts_cut gives it (kept_keys), given ts_stats' row_max of the same rows: the
 * token of ts_filter for the same row and sample. Launched to overlap the end of the kernel before it (programmatic
 * dependent launch). A row whose cut kept nothing gets -1 and flag 4 (the same flags every sample). */
int ts_sample_kept(const TsLogits* logits, const TsRows* rows, const float* row_max, const int64_t* kept_keys,
                   int32_t num_draws, const TsOutputs* out, const TsWorkspace* ws, void* stream);

/* top-k (1 <= k, k + 1 <= bucket) with optional top-p and min-p, every sample in one launch. */
int ts_topk(const TsLogits* logits, const TsRows* rows, int32_t bucket, const TsOutputs* out,
            const TsWorkspace* ws, void* stream);

/* Exact top-p / min-p / large-k filtering and sampling of sample out->sample, given ts_stats'
 * row_max, row_min, flags and argmax (its tokens, [num_rows, out->num_samples]).
 * need_exact_mass: resolve the kept set exactly (processed logprobs).
 * splits: blocks per row (any value gives the same result). Launched to overlap the end of the
 * kernel before it on the stream (programmatic dependent launch); it reads nothing before that kernel
 * has finished. */
int ts_filter(const TsLogits* logits, const TsRows* rows, const float* row_max,
              const float* row_min, const int64_t* row_argmax, const uint8_t* stats_flags,
              int32_t need_exact_mass, int32_t splits, const TsOutputs* out, const TsWorkspace* ws,
              void* stream);

/* The kept set of ts_filter (any k, top-p, min-p), with no sample drawn: each row's last kept rank key (z desc, id
 * asc) to kept_keys (int64, by row; ~0: none kept, or no finite logit), for ts_sample_kept to draw every sample
 * from. Arguments and launch as ts_filter; the workspace's hist and counters as ts_filter's. */
int ts_cut(const TsLogits* logits, const TsRows* rows, const float* row_max, const float* row_min,
           const int64_t* row_argmax, const uint8_t* stats_flags, int32_t splits, int64_t* kept_keys,
           const TsWorkspace* ws, void* stream);

/* Top-p and/or min-p without k, sample out->sample, from a frontier of candidates (nucleus.cuh):
 * writes what ts_stats writes to pre (row_max, row_min, tokens [num_rows, 1] = argmax, flags) and,
 * for the rows it settles, the token to out and bit 8 to pre->flags. ts_filter on the same rows and
 * pre afterwards does the others (and skips these). Two launches; the scratch is
 * ts_nucleus_scratch_bytes. */
size_t ts_nucleus_scratch_bytes(int32_t num_work_rows, int64_t vocab);
int ts_nucleus(const TsLogits* logits, const TsRows* rows, const TsOutputs* pre, const TsOutputs* out,
               const TsWorkspace* ws, void* stream);

/* The bitmask (or the floor) written into fp32 logits [num_rows, vocab] (contiguous) in place: every token it
 * disallows becomes -inf, the others are left as they are (rows without a mask too). For logits that other
 * processing changes afterwards, and for tables of the logits the kernels read; the sampling kernels apply
 * TsRows.bitmask themselves. */
int ts_apply_bitmask(float* logits, int64_t num_rows, int64_t vocab, const TsBitmask* bitmask, void* stream);

/* dst[r] |= src[r] & bits for r in [0, n): a sample's exact-filter flags kept across the samples of a call. */
int ts_or_flags(uint8_t* dst, const uint8_t* src, int64_t n, uint8_t bits, void* stream);

/* Test hook: the Philox words and exact Gumbel noise of tokens [0, vocab) of one stream, each Philox product
 * formed as one 64-bit product (split_products = 0) or by __umulhi and a 32-bit product (1). */
int ts_noise(int64_t seed, int64_t position, int64_t iteration, uint32_t sample, int64_t vocab, int split_products,
             uint32_t* words, float* noise, void* stream);

#ifdef __cplusplus
}
#endif
