// The native path (native_path.h): parse -> validate -> stage -> the routes' plan, one upload and
// launches (routes.h, shared with the Python path) -> one copy back and synchronisation -> encode. Parsing,
// validation and encoding follow the Python path's rules, named where they are; any request or value outside
// them is declined, never approximated.
#include "native_path.h"

#include <signal.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "routes.h"
#include "wire.h"

namespace tokensampler {
namespace {

// sampler.proto's DType values.
constexpr uint64_t kFloat32 = 1, kBfloat16 = 2, kFloat16 = 3, kInt32 = 4;
constexpr uint64_t kMaxLogprobsMode = 2;  // LOGPROBS_MODE_PROCESSED

enum Mode { kGreedy, kGumbel, kTopK, kTopP, kMinP };  // metrics.ROW_MODES

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("tokensampler native path: ") + what + ": " + cudaGetErrorString(err));
}

void check_launch(int err, const char* what) { check(static_cast<cudaError_t>(err), what); }

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// validation/sample.py's random_seeds: the OS's cryptographic generator.
void random_words(uint64_t* out, size_t count) {
  auto* bytes = reinterpret_cast<char*>(out);
  size_t left = 8 * count;
  while (left) {
    const ssize_t got = getrandom(bytes, left, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error("tokensampler native path: getrandom failed");
    }
    bytes += got, left -= static_cast<size_t>(got);
  }
}

// A 0-, 1- or B-valued column of SamplingParams (validation/sample.py _column).
template <typename T>
struct Column {
  const std::vector<T>& values;
  bool sized(int64_t rows) const { return values.size() <= 1 || static_cast<int64_t>(values.size()) == rows; }
  bool given() const { return !values.empty(); }
  T at(int64_t row, T fallback) const { return values.empty() ? fallback : values[values.size() == 1 ? 0 : row]; }
};

bool in_uint32(uint64_t v) { return v <= 0xFFFFFFFFull; }
// An int32 field's varint: a non-negative value, or a negative one sign-extended to 64 bits.
bool in_int32(uint64_t v) { return v <= 0x7FFFFFFFull || v >= 0xFFFFFFFF80000000ull; }

}  // namespace

struct NativePath::Parsed {
  // SampleRequest.logits (Tensor, carried in the request's bytes), logits_ref (TensorRef) or logits_rows (RowsRef:
  // row_size and row_offsets, gathered)
  bool has_input = false, carried = false, gathered = false;
  std::string_view region, data;
  uint64_t offset = 0, dtype = 0, row_size = 0;
  std::vector<uint64_t> shape, row_offsets;
  // SampleRequest.params (SamplingParams): floats as their bits
  bool has_params = false;
  std::vector<uint32_t> temperature, top_p, min_p;
  std::vector<uint64_t> top_k, seed, has_seed, position, iteration;
  // the scalars
  bool has_num_samples = false;
  uint64_t num_samples = 0, return_logprobs = 0, logprobs_mode = 0, top_logprobs = 0;

  void clear() {
    has_input = carried = gathered = has_params = has_num_samples = false;
    region = data = {};
    offset = dtype = row_size = num_samples = return_logprobs = logprobs_mode = top_logprobs = 0;
    for (auto* v : {&shape, &row_offsets, &top_k, &seed, &has_seed, &position, &iteration}) v->clear();
    for (auto* v : {&temperature, &top_p, &min_p}) v->clear();
  }

  // TensorRef {region = 1, offset = 2, dtype = 3, shape = 4} and RowsRef {region = 1, dtype = 2, row_size = 3,
  // row_offsets = 4} share one wire layout: a string, two varints and a packed list.
  bool parse_reference(std::string_view bytes, uint64_t& field2, uint64_t& field3, std::vector<uint64_t>& field4) {
    wire::Reader reader(bytes);
    wire::Field f;
    while (reader.next(f)) {
      switch (f.number) {
        case 1:
          if (f.type != wire::kLengthDelimited) return false;
          region = f.bytes;
          break;
        case 2:
        case 3:
          if (f.type != wire::kVarint) return false;
          (f.number == 2 ? field2 : field3) = f.value;
          break;
        case 4:
          if (!wire::append_varints(f, field4)) return false;
          break;
        default:
          return false;
      }
    }
    return reader.ok();
  }

