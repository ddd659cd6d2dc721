// extern "C" launchers of the workload kernels (workloads.cuh). No framework headers: any host code
// can call them through workloads.h.
#include <cuda_runtime.h>

#include "launch.h"
#include "workloads.cuh"

using namespace tokensampler;

namespace {

constexpr int kMaxGridY = 65535;

template <typename F>
cudaError_t with_dtype(int32_t dtype, F&& f) {
  switch (dtype) {
    case kF32: return f(float{});
    case kF16: return f(__half{});
    case kBF16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

bool bad_job(const TsRowJob* job) {
  return job->vocab < 1 || job->vocab > (int64_t{1} << 31) - 1 || job->num_rows < 0 ||
         job->num_rows > kMaxGridY || job->per_request < 1 || job->num_rows % job->per_request != 0 ||
         !job->temperature || !job->seed || !job->iteration;
}

template <typename T, int K>
cudaError_t launch_topk_probs(const TsLogits* logits, const float* temperature, int32_t k, float* probs,
                              int64_t* ids, uint8_t* flags, const TsWorkspace* ws, cudaStream_t stream) {
  const dim3 grid(num_splits(logits->vocab), static_cast<unsigned int>(logits->num_rows));
  topk_probs_kernel<T, K><<<grid, kThreads, 0, stream>>>(*logits, temperature, k, probs, ids, flags, *ws);
  return cudaGetLastError();
}

// The row pass: chunks vary fastest in the grid (row statistics, verification), or rows for a diffusion
// step (`step`), with its commit folded in when step->fold_commit (row_stats_kernel).
cudaError_t launch_row_stats(const TsRowJob* job, const TsRowStats* stats, const TsWorkspace* ws,
                             const DiffusionStep* step, cudaStream_t s) {
  if (bad_job(job)) return cudaErrorInvalidValue;
  if (job->num_rows == 0) return cudaSuccess;
  if (job->aux && (job->aux_per_request < 1 || job->aux_per_request > job->per_request || !stats->aux_sum))
    return cudaErrorInvalidValue;
  const unsigned int rows = static_cast<unsigned int>(job->num_rows + aux_rows(*job)), splits = num_splits(job->vocab);
  if ((step ? splits : rows) > kMaxGridY) return cudaErrorInvalidValue;
  return with_dtype(job->dtype, [&](auto t) {
    using T = decltype(t);
    if (step) {
      row_stats_kernel<T, true><<<dim3(rows, splits), kThreads, 0, s>>>(*job, *stats, *ws, *step);
    } else {
      row_stats_kernel<T, false><<<dim3(splits, rows), kThreads, 0, s>>>(*job, *stats, *ws, DiffusionStep{});
    }
    return cudaGetLastError();
  });
}

// The commit of a diffusion step whose requests are too long to commit in the row pass, after it on the
// stream (launched to overlap its end, as verify_finish_kernel).
cudaError_t launch_diffusion_commit(const TsRowJob* job, const TsRowStats* stats, const DiffusionStep& step,
                                    cudaStream_t stream) {
  const int requests = job->num_rows / job->per_request;
  if (requests == 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(job->per_request) * (sizeof(float) + 1);
  if (smem > 48 * 1024) {
    const void* kernel = reinterpret_cast<const void*>(&diffusion_commit_kernel);
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)))
      return e;
  }
  return launch_after_previous(&diffusion_commit_kernel, dim3(requests), dim3(kCommitThreads), smem, stream, *job,
                               *stats, step);
}

}  // namespace

