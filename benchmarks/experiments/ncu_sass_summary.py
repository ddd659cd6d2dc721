"""Summarises ncu's per-instruction SASS export of one kernel (ncu_profile.sh writes it): executed warp
instructions by opcode, the warp-stall samples by reason, the hottest lines, and the lines grouped by how
many times they ran (a kernel's main path is the large group whose count is its warps: 8 a block). An
experiment, not part of the package (benchmarks/NOTES.md, twenty-ninth session):

  python benchmarks/experiments/ncu_sass_summary.py KERNEL.sass.csv [--top 20]
"""
import argparse
import csv
from collections import Counter

INSTRUCTIONS = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"


def read_lines(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and the SASS lines of the first kernel in an `ncu --page source --csv` export."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header, lines = rows[start], []
    for row in rows[start + 1:]:
        if row and row[0] == "Kernel Name":  # the next kernel of the export
            break
        if len(row) == len(header) and row[0].startswith("0x"):
            lines.append(row)
    return header, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    header, lines = read_lines(args.export)
    column = {name: i for i, name in enumerate(header)}
    stall_names = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def value(line: list[str], name: str) -> float:
        text = line[column[name]].replace(",", "")
        return float(text) if text.replace(".", "", 1).isdigit() else 0.0

    def opcode(line: list[str]) -> str:
        words = line[column["Source"]].split()
        return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]

    total = sum(value(line, INSTRUCTIONS) for line in lines)
    samples = sum(value(line, SAMPLES) for line in lines)
    print(f"{len(lines)} SASS lines, {total:.4g} warp instructions executed, {samples:.0f} stall samples")
    by_op, op_samples = Counter(), Counter()
    for line in lines:
        by_op[opcode(line)] += value(line, INSTRUCTIONS)
        op_samples[opcode(line)] += value(line, SAMPLES)
    print("opcode: share of instructions, share of samples")
    for op, count in by_op.most_common(args.top):
        print(f"  {op:10s} {count / total:6.1%} {op_samples[op] / samples:6.1%}")
    reasons = {name[6:]: sum(value(line, name) for line in lines) for name in stall_names}
    print("stall reasons:", ", ".join(f"{k} {v / samples:.1%}" for k, v in Counter(reasons).most_common(8)))
    groups, group_instr = Counter(), Counter()
    for line in lines:
        runs = value(line, INSTRUCTIONS)
        groups[runs] += 1
        group_instr[runs] += runs
    print("lines by times run: runs x lines, share of instructions")
    for runs, count in group_instr.most_common(8):
        print(f"  {int(runs):10d} x {groups[runs]:5d}  {count / total:6.1%}")
    print("hottest lines: samples, times run, SASS, top stall reasons")
    for line in sorted(lines, key=lambda line: -value(line, SAMPLES))[: args.top]:
        top = sorted(((value(line, name), name[6:]) for name in stall_names), reverse=True)[:2]
        reasons_text = ", ".join(f"{name} {count:.0f}" for count, name in top if count)
        print(f"  {value(line, SAMPLES):6.0f} {value(line, INSTRUCTIONS):10.0f}  "
              f"{line[column['Source']].strip()[:64]:64s} {reasons_text}")


if __name__ == "__main__":
    main()
