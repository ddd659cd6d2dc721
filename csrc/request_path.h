// The native request path of the CUDA backend (issue 5): a SampleRequest whose logits lie in a CUDA region or
// are carried in its own bytes, and that asks for tokens alone (no log-probs, no logit processing, no output
// regions, one sample) is parsed, validated, planned, launched and answered here, without a Python line
// between the request's bytes and the response's. The server's Python path (sample_rpc.py) answers every
// other request and every error: sample() declines (returns false) whatever it does not take, before anything
// a client could see has happened, and the Python path then takes the request as if this one did not exist.
// The rules it applies are validation.py's and backends/cuda.py's, mirrored: tests/gpu/test_request_path.py
// holds the two paths to the same answers.
//
// Plain C++ and the CUDA runtime, no torch: bindings_request_path.cpp is the thin binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tokensampler {

struct RequestLimits {
  int64_t max_batch_rows;
  int64_t max_batch_elements;
};

// A CUDA region of this process's device (regions.py opened its IPC handle).
struct RegionMapping {
  uintptr_t base;
  uint64_t byte_size;
  int32_t producer_pid;  // 0: unknown
  uintptr_t ready_event;  // the producer's interprocess cudaEvent_t, recorded after each write; 0: none
};

// An answered request: the serialized response and what the server's metrics record of it.
struct AnsweredRequest {
  std::string response;  // SampleResponse, or SampleStreamResponse for a stream message
  int64_t num_rows = 0;
  int64_t decode_ns = 0;   // parse, validation, plan and upload staging
  int64_t compute_ns = 0;  // upload, launches, results back (the one synchronisation)
  int64_t encode_ns = 0;
  int64_t rows_by_mode[5] = {};  // greedy, gumbel, top_k, top_p, min_p: metrics.ROW_MODES' order
};

class RequestPath {
 public:
  // fallback_count: the backend's in-kernel fallback counter (device memory), shared.
  RequestPath(int device, RequestLimits limits, unsigned long long* fallback_count);
  ~RequestPath();
  RequestPath(const RequestPath&) = delete;
  RequestPath& operator=(const RequestPath&) = delete;

  void add_region(const std::string& name, RegionMapping region);
  void remove_region(const std::string& name);  // waits for a request using it

  // Answers `request` (serialized SampleRequest bytes) into `answer`, or returns false.
  bool sample(std::string_view request, std::string_view request_id, bool stream_message, AnsweredRequest& answer);

  struct Parsed;  // the request's fields, reused from call to call (request_path.cpp)

 private:
  struct Buffer {  // grown on demand, never shrunk
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  void grow_device(Buffer& buffer, size_t bytes, bool zeroed);
  void grow_host(Buffer& buffer, size_t bytes);
  bool answer(Parsed& request, const RegionMapping* region, std::string_view request_id, bool stream_message,
              int64_t started_ns, AnsweredRequest& answer);

  int device_;
  RequestLimits limits_;
  unsigned long long* fallback_count_;
  cudaStream_t stream_ = nullptr;
  std::mutex mutex_;  // one request at a time; regions change between requests only
  std::unordered_map<std::string, RegionMapping> regions_;
  std::unique_ptr<Parsed> parsed_;
  Buffer dev_logits_;  // carried logits, uploaded (as large as the largest such request so far)
  Buffer host_stage_, dev_stage_, host_out_, dev_out_, counters_, hist_, scratch_;
};

}  // namespace tokensampler
