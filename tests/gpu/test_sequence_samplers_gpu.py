"""The sequence samplers' kernels (csrc/sequence_samplers.cu, backends/cuda_sequence_samplers.py) against the torch
derivation the CPU reference runs (backends/sequence_samplers.py), bit for bit: no-repeat-n-gram's bans as
token-bitmask words, DRY's penalties subtracted in place. And the CUDA backend's calls whose only processing is one of
them: no torch processing, the reference's tokens, flags and processed log-probs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends import cuda as cuda_module
from tokensampler_server.backends import sequence_samplers
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.cuda_build import load_kernels
from tokensampler_server.backends.cuda_sequence_samplers import SequenceSamplerKernels, bans_only, penalties_only
from tokensampler_server.backends.entry_masks import words_of
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.core.config import Limits
from tokensampler_server.model.repetition import SequenceSamplers, TileLayout
from tokensampler_server.validation.sample import validate_sample_request

from ..test_sequence_samplers import _case, _validated
from .agreement import assert_tokens_agree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

DEVICE = torch.device("cuda", 0)


def _bans_case(seed: int, rows: int, vocab: int, longest: int) -> dict:
    """_case's sequences and n-gram sizes, DRY off, n = 2 on row 0 so that some row bans."""
    params, _ = _case(seed, rows=rows, vocab=vocab, longest=longest)
    params["dry_multiplier"] = [0.0] * rows
    params["no_repeat_ngram_size"][0] = 2
    return params


def _expected_words(samplers: SequenceSamplers, num_rows: int, vocab: int) -> np.ndarray:
    """uint32 [num_rows, ceil(V / 32)]: all ones less the bans torch derives on the CPU."""
    derived = sequence_samplers.derive(samplers, vocab, torch.device("cpu"))
    index = derived.index[derived.banned].numpy()
    words = np.full((num_rows, words_of(vocab)), 0xFFFFFFFF, dtype=np.uint32)
    rows, tokens = index // vocab, index % vocab
    np.bitwise_and.at(words.reshape(-1), rows * words.shape[1] + (tokens >> 5),
                      ~(np.uint32(1) << (tokens & 31).astype(np.uint32)))
    return words


@pytest.fixture(scope="module")
def kernels() -> SequenceSamplerKernels:
    return SequenceSamplerKernels(load_kernels(0), DEVICE)