  // Tensor {dtype = 1, shape = 2, data = 3}; the data stays where it is, in the request's bytes.
  bool parse_tensor(std::string_view bytes) {
    wire::Reader reader(bytes);
    wire::Field f;
    while (reader.next(f)) {
      switch (f.number) {
        case 1:
          if (f.type != wire::kVarint) return false;
          dtype = f.value;
          break;
        case 2:
          if (!wire::append_varints(f, shape)) return false;
          break;
        case 3:
          if (f.type != wire::kLengthDelimited) return false;
          data = f.bytes;
          break;
        default:
          return false;
      }
    }
    return reader.ok();
  }

  bool parse_params(std::string_view bytes) {
    wire::Reader reader(bytes);
    wire::Field f;
    while (reader.next(f)) {
      bool ok = false;
      switch (f.number) {
        case 1: ok = wire::append_fixed32(f, temperature); break;
        case 2: ok = wire::append_varints(f, top_k); break;
        case 3: ok = wire::append_fixed32(f, top_p); break;
        case 4: ok = wire::append_fixed32(f, min_p); break;
        case 5: ok = wire::append_varints(f, seed); break;
        case 6: ok = wire::append_varints(f, has_seed); break;
        case 7: ok = wire::append_varints(f, position); break;
        case 8: ok = wire::append_varints(f, iteration); break;
        default: return false;  // penalties, token lists, logit bias: the Python path
      }
      if (!ok) return false;
    }
    return reader.ok();
  }

  // SampleRequest: logits, logits_ref or logits_rows, params and the scalars; any other field declines (hidden
  // states, output regions, fields this build does not know).
  bool parse(std::string_view bytes) {
    clear();
    wire::Reader reader(bytes);
    wire::Field f;
    while (reader.next(f)) {
      switch (f.number) {
        case 1:  // a message field given twice would merge, and a second oneof case replace the first: not mirrored
        case 3:
        case 10:
          if (has_input || f.type != wire::kLengthDelimited) return false;
          carried = f.number == 1, gathered = f.number == 10;
          if (!(carried    ? parse_tensor(f.bytes)
                : gathered ? parse_reference(f.bytes, dtype, row_size, row_offsets)
                           : parse_reference(f.bytes, offset, dtype, shape)))
            return false;
          has_input = true;
          break;
        case 4:
          if (has_params || f.type != wire::kLengthDelimited || !parse_params(f.bytes)) return false;
          has_params = true;
          break;
        case 5:
        case 6:
        case 7:
        case 8: {
          if (f.type != wire::kVarint) return false;
          uint64_t* scalar[] = {&num_samples, &return_logprobs, &logprobs_mode, &top_logprobs};
          *scalar[f.number - 5] = f.value;
          has_num_samples |= f.number == 5;
          break;
        }
        default:
          return false;
      }
    }
    return reader.ok() && has_input;
  }
};


namespace {

struct DeviceGuard {  // the caller's current device back on every way out
  int previous = 0;
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous); }
};

}  // namespace

NativePath::NativePath(int device, RequestLimits limits, unsigned long long* fallback_count)
    : device_(device), limits_(limits), fallback_count_(fallback_count), parsed_(std::make_unique<Parsed>()) {
  DeviceGuard guard(device_);
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
}

NativePath::~NativePath() {
  // Errors are ignored: at interpreter exit the CUDA context may be gone already.
  cudaSetDevice(device_);
  for (Buffer* b : {&dev_logits_, &dev_stage_, &dev_out_, &counters_, &hist_, &scratch_})
    if (b->ptr) retired_device_.push_back(b->ptr);
  for (Buffer* b : {&host_stage_, &host_out_})
    if (b->ptr) retired_host_.push_back(b->ptr);
  for (void* ptr : retired_device_) cudaFree(ptr);
  for (void* ptr : retired_host_) cudaFreeHost(ptr);
  if (stream_) cudaStreamDestroy(stream_);
}

