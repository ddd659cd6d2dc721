"""The in-process API (tokensampler_server.inprocess): the service's tokens for the same request, the service's
refusals as ValueError naming the field, hidden states through a head used in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_server.inprocess import LocalSampler

from .conftest import RunningServer, connected

ROWS, VOCAB, DIM = 6, 500, 32


@pytest.fixture(scope="module")
def sampler() -> LocalSampler:
    return LocalSampler("cpu")


@pytest.fixture(scope="module")
def client(server: RunningServer):
    yield from connected(server, timeout=None)


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("params", [
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    {"temperature": [0.0, 0.5, 1.0, 1.5, 0.7, 2.0], "top_k": [0, 1, 7, 300, 499, 500], "min_p": 0.05},
    {"top_p": 0.7, "banned_token_ids": [3, 4, 5], "logit_bias": {7: 2.0}, "repetition_penalty": 1.3,
     "output_token_ids": [[1, 2, 2], [], [9], [10, 11], [], [0]], "num_samples": 3},
    {"typical_p": 0.8, "top_n_sigma": 1.5, "return_logprobs": True, "logprobs_mode": "processed",
     "top_logprobs": 4},
])
def test_the_service_s_tokens_for_the_same_request(sampler: LocalSampler, client: SamplerClient, params: dict) -> None:
    logits = _logits(1)
    seeds = list(range(100, 100 + ROWS))
    local = sampler.sample(logits, seed=seeds, position=3, **params)
    remote = client.sample(logits, seed=seeds, position=3, **params)
    assert torch.equal(local.tokens, remote.tokens)
    assert local.seeds == remote.seeds == seeds
    assert torch.equal(local.valid, remote.valid) and torch.equal(local.nan_detected, remote.nan_detected)
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


def test_a_seedless_call_reports_seeds_that_reproduce_it(sampler: LocalSampler) -> None:
    logits = _logits(2)
    first = sampler.sample(logits, temperature=1.0, num_samples=4)
    again = sampler.sample(logits, temperature=1.0, num_samples=4, seed=first.seeds)
    assert torch.equal(first.tokens, again.tokens)


@pytest.mark.parametrize("params,field", [
    ({"top_p": 1.5}, "params.top_p"),
    ({"temperature": -1.0}, "params.temperature"),
    ({"top_k": [1, 2]}, "top_k"),
    ({"num_samples": 0}, "num_samples"),
    ({"logprobs_mode": "softmax"}, "logprobs_mode"),
    ({"top_q": 0.5}, "top_q"),
])
def test_refusals_name_the_field(sampler: LocalSampler, params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sampler.sample(_logits(3), **params)


def test_hidden_states_through_a_registered_head(sampler: LocalSampler) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB + 12, DIM, generator=gen)  # 12 padding rows: never sampled
    bias = torch.randn(VOCAB + 12, generator=gen)
    hidden = torch.randn(ROWS, DIM, generator=gen)
    head = sampler.register_head(weight, bias=bias, vocab_size=VOCAB, soft_cap=20.0)
    assert head.weight.data_ptr() == weight.data_ptr(), "a head already on the device is used in place"
    got = sampler.sample_hidden(hidden, head, top_k=40, seed=list(range(ROWS)), num_samples=2)
    logits = 20.0 * torch.tanh((hidden @ weight[:VOCAB].T + bias[:VOCAB]) / 20.0)
    want = sampler.sample(logits, top_k=40, seed=list(range(ROWS)), num_samples=2)
    assert torch.equal(got.tokens, want.tokens)
    with pytest.raises(ValueError, match="head.vocab_size"):
        sampler.register_head(weight, vocab_size=VOCAB + 13)


def _nan_row(weight: torch.Tensor) -> torch.Tensor:
    weight = weight.clone()
    weight[3, 0] = float("nan")
    return weight


@pytest.mark.parametrize("head, field", [
    ({"weight": _nan_row(torch.randn(VOCAB, DIM))}, "weight: got a NaN or infinite value in row 3"),
    ({"bias": torch.arange(VOCAB, dtype=torch.int32)}, "head.bias.dtype"),
    ({"bias": torch.zeros(VOCAB, dtype=torch.complex64)}, "head.bias.dtype"),
    ({"logit_scale": 1e300}, "head.logit_scale"),  # inf in the service's float32 field
    ({"logit_scale": 10**400}, "head.logit_scale"),
    ({"soft_cap": 1e39}, "head.soft_cap"),
])
def test_register_head_refuses_what_the_service_refuses(sampler: LocalSampler, head: dict, field: str) -> None:
    head = {"weight": torch.randn(VOCAB, DIM), **head}
    with pytest.raises(ValueError, match=f"^{field}"):
        sampler.register_head(head.pop("weight"), **head)


@pytest.mark.parametrize("make", [lambda *shape: torch.empty(*shape, device="meta"),
                                  lambda *shape: torch.zeros(*shape).to_sparse()])
def test_inputs_without_dense_data_are_refused(sampler: LocalSampler, make) -> None:
    with pytest.raises(ValueError, match="^input: got a"):
        sampler.sample(make(2, VOCAB))
    with pytest.raises(ValueError, match="^input: got a"):
        sampler.sample_hidden(make(2, DIM), sampler.register_head(torch.randn(VOCAB, DIM)))
    with pytest.raises(ValueError, match="^input: got a"):
        sampler.score(make(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("options", [
    {},
    {"mode": "processed", "temperature": [0.5, 1.0, 1.5, 0.8, 2.0, 1.0], "top_logprobs": 5, "return_entropy": True},
    {"mode": "processed", "top_k": 20, "top_p": 0.9, "min_p": 0.01, "top_logprobs": 3},
])
def test_scores_are_the_service_s(sampler: LocalSampler, client: SamplerClient, options: dict) -> None:
    """score(): ScoreTokens in process, the service's log-probs, top log-probs and entropy for the same request."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(ROWS, 4, VOCAB, generator=g) * 3
    token_ids = torch.randint(0, VOCAB, (ROWS, 4), generator=g)
    local = sampler.score(logits, token_ids, **options)
    remote = client.score_tokens(logits, token_ids, **options)
    for name in ("logprobs", "top_logprob_ids", "top_logprobs", "entropy"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:
            assert list(mine.shape) == list(theirs.shape), name
            assert torch.equal(torch.as_tensor(mine), torch.as_tensor(theirs)), name


def test_scores_from_hidden_states_are_those_of_their_logits(sampler: LocalSampler) -> None:
    """score_hidden() through a head gives score()'s results on the head's own logits."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(VOCAB, DIM, generator=g)
    hidden = torch.randn(ROWS, 3, DIM, generator=g)
    token_ids = torch.randint(0, VOCAB, (ROWS, 3), generator=g)
    head = sampler.register_head(weight)
    got = sampler.score_hidden(hidden, head, token_ids, top_logprobs=4, return_entropy=True)
    want = sampler.score(hidden @ weight.T, token_ids, top_logprobs=4, return_entropy=True)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.top_logprob_ids, want.top_logprob_ids)


@pytest.mark.parametrize("call,field", [
    (lambda s: s.score(torch.randn(2, 3, 10), torch.full((2, 3), 10)), "token_ids"),
    (lambda s: s.score(torch.randn(2, 3, 10), torch.zeros(2, 4, dtype=torch.int64)), "token_ids.shape"),
    (lambda s: s.score(torch.randn(2, 3, 10).double(), torch.zeros(2, 3, dtype=torch.int64)), "logits.dtype"),
    (lambda s: s.score(torch.randn(2, 3, 10), torch.zeros(2, 3, dtype=torch.int64), top_logprobs=65), "top_logprobs"),
])
def test_score_refusals_name_the_field(sampler: LocalSampler, call, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        call(sampler)


@pytest.mark.parametrize("shape,temperature", [((ROWS, VOCAB), None), ((ROWS, 3, VOCAB), [0.5, 1.0, 2.0, 0.7, 1.3, 0.9])])
def test_top_k_probabilities_are_the_service_s(sampler: LocalSampler, client: SamplerClient, shape: tuple,
                                               temperature) -> None:
    """topk_probs(): TopKProbs in process, the service's ids and probabilities for the same request."""
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 3
    local = sampler.topk_probs(logits, 20, temperature=temperature)
    remote = client.topk_probs(logits, 20, temperature=temperature)
    assert list(local.ids.shape) == [*shape[:-1], 20]
    assert torch.equal(local.ids, torch.as_tensor(remote.ids))
    assert torch.equal(local.probs, torch.as_tensor(remote.probs))


def test_top_k_probabilities_from_hidden_states_are_those_of_their_logits(sampler: LocalSampler) -> None:
    g = torch.Generator().manual_seed(8)
    weight, hidden = torch.randn(VOCAB, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)
    got = sampler.topk_probs_hidden(hidden, sampler.register_head(weight), 10)
    want = sampler.topk_probs(hidden @ weight.T, 10)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-6)


