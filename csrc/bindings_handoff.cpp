// Torch binding of the colocated hand-off kernels (csrc/handoff.h). Plain addresses in, launches on the given
// stream; server/tokensampler_server/backends/cuda_handoff.py owns every buffer passed here.
#include <torch/extension.h>

#include "binding_args.h"
#include "handoff.h"

using tokensampler::binding::check;
using tokensampler::binding::ptr;

void register_handoff(pybind11::module_& m) {
  m.def("gated_copy", [](int64_t src, int64_t dst, int64_t nbytes, int64_t gate, int64_t stop, int64_t step,
                         int64_t verdict, int64_t stream) {
    check(ts_gated_copy(ptr<const void>(src), ptr<void>(dst), nbytes, ptr<const uint32_t>(gate),
                        ptr<const uint32_t>(stop), static_cast<uint32_t>(step), ptr<uint32_t>(verdict),
                        ptr<void>(stream)),
          "gated_copy");
  });
  // tokens, count, out_tokens, out_int64, logprobs (0: none), out_logprobs (0: none), gate, stop, step, release,
  // stream
  m.def("deliver", [](int64_t tokens, int64_t count, int64_t out_tokens, bool out_int64, int64_t logprobs,
                      int64_t out_logprobs, int64_t gate, int64_t stop, int64_t step, int64_t release,
                      int64_t stream) {
    check(ts_deliver(ptr<const int64_t>(tokens), count, ptr<void>(out_tokens), out_int64 ? 1 : 0,
                     ptr<const float>(logprobs), ptr<float>(out_logprobs), ptr<const uint32_t>(gate),
                     ptr<const uint32_t>(stop), static_cast<uint32_t>(step), ptr<uint32_t>(release),
                     ptr<void>(stream)),
          "deliver");
  });
}
