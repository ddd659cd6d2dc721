"""A diffusion-LM denoising loop driven by tokensampler, with random logits standing in for a model.

  python examples/diffusion_loop.py [--target HOST:PORT] [--rows 4] [--length 128] [--vocab 32000]

Every step sends the logits of all positions [B, L, V] and the mask of those still undecided; the
server samples the masked positions, commits the confident ones (threshold 0.9, plus the 8 most
confident per row), and returns the new mask. The loop runs until every position is committed and
prints, per step, how many positions remain. Without --target it starts a server of its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from local_server import server_target  # beside this file

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a running server (default: start one)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-steps", type=int, default=64)
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]
    from tokensampler_client import SamplerClient

    with server_target(args.target) as target:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.full((args.rows, args.length), -1, dtype=torch.int64)
        mask = torch.ones(args.rows, args.length, dtype=torch.bool)
        seeds = [1000 + row for row in range(args.rows)]
        started = time.perf_counter()
        with SamplerClient(target, timeout=120) as client:
            for step in range(args.max_steps):
                # A model would produce these; sharper logits as denoising proceeds make commits easier.
                logits = torch.randn(args.rows, args.length, args.vocab, generator=gen) * (2 + step)
                result = client.sample_diffusion_step(
                    logits, mask, top_k=50, seed=seeds, iteration=step, confidence_threshold=0.9, commit_count=8,
                )
                committed = mask & ~result.mask
                tokens[committed] = result.tokens[committed]
                mask = result.mask
                print(f"step {step:2d}: committed {int(committed.sum()):4d}, undecided {int(mask.sum()):4d}")
                if not mask.any():
                    break
        if mask.any():
            print(f"{int(mask.sum())} positions still undecided after {args.max_steps} steps")
            return 1
        elapsed = time.perf_counter() - started
        print(f"all {args.rows * args.length} positions committed in {step + 1} steps, {elapsed:.2f} s")
        assert (tokens >= 0).all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
