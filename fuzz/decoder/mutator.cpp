// mutator.h: parse a message into its fields, edit one (descending into length-delimited payloads that parse
// as messages or packed runs), serialize again with every length recomputed.
#include "mutator.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <array>
#include <iterator>
#include <vector>

#include "wire.h"

namespace fuzz {
namespace {

namespace wire = tokensampler::wire;

struct Node {
  uint32_t number;
  uint32_t type;
  uint64_t value;     // varint, fixed64 and fixed32 bits
  std::string bytes;  // length-delimited payload
};

// Sizes, counts and offsets whose products with 2 or 4 pass 64 bits, int32 and uint32 bounds, int32 negatives
// as int64 varints carry them.
constexpr uint64_t kEdges[] = {0,
                               1,
                               2,
                               3,
                               4,
                               7,
                               8,
                               0x7F,
                               0x80,
                               0xFFFF,
                               (1ull << 30),
                               (1ull << 31) - 1,
                               1ull << 31,
                               (1ull << 32) - 1,
                               1ull << 32,
                               1ull << 33,
                               1ull << 61,
                               1ull << 62,
                               (1ull << 62) + 1,
                               (1ull << 63) - 1,
                               1ull << 63,
                               UINT64_MAX,
                               UINT64_MAX - 1,
                               0xFFFFFFFF80000000ull,
                               0xFFFFFFFF7FFFFFFFull};

uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

uint64_t edge_float(std::mt19937_64& rng) {
  const float values[] = {0.f,       -0.f, 1.f, std::nextafter(1.f, 2.f), std::nextafter(1.f, 0.f), 0.5f, -1.f,
                          1e-45f,    1e30f, INFINITY, -INFINITY, NAN, 1e-7f, 2.f};
  return float_bits(values[rng() % std::size(values)]);
}

uint64_t edited_value(uint64_t value, std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
    case 1: return kEdges[rng() % std::size(kEdges)];
    case 2: return value + (rng() % 9) - 4;
    default: return value ^ (1ull << (rng() % 64));
  }
}

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>(v | 0x80));
  out.push_back(static_cast<char>(v));
}

bool parse(std::string_view message, std::vector<Node>& nodes) {
  wire::Reader reader(message);
  wire::Field f;
  while (reader.next(f)) nodes.push_back({f.number, f.type, f.value, std::string(f.bytes)});
  return reader.ok();
}

std::string serialize(const std::vector<Node>& nodes) {
  std::string out;
  for (const Node& n : nodes) {
    put_varint(out, static_cast<uint64_t>(n.number) << 3 | n.type);
    if (n.type == wire::kVarint) {
      put_varint(out, n.value);
    } else if (n.type == wire::kLengthDelimited) {
      put_varint(out, n.bytes.size());
      out += n.bytes;
    } else {
      const size_t size = n.type == wire::kFixed64 ? 8 : 4;
      char bits[8];
      std::memcpy(bits, &n.value, 8);
      out.append(bits, size);
    }
  }
  return out;
}

// A payload as a packed run of varints, one element edited, added or removed.
bool mutate_packed(std::string& payload, std::mt19937_64& rng) {
  wire::Reader run(payload);
  std::vector<uint64_t> values;
  for (uint64_t v = 0; !run.at_end();) {
    if (!run.varint(v)) return false;
    values.push_back(v);
  }
  const size_t at = values.empty() ? 0 : rng() % values.size();
  switch (values.empty() ? 0 : rng() % 3) {
    case 0: values.insert(values.begin() + static_cast<std::ptrdiff_t>(at), kEdges[rng() % std::size(kEdges)]); break;
    case 1: values[at] = edited_value(values[at], rng); break;
    default: values.erase(values.begin() + static_cast<std::ptrdiff_t>(at)); break;
  }
  payload.clear();
  for (uint64_t v : values) put_varint(payload, v);
  return true;
}

Node random_field(std::mt19937_64& rng) {
  const uint32_t number = 1 + static_cast<uint32_t>(rng() % 16);
  switch (rng() % 3) {
    case 0: return {number, wire::kVarint, kEdges[rng() % std::size(kEdges)], {}};
    case 1: return {number, wire::kFixed32, edge_float(rng), {}};
    default: {
      std::string payload;
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) put_varint(payload, kEdges[rng() % std::size(kEdges)]);
      return {number, wire::kLengthDelimited, 0, payload};
    }
  }
}

void mutate_nodes(std::vector<Node>& nodes, std::mt19937_64& rng, int depth) {
  if (nodes.empty() || rng() % 8 == 0) {  // a new field somewhere
    nodes.insert(nodes.begin() + static_cast<std::ptrdiff_t>(rng() % (nodes.size() + 1)), random_field(rng));
    return;
  }
  Node& n = nodes[rng() % nodes.size()];
  if (n.type == wire::kLengthDelimited && depth < 3 && !n.bytes.empty() && rng() % 3 != 0) {
    std::vector<Node> inner;
    if (rng() % 2 && parse(n.bytes, inner)) {
      mutate_nodes(inner, rng, depth + 1);
      n.bytes = serialize(inner);
      return;
    }
    if (mutate_packed(n.bytes, rng)) return;
  }
  switch (rng() % 8) {
    case 0:  // remove it
      nodes.erase(nodes.begin() + (&n - nodes.data()));
      return;
    case 1:  // once more, as a repeated field or a second oneof case
      nodes.insert(nodes.begin() + static_cast<std::ptrdiff_t>(rng() % (nodes.size() + 1)), Node(n));
      return;
    case 2:  // another field number
      n.number = rng() % 2 ? 1 + static_cast<uint32_t>(rng() % 16) : static_cast<uint32_t>(edited_value(n.number, rng) & 0x1FFFFFFF);
      if (!n.number) n.number = 1;
      return;
    case 3:  // another wire type, its value kept where it fits
      n.type = std::array<uint32_t, 4>{wire::kVarint, wire::kFixed64, wire::kLengthDelimited, wire::kFixed32}[rng() % 4];
      return;
    default:
      break;
  }
  if (n.type == wire::kVarint || n.type == wire::kFixed64) {
    n.value = edited_value(n.value, rng);
  } else if (n.type == wire::kFixed32) {
    n.value = rng() % 2 ? edge_float(rng) : edited_value(n.value, rng) & 0xFFFFFFFF;
  } else if (rng() % 2) {  // a float run: one value replaced, or the run cut or grown by a float
    const size_t floats = n.bytes.size() / 4;
    if (floats && rng() % 2) {
      const uint32_t bits = static_cast<uint32_t>(edge_float(rng));
      std::memcpy(&n.bytes[4 * (rng() % floats)], &bits, 4);
    } else {
      n.bytes.resize(rng() % 2 && !n.bytes.empty() ? n.bytes.size() - 1 - rng() % std::min<size_t>(n.bytes.size(), 4)
                                                   : n.bytes.size() + 4);
    }
  } else {  // payload bytes: cut, emptied, or grown by zeros
    const size_t size = n.bytes.size();
    n.bytes.resize(rng() % 3 == 0 ? 0 : rng() % 2 ? rng() % (size + 1) : size + 1 + rng() % 64);
  }
}

}  // namespace

std::string mutate_structure(std::string_view message, std::mt19937_64& rng) {
  std::vector<Node> nodes;
  if (!parse(message, nodes)) {
    std::string out(message);
    std::vector<Node> appended{random_field(rng)};
    return out + serialize(appended);
  }
  mutate_nodes(nodes, rng, 0);
  return serialize(nodes);
}

}  // namespace fuzz
