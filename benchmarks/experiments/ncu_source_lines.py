"""Executed warp instructions of one kernel by CUDA source line, inlined frames included: ncu's per-instruction
export (ncu_profile.sh writes NAME.sass.csv) joined by address with `nvdisasm -c -gi` of the same build's cubin.
An experiment, not part of the package (benchmarks/NOTES.md, thirty-first session). The cubin comes from the
build directory the profiled process used, on the GPU machine:

  cuobjdump -xelf all $TOKENSAMPLER_BUILD_DIR/*/sampling.cuda.o      # writes sampling.sm_90a.cubin
  nvdisasm -c -gi sampling.sm_90a.cubin > sampling.sass               # any nvdisasm of CUDA 13
  python benchmarks/experiments/ncu_source_lines.py NAME.sass.csv sampling.sass frontier_kernelIf --depth 2

A row's key is the chain of source lines from the kernel's own line inwards, `--depth` frames deep; the counts are
per warp (the kernel's first instruction runs once a warp). The script checks that the opcodes agree at every
address, so a cubin from another build is refused rather than misread.
"""
import argparse
import re
from collections import Counter

from ncu_sass_summary import INSTRUCTIONS, SAMPLES, read_lines

LOCATION = re.compile(r'File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def disassembly(path: str, kernel: str) -> dict[int, tuple[str, list[str]]]:
    """Offset -> (SASS text, source frames outermost first) of the first function whose name contains `kernel`."""
    out: dict[int, tuple[str, list[str]]] = {}
    inside, pending, frames = False, [], []
    for line in open(path):
        if line.lstrip().startswith(".text."):
            if inside:
                break
            inside = kernel in line
            continue
        if not inside:
            continue
        if "//##" in line:
            match = LOCATION.search(line)
            pending.append(f"{match.group(1).rsplit('/', 1)[-1]}:{match.group(2)}")
            continue
        match = INSTRUCTION.search(line)
        if match:
            if pending:  # nvdisasm lists a location's frames innermost first
                frames, pending = pending[::-1], []
            out[int(match.group(1), 16)] = (match.group(2).strip(), frames)
    if not out:
        raise SystemExit(f"no function matching {kernel!r} in {path}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("sass")
    parser.add_argument("kernel", help="a substring of the kernel's mangled name, e.g. frontier_kernelIf")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    code = disassembly(args.sass, args.kernel)
    header, lines = read_lines(args.export)
    column = {name: i for i, name in enumerate(header)}

    def number(row: list[str], name: str) -> float:
        return float(row[column[name]].replace(",", "") or 0)

    base = int(lines[0][0], 16)
    warps = number(lines[0], INSTRUCTIONS)
    executed, samples = Counter(), Counter()
    for row in lines:
        text, frames = code.get(int(row[0], 16) - base, ("?", []))
        source = row[column["Source"]].strip()
        if text.split()[:1] != source.split()[:1]:
            raise SystemExit(f"opcode mismatch at {row[0]}: {source!r} against {text!r}: another build?")
        key = " > ".join(frames[: args.depth]) or "?"
        executed[key] += number(row, INSTRUCTIONS)
        samples[key] += number(row, SAMPLES)
    total = sum(executed.values())
    print(f"{total:.4g} warp instructions, {total / warps:.0f} a warp")
    for key, count in executed.most_common(args.top):
        print(f"{count / total:6.1%} {count / warps:8.1f} a warp  samples {samples[key]:6.0f}  {key}")


if __name__ == "__main__":
    main()
