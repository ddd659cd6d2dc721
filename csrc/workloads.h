/* C API of the workload kernels (csrc/workloads.cu): diffusion steps, top-k probabilities and
 * speculative verification. Plain C types only; every array is device memory. Semantics:
 * docs/semantics.md (choices 14, 15, 16). Every launcher returns a cudaError_t as int (0 = success).
 * Workspaces are TsWorkspace (sampling.h): counters zeroed (left zeroed), scratch per launcher.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of logits grouped by request: row w belongs to request w / per_request, at slot
 * w % per_request. A diffusion step is B requests of L slots (positions); a verification is B
 * requests of n + 1 slots (target positions). */
typedef struct {
  const void* logits;       /* [num_rows, vocab], contiguous */
  int64_t vocab;
  int32_t dtype;            /* 0 fp32, 1 fp16, 2 bf16 */
  int32_t num_rows;
  int32_t per_request;
  const uint8_t* active;    /* [num_rows] or NULL: rows with 0 are neither read nor written */
  const float* temperature; /* [requests]; 0 = greedy */
  const int64_t* seed;      /* [requests] */
  const int64_t* position;  /* [requests] or NULL (0); the noise position of a slot is position + slot */
  const int64_t* iteration; /* [requests] */
  int32_t draw_slot;        /* draw a Gumbel-max sample at this slot only; -1: at every slot */
  const float* aux;         /* optional fp32 rows summed in the same pass: [requests * aux_per_request, vocab] */
  int32_t aux_per_request;  /* slot s < aux_per_request of request b reads aux row b * aux_per_request + s */
} TsRowJob;

/* Per row w (active rows only): statistics of the sanitized logits x, with c = 1 / T (1 for greedy). */
typedef struct {
  float* row_max;   /* max x (-inf: no finite logit) */
  float* row_sum;   /* sum exp(c (x - max)) */
  int64_t* argmax;  /* lowest index of the max, -1 if none */
  int64_t* token;   /* the sample: Gumbel-max of c (x - max) at drawn slots, the argmax elsewhere */
  float* aux_sum;   /* sum of the aux row, at slots that have one */
  float* confidence; /* the token's probability exp(c (x_token - max)) / row_sum; 0 where there is no token */
} TsRowStats;

size_t ts_row_stats_scratch_bytes(int32_t num_rows, int64_t vocab);

/* One read of every active row: max, argmax, sum of exponentials, the Gumbel-max sample; and of
 * every aux row (its sum). Workspace counters: 3 num_rows (the rows', the aux rows' (at most
 * num_rows) and, from 2 num_rows on, each drawing row's best screening pilot). A row's blocks run
 * side by side and share their screening bound as they go. */
int ts_row_stats(const TsRowJob* job, const TsRowStats* stats, const TsWorkspace* ws, void* stream);

/* The diffusion step's mailbox: device memory of ts_diffusion_mailbox_bytes, zeroed before its first
 * step, through which a step's blocks pass their partial results without a memory fence (each word
 * carries the step's tag). Reused by consecutive steps on one stream, which keep it consistent; zero
 * it again before 2^32 steps have used it (the tags would wrap). */
size_t ts_diffusion_mailbox_bytes(int32_t num_rows, int64_t vocab);

/* A diffusion step on [B * L] rows (draw_slot -1, no aux; active = the mask; stats: token, and
 * confidence = the confidences output): one read of every masked position (max, sum of exponentials
 * and the Gumbel-max sample, rows varying fastest in the grid so that a row's later blocks screen by
 * the bound its earlier ones posted), the confidences, tokens (-1 at unmasked positions and where
 * nothing is finite) and the commit rule of every request. Up to 1024 positions a request the row pass
 * commits each request itself, in the block that finishes its last row (one launch); longer steps take
 * a second, small kernel. threshold: [B] (NaN = none); count: [B] (0 = none); mask_out: [B, L] (bool
 * bytes). Workspace counters: B + 1 (rows done per request, then requests committed); no scratch. */
int ts_diffusion_step(const TsRowJob* job, const TsRowStats* stats, const float* threshold,
                      const int64_t* count, int64_t* tokens, float* confidences, uint8_t* mask_out,
                      const TsWorkspace* ws, void* mailbox, void* stream);

/* Speculative verification after ts_row_stats on the target's [B * (n + 1)] rows (draw_slot = n,
 * aux = the draft probabilities [B * n, vocab] fp32, aux_per_request = n). draft_ids: [B, n].
 * Writes accepted [B] and tokens [B, n + 1]. Launched to overlap the end of the kernel before it on
 * the stream (programmatic dependent launch): it reads nothing before that kernel has finished. */
size_t ts_verify_scratch_bytes(int32_t num_requests, int64_t vocab);
int ts_verify_finish(const TsRowJob* job, const TsRowStats* stats, const int64_t* draft_ids,
                     int64_t* accepted, int64_t* tokens, const TsWorkspace* ws, void* stream);

/* Top-k probabilities of softmax(x / T) per row, sorted (probability desc, id asc), k + 1 <= bucket.
 * probs/ids: [num_rows, k]. flags [num_rows]: 4 where the kernel cannot decide the last ids exactly
 * (probability ties at the cut): the caller recomputes those rows. */
int ts_topk_probs_bucket(int32_t k);  /* smallest bucket holding k + 1 candidates, 0 if none */
size_t ts_topk_probs_scratch_bytes(int32_t num_rows, int64_t vocab, int32_t bucket);
int ts_topk_probs(const TsLogits* logits, const float* temperature, int32_t k, int32_t bucket,
                  float* probs, int64_t* ids, uint8_t* flags, const TsWorkspace* ws, void* stream);

#ifdef __cplusplus
}
#endif
