// extern "C" launchers of the local samplers' kernels (local_samplers.cuh). No framework headers: any host code
// can call them through local_samplers.h.
#include <cuda_runtime.h>

#include "local_samplers.cuh"

using namespace tokensampler;
using namespace tokensampler::local;

namespace {

constexpr int64_t kMaxRows = 65535;  // grid y

// The kernels of the samplers some row uses, in order; kKeep: removals go to the kept bits (Row::keep). The order is
// also what lets a row's first cut write its words with plain stores (store_removed's `first`): sigma_kernel cuts a
// row before anything else does, typical_cut_kernel is first where top-n-sigma is off, and XTC, which may come first,
// removes by atomics only.
template <bool kKeep>
cudaError_t launch(float* logits, uint32_t* keep, int64_t vocab, const TsLocalRows& rows, int32_t samplers,
                   const Workspace& ws, dim3 grid, cudaStream_t s) {
  stats_kernel<false, kKeep><<<grid, kThreads, 0, s>>>(logits, keep, vocab, rows, ws);
  if (samplers & TS_LOCAL_TOP_N_SIGMA) sigma_kernel<kKeep><<<grid, kThreads, 0, s>>>(logits, keep, vocab, rows, ws);
  if (samplers & TS_LOCAL_TYPICAL) {
    typical_hist_kernel<kKeep><<<grid, kThreads, 0, s>>>(logits, keep, vocab, rows, ws);
    const void* cut = reinterpret_cast<const void*>(&typical_cut_kernel<kKeep>);
    if (cudaError_t e = cudaFuncSetAttribute(cut, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kCutSmemBytes)))
      return e;
    typical_cut_kernel<kKeep><<<grid, kThreads, kCutSmemBytes, s>>>(logits, keep, vocab, rows, ws);
    if (samplers & TS_LOCAL_XTC) stats_kernel<true, kKeep><<<grid, kThreads, 0, s>>>(logits, keep, vocab, rows, ws);
  }
  return cudaGetLastError();
}

bool bad_shape(int64_t num_rows, int64_t vocab) {
  return vocab < 1 || vocab > (int64_t{1} << 31) - 1 || num_rows < 0 || num_rows > kMaxRows;
}

}  // namespace

extern "C" {

size_t ts_local_rows_bytes(int64_t num_rows) {
  return static_cast<size_t>(num_rows) * (4 * sizeof(float) + 3 * sizeof(int64_t));
}

TsLocalRows ts_local_rows_packed(const void* packed, int64_t num_rows) {
  const float* f = static_cast<const float*>(packed);
  const int64_t* i = reinterpret_cast<const int64_t*>(f + 4 * num_rows);
  return TsLocalRows{f, f + num_rows, f + 2 * num_rows, f + 3 * num_rows, i, i + num_rows, i + 2 * num_rows};
}

TsLocalWorkspaceBytes ts_local_samplers_workspace(int64_t num_rows, int64_t vocab) {
  return workspace_bytes(num_rows, vocab);
}

int ts_local_samplers(float* logits, uint32_t* keep, int64_t num_rows, int64_t vocab, const TsLocalRows* rows,
                      int32_t samplers, void* scratch, void* zeroed, void* stream) {
  if (bad_shape(num_rows, vocab)) return cudaErrorInvalidValue;
  if (num_rows == 0 || !(samplers & (TS_LOCAL_TOP_N_SIGMA | TS_LOCAL_TYPICAL | TS_LOCAL_XTC))) return cudaSuccess;
  const Workspace ws = workspace_at(scratch, zeroed, num_rows, vocab);
  const dim3 grid(num_chunks(vocab), static_cast<unsigned int>(num_rows));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (keep) {
    const size_t bytes = static_cast<size_t>(num_rows * words_of(vocab)) * sizeof(uint32_t);
    if (cudaError_t e = cudaMemsetAsync(keep, 0xFF, bytes, s)) return e;
    return launch<true>(logits, keep, vocab, *rows, samplers, ws, grid, s);
  }
  return launch<false>(logits, keep, vocab, *rows, samplers, ws, grid, s);
}

int ts_top_n_sigma_floor(const float* logits, float* floor, int64_t num_rows, int64_t vocab, const TsLocalRows* rows,
                         void* scratch, void* zeroed, void* stream) {
  if (bad_shape(num_rows, vocab) || floor == nullptr) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const dim3 grid(num_chunks(vocab), static_cast<unsigned int>(num_rows));
  sigma_floor_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      logits, floor, vocab, *rows, workspace_at(scratch, zeroed, num_rows, vocab));
  return cudaGetLastError();
}

}  // extern "C"
