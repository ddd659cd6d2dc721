// Torch binding of the local samplers' kernels (csrc/local_samplers.h): plain device addresses in, launches on the
// given stream. Shapes, dtypes and the workspace are checked and owned by
// server/tokensampler_server/backends/cuda_local_samplers.py.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <stdexcept>
#include <string>

#include "binding_args.h"
#include "local_samplers.h"
#include "sequence_bans.h"

using tokensampler::binding::check;
using tokensampler::binding::ptr;

void register_local_samplers(pybind11::module_& m) {
  m.attr("LOCAL_TOP_N_SIGMA") = static_cast<int>(TS_LOCAL_TOP_N_SIGMA);
  m.attr("LOCAL_TYPICAL") = static_cast<int>(TS_LOCAL_TYPICAL);
  m.attr("LOCAL_XTC") = static_cast<int>(TS_LOCAL_XTC);
  m.def("local_rows_bytes", &ts_local_rows_bytes);
  // (scratch, zeroed) bytes of a launch over num_rows rows of vocab logits.
  m.def("local_samplers_workspace", [](int64_t num_rows, int64_t vocab) {
    const TsLocalWorkspaceBytes w = ts_local_samplers_workspace(num_rows, vocab);
    return pybind11::make_tuple(w.scratch, w.zeroed);
  });
  m.attr("SEQUENCE_MAX_NEED") = static_cast<int>(TS_SEQUENCE_MAX_NEED);
  // tiles: int32 [num_tiles, columns] (repetition.py TileLayout; the column indices given here); instances: int32
  // [num_instances, 2] or 0; words: int32 [rows, words_per_row], whose banned tokens' bits are cleared.
  m.def("sequence_bans", [](int64_t tiles, int64_t num_tiles, int64_t columns, int64_t width, int64_t row_column,
                            int64_t need_column, int64_t suffix_column, int64_t tokens_column, int64_t off_need,
                            int64_t instances, int64_t num_instances, int64_t words, int64_t words_per_row,
                            int64_t stream) {
    const TsSequenceTiles t{ptr<const int32_t>(tiles), num_tiles, static_cast<int32_t>(columns),
                            static_cast<int32_t>(width), static_cast<int32_t>(row_column),
                            static_cast<int32_t>(need_column), static_cast<int32_t>(suffix_column),
                            static_cast<int32_t>(tokens_column), static_cast<int32_t>(off_need),
                            ptr<const int32_t>(instances), num_instances};
    check(ts_sequence_bans(&t, ptr<uint32_t>(words), static_cast<int32_t>(words_per_row), ptr<void>(stream)),
          "sequence_bans");
  });
  // logits: float32 [num_rows, vocab]; rows: the packed parameters (ts_local_rows_packed).
  m.def("local_samplers", [](int64_t logits, int64_t num_rows, int64_t vocab, int64_t rows, int64_t samplers,
                             int64_t scratch, int64_t zeroed, int64_t stream) {
    const TsLocalRows r = ts_local_rows_packed(ptr<const void>(rows), num_rows);
    check(ts_local_samplers(ptr<float>(logits), num_rows, vocab, &r, static_cast<int32_t>(samplers), ptr<void>(scratch),
                            ptr<void>(zeroed), ptr<void>(stream)),
          "local_samplers");
  });
}
