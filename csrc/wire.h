// The protobuf wire format, as much of it as the native path needs (native_path.cpp):
// reading a message's fields in order, the two encodings of repeated scalars (packed and not), and
// writing a response. Plain C++17, no protobuf library: the path reads only messages whose every
// field it knows, and hands anything else to the Python path.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace tokensampler::wire {

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

struct Field {
  uint32_t number = 0;
  WireType type = kVarint;
  uint64_t value = 0;      // kVarint: the value; kFixed64 / kFixed32: the bits
  std::string_view bytes;  // kLengthDelimited: the payload
};

// Reads the fields of one message in order. next() returns false at the end, and also at the first
// malformed byte, after which ok() is false.
class Reader {
 public:
  explicit Reader(std::string_view message)
      : p_(reinterpret_cast<const uint8_t*>(message.data())), end_(p_ + message.size()) {}

  bool ok() const { return ok_; }
  bool at_end() const { return p_ == end_; }

  bool next(Field& field) {
    if (p_ == end_) return false;
    uint64_t tag = 0;
    if (!varint(tag) || (tag >> 3) == 0 || (tag >> 3) > 0x1FFFFFFF) return fail();
    field.number = static_cast<uint32_t>(tag >> 3);
    field.type = static_cast<WireType>(tag & 7);
    switch (field.type) {
      case kVarint:
        return varint(field.value) || fail();
      case kFixed64:
        return fixed(8, field.value) || fail();
      case kFixed32:
        return fixed(4, field.value) || fail();
      case kLengthDelimited: {
        uint64_t size = 0;
        if (!varint(size) || size > static_cast<uint64_t>(end_ - p_)) return fail();
        field.bytes = std::string_view(reinterpret_cast<const char*>(p_), static_cast<size_t>(size));
        p_ += size;
        return true;
      }
    }
    return fail();  // groups (3, 4) and the unused wire types
  }

  // A varint at the read position (at most 10 bytes).
  bool varint(uint64_t& value) {
    value = 0;
    for (int shift = 0; shift < 70 && p_ != end_; shift += 7) {
      const uint8_t byte = *p_++;
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  }

 private:
  bool fixed(int size, uint64_t& value) {
    if (end_ - p_ < size) return false;
    value = 0;
    std::memcpy(&value, p_, static_cast<size_t>(size));  // little-endian on every target we build for
    p_ += size;
    return true;
  }
  bool fail() {
    ok_ = false;
    return false;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

// Appends the values of one occurrence of a repeated varint field: a packed run or a single value.
inline bool append_varints(const Field& field, std::vector<uint64_t>& out) {
  if (field.type == kVarint) {
    out.push_back(field.value);
    return true;
  }
  if (field.type != kLengthDelimited) return false;
  Reader run(field.bytes);  // a packed run: varints without tags
  while (!run.at_end()) {
    uint64_t value = 0;
    if (!run.varint(value)) return false;
    out.push_back(value);
  }
  return true;
}

// Appends the values of one occurrence of a repeated 32-bit field (float): packed or single.
inline bool append_fixed32(const Field& field, std::vector<uint32_t>& out) {
  if (field.type == kFixed32) {
    out.push_back(static_cast<uint32_t>(field.value));
    return true;
  }
  if (field.type != kLengthDelimited || field.bytes.size() % 4) return false;
  const size_t count = field.bytes.size() / 4;
  if (!count) return true;  // an empty run: out may have no storage, and memcpy's pointers must not be null
  const size_t start = out.size();
  out.resize(start + count);
  std::memcpy(out.data() + start, field.bytes.data(), 4 * count);
  return true;
}

// Builds a message. Proto3 leaves out fields at their default value, and so does every helper here.
class Writer {
 public:
  const std::string& bytes() const { return out_; }
  void reserve(size_t n) { out_.reserve(n); }

  void varint(uint64_t value) {
    while (value >= 0x80) {
      out_.push_back(static_cast<char>(value | 0x80));
      value >>= 7;
    }
    out_.push_back(static_cast<char>(value));
  }
  void tag(uint32_t number, WireType type) { varint((static_cast<uint64_t>(number) << 3) | type); }

  void uint_field(uint32_t number, uint64_t value) {
    if (!value) return;
    tag(number, kVarint);
    varint(value);
  }
  void bytes_field(uint32_t number, const void* data, size_t size) {
    if (!size) return;
    tag(number, kLengthDelimited);
    varint(size);
    out_.append(static_cast<const char*>(data), size);
  }
  void message_field(uint32_t number, const Writer& message) {
    // an empty sub-message is still written: its presence is what a oneof or a message field says
    tag(number, kLengthDelimited);
    varint(message.out_.size());
    out_.append(message.out_);
  }
  // A packed repeated varint field (int64 shape, uint64 seeds, bools).
  template <typename T>
  void packed_varints(uint32_t number, const T* values, size_t count) {
    if (!count) return;
    Writer run;
    for (size_t i = 0; i < count; ++i) run.varint(static_cast<uint64_t>(values[i]));
    bytes_field(number, run.out_.data(), run.out_.size());
  }

 private:
  std::string out_;
};

}  // namespace tokensampler::wire