void NativePath::add_region(const std::string& name, RegionMapping region) {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  regions_[name] = region;
}

void NativePath::remove_region(const std::string& name) {
  std::lock_guard<std::mutex> batch(launch_mutex_);  // a batch that found the region may still read it
  std::lock_guard<std::mutex> lock(regions_mutex_);
  regions_.erase(name);
}

void NativePath::grow_device(Buffer& buffer, size_t bytes, bool zeroed) {
  if (buffer.bytes >= bytes) return;
  const size_t size = std::max({bytes, 2 * buffer.bytes, size_t{4096}});
  if (buffer.ptr) retired_device_.push_back(buffer.ptr);
  buffer = Buffer{};
  check(cudaMalloc(&buffer.ptr, size), "cudaMalloc");
  buffer.bytes = size;
  if (zeroed) check(cudaMemsetAsync(buffer.ptr, 0, size, stream_), "cudaMemsetAsync");
}

void NativePath::grow_host(Buffer& buffer, size_t bytes) {
  if (buffer.bytes >= bytes) return;
  const size_t size = std::max({bytes, 2 * buffer.bytes, size_t{4096}});
  if (buffer.ptr) retired_host_.push_back(buffer.ptr);
  buffer = Buffer{};
  check(cudaHostAlloc(&buffer.ptr, size, cudaHostAllocDefault), "cudaHostAlloc");
  buffer.bytes = size;
}

std::shared_ptr<PreparedRequest> NativePath::prepare(std::string_view request, std::string_view request_id,
                                                      bool stream_message) {
  const int64_t started = now_ns();
  std::lock_guard<std::mutex> lock(parse_mutex_);
  Parsed& q = *parsed_;
  if (!q.parse(request)) return nullptr;
  RegionMapping mapping;  // a copy: the region may leave while the request is validated
  const RegionMapping* region = nullptr;  // none for logits carried in the request
  if (!q.carried) {
    {
      std::lock_guard<std::mutex> regions(regions_mutex_);
      const auto found = regions_.find(std::string(q.region));
      if (found == regions_.end()) return nullptr;
      mapping = found->second;
    }
    region = &mapping;
    // regions.py check_producer: a dead producer's memory must not be read
    if (region->producer_pid && kill(region->producer_pid, 0) != 0 && errno == ESRCH) return nullptr;
  }
  auto prepared = std::make_shared<PreparedRequest>();
  if (!validate(q, region, *prepared)) return nullptr;
  prepared->request_id.assign(request_id);
  prepared->stream_message = stream_message;
  prepared->started_ns = started;
  prepared->prepared_ns = now_ns();
  return prepared;
}

