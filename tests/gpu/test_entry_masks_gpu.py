"""Allowed and banned token lists (min_tokens' bans among them) as bitmask rows on the CUDA backend
(backends/entry_masks.py; docs/semantics.md, step 2).

A call whose only processing is those lists, on few rows, is read by the kernels through the bitmask rows built on
the host; on more rows it keeps the torch path (a float32 copy masked in place). Either way every kernel family must
sample, bit for bit, what it samples from the logits masked beforehand, log-probs included, and agree with the CPU
reference as the unmasked routes do. A spy on the torch processing checks which path each call took. The autouse
fixture of conftest.py asserts that no row went to the exact filter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokensampler_server.backends import cuda as cuda_module
from tokensampler_server.backends.entry_masks import MAX_BYTES, words_of
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.model.sampling import LogitProcessing, LogprobsMode, TokenEntries

from ..test_entry_masks import random_lists
from .conftest import MODES, logits, make_batch
from .test_token_bitmask_gpu import assert_agrees, assert_same_result

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB = 128256
FEW = 10  # rows with lists that fit MAX_BYTES at VOCAB
MANY = 40  # rows that do not


@pytest.fixture
def torch_calls(monkeypatch) -> list[int]:
    """Rows of each call that took the torch processing path."""
    calls: list[int] = []
    original = cuda_module.apply_processing
    monkeypatch.setattr(cuda_module, "apply_processing",
                        lambda x, processing, **kw: calls.append(x.shape[0]) or original(x, processing, **kw))
    return calls


def kept(processing: LogitProcessing, num_rows: int, vocab: int) -> torch.Tensor:
    """bool [B, V]: the tokens step 2 of the reference keeps."""
    return apply_processing(torch.zeros(num_rows, vocab), processing) > float("-inf")


def test_the_row_counts_straddle_the_budget() -> None:
    assert FEW * 4 * words_of(VOCAB) <= MAX_BYTES < MANY * 4 * words_of(VOCAB) * 4 // 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows", [FEW, MANY])
@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_p", "min_p", "large_k", "top_k_min_p"])
def test_lists_sample_what_the_premasked_logits_sample(cuda_backend, cpu_backend, torch_calls, mode: str,
                                                       num_rows: int, dtype: torch.dtype) -> None:
    x = logits("spiky", num_rows, VOCAB, seed=num_rows, dtype=dtype).cuda()
    processing = random_lists(num_rows, VOCAB, seed=num_rows)
    allowed = kept(processing, num_rows, VOCAB)
    params = dict(MODES[mode], num_samples=2)
    got = cuda_backend.sample(make_batch(x, processing=processing, **params))
    assert torch_calls == ([] if num_rows == FEW else [num_rows])
    assert_same_result(got, cuda_backend.sample(make_batch(x.masked_fill(~allowed.cuda(), float("-inf")), **params)))
    assert got.valid.tolist() == [row % 5 != 3 for row in range(num_rows)]  # row 3 of 5: its bans empty its list
    assert_agrees(got, make_batch(x.cpu(), processing=processing, **params), cpu_backend, x, allowed)


@pytest.mark.parametrize("logprobs_mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
@pytest.mark.parametrize("mode", ["greedy", "top_k_top_p", "top_p", "large_k"])
def test_logprobs(cuda_backend, torch_calls, logprobs_mode: LogprobsMode, mode: str) -> None:
    """Raw log-probs are of the input logits (before step 2); processed ones of the masked logits, bit for bit those
    of the premasked logits."""
    x = logits("spiky", FEW, VOCAB, seed=3).cuda()
    processing = random_lists(FEW, VOCAB, seed=4)
    allowed = kept(processing, FEW, VOCAB)
    params = dict(MODES[mode], num_samples=2, return_logprobs=True, logprobs_mode=logprobs_mode, top_logprobs=5)
    got = cuda_backend.sample(make_batch(x, processing=processing, **params))
    assert torch_calls == []
    premasked = cuda_backend.sample(make_batch(x.masked_fill(~allowed.cuda(), float("-inf")), **params))
    assert torch.equal(got.tokens, premasked.tokens)
    if logprobs_mode is LogprobsMode.PROCESSED:
        assert_same_result(got, premasked)
    else:
        valid = got.valid
        raw = torch.log_softmax(x.float(), dim=1).cpu()
        torch.testing.assert_close(got.logprobs[valid], raw[valid].gather(1, got.tokens[valid]), rtol=1e-5, atol=1e-5)


def test_a_nan_that_a_list_bans_is_no_nan(cuda_backend, torch_calls) -> None:
    """A banned token is -inf before step 5 looks for NaN (choice 1): its NaN does not flag the row; an allowed NaN
    does."""
    x = logits("flat", 3, VOCAB, seed=5).cuda()
    x[:, 7] = float("nan")
    banned = TokenEntries(rows=torch.tensor([0, 1]), tokens=torch.tensor([7, 9]))
    got = cuda_backend.sample(make_batch(x, processing=LogitProcessing(banned=banned), **MODES["top_k_top_p"]))
    assert torch_calls == []
    assert got.nan_detected.tolist() == [False, True, True]


@pytest.mark.parametrize("num_rows", [4, 256])
def test_min_tokens_from_a_request(cuda_backend, cpu_backend, torch_calls, num_rows: int) -> None:
    """min_tokens' stop-id bans, as validation builds them, take the bitmask rows (one, shared by every row, at any
    B) and never draw a stop id."""
    from tokensampler_client.params import build_sample_request
    from tokensampler_server.core.config import Limits
    from tokensampler_server.validation.sample import validate_sample_request

    x = logits("spiky", num_rows, VOCAB, seed=6)
    stops = x[:4].argmax(dim=1).tolist()  # the first rows' most likely tokens: banned, they must not come out
    request = build_sample_request(x, seed=list(range(num_rows)), temperature=0.0, min_tokens=5, num_generated=1,
                                   stop_token_ids=stops)
    batch, _ = validate_sample_request(request, Limits())
    got = cuda_backend.sample(dataclasses.replace(batch, logits=x.cuda()))
    assert torch_calls == []
    assert not any(token in stops for token in got.tokens[:, 0].tolist())
    assert torch.equal(got.tokens, cpu_backend.sample(batch).tokens)  # greedy: exact
