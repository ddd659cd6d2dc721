// Torch binding of the scoring kernel (csrc/score.h). Plain device addresses in, launches on the given stream;
// shapes and dtypes are checked by server/tokensampler_server/workloads/score_cuda.py, which owns every tensor
// passed here.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "score.h"

using tokensampler::binding::check;
using tokensampler::binding::ptr;

void register_score(pybind11::module_& m) {
  m.attr("score_max_top") = TS_SCORE_MAX_TOP;
  m.def("score_block_tokens", &ts_score_block_tokens);
  m.def("score_scratch_bytes", &ts_score_scratch_bytes);
  m.def("score_state_bytes", &ts_score_state_bytes);
  // logits: data, num_rows, width, dtype, row_start (0: contiguous rows); rows: token, temperature (0: none),
  // top_n, logprob, entropy (0: none), top_ids, top_values; ws: counters, scratch.
  m.def("score_slice", [](std::vector<int64_t> logits, int64_t offset, std::vector<int64_t> rows, bool first,
                          bool last, int64_t state, std::vector<int64_t> ws, int64_t stream) {
    if (logits.size() != 5 || rows.size() != 7 || ws.size() != 2)
      throw std::invalid_argument("tokensampler score_slice: 5 logits, 7 rows and 2 workspace fields expected");
    const TsLogits l{ptr<const void>(logits[0]), logits[1], logits[2], static_cast<int32_t>(logits[3]),
                     ptr<const int64_t>(logits[4])};
    const TsScoreRows r{ptr<const int64_t>(rows[0]), ptr<const float>(rows[1]), static_cast<int32_t>(rows[2]),
                        ptr<float>(rows[3]), ptr<float>(rows[4]), ptr<int64_t>(rows[5]), ptr<float>(rows[6])};
    const TsWorkspace w{ptr<unsigned int>(ws[0]), nullptr, ptr<void>(ws[1]), nullptr};
    check(ts_score_slice(&l, offset, &r, first ? 1 : 0, last ? 1 : 0, ptr<void>(state), &w, ptr<void>(stream)),
          "score_slice");
  });
}
