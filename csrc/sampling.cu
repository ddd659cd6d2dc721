// extern "C" launchers of the logits-path kernels (sampling.cuh). No framework headers: this file
// compiles on its own with nvcc, and any host code can call it through sampling.h.
#include <cuda_runtime.h>

#include <type_traits>

#include "launch.h"
#include "nucleus.cuh"
#include "sampling.cuh"

using namespace tokensampler;

namespace {

constexpr int kMaxGridY = 65535, kMaxGridZ = 65535;

// Words and a floor at once (a row's cut is one or the other), or rows of fewer words than the vocabulary has.
bool bad_bitmask(const TsBitmask& bitmask, int64_t vocab) {
  return bitmask.words && (bitmask.row_words < words_of(vocab) || bitmask.floor);
}

bool bad_args(const TsLogits* logits, const TsRows* rows) {
  return logits->vocab < 1 || logits->vocab > (int64_t{1} << 31) - 1 || rows->num_work_rows < 0 ||
         rows->num_work_rows > kMaxGridY || logits->dtype < kF32 || logits->dtype > kBF16 ||
         bad_bitmask(rows->bitmask, logits->vocab);
}

// The Gumbel-max launchers draw samples out->sample .. + num_draws - 1, one grid layer (blockIdx.z) each.
bool bad_draws(const TsOutputs* out, int32_t num_draws) {
  return num_draws < 1 || num_draws > kMaxGridZ || out->sample < 0 ||
         out->sample + static_cast<int64_t>(num_draws) > out->num_samples;
}

// Calls f with a value of the logits' element type and std::true_type when some row has a token bitmask or a floor
// (the kernels' masked instances), std::false_type otherwise.
template <typename F>
cudaError_t dispatch(int32_t dtype, const TsRows* rows, F&& f) {
  auto typed = [&](auto t) {
    return rows->bitmask.words || rows->bitmask.floor ? f(t, std::true_type{}) : f(t, std::false_type{});
  };
  switch (dtype) {
    case kF32: return typed(float{});
    case kF16: return typed(__half{});
    case kBF16: return typed(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

// dispatch for the kernels that run a block per chunk of each work row, and per draw (blockIdx.z) for the Gumbel-max
// launchers: f(t, mask, grid, stream) gets that grid. No rows, no launch.
template <typename F>
cudaError_t dispatch_chunks(const TsLogits* logits, const TsRows* rows, void* stream, F&& f, int32_t num_draws = 1) {
  if (rows->num_work_rows == 0) return cudaSuccess;
  const dim3 grid(num_splits(logits->vocab), rows->num_work_rows, static_cast<unsigned>(num_draws));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch(logits->dtype, rows, [&](auto t, auto mask) { return f(t, mask, grid, s); });
}

cudaError_t set_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <typename T, bool kMask, int K>
cudaError_t launch_topk(const TsLogits* logits, const TsRows* rows, const TsOutputs* out,
                        const TsWorkspace* ws, cudaStream_t stream) {
  const int splits = num_splits(logits->vocab);
  const size_t smem = topk_smem_bytes(K);
  const void* kernel = reinterpret_cast<const void*>(&topk_kernel<T, kMask, K>);
  if (cudaError_t e = set_smem(kernel, smem)) return e;
  topk_kernel<T, kMask, K><<<dim3(splits, rows->num_work_rows), kThreads, smem, stream>>>(*logits, *rows, *out, *ws);
  return cudaGetLastError();
}

// The bitmask written into fp32 logits in place (ts_apply_bitmask), for rows whose other processing runs on a
// copy after it: a thread a token, which reads its word (one load a warp) and writes -inf where the bit is clear.
// No logit is read, only disallowed tokens are written; a floor reads the logit it compares.
constexpr int kBitmaskThreads = 256;

__global__ void __launch_bounds__(kBitmaskThreads)
    apply_bitmask_kernel(float* logits, int64_t num_rows, int64_t vocab, TsBitmask bitmask) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kBitmaskThreads + threadIdx.x;
  if (i >= vocab) return;
  for (int64_t r = blockIdx.y; r < num_rows; r += gridDim.y) {
    const RowCut cut = row_cut(bitmask, r);
    if (cut.has_floor()) {
      if (logits[r * vocab + i] < cut.floor()) logits[r * vocab + i] = -kInf;
    } else if (const uint32_t* mask = cut.words(); mask != nullptr && !((__ldg(mask + (i >> 5)) >> (i & 31)) & 1u)) {
      logits[r * vocab + i] = -kInf;
    }
  }
}

__global__ void or_flags_kernel(uint8_t* dst, const uint8_t* src, int64_t n, uint8_t bits) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] |= src[i] & bits;
}

// The test hook's kernel (ts_noise), for either Philox product form.
template <typename Noise>
__global__ void noise_kernel(Noise noise, int64_t vocab, uint32_t* words, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= vocab) return;
  const uint32_t word = noise.word(static_cast<uint32_t>(i));
  if (words) words[i] = word;
  if (out) out[i] = gumbel_exact(word);
}

