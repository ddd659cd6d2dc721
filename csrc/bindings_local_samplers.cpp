// Torch binding of the local samplers' kernels (csrc/local_samplers.h): plain device addresses in, launches on the
// given stream. Shapes, dtypes and the workspace are checked and owned by
// server/tokensampler_server/backends/cuda_local_samplers.py.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "local_samplers.h"
#include "sequence_samplers.h"

using tokensampler::binding::check;
using tokensampler::binding::ptr;

namespace {

// TsSequenceTiles from its fields in declaration order: tiles, num_tiles, columns, width, halo, the nine column
// indices and counts from row_column to off_need, instances, num_instances.
TsSequenceTiles sequence_tiles(const std::vector<int64_t>& f) {
  if (f.size() != 17) throw std::invalid_argument("sequence tiles: 17 fields expected, got " + std::to_string(f.size()));
  auto i32 = [&](size_t k) { return static_cast<int32_t>(f[k]); };
  return TsSequenceTiles{ptr<const int32_t>(f[0]), f[1], i32(2), i32(3), i32(4), i32(5), i32(6), i32(7), i32(8),
                         i32(9), i32(10), i32(11), i32(12), i32(13), i32(14), ptr<const int32_t>(f[15]), f[16]};
}

// local_samplers' result bit for a call whose cut went to the rows' floors (beside the TS_LOCAL_* bits).
constexpr int kFloorWritten = 8;
static_assert(kFloorWritten > (TS_LOCAL_TOP_N_SIGMA | TS_LOCAL_TYPICAL | TS_LOCAL_XTC), "a bit of its own");

// The rows' columns (host addresses, local_samplers' order below) packed into pinned `host`, copied to `dev` on
// `stream`, with the TS_LOCAL_* bits of the samplers some row uses (none: nothing packed or copied).
struct Packed {
  TsLocalRows rows;
  int32_t samplers;
};

Packed pack_rows(const std::vector<int64_t>& columns, int64_t num_rows, int64_t host, int64_t dev, int64_t stream) {
  if (columns.size() != 7) throw std::invalid_argument("local samplers: 7 host columns expected");
  const size_t n = static_cast<size_t>(num_rows);
  const float* sigma = ptr<const float>(columns[0]);
  const float* typical = ptr<const float>(columns[1]);
  const float* probability = ptr<const float>(columns[3]);
  int32_t samplers = 0;
  for (size_t i = 0; i < n; ++i) {
    if (sigma[i] > 0.f) samplers |= TS_LOCAL_TOP_N_SIGMA;
    if (typical[i] < 1.f) samplers |= TS_LOCAL_TYPICAL;
    if (probability[i] > 0.f) samplers |= TS_LOCAL_XTC;
  }
  if (!samplers) return Packed{TsLocalRows{}, 0};
  char* packed = ptr<char>(host);
  for (size_t c = 0; c < 4; ++c)
    std::memcpy(packed + c * sizeof(float) * n, ptr<const void>(columns[c]), sizeof(float) * n);
  for (size_t c = 0; c < 3; ++c)
    std::memcpy(packed + 4 * sizeof(float) * n + c * sizeof(int64_t) * n, ptr<const void>(columns[4 + c]),
                sizeof(int64_t) * n);
  check(cudaMemcpyAsync(ptr<void>(dev), packed, ts_local_rows_bytes(num_rows), cudaMemcpyHostToDevice,
                        static_cast<cudaStream_t>(ptr<void>(stream))),
        "local samplers' rows");
  return Packed{ts_local_rows_packed(ptr<const void>(dev), num_rows), samplers};
}

}  // namespace