bool NativePath::validate(const Parsed& q, const RegionMapping* region, PreparedRequest& p) const {
  // ---- validation/sample.py: the input's shape and its bytes (tensors.py _checked), or the region reference
  // (regions.py Region.tensor, Region.rows)
  const bool gathered = q.gathered;
  if (gathered ? q.row_size > static_cast<uint64_t>(INT64_MAX) : q.shape.size() != 2) return false;
  const int64_t num_rows = static_cast<int64_t>(gathered ? q.row_offsets.size() : q.shape[0]);
  const int64_t vocab = static_cast<int64_t>(gathered ? q.row_size : q.shape[1]);
  if (num_rows < 1 || vocab < 1 || num_rows > limits_.max_batch_rows) return false;
  if (vocab > limits_.max_batch_elements / num_rows) return false;
  switch (q.dtype) {
    case kFloat32: p.dtype_code = 0, p.itemsize = 4; break;
    case kFloat16: p.dtype_code = 1, p.itemsize = 2; break;
    case kBfloat16: p.dtype_code = 2, p.itemsize = 2; break;
    default: return false;
  }
  // Limits near INT64_MAX (an operator's choice) let these products pass 64 bits, and a wrapped byte count is
  // small enough to pass every check below: such a request is declined (the Python path refuses it).
  uint64_t row_bytes = 0, logits_bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(vocab), p.itemsize, &row_bytes) ||
      __builtin_mul_overflow(static_cast<uint64_t>(num_rows), row_bytes, &logits_bytes))
    return false;
  if (q.carried) {
    if (q.data.size() != logits_bytes) return false;
  } else if (gathered) {
    for (uint64_t start : q.row_offsets)
      if (start % p.itemsize || start > region->byte_size || row_bytes > region->byte_size - start) return false;
  } else {
    if (q.offset % p.itemsize || q.offset > region->byte_size || logits_bytes > region->byte_size - q.offset)
      return false;
  }

  // ---- validation/sample.py validate_sample_request's scalars: one sample, tokens only
  if (q.has_num_samples && q.num_samples != 1) return false;
  if (q.return_logprobs || q.top_logprobs || q.logprobs_mode > kMaxLogprobsMode) return false;

  // ---- validation/sample.py validate_row_params: every column 0-, 1- or B-valued, every value in range
  const Column<uint32_t> temperature{q.temperature}, top_p{q.top_p}, min_p{q.min_p};
  const Column<uint64_t> top_k{q.top_k}, seed{q.seed}, position{q.position}, iteration{q.iteration};
  for (bool sized : {temperature.sized(num_rows), top_p.sized(num_rows), min_p.sized(num_rows), top_k.sized(num_rows),
                     seed.sized(num_rows), position.sized(num_rows), iteration.sized(num_rows)})
    if (!sized) return false;
  for (uint32_t bits : q.temperature)
    if (!(std::isfinite(float_of(bits)) && float_of(bits) >= 0.f)) return false;
  for (uint64_t k : q.top_k)
    if (!in_int32(k) || static_cast<int32_t>(static_cast<uint32_t>(k)) < -1) return false;
  for (uint32_t bits : q.top_p)
    if (!(float_of(bits) > 0.f && float_of(bits) <= 1.f)) return false;
  for (uint32_t bits : q.min_p)
    if (!(float_of(bits) >= 0.f && float_of(bits) <= 1.f)) return false;
  for (const auto* column : {&q.position, &q.iteration})
    for (uint64_t v : *column)
      if (!in_uint32(v)) return false;
  // _seeds: has_seed only beside seeds, and then one flag per row
  if (!q.has_seed.empty() && (q.seed.empty() || static_cast<int64_t>(q.has_seed.size()) != num_rows)) return false;
  for (uint64_t flag : q.has_seed)
    if (flag > 1) return false;

  // ---- where the rows are
  p.num_rows = num_rows, p.vocab = vocab, p.gathered = gathered;
  if (q.carried) {
    p.carried = q.data;
  } else {
    p.region.assign(q.region);
    p.region_base = region->base, p.region_bytes = region->byte_size;
    p.offset = q.offset;
    p.row_offsets = q.row_offsets;
  }

  // ---- validation/sample.py _seeds and the per-row columns (backends/cuda.py _Stage)
  const size_t b = static_cast<size_t>(num_rows);
#define TS_SIZE(type, name) p.name.resize(b);
  TS_ROW_PARAMS(TS_SIZE)