// ts_stats and ts_stats_flagged (only_flagged NULL: every row).
cudaError_t launch_stats(const TsLogits* logits, const TsRows* rows, const float* lse_scale, const uint8_t* only_flagged,
                         const TsOutputs* out, const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows)) return cudaErrorInvalidValue;
  return dispatch_chunks(logits, rows, stream, [&](auto t, auto mask, dim3 grid, cudaStream_t s) {
    stats_kernel<decltype(t), decltype(mask)::value><<<grid, kThreads, 0, s>>>(*logits, *rows, lse_scale,
                                                                                only_flagged, *out, *ws);
    return cudaGetLastError();
  });
}

// ts_filter (kCut false) and ts_cut (true): filter_kernel, `splits` blocks a row.
template <bool kCut>
cudaError_t launch_filter(const TsLogits* logits, const TsRows* rows, const float* row_max, const float* row_min,
                          const int64_t* row_argmax, const uint8_t* stats_flags, int32_t need_exact_mass,
                          int32_t splits, const TsOutputs* out, const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows) || !row_argmax || splits < 1) return cudaErrorInvalidValue;
  if (rows->num_work_rows == 0) return cudaSuccess;
  const int64_t groups = (logits->vocab + 3) / 4;
  const int blocks = static_cast<int>(splits < groups ? splits : groups);
  const dim3 grid(blocks, rows->num_work_rows);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch(logits->dtype, rows, [&](auto t, auto mask) {
    using T = decltype(t);
    constexpr bool M = decltype(mask)::value;
    const void* kernel = reinterpret_cast<const void*>(&filter_kernel<T, M, kCut>);
    if (cudaError_t e = set_smem(kernel, kFilterSmemBytes)) return e;
    // the cut ranges the filter leaves to every block of their row (CutRange): a failure of this set-up must come
    // before the filter writes any, or they would stay in the workspace
    const bool collect = blocks > 1;
    constexpr size_t kCollectSmemBytes = 2 * kResolveCap * sizeof(uint64_t);
    if (collect) {
      if (cudaError_t e = set_smem(reinterpret_cast<const void*>(&cut_collect_kernel<T, M, kCut>), kCollectSmemBytes))
        return e;
    }
    if (cudaError_t e = launch_after_previous(&filter_kernel<T, M, kCut>, grid, dim3(kFilterThreads),
                                              kFilterSmemBytes, s, *logits, *rows, row_max, row_min, row_argmax,
                                              stats_flags, need_exact_mass, *out, *ws))
      return e;
    if (!collect) return cudaSuccess;
    const cudaError_t e = launch_after_previous(&cut_collect_kernel<T, M, kCut>, grid, dim3(kFilterThreads),
                                                kCollectSmemBytes, s, *logits, *rows, row_max, row_min, *out, *ws);
    // the filter's records would stay in the workspace, and the next call would read them as its own: zero it (the
    // call fails either way)
    if (e != cudaSuccess) cudaMemsetAsync(ws->hist, 0, kHistRowBytes * static_cast<size_t>(rows->num_work_rows), s);
    return e;
  });
}

}  // namespace

