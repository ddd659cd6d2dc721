"""The local samplers' cost (workload `local_samplers`; docs/semantics.md, "Local samplers"): each sampler alone, and
typical-p with top-k 50 + top-p 0.9, against the call of top-k 50 + top-p 0.9 at the same B, in one process.

  python benchmarks/bench_local_samplers.py [--batch-sizes 1 8 64 256] [--history 4096] [--out benchmarks/results]
  python benchmarks/bench_local_samplers.py --device cpu --batch-sizes 1 8 --vocab 4096 --out /tmp   # a smoke test

Every case is a whole backend call, what a request pays: CudaBackend.sample (CpuBackend.sample with --device cpu) on
spiky fp32 logits [B, V] already on the device, with the batch validated from a request as the server does, so the
call does all of the processing (for DRY and no-repeat-n-gram: the upload of the rows' tiles and the comparisons).
The cases: typical_p 0.9; top_n_sigma 1.0; XTC (threshold 0.1, probability 1.0: every row's coin acts); min_tokens
with 10 stop ids not yet reached; no_repeat_ngram_size 3 and DRY (multiplier 0.8, base 1.75, allowed length 2,
llama.cpp's default breakers) over a history of --history random ids per row; typical_p 0.9 with top-k 50 +
top-p 0.9. The cases are timed in --rounds rounds, each case in turn within a round. Writes
local_samplers-<gpu>-<date>.json: per case and B the median µs over the rounds, the median and range of its ratio to
top-k 50 + top-p 0.9 in the same round, the one-read roofline and the time the request took to validate (once, on
the host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "client"), str(ROOT / "benchmarks")]

from bench_kernels import run_meta, write_results  # noqa: E402
from generators import spiky  # noqa: E402
from provenance import tree_commit  # noqa: E402
from wall import wall_us  # noqa: E402
from tokensampler_client.params import build_sample_request  # noqa: E402
from tokensampler_server.backends.cpu import CpuBackend  # noqa: E402
from tokensampler_server.core.config import Limits  # noqa: E402
from tokensampler_server.validation.sample import validate_sample_request  # noqa: E402

REFERENCE = "top_k_50_top_p_0.9"
TARGET = 1.5
# llama.cpp's default DRY breakers "\n", ":", "\"", "*", as Qwen2's tokenizer (V = 151936) writes them.
BREAKERS = [[198], [25], [1], [9]]
STOP_IDS = [151643, 151645] + list(range(8))


def cases(num_rows: int, vocab: int, history: int) -> dict[str, dict[str, Any]]:
    """The request parameters of every case, the reference first."""
    histories = np.random.default_rng(num_rows).integers(0, vocab, (num_rows, history))
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_sequence_breakers": BREAKERS}
    return {
        REFERENCE: {"top_k": 50, "top_p": 0.9},
        "typical_p_0.9": {"typical_p": 0.9},
        "top_n_sigma_1.0": {"top_n_sigma": 1.0},
        "xtc_0.1_1.0": {"xtc_threshold": 0.1, "xtc_probability": 1.0},
        "min_tokens_10_stop_ids": {"min_tokens": 16, "num_generated": 3,
                                   "stop_token_ids": [i % vocab for i in STOP_IDS]},
        f"no_repeat_ngram_3_history_{history}": {"no_repeat_ngram_size": 3, "output_token_ids": histories},
        f"dry_history_{history}": {**dry, "output_token_ids": histories},
        "typical_p_0.9_top_k_50_top_p_0.9": {"typical_p": 0.9, "top_k": 50, "top_p": 0.9},
    }


def cpu_bench(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median µs of `fn` on the host clock, after one call."""
    return float(np.median(wall_us(fn, repeats, warmup=1)))


def cpu_meta() -> dict:
    """run_meta's record for a CPU run: the read bandwidth of a float32 sum over 256 MiB."""
    x = torch.ones(1 << 26)
    read_bw = x.numel() * 4 / (cpu_bench(x.sum, 3) * 1e-6)
    return {"gpu": "cpu", "torch": torch.__version__, "commit": tree_commit(),
            "date": datetime.date.today().isoformat(), "read_bw_GBps": round(read_bw / 1e9, 1), "timing": "perf_counter median of 7 calls after one"}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--history", type=int, default=4096, help="ids per row of DRY's and no-repeat-n-gram's sequences")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every case in turn; medians over them")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if args.device == "cuda":
        import timing  # noqa: PLC0415 - triton's timer, CUDA only
        from tokensampler_server.backends.cuda import CudaBackend  # noqa: PLC0415

        backend, bench, meta = CudaBackend(torch.cuda.current_device()), timing.bench, run_meta(timing)
    else:
        backend, bench, meta = CpuBackend(), cpu_bench, cpu_meta()
    meta = {**meta, "V": args.vocab, "history": args.history, "rounds": args.rounds,
            "call": f"{type(backend).__name__}.sample, logits on the device"}
    print(json.dumps(meta), flush=True)
    read_bw = meta["read_bw_GBps"] * 1e9
    gen = torch.Generator(device=args.device).manual_seed(0)
    rows: list[dict] = []
    for num_rows in args.batch_sizes:
        logits = spiky(num_rows, args.vocab, gen)
        roof = num_rows * args.vocab * 4 / read_bw * 1e6
        calls = {}
        for mode, params in cases(num_rows, args.vocab, args.history).items():
            request = build_sample_request(torch.zeros(num_rows, args.vocab, dtype=torch.float16),
                                           seed=list(range(num_rows)), **params)
            start = time.perf_counter()
            batch, _ = validate_sample_request(request, Limits())
            validate_us = 1e6 * (time.perf_counter() - start)
            batch = replace(batch, logits=logits)
            assert bool(backend.sample(batch).valid.all())
            calls[mode] = (batch, validate_us)
        # Rounds of every case in turn: a whole call is mostly host work at small B, and the host's speed drifts
        # within a run, so each case is compared with the reference of its own round.
        times = {mode: [] for mode in calls}
        for _ in range(args.rounds):
            for mode, (batch, _) in calls.items():
                times[mode].append(bench(lambda batch=batch: backend.sample(batch)))
        for mode, (_, validate_us) in calls.items():
            us = float(np.median(times[mode]))
            ratios = np.array(times[mode]) / np.array(times[REFERENCE])
            ratio = float(np.median(ratios))
            rows.append({"workload": "local_samplers", "method": "tokensampler", "mode": mode, "B": num_rows,
                         "median_us": round(us, 2), "roofline_us": round(roof, 2), "of_roofline": round(roof / us, 3),
                         "of_reference": round(ratio, 2),
                         "of_reference_range": [round(float(ratios.min()), 2), round(float(ratios.max()), 2)],
                         "validate_us": round(validate_us, 1)})
            print(f"local_samplers {mode:36s} B={num_rows:4d} {us:10.2f} us  x{ratio:5.2f} of {REFERENCE}"
                  f" ({ratios.min():.2f}-{ratios.max():.2f} over {args.rounds} rounds)"
                  f"  validated in {validate_us / 1e3:8.2f} ms", flush=True)
        del logits, calls
    for mode in dict.fromkeys(row["mode"] for row in rows if row["mode"] != REFERENCE):
        ratios = [row["of_reference"] for row in rows if row["mode"] == mode]
        cells = [f"{ratio:5.2f}{'' if ratio <= TARGET else '*'}" for ratio in ratios]
        print(f"TARGET local_samplers {mode:36s} <= {TARGET} x {REFERENCE}: " + " ".join(cells), flush=True)
    return write_results(Path(args.out), "local_samplers", meta, rows)


if __name__ == "__main__":
    main()