def test_top_k_probabilities_refusals_name_the_field(sampler: LocalSampler) -> None:
    with pytest.raises(ValueError, match=r"^k\b"):
        sampler.topk_probs(torch.randn(2, 10), 11)
    with pytest.raises(ValueError, match=r"^temperature\b"):
        sampler.topk_probs(torch.randn(2, 10), 3, temperature=0.0)


@pytest.mark.parametrize("params", [
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "num_samples": 2},
    {"temperature": [0.0, 0.5, 1.0, 1.5, 0.7, 2.0], "top_k": [0, 1, 7, 300, 499, 500], "min_p": 0.05},
])
def test_a_prepared_call_gives_sample_s_tokens_at_the_counters_written_in_place(sampler: LocalSampler,
                                                                                  params: dict) -> None:
    logits = _logits(5)
    seeds = list(range(300, 300 + ROWS))
    prepared = sampler.prepare(ROWS, VOCAB, seed=seeds, position=0, **params)
    assert prepared.seeds == seeds
    for step in range(3):
        prepared.position.fill_(step)
        prepared.iteration.fill_(step % 2)
        want = sampler.sample(logits, seed=seeds, position=step, iteration=step % 2, **params)
        got = prepared(logits)
        assert torch.equal(got.tokens, want.tokens), step
        assert torch.equal(got.valid, want.valid) and torch.equal(got.nan_detected, want.nan_detected)
    prepared.seed.copy_(torch.tensor(seeds[::-1], dtype=torch.int64))
    assert torch.equal(prepared(logits).tokens, sampler.sample(logits, seed=seeds[::-1], position=2, iteration=0,
                                                               **params).tokens)


