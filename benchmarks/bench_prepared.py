"""Prepared calls (workload `prepared`; docs/inprocess.md, "Prepared calls"): what a call costs an engine in its own
process, from fp32 logits [B, V] already on the GPU, T 0.8 with top-k 50 + top-p 0.9 or top-p 0.9 alone, a seed a
row.

  python benchmarks/bench_prepared.py [--batches 1,8,64,256] [--peers PATH | --no-peers] [--out benchmarks/results]

Methods, each a call and then a wait for its tokens (the host clock: latency as a decode loop that reads them sees
it), and the call's time on the GPU's clock (CUDA events around back-to-back calls, L2 flushed: peers.bench; for a
call bound by its host work, that includes the GPU's idle gaps):
  sample           LocalSampler.sample: the request's validation, the plan, the fast routes, one synchronisation
  prepared         LocalSampler.prepare's call: the exact routes, no validation, planning or synchronisation inside
  prepared_graph   the same call captured in a CUDA graph, replayed
  flashinfer       FlashInfer's top_k_top_p_sampling_from_logits (top_p_sampling_from_probs after a softmax for
                   top-p alone) on logits / T, where the peers module imports it
Writes prepared-<gpu>-<date>.json: per method, mode and B the wall p50 and the GPU time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "client"), str(ROOT / "benchmarks")]

from bench_kernels import import_flashinfer, kernel_bench_arguments, run_meta, write_results  # noqa: E402
from wall import wall_us  # noqa: E402
from tokensampler_server.inprocess import LocalSampler, capture  # noqa: E402

V = 151936
T = 0.8
MODES = {"top_k_top_p": {"top_k": 50, "top_p": 0.9}, "top_p": {"top_p": 0.9}}
ITERS, WARMUP = 300, 30


def waited(call: Callable[[], Any]) -> Callable[[], None]:
    """call() and a wait for the GPU: what a caller that reads the tokens sees."""

    def run() -> None:
        call()
        torch.cuda.synchronize()
    return run


def methods(sampler: LocalSampler, fi: Any, logits: torch.Tensor, mode: str) -> dict[str, Callable[[], Any]]:
    rows = logits.shape[0]
    params = {"temperature": T, "seed": list(range(rows)), **MODES[mode]}
    prepared = sampler.prepare(rows, V, **params)
    calls: dict[str, Callable[[], Any]] = {
        "sample": lambda: sampler.sample(logits, position=1, **params),
        "prepared": lambda: prepared(logits),
        "prepared_graph": capture(lambda: prepared(logits))[0].replay,
    }
    if fi is not None:
        if mode == "top_k_top_p":
            calls["flashinfer"] = lambda: fi.top_k_top_p_sampling_from_logits(logits / T, 50, 0.9)
        else:
            calls["flashinfer"] = lambda: fi.top_p_sampling_from_probs(torch.softmax(logits / T, dim=-1), 0.9)
    return calls


def main() -> None:
    args, batches, peers = kernel_bench_arguments("1,8,64,256")
    meta = run_meta(peers)
    fi = import_flashinfer(peers, meta) if hasattr(peers, "import_with_stubs") else None
    meta.update({"V": V, "temperature": T, "modes": MODES, "wall": f"host clock, a call and its wait, p50 of {ITERS}"})
    sampler = LocalSampler("cuda")
    rows_out: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in batches:
        logits = peers.spiky_logits(rows, V, gen)
        for mode in MODES:
            for name, call in methods(sampler, fi, logits, mode).items():
                wall = wall_us(waited(call), ITERS, WARMUP)
                row = {"workload": "prepared", "method": name, "mode": mode, "B": rows,
                       "wall_p50_us": round(float(np.median(wall)), 1),
                       "wall_p99_us": round(float(np.percentile(wall, 99)), 1),
                       "gpu_us": round(float(peers.bench(call)), 1)}
                rows_out.append(row)
                print(f"prepared B={rows:4d} {mode:12s} {name:15s} wall p50 {row['wall_p50_us']:8.1f} us  "
                      f"gpu {row['gpu_us']:8.1f} us", flush=True)
    write_results(Path(args.out), "prepared", meta, rows_out, plot_value="wall_p50_us")


if __name__ == "__main__":
    main()
