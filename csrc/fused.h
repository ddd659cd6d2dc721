/* C API of the fused LM-head matmul + sampling kernels (csrc/fused.cu).
 *
 * x = W h is computed tile by tile on chip (tensor-core MMA, fp32 accumulation) and consumed there:
 * per-row running max and sum-exp, the Gumbel-max winner (or the argmax), and for filtered rows the
 * best keys of each CTA's vocabulary range. A second kernel merges the CTAs' partial results per row
 * (the best kCand = 64 keys of a filtered row) and finishes docs/semantics.md. Logits never reach
 * global memory.
 *
 * Scope (the host checks it; anything else takes the logits path): W and h both bf16 or both fp16,
 * D a multiple of 64, no processing but a token bitmask (TsRows.bitmask, applied to each logit as it is
 * made), raw log-probs only and not with a bitmask, top_k < kCand, one sample per row for rows without
 * filters. Rows whose kept set cannot be decided from the candidates (top-p or
 * min-p without k, kept mass beyond the candidates, a kept set reaching below the keys a CTA's full
 * list may have cut off) come back flagged for the exact logits path.
 * Every array is device memory; every launcher returns a cudaError_t as int (0 = success).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* weight;   /* [padded_vocab, dim], contiguous, 16-byte aligned */
  int64_t vocab;        /* rows that can be sampled (<= padded rows; the rest are never read) */
  int64_t dim;
  int32_t dtype;        /* 1 fp16, 2 bf16 (TsLogits' codes) */
  const float* bias;    /* [>= vocab] or NULL */
  float logit_scale;
  float soft_cap;       /* 0: none */
  int64_t first_token;  /* the token id of weight row 0, a multiple of 128 (a vocabulary-parallel shard: rows
                           first_token .. first_token + vocab - 1 of a larger head, bias indexed like the weight);
                           ids, noise and the token bitmask are the whole vocabulary's. 0: the whole head */
} TsLmHead;

typedef struct {
  int64_t* tokens;      /* [num_rows, num_samples] */
  int32_t num_samples;
  float* logprobs;      /* [num_rows, num_samples], raw log-probs; NULL: not computed */
  uint8_t* flags;       /* [num_rows]: TS_ROW_* bits (sampling.h); UNSETTLED: the row needs the logits path */
} TsFusedOutputs;

/* Stage 1 kernels: W streamed by the tensor memory accelerator, collecting filtered rows' candidates
 * (16 a CTA) or, when no row has filters, none (filtered rows then come back flagged); or W through a
 * register ring (64 candidates a CTA) where the streaming kernel's shared memory does not fit, or for
 * filtered rows of small vocabularies (fewer than 64 CTAs along V). */
enum { TS_FUSED_RING = 0, TS_FUSED_STREAM = 1, TS_FUSED_STREAM_CANDIDATES = 2 };

/* The launch plan for B rows of hidden size dim on a GPU with num_sms SMs: the stage 1 kernel, rows per
 * CTA (ring: 8 or 16; stream: 8, 16, 32 or 64), CTAs per batch tile along the vocabulary, and the
 * scratch bytes. 0 rows per tile: dim not supported. `filtered`: some row has top-k/top-p/min-p (its
 * candidates are then collected). */
typedef struct {
  int32_t kernel;
  int32_t rows_per_tile;
  int32_t vocab_ctas;
  int32_t batch_tiles;
  size_t smem_bytes;
  size_t scratch_bytes;
} TsFusedPlan;

TsFusedPlan ts_fused_plan(int64_t num_rows, int64_t dim, int64_t vocab, int32_t num_sms, int32_t max_smem,
                          int32_t filtered);

/* The route of a hidden-state batch of num_rows rows (`filtered`: some sampled row has top-k, top-p or min-p): 1 when
 * the backend sends it to the fused kernel, 0 when cuBLAS into fp32 logits + the logits kernels (routes.h) is faster.
 * By measurement on an H200 (docs/design/fused-lm-head.md): the fused kernel up to one streaming batch tile (128
 * rows), up to 64 rows when filtered, where the candidates' epilogue beside the multiply costs more. Rows whose top-k
 * exceeds TS_FUSED_MAX_TOP_K (k + 1 within the 64 candidates a row keeps) take the logits path whatever B. */
enum { TS_FUSED_MAX_TOP_K = 63 };
int32_t ts_fused_preferred(int64_t num_rows, int32_t filtered);

/* Samples num_rows hidden states [num_rows, dim] (the weight's dtype, 16-byte aligned rows) with the
 * per-row parameters `rows` (its `rows` work list must be NULL): ts_fused_partials, then ts_fused_finish. */
int ts_fused_sample(const TsLmHead* head, const void* states, int64_t num_rows, const TsRows* rows,
                    const TsFusedPlan* plan, const TsFusedOutputs* out, void* scratch, void* stream);

/* The two stages apart, for a head split by vocabulary rows (docs/design/vocab-parallel.md): each shard's
 * stage 1 writes its partial results, and one stage 2 finishes them where an all-gather leaves them.
 *
 * Stage 1 writes `scratch` (plan->scratch_bytes): partials [num_rows, plan->vocab_ctas] of
 * TS_FUSED_PARTIAL_BYTES each, then candidates [num_rows, plan->vocab_ctas, ts_fused_candidates(plan->kernel)]
 * uint64 keys. want_sum1: raw log-probs will be asked of stage 2. */
enum { TS_FUSED_PARTIAL_BYTES = 32 };
int32_t ts_fused_candidates(int32_t kernel);
int ts_fused_partials(const TsLmHead* head, const void* states, int64_t num_rows, const TsRows* rows,
                      const TsFusedPlan* plan, int32_t want_sum1, void* scratch, void* stream);
/* Stage 2 over num_shards stage 1 outputs side by side, `shard_bytes` apart from `shards` on (one call's scratch,
 * or the shards' as an all-gather leaves them), each from a plan of parts_a_shard CTAs along V with cands_per_part
 * candidates a CTA: a row's parts are the shards' CTAs in turn. */
int ts_fused_finish(int64_t num_rows, const TsRows* rows, int32_t num_shards, int32_t parts_a_shard, const void* shards,
                    size_t shard_bytes, int32_t cands_per_part, const TsFusedOutputs* out, void* stream);

/* The fp32 logits [num_rows, head->vocab] of the rows whose flags (a fused call's) have TS_ROW_UNSETTLED: W·h
 * accumulated in fp32 and finished (bias, scale, soft cap) as the fused kernel finishes each logit; the other rows
 * are not written. What a call planned once (a captured CUDA graph) samples those rows from on the device, with
 * routes.h's TS_ROUTES_FLAGGED, instead of the cuBLAS product a host decision would pick. A whole head
 * (first_token 0); states [num_rows, dim] in the weight's dtype, both 16-byte aligned. */
int ts_fused_head_rows(const TsLmHead* head, const void* states, int64_t num_rows, const uint8_t* flags, float* logits,
                       void* stream);

#ifdef __cplusplus
}
#endif
