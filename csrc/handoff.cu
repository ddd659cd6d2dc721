// The colocated hand-off kernels (csrc/handoff.h). Both are a few microseconds on the step's critical path: the
// copy moves the engine's logits at the bandwidth of a device-to-device copy, the delivery writes B tokens.
// The gate words live in mapped host memory, where a GPU read crosses PCIe and such reads queue behind one
// another: with each of the copy's blocks reading both words itself, copying [8, 128256] fp32 logits took 1.98 ms
// on an H200 (260 µs for one row). So one thread reads them and leaves its verdict in device memory for the
// copy's blocks: 16 µs (docs/design/colocated-handoff.md).
#include <cuda_runtime.h>

#include "handoff.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ bool open_gate(const uint32_t* gate, const uint32_t* stop, uint32_t step) {
  return *reinterpret_cast<const volatile uint32_t*>(stop) == 0 &&
         *reinterpret_cast<const volatile uint32_t*>(gate) == step;
}

// Writes step to *verdict when the gate is open for it, else 0 (no step is 0).
__global__ void read_gate_kernel(const uint32_t* gate, const uint32_t* stop, uint32_t step, uint32_t* verdict) {
  *verdict = open_gate(gate, stop, step) ? step : 0u;
}

template <typename T>
__global__ void gated_copy_kernel(const T* __restrict__ src, T* __restrict__ dst, int64_t count,
                                  const uint32_t* verdict, uint32_t step) {
  if (*verdict != step) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void deliver_kernel(const int64_t* __restrict__ tokens, int64_t count, void* out_tokens, int32_t out_int64,
                               const float* __restrict__ logprobs, float* __restrict__ out_logprobs,
                               const uint32_t* gate, const uint32_t* stop, uint32_t step, uint32_t* release) {
  __shared__ bool open;
  if (threadIdx.x == 0) open = open_gate(gate, stop, step);
  __syncthreads();
  if (!open) return;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    if (out_int64)
      static_cast<int64_t*>(out_tokens)[i] = tokens[i];
    else
      static_cast<int32_t*>(out_tokens)[i] = static_cast<int32_t>(tokens[i]);
    if (out_logprobs != nullptr) out_logprobs[i] = logprobs[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the tokens are visible to the engine's stream before the flag that releases it
    *reinterpret_cast<volatile uint32_t*>(release) = step;
  }
}

int blocks_for(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

}  // namespace

extern "C" int ts_gated_copy(const void* src, void* dst, int64_t nbytes, const uint32_t* gate, const uint32_t* stop,
                             uint32_t step, uint32_t* verdict, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  read_gate_kernel<<<1, 1, 0, s>>>(gate, stop, step, verdict);
  const bool wide = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | nbytes) % 16 == 0;
  if (wide) {
    const int64_t count = nbytes / 16;
    gated_copy_kernel<uint4><<<blocks_for(count), kThreads, 0, s>>>(static_cast<const uint4*>(src),
                                                                   static_cast<uint4*>(dst), count, verdict, step);
  } else {
    gated_copy_kernel<uint8_t><<<blocks_for(nbytes), kThreads, 0, s>>>(static_cast<const uint8_t*>(src),
                                                                      static_cast<uint8_t*>(dst), nbytes, verdict, step);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int ts_deliver(const int64_t* tokens, int64_t count, void* out_tokens, int32_t out_int64,
                          const float* logprobs, float* out_logprobs, const uint32_t* gate, const uint32_t* stop,
                          uint32_t step, uint32_t* release, void* stream) {
  deliver_kernel<<<1, 1024, 0, static_cast<cudaStream_t>(stream)>>>(tokens, count, out_tokens, out_int64, logprobs,
                                                                    out_logprobs, gate, stop, step, release);
  return static_cast<int>(cudaGetLastError());
}
