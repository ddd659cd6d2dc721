"""Structured-output benchmark (the STRUCTURED workload): top-k 50 + top-p 0.9 under a token bitmask.

  python benchmarks/bench_structured.py --peers PATH/peers.py [--out benchmarks/results] [--batches 1,8,64,256]
  python benchmarks/bench_structured.py --no-peers   # tokensampler, and xgrammar + torch when xgrammar imports

V = 128256 (a Llama-3 vocabulary), spiky logits on the GPU. For every B, times whole backend calls
(CudaBackend.sample: planning, the one upload, the launches, the one copy back; as bench_kernels.py --set
adversarial does) without a mask, with half the vocabulary allowed and with 100 tokens allowed. Each masked call
twice: with the mask already on the GPU (the kernels' cost; the target is 1.1x the unmasked call or less) and with
the mask on the CPU, as a request's decoded mask is (its upload, B x 16 KB, included). Beside them: xgrammar's
apply_token_bitmask_inplace on a float32 copy of the logits, then torch top-k/top-p sampling (the peers module's
vLLM-native path with --peers, else torch_top_k_top_p below), and with --peers FlashInfer's
top_k_top_p_sampling_from_logits on that masked copy, when they import. Writes structured-<gpu>-<date>.json (rows:
workload, method, mode, mask, B, median_us, roofline_us, of_roofline, of_unmasked, exact_rows).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_kernels import import_flashinfer, kernel_bench_arguments, run_meta, write_results  # noqa: E402
from tokensampler_server.backends.cuda import CudaBackend  # noqa: E402
from tokensampler_server.model.sampling import LogitProcessing, SamplingBatch  # noqa: E402

V = 128256
WORDS = -(-V // 32)
TOP_K, TOP_P = 50, 0.9
MASKS = ("unmasked", "half_allowed", "100_allowed")
TARGET = 1.1  # a masked call's time over the unmasked call's, mask on the GPU


def torch_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over the k best, and one multinomial draw a row: sampling in plain torch (k: one value for
    every row, as here)."""
    values, ids = logits.topk(int(k[0]), dim=-1)
    probs = values.softmax(dim=-1)
    probs = probs * ((probs.cumsum(dim=-1) - probs) < p.unsqueeze(1))
    return ids.gather(-1, torch.multinomial(probs, 1))


