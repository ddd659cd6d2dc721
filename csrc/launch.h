// Host-side launch helper shared by the launchers (sampling.cu, workloads.cu). CUDA runtime only.
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace tokensampler {

// Launches `kernel` allowed to start before the previous kernel on `stream` finishes (programmatic
// dependent launch); the kernel must call wait_for_previous_grid (common.cuh) before it reads what
// that kernel writes. Where the device cannot, the runtime orders the launch as usual.
template <typename... Params, typename... Args>
cudaError_t launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                  cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace tokensampler
