"""The local samplers on the CUDA backend against the CPU reference (docs/semantics.md, "Local samplers").

Both run the same torch processing (backends/processing.py), the CUDA backend on the GPU: the tokens each
sampler removes must be the same set on both devices, and the tokens drawn must agree (greedy rows exactly,
sampled rows at the usual rate of at least 99.9%). no-repeat-n-gram's bans and DRY's penalties are integer
comparisons, table look-ups and one float32 subtraction each: the same bits on both devices, alone or in any batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends import sequence_samplers
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.batching.batch_merge import merge_batches
from tokensampler_server.core.config import Limits
from tokensampler_server.model.sampling import LogitProcessing
from tokensampler_server.validation.sample import validate_sample_request

from .conftest import logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ROWS, VOCAB, SAMPLES = 256, 32000, 2


def _history(rows: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Few distinct ids, so that n-grams and DRY repeats occur.
    return torch.randint(0, 40, (rows, 300), generator=g).tolist()


SAMPLERS: dict[str, dict[str, Any]] = {
    "top_n_sigma": {"top_n_sigma": 1.0},
    "typical_p": {"typical_p": 0.5},
    "xtc": {"xtc_threshold": 0.05, "xtc_probability": 0.5},
    "no_repeat_ngram": {"no_repeat_ngram_size": 3},
    "dry": {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_sequence_breakers": [[7], [8, 9]]},
    "min_tokens": {"min_tokens": 10, "num_generated": list(range(ROWS)), "stop_token_ids": [0, 1, 2]},
    "combined": {"top_n_sigma": 2.0, "typical_p": 0.9, "xtc_threshold": 0.1, "xtc_probability": 0.5,
                 "no_repeat_ngram_size": 2, "dry_multiplier": 0.5, "repetition_penalty": 1.2, "top_k": 50,
                 "top_p": 0.9, "min_p": 0.02},
}


def _batch(name: str, generator: str, temperature: float):
    x = logits(generator, ROWS, VOCAB, seed=len(name) * 7 + ROWS)
    request = build_sample_request(x, seed=list(range(ROWS)), position=3, temperature=temperature,
                                   num_samples=SAMPLES, output_token_ids=_history(ROWS, len(name)), **SAMPLERS[name])
    return validate_sample_request(request, Limits())[0]


@pytest.mark.parametrize("generator", ["spiky", "flat"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_processing_removes_the_same_tokens_on_both_devices(name: str, generator: str) -> None:
    batch = _batch(name, generator, 1.0)
    assert batch.processing is not None
    x = batch.logits.to(torch.float32)
    on_cpu = apply_processing(x.clone(), batch.processing)
    on_gpu = apply_processing(x.cuda(), batch.processing).cpu()
    finite = torch.isfinite(on_cpu)
    mismatched = int((finite != torch.isfinite(on_gpu)).sum())
    assert mismatched <= 1, f"{mismatched} tokens removed on one device only"
    both = finite & torch.isfinite(on_gpu)
    assert torch.allclose(on_cpu[both], on_gpu[both], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("generator", ["spiky", "flat"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_cuda_agrees_with_the_cpu_reference(cuda_backend, cpu_backend, name: str, generator: str,
                                            temperature: float) -> None:
    batch = _batch(name, generator, temperature)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.valid, want.valid)
    assert got.tokens.shape == want.tokens.shape == (ROWS, SAMPLES)
    mismatches = int((got.tokens != want.tokens).sum())
    if temperature == 0:
        assert mismatches == 0
    else:
        assert mismatches <= max(1, got.tokens.numel() // 1000), f"{mismatches} of {got.tokens.numel()} tokens differ"


def _long_histories(rows: int, length: int, seed: int) -> list[list[int]]:
    """Random, periodic and constant histories, each ending in a repeat of its own."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in range(rows):
        kind = row % 3
        if kind == 0:
            history = torch.randint(0, 50, (length,), generator=g)
        elif kind == 1:
            history = torch.randint(0, 50, (1 + row % 7,), generator=g).repeat(length)[:length]
        else:
            history = torch.full((length,), row % 50)
        out.append(history.tolist())
    return out


SEQUENCE_SAMPLERS = {"no_repeat_ngram_size": [1, 2, 3, 5, 32] * 13, "dry_multiplier": 0.8, "dry_base": 1.75,
                     "dry_allowed_length": [1, 2, 3, 50] * 16, "dry_penalty_last_n": [-1, 4096, 300, 7] * 16,
                     "dry_sequence_breakers": [[7], [8, 9], [11], list(range(20, 36))]}


def _sequence_batch(rows: int, length: int, seed: int):
    request = build_sample_request(logits("spiky", rows, VOCAB, seed=seed), seed=list(range(rows)),
                                   output_token_ids=_long_histories(rows, length, seed),
                                   **{key: value[:rows] if isinstance(value, list) and key != "dry_sequence_breakers"
                                      else value for key, value in SEQUENCE_SAMPLERS.items()})
    return validate_sample_request(request, Limits())[0]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
        f"{int((got.view(torch.int32) != want.view(torch.int32)).sum())} logits differ"


@pytest.mark.parametrize("chunk", [sequence_samplers._CHUNK_POSITIONS, 5000])
def test_sequence_samplers_give_the_same_bits_on_both_devices(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """4096-id histories, every n, windows, breakers; the comparisons in one piece or a few tiles at a time."""
    monkeypatch.setattr(sequence_samplers, "_CHUNK_POSITIONS", chunk)
    batch = _sequence_batch(64, 4096, seed=5)
    x = batch.logits.to(torch.float32)
    _same_bits(apply_processing(x.cuda(), batch.processing).cpu(), apply_processing(x.clone(), batch.processing))


def test_sequence_samplers_on_the_gpu_alone_merged_and_repeated() -> None:
    """A row's processed logits on the GPU are the same bits alone, in a merged batch, and repeated (a diffusion
    step's positions read their request's tiles)."""
    parts = [_sequence_batch(rows, length, seed) for rows, length, seed in ((3, 4096, 1), (5, 100, 2), (2, 1500, 3))]
    alone = torch.cat([apply_processing(b.logits.to(torch.float32).cuda(), b.processing).cpu() for b in parts])
    merged = merge_batches(parts)
    x = merged.logits.to(torch.float32)
    _same_bits(apply_processing(x.cuda(), merged.processing).cpu(), alone)
    repeated = torch.tensor([0, 0, 4, 4, 4, 9, 2])
    processing = LogitProcessing(sequence_samplers=merged.processing.sequence_samplers.rows(repeated))
    on_gpu = apply_processing(x[repeated].cuda(), processing).cpu()
    _same_bits(on_gpu, apply_processing(x[repeated].clone(), processing))
