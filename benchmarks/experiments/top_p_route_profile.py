"""Kernel times of the top-p route (torch.profiler, 20 calls, L2 flushed before each): per kernel, and the call
from its first kernel's start to its last kernel's end, at a few B on both generators. An experiment, not part
of the package (benchmarks/NOTES.md, twenty-sixth session); on a GPU machine:

  python benchmarks/experiments/top_p_route_profile.py [B ...]   (default: 1 32 64 256)
"""
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "server"))
from bench_kernels import load_peers  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Kernels, Outputs, RowParams  # noqa: E402

V = 151936
CALLS = 20


def kernel_name(event) -> str:
    """The kernel with its template arguments (the mass pass's two instances apart), without namespaces."""
    return event.name.split("(")[0].replace("void ", "").replace("tokensampler::", "")


def main() -> None:
    peers = load_peers()
    kernels = Kernels(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name, make in (("spiky", peers.spiky_logits), ("flat", peers.flat_logits)):
        for b in [int(arg) for arg in sys.argv[1:]] or (1, 32, 64, 256):
            logits = make(b, V, gen)
            params = RowParams.make(b, "cuda", top_p=0.9, seed=7)
            out = Outputs(tokens=torch.empty(b, 1, dtype=torch.int64, device="cuda"),
                          flags=torch.empty(b, dtype=torch.uint8, device="cuda"))
            pre = Outputs.row_stats(b, "cuda")
            for _ in range(5):
                kernels.nucleus(logits, params, pre, out, 0)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    flush.zero_()
                    kernels.nucleus(logits, params, pre, out, 0)
                torch.cuda.synchronize()
            events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                            key=lambda e: e.time_range.start)
            times: dict[str, list[float]] = defaultdict(list)
            spans: list[float] = []
            span: list[float] | None = None
            for event in events:
                if "elementwise" in event.name or "fill" in event.name.lower() or "Memset" in event.name:
                    if span:  # the flush: the call before it has ended
                        spans.append(span[1] - span[0])
                    span = None
                    continue
                times[kernel_name(event)].append(event.time_range.end - event.time_range.start)
                start, end = event.time_range.start, event.time_range.end
                span = [start, end] if span is None else [span[0], max(span[1], end)]
            if span:
                spans.append(span[1] - span[0])
            per_kernel = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in times.items())
            print(f"{name} B={b}: call {statistics.median(spans):.1f} us | {per_kernel}", flush=True)


if __name__ == "__main__":
    main()
