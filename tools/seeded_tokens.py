"""Seeded tokens and log-probs of a fixed set of requests, per backend: the proof that a change of structure left
behaviour alone.

    python tools/seeded_tokens.py --device cpu  --write   # tests/seeded/cpu.json
    python tools/seeded_tokens.py --device cuda --write   # tests/seeded/cuda.json (on a GPU)
    python tools/seeded_tokens.py --device cpu            # compares with the committed file, exits 1 on a change

Every mode of docs/semantics.md over logits and over hidden states through a registered head (all seeded): greedy,
Gumbel-max, top-k (small and above the largest kernel bucket), top-p, min-p and their combinations, a k per row,
processing (bans, bias, penalties, the local samplers), raw and processed log-probs with top log-probs, several
samples. tests/test_seeded_tokens.py compares the CPU file on every run, the CUDA file where a GPU is present.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "tests" / "seeded"
ROWS, VOCAB, DIM = 4, 1000, 64
SEEDS = [11, 12, 13, 14]
LOGPROB_TOLERANCE = 1e-5  # relative: log-probs are sums of exponentials whose order may vary between CPUs

CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "gumbel": {"temperature": 0.8, "num_samples": 3},
    "top_k": {"top_k": 20},
    "top_k_above_buckets": {"top_k": 400, "top_p": 0.95},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.05, "temperature": 1.3},
    "top_k_top_p_min_p": {"top_k": 50, "top_p": 0.9, "min_p": 0.01},
    "per_row_k": {"top_k": [1, 30, 300, 999], "top_p": 0.9},
    "processing": {"banned_token_ids": [1, 2, 3], "logit_bias": {5: 3.0}, "repetition_penalty": 1.2,
                   "output_token_ids": [[5, 6], [7], [], [8, 8]], "top_k": 40},
    "local_samplers": {"typical_p": 0.9, "top_n_sigma": 2.0, "temperature": 0.9},
    "raw_logprobs": {"top_k": 30, "return_logprobs": True, "top_logprobs": 3},
    "processed_logprobs": {"top_p": 0.9, "return_logprobs": True, "logprobs_mode": "processed", "top_logprobs": 3},
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2024)
    logits = torch.randn(ROWS, VOCAB, generator=gen)
    weight = (torch.randn(VOCAB, DIM, generator=gen) / DIM ** 0.5).to(torch.bfloat16)
    hidden = torch.randn(ROWS, DIM, generator=gen).to(torch.bfloat16)  # logits of unit spread, as the logits'
    return logits, weight, hidden


def _entry(result) -> dict[str, Any]:
    entry: dict[str, Any] = {"tokens": result.tokens.tolist(), "valid": result.valid.tolist()}
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
        value = getattr(result, name)
        if value is not None:
            entry[name] = value.tolist()
    return entry


def run(device: str) -> dict[str, dict[str, Any]]:
    """Every case's answer on `device`, as JSON-ready lists."""
    from tokensampler_server.inprocess import LocalSampler

    sampler = LocalSampler(device)
    logits, weight, hidden = _inputs()
    head = sampler.register_head(weight)
    answers = {}
    for name, params in CASES.items():
        answers[f"logits/{name}"] = _entry(sampler.sample(logits, seed=SEEDS, position=7, **params))
        answers[f"hidden/{name}"] = _entry(sampler.sample_hidden(hidden, head, seed=SEEDS, position=7, **params))
    return answers


def differences(want: dict[str, dict[str, Any]], got: dict[str, dict[str, Any]]) -> list[str]:
    """What differs: any token, validity or top id exactly; log-probs beyond LOGPROB_TOLERANCE."""
    found = [f"{case}: missing" for case in want if case not in got]
    found += [f"{case}: not in the committed file" for case in got if case not in want]
    for case in want.keys() & got.keys():
        for field, expected in want[case].items():
            actual = got[case].get(field)
            if field in ("logprobs", "top_logprobs"):
                same = actual is not None and torch.allclose(torch.tensor(actual), torch.tensor(expected), equal_nan=True,
                                                             rtol=LOGPROB_TOLERANCE, atol=LOGPROB_TOLERANCE)
            else:
                same = actual == expected
            if not same:
                found.append(f"{case}: {field} differs")
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--write", action="store_true", help="write the file instead of comparing with it")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "server"), str(ROOT / "client")]
    path = FILES / f"{args.device.split(':')[0]}.json"
    answers = run(args.device)
    if args.write:
        FILES.mkdir(exist_ok=True)
        lines = ",\n".join(f"{json.dumps(case)}: {json.dumps(answers[case])}" for case in sorted(answers))
        path.write_text("{\n" + lines + "\n}\n")  # a case a line: a change shows as the cases it touched
        print(f"wrote {path}")
        return 0
    found = differences(json.loads(path.read_text()), answers)
    print("\n".join(found) or f"{len(answers)} cases as in {path.name}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
