"""Prepared calls on hidden states (LocalSampler.prepare with a head; backends/cuda_prepared_hidden.py): the fused
kernel where it takes the call, the rows it flags sampled again on the device, and the tokens of sample_hidden()
for the same rows and counters, eager, captured in a CUDA graph, and without a synchronisation.

The flagged rows' logits are W·h summed in another order than cuBLAS's (sample_hidden's path for them): equal up
to fp32 rounding, which these fixed seeds never bring to a tie (the kernels are deterministic, so a pass is not
luck of the run)."""

from __future__ import annotations

import pytest
import torch

from tokensampler_server.backends import cuda_fused
from tokensampler_server.backends.base import ThroughHead
from tokensampler_server.backends.cuda_buffers import FLAG_UNSETTLED
from tokensampler_server.backends.cuda_kernels import RowParams
from tokensampler_server.backends.cuda_prepared_hidden import CudaPreparedHidden
from tokensampler_server.inprocess import LocalSampler, capture

from .conftest import row_seeds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB, DIM = 32000, 256
FLAT = {"top_p": 0.9}  # flat rows: a nucleus of thousands of tokens, past the fused kernel's candidates
MIXED = {"temperature": [0.0, 0.7, 1.0, 1.3] * 6, "top_k": [0, 50, 20, 0] * 6, "top_p": [1.0, 0.9, 0.95, 0.8] * 6,
         "min_p": [0.0, 0.0, 0.05, 0.0] * 6}


def _head_and_states(sampler: LocalSampler, rows: int, scale: float, seed: int = 12):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(VOCAB, DIM, generator=g) * scale).to(torch.bfloat16).cuda()
    hidden = torch.randn(rows, DIM, generator=g).to(torch.bfloat16).cuda()
    return sampler.register_head(weight), hidden


def _flagged_rows(head, hidden: torch.Tensor, params: dict) -> int:
    """How many rows the fused kernel alone leaves to the logits path for these parameters."""
    rows = hidden.shape[0]
    columns = {name: params.get(name, default) for name, default in
               (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))}
    full = {name: torch.tensor(value if isinstance(value, list) else [value] * rows) for name, value in columns.items()}
    row = RowParams(temperature=full["temperature"].float().cuda(), top_k=full["top_k"].int().cuda(),
                    top_p=full["top_p"].float().cuda(), min_p=full["min_p"].float().cuda(),
                    seed=torch.tensor(row_seeds(rows)).cuda(), position=torch.zeros(rows, dtype=torch.int64).cuda(),
                    iteration=torch.zeros(rows, dtype=torch.int64).cuda())
    _, _, flags = cuda_fused.fused_sample(head.weight, hidden, row)
    return int(((flags & FLAG_UNSETTLED) != 0).sum())


CASES = [(params, n) for params in ({"top_k": 50, "top_p": 0.9}, FLAT, MIXED, {"min_p": 0.1}, {"temperature": 0.0})
         for n in (1, 3)] + [({}, 1)]  # rows without filters: one sample a row in the fused kernel


@pytest.mark.parametrize(("params", "num_samples"), CASES)
def test_tokens_are_sample_hidden_s(sampler: LocalSampler, params: dict, num_samples: int) -> None:
    rows = len(MIXED["temperature"]) if params is MIXED else 16
    head, hidden = _head_and_states(sampler, rows, scale=0.05)
    prepared = sampler.prepare(rows, head=head, num_samples=num_samples, seed=row_seeds(rows), position=0, **params)
    assert isinstance(prepared._prepared, CudaPreparedHidden)
    for step in (0, 7):
        prepared.position.fill_(step)
        got = prepared(hidden)
        want = sampler.sample_hidden(hidden, head, num_samples=num_samples, seed=row_seeds(rows), position=step, **params)
        assert torch.equal(got.tokens.cpu(), want.tokens), step
        assert torch.equal(got.valid.cpu(), want.valid) and torch.equal(got.nan_detected.cpu(), want.nan_detected)


