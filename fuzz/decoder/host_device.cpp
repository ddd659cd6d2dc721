// The sanitizer build's stand-ins for the CUDA runtime (cuda_runtime.h here) and for the launchers of
// csrc/sampling.h. Each launcher checks, before it writes an answer, that everything the real kernel would read
// or write lies inside a block the native path allocated or a region registered with it: the logits of every
// work row, the per-row columns, the row lists, the outputs, the workspace. A row outside its region is the
// worst a decoding or validation bug can do on the GPU (a read of another allocation), and on the GPU no
// sanitizer sees it; here fail() stops the run on it.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "host_device.h"
#include "sampling.h"

namespace fuzz {
namespace {

std::map<uintptr_t, size_t>& blocks() {
  static std::map<uintptr_t, size_t> tracked;
  return tracked;
}

uint64_t bytes_of(uint64_t count, uint64_t size, const char* what) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, size, &bytes)) fail(what);
  return bytes;
}

void need(const void* p, uint64_t count, uint64_t size, const char* what) {
  if (!p || !inside(p, bytes_of(count, size, what))) fail(what);
}

size_t itemsize_of(int32_t dtype) {
  switch (dtype) {
    case 0: return 4;
    case 1:
    case 2: return 2;
    default: fail("TsLogits.dtype is not 0, 1 or 2");
  }
}

constexpr uint8_t kFlagCpu = 4;

// The native path draws one sample a row: a Gumbel-max launch of one grid layer.
void one_draw(int32_t num_draws) {
  if (num_draws != 1) fail("a Gumbel-max launch of more than one sample");
}

// One stand-in launch over a work list: every read checked, then a token and flags for each work row. The
// answer comes from the row's first byte, so that a fuzzed input reaches both the answered and the declined
// (kFlagCpu) ends of NativePath::sample. `draws`: the launch writes tokens and flags (ts_cut writes neither).
void run(const TsLogits* l, const TsRows* r, const TsOutputs* out, const TsWorkspace* ws, size_t scratch_bytes,
         bool draws = true) {
  if (l->num_rows < 1 || l->vocab < 1) fail("TsLogits without rows or tokens");
  if (r->num_work_rows < 1 || r->num_work_rows > l->num_rows) fail("TsRows.num_work_rows outside [1, num_rows]");
  const uint64_t rows = static_cast<uint64_t>(l->num_rows), n = static_cast<uint64_t>(r->num_work_rows);
  const size_t itemsize = itemsize_of(l->dtype);
  need(r->temperature, rows, 4, "TsRows.temperature");
  need(r->top_k, rows, 4, "TsRows.top_k");
  need(r->top_p, rows, 4, "TsRows.top_p");
  need(r->min_p, rows, 4, "TsRows.min_p");
  need(r->seed, rows, 8, "TsRows.seed");
  need(r->position, rows, 8, "TsRows.position");
  need(r->iteration, rows, 8, "TsRows.iteration");
  if (r->rows) need(r->rows, n, 4, "TsRows.rows");
  if (l->row_start) need(l->row_start, rows, 8, "TsLogits.row_start");
  need(ws->counters, n, 4, "TsWorkspace.counters");
  need(ws->scratch, scratch_bytes, 1, "TsWorkspace.scratch");
  if (draws) {
    if (out->num_samples != 1 || out->sample != 0) fail("TsOutputs: more than one sample");
    need(out->tokens, rows, 8, "TsOutputs.tokens");
    need(out->flags, rows, 1, "TsOutputs.flags");
  }
  for (float* column : {out->row_max, out->row_min, out->row_logz, out->kept_mass})
    if (column) need(column, rows, 4, "TsOutputs' per-row floats");
  if (out->kept_min_key) need(out->kept_min_key, rows, 8, "TsOutputs.kept_min_key");
  const uint64_t row_bytes = bytes_of(static_cast<uint64_t>(l->vocab), itemsize, "a row's bytes overflow");
  for (uint64_t i = 0; i < n; ++i) {
    const int64_t row = r->rows ? r->rows[i] : static_cast<int64_t>(i);
    if (row < 0 || static_cast<uint64_t>(row) >= rows) fail("TsRows.rows holds a row outside [0, num_rows)");
    const __int128 element = l->row_start ? static_cast<__int128>(l->row_start[row])
                                          : static_cast<__int128>(row) * l->vocab;
    const __int128 at = static_cast<__int128>(reinterpret_cast<uintptr_t>(l->data)) + element * itemsize;
    if (at <= 0 || at > static_cast<__int128>(UINTPTR_MAX)) fail("a row's address outside the address space");
    const auto* logits = reinterpret_cast<const volatile uint8_t*>(static_cast<uintptr_t>(at));
    if (!inside(const_cast<const uint8_t*>(logits), row_bytes)) fail("a row's logits outside every region and buffer");
    const uint8_t first = logits[0];
    (void)logits[row_bytes - 1];  // both ends read, for AddressSanitizer too
    if (draws) {
      out->tokens[row] = first % l->vocab;
      out->flags[row] = first == 0xC4 ? kFlagCpu : first & 3;
    }
    for (float* column : {out->row_max, out->row_min, out->row_logz, out->kept_mass})
      if (column) column[row] = 0.f;
    if (out->kept_min_key) out->kept_min_key[row] = 0;
  }
}

}  // namespace

