// libFuzzer's custom mutator for the request-decoder target: half of the mutations are libFuzzer's own (byte
// level, with its dictionary and the comparisons it traced), half edit the protobuf structure (mutator.h).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <string_view>

#include "mutator.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  std::mt19937_64 rng(seed);
  if (rng() % 2) return LLVMFuzzerMutate(data, size, max_size);
  const std::string out = fuzz::mutate_structure(std::string_view(reinterpret_cast<const char*>(data), size), rng);
  if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}
