// A main() for harness.cpp where libFuzzer is not available (g++): it runs every file given, then `-runs=N`
// random mutations of them, without coverage guidance: half byte-level (bit flips, byte values, varints of edge
// values, cuts, repeats, splices), half protobuf-aware (mutator.h). Its flags and its closing line are libFuzzer's, so that scripts/fuzz_decoder.sh reads
// both alike. On a sanitizer report (made to abort, below) or a crash the input at fault is written to
// <artifact_prefix>crash-input.
//   driver [-runs=N] [-seed=S] [-max_len=L] [-artifact_prefix=P] FILE_OR_DIR...
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "mutator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::string current;            // the input being run
std::string crash_path = "crash-input";

void save_current() {  // async-signal-safe: open, write, close
  const int fd = open(crash_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  for (size_t done = 0; done < current.size();) {
    const ssize_t n = write(fd, current.data() + done, current.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  constexpr char note[] = "==driver== the input at fault is written to its crash file\n";
  (void)!write(2, note, sizeof note - 1);
}

void on_abort(int signal_number) {
  save_current();
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

std::string varint(uint64_t v) {
  std::string out;
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>(v | 0x80));
  out.push_back(static_cast<char>(v));
  return out;
}

// One to four random edits of `input`, another corpus entry at hand for splices.
std::string mutate(std::string input, const std::string& other, std::mt19937_64& rng, size_t max_len) {
  static const uint64_t kEdges[] = {0,          1,          2,          3,          4,          7,
                                    0x7F,       0x80,       0xFFFF,     0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
                                    1ull << 32, 1ull << 62, INT64_MAX,  1ull << 63, UINT64_MAX, UINT64_MAX - 1};
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t n = input.size();
    switch (rng() % 8) {
      case 0:  // flip a bit
        if (n) input[pick(n)] ^= static_cast<char>(1 << pick(8));
        break;
      case 1:  // a random byte, or a boundary one
        if (n) input[pick(n)] = static_cast<char>(rng() % 2 ? rng() : "\x00\x01\x7f\x80\xff"[pick(5)]);
        break;
      case 2: {  // an edge value as a varint, over 1-10 bytes
        if (!n) break;
        const size_t at = pick(n);
        input.replace(at, std::min(n - at, 1 + pick(10)), varint(kEdges[pick(std::size(kEdges))]));
        break;
      }
      case 3:  // cut a span
        if (n) {
          const size_t at = pick(n);
          input.erase(at, 1 + pick(n - at));
        }
        break;
      case 4:  // repeat a span
        if (n) {
          const size_t at = pick(n), len = 1 + pick(std::min<size_t>(n - at, 64));
          input.insert(pick(n + 1), input.substr(at, len));
        }
        break;
      case 5:  // a random tag and wire type
        input.insert(pick(n + 1), varint((1 + pick(16)) << 3 | pick(8)));
        break;
      case 6:  // splice: this input's head, the other's tail
        if (!other.empty()) input = input.substr(0, pick(n + 1)) + other.substr(pick(other.size()));
        break;
      case 7:  // truncate
        input.resize(pick(n + 1));
        break;
    }
  }
  if (input.size() > max_len) input.resize(max_len);
  return input;
}

bool flag(const std::string& arg, const char* name, std::string& value) {
  const std::string prefix = std::string("-") + name + "=";
  if (arg.rfind(prefix, 0) != 0) return false;
  value = arg.substr(prefix.size());
  return true;
}

}  // namespace

// Reports end in abort(), which on_abort sees; ASAN_OPTIONS and UBSAN_OPTIONS still override these.
extern "C" const char* __asan_default_options() { return "abort_on_error=1"; }
extern "C" const char* __ubsan_default_options() { return "abort_on_error=1:halt_on_error=1:print_stacktrace=1"; }

int main(int argc, char** argv) {
  uint64_t runs = 0, seed = 1;
  size_t max_len = 8192;
  std::vector<std::string> corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string value;
    if (flag(arg, "runs", value)) runs = std::stoull(value);
    else if (flag(arg, "seed", value)) seed = std::stoull(value);
    else if (flag(arg, "max_len", value)) max_len = std::stoull(value);
    else if (flag(arg, "artifact_prefix", value)) crash_path = value + "crash-input";
    else if (arg[0] == '-') std::fprintf(stderr, "driver: ignoring %s\n", arg.c_str());
    else {
      std::vector<std::filesystem::path> files;
      if (std::filesystem::is_directory(arg)) {
        for (const auto& entry : std::filesystem::directory_iterator(arg))
          if (entry.is_regular_file()) files.push_back(entry.path());
        std::sort(files.begin(), files.end());
      } else {
        files.push_back(arg);
      }
      for (const auto& file : files) {
        std::ifstream in(file, std::ios::binary);
        corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
    }
  }
  std::signal(SIGABRT, on_abort);
  std::signal(SIGSEGV, on_abort);
  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0;
  for (const std::string& input : corpus) {
    current = input;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(current.data()), current.size());
    ++done;
  }
  std::mt19937_64 rng(seed);
  if (corpus.empty()) corpus.emplace_back();
  for (; done < runs; ++done) {
    const std::string& base = corpus[rng() % corpus.size()];
    current = rng() % 2 ? mutate(base, corpus[rng() % corpus.size()], rng, max_len)
                        : fuzz::mutate_structure(base, rng).substr(0, max_len);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(current.data()), current.size());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("Done %llu runs in %.0f second(s)\n", static_cast<unsigned long long>(done), seconds);
  return 0;
}
