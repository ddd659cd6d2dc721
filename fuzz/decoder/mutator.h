// A protobuf-aware mutation for the request-decoder fuzzer (mutator.cpp). Byte-level mutations rarely get past
// the nested length prefixes of a SampleRequest (a shape varint grown by 8 bytes must grow the packed run, the
// Tensor and the request around it), so the values where decoding bugs hide (sizes whose products pass 64 bits,
// int32 edges, NaN floats) stay out of reach; this one edits a field anywhere in the message tree and writes
// every length around it again.
#pragma once
#include <random>
#include <string>
#include <string_view>

namespace fuzz {

// `message` with one field edited, added, removed or copied, at any depth. Input that does not parse as a
// message gets a field appended.
std::string mutate_structure(std::string_view message, std::mt19937_64& rng);

}  // namespace fuzz