def test_a_prepared_call_from_hidden_states_is_that_of_their_logits(sampler: LocalSampler) -> None:
    g = torch.Generator().manual_seed(6)
    weight, hidden = torch.randn(VOCAB, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)
    head = sampler.register_head(weight)
    prepared = sampler.prepare(ROWS, head=head, top_k=20, seed=7, position=4)
    assert torch.equal(prepared(hidden).tokens, sampler.sample_hidden(hidden, head, top_k=20, seed=7,
                                                                      position=4).tokens)


@pytest.mark.parametrize("call,field", [
    (lambda s: s.prepare(ROWS, VOCAB, logit_bias={1: 2.0}), "logit_bias"),
    (lambda s: s.prepare(ROWS, VOCAB, typical_p=0.5), "typical_p"),
    (lambda s: s.prepare(ROWS, VOCAB, top_p=1.5), "top_p"),
    (lambda s: s.prepare(ROWS, VOCAB, num_samples=0), "num_samples"),
    (lambda s: s.prepare(ROWS, VOCAB, logprobs_mode="exact"), "logprobs_mode"),
    (lambda s: s.prepare(ROWS), "vocab_size"),
    (lambda s: s.prepare(ROWS, VOCAB)(torch.zeros(ROWS + 1, VOCAB)), "input"),
    (lambda s: s.prepare(ROWS, VOCAB)(torch.zeros(ROWS, VOCAB, dtype=torch.float64)), "input.dtype"),
    (lambda s: s.prepare(ROWS, VOCAB)(torch.zeros(ROWS, VOCAB, dtype=torch.int64)), "input.dtype"),
    (lambda s: s.prepare(True, VOCAB), "batch_size"),
    (lambda s: s.register_head(np.zeros((VOCAB, 8), np.float32)), "weight"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8, dtype=torch.int64)), "weight"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8, dtype=torch.float64)), "weight"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8), vocab_size=90.0), "head.vocab_size"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8), logit_scale="2"), "head.logit_scale"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8), soft_cap="30"), "head.soft_cap"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8), bias=np.zeros(VOCAB, np.float32)), "head.bias"),
])
def test_prepared_call_refusals_name_the_field(sampler: LocalSampler, call, field: str) -> None:
    """Prepared calls and heads refuse, by argument, what the service and sample() refuse."""
    with pytest.raises(ValueError, match=field):
        call(sampler)