#undef TS_SIZE
  auto* seeds = reinterpret_cast<uint64_t*>(p.seed.data());  // the seed's bits, as the wire carries them
  if (seed.given()) {
    size_t missing = 0;
    for (size_t r = 0; r < b; ++r) {
      seeds[r] = seed.at(static_cast<int64_t>(r), 0);
      missing += !q.has_seed.empty() && !q.has_seed[r];
    }
    if (missing) {  // fresh seeds for the rows without one, in row order
      std::vector<uint64_t> fresh(missing);
      random_words(fresh.data(), missing);
      size_t next = 0;
      for (size_t r = 0; r < b; ++r)
        if (!q.has_seed[r]) seeds[r] = fresh[next++];
    }
  } else {
    random_words(seeds, b);
  }
  for (size_t r = 0; r < b; ++r) {
    const int64_t row = static_cast<int64_t>(r);
    const float t = float_of(temperature.at(row, 0x3F800000u));  // default 1.0
    int32_t k = static_cast<int32_t>(static_cast<uint32_t>(top_k.at(row, 0)));
    if (k < 0 || k >= vocab) k = 0;  // -1 and 0 disable; k >= V keeps every token
    const float top = float_of(top_p.at(row, 0x3F800000u)), floor = float_of(min_p.at(row, 0u));
    p.position[r] = static_cast<int64_t>(position.at(row, 0));
    p.iteration[r] = static_cast<int64_t>(iteration.at(row, 0));
    p.temperature[r] = t, p.top_p[r] = top, p.min_p[r] = floor, p.top_k[r] = k;
    ++p.rows_by_mode[t == 0.f ? kGreedy : k > 0 ? kTopK : top < 1.f ? kTopP : floor > 0.f ? kMinP : kGumbel];
  }
  return true;
}

std::vector<AnsweredRequest> NativePath::sample(const std::vector<std::shared_ptr<PreparedRequest>>& batch) {
  std::lock_guard<std::mutex> lock(launch_mutex_);
  if (batch.empty()) throw std::invalid_argument("tokensampler native path: an empty batch");
  std::vector<const PreparedRequest*> included;
  std::vector<AnsweredRequest> answers(batch.size());
  int64_t rows = 0;
  std::unique_lock<std::mutex> regions(regions_mutex_);
  for (size_t i = 0; i < batch.size(); ++i) {
    const PreparedRequest& p = *batch[i];
    if (p.vocab != batch[0]->vocab || p.dtype_code != batch[0]->dtype_code)
      throw std::invalid_argument("tokensampler native path: a batch of more than one vocabulary or dtype");
    if (!p.region.empty()) {  // regions.py: a request after the region's unregister finds it gone
      const auto found = regions_.find(p.region);
      const bool same = found != regions_.end() && found->second.base == p.region_base &&
                        found->second.byte_size == p.region_bytes;
      if (!same) continue;
    }
    answers[i].answered = true;  // until its rows say otherwise
    included.push_back(&p);
    rows += p.num_rows;
  }
  regions.unlock();
  if (rows > limits_.max_batch_rows || rows > limits_.max_batch_elements / batch[0]->vocab)
    throw std::invalid_argument("tokensampler native path: a batch past the limits");
  if (!rows) return answers;
  const int64_t launched = now_ns();
  {
    DeviceGuard guard(device_);
    try {
      launch_rows(included, rows);
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");  // the one synchronisation
    } catch (...) {
      cudaStreamSynchronize(stream_);  // no copy from the reused pinned buffers may outlive a failed batch
      throw;
    }
  }
  const int64_t computed = now_ns();
  const size_t b = static_cast<size_t>(rows);
  const auto* tokens = static_cast<const int64_t*>(host_out_.ptr);
  const auto* flags = static_cast<const uint8_t*>(host_out_.ptr) + 8 * b;
  for (size_t i = 0, row = 0; i < batch.size(); ++i) {
    AnsweredRequest& a = answers[i];
    if (!a.answered) continue;
    const PreparedRequest& p = *batch[i];
    const size_t n = static_cast<size_t>(p.num_rows);
    // a row for the exact filter: the Python path has the request (backends/cuda.py samples it again)
    a.answered = std::none_of(flags + row, flags + row + n, [](uint8_t f) { return (f & TS_ROW_UNSETTLED) != 0; });
    if (a.answered) {
      a.response = encode(p, tokens + row, flags + row, launched, computed);
      a.decode_ns = p.prepared_ns - p.started_ns;
      a.queue_ns = launched - p.prepared_ns;
      a.compute_ns = computed - launched;
      a.encode_ns = now_ns() - computed;  // this request's encoding, and those before it in the batch
      a.batch_rows = rows;
    }
    row += n;
  }
  return answers;
}

