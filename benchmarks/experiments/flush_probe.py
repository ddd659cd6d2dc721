"""What the benchmark's L2 flush costs the call that follows it. triton's do_bench flushes by writing 256 MB, which
leaves the L2 full of dirty lines that the next kernel's reads must first write back. This times the fused
gumbel call and cuBLAS alone at B = 1 / 32 / 64 after that write flush, after a read of 256 MB (a clean flush)
and back to back, with CUDA events (median of 40), beside do_bench itself; then torch.profiler kernel times
inside the write- and read-flush loops. An experiment, not part of the package (benchmarks/FUSED_NOTES.md,
twenty-ninth session); on a GPU machine, with peers.py in .bench_peers/ or ../shared/bench/:

  python benchmarks/experiments/flush_probe.py
"""
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_fused import fused_fn  # noqa: E402
from bench_kernels import load_peers  # noqa: E402

V, D = 151936, 4096


def event_median(call: Callable[[], object], before: Callable[[], object], n: int = 40) -> float:
    """Median µs of call() between CUDA events, with before() enqueued ahead of each one."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        before()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) * 1e3 for start, end in events)[n // 2]


def main() -> None:
    peers = load_peers()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(V, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    dirty = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    clean = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    flushes = {"write_flush": dirty.zero_, "read_flush": clean.sum, "none": lambda: None}
    for round_ in range(2):
        for b in (1, 32, 64):
            hidden = torch.randn(b, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            calls = {"fused": fused_fn(weight, hidden, "gumbel"), "cublas": lambda: hidden @ weight.T}
            for name, call in calls.items():
                for _ in range(5):
                    call()
                times = "  ".join(f"{flush} {event_median(call, before):7.1f}" for flush, before in flushes.items())
                print(f"round {round_} B={b:<3d} {name:7s} do_bench {peers.bench(call):7.1f}  {times}", flush=True)
    for b in (1, 64):
        call = fused_fn(weight, torch.randn(b, D, device="cuda", dtype=torch.bfloat16, generator=gen), "gumbel")
        for flush in ("write_flush", "read_flush"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                event_median(call, flushes[flush], n=20)
            for event in prof.key_averages():
                if "fused" in event.key:
                    print(f"B={b} {flush:12s} {event.key[:60]:60s} n={event.count} mean {event.device_time:7.1f} us")


if __name__ == "__main__":
    main()
