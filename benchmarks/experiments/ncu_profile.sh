#!/bin/bash
# Nsight Compute profile of one call of a kernel path (ncu_drive.py), on the device tool's H200 machines
# (Firecracker runtime: ncu reads the hardware counters there). Writes into OUT_DIR (default $OUT):
# NAME.details.txt (every section of every kernel matched) and NAME.sass.csv (per-instruction counters of every
# kernel matched), then prints ncu_sass_summary.py's reading of the first kernel's SASS. Clocks are left alone
# (--clock-control none), as the device notes ask. An experiment, not part of the package
# (benchmarks/NOTES.md, twenty-ninth session):
#
#   benchmarks/experiments/ncu_profile.sh NAME KERNEL_REGEX flat|spiky|fused B MODE
#   e.g. benchmarks/experiments/ncu_profile.sh topp256 'frontier|nucleus_mass' flat 256 top_p
set -euo pipefail
name=$1 regex=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT_DIR:-$OUT}
report=/tmp/$name
ncu --clock-control none --profile-from-start off --set full --import-source yes -k "regex:$regex" -f -o "$report" \
  python "$here/ncu_drive.py" "$@" > "$out/$name.log" 2>&1
ncu --import "$report.ncu-rep" --page details > "$out/$name.details.txt"
ncu --import "$report.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv"
grep -E "^  [a-z_ ]|Duration|Executed Instructions  |Issue Slots Busy|DRAM Throughput" "$out/$name.details.txt"
python "$here/ncu_sass_summary.py" "$out/$name.sass.csv" --top 12