extern "C" {

size_t ts_row_stats_scratch_bytes(int32_t num_rows, int64_t vocab) {  // aux rows: at most num_rows
  return (sizeof(RowPartial) + sizeof(float)) * static_cast<size_t>(num_rows) * num_splits(vocab);
}

int ts_row_stats(const TsRowJob* job, const TsRowStats* stats, const TsWorkspace* ws, void* stream) {
  return launch_row_stats(job, stats, ws, nullptr, static_cast<cudaStream_t>(stream));
}

size_t ts_diffusion_mailbox_bytes(int32_t num_rows, int64_t vocab) {
  return sizeof(unsigned long long) * mailbox_words(num_rows, vocab);
}

int ts_diffusion_step(const TsRowJob* job, const TsRowStats* stats, const float* threshold, const int64_t* count,
                      int64_t* tokens, float* confidences, uint8_t* mask_out, const TsWorkspace* ws, void* mailbox,
                      void* stream) {
  if (bad_job(job) || !job->active || job->draw_slot >= 0 || job->aux || !stats->token || !stats->confidence ||
      stats->confidence != confidences || !mailbox || reinterpret_cast<uintptr_t>(mailbox) % 8 != 0)
    return cudaErrorInvalidValue;
  // mailbox words: the epoch, then the rows' bounds, then their partials
  auto* words = static_cast<unsigned long long*>(mailbox);
  const DiffusionStep step{threshold, count, tokens, mask_out, job->per_request <= kFoldedCommitMaxLength,
                           ws->counters, Mailbox{reinterpret_cast<unsigned int*>(words), words + 1, words + 1 + job->num_rows}};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (cudaError_t e = launch_row_stats(job, stats, ws, &step, s)) return e;
  return step.fold_commit ? cudaSuccess : launch_diffusion_commit(job, stats, step, s);
}

size_t ts_verify_scratch_bytes(int32_t num_requests, int64_t vocab) {
  return sizeof(uint64_t) * static_cast<size_t>(num_requests) * num_splits(vocab);
}

int ts_verify_finish(const TsRowJob* job, const TsRowStats* stats, const int64_t* draft_ids, int64_t* accepted,
                     int64_t* tokens, const TsWorkspace* ws, void* stream) {
  if (bad_job(job) || job->per_request < 2 || !job->aux || job->aux_per_request != job->per_request - 1)
    return cudaErrorInvalidValue;
  const int requests = job->num_rows / job->per_request;
  if (requests == 0) return cudaSuccess;
  const dim3 grid(num_splits(job->vocab), static_cast<unsigned int>(requests));
  return with_dtype(job->dtype, [&](auto t) {
    using T = decltype(t);
    return launch_after_previous(&verify_finish_kernel<T>, grid, dim3(kThreads), 0, static_cast<cudaStream_t>(stream),
                                 *job, *stats, draft_ids, accepted, tokens, *ws);
  });
}

int ts_topk_probs_bucket(int32_t k) {
  for (int bucket : {32, 64, 128, 256})
    if (k + 1 <= bucket) return bucket;
  return 0;
}

size_t ts_topk_probs_scratch_bytes(int32_t num_rows, int64_t vocab, int32_t bucket) {
  const size_t blocks = static_cast<size_t>(num_rows) * num_splits(vocab);
  return blocks * (bucket * sizeof(uint64_t) + sizeof(ChunkSum) + sizeof(uint32_t));
}

int ts_topk_probs(const TsLogits* logits, const float* temperature, int32_t k, int32_t bucket, float* probs,
                  int64_t* ids, uint8_t* flags, const TsWorkspace* ws, void* stream) {
  if (logits->vocab < 1 || logits->vocab > (int64_t{1} << 31) - 1 || logits->num_rows < 0 ||
      logits->num_rows > kMaxGridY || k < 1 || k > logits->vocab || k + 1 > bucket)
    return cudaErrorInvalidValue;
  if (logits->num_rows == 0) return cudaSuccess;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return with_dtype(logits->dtype, [&](auto t) {
    using T = decltype(t);
    switch (bucket) {
      case 32: return launch_topk_probs<T, 32>(logits, temperature, k, probs, ids, flags, ws, s);
      case 64: return launch_topk_probs<T, 64>(logits, temperature, k, probs, ids, flags, ws, s);
      case 128: return launch_topk_probs<T, 128>(logits, temperature, k, probs, ids, flags, ws, s);
      case 256: return launch_topk_probs<T, 256>(logits, temperature, k, probs, ids, flags, ws, s);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // extern "C"