void track(const void* base, size_t bytes) { blocks()[reinterpret_cast<uintptr_t>(base)] = bytes; }

void untrack(const void* base) {
  if (!blocks().erase(reinterpret_cast<uintptr_t>(base))) fail("a free of a block never allocated");
}

bool inside(const void* p, size_t bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  auto next = blocks().upper_bound(at);
  if (next == blocks().begin()) return false;
  const auto& [base, size] = *--next;
  return at - base <= size && bytes <= size - (at - base);
}

void fail(const char* what) {
  std::fprintf(stderr, "==fuzz== native path invariant broken: %s\n", what);
  std::abort();
}

}  // namespace fuzz

// ---- the CUDA runtime, on the heap
namespace {
char stream_token;
constexpr size_t kMostBytes = size_t{1} << 32;  // a larger request than any fuzzed input can make: a failure
}  // namespace

const char* cudaGetErrorString(cudaError_t err) { return err == cudaSuccess ? "no error" : "out of memory"; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = reinterpret_cast<cudaStream_t>(&stream_token);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (bytes > kMostBytes) return cudaErrorMemoryAllocation;
  *ptr = std::malloc(bytes ? bytes : 1);
  if (!*ptr) return cudaErrorMemoryAllocation;
  fuzz::track(*ptr, bytes);
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  fuzz::untrack(ptr);
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int) { return cudaMalloc(ptr, bytes); }
cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  if (!fuzz::inside(ptr, bytes)) fuzz::fail("cudaMemsetAsync outside its buffer");
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  // a host source may be any host memory (the request's own bytes): AddressSanitizer checks that read
  if (!fuzz::inside(dst, bytes) || (kind == cudaMemcpyDeviceToHost && !fuzz::inside(src, bytes)))
    fuzz::fail("cudaMemcpyAsync outside its buffers");
  if (bytes) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

// ---- the launchers native_path.cpp calls, with scratch sizes of the same shape as the real ones
size_t ts_stats_scratch_bytes(int32_t n, int64_t) { return 16 * static_cast<size_t>(n); }
size_t ts_gumbel_scratch_bytes(int32_t n, int64_t) { return 24 * static_cast<size_t>(n); }
size_t ts_topk_scratch_bytes(int32_t n, int64_t, int32_t bucket) {
  return 8 * static_cast<size_t>(n) * static_cast<size_t>(bucket);
}
size_t ts_nucleus_scratch_bytes(int32_t n, int64_t) { return 32 * static_cast<size_t>(n); }
size_t ts_hist_bytes(int32_t n) { return 256 * static_cast<size_t>(n); }
int ts_num_splits(int64_t vocab) { return static_cast<int>((vocab + 8191) / 8192); }
int ts_topk_bucket(int32_t k) {
  for (int bucket : {16, 32, 64, 128, 256})
    if (k + 1 <= bucket) return bucket;
  return 0;
}

int ts_or_flags(uint8_t* dst, const uint8_t* src, int64_t n, uint8_t bits, void*) {
  fuzz::need(dst, static_cast<uint64_t>(n), 1, "ts_or_flags dst");
  fuzz::need(src, static_cast<uint64_t>(n), 1, "ts_or_flags src");
  for (int64_t i = 0; i < n; ++i) dst[i] |= src[i] & bits;
  return 0;
}

int ts_stats(const TsLogits* l, const TsRows* r, const float*, const TsOutputs* out, const TsWorkspace* ws, void*) {
  fuzz::run(l, r, out, ws, ts_stats_scratch_bytes(r->num_work_rows, l->vocab));
  return 0;
}
int ts_stats_flagged(const TsLogits* l, const TsRows* r, const uint8_t* flagged, const TsOutputs* out,
                     const TsWorkspace* ws, void*) {
  fuzz::need(flagged, static_cast<uint64_t>(l->num_rows), 1, "ts_stats_flagged flagged");
  fuzz::run(l, r, out, ws, ts_stats_scratch_bytes(r->num_work_rows, l->vocab));
  return 0;
}

