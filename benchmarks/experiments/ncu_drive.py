"""One call of a tokensampler kernel path between cudaProfilerStart and cudaProfilerStop, after five warm-up
calls, so that `ncu --profile-from-start off` profiles exactly one call (ncu_profile.sh runs it). An
experiment, not part of the package (benchmarks/NOTES.md, twenty-ninth session); on a GPU machine:

  python benchmarks/experiments/ncu_drive.py flat 256 top_p      # logits path: flat|spiky, B, a bench_kernels mode
  python benchmarks/experiments/ncu_drive.py fused 64 gumbel     # hidden-state path: B, gumbel|top_k_top_p
"""
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "server")]
from bench_kernels import tokensampler_fn  # noqa: E402
from generators import spiky_logits  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Kernels  # noqa: E402

V, D = 151936, 4096


def path_call(what: str, b: int, mode: str):
    """The timed call of bench_fused / bench_kernels for this workload, on the benchmark's inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    if what == "fused":
        from bench_fused import fused_fn  # noqa: PLC0415

        weight = torch.randn(V, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        hidden = torch.randn(b, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        return fused_fn(weight, hidden, mode)
    logits = spiky_logits(b, V, "cuda") if what == "spiky" else torch.randn(b, V, device="cuda", generator=gen)
    return tokensampler_fn(Kernels(torch.cuda.current_device()), mode, logits)


def main() -> None:
    what, b, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    call = path_call(what, b, mode)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
