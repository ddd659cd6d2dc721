"""SM clock, power and throttle reasons while a hidden-state call runs back to back (do_bench's shape: the L2 flush,
then the call, never waiting) and spaced (a synchronisation and a 0.3 ms pause after each call; a ~0.1 ms sleep
kernel ahead of each timed call keeps the host's enqueue out of its time), read by `nvidia-smi -lms 20` beside
the timings. An experiment, not part of the package (benchmarks/FUSED_NOTES.md, thirty-fifth session); on a GPU
machine:

  python benchmarks/experiments/power_clock_probe.py 64 128 256

For each B: cuBLAS alone back to back, then the fused Gumbel call back to back and spaced, two seconds each.
"""
import collections
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "server")]
from bench_fused import fused_fn  # noqa: E402

V, D = 151936, 4096
SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def run_phase(call, flush: torch.Tensor, spaced: bool, seconds: float = 2.0) -> tuple[float, float, float]:
    """(start, end, median event time in us) of `call` repeated for `seconds`, L2 flushed before each call."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, times = time.time(), []
    while time.time() - start < seconds:
        events = []
        for _ in range(20):
            flush.zero_()
            if spaced:
                torch.cuda._sleep(200_000)  # cycles: the call is enqueued before the GPU reaches its first event
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            call()
            end.record()
            events.append((begin, end))
            if spaced:
                torch.cuda.synchronize()
                time.sleep(0.0003)
        torch.cuda.synchronize()
        times += [b.elapsed_time(e) * 1e3 for b, e in events]
    return start, time.time(), statistics.median_high(times)


def parse_samples(lines: list[str]) -> list[tuple[float, int, float, str, str]]:
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time()
            samples.append((stamp, int(fields[1].split()[0]), float(fields[2].split()[0]), fields[3], fields[4]))
        except (ValueError, IndexError):
            continue  # a header or a field nvidia-smi could not read
    return samples


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [64, 128, 256]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(V, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    # To a file, not a pipe: an unread pipe fills after ~15 s of samples and then stalls nvidia-smi.
    log = tempfile.TemporaryFile("w+")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "20"],
                           stdout=log, text=True)
    time.sleep(1.0)
    phases = []
    for b in batches:
        hidden = torch.randn(b, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(b, V, device="cuda", dtype=torch.bfloat16)
        fused = fused_fn(weight, hidden, "gumbel")
        for name, call, spaced in ((f"cuBLAS B={b} back to back", lambda: torch.mm(hidden, weight.T, out=out), False),
                                   (f"fused gumbel B={b} back to back", fused, False),
                                   (f"fused gumbel B={b} spaced", fused, True)):
            phases.append((name, *run_phase(call, flush, spaced)))
            time.sleep(0.6)
    smi.terminate()
    smi.wait()
    log.seek(0)
    samples = parse_samples(log.read().splitlines())
    for name, start, end, us in phases:
        window = [s for s in samples if start + 0.2 <= s[0] <= end]  # past the phase's first 0.2 s
        if not window:
            print(f"{name:32s} {us:7.1f} us | no clock samples")
            continue
        clocks, watts = [s[1] for s in window], [s[2] for s in window]
        reasons = collections.Counter(s[4] for s in window).most_common(2)
        clock, watt = statistics.median_high(clocks), statistics.median_high(watts)
        print(f"{name:32s} {us:7.1f} us | SM MHz min/median/max {min(clocks)}/{clock}/{max(clocks)} | "
              f"W median/max {watt:.0f}/{max(watts):.0f} | {window[-1][3]} C | throttle reasons {reasons}",
              flush=True)


if __name__ == "__main__":
    main()