def bitmask(kind: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] on the generator's device: every bit set with probability 1/2 (half_allowed), or
    100 distinct tokens a row (100_allowed)."""
    device = gen.device
    if kind == "half_allowed":
        return torch.randint(-2 ** 31, 2 ** 31, (rows, WORDS), dtype=torch.int32, device=device, generator=gen)
    ids = torch.stack([torch.randperm(V, device=device, generator=gen)[:100] for _ in range(rows)])
    bits = torch.zeros(rows, WORDS, dtype=torch.int64, device=device)
    bits.scatter_add_(1, ids // 32, torch.ones_like(ids) << (ids % 32))  # distinct tokens: the sum is the union
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)


def sample_batch(logits: torch.Tensor, mask: torch.Tensor | None) -> SamplingBatch:
    """top-k 50 + top-p 0.9 over `logits`, a seed a row, under `mask` (None: no processing)."""
    b = logits.shape[0]
    return SamplingBatch(
        logits=logits, temperature=torch.ones(b), top_k=torch.full((b,), TOP_K, dtype=torch.int32),
        top_p=torch.full((b,), TOP_P), min_p=torch.zeros(b), seed=torch.arange(b, dtype=torch.int64) + 7,
        position=torch.zeros(b, dtype=torch.int64), iteration=torch.zeros(b, dtype=torch.int64),
        processing=None if mask is None else LogitProcessing(token_bitmask=mask))


def allowed_tokens_drawn(tokens: torch.Tensor, mask: torch.Tensor) -> bool:
    words = mask.to(tokens.device).gather(1, tokens // 32)
    return bool((((words >> (tokens % 32)) & 1) == 1).all())


def main() -> None:
    args, batches, peers = kernel_bench_arguments("1,8,64,256")
    backend = CudaBackend(torch.cuda.current_device())
    meta = {**run_meta(peers), "V": V, "top_k": TOP_K, "top_p": TOP_P,
            "call": "CudaBackend.sample, logits on the GPU; mask on the GPU or the CPU"}
    try:
        xgr = importlib.import_module("xgrammar")
        meta["xgrammar"] = "imported"
    except ImportError as err:
        xgr = None
        meta["xgrammar"] = f"unavailable: {err}"[:300]
    torch_sampler: Callable = getattr(peers, "vllm_native_topk_topp", torch_top_k_top_p)
    meta["torch_sampler"] = torch_sampler.__name__
    fi = None if args.no_peers else import_flashinfer(peers, meta)
    print(json.dumps(meta), flush=True)
    read_bw = meta["read_bw_GBps"] * 1e9
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []

    def emit(method: str, kind: str, mask_on: str, b: int, us: float, base: float, **extra) -> None:
        roof = b * V * 4 / read_bw * 1e6
        mode = kind + ("_mask_on_cpu" if mask_on == "cpu" else "")  # apart in the plot
        row = {"workload": "structured", "method": method, "mode": mode, "mask": mask_on, "B": b,
               "median_us": round(us, 2), "roofline_us": round(roof, 2), "of_roofline": round(roof / us, 3),
               "of_unmasked": round(us / base, 3), **extra}
        rows.append(row)
        print(f"structured {method:20s} {mode:25s} B={b:4d} {us:9.2f} us  x{row['of_unmasked']:5.2f} of unmasked",
              flush=True)

    for b in batches:
        logits = peers.spiky_logits(b, V, gen)
        k = torch.full((b,), TOP_K, dtype=torch.int32, device="cuda")
        p = torch.full((b,), TOP_P, dtype=torch.float32, device="cuda")
        ours = peer = flashinfer = None  # each method's unmasked time at this B
        for kind in MASKS:
            mask = None if kind == "unmasked" else bitmask(kind, b, gen)
            for mask_on in ("gpu", "cpu") if mask is not None else ("none",):
                batch = sample_batch(logits, None if mask is None else mask if mask_on == "gpu" else mask.cpu())
                before = backend.fallbacks()["exact_rows"]
                tokens = backend.sample(batch).tokens
                if mask is not None:
                    assert allowed_tokens_drawn(tokens, mask), "a token the mask disallows was drawn"
                exact_rows = backend.fallbacks()["exact_rows"] - before
                us = peers.bench(lambda: backend.sample(batch))
                ours = ours or us
                emit("tokensampler", kind, mask_on, b, us, ours, exact_rows=exact_rows)
            masked = logits.clone()
            if mask is not None:
                if xgr is None:
                    continue
                xgr.apply_token_bitmask_inplace(masked, mask)  # once here; timed again below (idempotent)
            def xgrammar_then_torch() -> torch.Tensor:
                if mask is not None:
                    xgr.apply_token_bitmask_inplace(masked, mask)
                return torch_sampler(masked, k, p)

            us = peers.bench(xgrammar_then_torch)
            peer = peer or us
            emit("xgrammar+torch" if mask is not None else "torch", kind, "gpu" if mask is not None else "none", b, us,
                 peer)
            if fi is not None:
                def xgrammar_then_flashinfer() -> torch.Tensor:
                    if mask is not None:
                        xgr.apply_token_bitmask_inplace(masked, mask)
                    return fi.top_k_top_p_sampling_from_logits(masked, k, p)

                us = peers.bench(xgrammar_then_flashinfer)
                flashinfer = flashinfer or us
                emit("xgrammar+flashinfer" if mask is not None else "flashinfer", kind,
                     "gpu" if mask is not None else "none", b, us, flashinfer)
        del logits
    t = {(r["method"], r["mode"], r["B"]): r for r in rows}
    for kind in MASKS[1:]:
        cells = []
        for b in batches:
            ratio = t[("tokensampler", kind, b)]["of_unmasked"]
            cells.append(f"{ratio:5.2f}{'' if ratio <= TARGET else '*'}")
        print(f"TARGET structured {kind + ' / unmasked <= ' + str(TARGET):34s} " + " ".join(cells), flush=True)
    write_results(Path(args.out), "structured", meta, rows)


if __name__ == "__main__":
    main()