void register_local_samplers(pybind11::module_& m) {
  m.attr("LOCAL_TOP_N_SIGMA") = static_cast<int>(TS_LOCAL_TOP_N_SIGMA);
  m.attr("LOCAL_TYPICAL") = static_cast<int>(TS_LOCAL_TYPICAL);
  m.attr("LOCAL_XTC") = static_cast<int>(TS_LOCAL_XTC);
  m.attr("LOCAL_FLOOR") = kFloorWritten;
  m.def("local_rows_bytes", &ts_local_rows_bytes);
  // (scratch, zeroed) bytes of a launch over num_rows rows of vocab logits.
  m.def("local_samplers_workspace", [](int64_t num_rows, int64_t vocab) {
    const TsLocalWorkspaceBytes w = ts_local_samplers_workspace(num_rows, vocab);
    return pybind11::make_tuple(w.scratch, w.zeroed);
  });
  m.attr("SEQUENCE_MAX_HALO") = static_cast<int>(TS_SEQUENCE_MAX_HALO);
  m.attr("SEQUENCE_MAX_SINGLES") = static_cast<int>(TS_SEQUENCE_MAX_SINGLES);
  // The tiles' addresses and layout (repetition.py TileLayout; column indices given by the caller, in
  // sequence_tiles' order) for the launchers below.
  m.def("sequence_bans", [](std::vector<int64_t> tiles, int64_t words, int64_t words_per_row, int64_t stream) {
    const TsSequenceTiles t = sequence_tiles(tiles);
    check(ts_sequence_bans(&t, ptr<uint32_t>(words), static_cast<int32_t>(words_per_row), ptr<void>(stream)),
          "sequence_bans");
  });
  m.def("sequence_penalties", [](std::vector<int64_t> tiles, int64_t x, int64_t vocab, int64_t penalty,
                                 int64_t stream) {
    const TsSequenceTiles t = sequence_tiles(tiles);
    check(ts_sequence_penalties(&t, ptr<float>(x), vocab, ptr<float>(penalty), ptr<void>(stream)),
          "sequence_penalties");
  });
  // logits: float32 [num_rows, vocab] on the device; keep: 0 (removals written into the logits) or the device
  // address of int32 [num_rows, ceil(vocab / 32)] kept bits (ts_local_samplers); floor: 0 or the device address of
  // float32 [num_rows] floors, written instead (ts_top_n_sigma_floor) where top-n-sigma is the only sampler some row
  // uses (with keep 0, no row may use another); columns: the host addresses of the rows' float32 top_n_sigma,
  // typical_p, xtc_threshold, xtc_probability and int64 seed, position, iteration [num_rows] each. Packs them into
  // pinned `host` as ts_local_rows_packed lays them out, copies them to `dev` and launches the samplers some row
  // uses, all on `stream`; returns their TS_LOCAL_* bits (0: nothing copied, set or launched), with LOCAL_FLOOR
  // where the floors were written. One call from Python, which decides the route from its columns here instead of
  // in torch (~20 us of a call on an H200's host) and packs them instead of numpy (docs/design/kernel-routing.md).
  m.def("local_samplers", [](int64_t logits, int64_t keep, int64_t floor, int64_t num_rows, int64_t vocab,
                             std::vector<int64_t> columns, int64_t host, int64_t dev, int64_t scratch, int64_t zeroed,
                             int64_t stream) {
    const Packed p = pack_rows(columns, num_rows, host, dev, stream);
    if (!p.samplers) return 0;
    if (floor && p.samplers == TS_LOCAL_TOP_N_SIGMA) {
      check(ts_top_n_sigma_floor(ptr<const float>(logits), ptr<float>(floor), num_rows, vocab, &p.rows,
                                 ptr<void>(scratch), ptr<void>(zeroed), ptr<void>(stream)),
            "local_samplers' floor");
      return p.samplers | kFloorWritten;
    }
    // A floor address says the logits are only read: the other samplers then need kept bits to cut into.
    if (floor && !keep)
      throw std::invalid_argument("local_samplers: floor given without keep, and a row uses typical-p or XTC");
    check(ts_local_samplers(ptr<float>(logits), ptr<uint32_t>(keep), num_rows, vocab, &p.rows, p.samplers,
                            ptr<void>(scratch), ptr<void>(zeroed), ptr<void>(stream)),
          "local_samplers");
    return static_cast<int>(p.samplers);
  });
}
