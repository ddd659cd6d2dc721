"""Kernel benchmark of the logits path (the LOGITS workload of docs/performance.md).

  python benchmarks/bench_kernels.py --peers PATH/peers.py [--out benchmarks/results] [--batches 1,8,32,64,128,256]
  python benchmarks/bench_kernels.py --no-peers          # tokensampler alone, from this repository only
  python benchmarks/bench_kernels.py --set adversarial --no-peers   # the unusual-but-valid parameters

For both generators (spiky, flat) and every B, times the tokensampler kernels in the six modes
(greedy, gumbel, top_k_top_p, top_k, top_p, min_p; k, p, T, min_p as per-row tensors) next to the
peers of the peers module (`--peers`, or $PEERS_PY) in the same process on the same logits: torch
argmax, FlashInfer's samplers, the PyTorch-native vLLM path. Writes logits-<generator>-<gpu>-<date>.json (rows: workload, method,
mode, B, median_us, roofline_us, of_roofline) and a PNG plot per file.

`--set adversarial` times whole backend calls (CudaBackend.sample on logits already on the GPU: planning, the
one upload, the launches, the one copy back) of the parameters an engine lets its users pick, beside the same
call of top-k 50: k in {256, 1000, 4096, V/2}, k 1000 + top-p 0.9, k V/2 + top-p 0.5, a k per row uniform in
[1, V] with top-p 0.9, and fp16 logits with top-k 50 + top-p 0.9. Writes adversarial-<gpu>-<date>.json with the
ratio to top-k 50 at the same B and generator, and the rows a fast kernel left to the exact filter. `--samples N`
draws N samples a row in every call (FlashInfer: each row repeated N times, one sample each) and writes
adversarial-samplesN-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from tokensampler_server.backends.cuda import CudaBackend  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Kernels, Outputs, RowParams  # noqa: E402
from tokensampler_server.model.sampling import SamplingBatch  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import tree_commit  # noqa: E402

V = 151936
TOP_K, TOP_P, MIN_P = 50, 0.9, 0.05
MODES = ("greedy", "gumbel", "top_k_top_p", "top_k", "top_p", "min_p")
# mode: (top_k, top_p, dtype); top_k "per_row": uniform in [1, V] per row.
# FlashInfer's forms of one mode; its fastest is the peer of the targets.
FLASHINFER_FORMS = {
    "flashinfer_fastest_topk_topp": ("flashinfer_topk_topp", "flashinfer_topk_topp_scalar_k"),
    "flashinfer_fastest_top_p": ("flashinfer_softmax+top_p", "flashinfer_fused_softmax+top_p"),
    "flashinfer_fastest_min_p": ("flashinfer_softmax+min_p", "flashinfer_fused_softmax+min_p"),
}

ADVERSARIAL = {
    "top_k_50": (50, 1.0, torch.float32),
    "top_k_256": (256, 1.0, torch.float32),
    "top_k_1000": (1000, 1.0, torch.float32),
    "top_k_4096": (4096, 1.0, torch.float32),
    "top_k_75968": (V // 2, 1.0, torch.float32),
    "top_k_1000_top_p_0.9": (1000, 0.9, torch.float32),
    "top_k_75968_top_p_0.5": (V // 2, 0.5, torch.float32),
    "per_row_k_top_p_0.9": ("per_row", 0.9, torch.float32),
    "fp16_top_k_50_top_p_0.9": (50, 0.9, torch.float16),
}


def add_peers_arguments(ap: argparse.ArgumentParser) -> None:
    """--peers PATH and --no-peers, shared by the kernel benchmarks."""
    ap.add_argument("--peers", default=os.environ.get("PEERS_PY"),
                    help="the peers module (peers.py) whose peers are timed beside tokensampler; default $PEERS_PY")
    ap.add_argument("--no-peers", action="store_true", help="time the tokensampler kernels only")


def kernel_bench_arguments(default_batches: str, ap: argparse.ArgumentParser | None = None):
    """(args, batch sizes, peers module) of a kernel benchmark: --out, --batches and the peers' flags, beside the
    flags already on `ap`."""
    ap = ap or argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--batches", default=default_batches)
    add_peers_arguments(ap)
    args = ap.parse_args()
    return args, [int(b) for b in args.batches.split(",")], load_peers(args.peers, args.no_peers)


def load_peers(path: str | None, no_peers: bool):
    """The module the benchmark times with: the peers module at `path`, or with --no-peers and no path this
    repository's own timing.py (same helper names, no peers)."""
    if path:
        if not Path(path).is_file():
            raise SystemExit(f"--peers: no file {path}")
        spec = importlib.util.spec_from_file_location("peers", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if not no_peers:
        raise SystemExit("timing the peers needs their module: pass --peers PATH (or set PEERS_PY), or --no-peers")
    import timing  # noqa: PLC0415 - benchmarks/ is on sys.path

    return timing


def tokensampler_fn(kernels: Kernels, mode: str, logits: torch.Tensor):
    """The call timed for one mode: launches only, outputs allocated inside as a caller would (the row
    statistics the two-launch routes pass between their kernels are workspace, allocated once)."""
    b = logits.shape[0]
    dev = logits.device
    params = {
        "greedy": RowParams.make(b, dev, temperature=0.0),
        "gumbel": RowParams.make(b, dev, temperature=1.0, seed=7),
        "top_k_top_p": RowParams.make(b, dev, top_k=TOP_K, top_p=TOP_P, seed=7),
        "top_k": RowParams.make(b, dev, top_k=TOP_K, seed=7),
        "top_p": RowParams.make(b, dev, top_p=TOP_P, seed=7),
        "min_p": RowParams.make(b, dev, min_p=MIN_P, seed=7),
    }[mode]
    bucket = kernels.topk_bucket(TOP_K)
    # The two-launch routes' intermediate row statistics are workspace, reused from call to call as the backend
    # reuses its buffers (allocating four tensors a call made the host, not the GPU, the bound at small B).
    pre = Outputs.row_stats(b, dev)

    def run() -> torch.Tensor:
        out = Outputs(tokens=torch.empty(b, 1, dtype=torch.int64, device=dev),
                      flags=torch.empty(b, dtype=torch.uint8, device=dev))
        if mode == "greedy":
            kernels.stats(logits, params, out)
        elif mode == "gumbel":
            kernels.gumbel(logits, params, out, 0)
        elif mode in ("top_k_top_p", "top_k"):
            kernels.topk(logits, params, out, bucket)
        elif mode == "top_p" and b >= kernels.module.FRONTIER_MIN_ROWS:  # the route planner's choice (csrc/routes.cpp)
            kernels.nucleus(logits, params, pre, out, 0)
        elif mode == "min_p":
            kernels.stats(logits, params, pre)
            kernels.min_p(logits, params, pre, out, 0)
        else:
            kernels.stats(logits, params, pre)
            kernels.filter(logits, params, pre, out, 0)
        return out.tokens

    return run


def print_targets(workload: str, rows: list[dict]) -> None:
    """The project's targets as ratios inside this run, one line per target (B ascending)."""
    t = {(r["method"] if r["method"] != "tokensampler" else r["mode"], r["B"]): r["median_us"] for r in rows}
    for fastest, forms in FLASHINFER_FORMS.items():  # the peer is FlashInfer's fastest form of each mode
        for b in {r["B"] for r in rows}:
            times = [t[(form, b)] for form in forms if (form, b) in t]
            if times:
                t[(fastest, b)] = min(times)
    bs = sorted({r["B"] for r in rows})
    checks = [("gumbel/argmax <= 1.3", "gumbel", "torch_argmax", 1.3, False),
              ("greedy/argmax <= 1.0", "greedy", "torch_argmax", 1.0, False),
              ("top_k/argmax <= 1.5", "top_k", "torch_argmax", 1.5, False),
              ("top_k_top_p/argmax <= 1.5", "top_k_top_p", "torch_argmax", 1.5, False),
              ("FI fastest top_k_top_p / top_k >= 3", "top_k", "flashinfer_fastest_topk_topp", 3.0, True),
              ("FI fastest top_k_top_p / top_k_top_p >= 3", "top_k_top_p", "flashinfer_fastest_topk_topp", 3.0, True),
              ("FI fastest top_p / top_p >= 2", "top_p", "flashinfer_fastest_top_p", 2.0, True),
              ("FI fastest min_p / min_p >= 2", "min_p", "flashinfer_fastest_min_p", 2.0, True)]
    for name, ours, peer, bound, speedup in checks:
        cells = []
        for b in bs:
            if (ours, b) not in t or (peer, b) not in t:
                cells.append("  -  ")
                continue
            ratio = t[(peer, b)] / t[(ours, b)] if speedup else t[(ours, b)] / t[(peer, b)]
            ok = ratio >= bound if speedup else ratio <= bound
            cells.append(f"{ratio:5.2f}{'' if ok else '*'}")
        print(f"TARGET {workload:13s} {name:34s} " + " ".join(cells), flush=True)


def gpu_slug(name: str) -> str:
    for short in ("H200", "H100", "B200", "A100", "L40S"):
        if short in name:
            return short.lower()
    return name.lower().replace(" ", "-")


def run_meta(peers) -> dict:
    """What every result file records about its run: GPU, torch, commit, date, measured bandwidths."""
    copy_bw, read_bw = peers.bandwidth()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": tree_commit(),
            "date": datetime.date.today().isoformat(), "read_bw_GBps": round(read_bw / 1e9, 1),
            "copy_bw_GBps": round(copy_bw / 1e9, 1), "timing": "triton do_bench warmup=25 rep=100 median, L2 flushed"}


