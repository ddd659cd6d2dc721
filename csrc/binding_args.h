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

// The token bitmask of TsRows from (words, row, row_words, floor): device addresses (0: NULL) and a count.
inline TsBitmask bitmask_of(int64_t words, int64_t row, int64_t row_words, int64_t floor) {
  return TsBitmask{ptr<const int32_t>(words), ptr<const int32_t>(row), row_words, ptr<const float>(floor)};
}

// params: one device address a row parameter, in TS_ROW_PARAMS' order (Python's RowParams.pointers()), then the token
// bitmask: its words (0: no row has one), its row map (0: row r's mask is row r), the words a mask row and the rows'
// floors (0: none).
// rows: the work list (0: rows 0 .. num_work_rows - 1).
inline TsRows rows_of(int64_t rows, int64_t num_work_rows, const std::vector<int64_t>& params) {
  constexpr size_t kParams = 0
#define TS_COUNT(type, name) +1
      TS_ROW_PARAMS(TS_COUNT);
#undef TS_COUNT
  if (params.size() != kParams + 4)
    throw std::invalid_argument("tokensampler: " + std::to_string(kParams) + " parameter arrays and a bitmask expected");
  TsRows r{};
  r.rows = ptr<const int32_t>(rows), r.num_work_rows = static_cast<int32_t>(num_work_rows);
  size_t i = 0;
#define TS_POINT(type, name) r.name = ptr<const type>(params[i++]);
  TS_ROW_PARAMS(TS_POINT)
#undef TS_POINT
  r.bitmask = bitmask_of(params[i], params[i + 1], params[i + 2], params[i + 3]);
  return r;
}

}  // namespace tokensampler::binding