extern "C" {

int ts_num_splits(int64_t vocab) { return num_splits(vocab); }

size_t ts_stats_scratch_bytes(int32_t num_work_rows, int64_t vocab) {
  return sizeof(Stats) * static_cast<size_t>(num_work_rows) * num_splits(vocab);
}

size_t ts_gumbel_scratch_bytes(int32_t num_work_rows, int64_t vocab) {
  return sizeof(GumbelPartial) * static_cast<size_t>(num_work_rows) * num_splits(vocab);
}

size_t ts_topk_scratch_bytes(int32_t num_work_rows, int64_t vocab, int32_t bucket) {
  const size_t blocks = static_cast<size_t>(num_work_rows) * num_splits(vocab);
  return blocks * bucket * sizeof(uint64_t) + blocks * sizeof(uint32_t);
}

size_t ts_hist_bytes(int32_t num_work_rows) { return kHistRowBytes * static_cast<size_t>(num_work_rows); }

int ts_topk_bucket(int32_t k) {
  for (int bucket : {16, 32, 64, 128, 256})
    if (k + 1 <= bucket) return bucket;
  return 0;
}

int ts_or_flags(uint8_t* dst, const uint8_t* src, int64_t n, uint8_t bits, void* stream) {
  if (n <= 0) return cudaSuccess;
  or_flags_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(dst, src, n, bits);
  return cudaGetLastError();
}

int ts_stats(const TsLogits* logits, const TsRows* rows, const float* lse_scale, const TsOutputs* out,
             const TsWorkspace* ws, void* stream) {
  return launch_stats(logits, rows, lse_scale, nullptr, out, ws, stream);
}

int ts_stats_flagged(const TsLogits* logits, const TsRows* rows, const uint8_t* flagged, const TsOutputs* out,
                     const TsWorkspace* ws, void* stream) {
  if (!flagged || !out->flags) return cudaErrorInvalidValue;
  return launch_stats(logits, rows, nullptr, flagged, out, ws, stream);
}

int ts_gumbel(const TsLogits* logits, const TsRows* rows, const float* lse_scale, int32_t num_draws,
              const TsOutputs* out, const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows) || !out->tokens || bad_draws(out, num_draws)) return cudaErrorInvalidValue;
  return dispatch_chunks(logits, rows, stream, [&](auto t, auto mask, dim3 grid, cudaStream_t s) {
    using T = decltype(t);
    constexpr bool M = decltype(mask)::value;
    if (lse_scale)
      gumbel_kernel<T, M, true, kNoRowMask><<<grid, kThreads, 0, s>>>(*logits, *rows, lse_scale, nullptr, nullptr,
                                                                      *out, *ws);
    else
      gumbel_kernel<T, M, false, kNoRowMask><<<grid, kThreads, 0, s>>>(*logits, *rows, lse_scale, nullptr, nullptr,
                                                                       *out, *ws);
    return cudaGetLastError();
  }, num_draws);
}

int ts_min_p(const TsLogits* logits, const TsRows* rows, const float* row_max, int32_t num_draws,
             const TsOutputs* out, const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows) || !out->tokens || !row_max || bad_draws(out, num_draws)) return cudaErrorInvalidValue;
  return dispatch_chunks(logits, rows, stream, [&](auto t, auto mask, dim3 grid, cudaStream_t s) {
    return launch_after_previous(&gumbel_kernel<decltype(t), decltype(mask)::value, false, kMinPRowMask>, grid,
                                 dim3(kThreads), 0, s, *logits, *rows, static_cast<const float*>(nullptr), row_max,
                                 static_cast<const int64_t*>(nullptr), *out, *ws);
  }, num_draws);
}

int ts_sample_kept(const TsLogits* logits, const TsRows* rows, const float* row_max, const int64_t* kept_keys,
                   int32_t num_draws, const TsOutputs* out, const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows) || !out->tokens || !row_max || !kept_keys || bad_draws(out, num_draws))
    return cudaErrorInvalidValue;
  return dispatch_chunks(logits, rows, stream, [&](auto t, auto mask, dim3 grid, cudaStream_t s) {
    return launch_after_previous(&gumbel_kernel<decltype(t), decltype(mask)::value, false, kCutRowMask>, grid,
                                 dim3(kThreads), 0, s, *logits, *rows, static_cast<const float*>(nullptr), row_max,
                                 kept_keys, *out, *ws);
  }, num_draws);
}

int ts_topk(const TsLogits* logits, const TsRows* rows, int32_t bucket, const TsOutputs* out,
            const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows) || !out->tokens || !out->flags) return cudaErrorInvalidValue;
  if (rows->num_work_rows == 0) return cudaSuccess;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch(logits->dtype, rows, [&](auto t, auto mask) {
    using T = decltype(t);
    constexpr bool M = decltype(mask)::value;
    switch (bucket) {
      case 16: return launch_topk<T, M, 16>(logits, rows, out, ws, s);
      case 32: return launch_topk<T, M, 32>(logits, rows, out, ws, s);
      case 64: return launch_topk<T, M, 64>(logits, rows, out, ws, s);
      case 128: return launch_topk<T, M, 128>(logits, rows, out, ws, s);
      case 256: return launch_topk<T, M, 256>(logits, rows, out, ws, s);
      default: return cudaErrorInvalidValue;
    }
  });
}

