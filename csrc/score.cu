// extern "C" launcher of the scoring kernel (score.cuh). No framework headers: any host code can call it
// through score.h.
#include <cuda_runtime.h>

#include "score.cuh"

using namespace tokensampler;

namespace {

constexpr int64_t kMaxScoreRows = 65535;  // grid rows
constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 1;  // rank keys hold 32-bit ids

template <typename T, bool kTop>
cudaError_t launch_score(const TsLogits* logits, int64_t offset, const TsScoreRows* rows, int32_t first,
                         int32_t last, void* state, const TsWorkspace* ws, cudaStream_t stream) {
  const dim3 grid(num_splits(logits->vocab), static_cast<unsigned int>(logits->num_rows));
  const size_t smem = kTop ? sizeof(TopShared) : 0;
  score_slice_kernel<T, kTop><<<grid, kThreads, smem, stream>>>(*logits, offset, *rows, first, last, state, *ws);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_score_of(const TsLogits* logits, int64_t offset, const TsScoreRows* rows, int32_t first,
                            int32_t last, void* state, const TsWorkspace* ws, cudaStream_t stream) {
  return rows->top_n > 0 ? launch_score<T, true>(logits, offset, rows, first, last, state, ws, stream)
                         : launch_score<T, false>(logits, offset, rows, first, last, state, ws, stream);
}

bool bad_call(const TsLogits* logits, int64_t offset, const TsScoreRows* rows, const void* state,
              const TsWorkspace* ws) {
  return logits->vocab < 1 || offset < 0 || offset + logits->vocab > kMaxTokenId || logits->num_rows < 0 ||
         logits->num_rows > kMaxScoreRows || rows->top_n < 0 || rows->top_n > kScoreMaxTop || !rows->token ||
         !rows->logprob || (rows->top_n > 0 && (!rows->top_ids || !rows->top_values)) || !state || !ws->counters ||
         !ws->scratch;
}

}  // namespace

extern "C" {

int32_t ts_score_block_tokens(void) { return static_cast<int32_t>(kChunk); }

size_t ts_score_scratch_bytes(int32_t num_rows, int64_t slice_width, int32_t top_n) {
  const size_t blocks = static_cast<size_t>(num_rows) * num_splits(slice_width);
  return blocks * (sizeof(ScoreState) + static_cast<size_t>(top_n) * sizeof(uint64_t));
}

size_t ts_score_state_bytes(int32_t num_rows, int32_t top_n) {
  return static_cast<size_t>(num_rows) * (sizeof(ScoreState) + static_cast<size_t>(top_n) * sizeof(uint64_t));
}

int ts_score_slice(const TsLogits* logits, int64_t offset, const TsScoreRows* rows, int32_t first, int32_t last,
                   void* state, const TsWorkspace* ws, void* stream) {
  if (bad_call(logits, offset, rows, state, ws)) return cudaErrorInvalidValue;
  if (logits->num_rows == 0) return cudaSuccess;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (logits->dtype) {
    case kF32: return launch_score_of<float>(logits, offset, rows, first, last, state, ws, s);
    case kF16: return launch_score_of<__half>(logits, offset, rows, first, last, state, ws, s);
    case kBF16: return launch_score_of<__nv_bfloat16>(logits, offset, rows, first, last, state, ws, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // extern "C"
