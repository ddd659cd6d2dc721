// Torch binding of the fused LM-head matmul + sampling kernels (csrc/fused.h): plain device
// addresses in, launches on the caller's stream. Shapes, dtypes and alignment are checked on the
// Python side (server/tokensampler_server/backends/cuda_fused.py), which owns every tensor passed here.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "binding_args.h"
#include "fused.h"

namespace {

using tokensampler::binding::ptr;
using tokensampler::binding::rows_of;

using PlanTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

PlanTuple plan_tuple(const TsFusedPlan& p) {
  return {p.kernel, p.rows_per_tile, p.vocab_ctas, p.batch_tiles, static_cast<int64_t>(p.smem_bytes),
          static_cast<int64_t>(p.scratch_bytes)};
}

TsFusedPlan plan_of(const PlanTuple& t) {
  return TsFusedPlan{static_cast<int32_t>(std::get<0>(t)), static_cast<int32_t>(std::get<1>(t)),
                     static_cast<int32_t>(std::get<2>(t)), static_cast<int32_t>(std::get<3>(t)),
                     static_cast<size_t>(std::get<4>(t)), static_cast<size_t>(std::get<5>(t))};
}

TsLmHead head_of(int64_t weight, int64_t vocab, int64_t dim, int64_t dtype, int64_t bias, double logit_scale,
                 double soft_cap, int64_t first_token) {
  return TsLmHead{ptr<const void>(weight), vocab, dim, static_cast<int32_t>(dtype), ptr<const float>(bias),
                  static_cast<float>(logit_scale), static_cast<float>(soft_cap), first_token};
}

}  // namespace

void register_fused(pybind11::module_& m) {
  // (kernel, rows_per_tile, vocab_ctas, batch_tiles, smem_bytes, scratch_bytes); rows_per_tile 0: unsupported.
  m.def("fused_plan", [](int64_t num_rows, int64_t dim, int64_t vocab, int64_t num_sms, int64_t max_smem,
                         bool filtered) {
    return plan_tuple(ts_fused_plan(num_rows, dim, vocab, static_cast<int32_t>(num_sms), static_cast<int32_t>(max_smem),
                                    filtered ? 1 : 0));
  });
  m.def("fused_preferred", [](int64_t num_rows, bool filtered) { return ts_fused_preferred(num_rows, filtered) != 0; });
  m.attr("FUSED_MAX_TOP_K") = static_cast<int>(TS_FUSED_MAX_TOP_K);
  // head: weight, vocab, dim, dtype, bias (0: none); params: as binding_args.h rows_of takes them; logprobs 0: not
  // computed.
  m.def("fused_sample", [](int64_t weight, int64_t vocab, int64_t dim, int64_t dtype, int64_t bias, double logit_scale,
                           double soft_cap, int64_t states, int64_t num_rows, std::vector<int64_t> params,
                           PlanTuple plan, int64_t tokens, int64_t num_samples, int64_t logprobs, int64_t flags,
                           int64_t scratch, int64_t stream) {
    const TsLmHead head = head_of(weight, vocab, dim, dtype, bias, logit_scale, soft_cap, 0);
    const TsRows rows = rows_of(0, num_rows, params);
    const TsFusedOutputs out{ptr<int64_t>(tokens), static_cast<int32_t>(num_samples), ptr<float>(logprobs),
                             ptr<uint8_t>(flags)};
    const TsFusedPlan p = plan_of(plan);
    tokensampler::binding::check(
        ts_fused_sample(&head, ptr<const void>(states), num_rows, &rows, &p, &out, ptr<void>(scratch), ptr<void>(stream)),
        "fused_sample");
  });
  // The logits of the rows a fused call flagged (flags: its uint8 [num_rows]) into fp32 [num_rows, vocab].
  m.def("fused_head_rows", [](int64_t weight, int64_t vocab, int64_t dim, int64_t dtype, int64_t bias,
                              double logit_scale, double soft_cap, int64_t states, int64_t num_rows, int64_t flags,
                              int64_t logits, int64_t stream) {
    const TsLmHead head = head_of(weight, vocab, dim, dtype, bias, logit_scale, soft_cap, 0);
    tokensampler::binding::check(ts_fused_head_rows(&head, ptr<const void>(states), num_rows, ptr<const uint8_t>(flags),
                                                    ptr<float>(logits), ptr<void>(stream)),
                                 "fused_head_rows");
  });
  // The stages apart, for a shard of a vocabulary-parallel head (fused.h): the head as fused_sample's plus the
  // token id of its first row; stage 1 writes `scratch`, stage 2 reads the shards' scratch side by side.
  m.def("fused_candidates", [](int64_t kernel) { return ts_fused_candidates(static_cast<int32_t>(kernel)); });
  m.def("fused_partials", [](int64_t weight, int64_t vocab, int64_t dim, int64_t dtype, int64_t bias,
                             double logit_scale, double soft_cap, int64_t first_token, int64_t states, int64_t num_rows,
                             std::vector<int64_t> params, PlanTuple plan, bool want_sum1, int64_t scratch,
                             int64_t stream) {
    const TsLmHead head = head_of(weight, vocab, dim, dtype, bias, logit_scale, soft_cap, first_token);
    const TsRows rows = rows_of(0, num_rows, params);
    const TsFusedPlan p = plan_of(plan);
    tokensampler::binding::check(ts_fused_partials(&head, ptr<const void>(states), num_rows, &rows, &p,
                                                   want_sum1 ? 1 : 0, ptr<void>(scratch), ptr<void>(stream)),
                                 "fused_partials");
  });
  m.def("fused_finish", [](int64_t num_rows, std::vector<int64_t> params, int64_t num_shards, int64_t parts_a_shard,
                           int64_t shards, int64_t shard_bytes, int64_t cands_per_part, int64_t tokens,
                           int64_t num_samples, int64_t logprobs, int64_t flags, int64_t stream) {
    const TsRows rows = rows_of(0, num_rows, params);
    const TsFusedOutputs out{ptr<int64_t>(tokens), static_cast<int32_t>(num_samples), ptr<float>(logprobs),
                             ptr<uint8_t>(flags)};
    tokensampler::binding::check(
        ts_fused_finish(num_rows, &rows, static_cast<int32_t>(num_shards), static_cast<int32_t>(parts_a_shard),
                        ptr<const void>(shards), static_cast<size_t>(shard_bytes), static_cast<int32_t>(cands_per_part),
                        &out, ptr<void>(stream)),
        "fused_finish");
  });
}
