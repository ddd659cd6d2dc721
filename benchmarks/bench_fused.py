"""FUSED workload benchmark (docs/performance.md): hidden states [B, D] bf16 x LM head [V, D] bf16.

  python benchmarks/bench_fused.py (--peers PATH/peers.py | --no-peers) [--out benchmarks/results] [--batches 1,8,32,64,128,256]
  python benchmarks/bench_fused.py --no-peers --devices 0,1 [--batches 1,8,32,64,128]   # vocabulary-parallel mode

Times, in one process on the same W and h: the fused kernel (`tokensampler_fused`: gumbel, and
top_k_top_p with raw log-probs on), cuBLAS into fp32 logits followed by our logits kernels
(`tokensampler_unfused`), `tokensampler` = the one of the two the CUDA backend picks
(cuda_fused.fused_is_faster), and the peers: cuBLAS matmul alone, matmul + FlashInfer sampling_from_logits
and top_k_top_p_sampling_from_logits, FlashSampling's Triton kernel when its fs_core module imports.
Every row carries the HBM roofline (W bytes / measured read bandwidth).
Writes fused-<gpu>-<date>.json and a PNG.

With --devices, the vocabulary-parallel mode instead (docs/design/vocab-parallel.md): the head split over 1 and
N GPUs (`VocabParallelHead.launch`: each GPU's first stage on its shard, one NCCL all-gather of the partials, the
second stage on the first GPU), at V = 151936, D = 4096 and V = 262144, D = 8192, gumbel and top_k_top_p with raw
log-probs; and the all-gather alone of the same bytes. Timed on the first GPU's stream; writes
fused-vocab-parallel-x<N>-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import import_flashinfer, kernel_bench_arguments, run_meta, tokensampler_fn, write_results  # noqa: E402
from tokensampler_server.backends import cuda_fused  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Kernels, RowParams  # noqa: E402

V, D = 151936, 4096
TOP_K, TOP_P = 50, 0.9


def fused_fn(weight: torch.Tensor, hidden: torch.Tensor, mode: str):
    b = hidden.shape[0]
    if mode == "gumbel":
        params = RowParams.make(b, weight.device, temperature=1.0, seed=7)
        return lambda: cuda_fused.fused_sample(weight, hidden, params, filtered=False)[0]
    params = RowParams.make(b, weight.device, top_k=TOP_K, top_p=TOP_P, seed=7)
    return lambda: cuda_fused.fused_sample(weight, hidden, params, logprobs=True)[0]


def unfused_fn(kernels: Kernels, weight: torch.Tensor, hidden: torch.Tensor, mode: str):
    """cuBLAS W·h into fp32 logits (tensor cores, fp32 accumulation), then the logits kernel."""
    logits = torch.mm(hidden, weight.T, out_dtype=torch.float32)
    sample = tokensampler_fn(kernels, mode, logits)

    def run() -> torch.Tensor:
        torch.mm(hidden, weight.T, out_dtype=torch.float32, out=logits)
        return sample()

    return run


def print_targets(rows: list[dict]) -> None:
    t = {(r["method"], r.get("mode"), r["B"]): r["median_us"] for r in rows}
    roof = {r["B"]: r["roofline_us"] for r in rows}
    for b in sorted(roof):
        gumbel = t.get(("tokensampler", "gumbel", b))
        topk = t.get(("tokensampler", "top_k_top_p", b))
        cublas = t.get(("cublas_matmul_only", None, b))
        fi = t.get(("matmul+flashinfer_gumbel", None, b))
        cells = [f"B={b:4d}", f"gumbel {gumbel:8.1f} us", f"roof/gumbel {roof[b] / gumbel:5.3f} (>=0.95 for B<=64)"]
        if cublas:
            cells.append(f"gumbel/cuBLAS {gumbel / cublas:5.3f} (<=1.05 for B>=128)")
        if fi:
            cells.append(f"gumbel/(cuBLAS+FI) {gumbel / fi:5.3f} (<1)")
        if topk:
            cells.append(f"top_k_top_p+logprobs/gumbel {topk / gumbel:5.3f} (<=1.1)")
        print("TARGET fused " + "  ".join(cells), flush=True)


VOCAB_PARALLEL_SHAPES = ((151936, 4096), (262144, 8192))


def vocab_parallel_fn(sharded, hidden: torch.Tensor, mode: str):
    """One call of the split head, launches only (the call's lock and host wait are the caller's)."""
    b = hidden.shape[0]
    extra = {} if mode == "gumbel" else {"top_k": TOP_K, "top_p": TOP_P}
    params = [RowParams.make(b, torch.device("cuda", d), seed=7, **extra) for d in sharded.group.devices]
    return lambda: sharded.launch(hidden, params, 1, mode != "gumbel", mode != "gumbel")[0]


def queued_us(fn, calls: int = 50) -> float:
    """µs a call with the host ahead of the GPUs: the first GPU sleeps while `calls` calls are enqueued behind it
    (the other GPUs' work waits on its stream through the hidden states' copy), then runs them back to back. The
    GPUs' own time a call, without the host's enqueueing (which peers.bench includes when it is the slower)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(60_000_000)  # ~30 ms at the H200's clock: longer than the host takes to enqueue the calls
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def all_gather_fn(sharded, nbytes: int):
    """The exchange alone: an all-gather of nbytes a GPU over the split head's NCCL group."""
    devices = sharded.group.devices
    sends = [torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in devices]
    receives = [torch.empty((len(devices), nbytes), dtype=torch.uint8, device=f"cuda:{d}") for d in devices]
    group = sharded.group.communicators()
    return lambda: group.all_gather(sends, receives)


