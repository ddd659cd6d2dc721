// The torch-extension binding of the native request path (request_path.h): bytes in, bytes out, the
// GIL released for the whole request (parse to response), since nothing there touches Python.
#include <torch/extension.h>

#include <memory>
#include <string>

#include "request_path.h"

namespace py = pybind11;

void register_request_path(py::module_& m) {
  using tokensampler::AnsweredRequest;
  using tokensampler::RequestPath;
  py::class_<RequestPath>(m, "RequestPath")
      .def(py::init([](int device, int64_t max_batch_rows, int64_t max_batch_elements, int64_t fallback_count) {
             return std::make_unique<RequestPath>(
                 device, tokensampler::RequestLimits{max_batch_rows, max_batch_elements},
                 reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(fallback_count)));
           }),
           py::arg("device"), py::arg("max_batch_rows"), py::arg("max_batch_elements"), py::arg("fallback_count"))
      .def("add_region",
           [](RequestPath& self, const std::string& name, int64_t base, int64_t byte_size, int64_t producer_pid,
              int64_t ready_event) {
             self.add_region(name, tokensampler::RegionMapping{static_cast<uintptr_t>(base),
                                                               static_cast<uint64_t>(byte_size),
                                                               static_cast<int32_t>(producer_pid),
                                                               static_cast<uintptr_t>(ready_event)});
           })
      .def("remove_region",
           [](RequestPath& self, const std::string& name) {
             py::gil_scoped_release release;  // waits for a request in flight
             self.remove_region(name);
           })
      // (response, rows, decode_ns, compute_ns, encode_ns, rows by mode) or None: declined.
      .def("sample", [](RequestPath& self, const py::bytes& request, const std::string& request_id,
                        bool stream_message) -> py::object {
        char* data = nullptr;
        Py_ssize_t size = 0;
        if (PyBytes_AsStringAndSize(request.ptr(), &data, &size) != 0) throw py::error_already_set();
        AnsweredRequest answer;
        bool answered = false;
        {
          py::gil_scoped_release release;
          answered = self.sample(std::string_view(data, static_cast<size_t>(size)), request_id, stream_message, answer);
        }
        if (!answered) return py::none();
        const int64_t* modes = answer.rows_by_mode;
        return py::make_tuple(py::bytes(answer.response), answer.num_rows, answer.decode_ns, answer.compute_ns,
                              answer.encode_ns, py::make_tuple(modes[0], modes[1], modes[2], modes[3], modes[4]));
      });
}
