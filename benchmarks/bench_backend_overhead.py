"""Host overhead of one `CudaBackend.sample` call, per mode and B (the in-process call of the service path).

  python benchmarks/bench_backend_overhead.py [--batches 1,8,64] [--iters 300] [--json out.json]
      [--baseline path/to/older/cuda.py] [--check] [--profile]

For each mode and B it times `backend.sample(batch)` (perf_counter around the call: p50, p99) on spiky
fp32 logits [B, 151936] already on the GPU, as bench_service.py's `inprocess` method does, and the GPU
time of the same kernels launched back to back through cuda_kernels (CUDA events), so that
`host_us = p50 - kernel_us` is the per-call overhead of the backend's Python and copies.
Modes: greedy, gumbel, top_k_top_p (k = 50, p = 0.9), top_p, min_p with plain token outputs; `mixed`
(rows cycling through those five); and, wall time only, `top_k_top_p+raw_logprobs`,
`top_k_top_p+processed_top5` and `top_k_top_p+penalties` (logit processing).

--baseline loads another version of backends/cuda.py (e.g. the one before a change) as a second backend
and times it beside the current one in the same process. --check compares the two backends' results,
field by field and bit for bit, on a matrix of batches (modes, mixed rows, samples, log-probs,
processing, bf16, logits on the CPU and on the GPU). --profile prints cProfile's top entries for the
current backend at B = 1, top_k_top_p.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

sys.path.insert(0, str(ROOT / "benchmarks"))
from generators import spiky_logits  # noqa: E402
from wall import wall_us  # noqa: E402
from tokensampler_server.backends.cuda import CudaBackend  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Outputs, RowParams  # noqa: E402
from tokensampler_server.model.sampling import LogitProcessing, LogprobsMode, SamplingBatch, TokenEntries  # noqa: E402

V = 151936
MODES = {
    "greedy": {"temperature": 0.0},
    "gumbel": {"temperature": 1.0},
    "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
}



def make_batch(x: torch.Tensor, modes: list[str], *, num_samples: int = 1, seed: int = 0, **extra) -> SamplingBatch:
    b = x.shape[0]

    def per_row(key: str, default: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([MODES[m].get(key, default) for m in modes], dtype=dtype)

    return SamplingBatch(
        logits=x, temperature=per_row("temperature", 1.0, torch.float32), top_k=per_row("top_k", 0, torch.int32),
        top_p=per_row("top_p", 1.0, torch.float32), min_p=per_row("min_p", 0.0, torch.float32),
        seed=torch.arange(b, dtype=torch.int64) * 7919 + seed, position=torch.arange(b, dtype=torch.int64) % 97,
        iteration=torch.full((b,), 3, dtype=torch.int64), num_samples=num_samples, **extra)


def penalties(b: int, vocab: int) -> LogitProcessing:
    rows = torch.arange(b).repeat_interleave(16)
    tokens = torch.randint(0, vocab, (16 * b,), generator=torch.Generator().manual_seed(b))
    return LogitProcessing(output_tokens=TokenEntries(rows, tokens), repetition_penalty=torch.full((b,), 1.1),
                           presence_penalty=torch.full((b,), 0.2), frequency_penalty=torch.full((b,), 0.1))


def load_baseline(path: str):
    """Another version of backends/cuda.py, imported inside the package so that its relative imports work."""
    name = "tokensampler_server.backends._cuda_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.CudaBackend(0)


def wall(call, iters: int, warmup: int = 20) -> tuple[float, float, float]:
    """(p50, p99, mean) of call() in microseconds."""
    times = wall_us(call, iters, warmup)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99)), float(times.mean())


def kernel_time(backend: CudaBackend, x: torch.Tensor, mode: str, reps: int = 50) -> float:
    """GPU time (µs) of the kernels one call of `mode` launches, back to back, by CUDA events."""
    k, dev, b = backend._kernels, x.device, x.shape[0]
    p = MODES[mode]
    params = RowParams.make(b, dev, temperature=p["temperature"] or 1.0, top_k=p.get("top_k", 0),
                            top_p=p.get("top_p", 1.0), min_p=p.get("min_p", 0.0), seed=7)
    e = lambda dtype, *shape: torch.empty(shape or (b,), dtype=dtype, device=dev)  # noqa: E731
    main = Outputs(tokens=e(torch.int64, b, 1), flags=e(torch.uint8), row_max=e(torch.float32),
                   row_min=e(torch.float32), row_logz=e(torch.float32))
    filt = Outputs(tokens=e(torch.int64, b, 1), flags=e(torch.uint8), row_max=e(torch.float32),
                   kept_mass=e(torch.float32), kept_min_key=e(torch.int64))
    pre = Outputs(tokens=e(torch.int64, b, 1), flags=e(torch.uint8), row_max=filt.row_max, row_min=e(torch.float32))

    def launch() -> None:
        if mode == "greedy":
            k.stats(x, params, main)
        elif mode == "gumbel":
            k.gumbel(x, params, main, 0)
        elif mode == "top_k_top_p":
            k.topk(x, params, filt, k.topk_bucket(50))
        else:
            k.stats(x, params, pre)
            k.filter(x, params, pre, filt, 0)

    for _ in range(5):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def timing_cases(b: int, x: torch.Tensor):
    for mode in MODES:
        yield mode, make_batch(x, [mode] * b)
    names = list(MODES)
    yield "mixed", make_batch(x, [names[i % len(names)] for i in range(b)])
    yield "top_k_top_p+raw_logprobs", make_batch(x, ["top_k_top_p"] * b, return_logprobs=True)
    yield "top_k_top_p+processed_top5", make_batch(x, ["top_k_top_p"] * b, return_logprobs=True, top_logprobs=5,
                                                   logprobs_mode=LogprobsMode.PROCESSED)
    yield "top_k_top_p+penalties", make_batch(x, ["top_k_top_p"] * b, processing=penalties(b, x.shape[1]))


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def check_cases():
    names = list(MODES) + ["large_k", "top_k_min_p", "greedy_k"]
    MODES.update({"large_k": {"temperature": 1.0, "top_k": 1000, "top_p": 0.95},
                  "top_k_min_p": {"temperature": 1.3, "top_k": 200, "min_p": 0.1},
                  "greedy_k": {"temperature": 0.0, "top_k": 20, "top_p": 0.8}})
    gen = torch.Generator().manual_seed(3)
    for vocab, sizes in ((1000, (1, 8, 64, 130, 300)), (V, (1, 8, 64))):
        for b in sizes:
            x = spiky_logits(b, vocab, "cuda", seed=b)
            if b > 2:
                x[1] = float("-inf")
                x[2, 7] = float("nan")
            mixed = [names[int(i)] for i in torch.randint(0, len(names), (b,), generator=gen)]
            for ns in (1, 3):
                for mode in names:
                    yield f"{mode} V={vocab} B={b} S={ns}", make_batch(x, [mode] * b, num_samples=ns)
                yield f"mixed V={vocab} B={b} S={ns}", make_batch(x, mixed, num_samples=ns)
                for lp in (LogprobsMode.RAW, LogprobsMode.PROCESSED):
                    yield (f"mixed+{lp.value} V={vocab} B={b} S={ns}",
                           make_batch(x, mixed, num_samples=ns, return_logprobs=True, top_logprobs=3, logprobs_mode=lp))
                    yield (f"top_k_top_p+{lp.value} V={vocab} B={b} S={ns}",
                           make_batch(x, ["top_k_top_p"] * b, num_samples=ns, return_logprobs=True, logprobs_mode=lp))
            yield f"mixed+penalties V={vocab} B={b}", make_batch(x, mixed, num_samples=2, processing=penalties(b, vocab))
            yield (f"mixed+penalties+processed V={vocab} B={b}",
                   make_batch(x, mixed, processing=penalties(b, vocab), return_logprobs=True, top_logprobs=2,
                              logprobs_mode=LogprobsMode.PROCESSED))
            yield f"mixed bf16 V={vocab} B={b}", make_batch(x.to(torch.bfloat16), mixed, num_samples=2)
            yield f"mixed cpu-logits V={vocab} B={b}", make_batch(x.cpu(), mixed, num_samples=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--baseline", help="another cuda.py to time (and --check) beside the current one")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    backend = CudaBackend(0)
    backends = {"current": backend}
    if args.baseline:
        backends["baseline"] = load_baseline(args.baseline)
    rows = []
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, V = {V}", flush=True)
    for b in [int(v) for v in args.batches.split(",")]:
        x = spiky_logits(b, V, "cuda")
        for case, batch in timing_cases(b, x):
            kernel = kernel_time(backend, x, case) if case in MODES else None
            for name, be in backends.items():
                p50, p99, mean = wall(lambda: be.sample(batch), args.iters)
                row = {"backend": name, "case": case, "B": b, "p50_us": round(p50, 1), "p99_us": round(p99, 1),
                       "mean_us": round(mean, 1)}
                if kernel is not None:
                    row["kernel_us"] = round(kernel, 1)
                    row["host_us"] = round(p50 - kernel, 1)
                rows.append(row)
                extra = f"  kernel {kernel:7.1f}  host {p50 - kernel:7.1f}" if kernel is not None else ""
                print(f"{name:9s} {case:28s} B={b:<3d} p50 {p50:8.1f} us  p99 {p99:8.1f}  mean {mean:8.1f}{extra}",
                      flush=True)

    summary = {}
    if args.check and "baseline" in backends:
        checked, bad = 0, []
        for label, batch in check_cases():
            new, old = backend.sample(batch), backends["baseline"].sample(batch)
            fields = [f for f in ("tokens", "valid", "nan_detected", "logprobs", "top_logprob_ids", "top_logprobs")
                      if not same(getattr(new, f), getattr(old, f))]
            checked += 1
            if fields:
                bad.append(f"{label}: {', '.join(fields)}")
        summary = {"checked": checked, "differing": bad}
        print(f"CHECK identical results on {checked - len(bad)} of {checked} batches", flush=True)
        for line in bad:
            print("  DIFFERS", line, flush=True)

    if args.profile:
        import cProfile
        import pstats

        x = spiky_logits(1, V, "cuda")
        batch = make_batch(x, ["top_k_top_p"])
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            backend.sample(batch)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)

    if args.json:
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "vocab": V,
                "date": datetime.date.today().isoformat(), "iters": args.iters}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "check": summary}, indent=1))


if __name__ == "__main__":
    main()