int ts_filter(const TsLogits* logits, const TsRows* rows, const float* row_max, const float* row_min,
              const int64_t* row_argmax, const uint8_t* stats_flags, int32_t need_exact_mass, int32_t splits,
              const TsOutputs* out, const TsWorkspace* ws, void* stream) {
  if (!out->tokens || !out->flags) return cudaErrorInvalidValue;
  return launch_filter<false>(logits, rows, row_max, row_min, row_argmax, stats_flags, need_exact_mass, splits, out, ws,
                              stream);
}

int ts_cut(const TsLogits* logits, const TsRows* rows, const float* row_max, const float* row_min,
           const int64_t* row_argmax, const uint8_t* stats_flags, int32_t splits, int64_t* kept_keys,
           const TsWorkspace* ws, void* stream) {
  if (!kept_keys) return cudaErrorInvalidValue;
  TsOutputs out{};
  out.kept_min_key = kept_keys;
  return launch_filter<true>(logits, rows, row_max, row_min, row_argmax, stats_flags, 0, splits, &out, ws, stream);
}

size_t ts_nucleus_scratch_bytes(int32_t num_work_rows, int64_t vocab) {
  return frontier_scratch_bytes(num_work_rows, vocab);
}

int ts_nucleus(const TsLogits* logits, const TsRows* rows, const TsOutputs* pre, const TsOutputs* out,
               const TsWorkspace* ws, void* stream) {
  if (bad_args(logits, rows) || !out->tokens || !out->flags || !pre->tokens || !pre->flags || !pre->row_max ||
      !pre->row_min)
    return cudaErrorInvalidValue;
  return dispatch_chunks(logits, rows, stream, [&](auto t, auto mask, dim3 grid, cudaStream_t s) {
    using T = decltype(t);
    constexpr bool M = decltype(mask)::value;
    frontier_kernel<T, M><<<grid, kThreads, 0, s>>>(*logits, *rows, *pre, *out, *ws);
    if (cudaError_t e = cudaGetLastError()) return e;
    const dim3 mass_grid(mass_blocks_per_row(rows->num_work_rows, static_cast<int>(grid.x)), grid.y);
    if (cudaError_t e = launch_after_previous(&nucleus_mass_kernel<T, M>, mass_grid, dim3(kThreads), 0, s, *logits,
                                              *rows, *pre, *out, *ws))
      return e;
    const int at_once = rows->num_work_rows < kExactRowsAtOnce ? rows->num_work_rows : kExactRowsAtOnce;
    const dim3 exact_grid(grid.x * kExactParts * at_once);
    return launch_after_previous(&nucleus_exact_mass_kernel<T, M>, exact_grid, dim3(kThreads), 0, s, *logits, *rows,
                                 *pre, *out, *ws);
  });
}

int ts_apply_bitmask(float* logits, int64_t num_rows, int64_t vocab, const TsBitmask* bitmask, void* stream) {
  if (vocab < 1 || num_rows < 0 || !(bitmask->words || bitmask->floor) || bad_bitmask(*bitmask, vocab))
    return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned int>((vocab + kBitmaskThreads - 1) / kBitmaskThreads),
                  static_cast<unsigned int>(num_rows < kMaxGridY ? num_rows : kMaxGridY));
  apply_bitmask_kernel<<<grid, kBitmaskThreads, 0, static_cast<cudaStream_t>(stream)>>>(logits, num_rows, vocab,
                                                                                        *bitmask);
  return cudaGetLastError();
}

int ts_noise(int64_t seed, int64_t position, int64_t iteration, uint32_t sample, int64_t vocab, int split_products,
             uint32_t* words, float* noise, void* stream) {
  if (vocab < 1) return cudaErrorInvalidValue;
  const NoiseStream stream_of_row = NoiseStream::make(seed, position, iteration, sample);
  const unsigned int blocks = static_cast<unsigned int>((vocab + 255) / 256);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (split_products)
    noise_kernel<<<blocks, 256, 0, s>>>(stream_of_row.with_products<PhiloxProducts::kSplit>(), vocab, words, noise);
  else
    noise_kernel<<<blocks, 256, 0, s>>>(stream_of_row, vocab, words, noise);
  return cudaGetLastError();
}

}  // extern "C"