@pytest.mark.parametrize("seed", range(12))
def test_ban_words_are_the_references_bans(kernels: SequenceSamplerKernels, seed: int) -> None:
    """Rows of every n (0 to 32, rows without it), periodic, constant and random sequences up to several tiles a row,
    vocabularies of 3 to 151936; and the same rows taken apart and repeated (tiles read by several rows)."""
    vocab = (3, 8, 40, 151936)[seed % 4]
    params = _bans_case(seed, rows=12, vocab=vocab, longest=3000 if seed % 2 else 160)
    samplers = _validated(12, vocab, **params).processing.sequence_samplers
    assert samplers.bans and not samplers.penalties
    got = kernels.words(samplers, 12, vocab).cpu().numpy().view(np.uint32)
    assert np.array_equal(got, _expected_words(samplers, 12, vocab))
    repeated = samplers.rows(torch.tensor([3, 0, 0, 11, 5, 5, 5]))
    assert repeated.instances is not None
    got = kernels.words(repeated, 7, vocab).cpu().numpy().view(np.uint32)
    assert np.array_equal(got, _expected_words(repeated, 7, vocab))


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (-0.0 and 0.0 alike: a penalty of 0 is none)."""
    diff = (got + 0.0).view(torch.int32) != (want + 0.0).view(torch.int32)
    row, token = (diff.nonzero()[0].tolist() if diff.any() else (None, None))
    assert not diff.any(), f"row {row}, token {token}: got {got[row, token]}, expected {want[row, token]}"


@pytest.mark.parametrize("seed", range(12))
def test_dry_penalties_are_the_references(kernels: SequenceSamplerKernels, seed: int) -> None:
    """DRY of every multiplier (1e30: penalties of +inf), base, allowed length, window and breakers, on randn logits
    with NaN and +inf entries; and the same rows taken apart and repeated. The penalty scratch is left zeroed."""
    vocab = (3, 8, 40, 151936)[seed % 4]
    params, _ = _case(500 + seed, rows=12, vocab=vocab, longest=3000 if seed % 2 else 160)
    params["no_repeat_ngram_size"] = [0] * 12
    params["dry_multiplier"][0] = 0.8
    params["dry_penalty_last_n"][0] = -1
    params["dry_sequence_breakers"][0] = None  # row 0 penalises: its repeats are not cut short
    processing = _validated(12, vocab, **params).processing
    samplers = processing.sequence_samplers
    assert samplers.penalties and not samplers.bans
    x = torch.randn(12, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    x[1, 0], x[2, -1] = float("nan"), float("inf")
    got = kernels.penalise(x.to(DEVICE), samplers).cpu()
    _assert_same(got, apply_processing(x.clone(), processing))
    held = sorted(set(samplers.tiles[:, TileLayout.ROW].tolist()))  # the rows that penalise
    picks = [held[-1], 0, 0, held[len(held) // 2], held[0], held[0], held[0]]  # rows repeated, a penalising one among them
    repeated = samplers.rows(torch.tensor(picks))
    assert repeated.instances is not None
    picked = x[picks]
    got = kernels.penalise(picked.to(DEVICE), repeated).cpu()
    _assert_same(got, apply_processing(picked.clone(), type(processing)(sequence_samplers=repeated)))
    assert not kernels._penalty.any()


def _refuse_torch_processing(*args: object, **kwargs: object) -> None:
    raise AssertionError("the call took the torch processing path")


@pytest.mark.parametrize("sampler", ["no_repeat_ngram", "dry"])
@pytest.mark.parametrize("vocab", [3, 111, 151936])
@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
                                    {"temperature": 0.0}], ids=["gumbel", "top_k_top_p", "greedy"])
def test_the_backend_samples_through_the_sequence_kernels_as_the_reference(
        cuda_backend, monkeypatch: pytest.MonkeyPatch, sampler: str, vocab: int, params: dict) -> None:
    """Histories whose tokens hold most of the probability (so that the bans and penalties decide), no torch
    processing on the GPU: the reference's tokens (up to its rounding edges), validity flags and processed log-probs.
    At V = 3 some rows ban every token and are flagged invalid on both."""
    rows = 16
    bans = _bans_case(40 + vocab, rows=rows, vocab=vocab, longest=4096 if vocab > 3 else 40)
    if sampler == "dry":
        bans["no_repeat_ngram_size"] = [0] * rows
        bans["dry_multiplier"] = [0.8, 3.0, 1e30, 0.5] * (rows // 4)
        bans["dry_sequence_breakers"][:rows // 2] = [None] * (rows // 2)  # at V = 3 breakers can cut every repeat
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen)
    for row, history in enumerate(bans["output_token_ids"]):
        if history:  # the history's tokens the likeliest
            x[row, torch.tensor(history[-64:])] += 8.0
    request = build_sample_request(x, seed=list(range(rows)), num_samples=2, return_logprobs=True,
                                   logprobs_mode="processed", **params, **bans)
    batch, _ = validate_sample_request(request, Limits())
    assert (bans_only if sampler == "no_repeat_ngram" else penalties_only)(batch.processing)
    monkeypatch.setattr(cuda_module, "apply_processing", _refuse_torch_processing)
    got = cuda_backend.sample(replace(batch, logits=x.to(DEVICE)))
    want = CpuBackend().sample(batch)
    assert torch.equal(got.valid, want.valid) and torch.equal(got.nan_detected, want.nan_detected)
    processed = apply_processing(x.clone(), batch.processing)
    assert_tokens_agree(processed, batch, got, want)
    banned = torch.isneginf(processed)
    valid = want.valid
    assert not banned[torch.arange(rows)[valid].unsqueeze(1), got.tokens[valid].clamp(min=0)].any()
    same = (got.tokens == want.tokens).all(dim=1) & valid
    torch.testing.assert_close(got.logprobs[same], want.logprobs[same], rtol=1e-4, atol=1e-4, equal_nan=True)
