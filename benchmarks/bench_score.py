"""Benchmark of ScoreTokens: the log-probs of given tokens (docs/semantics.md, "Scoring given tokens").

  python benchmarks/bench_score.py [--out benchmarks/results]

Times, in one process on the same inputs (V = 151936, bf16 hidden states and head, D = 4096):
- from hidden states, N = B·T positions (RAW log-probs of the given tokens, and with the entropy): tokensampler's
  scoring on the CUDA backend (workloads/score_cuda.py: matmul blocks of CHUNK_BYTES read by the scoring kernel;
  also with other block sizes, methods tokensampler_chunk_<MiB>) and the torch reference that
  walks the vocabulary a slice at a time (workloads/score.py, tokensampler_torch_slices), against cuBLAS's matmul
  alone of the same shapes and torch's matmul + log_softmax + gather, with the peak extra memory of each (bytes
  allocated beyond the inputs);
- from fp32 logits [N, V]: the same two paths against torch argmax over the same logits (one read).
Writes score-<gpu>-<date>.json (rows: workload, method, mode, N, median_us, peak_extra_bytes) and its PNG.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import timing  # noqa: E402
from bench_kernels import run_meta, write_results  # noqa: E402
from tokensampler_server.backends.cuda_build import load_kernels  # noqa: E402
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight  # noqa: E402
from tokensampler_server.workloads.score import LogitSource, TokenScoring, score_tokens  # noqa: E402
from tokensampler_server.workloads.score_cuda import CHUNK_BYTES, ScoreKernels, score_tokens_cuda  # noqa: E402

V, D = 151936, 4096
HIDDEN_POSITIONS = [512, 4096]
LOGITS_POSITIONS = [64, 1024]
CHUNK_SWEEP_MIB = [8, 32, 64, 128, 256]
"""Other matmul block sizes timed at every N, beside CHUNK_BYTES."""


def _raw_scoring(tokens: torch.Tensor, entropy: bool) -> TokenScoring:
    n = tokens.numel()
    return TokenScoring(token_ids=tokens.cpu(), temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int32),
                        top_p=torch.ones(n), min_p=torch.zeros(n), processed=False, entropy=entropy)


def _peak_extra(fn: Callable[[], object]) -> int:
    """Bytes `fn` allocates beyond what is allocated before it, at its peak."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _row(method: str, mode: str, n: int, fn: Callable[[], object], roofline_us: float | None = None,
         first_call: Callable[[], object] | None = None) -> dict:
    """`first_call`: fn as it runs the first time, for its peak memory (a scorer allocating its buffers)."""
    row = {"workload": "score", "method": method, "mode": mode, "B": n, "median_us": round(timing.bench(fn), 2),
           "peak_extra_bytes": _peak_extra(first_call or fn)}
    if roofline_us is not None:
        row["roofline_us"] = round(roofline_us, 2)
    print(f"score {mode:7s} N={n:5d} {method:38s} {row['median_us']:10.1f} us  extra {row['peak_extra_bytes'] / 2**20:9.1f} MiB",
          flush=True)
    return row


def _scorer(chunk_bytes: int = CHUNK_BYTES) -> ScoreKernels:
    return ScoreKernels(torch.device("cuda", 0), load_kernels(0), chunk_bytes)


def hidden_rows(n: int, gen: torch.Generator) -> list[dict]:
    device = torch.device("cuda")
    weight = (torch.randn(V, D, generator=gen, device=device) / D ** 0.5).to(torch.bfloat16)
    hidden = torch.randn(n, D, generator=gen, device=device).to(torch.bfloat16)
    tokens = torch.randint(0, V, (n,), generator=gen, device=device)
    head = RegisteredWeight(name="head", weight=weight, finish=LogitsFinish(vocab_size=V), sha256="")
    source = LogitSource(hidden=hidden, lm_head=head)

    def torch_logprobs() -> torch.Tensor:
        logits = (hidden @ weight.T).float()
        return torch.log_softmax(logits, dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)

    rows = [
        _row("cublas_matmul", "hidden", n, lambda: hidden @ weight.T),
        _row("torch_matmul_log_softmax_gather", "hidden", n, torch_logprobs),
    ]

    def kernel_row(method: str, scoring: TokenScoring, chunk_bytes: int = CHUNK_BYTES) -> dict:
        scorer = _scorer(chunk_bytes)
        return _row(method, "hidden", n, lambda: score_tokens_cuda(source, scoring, scorer),
                    first_call=lambda: score_tokens_cuda(source, scoring, _scorer(chunk_bytes)))

    raw = _raw_scoring(tokens, entropy=False)
    rows += [kernel_row("tokensampler", raw), kernel_row("tokensampler_entropy", _raw_scoring(tokens, entropy=True))]
    rows += [kernel_row(f"tokensampler_chunk_{mib}MiB", raw, mib << 20) for mib in CHUNK_SWEEP_MIB]
    rows.append(_row("tokensampler_torch_slices", "hidden", n, lambda: score_tokens(source, raw, device)))
    return rows


def logits_rows(n: int, gen: torch.Generator, read_bw: float) -> list[dict]:
    device = torch.device("cuda")
    logits = timing.spiky_logits(n, V, gen)
    tokens = torch.randint(0, V, (n,), generator=gen, device=device)
    source = LogitSource(logits=logits)
    scoring = _raw_scoring(tokens, entropy=False)
    roofline = logits.numel() * logits.element_size() / read_bw * 1e6
    scorer = _scorer()
    return [
        _row("torch_argmax", "logits", n, lambda: logits.argmax(dim=1), roofline),
        _row("tokensampler", "logits", n, lambda: score_tokens_cuda(source, scoring, scorer), roofline,
             first_call=lambda: score_tokens_cuda(source, scoring, _scorer())),
        _row("tokensampler_torch_slices", "logits", n, lambda: score_tokens(source, scoring, device), roofline),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    meta = run_meta(timing)
    meta.update({"V": V, "D": D, "dtype": "bfloat16 hidden states and head; float32 logits", "mode_raw": "RAW log-probs"})
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in HIDDEN_POSITIONS:
        rows += hidden_rows(n, gen)
    for n in LOGITS_POSITIONS:
        rows += logits_rows(n, gen, meta["read_bw_GBps"] * 1e9)
    write_results(args.out, "score", meta, rows)


if __name__ == "__main__":
    main()