def test_a_head_takes_numpy_and_torch_scalars_for_its_options(sampler: LocalSampler) -> None:
    head = sampler.register_head(torch.randn(VOCAB + 6, 8), vocab_size=np.int64(VOCAB), soft_cap=np.float32(20.0),
                                 logit_scale=torch.tensor(0.5).item())
    assert head.finish.vocab_size == VOCAB and type(head.finish.vocab_size) is int and head.finish.soft_cap == 20.0


def test_a_prepared_call_with_log_probs_gives_sample_s(sampler: LocalSampler) -> None:
    logits = _logits(7)
    params = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "seed": 5, "position": 2}
    options = {"return_logprobs": True, "logprobs_mode": "processed", "top_logprobs": 3, "num_samples": 2}
    got = sampler.prepare(ROWS, VOCAB, **options, **params)(logits)
    want = sampler.sample(logits, **options, **params)
    assert torch.equal(got.tokens, want.tokens)
    for mine, theirs in ((got.logprobs, want.logprobs), (got.top_logprob_ids, want.top_logprob_ids),
                         (got.top_logprobs, want.top_logprobs)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("logits", [torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.int64)])
def test_logits_of_another_dtype_are_refused(sampler: LocalSampler, logits: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"dtype: got torch\.(float64|int64), expected float32, bfloat16 or float16"):
        sampler.sample(logits)


@pytest.mark.parametrize("options, name", [(dict(num_samples=-1), "num_samples"),
                                           (dict(num_samples=2.0), "num_samples"),
                                           (dict(top_logprobs=-1), "top_logprobs"),
                                           (dict(return_logprobs="yes"), "return_logprobs")])
