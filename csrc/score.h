/* C API of the scoring kernel (csrc/score.cu): the log-probs of given tokens, with the entropy and the N best
 * log-probs, of rows whose distribution is softmax(x / T) over the whole vocabulary (docs/semantics.md, choice 18:
 * RAW, and PROCESSED without top-k, top-p or min-p). Plain C types only; every array is device memory. Every
 * launcher returns a cudaError_t as int (0 = success).
 *
 * A row is read one vocabulary slice at a time: the whole row in one call (logits), or the slices a matmul
 * writes in turn (hidden states through an LM head), each call carrying the rows' running state (max, sum of
 * exponentials, entropy sum, the token's logit, the N best) to the next.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most top log-probs the kernel lists (the server's default limit, max_top_logprobs). */
#define TS_SCORE_MAX_TOP 64

typedef struct {
  const int64_t* token;     /* [num_rows]: the token scored at each row, in [0, the vocabulary size) */
  const float* temperature; /* [num_rows]: T > 0 dividing the row's logits, or NULL: none (RAW) */
  int32_t top_n;            /* 0 .. TS_SCORE_MAX_TOP */
  float* logprob;           /* [num_rows] */
  float* entropy;           /* [num_rows] or NULL */
  int64_t* top_ids;         /* [num_rows, top_n] when top_n > 0: (x desc, id asc: log-prob order, ties of x by id); -1 on rows not valid */
  float* top_values;        /* [num_rows, top_n] */
} TsScoreRows;

/* Tokens of a row one block reads (the sampling kernels' chunk): a slice of this width is one block a row. */
int32_t ts_score_block_tokens(void);

/* The per-block partials of one call over num_rows rows of a slice_width-token slice (TsWorkspace.scratch). */
size_t ts_score_scratch_bytes(int32_t num_rows, int64_t slice_width, int32_t top_n);

/* The rows' running state between the slices of one scoring. */
size_t ts_score_state_bytes(int32_t num_rows, int32_t top_n);

/* Tokens [offset, offset + logits->vocab) of each of logits->num_rows (<= 65535) rows: row w of the logits is row
 * w of `rows` and of the state. NaN and +inf read as -inf (choice 1). first: the rows' first slice (the state is
 * set, not merged into); last: their final slice (the outputs are written: NaN log-prob and entropy, ids -1 and
 * values NaN on a row without a finite logit; choice 8). Slices of one scoring run in order on one stream, every
 * token of the vocabulary in exactly one of them. Workspace: counters >= num_rows (zeroed, left zeroed), scratch
 * of ts_score_scratch_bytes. */
int ts_score_slice(const TsLogits* logits, int64_t offset, const TsScoreRows* rows, int32_t first, int32_t last,
                   void* state, const TsWorkspace* ws, void* stream);

#ifdef __cplusplus
}
#endif