def import_flashinfer(peers, meta: dict):
    """flashinfer.sampling through the peers module's stubs, or None; meta["flashinfer"] records which."""
    try:
        fi = peers.import_with_stubs("flashinfer.sampling")
    except Exception as err:  # noqa: BLE001 - recorded in the results, the run goes on
        meta["flashinfer"] = f"unavailable: {type(err).__name__}: {err}"[:300]
        return None
    meta["flashinfer"] = "imported"
    return fi


def write_results(out_dir: Path, workload: str, meta: dict, rows: list[dict], plot_value: str = "median_us") -> Path:
    """<out_dir>/<workload>-<gpu>-<date>.json, and its PNG plot of `plot_value` where matplotlib is installed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{workload}-{gpu_slug(meta['gpu'])}-{meta['date']}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}", flush=True)
    try:
        from plot_results import plot  # noqa: PLC0415 - optional: needs matplotlib

        plot(path, plot_value)
    except ImportError as err:
        print(f"no plot: {err}", flush=True)
    return path


def adversarial_batch(mode: str, logits: torch.Tensor, gen: torch.Generator, num_samples: int) -> SamplingBatch:
    """The backend call of one adversarial mode over `logits` (per-row tensors, as a server batch carries)."""
    top_k, top_p, dtype = ADVERSARIAL[mode]
    b = logits.shape[0]
    if top_k == "per_row":
        k = torch.randint(1, V + 1, (b,), generator=gen, device="cuda").cpu().to(torch.int32)
    else:
        k = torch.full((b,), top_k, dtype=torch.int32)
    return SamplingBatch(
        logits=logits.to(dtype), temperature=torch.ones(b), top_k=k, top_p=torch.full((b,), top_p),
        min_p=torch.zeros(b), seed=torch.arange(b, dtype=torch.int64) + 7, position=torch.zeros(b, dtype=torch.int64),
        iteration=torch.zeros(b, dtype=torch.int64), num_samples=num_samples)


def flashinfer_adversarial(fi, peers, mode: str, batch: SamplingBatch) -> tuple[float, str]:
    """FlashInfer's fastest form of one adversarial request: per-row k and p tensors, or (one k for the batch) its
    scalar form; several samples a row as that many copies of the row. Returns (µs, form)."""
    n = batch.num_samples
    x = batch.logits.cuda().repeat_interleave(n, dim=0)
    k, p = batch.top_k.cuda().repeat_interleave(n), batch.top_p.cuda().repeat_interleave(n)
    forms = {"tensor_k": lambda: fi.top_k_top_p_sampling_from_logits(x, k, p)}
    if ADVERSARIAL[mode][0] != "per_row":
        k0, p0 = int(batch.top_k[0]), float(batch.top_p[0])
        forms["scalar_k"] = lambda: fi.top_k_top_p_sampling_from_logits(x, k0, p0)
    times = {name: peers.bench(fn) for name, fn in forms.items()}
    best = min(times, key=times.get)
    return round(times[best], 2), best


def run_adversarial(args, peers, batches: list[int]) -> None:
    """--set adversarial: whole backend calls of each mode, and each one's ratio to top-k 50 (see the docstring)."""
    backend = CudaBackend(torch.cuda.current_device())
    meta = {**run_meta(peers), "V": V, "call": "CudaBackend.sample, logits on the GPU", "num_samples": args.samples}
    read_bw = meta["read_bw_GBps"] * 1e9
    print(json.dumps(meta), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fi = None if args.no_peers else import_flashinfer(peers, meta)
    rows: list[dict] = []
    for gen_name, make in (("spiky", peers.spiky_logits), ("flat", peers.flat_logits)):
        for b in batches:
            logits = make(b, V, gen)
            roof = b * V * 4 / read_bw * 1e6
            base = None
            for mode in ADVERSARIAL:
                batch = adversarial_batch(mode, logits, gen, args.samples)
                before = backend.fallbacks()
                backend.sample(batch)
                after = backend.fallbacks()
                us = peers.bench(lambda: backend.sample(batch))
                base = base or us
                row = {"workload": "adversarial", "generator": gen_name, "method": "tokensampler", "mode": mode, "B": b,
                       "median_us": round(us, 2), "roofline_us": round(roof, 2), "of_roofline": round(roof / us, 3),
                       "of_top_k_50": round(us / base, 2), "exact_rows": after["exact_rows"] - before["exact_rows"]}
                if fi is not None:  # FlashInfer's fastest form of the same request
                    row["flashinfer_us"], row["flashinfer_form"] = flashinfer_adversarial(fi, peers, mode, batch)
                    row["flashinfer_over_ours"] = round(row["flashinfer_us"] / us, 2)
                rows.append(row)
                print(f"adversarial {gen_name:5s} {mode:26s} B={b:4d} {us:9.2f} us"
                      f"  x{row['of_top_k_50']:5.2f} of top-k 50  exact rows {row['exact_rows']}"
                      + (f"  FlashInfer {row['flashinfer_us']:9.2f} us ({row['flashinfer_form']})" if fi else ""),
                      flush=True)
            del logits
    write_results(Path(args.out), "adversarial" if args.samples == 1 else f"adversarial-samples{args.samples}", meta,
                  rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=("protocol", "adversarial"), default="protocol",
                    help="the protocol's modes (kernels alone), or the adversarial parameters (backend calls)")
    ap.add_argument("--samples", type=int, default=1, help="--set adversarial: samples a row in every call")
    args, batches, peers = kernel_bench_arguments("1,8,32,64,128,256", ap)
    if args.set == "adversarial":
        run_adversarial(args, peers, batches)
        return
    kernels = Kernels(torch.cuda.current_device())
    meta = {**run_meta(peers), "V": V, "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P}
    read_bw = meta["read_bw_GBps"] * 1e9
    fi = None if args.no_peers else import_flashinfer(peers, meta)
    print(json.dumps(meta), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for gen_name, make in (("spiky", peers.spiky_logits), ("flat", peers.flat_logits)):
        workload = f"logits-{gen_name}"
        rows: list[dict] = []

        def emit(method: str, mode: str | None, b: int, us: float, roof: float, **extra) -> None:
            row = {"workload": workload, "method": method, "mode": mode, "B": b, "median_us": round(us, 2),
                   "roofline_us": round(roof, 2), "of_roofline": round(roof / us, 3), **extra}
            rows.append(row)
            print(f"{workload:13s} {method:26s} {mode or '':12s} B={b:4d} {us:9.2f} us  roof {roof:7.2f}", flush=True)

        for b in batches:
            logits = make(b, V, gen)
            roof = b * V * 4 / read_bw * 1e6
            for mode in MODES:
                fn = tokensampler_fn(kernels, mode, logits)
                before = int(kernels.fallback_count.item())
                tokens = fn()
                if mode == "greedy":
                    assert torch.equal(tokens[:, 0], logits.argmax(dim=1)), "greedy disagrees with torch.argmax"
                fallbacks = int(kernels.fallback_count.item()) - before
                emit("tokensampler", mode, b, peers.bench(fn), roof, fallbacks_per_call=fallbacks)
            if args.no_peers:
                continue
            k = torch.full((b,), TOP_K, device="cuda", dtype=torch.int32)
            p = torch.full((b,), TOP_P, device="cuda", dtype=torch.float32)
            m = torch.full((b,), MIN_P, device="cuda", dtype=torch.float32)
            emit("torch_argmax", None, b, peers.bench(lambda: logits.argmax(dim=-1)), roof)
            emit("vllm_native_topk_topp", None, b, peers.bench(lambda: peers.vllm_native_topk_topp(logits, k, p)), roof)
            if fi is not None:
                try:
                    emit("flashinfer_topk_topp", None, b, peers.bench(lambda: fi.top_k_top_p_sampling_from_logits(logits, k, p)), roof)
                    # one int k for the batch: FlashInfer's radix fast path, its best case
                    emit("flashinfer_topk_topp_scalar_k", None, b, peers.bench(lambda: fi.top_k_top_p_sampling_from_logits(logits, TOP_K, TOP_P)), roof)
                    emit("flashinfer_gumbel", None, b, peers.bench(lambda: fi.sampling_from_logits(logits)), roof)
                    emit("flashinfer_softmax+top_p", None, b, peers.bench(lambda: fi.top_p_sampling_from_probs(torch.softmax(logits, -1), p)), roof)
                    emit("flashinfer_softmax+min_p", None, b, peers.bench(lambda: fi.min_p_sampling_from_probs(torch.softmax(logits, -1), m)), roof)
                    if hasattr(fi, "softmax"):  # its own softmax kernel before top-p / min-p
                        emit("flashinfer_fused_softmax+top_p", None, b, peers.bench(lambda: fi.top_p_sampling_from_probs(fi.softmax(logits), p)), roof)
                        emit("flashinfer_fused_softmax+min_p", None, b, peers.bench(lambda: fi.min_p_sampling_from_probs(fi.softmax(logits), m)), roof)
                except Exception as err:  # noqa: BLE001
                    meta["flashinfer"] = f"failed: {type(err).__name__}: {err}"[:300]
                    print(meta["flashinfer"], flush=True)
                    fi = None
            del logits
        print_targets(workload, rows)
        write_results(Path(args.out), workload, meta, rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