int ts_gumbel(const TsLogits* l, const TsRows* r, const float*, int32_t num_draws, const TsOutputs* out,
              const TsWorkspace* ws, void*) {
  fuzz::one_draw(num_draws);
  fuzz::run(l, r, out, ws, ts_gumbel_scratch_bytes(r->num_work_rows, l->vocab));
  return 0;
}
int ts_min_p(const TsLogits* l, const TsRows* r, const float* row_max, int32_t num_draws, const TsOutputs* out,
             const TsWorkspace* ws, void*) {
  fuzz::one_draw(num_draws);
  fuzz::need(row_max, static_cast<uint64_t>(l->num_rows), 4, "ts_min_p row_max");
  fuzz::run(l, r, out, ws, ts_gumbel_scratch_bytes(r->num_work_rows, l->vocab));
  return 0;
}
int ts_topk(const TsLogits* l, const TsRows* r, int32_t bucket, const TsOutputs* out, const TsWorkspace* ws, void*) {
  fuzz::run(l, r, out, ws, ts_topk_scratch_bytes(r->num_work_rows, l->vocab, bucket));
  return 0;
}
namespace {
// What ts_filter and ts_cut (`launcher`, named in the failure) read beside the rows.
void need_filter_inputs(const char* launcher, const TsLogits* l, const TsRows* r, const float* row_max,
                        const float* row_min, const int64_t* row_argmax, const uint8_t* stats_flags, int32_t splits,
                        const TsWorkspace* ws) {
  const uint64_t rows = static_cast<uint64_t>(l->num_rows);
  auto named = [launcher](const char* what) { return std::string(launcher) + " " + what; };
  fuzz::need(row_max, rows, 4, named("row_max").c_str());
  fuzz::need(row_min, rows, 4, named("row_min").c_str());
  fuzz::need(row_argmax, rows, 8, named("row_argmax").c_str());
  fuzz::need(stats_flags, rows, 1, named("stats_flags").c_str());
  if (splits < 1 || splits > 64) fuzz::fail(named("splits outside [1, 64]").c_str());
  if (splits > 1) fuzz::need(ws->hist, ts_hist_bytes(r->num_work_rows), 1, "TsWorkspace.hist");
}
}  // namespace

int ts_filter(const TsLogits* l, const TsRows* r, const float* row_max, const float* row_min,
              const int64_t* row_argmax, const uint8_t* stats_flags, int32_t, int32_t splits, const TsOutputs* out,
              const TsWorkspace* ws, void*) {
  need_filter_inputs("ts_filter", l, r, row_max, row_min, row_argmax, stats_flags, splits, ws);
  fuzz::run(l, r, out, ws, 0);
  return 0;
}
int ts_cut(const TsLogits* l, const TsRows* r, const float* row_max, const float* row_min, const int64_t* row_argmax,
           const uint8_t* stats_flags, int32_t splits, int64_t* kept_keys, const TsWorkspace* ws, void*) {
  need_filter_inputs("ts_cut", l, r, row_max, row_min, row_argmax, stats_flags, splits, ws);
  TsOutputs out{};
  out.kept_min_key = kept_keys;
  fuzz::need(kept_keys, static_cast<uint64_t>(l->num_rows), 8, "ts_cut kept_keys");
  fuzz::run(l, r, &out, ws, 0, false);
  return 0;
}
int ts_sample_kept(const TsLogits* l, const TsRows* r, const float* row_max, const int64_t* kept_keys,
                   int32_t num_draws, const TsOutputs* out, const TsWorkspace* ws, void*) {
  fuzz::one_draw(num_draws);
  fuzz::need(row_max, static_cast<uint64_t>(l->num_rows), 4, "ts_sample_kept row_max");
  fuzz::need(kept_keys, static_cast<uint64_t>(l->num_rows), 8, "ts_sample_kept kept_keys");
  fuzz::run(l, r, out, ws, ts_gumbel_scratch_bytes(r->num_work_rows, l->vocab));
  return 0;
}
int ts_nucleus(const TsLogits* l, const TsRows* r, const TsOutputs* pre, const TsOutputs* out, const TsWorkspace* ws,
               void*) {
  const size_t scratch = ts_nucleus_scratch_bytes(r->num_work_rows, l->vocab);
  fuzz::run(l, r, pre, ws, scratch);
  fuzz::run(l, r, out, ws, scratch);
  return 0;
}
