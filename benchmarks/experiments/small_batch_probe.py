"""Are the small-B logits cells' slow readings the kernels or the host? For B = 1 and 8 and both generators,
each mode's benchmark call (bench_kernels.tokensampler_fn) is timed three times eagerly and three times
replayed from a CUDA graph (peers.bench: L2 flushed, medians), beside the host's own time a call (200
calls without synchronising). An experiment, not part of the package (benchmarks/NOTES.md, twentieth
session); on a GPU machine:

  python benchmarks/experiments/small_batch_probe.py
"""
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "server"))
from bench_kernels import load_peers, tokensampler_fn  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Kernels  # noqa: E402

V = 151936
MODES = ("greedy", "gumbel", "top_k_top_p", "top_p", "min_p")


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()  # warm-up off the capture stream, as torch's graph docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main() -> None:
    peers = load_peers()
    gen = torch.Generator(device="cuda").manual_seed(0)
    kernels = Kernels(0)
    for generator in ("spiky", "flat"):
        for b in (1, 8):
            x = getattr(peers, f"{generator}_logits")(b, V, gen)
            for mode in MODES:
                fn = tokensampler_fn(kernels, mode, x)
                fn()
                eager = [peers.bench(fn) for _ in range(3)]
                host = host_us(fn)
                replay = graph_of(fn).replay
                graph = [peers.bench(replay) for _ in range(3)]
                print(f"{generator} B={b} {mode:12s} eager " + " ".join(f"{t:6.1f}" for t in eager)
                      + "  graph " + " ".join(f"{t:6.1f}" for t in graph) + f"  host {host:6.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
