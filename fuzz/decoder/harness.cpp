// The fuzz target of the native path: one input is the bytes of a SampleRequest as a client sends them.
// Each input goes through
//   1. wire.h alone: every field of the message and of its nested messages read, each payload a view inside its
//      parent, each repeated run's count bounded by its bytes, and varint and length-delimited fields written back
//      by wire::Writer and read again unchanged;
//   2. NativePath::prepare (csrc/native_path.cpp, compiled unchanged) under three sets of limits (the server's
//      defaults, small ones, and none at all, as an operator may configure); a request it takes must satisfy the
//      invariants below, computed in 128 bits so that no overflow can hide a violation;
//   3. NativePath::sample of the prepared request, alone, then merged with a second copy of itself between a
//      carried and a gathered one-row request, through the stand-in device of host_device.cpp (every row's logits
//      checked inside its region or buffer), and each response read back.
// Any sanitizer report, or fuzz::fail on a broken invariant, aborts: the input is a bug.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "host_device.h"
#include "native_path.h"
#include "wire.h"

namespace {

using tokensampler::PreparedRequest;
using tokensampler::RequestLimits;
using tokensampler::NativePath;
using u128 = unsigned __int128;

// The regions a request may name (make_seeds.py names the same): sizes of a few rows, one not a multiple of any
// item size, and one large enough for the seeds' largest contiguous request.
struct Region {
  const char* name;
  uint64_t bytes;
  uintptr_t ready_event;  // never waited on by the stand-in: non-zero only to take that branch
};
constexpr Region kRegions[] = {{"a", 4096, 0}, {"odd", 4099, 1}, {"big", 1 << 16, 0}};

const Region* region_named(std::string_view name) {
  for (const Region& r : kRegions)
    if (name == r.name) return &r;
  return nullptr;
}

struct Path {
  RequestLimits limits;
  std::unique_ptr<NativePath> path;
  std::vector<std::unique_ptr<uint8_t[]>> regions;  // each region's memory, as this path knows it
};

std::vector<Path>& paths() {
  static std::vector<Path> all = [] {
    std::vector<Path> made;
    for (RequestLimits limits : {RequestLimits{4096, 4096LL * 262144}, RequestLimits{8, 256},
                                 RequestLimits{INT64_MAX, INT64_MAX}}) {
      Path p{limits, std::make_unique<NativePath>(0, limits, nullptr), {}};
      for (const Region& r : kRegions) {
        // exactly the region's size: AddressSanitizer's redzone starts at its last byte
        p.regions.push_back(std::make_unique<uint8_t[]>(r.bytes));
        uint8_t* base = p.regions.back().get();
        for (uint64_t i = 0; i < r.bytes; ++i) base[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
        fuzz::track(base, r.bytes);
        p.path->add_region(r.name, {reinterpret_cast<uintptr_t>(base), r.bytes, 0, r.ready_event});
      }
      made.push_back(std::move(p));
    }
    return made;
  }();
  return all;
}

void expect(bool holds, const char* what) {
  if (!holds) fuzz::fail(what);
}

// ---- 1. the wire format alone
void walk(std::string_view message, int depth) {
  namespace wire = tokensampler::wire;
  wire::Reader reader(message);
  wire::Writer rewritten;  // the varint and length-delimited fields again, through wire::Writer
  std::vector<wire::Field> kept;
  wire::Field f;
  while (reader.next(f)) {
    expect(f.number >= 1 && f.number <= 0x1FFFFFFF, "a field number outside [1, 2^29)");
    std::vector<uint64_t> varints;
    std::vector<uint32_t> floats;
    const bool as_varints = wire::append_varints(f, varints), as_floats = wire::append_fixed32(f, floats);
    if (f.type == wire::kLengthDelimited) {
      expect(f.bytes.data() >= message.data() && f.bytes.data() + f.bytes.size() <= message.data() + message.size(),
             "a payload outside its message");
      expect(!as_varints || varints.size() <= f.bytes.size(), "more varints than bytes");
      expect(as_floats == (f.bytes.size() % 4 == 0), "a packed float run of a size not a multiple of 4");
      expect(!as_floats || (floats.size() == f.bytes.size() / 4 &&
                            (floats.empty() || !std::memcmp(floats.data(), f.bytes.data(), f.bytes.size()))),
             "a packed float run read wrong");
      if (depth < 3) walk(f.bytes, depth + 1);
      if (f.bytes.empty()) {  // bytes_field leaves an empty payload out
        rewritten.tag(f.number, wire::kLengthDelimited);
        rewritten.varint(0);
      } else {
        rewritten.bytes_field(f.number, f.bytes.data(), f.bytes.size());
      }
      kept.push_back(f);
    } else {
      expect(as_varints == (f.type == wire::kVarint) && varints.size() == as_varints, "a scalar read as a run");
      expect(as_floats == (f.type == wire::kFixed32) && floats.size() == as_floats, "a fixed32 not read as one");
      if (f.type == wire::kVarint) {
        rewritten.tag(f.number, wire::kVarint);
        rewritten.varint(f.value);
        kept.push_back(f);
      }
    }
  }
  expect(!reader.ok() || reader.at_end(), "the reader stopped early without failing");
  wire::Reader again(rewritten.bytes());
  size_t i = 0;
  while (again.next(f)) {
    expect(i < kept.size() && kept[i].number == f.number && kept[i].type == f.type &&
               (f.type == wire::kVarint ? kept[i].value == f.value : kept[i].bytes == f.bytes),
           "wire::Writer wrote a field that reads back different");
    ++i;
  }
  expect(again.ok() && i == kept.size(), "wire::Writer wrote a message that reads back different");
}

// ---- 2. what a prepared request promises
void check_prepared(const PreparedRequest& p, const Path& path, std::string_view input) {
  const u128 rows = static_cast<u128>(p.num_rows), vocab = static_cast<u128>(p.vocab);
  expect(p.num_rows >= 1 && p.vocab >= 1, "a request without rows or tokens");
  expect(p.num_rows <= path.limits.max_batch_rows, "more rows than max_batch_rows");
  expect(rows * vocab <= static_cast<u128>(path.limits.max_batch_elements), "more elements than max_batch_elements");
  const uint32_t itemsize = p.dtype_code == 0 ? 4 : p.dtype_code <= 2 ? 2 : 0;
  expect(p.dtype_code >= 0 && itemsize == p.itemsize, "an item size that is not its dtype's");
  const u128 row_bytes = vocab * itemsize, logits_bytes = rows * row_bytes;
  if (p.region.empty()) {
    expect(!p.gathered && p.row_offsets.empty(), "carried logits with row offsets");
    expect(p.carried.data() >= input.data() && p.carried.data() + p.carried.size() <= input.data() + input.size(),
           "carried logits outside the request's bytes");
    expect(p.carried.size() == logits_bytes, "carried logits whose byte count is not rows x vocab x item size");
  } else {
    const Region* region = region_named(p.region);
    expect(region && p.region_bytes == region->bytes, "a request on a region never registered");
    if (p.gathered) {
      expect(p.row_offsets.size() == static_cast<size_t>(p.num_rows), "one row offset per row");
      for (uint64_t start : p.row_offsets)
        expect(start % itemsize == 0 && start + row_bytes <= region->bytes, "a gathered row outside its region");
    } else {
      expect(p.offset % itemsize == 0 && p.offset + logits_bytes <= region->bytes, "rows outside their region");
    }
  }
  const size_t b = static_cast<size_t>(p.num_rows);
  expect(p.seed.size() == b && p.position.size() == b && p.iteration.size() == b && p.temperature.size() == b &&
             p.top_p.size() == b && p.min_p.size() == b && p.top_k.size() == b,
         "a per-row column of another length");
  int64_t modes = 0;
  for (int64_t m : p.rows_by_mode) modes += m;
  expect(modes == p.num_rows, "rows_by_mode does not count every row once");
  for (size_t r = 0; r < b; ++r) {
    expect(std::isfinite(p.temperature[r]) && p.temperature[r] >= 0.f, "a temperature not finite and >= 0");
    expect(p.top_p[r] > 0.f && p.top_p[r] <= 1.f, "a top_p outside (0, 1]");
    expect(p.min_p[r] >= 0.f && p.min_p[r] <= 1.f, "a min_p outside [0, 1]");
    expect(p.top_k[r] >= 0 && p.top_k[r] < p.vocab, "a top_k outside [0, vocab)");
    expect(p.position[r] >= 0 && p.position[r] <= UINT32_MAX, "a position outside uint32");
    expect(p.iteration[r] >= 0 && p.iteration[r] <= UINT32_MAX, "an iteration outside uint32");
  }
}

// ---- 3. the response: SampleResponse (in SampleStreamResponse.response for a stream message)
void check_response(const PreparedRequest& p, std::string_view response) {
  tokensampler::wire::Field f;
  if (p.stream_message) {
    tokensampler::wire::Reader outer(response);
    expect(outer.next(f) && f.number == 1 && f.type == tokensampler::wire::kLengthDelimited && !outer.next(f) &&
               outer.ok(),
           "a stream message's answer is not one SampleStreamResponse.response");
    response = f.bytes;
  }
  tokensampler::wire::Reader reader(response);
  std::vector<uint64_t> seeds, valid;
  bool tokens_seen = false;
  while (reader.next(f)) {
    if (f.number == 1) {
      tokensampler::wire::Reader tensor(f.bytes);
      std::vector<uint64_t> shape;
      std::string_view data;
      uint64_t dtype = 0;
      while (tensor.next(f)) {
        if (f.number == 1) dtype = f.value;
        if (f.number == 2) tokensampler::wire::append_varints(f, shape);
        if (f.number == 3) data = f.bytes;
      }
      expect(tensor.ok() && dtype == 4 && shape.size() == 2 && shape[0] == static_cast<uint64_t>(p.num_rows) &&
                 shape[1] == 1 && data.size() == 4 * static_cast<size_t>(p.num_rows),
             "the tokens tensor is not int32 [rows, 1]");
      for (size_t r = 0; r < static_cast<size_t>(p.num_rows); ++r) {
        int32_t token;
        std::memcpy(&token, data.data() + 4 * r, 4);
        expect(token >= -1 && token < p.vocab, "a token outside [-1, vocab)");
      }
      tokens_seen = true;
    } else if (f.number == 2) {
      expect(tokensampler::wire::append_varints(f, seeds), "seeds not varints");
    } else if (f.number == 6) {
      expect(tokensampler::wire::append_varints(f, valid), "valid not varints");
    } else if (f.number == 9) {
      expect(f.bytes == p.request_id, "another request id");
    }
  }
  expect(reader.ok() && tokens_seen, "a response without tokens");
  expect(seeds == std::vector<uint64_t>(p.seed.begin(), p.seed.end()), "the response's seeds are not the request's rows' seeds");
  expect(valid.size() == static_cast<size_t>(p.num_rows), "one valid flag per row");
}

// One-row requests of p's vocabulary and dtype, to merge it with: logits carried in the request, and a row
// gathered from region "big" (empty where the row does not fit).
uint64_t proto_dtype(const PreparedRequest& p) { return p.dtype_code == 0 ? 1 : p.dtype_code == 1 ? 3 : 2; }

std::string carried_companion(const PreparedRequest& p) {
  const u128 bytes = static_cast<u128>(p.vocab) * p.itemsize;
  if (bytes > 65536) return {};
  tokensampler::wire::Writer tensor, request;
  tensor.uint_field(1, proto_dtype(p));
  const int64_t shape[2] = {1, p.vocab};
  tensor.packed_varints(2, shape, 2);
  const std::string data(static_cast<size_t>(bytes), '\0');
  tensor.bytes_field(3, data.data(), data.size());
  request.message_field(1, tensor);
  return request.bytes();
}

std::string gathered_companion(const PreparedRequest& p) {
  const uint64_t offset = 3 * p.itemsize;  // not the region's start
  if (static_cast<u128>(p.vocab) * p.itemsize + offset > region_named("big")->bytes) return {};
  tokensampler::wire::Writer rows, request;
  rows.bytes_field(1, "big", 3);
  rows.uint_field(2, proto_dtype(p));
  rows.uint_field(3, static_cast<uint64_t>(p.vocab));
  rows.packed_varints(4, &offset, 1);
  request.message_field(10, rows);
  return request.bytes();
}

void sample(const Path& path, const std::vector<std::shared_ptr<PreparedRequest>>& batch) {
  std::vector<tokensampler::AnsweredRequest> answers;
  try {
    answers = path.path->sample(batch);
  } catch (const std::exception& e) {
    fuzz::fail(e.what());  // a batch of prepared requests within the limits is always sampled
  }
  expect(answers.size() == batch.size(), "one answer per request");
  for (size_t i = 0; i < batch.size(); ++i)
    if (answers[i].answered) check_response(*batch[i], answers[i].response);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // a block of exactly the input's size, so that a read past the request's end is a sanitizer report
  const std::unique_ptr<char[]> copy(new char[size ? size : 1]);
  if (size) std::memcpy(copy.get(), data, size);
  const std::string_view input(copy.get(), size);
  walk(input, 0);
  const bool stream_message = size & 1;
  for (Path& path : paths()) {
    const auto prepared = path.path->prepare(input, "fuzz", stream_message);
    if (!prepared) continue;
    check_prepared(*prepared, path, input);
    sample(path, {prepared});
    // merged: a second copy of itself, between a carried and a gathered request of its vocabulary and dtype
    const std::string carried = carried_companion(*prepared), gathered = gathered_companion(*prepared);
    std::vector<std::shared_ptr<PreparedRequest>> batch;
    u128 rows = 0;
    for (int i = 0; i < 4; ++i) {
      const std::string_view bytes = i == 0 ? carried : i == 3 ? gathered : input;
      if (bytes.empty()) continue;
      auto request = i == 1 ? prepared : path.path->prepare(bytes, "fuzz-merged", i % 2);
      expect(request != nullptr, "a request taken once, or a one-row request of its shape, declined");
      rows += static_cast<u128>(request->num_rows);
      if (rows > static_cast<u128>(path.limits.max_batch_rows) ||
          rows * static_cast<u128>(prepared->vocab) > static_cast<u128>(path.limits.max_batch_elements))
        break;
      batch.push_back(std::move(request));
    }
    if (batch.size() > 1) sample(path, batch);
  }
  return 0;
}