def test_flagged_rows_are_settled_on_the_device(sampler: LocalSampler) -> None:
    rows = 16
    head, hidden = _head_and_states(sampler, rows, scale=0.05)
    assert _flagged_rows(head, hidden, FLAT) == rows  # every row needs the device's second route here
    prepared = sampler.prepare(rows, head=head, seed=row_seeds(rows), position=0, **FLAT)
    got = prepared(hidden)
    want = sampler.sample_hidden(hidden, head, seed=row_seeds(rows), position=0, **FLAT)
    assert torch.equal(got.tokens.cpu(), want.tokens) and bool(got.valid.all())


def test_a_captured_call_replays_sample_hidden_s_tokens(sampler: LocalSampler) -> None:
    rows = len(MIXED["temperature"])
    head, hidden = _head_and_states(sampler, rows, scale=0.05, seed=3)
    assert _flagged_rows(head, hidden, MIXED) > 0
    prepared = sampler.prepare(rows, head=head, seed=row_seeds(rows), position=0, **MIXED)

    def step():
        prepared.position.add_(1)
        return prepared(hidden)

    graph, out = capture(step)
    prepared.position.fill_(0)
    for position in range(1, 4):
        graph.replay()
        want = sampler.sample_hidden(hidden, head, seed=row_seeds(rows), position=position, **MIXED)
        assert torch.equal(out.tokens.cpu(), want.tokens), position
    hidden.copy_(torch.randn(rows, DIM, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out.tokens.cpu(), sampler.sample_hidden(hidden, head, seed=row_seeds(rows), position=4,
                                                               **MIXED).tokens)


def test_a_prepared_hidden_call_never_synchronises(sampler: LocalSampler) -> None:
    head, hidden = _head_and_states(sampler, 16, scale=0.05)
    prepared = sampler.prepare(16, head=head, seed=1, **FLAT)
    prepared(hidden)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepared.position.add_(1)
        prepared(hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_hidden_states_in_another_dtype_take_the_head_s_product(sampler: LocalSampler) -> None:
    rows = 8
    head, hidden = _head_and_states(sampler, rows, scale=0.05)
    prepared = sampler.prepare(rows, head=head, top_k=50, top_p=0.9, seed=row_seeds(rows), position=0)
    wide = hidden.float() + 1e-3  # not a bf16 value: W·h of fp32 states, not of their rounding
    prepared.position.fill_(5)  # the counters are the call's, whichever input comes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the other dtype's call is made at prepare: its first use is a step
    try:
        got = prepared(wide)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = sampler.sample_hidden(wide, head, top_k=50, top_p=0.9, seed=row_seeds(rows), position=5)
    assert torch.equal(got.tokens.cpu(), want.tokens)


@pytest.mark.parametrize("options", [{"return_logprobs": True}, {"top_logprobs": 2}, {"top_k": 100}])
def test_calls_the_fused_kernel_does_not_take_go_through_the_head(sampler: LocalSampler, options: dict) -> None:
    rows = 8
    head, hidden = _head_and_states(sampler, rows, scale=0.05)
    prepared = sampler.prepare(rows, head=head, seed=row_seeds(rows), position=2, **options)
    assert isinstance(prepared._prepared, ThroughHead)
    got = prepared(hidden)
    want = sampler.sample_hidden(hidden, head, seed=row_seeds(rows), position=2, **options)
    assert torch.equal(got.tokens.cpu(), want.tokens)


def test_a_head_of_another_layout_takes_the_head_s_product(sampler: LocalSampler) -> None:
    """A [V, D] view of a [D, V] tensor: its rows are not D elements apart, which the fused kernel reads; the call
    goes through the head's product, as sample_hidden does."""
    rows = 8
    g = torch.Generator().manual_seed(5)
    transposed = (torch.randn(DIM, VOCAB, generator=g) * 0.05).to(torch.bfloat16).cuda()
    head = sampler.register_head(transposed.t())
    hidden = torch.randn(rows, DIM, generator=g).to(torch.bfloat16).cuda()
    prepared = sampler.prepare(rows, head=head, top_k=50, top_p=0.9, seed=row_seeds(rows), position=1)
    assert isinstance(prepared._prepared, ThroughHead)
    want = sampler.sample_hidden(hidden, head, top_k=50, top_p=0.9, seed=row_seeds(rows), position=1)
    assert torch.equal(prepared(hidden).tokens.cpu(), want.tokens)
