"""Logits generators of the benchmark protocol (shared/bench/README.md), for this repo's benchmarks."""

from __future__ import annotations

import torch


def spiky_logits(rows: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """randn + 50 spikes in U(10, 30) per row, as the protocol's spiky generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, device=device, generator=gen)
    idx = torch.randint(0, vocab, (rows, 50), device=device, generator=gen)
    x.scatter_(1, idx, torch.rand(rows, 50, device=device, generator=gen) * 20 + 10)
    return x
