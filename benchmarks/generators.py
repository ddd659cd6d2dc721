"""Logits generators of the benchmarks (docs/performance.md, "Method"): the same draws as the peers' own."""

from __future__ import annotations

import torch


def spiky(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """randn + 50 spikes in U(10, 30) per row, on the generator's device."""
    x = torch.randn(rows, vocab, device=gen.device, generator=gen)
    idx = torch.randint(0, vocab, (rows, 50), device=gen.device, generator=gen)
    x.scatter_(1, idx, torch.rand(rows, 50, device=gen.device, generator=gen) * 20 + 10)
    return x


def flat(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """randn rows, on the generator's device."""
    return torch.randn(rows, vocab, device=gen.device, generator=gen)


def spiky_logits(rows: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """`spiky` from a generator of its own, seeded."""
    return spiky(rows, vocab, torch.Generator(device=device).manual_seed(seed))
