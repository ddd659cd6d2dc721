/* C API of the local samplers' kernels (csrc/local_samplers.cu): top-n-sigma, typical-p and XTC, step 5 of
 * docs/semantics.md (L4-L6), applied in place to float32 logits before the sampling kernels read them. Plain C types
 * only; every pointer is device memory.
 *
 * Each removed token becomes -inf; NaN and +inf entries are read as -inf and left as they are (step 5 flags them
 * afterwards); every other logit keeps its bits. The kept sets are those of the torch reference
 * (server/tokensampler_server/backends/truncation.py) up to rounding edges of its float64 sums
 * (docs/design/kernel-routing.md, "Local samplers"). Every launcher returns a cudaError_t as int (0 = success).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Per-row parameters, indexed by logits row. */
typedef struct {
  const float* top_n_sigma;     /* <= 0: off */
  const float* typical_p;       /* in (0, 1]; 1: off */
  const float* xtc_threshold;   /* in (0, 1] */
  const float* xtc_probability; /* in [0, 1]; 0: off. The coin is drawn in the kernels from the three below. */
  const int64_t* seed;          /* uint64 bits */
  const int64_t* position;
  const int64_t* iteration;
} TsLocalRows;

/* The packed form of TsLocalRows for num_rows rows, one device buffer of ts_local_rows_bytes(num_rows) bytes:
 * float32 top_n_sigma, typical_p, xtc_threshold, xtc_probability [num_rows] each, then int64 seed, position,
 * iteration [num_rows] each. */
size_t ts_local_rows_bytes(int64_t num_rows);
TsLocalRows ts_local_rows_packed(const void* packed, int64_t num_rows);

/* Which samplers some row uses (a launch skips the kernels of the others). */
enum { TS_LOCAL_TOP_N_SIGMA = 1, TS_LOCAL_TYPICAL = 2, TS_LOCAL_XTC = 4 };

/* Workspace of one launch: scratch (any contents) and zeroed bytes (zero before the first launch; every launch
 * leaves them zeroed). */
typedef struct {
  size_t scratch;
  size_t zeroed;
} TsLocalWorkspaceBytes;
TsLocalWorkspaceBytes ts_local_samplers_workspace(int64_t num_rows, int64_t vocab);

/* Applies L4, L5 and L6, in this order, to logits [num_rows, vocab] (contiguous float32) on `stream`. keep NULL:
 * the removed tokens are written as -inf into the logits in place. Else keep is int32 [num_rows, ceil(vocab / 32)]
 * (a token bitmask: token i at bit i % 32 of word i / 32), set to all ones by this call, and the removed tokens'
 * bits are cleared while the logits are only read; bits past the vocabulary stay set. Either way a removed token is
 * a finite one: NaN and +inf entries keep their bits.
 * samplers: the TS_LOCAL_* bits of the samplers some row uses. num_rows <= 65535. */
int ts_local_samplers(float* logits, uint32_t* keep, int64_t num_rows, int64_t vocab, const TsLocalRows* rows,
                      int32_t samplers, void* scratch, void* zeroed, void* stream);

/* L4 alone, for calls whose only local sampler is top-n-sigma: floor float32 [num_rows] gets each row's cut as the
 * least float32 at or above M - n sigma (-inf where n <= 0), so that a logit x is removed exactly when x < floor[r];
 * the sampling kernels apply it as they read the logits (csrc/sampling.h TsBitmask.floor). The logits
 * [num_rows, vocab] (contiguous float32) are only read, once. Workspace and limits as for ts_local_samplers. */
int ts_top_n_sigma_floor(const float* logits, float* floor, int64_t num_rows, int64_t vocab, const TsLocalRows* rows,
                         void* scratch, void* zeroed, void* stream);

#ifdef __cplusplus
}
#endif