def vocab_parallel_main(args, batches: list[int], peers, devices: list[int]) -> None:
    from tokensampler_server.backends.cuda_vocab_parallel import (  # noqa: PLC0415
        PARTIAL_BYTES, DeviceGroup, VocabParallelHead)
    from tokensampler_server.backends.nccl import nccl_version  # noqa: PLC0415
    from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight  # noqa: PLC0415

    meta = {**run_meta(peers), "devices": devices, "nccl": nccl_version(), "dtype": "bfloat16", "top_k": TOP_K,
            "top_p": TOP_P, "shapes": VOCAB_PARALLEL_SHAPES}
    print(json.dumps(meta), flush=True)
    read_bw = meta["read_bw_GBps"] * 1e9
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab, dim in VOCAB_PARALLEL_SHAPES:
        weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        head = RegisteredWeight(name="w", weight=weight, finish=LogitsFinish(vocab_size=vocab), sha256="")
        for count in sorted({1, len(devices)}):
            group = DeviceGroup(devices[:count])
            sharded = VocabParallelHead(head, group)
            roof = vocab * dim * 2 / count / read_bw * 1e6  # each GPU reads its shard once
            for b in batches:
                hidden = torch.randn(b, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                for mode in ("gumbel", "top_k_top_p"):
                    call = vocab_parallel_fn(sharded, hidden, mode)
                    us, gpu_us = peers.bench(call), queued_us(call)
                    rows.append({"workload": "fused_vocab_parallel", "method": "tokensampler_vocab_parallel",
                                 "mode": mode, "V": vocab, "D": dim, "N": count, "B": b, "median_us": round(us, 2),
                                 "queued_us": round(gpu_us, 2), "roofline_us": round(roof, 2)})
                    print(f"V={vocab} D={dim} N={count} B={b:4d} {mode:12s} {us:9.2f} us, queued {gpu_us:9.2f} us"
                          f"  roof {roof:7.2f}", flush=True)
                if count > 1:
                    plan = cuda_fused.plan(b, dim, min(e - s for s, e in sharded.bounds), devices[0], True)
                    us = peers.bench(all_gather_fn(sharded, plan.scratch_bytes))
                    rows.append({"workload": "fused_vocab_parallel", "method": "nccl_all_gather", "mode": None,
                                 "V": vocab, "D": dim, "N": count, "B": b, "median_us": round(us, 2),
                                 "bytes_a_gpu": plan.scratch_bytes, "partial_bytes": PARTIAL_BYTES})
                    print(f"V={vocab} D={dim} N={count} B={b:4d} all-gather of {plan.scratch_bytes} B {us:9.2f} us",
                          flush=True)
            group.close()
        del weight, head
        torch.cuda.empty_cache()
    write_results(Path(args.out), f"fused-vocab-parallel-x{len(devices)}", meta, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default=None, help="comma-separated CUDA devices: the vocabulary-parallel mode")
    args, batches, peers = kernel_bench_arguments("1,8,32,64,128,256", ap)
    if args.devices:
        vocab_parallel_main(args, batches, peers, [int(d) for d in args.devices.split(",")])
        return
    kernels = Kernels(torch.cuda.current_device())
    meta = {**run_meta(peers), "V": V, "D": D, "dtype": "bfloat16", "top_k": TOP_K, "top_p": TOP_P,
            "fused_routes": {f"B={b}": {"unfiltered": cuda_fused.fused_is_faster(b, False, kernels.device.index),
                                        "filtered": cuda_fused.fused_is_faster(b, True, kernels.device.index)}
                             for b in batches}}
    read_bw = meta["read_bw_GBps"] * 1e9
    fi = fs = None
    if not args.no_peers:
        fi = import_flashinfer(peers, meta)
        try:
            fs = importlib.import_module("fs_core")
            meta["flashsampling"] = "imported"
        except Exception as err:  # noqa: BLE001
            meta["flashsampling"] = f"unavailable: {type(err).__name__}: {err}"[:300]
    print(json.dumps(meta), flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(V, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    roof = V * D * 2 / read_bw * 1e6
    rows: list[dict] = []

    def emit(method: str, mode: str | None, b: int, us: float) -> None:
        rows.append({"workload": "fused", "method": method, "mode": mode, "B": b, "median_us": round(us, 2),
                     "roofline_us": round(roof, 2), "of_roofline": round(roof / us, 3)})
        print(f"fused {method:28s} {mode or '':12s} B={b:4d} {us:9.2f} us  roof {roof:7.2f} ({roof / us:.0%})", flush=True)

    for b in batches:
        hidden = torch.randn(b, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for mode in ("gumbel", "top_k_top_p"):
            fused_us = peers.bench(fused_fn(weight, hidden, mode))
            unfused_us = peers.bench(unfused_fn(kernels, weight, hidden, mode))
            emit("tokensampler_fused", mode, b, fused_us)
            emit("tokensampler_unfused", mode, b, unfused_us)
            chosen = cuda_fused.fused_is_faster(b, mode != "gumbel", kernels.device.index)
            emit("tokensampler", mode, b, fused_us if chosen else unfused_us)
        if args.no_peers:
            continue
        k = torch.full((b,), TOP_K, device="cuda", dtype=torch.int32)
        p = torch.full((b,), TOP_P, device="cuda", dtype=torch.float32)
        emit("cublas_matmul_only", None, b, peers.bench(lambda: hidden @ weight.T))
        if fi is not None:
            emit("matmul+flashinfer_gumbel", None, b, peers.bench(lambda: fi.sampling_from_logits(hidden @ weight.T)))
            emit("matmul+flashinfer_topk_topp", None, b,
                 peers.bench(lambda: fi.top_k_top_p_sampling_from_logits(hidden @ weight.T, k, p)))
        if fs is not None:
            temp = torch.tensor(1.0, device="cuda")
            emit("flashsampling_triton", None, b, peers.bench(
                lambda: fs.fused_mm_sample_triton(weights=weight, hidden_states=hidden, num_samples=1, temperature=temp, seed=0)))
    print_targets(rows)
    write_results(Path(args.out), "fused", meta, rows)


if __name__ == "__main__":
    main()
