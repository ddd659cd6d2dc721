// The one torch binding of the logits-path kernels: plain pointers in, launches on the caller's
// stream. Shapes, dtypes and workspace sizes are checked on the Python side
// (server/tokensampler_server/backends/cuda_kernels.py), which owns every tensor passed here.
// copy_h2d / copy_d2h_sync move the CUDA backend's packed per-call upload and results (pinned host
// memory), copy_d2d and fill_bytes its reused device buffers, with one runtime call each, without a torch op's
// dispatch and allocation around them.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "routes.h"
#include "sampling.h"

// Defined in bindings_fused.cpp (hidden states x LM head), bindings_workloads.cpp (diffusion, top-k
// probabilities, draft verification), bindings_native_path.cpp (the native path),
// bindings_score.cpp (scoring given tokens), bindings_local_samplers.cpp (typical-p, top-n-σ, XTC) and
// bindings_handoff.cpp (the colocated hand-off): one extension module, one binding file per family.
void register_fused(pybind11::module_& m);
void register_workloads(pybind11::module_& m);
void register_native_path(pybind11::module_& m);
void register_score(pybind11::module_& m);
void register_local_samplers(pybind11::module_& m);
void register_handoff(pybind11::module_& m);

namespace {

using tokensampler::binding::bitmask_of;
using tokensampler::binding::check;
using tokensampler::binding::ptr;
using tokensampler::binding::rows_of;
using tokensampler::binding::workspace_of;

TsLogits logits_of(int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype) {
  return TsLogits{ptr<const void>(data), num_rows, vocab, static_cast<int32_t>(dtype), nullptr};
}

// outputs: tokens, flags, row_max, row_min, row_logz, kept_mass, kept_min_key (0 = not written).
TsOutputs outputs_of(const std::vector<int64_t>& o, int64_t num_samples, int64_t sample) {
  if (o.size() != 7) throw std::invalid_argument("tokensampler: 7 output arrays expected");
  return TsOutputs{ptr<int64_t>(o[0]), static_cast<int32_t>(num_samples), static_cast<int32_t>(sample),
                   ptr<uint8_t>(o[1]), ptr<float>(o[2]), ptr<float>(o[3]), ptr<float>(o[4]), ptr<float>(o[5]),
                   ptr<int64_t>(o[6])};
}

// The logits, rows, outputs and workspace of a sampler's call, converted (and their sizes checked) in that order.
struct SamplerCall {
  TsLogits logits;
  TsRows rows;
  TsOutputs out;
  TsWorkspace ws;
};

SamplerCall sampler_call(int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t rows, int64_t num_work,
                         const std::vector<int64_t>& params, const std::vector<int64_t>& outs, int64_t num_samples,
                         int64_t sample, const std::vector<int64_t>& ws) {
  return SamplerCall{logits_of(data, num_rows, vocab, dtype), rows_of(rows, num_work, params),
                     outputs_of(outs, num_samples, sample), workspace_of(ws)};
}

using SamplerWithRowFloats = int (*)(const TsLogits*, const TsRows*, const float*, int32_t, const TsOutputs*,
                                     const TsWorkspace*, void*);

// A sampler of one sample column that takes one per-row float array besides the rows (ts_gumbel, ts_min_p).
void def_sampler_with_row_floats(pybind11::module_& m, const char* name, SamplerWithRowFloats launch) {
  m.def(name, [name, launch](int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t rows,
                             int64_t num_work, std::vector<int64_t> params, int64_t row_floats,
                             std::vector<int64_t> outs, int64_t num_samples, int64_t sample, std::vector<int64_t> ws,
                             int64_t stream) {
    const SamplerCall c =
        sampler_call(data, num_rows, vocab, dtype, rows, num_work, params, outs, num_samples, sample, ws);
    check(launch(&c.logits, &c.rows, ptr<const float>(row_floats), 1, &c.out, &c.ws, ptr<void>(stream)), name);
  });
}

// The routes of a call (routes.h): its plan as a Python object, and the launches of a plan.
void register_routes(pybind11::module_& m) {
  namespace py = pybind11;
  auto group = [](const TsGroup& g) { return py::make_tuple(g.first, g.n); };
  py::class_<TsPlan>(m, "Plan", "The rows' groups of one call (routes.h TsPlan); a group is (first, n), first -1: every row.")
      .def_property_readonly("greedy", [group](const TsPlan& p) { return group(p.greedy); })
      .def_property_readonly("unfiltered", [group](const TsPlan& p) { return group(p.unfiltered); })
      .def_property_readonly("buckets", [group](const TsPlan& p) {
        py::list out;
        for (const TsGroup& g : p.buckets) out.append(group(g));
        return out;
      })
      .def_property_readonly("exact", [group](const TsPlan& p) { return group(p.exact); })
      .def_property_readonly("need_raw", [group](const TsPlan& p) { return group(p.need_raw); })
      .def_property_readonly("settle", [group](const TsPlan& p) { return group(p.settle); })
      .def_readonly("num_samples", &TsPlan::num_samples)
      .def_readonly("exact_route", &TsPlan::exact_route)
      .def_readonly("filter_splits", &TsPlan::filter_splits)
      .def_readonly("settle_splits", &TsPlan::settle_splits)
      .def_readonly("lists_used", &TsPlan::lists_used)
      .def("workspace", [](const TsPlan& p) {
        const TsWorkspaceBytes w = ts_plan_workspace(&p);
        return py::make_tuple(w.counters, w.hist, w.scratch);
      });
  m.attr("TOKENS") = static_cast<int>(TS_TOKENS);
  m.attr("LOGPROBS_RAW") = static_cast<int>(TS_LOGPROBS_RAW);
  m.attr("LOGPROBS_PROCESSED") = static_cast<int>(TS_LOGPROBS_PROCESSED);
  m.attr("EXACT_FILTER") = static_cast<int>(TS_EXACT_FILTER);
  m.attr("EXACT_MIN_P") = static_cast<int>(TS_EXACT_MIN_P);
  m.attr("EXACT_FRONTIER") = static_cast<int>(TS_EXACT_FRONTIER);
  m.attr("EXACT_CUT") = static_cast<int>(TS_EXACT_CUT);
  m.attr("ROUTES_EXACT") = static_cast<int>(TS_ROUTES_EXACT);
  m.attr("ROUTES_FAST") = static_cast<int>(TS_ROUTES_FAST);
  m.attr("ROUTES_SETTLED") = static_cast<int>(TS_ROUTES_SETTLED);
  m.attr("ROUTES_FLAGGED") = static_cast<int>(TS_ROUTES_FLAGGED);
  m.attr("FRONTIER_MIN_ROWS") = TS_FRONTIER_MIN_ROWS;
  m.attr("CUT_MIN_SAMPLES_WITH_K") = TS_CUT_MIN_SAMPLES_WITH_K;
  m.attr("CUT_MIN_SAMPLES_TOP_P") = TS_CUT_MIN_SAMPLES_TOP_P;
  m.def("filter_splits", &ts_filter_splits);
  m.def("stage_layout", [](int64_t num_rows) {
    const TsStageLayout s = ts_stage_layout(num_rows);
    py::dict d;
#define TS_ENTRY(type, name) d[#name] = s.name;
    TS_ROW_PARAMS(TS_ENTRY)
#undef TS_ENTRY
    d["masks"] = s.masks, d["lists"] = s.lists;
    d["row_start"] = s.row_start, d["bitmask_row"] = s.bitmask_row, d["bitmask_words"] = s.bitmask_words;
    return d;
  });
  m.def("plan", [](int64_t host_stage, int64_t num_rows, int64_t vocab, int64_t num_samples, int64_t kind,
                   bool processing, int64_t routing) {
    TsPlan plan;
    if (num_samples < 1 || num_samples > INT32_MAX ||
        ts_plan(ptr<void>(host_stage), num_rows, vocab, static_cast<int32_t>(num_samples), static_cast<int32_t>(kind),
                processing, static_cast<int32_t>(routing), &plan))
      throw std::invalid_argument("tokensampler: a call the routes cannot plan");
    return plan;
  });
  // logits and raw: (address, dtype code) of [num_rows, vocab] (raw address 0: no need_raw pass); bitmask: the 4
  // entries of launch params; main, filt, pre, raw_out: 7 output addresses each (outputs_of).
  m.def("launch_plan", [](const TsPlan& plan, int64_t data, int64_t dtype, std::vector<int64_t> bitmask,
                          int64_t lse_scale, int64_t raw_data, int64_t raw_dtype, int64_t raw_lse_scale,
                          int64_t dev_stage, std::vector<int64_t> main, std::vector<int64_t> filt,
                          std::vector<int64_t> pre, std::vector<int64_t> raw_out, int64_t exact_bits,
                          std::vector<int64_t> ws, int64_t stream) {
    if (bitmask.size() != 4) throw std::invalid_argument("tokensampler: 4 bitmask entries expected");
    const TsCallInputs in{logits_of(data, plan.num_rows, plan.vocab, dtype),
                          bitmask_of(bitmask[0], bitmask[1], bitmask[2], bitmask[3]),
                          ptr<const float>(lse_scale), logits_of(raw_data, plan.num_rows, plan.vocab, raw_dtype),
                          ptr<const float>(raw_lse_scale)};
    const TsCallOutputs out{outputs_of(main, 1, 0), outputs_of(filt, 1, 0), outputs_of(pre, 1, 0),
                            outputs_of(raw_out, 1, 0), ptr<uint8_t>(exact_bits)};
    const TsWorkspace w = workspace_of(ws);
    check(ts_launch_plan(&plan, &in, ptr<const void>(dev_stage), &out, &w, ptr<void>(stream)), "launch_plan");
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tokensampler logits-path CUDA kernels (csrc/sampling.h)";
  m.def("num_splits", &ts_num_splits);
  m.def("topk_bucket", &ts_topk_bucket);
  m.def("stats_scratch_bytes", &ts_stats_scratch_bytes);
  m.def("gumbel_scratch_bytes", &ts_gumbel_scratch_bytes);
  m.def("topk_scratch_bytes", &ts_topk_scratch_bytes);
  m.def("hist_bytes", &ts_hist_bytes);
  m.def("stats", [](int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t rows, int64_t num_work,
                    std::vector<int64_t> params, int64_t lse_scale, std::vector<int64_t> outs, int64_t num_samples,
                    std::vector<int64_t> ws, int64_t stream) {
    const SamplerCall c = sampler_call(data, num_rows, vocab, dtype, rows, num_work, params, outs, num_samples, 0, ws);
    check(ts_stats(&c.logits, &c.rows, ptr<const float>(lse_scale), &c.out, &c.ws, ptr<void>(stream)), "stats");
  });
  def_sampler_with_row_floats(m, "gumbel", &ts_gumbel);  // the floats: lse_scale (0: none)
  def_sampler_with_row_floats(m, "min_p", &ts_min_p);    // the floats: stats' row_max
  m.def("topk", [](int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t rows, int64_t num_work,
                   std::vector<int64_t> params, int64_t bucket, std::vector<int64_t> outs, int64_t num_samples,
                   std::vector<int64_t> ws, int64_t stream) {
    const SamplerCall c = sampler_call(data, num_rows, vocab, dtype, rows, num_work, params, outs, num_samples, 0, ws);
    check(ts_topk(&c.logits, &c.rows, static_cast<int32_t>(bucket), &c.out, &c.ws, ptr<void>(stream)), "topk");
  });
  m.def("filter", [](int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t rows, int64_t num_work,
                     std::vector<int64_t> params, std::vector<int64_t> stats, int64_t need_exact_mass, int64_t splits,
                     std::vector<int64_t> outs, int64_t num_samples, int64_t sample, std::vector<int64_t> ws,
                     int64_t stream) {
    if (stats.size() != 4) throw std::invalid_argument("tokensampler: row_max, row_min, argmax, flags expected");
    const SamplerCall c =
        sampler_call(data, num_rows, vocab, dtype, rows, num_work, params, outs, num_samples, sample, ws);
    check(ts_filter(&c.logits, &c.rows, ptr<const float>(stats[0]), ptr<const float>(stats[1]),
                    ptr<const int64_t>(stats[2]), ptr<const uint8_t>(stats[3]), static_cast<int32_t>(need_exact_mass),
                    static_cast<int32_t>(splits), &c.out, &c.ws, ptr<void>(stream)),
          "filter");
  });
  m.def("nucleus_scratch_bytes", &ts_nucleus_scratch_bytes);
  m.def("nucleus", [](int64_t data, int64_t num_rows, int64_t vocab, int64_t dtype, int64_t rows, int64_t num_work,
                      std::vector<int64_t> params, std::vector<int64_t> pre, std::vector<int64_t> outs,
                      int64_t num_samples, int64_t sample, std::vector<int64_t> ws, int64_t stream) {
    const TsOutputs p = outputs_of(pre, 1, 0);
    const SamplerCall c =
        sampler_call(data, num_rows, vocab, dtype, rows, num_work, params, outs, num_samples, sample, ws);
    check(ts_nucleus(&c.logits, &c.rows, &p, &c.out, &c.ws, ptr<void>(stream)), "nucleus");
  });
  m.def("copy_h2d", [](int64_t dst, int64_t src, int64_t nbytes, int64_t stream) {
    check(cudaMemcpyAsync(ptr<void>(dst), ptr<const void>(src), static_cast<size_t>(nbytes), cudaMemcpyHostToDevice,
                          ptr<CUstream_st>(stream)),
          "copy_h2d");
  });
  m.def("copy_d2d", [](int64_t dst, int64_t src, int64_t nbytes, int64_t stream) {
    check(cudaMemcpyAsync(ptr<void>(dst), ptr<const void>(src), static_cast<size_t>(nbytes), cudaMemcpyDeviceToDevice,
                          ptr<CUstream_st>(stream)),
          "copy_d2d");
  });
  m.def("fill_bytes", [](int64_t dst, int64_t value, int64_t nbytes, int64_t stream) {
    check(cudaMemsetAsync(ptr<void>(dst), static_cast<int>(value), static_cast<size_t>(nbytes),
                          ptr<CUstream_st>(stream)),
          "fill_bytes");
  });
  m.def("copy_d2h_sync", [](int64_t dst, int64_t src, int64_t nbytes, int64_t stream) {
    int err = 0;
    {
      pybind11::gil_scoped_release release;  // the wait can be long: let other Python threads run
      cudaStream_t s = ptr<CUstream_st>(stream);
      err = cudaMemcpyAsync(ptr<void>(dst), ptr<const void>(src), static_cast<size_t>(nbytes), cudaMemcpyDeviceToHost, s);
      if (err == 0) err = cudaStreamSynchronize(s);
    }
    check(err, "copy_d2h_sync");
  });
  register_fused(m);
  register_workloads(m);
  register_native_path(m);
  register_local_samplers(m);
  register_routes(m);
  register_score(m);
  register_handoff(m);
  // The bitmask (words, row, row_words, floor as in params) written into fp32 logits [num_rows, vocab] in place.
  m.def("apply_bitmask", [](int64_t logits, int64_t num_rows, int64_t vocab, int64_t words, int64_t row,
                            int64_t row_words, int64_t floor, int64_t stream) {
    const TsBitmask bitmask = bitmask_of(words, row, row_words, floor);
    check(ts_apply_bitmask(ptr<float>(logits), num_rows, vocab, &bitmask, ptr<void>(stream)), "apply_bitmask");
  });
  m.def("noise", [](int64_t seed, int64_t position, int64_t iteration, int64_t sample, int64_t vocab,
                    bool split_products, int64_t words, int64_t noise, int64_t stream) {
    check(ts_noise(seed, position, iteration, static_cast<uint32_t>(sample), vocab, split_products ? 1 : 0,
                   ptr<uint32_t>(words), ptr<float>(noise), ptr<void>(stream)),
          "noise");
  });
}
