"""Prepared calls on the CUDA backend (LocalSampler.prepare): the tokens of sample() for the same rows and counters,
no synchronisation, and the same tokens when captured in a CUDA graph and replayed with counters written inside
it."""

from __future__ import annotations

import pytest
import torch

from tokensampler_server.inprocess import LocalSampler, capture

from .conftest import MODES, logits, row_seeds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB = 32000
MIXED = {"temperature": [0.0, 0.7, 1.0, 1.3] * 10, "top_k": [0, 50, 300, 0] * 10, "top_p": [1.0, 0.9, 0.95, 0.8] * 10,
         "min_p": [0.0, 0.0, 0.05, 0.02] * 10}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("rows", [8, 40])  # 40: top-p rows take the frontier route
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_tokens_are_sample_s(sampler: LocalSampler, mode: str, rows: int, dtype: torch.dtype) -> None:
    x = logits("spiky", rows, VOCAB, seed=rows, dtype=dtype).cuda()
    params = {**MODES[mode], "seed": row_seeds(rows)}
    prepared = sampler.prepare(rows, VOCAB, num_samples=2, position=0, **params)
    for step in (0, 5):
        prepared.position.fill_(step)
        got = prepared(x)
        want = sampler.sample(x, num_samples=2, position=step, **params)
        assert torch.equal(got.tokens.cpu(), want.tokens), (mode, step)
        assert torch.equal(got.valid.cpu(), want.valid) and torch.equal(got.nan_detected.cpu(), want.nan_detected)


def test_mixed_rows_and_invalid_rows(sampler: LocalSampler) -> None:
    rows = len(MIXED["temperature"])
    x = logits("flat", rows, VOCAB, seed=3).cuda()
    x[3] = float("-inf")
    x[5, 7] = float("nan")
    prepared = sampler.prepare(rows, VOCAB, seed=row_seeds(rows), position=9, **MIXED)
    got, want = prepared(x), sampler.sample(x, seed=row_seeds(rows), position=9, **MIXED)
    assert torch.equal(got.tokens.cpu(), want.tokens)
    assert not got.valid[3] and got.tokens[3, 0] == -1 and got.nan_detected[5]
    assert torch.equal(got.valid.cpu(), want.valid) and torch.equal(got.nan_detected.cpu(), want.nan_detected)


def test_a_prepared_call_never_synchronises(sampler: LocalSampler) -> None:
    x = logits("spiky", 16, VOCAB, seed=4).cuda()
    prepared = sampler.prepare(16, VOCAB, top_k=50, top_p=0.9, seed=1)
    prepared(x)  # first call: nothing left to build
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepared.position.add_(1)
        prepared(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("params", [{"top_k": 50, "top_p": 0.9}, {"top_p": 0.9}, MIXED, {"min_p": 0.1},
                                    {"top_k": 1000}])
def test_a_captured_call_replays_sample_s_tokens(sampler: LocalSampler, params: dict) -> None:
    rows = 40
    x = logits("spiky", rows, VOCAB, seed=8).cuda()
    prepared = sampler.prepare(rows, VOCAB, seed=row_seeds(rows), position=0, **params)

    def step():
        prepared.position.add_(1)
        return prepared(x)

    graph, out = capture(step)
    prepared.position.fill_(0)
    for step in range(1, 4):
        graph.replay()
        want = sampler.sample(x, seed=row_seeds(rows), position=step, **params)
        assert torch.equal(out.tokens.cpu(), want.tokens), step
    x.copy_(logits("flat", rows, VOCAB, seed=9).cuda())  # new logits in the same buffer
    graph.replay()
    assert torch.equal(out.tokens.cpu(), sampler.sample(x, seed=row_seeds(rows), position=4, **params).tokens)


def test_a_captured_call_from_hidden_states(sampler: LocalSampler) -> None:
    g = torch.Generator().manual_seed(12)
    weight = (torch.randn(VOCAB, 256, generator=g) * 0.05).to(torch.bfloat16).cuda()
    hidden = torch.randn(8, 256, generator=g).to(torch.bfloat16).cuda()
    head = sampler.register_head(weight)
    prepared = sampler.prepare(8, head=head, top_k=50, top_p=0.9, seed=row_seeds(8), position=0)
    graph, out = capture(lambda: prepared(hidden))
    graph.replay()
    want = sampler.sample_hidden(hidden, head, top_k=50, top_p=0.9, seed=row_seeds(8), position=0)
    assert torch.equal(out.tokens.cpu(), want.tokens)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_rows_the_top_k_kernel_flags_are_settled_on_the_device(sampler: LocalSampler, num_samples: int) -> None:
    """Rows whose top-k cut falls inside a run of equal logits are flagged by the one-pass kernel: sample() samples
    them again after its synchronisation, a prepared call on the device; both give the same tokens."""
    rows = 12
    x = logits("spiky", rows, VOCAB, seed=21).cuda()
    x[::2] = 0.0
    x[::2, :10] = 5.0  # the even rows: 10 tokens above the cut, 31990 tied at it
    params = {"top_k": 50, "top_p": 0.95, "seed": row_seeds(rows), "position": 3}
    prepared = sampler.prepare(rows, VOCAB, num_samples=num_samples, **params)
    before = sampler._backend.fallbacks()["exact_rows"]
    want = sampler.sample(x, num_samples=num_samples, **params)
    assert sampler._backend.fallbacks()["exact_rows"] - before == rows // 2  # the tied rows, and only they
    got = prepared(x)
    assert torch.equal(got.tokens.cpu(), want.tokens)
    assert bool(got.valid.all())


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("params", [MODES["top_k_top_p"], MODES["top_p"], MODES["greedy"], MIXED])
def test_prepared_log_probs_are_sample_s(sampler: LocalSampler, mode: str, params: dict) -> None:
    rows = len(MIXED["temperature"])
    x = logits("spiky", rows, VOCAB, seed=31).cuda()
    options = {"return_logprobs": True, "logprobs_mode": mode, "top_logprobs": 5, "num_samples": 2,
               "seed": row_seeds(rows), "position": 6, **params}
    prepared = sampler.prepare(rows, VOCAB, **options)
    graph, got = capture(lambda: prepared(x))
    graph.replay()
    want = sampler.sample(x, **options)
    assert torch.equal(got.tokens.cpu(), want.tokens)
    assert torch.equal(got.top_logprob_ids.cpu(), want.top_logprob_ids)
    torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(got.top_logprobs.cpu(), want.top_logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)
