// The host stand-in "device" of the sanitizer build (host_device.cpp): which heap blocks count as device or
// pinned memory, and the check every stand-in launcher and copy makes against them.
#pragma once
#include <cstddef>

namespace fuzz {

// A block the native path may read: a stand-in allocation, or a region the harness registered.
void track(const void* base, size_t bytes);
void untrack(const void* base);
// Whether [p, p + bytes) lies inside one tracked block (bytes = 0: p inside or one past the end).
bool inside(const void* p, size_t bytes);
// Prints what broke and aborts, as a sanitizer does: the fuzzer keeps the input.
[[noreturn]] void fail(const char* what);

}  // namespace fuzz
