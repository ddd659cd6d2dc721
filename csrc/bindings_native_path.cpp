// The torch-extension binding of the native path (native_path.h): request bytes in, prepared
// requests sampled together, response bytes out. The GIL is released while a batch is sampled (upload,
// launches, the synchronisation), since nothing there touches Python.
#include <torch/extension.h>

#include <memory>
#include <string>

#include "native_path.h"

namespace py = pybind11;

void register_native_path(py::module_& m) {
  using tokensampler::AnsweredRequest;
  using tokensampler::PreparedRequest;
  using tokensampler::NativePath;
  py::class_<PreparedRequest, std::shared_ptr<PreparedRequest>>(m, "PreparedRequest")
      .def_readonly("num_rows", &PreparedRequest::num_rows)
      .def_property_readonly("merge_key",  // requests of one key may be sampled together
                             [](const PreparedRequest& p) { return py::make_tuple(p.vocab, p.dtype_code); })
      .def_property_readonly("rows_by_mode", [](const PreparedRequest& p) {
        const int64_t* modes = p.rows_by_mode;
        return py::make_tuple(modes[0], modes[1], modes[2], modes[3], modes[4]);
      });
  py::class_<NativePath>(m, "NativePath")
      .def(py::init([](int device, int64_t max_batch_rows, int64_t max_batch_elements, int64_t fallback_count) {
             return std::make_unique<NativePath>(
                 device, tokensampler::RequestLimits{max_batch_rows, max_batch_elements},
                 reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(fallback_count)));
           }),
           py::arg("device"), py::arg("max_batch_rows"), py::arg("max_batch_elements"), py::arg("fallback_count"))
      .def("add_region",
           [](NativePath& self, const std::string& name, int64_t base, int64_t byte_size, int64_t producer_pid,
              int64_t ready_event) {
             self.add_region(name, tokensampler::RegionMapping{static_cast<uintptr_t>(base),
                                                               static_cast<uint64_t>(byte_size),
                                                               static_cast<int32_t>(producer_pid),
                                                               static_cast<uintptr_t>(ready_event)});
           })
      .def("remove_region", &NativePath::remove_region, py::call_guard<py::gil_scoped_release>())
      // The PreparedRequest, or None: declined. Logits carried in `request` are read from its bytes when the
      // request is sampled: the caller keeps them until then.
      .def("prepare",
           [](NativePath& self, const py::bytes& request, const std::string& request_id,
              bool stream_message) -> py::object {
             char* data = nullptr;
             Py_ssize_t size = 0;
             if (PyBytes_AsStringAndSize(request.ptr(), &data, &size) != 0) throw py::error_already_set();
             auto prepared = self.prepare(std::string_view(data, static_cast<size_t>(size)), request_id, stream_message);
             if (!prepared) return py::none();
             return py::cast(std::move(prepared));
           })
      // Per request of the batch: (response, decode_ns, queue_ns, compute_ns, encode_ns, batch_rows), or None:
      // declined after all.
      .def("sample", [](NativePath& self, const std::vector<std::shared_ptr<PreparedRequest>>& batch) {
        std::vector<AnsweredRequest> answers;
        {
          py::gil_scoped_release release;
          answers = self.sample(batch);
        }
        py::list out(answers.size());
        for (size_t i = 0; i < answers.size(); ++i) {
          const AnsweredRequest& a = answers[i];
          if (a.answered)
            out[i] = py::make_tuple(py::bytes(a.response), a.decode_ns, a.queue_ns, a.compute_ns, a.encode_ns,
                                    a.batch_rows);
          else
            out[i] = py::none();
        }
        return out;
      });
}