def test_request_scalars_are_named_in_their_refusals(sampler: LocalSampler, options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        sampler.sample(torch.zeros(2, 8), **options)


def test_results_of_inputs_that_require_grad_are_values(sampler: LocalSampler) -> None:
    """As a remote call's are: no autograd graph, so .numpy() works."""
    result = sampler.sample(torch.randn(2, 8, requires_grad=True), return_logprobs=True, top_logprobs=2, seed=[1, 2])
    scored = sampler.score(torch.randn(1, 2, 8, requires_grad=True), torch.zeros(1, 2, dtype=torch.int64),
                           return_entropy=True)
    probs = sampler.topk_probs(torch.randn(2, 8, requires_grad=True), 2).probs
    for tensor in (result.logprobs, result.top_logprobs, scored.logprobs, scored.entropy, probs):
        assert not tensor.requires_grad
        tensor.numpy()


def test_a_head_and_sizes_of_the_wrong_kind_are_named(sampler: LocalSampler) -> None:
    with pytest.raises(ValueError, match="^head: got Tensor"):
        sampler.sample_hidden(torch.zeros(2, 4), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="^head: got Tensor"):
        sampler.topk_probs_hidden(torch.zeros(2, 4), torch.zeros(8, 4), 2)
    with pytest.raises(ValueError, match="^batch_size: got -1"):
        sampler.prepare(-1, 50)
    with pytest.raises(ValueError, match="^vocab_size: got None"):
        sampler.prepare(2)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


_IDS = torch.zeros(1, 2, dtype=torch.int64)


@pytest.mark.parametrize("call,field", [
    # Python numbers no float32 or int64 field holds (10**400 is no float at all: OverflowError before).
    (lambda s: s.sample(torch.zeros(2, 8), temperature=10**400), "temperature"),
    (lambda s: s.sample(torch.zeros(2, 8), temperature=[1.0, -10**400]), "temperature"),
    (lambda s: s.sample(torch.zeros(2, 8), logit_bias={1: 10**400}), "logit_bias"),
    (lambda s: s.sample(torch.zeros(2, 8), frequency_penalty=10**400), "frequency_penalty"),
    (lambda s: s.score(torch.zeros(1, 2, 8), _IDS, mode="processed", temperature=10**400), "temperature"),
    (lambda s: s.score(torch.zeros(1, 2, 8), [[0, 10**400]]), "token_ids"),
    (lambda s: s.topk_probs(torch.zeros(2, 8), 2, temperature=10**400), "temperature"),
    (lambda s: s.prepare(2, 8, temperature=10**400), "temperature"),
    (lambda s: s.prepare(2**63, 8), "batch_size"),
    (lambda s: s.prepare(2, 10**400), "vocab_size"),
    # Meta tensors (no data) wherever tensors come in (NotImplementedError or RuntimeError before).
    (lambda s: s.sample(torch.zeros(2, 8), temperature=_meta(2)), "temperature"),
    (lambda s: s.sample(torch.zeros(2, 8), temperature=[_meta(), 1.0]), "temperature"),
    (lambda s: s.sample(torch.zeros(2, 8), seed=_meta(2, dtype=torch.int64)), "seed"),
    (lambda s: s.sample(torch.zeros(2, 8), banned_token_ids=_meta(2, 1, dtype=torch.int64)), "banned_token_ids"),
    (lambda s: s.topk_probs(_meta(2, 8), 2), "input"),
    (lambda s: s.topk_probs(torch.zeros(2, 8), 2, temperature=_meta(2)), "temperature"),
    (lambda s: s.score(torch.zeros(1, 2, 8), _IDS.to("meta")), "token_ids"),
    (lambda s: s.score(torch.zeros(1, 2, 8), _IDS, mode="processed", temperature=_meta(1)), "temperature"),
    (lambda s: s.register_head(_meta(VOCAB, 8)), "weight"),
    (lambda s: s.register_head(torch.zeros(VOCAB, 8), bias=_meta(VOCAB)), "head.bias"),
    (lambda s: s.prepare(2, 8, seed=_meta(2, dtype=torch.int64)), "seed"),
    (lambda s: s.prepare(2, 8)(_meta(2, 8)), "input"),
])
def test_arguments_no_request_holds_are_value_errors_naming_them(sampler: LocalSampler, call, field: str) -> None:
    """docs/inprocess.md: bad input is a ValueError naming its argument, never torch's or protobuf's own error."""
    with pytest.raises(ValueError, match=rf"^{field}: got "):
        call(sampler)


@pytest.mark.parametrize("sizes", [(2, 2**62), (2**62, 2)])
def test_a_prepared_call_of_more_elements_than_a_request_holds_is_a_value_error(sizes: tuple[int, int]) -> None:
    """Each size fits int64 but their product does not: refused by name before a meta tensor of that shape (torch
    raised RuntimeError: its storage size overflowed)."""
    with pytest.raises(ValueError, match="batch_size: .* elements, expected at most"):
        LocalSampler("cpu").prepare(*sizes)
