"""Benchmark of the workload kernels (diffusion, topk_probs, verify; docs/performance.md).

  python benchmarks/bench_workloads.py (--peers PATH/peers.py | --no-peers) [--out benchmarks/results]

Times, in one process on the same inputs (fp32, V = 151936), each workload next to its peers:
- diffusion (masked positions B * L, all masked, commit count 8 and threshold 0.9): tokensampler's
  two kernels against the plain pipeline (softmax writing probabilities, torch.multinomial, the
  confidence gather, torch.topk of the confidences, the mask update). Modes gumbel (T = 1), greedy.
- topk_probs (B * T rows, K = 20, T = 1): against torch.softmax + torch.topk and torch argmax.
- verify (B rows, n = 4 draft tokens, T = 1): against FlashInfer's chain_speculative_sampling on
  target probabilities, and softmax + chain_speculative_sampling from the same target logits.
Writes <workload>-<gpu>-<date>.json (rows: workload, method, mode, B, median_us, roofline_us) and a
PNG per file. The roofline is one read of the inputs the workload must read at the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import add_peers_arguments, import_flashinfer, load_peers, run_meta, write_results  # noqa: E402
from tokensampler_server.workloads.cuda import WorkloadKernels  # noqa: E402
from tokensampler_server.workloads.diffusion import DiffusionStep  # noqa: E402
from tokensampler_server.workloads.verify import DraftVerification  # noqa: E402

V = 151936
WORKLOADS = ("diffusion", "topk_probs", "verify")
DIFFUSION_SHAPES = [(1, 64), (8, 64)]  # (B, L): 64 and 512 masked positions
DIFFUSION_COMMIT = 8
TOPK_ROWS = [1, 32, 256]
TOPK_K = 20
VERIFY_ROWS = [8, 32]
VERIFY_N = 4


def diffusion_inputs(b: int, length: int, temperature: float, gen: torch.Generator, peers) -> DiffusionStep:
    dev = torch.device("cuda")
    x = peers.spiky_logits(b * length, V, gen).view(b, length, V)

    def col(value, dtype):
        return torch.full((b,), value, dtype=dtype, device=dev)

    return DiffusionStep(
        logits=x, mask=torch.ones(b, length, dtype=torch.bool, device=dev), temperature=col(temperature, torch.float32),
        top_k=col(0, torch.int32), top_p=col(1.0, torch.float32), min_p=col(0.0, torch.float32),
        seed=col(7, torch.int64), iteration=col(3, torch.int64), threshold=col(0.9, torch.float32),
        count=col(DIFFUSION_COMMIT, torch.int64),
    )


def plain_diffusion(step: DiffusionStep, greedy: bool):
    """The plain pipeline: probabilities written, sampled, confidences gathered, top-c committed."""
    b, length, _ = step.logits.shape
    probs = torch.softmax(step.logits.view(b * length, V), dim=-1)
    tokens = probs.argmax(dim=-1, keepdim=True) if greedy else torch.multinomial(probs, 1)
    conf = probs.gather(1, tokens).view(b, length).masked_fill(~step.mask, -1.0)
    top = torch.topk(conf, DIFFUSION_COMMIT, dim=1).indices
    commit = torch.zeros_like(step.mask).scatter_(1, top, True) | (conf >= step.threshold.unsqueeze(1))
    return tokens.view(b, length), conf, step.mask & ~commit


def verify_inputs(b: int, gen: torch.Generator, peers) -> tuple[DraftVerification, torch.Tensor]:
    dev = torch.device("cuda")
    target = peers.flat_logits(b * (VERIFY_N + 1), V, gen).view(b, VERIFY_N + 1, V)
    draft_logits = target[:, :VERIFY_N] + torch.randn(b, VERIFY_N, V, device=dev, generator=gen)
    draft_probs = torch.softmax(draft_logits, dim=-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, V), 1, generator=gen).view(b, VERIFY_N)

    def col(value, dtype):
        return torch.full((b,), value, dtype=dtype, device=dev)

    v = DraftVerification(
        draft_ids=draft_ids, draft_probs=draft_probs, target_logits=target, temperature=col(1.0, torch.float32),
        top_k=col(0, torch.int32), top_p=col(1.0, torch.float32), min_p=col(0.0, torch.float32),
        seed=col(7, torch.int64), position=col(100, torch.int64), iteration=col(0, torch.int64),
    )
    return v, torch.softmax(target, dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    add_peers_arguments(ap)
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated subset of {','.join(WORKLOADS)} (each writes its own results file)")
    args = ap.parse_args()
    chosen = set(args.workloads.split(","))
    if not chosen <= set(WORKLOADS):
        ap.error(f"--workloads: expected a subset of {','.join(WORKLOADS)}, got {args.workloads}")
    peers = load_peers(args.peers, args.no_peers)
    kernels = WorkloadKernels(torch.cuda.current_device())
    meta = {**run_meta(peers), "V": V}
    read_bw = meta["read_bw_GBps"] * 1e9
    fi = None if args.no_peers else import_flashinfer(peers, meta)
    print(json.dumps(meta), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def write(workload: str, rows: list[dict], extra_meta: dict) -> None:
        write_results(Path(args.out), workload, {**meta, **extra_meta}, rows)

    def emitter(workload: str, rows: list[dict]):
        def emit(method: str, mode: str | None, b: int, us: float, roof: float, **extra) -> None:
            rows.append({"workload": workload, "method": method, "mode": mode, "B": b, "median_us": round(us, 2),
                         "roofline_us": round(roof, 2), "of_roofline": round(roof / us, 3), **extra})
            print(f"{workload:10s} {method:44s} {mode or '':7s} B={b:4d} {us:9.2f} us  roof {roof:7.2f}", flush=True)
        return emit

    if "diffusion" in chosen:
        bench_diffusion(emitter, write, gen, peers, kernels, read_bw, args.no_peers)
    if "topk_probs" in chosen:
        bench_topk_probs(emitter, write, gen, peers, kernels, read_bw, args.no_peers)
    if "verify" in chosen:
        bench_verify(emitter, write, gen, peers, kernels, read_bw, fi, meta)


def bench_diffusion(emitter, write, gen, peers, kernels, read_bw: float, no_peers: bool) -> None:
    rows: list[dict] = []
    emit = emitter("diffusion", rows)
    for b, length in DIFFUSION_SHAPES:
        masked = b * length
        roof = masked * V * 4 / read_bw * 1e6
        for mode, temperature in (("gumbel", 1.0), ("greedy", 0.0)):
            step = diffusion_inputs(b, length, temperature, gen, peers)
            emit("tokensampler", mode, masked, peers.bench(lambda: kernels.diffusion(step)), roof, L=length)
            if not no_peers:
                emit("plain_softmax_multinomial_topk", mode, masked,
                     peers.bench(lambda: plain_diffusion(step, temperature == 0.0)), roof, L=length)
    write("diffusion", rows, {"commit_count": DIFFUSION_COMMIT, "threshold": 0.9, "generator": "spiky"})


def bench_topk_probs(emitter, write, gen, peers, kernels, read_bw: float, no_peers: bool) -> None:
    rows: list[dict] = []
    emit = emitter("topk_probs", rows)
    for b in TOPK_ROWS:
        x = peers.spiky_logits(b, V, gen)
        t = torch.ones(b, device="cuda")
        roof = b * V * 4 / read_bw * 1e6
        emit("tokensampler", None, b, peers.bench(lambda: kernels.topk_probs(x, t, TOPK_K)), roof)
        if not no_peers:
            emit("torch_softmax_topk20", None, b, peers.bench(lambda: torch.topk(torch.softmax(x / t.unsqueeze(1), -1), TOPK_K, dim=-1)), roof)
            emit("torch_argmax", None, b, peers.bench(lambda: x.argmax(dim=-1)), roof)
    write("topk_probs", rows, {"k": TOPK_K, "generator": "spiky"})


def bench_verify(emitter, write, gen, peers, kernels, read_bw: float, fi, meta: dict) -> None:
    rows: list[dict] = []
    emit = emitter("verify", rows)
    for b in VERIFY_ROWS:
        v, target_probs = verify_inputs(b, gen, peers)
        roof = b * (2 * VERIFY_N + 1) * V * 4 / read_bw * 1e6  # draft probs and target logits, once
        emit("tokensampler", None, b, peers.bench(lambda: kernels.verify(v)), roof, n=VERIFY_N,
             mean_accepted=round(float(kernels.verify(v)[0].float().mean()), 3))
        if fi is not None:
            draft_ids = v.draft_ids.to(torch.int32)
            try:
                chain = fi.chain_speculative_sampling
                emit("flashinfer_chain_speculative_sampling", None, b,
                     peers.bench(lambda: chain(v.draft_probs, draft_ids, target_probs)), roof, n=VERIFY_N)
                emit("torch_softmax+flashinfer_chain_speculative_sampling", None, b,
                     peers.bench(lambda: chain(v.draft_probs, draft_ids, torch.softmax(v.target_logits, -1))), roof, n=VERIFY_N)
            except Exception as err:  # noqa: BLE001
                meta["flashinfer"] = f"failed: {type(err).__name__}: {err}"[:300]
                print(meta["flashinfer"], flush=True)
                fi = None
    write("verify", rows, {"n": VERIFY_N, "generator": "flat, draft = softmax(target + N(0, 1))"})


if __name__ == "__main__":
    main()
