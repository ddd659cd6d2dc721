#!/usr/bin/env bash
# Builds benchmarks/filter_one_row.cu against csrc/ of each commit given (the working tree's for "."), then, unless
# --build-only (which needs no GPU), runs each in turn for ROUNDS rounds at B spiky rows: ts_stats + ts_filter,
# the route the planner gives top-p alone below TS_FRONTIER_MIN_ROWS rows (32; from there it takes the frontier),
# followed across commits with nothing else of the tree in the way.
#   benchmarks/filter_across_commits.sh [-b B] [-r ROUNDS] [--build-only] REV...
set -euo pipefail
cd "$(dirname "$0")/.."
rows=1 rounds=2 run=1 revs=()
while [ $# -gt 0 ]; do
  case "$1" in
    -b) rows=$2; shift 2 ;;
    -r) rounds=$2; shift 2 ;;
    --build-only) run=0; shift ;;
    *) revs+=("$1"); shift ;;
  esac
done
[ ${#revs[@]} -gt 0 ] || { echo "usage: $0 [-b B] [-r ROUNDS] [--build-only] REV..." >&2; exit 2; }
work=build/filter-across-commits
mkdir -p "$work"
for rev in "${revs[@]}"; do
  name=$(git rev-parse --short "${rev/#./HEAD}")
  [ "$rev" = . ] && name=worktree
  src=$work/$name
  rm -rf "$src" && mkdir -p "$src"
  if [ "$rev" = . ]; then cp -r csrc "$src/"; else git archive "$rev" csrc | tar -x -C "$src"; fi
  nvcc -std=c++17 -O3 -I"$src/csrc" -gencode=arch=compute_90a,code=sm_90a -o "$work/filter_$name" \
    benchmarks/filter_one_row.cu "$src/csrc/sampling.cu"
  echo "built $work/filter_$name"
done
[ "$run" = 1 ] || exit 0
for _ in $(seq "$rounds"); do
  for rev in "${revs[@]}"; do
    name=$(git rev-parse --short "${rev/#./HEAD}")
    [ "$rev" = . ] && name=worktree
    printf '%-10s ' "$name"
    "$work/filter_$name" "$rows" 1 300
  done
done