void NativePath::launch_rows(const std::vector<const PreparedRequest*>& requests, int64_t num_rows) {
  const PreparedRequest& first = *requests.front();
  const int64_t vocab = first.vocab;
  const uint64_t itemsize = first.itemsize, row_bytes = static_cast<uint64_t>(vocab) * itemsize;
  const size_t b = static_cast<size_t>(num_rows);
  // Rows of more than one request, or gathered rows, are found through per-row starts.
  const bool per_row_start = requests.size() > 1 || first.gathered;

  // ---- the producers' writes before this batch, without a host wait
  for (const PreparedRequest* p : requests) {
    if (p->region.empty()) continue;
    const uintptr_t event = regions_.at(p->region).ready_event;
    if (event) check(cudaStreamWaitEvent(stream_, reinterpret_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent");
  }

  // ---- the rows' parameters (and starts) in the stage (routes.h ts_stage_layout); carried logits one after the
  // other in dev_logits_
  size_t carried_bytes = 0;
  for (const PreparedRequest* p : requests) carried_bytes += align16(p->carried.size());
  if (carried_bytes) grow_device(dev_logits_, carried_bytes, false);
  const TsStageLayout layout = ts_stage_layout(num_rows);
  grow_host(host_stage_, layout.bitmask_row);
  grow_device(dev_stage_, layout.bitmask_row, false);
  char* host = static_cast<char*>(host_stage_.ptr);
  auto* row_start = per_row_start ? reinterpret_cast<int64_t*>(host + layout.row_start) : nullptr;
  uintptr_t first_row = 0;  // the address TsLogits.data holds; rows start past it (or before it) by row_start
  size_t row = 0, carried_at = 0;
  for (const PreparedRequest* p : requests) {
    uintptr_t rows_at;  // row 0 of a contiguous request; the region's base for gathered rows
    if (!p->carried.empty()) {
      rows_at = reinterpret_cast<uintptr_t>(dev_logits_.ptr) + carried_at;
      check(cudaMemcpyAsync(reinterpret_cast<void*>(rows_at), p->carried.data(), p->carried.size(),
                            cudaMemcpyHostToDevice, stream_),
            "logits upload");  // from pageable memory: returns once the driver has staged the bytes
      carried_at += align16(p->carried.size());
    } else {
      rows_at = p->region_base + (p->gathered ? 0 : p->offset);
    }
    for (size_t r = 0; r < static_cast<size_t>(p->num_rows); ++r, ++row) {
      const uintptr_t at = p->gathered ? rows_at + p->row_offsets[r] : rows_at + r * row_bytes;
      if (row == 0) first_row = at;
      // every address is a multiple of the item size (validate(), align16), so the difference divides
      if (row_start) row_start[row] = static_cast<int64_t>(at - first_row) / static_cast<int64_t>(itemsize);
#define TS_STAGE(type, name) reinterpret_cast<type*>(host + layout.name)[row] = p->name[r];
      TS_ROW_PARAMS(TS_STAGE)
#undef TS_STAGE
    }
  }

  // ---- the routes (routes.h): the rows grouped, the stage up in one copy
  TsPlan plan;
  check_launch(ts_plan(host, num_rows, vocab, 1, TS_TOKENS, 0, TS_ROUTES_FAST, &plan), "plan");
  const size_t upload = per_row_start ? layout.bitmask_row : layout.lists + 4 * static_cast<size_t>(plan.lists_used);
  char* dev = static_cast<char*>(dev_stage_.ptr);
  check(cudaMemcpyAsync(dev, host, upload, cudaMemcpyHostToDevice, stream_), "upload");

  // ---- the outputs: tokens and flags first (what comes back), then the exact group's inputs and scratch
  size_t end = 9 * b;
  auto field = [&](size_t bytes_per_row) {
    const size_t at = align16(end);
    end = at + bytes_per_row * b;
    return at;
  };
  const size_t main_row_max = field(4), main_row_min = field(4), main_row_logz = field(4), row_max = field(4),
               row_min = field(4), pre_tokens = field(8), kept_min_key = field(8), kept_mass = field(4),
               pre_flags = field(1), exact_bits = field(1);
  grow_device(dev_out_, end, false);
  grow_host(host_out_, 9 * b);
  const TsWorkspaceBytes need = ts_plan_workspace(&plan);
  grow_device(counters_, std::max(need.counters, size_t{4}), true);
  if (need.hist) grow_device(hist_, need.hist, true);
  grow_device(scratch_, std::max(need.scratch, size_t{1}), false);

  // ---- every launch of the plan, each group writing the same tokens and flags
  char* out = static_cast<char*>(dev_out_.ptr);
  auto* tokens = reinterpret_cast<int64_t*>(out);
  auto* flags = reinterpret_cast<uint8_t*>(out + 8 * b);
  auto f32 = [&](size_t at) { return reinterpret_cast<float*>(out + at); };
  const TsCallInputs in{
      TsLogits{reinterpret_cast<const void*>(first_row), num_rows, vocab, first.dtype_code,
               row_start ? reinterpret_cast<const int64_t*>(dev + layout.row_start) : nullptr},
      TsBitmask{}, nullptr, TsLogits{}, nullptr};
  const TsCallOutputs outputs{
      TsOutputs{tokens, 1, 0, flags, f32(main_row_max), f32(main_row_min), f32(main_row_logz), nullptr, nullptr},
      TsOutputs{tokens, 1, 0, flags, f32(row_max), nullptr, nullptr, f32(kept_mass),
                reinterpret_cast<int64_t*>(out + kept_min_key)},
      TsOutputs{reinterpret_cast<int64_t*>(out + pre_tokens), 1, 0, reinterpret_cast<uint8_t*>(out + pre_flags),
                f32(row_max), f32(row_min), nullptr, nullptr, nullptr},
      TsOutputs{}, reinterpret_cast<uint8_t*>(out + exact_bits)};
  const TsWorkspace ws{static_cast<unsigned int*>(counters_.ptr), hist_.ptr, scratch_.ptr, fallback_count_};
  check_launch(ts_launch_plan(&plan, &in, dev, &outputs, &ws, stream_), "launch");
  // Tokens and flags back in one copy.
  check(cudaMemcpyAsync(host_out_.ptr, out, 9 * b, cudaMemcpyDeviceToHost, stream_), "download");
}

// sample_rpc.py encode_result + finish: the SampleResponse (in a SampleStreamResponse for a stream message).
std::string NativePath::encode(const PreparedRequest& p, const int64_t* tokens, const uint8_t* flags,
                                int64_t launched_ns, int64_t computed_ns) const {
  const size_t b = static_cast<size_t>(p.num_rows);
  std::vector<int32_t> token_ids(b);
  std::vector<uint8_t> valid(b), nan(b);
  for (size_t r = 0; r < b; ++r) {
    valid[r] = !(flags[r] & TS_ROW_INVALID);
    nan[r] = (flags[r] & TS_ROW_NAN) != 0;
    token_ids[r] = valid[r] ? static_cast<int32_t>(tokens[r]) : -1;
  }
  wire::Writer tensor;
  tensor.uint_field(1, kInt32);
  const int64_t shape[2] = {p.num_rows, 1};
  tensor.packed_varints(2, shape, 2);
  tensor.bytes_field(3, token_ids.data(), 4 * b);
  wire::Writer response;
  response.reserve(4 * b + 12 * b + 64 + p.request_id.size());
  response.message_field(1, tensor);
  response.packed_varints(2, p.seed.data(), b);
  response.packed_varints(6, valid.data(), b);
  response.packed_varints(7, nan.data(), b);
  wire::Writer timings;
  timings.uint_field(1, static_cast<uint64_t>(launched_ns - p.prepared_ns));
  timings.uint_field(2, static_cast<uint64_t>(computed_ns - launched_ns));
  timings.uint_field(3, static_cast<uint64_t>(now_ns() - p.started_ns));
  response.message_field(8, timings);
  response.bytes_field(9, p.request_id.data(), p.request_id.size());
  if (!p.stream_message) return response.bytes();
  wire::Writer message;
  message.message_field(1, response);
  return message.bytes();
}

}  // namespace tokensampler
