// Torch binding of the workload kernels (csrc/workloads.h): diffusion steps, top-k probabilities, draft
// verification. Plain device addresses in, launches on the given stream; shapes and dtypes are checked
// by server/tokensampler_server/backends/cuda_workloads.py, which owns every tensor passed here.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "workloads.h"

namespace {

using tokensampler::binding::check;
using tokensampler::binding::ptr;
using tokensampler::binding::workspace_of;

// job: logits, vocab, dtype, num_rows, per_request, active, temperature, seed, position, iteration,
// draw_slot, aux, aux_per_request (addresses 0 = NULL).
TsRowJob job_of(const std::vector<int64_t>& j) {
  if (j.size() != 13) throw std::invalid_argument("tokensampler: 13 row-job fields expected");
  return TsRowJob{ptr<const void>(j[0]), j[1], static_cast<int32_t>(j[2]), static_cast<int32_t>(j[3]),
                  static_cast<int32_t>(j[4]), ptr<const uint8_t>(j[5]), ptr<const float>(j[6]), ptr<const int64_t>(j[7]),
                  ptr<const int64_t>(j[8]), ptr<const int64_t>(j[9]), static_cast<int32_t>(j[10]), ptr<const float>(j[11]),
                  static_cast<int32_t>(j[12])};
}

// stats: row_max, row_sum, argmax, token, aux_sum, confidence.
TsRowStats stats_of(const std::vector<int64_t>& s) {
  if (s.size() != 6) throw std::invalid_argument("tokensampler: 6 row-stats arrays expected");
  return TsRowStats{ptr<float>(s[0]), ptr<float>(s[1]), ptr<int64_t>(s[2]), ptr<int64_t>(s[3]), ptr<float>(s[4]),
                    ptr<float>(s[5])};
}

}  // namespace

void register_workloads(pybind11::module_& m) {
  m.def("row_stats_scratch_bytes", &ts_row_stats_scratch_bytes);
  m.def("verify_scratch_bytes", &ts_verify_scratch_bytes);
  m.def("topk_probs_bucket", &ts_topk_probs_bucket);
  m.def("topk_probs_scratch_bytes", &ts_topk_probs_scratch_bytes);
  m.def("row_stats", [](std::vector<int64_t> job, std::vector<int64_t> stats, std::vector<int64_t> ws, int64_t stream) {
    const TsRowJob j = job_of(job);
    const TsRowStats s = stats_of(stats);
    const TsWorkspace w = workspace_of(ws);
    check(ts_row_stats(&j, &s, &w, ptr<void>(stream)), "row_stats");
  });
  m.def("diffusion_mailbox_bytes", &ts_diffusion_mailbox_bytes);
  m.def("diffusion_step", [](std::vector<int64_t> job, std::vector<int64_t> stats, int64_t threshold, int64_t count,
                             int64_t tokens, int64_t confidences, int64_t mask_out, std::vector<int64_t> ws,
                             int64_t mailbox, int64_t stream) {
    const TsRowJob j = job_of(job);
    const TsRowStats s = stats_of(stats);
    const TsWorkspace w = workspace_of(ws);
    check(ts_diffusion_step(&j, &s, ptr<const float>(threshold), ptr<const int64_t>(count), ptr<int64_t>(tokens),
                            ptr<float>(confidences), ptr<uint8_t>(mask_out), &w, ptr<void>(mailbox), ptr<void>(stream)),
          "diffusion_step");
  });
  m.def("verify_finish", [](std::vector<int64_t> job, std::vector<int64_t> stats, int64_t draft_ids, int64_t accepted,
                            int64_t tokens, std::vector<int64_t> ws, int64_t stream) {
    const TsRowJob j = job_of(job);
    const TsRowStats s = stats_of(stats);
    const TsWorkspace w = workspace_of(ws);
    check(ts_verify_finish(&j, &s, ptr<const int64_t>(draft_ids), ptr<int64_t>(accepted), ptr<int64_t>(tokens), &w,
                           ptr<void>(stream)),
          "verify_finish");
  });
  m.def("topk_probs", [](int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t temperature, int64_t k,
                         int64_t bucket, int64_t probs, int64_t ids, int64_t flags, std::vector<int64_t> ws,
                         int64_t stream) {
    const TsLogits l{ptr<const void>(data), num_rows, vocab, static_cast<int32_t>(dtype), nullptr};
    const TsWorkspace w = workspace_of(ws);
    check(ts_topk_probs(&l, ptr<const float>(temperature), static_cast<int32_t>(k), static_cast<int32_t>(bucket),
                        ptr<float>(probs), ptr<int64_t>(ids), ptr<uint8_t>(flags), &w, ptr<void>(stream)),
          "topk_probs");
  });
}
