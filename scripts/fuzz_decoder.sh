#!/usr/bin/env bash
# Fuzzes the native path's decoder and validation (csrc/wire.h, csrc/native_path.cpp) on the CPU under
# AddressSanitizer and UndefinedBehaviorSanitizer (fuzz/decoder/). Builds the harness, writes the seed corpus
# (real SampleRequest messages), replays the regression corpus tests/fuzz_corpus/decoder/, then runs RUNS inputs.
#
#   scripts/fuzz_decoder.sh [-n RUNS] [-s SEED] [--driver] [--work DIR]
#
#   -n RUNS    inputs to run, seeds and regression inputs included (default 1000000)
#   -s SEED    the mutation seed (default: random, printed)
#   --driver   the random-mutation driver even where libFuzzer is available
#   --work DIR build, corpus and crash files (default build/fuzz-decoder)
#
# With clang (libFuzzer, coverage-guided) where it has -fsanitize=fuzzer, else with $CXX or g++ and
# fuzz/decoder/driver.cpp (random mutations, no coverage guidance). PYTHON (default python3) needs the protobuf
# package, for the seeds. Exit status: 0 no crash, 1 a crash (its input and report are printed), 77 no compiler
# with the sanitizers here.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=1000000
seed=$(( (RANDOM << 15 | RANDOM) + 1 ))
force_driver=0
work=build/fuzz-decoder
while [ $# -gt 0 ]; do
  case "$1" in
    -n) runs=$2; shift 2 ;;
    -s) seed=$2; shift 2 ;;
    --driver) force_driver=1; shift ;;
    --work) work=$2; shift 2 ;;
    *) echo "usage: $0 [-n RUNS] [-s SEED] [--driver] [--work DIR]" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
regression=tests/fuzz_corpus/decoder
mkdir -p "$work/corpus" "$work/artifacts"
rm -f "$work"/artifacts/*

# UB aborts (no recovery), and std::vector's operator[] is bounds-checked (_GLIBCXX_ASSERTIONS)
sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
flags=(-std=c++17 -g -O1 -D_GLIBCXX_ASSERTIONS -Ifuzz/decoder -Icsrc)  # fuzz/decoder first: its cuda_runtime.h
sources=(fuzz/decoder/harness.cpp fuzz/decoder/host_device.cpp fuzz/decoder/mutator.cpp csrc/native_path.cpp
         csrc/routes.cpp)

compiles() {  # compiles <libfuzzer 0|1> <compiler> <flags...>: links a trivial fuzz target with these flags
  local libfuzzer=$1 cxx=$2; shift 2
  command -v "$cxx" >/dev/null 2>&1 || return 1
  {
    printf '#include <cstddef>\n#include <cstdint>\n'
    printf 'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n'
    [ "$libfuzzer" = 1 ] || printf 'int main() { return LLVMFuzzerTestOneInput(nullptr, 0); }\n'
  } > "$work/probe.cpp"
  "$cxx" "$@" "$work/probe.cpp" -o "$work/probe" >/dev/null 2>&1 && "$work/probe" -runs=0 >/dev/null 2>&1
}

if [ "$force_driver" = 0 ] && compiles 1 clang++ "${sanitize[@]}" -fsanitize=fuzzer; then
  mode=libFuzzer cxx=clang++
  sanitize+=(-fsanitize=fuzzer)
  sources+=(fuzz/decoder/libfuzzer_mutator.cpp)
  guidance=(-dict=fuzz/decoder/decoder.dict)
elif compiles 0 "${CXX:-g++}" "${sanitize[@]}"; then
  mode=driver cxx=${CXX:-g++}
  sources+=(fuzz/decoder/driver.cpp)
  guidance=()
else
  echo "fuzz_decoder: no C++ compiler with AddressSanitizer and UndefinedBehaviorSanitizer (clang++ or ${CXX:-g++})" >&2
  exit 77
fi

echo "fuzz_decoder: building with $cxx ($mode)"
mkdir -p "$work/obj"
objects=() pids=()
for src in "${sources[@]}"; do  # one compiler per file, side by side
  objects+=("$work/obj/$(basename "${src%.cpp}").o")
  "$cxx" "${flags[@]}" "${sanitize[@]}" -c "$src" -o "${objects[-1]}" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
"$cxx" "${sanitize[@]}" "${objects[@]}" -o "$work/fuzz_decoder"
"$python" fuzz/decoder/make_seeds.py "$work/seeds"

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-abort_on_error=1:halt_on_error=1:print_stacktrace=1}
report() {  # report <log>: the crash, its input, and exit 1
  echo "fuzz_decoder: CRASH" >&2
  local found='ERROR: |runtime error: |==fuzz== '
  if grep -qE "$found" "$1"; then grep -E -A40 "$found" "$1" | head -80 >&2 || true; else tail -40 "$1" >&2; fi
  { grep -E '^Running: ' "$1" | tail -1 | sed 's/^Running: //' || true; ls "$work"/artifacts/* 2>/dev/null || true; } |
    sed 's/^/fuzz_decoder: input at fault: /' >&2
  exit 1
}

# The regression corpus, each input once.
regression_inputs=$(find "$regression" -type f | wc -l)
if [ "$regression_inputs" -gt 0 ]; then
  "$work/fuzz_decoder" -artifact_prefix="$work/artifacts/" "$regression"/* > "$work/regression.log" 2>&1 ||
    report "$work/regression.log"
fi
echo "fuzz_decoder: replayed $regression_inputs regression inputs, no crash"

# The fuzzing: new corpus entries in $work/corpus (libFuzzer), seeds and regression inputs read from theirs.
start=$(date +%s)
"$work/fuzz_decoder" -runs="$runs" -seed="$seed" "${guidance[@]}" -max_len=8192 -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "$work/seeds" "$regression" \
  > "$work/fuzz.log" 2>&1 || report "$work/fuzz.log"
done_line=$(grep -E '^Done [0-9]+ runs' "$work/fuzz.log" | tail -1)
ran=$(echo "$done_line" | awk '{print $2}')
echo "fuzz_decoder: $ran inputs in $(( $(date +%s) - start )) s ($mode, seed $seed), no crash"
