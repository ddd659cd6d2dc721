// The native path of the CUDA backend: a SampleRequest whose logits lie in a CUDA region or
// are carried in its own bytes, and that asks for tokens alone (no log-probs, no logit processing, no output
// regions, one sample) is parsed, validated, planned, launched and answered here, without a Python line
// between the request's bytes and the response's. The server's Python path (sample_rpc.py) answers every
// other request and every error: prepare() declines (returns null) whatever it does not take, before anything
// a client could see has happened, and the Python path then takes the request as if this one did not exist.
// It decodes and validates by validation/sample.py's rules (tests/gpu/test_native_path.py holds the two paths to
// the same answers) and samples through the routes of routes.h, the planner and launcher the CUDA backend uses.
// Why it exists, and what it measured: docs/design/service-path.md.
//
// A request is prepared (parsed and validated) as it arrives; prepared requests of one vocabulary and dtype are
// sampled together as one batch (their rows merged, each row's logits found through a per-row start), and
// each gets its own answer. Batch invariance (docs/semantics.md) makes a request's tokens the same alone or
// merged. native_path.py decides what to merge and when.
//
// Plain C++ and the CUDA runtime, no torch: bindings_native_path.cpp is the thin binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "sampling.h"

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

// A validated request waiting for its launch: its rows' parameters (seeds drawn) and where its logits are.
struct PreparedRequest {
  std::string request_id;
  bool stream_message = false;
  std::string region;        // empty: the logits are carried in the request
  uintptr_t region_base = 0;  // the region's mapping when the request was prepared, which bounded its rows
  uint64_t region_bytes = 0;
  std::string_view carried;  // carried logits: a view of the request's bytes, which the caller keeps alive
                             // until it is sampled
  bool gathered = false;
  uint64_t offset = 0;                // contiguous rows: the first row's byte offset in the region
  std::vector<uint64_t> row_offsets;  // gathered rows: each row's byte offset in the region
  int64_t num_rows = 0, vocab = 0;
  int32_t dtype_code = 0;  // sampling.h TsLogits.dtype
  uint32_t itemsize = 0;
  // The rows' parameters (sampling.h TS_ROW_PARAMS): seeds drawn for the rows without one (their bits, as uint64 on
  // the wire), temperature as given (0 in greedy rows), top_k 0 where off (-1, 0 and k >= vocab).
#define TS_ROW_VECTOR(type, name) std::vector<type> name;
  TS_ROW_PARAMS(TS_ROW_VECTOR)
#undef TS_ROW_VECTOR
  int64_t rows_by_mode[5] = {};  // greedy, gumbel, top_k, top_p, min_p: metrics.ROW_MODES' order
  int64_t started_ns = 0, prepared_ns = 0;
};

// A sampled request's answer: the serialized response and what the server's metrics record of it.
struct AnsweredRequest {
  bool answered = false;  // false: declined after all (a row for the CPU reference, its region gone)
  std::string response;   // SampleResponse, or SampleStreamResponse for a stream message
  int64_t decode_ns = 0;   // parse and validation
  int64_t queue_ns = 0;    // prepared to sampled
  int64_t compute_ns = 0;  // staging, upload, launches, results back
  int64_t encode_ns = 0;
  int64_t batch_rows = 0;  // rows of the batch it was part of
};

class NativePath {
 public:
  // fallback_count: the backend's in-kernel fallback counter (device memory), shared.
  NativePath(int device, RequestLimits limits, unsigned long long* fallback_count);
  ~NativePath();
  NativePath(const NativePath&) = delete;
  NativePath& operator=(const NativePath&) = delete;

  void add_region(const std::string& name, RegionMapping region);
  void remove_region(const std::string& name);  // waits for a batch being sampled

  // The request (serialized SampleRequest bytes) parsed and validated, or null: declined.
  std::shared_ptr<PreparedRequest> prepare(std::string_view request, std::string_view request_id,
                                           bool stream_message);
  // Samples `batch` (prepared requests of one vocabulary and dtype, their rows together within the limits) in
  // one set of launches and one synchronisation, and answers its requests in order. A request whose region
  // went since it was prepared is left out and declined.
  std::vector<AnsweredRequest> sample(const std::vector<std::shared_ptr<PreparedRequest>>& batch);

  struct Parsed;  // the request's fields, reused from call to call (native_path.cpp)

 private:
  struct Buffer {  // grown on demand, never shrunk
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  void grow_device(Buffer& buffer, size_t bytes, bool zeroed);
  void grow_host(Buffer& buffer, size_t bytes);
  bool validate(const Parsed& q, const RegionMapping* region, PreparedRequest& prepared) const;
  void launch_rows(const std::vector<const PreparedRequest*>& requests, int64_t rows);
  std::string encode(const PreparedRequest& request, const int64_t* tokens, const uint8_t* flags, int64_t launched_ns,
                     int64_t computed_ns) const;

  int device_;
  RequestLimits limits_;
  unsigned long long* fallback_count_;
  cudaStream_t stream_ = nullptr;
  // A prepare never waits for a batch: it runs on the server's event loop, and a batch can wait on the GPU for
  // as long as another stream of the context holds it (a colocated loop waiting on its engine).
  std::mutex launch_mutex_;   // one batch at a time on stream_ and the buffers; a region leaves between batches
  std::mutex parse_mutex_;    // parsed_
  std::mutex regions_mutex_;  // regions_, held for a lookup or a change only
  std::unordered_map<std::string, RegionMapping> regions_;
  std::unique_ptr<Parsed> parsed_;
  // Buffers outgrown, freed with the path: cudaFree and cudaFreeHost wait for every stream of the device, a
  // colocated loop's included. Growth doubles, so these hold less than the live buffers.
  std::vector<void*> retired_device_, retired_host_;
  Buffer dev_logits_;  // carried logits, uploaded (as large as the largest such batch so far)
  Buffer host_stage_, dev_stage_, host_out_, dev_out_, counters_, hist_, scratch_;
};

}  // namespace tokensampler
