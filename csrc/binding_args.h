// What every torch binding file of csrc/ shares: device addresses from Python ints, the workspace, and a launcher's
// error as an exception. Header-only, for the binding files alone (the kernels take no framework headers).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "sampling.h"

namespace tokensampler::binding {

template <typename T>
T* ptr(int64_t address) { return reinterpret_cast<T*>(static_cast<uintptr_t>(address)); }

// A launcher's cudaError_t (0: success) as a runtime_error naming the launch.
inline void check(int err, const char* what) {
  if (err != 0)
    throw std::runtime_error(std::string("tokensampler ") + what + ": " + cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// workspace: counters, hist, scratch, fallback_count.
inline TsWorkspace workspace_of(const std::vector<int64_t>& w) {
  if (w.size() != 4) throw std::invalid_argument("tokensampler: 4 workspace arrays expected");
  return TsWorkspace{ptr<unsigned int>(w[0]), ptr<void>(w[1]), ptr<void>(w[2]), ptr<unsigned long long>(w[3])};
}

}  // namespace tokensampler::binding
