"""workloads/score.py (docs/semantics.md, choice 18) against direct computations, validation, and the server."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import torch
from tokensampler_client import SamplerClient, TokenSamplerError, cli
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.workloads import build_score_request
from tokensampler_server.backends.cpu import kept_token_mask
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.workloads import score as score_module
from tokensampler_server.workloads.score import LogitSource, TokenScoring, score_tokens
from tokensampler_server.validation.workloads import validate_score_request
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight
from tokensampler_server.rpc.service import ON_LOOP_ANSWER_BYTES

from .conftest import RunningServer

CPU = torch.device("cpu")


def _scoring(ids: torch.Tensor, processed: bool = False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
             top_logprobs: int = 0, entropy: bool = False) -> TokenScoring:
    n = ids.numel()
    column = lambda value, dtype: torch.as_tensor(value, dtype=dtype).expand(n).clone()  # noqa: E731
    return TokenScoring(token_ids=ids.reshape(-1), temperature=column(temperature, torch.float32),
                        top_k=column(top_k, torch.int32), top_p=column(top_p, torch.float32),
                        min_p=column(min_p, torch.float32), processed=processed, top_logprobs=top_logprobs,
                        entropy=entropy)


def _data(rows: int = 12, vocab: int = 300, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3, torch.randint(vocab, (rows,), generator=gen)


def _entropy(table: torch.Tensor) -> torch.Tensor:
    p = table.exp()
    return -torch.where(p > 0, p * table, torch.zeros_like(p)).sum(dim=1)


@pytest.mark.parametrize("slice_elements", [1 << 22, 7 * 12], ids=["one slice", "slices of 7 tokens"])
def test_raw_scores_are_log_softmax_gathered(monkeypatch, slice_elements: int) -> None:
    monkeypatch.setattr(score_module, "_SLICE_ELEMENTS", slice_elements)
    logits, ids = _data()
    logits[3, 5:40] = float("-inf")
    logits[4, 7] = float("nan")
    logits[5] = float("-inf")  # nothing finite
    scores = score_tokens(LogitSource(logits=logits), _scoring(ids, top_logprobs=5, entropy=True), CPU)
    table = torch.log_softmax(logits.nan_to_num(nan=float("-inf")), dim=1)
    expected = table.gather(1, ids.unsqueeze(1)).squeeze(1)
    valid = torch.arange(12) != 5
    torch.testing.assert_close(scores.logprobs[valid], expected[valid], rtol=0, atol=2e-5)
    torch.testing.assert_close(scores.entropy[valid], _entropy(table)[valid], rtol=0, atol=2e-5)
    values, top_ids = torch.sort(table, dim=1, descending=True, stable=True)
    assert torch.equal(scores.top_ids[valid], top_ids[valid, :5])
    torch.testing.assert_close(scores.top_values[valid], values[valid, :5], rtol=0, atol=2e-5)
    assert scores.logprobs[5].isnan() and scores.entropy[5].isnan()
    assert scores.top_ids[5].eq(-1).all() and scores.top_values[5].isnan().all()


@pytest.mark.parametrize("slice_elements", [1 << 22, 1], ids=["one slice", "slices of 1 token"])
@pytest.mark.parametrize("logits,processed,temperature", [
    ([1e8, 1e8, -5.0], False, 1.0),  # max(z) + log 2 rounds to max(z) in float32
    ([3e4, 3e4, 0.0], False, 1.0),
    ([3.0, 3.0, 1.0], True, 1e-10),
    ([3.0, 3.0, 1.0], True, 1e-45),  # x / T overflows; (x - max) / T does not
    ([-5.0, 1e8, 1e8], True, 1e-3),  # the tied maximum in the last slice: earlier sums rescaled to nothing
], ids=["raw 1e8", "raw 3e4", "T 1e-10", "T 1e-45", "T 1e-3 max last"])
def test_two_tied_maxima_score_log_one_half_at_any_scale(monkeypatch, slice_elements: int, logits: list[float],
                                                        processed: bool, temperature: float) -> None:
    """z = (x - max) / T as Sample takes it (choice 2): two tied maxima and a far third score exactly log 1/2, and
    the entropy is log 2, however large |x / T|."""
    monkeypatch.setattr(score_module, "_SLICE_ELEMENTS", slice_elements)
    x = torch.tensor([logits])
    tied = int(np.argmax(logits))
    scoring = _scoring(torch.tensor([tied]), processed=processed, temperature=temperature, top_logprobs=2,
                       entropy=True)
    scores = score_tokens(LogitSource(logits=x), scoring, CPU)
    half = torch.tensor([float(np.log(0.5))])
    torch.testing.assert_close(scores.logprobs, half, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores.top_values, half.expand(1, 2), rtol=0, atol=1e-6)
    assert sorted(scores.top_ids[0].tolist()) == sorted(i for i, v in enumerate(logits) if v == max(logits))
    torch.testing.assert_close(scores.entropy, -half, rtol=0, atol=1e-6)


def test_top_logprob_ties_go_to_the_lower_id_across_slices(monkeypatch) -> None:
    monkeypatch.setattr(score_module, "_SLICE_ELEMENTS", 3)
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5]])
    scores = score_tokens(LogitSource(logits=logits), _scoring(torch.tensor([0]), top_logprobs=5), CPU)
    assert scores.top_ids.tolist() == [[1, 3, 4, 6, 7]]


@pytest.mark.parametrize("params", [
    dict(temperature=0.7),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.05, top_k=50, top_p=0.95),
    dict(temperature=0.0, top_p=0.5),
], ids=["temperature", "top_k", "top_p", "combined", "greedy"])
def test_processed_scores_follow_the_samplers_kept_set(params: dict) -> None:
    logits, ids = _data(seed=1)
    kept_ids = torch.cat([ids[:6], torch.argmax(logits[6:], dim=1)])  # half of them surely kept
    scores = score_tokens(LogitSource(logits=logits),
                          _scoring(kept_ids, processed=True, top_logprobs=4, entropy=True, **params), CPU)
    t = params["temperature"] or 1.0
    z = (logits - logits.amax(dim=1, keepdim=True)) / t
    n = logits.shape[0]
    kept = kept_token_mask(z, torch.full((n,), params.get("top_k", 0), dtype=torch.int32),
                           torch.full((n,), params.get("top_p", 1.0)), torch.full((n,), params.get("min_p", 0.0)))
    table = torch.where(kept, z, torch.tensor(float("-inf")))
    table = table - torch.logsumexp(table, dim=1, keepdim=True)
    expected = table.gather(1, kept_ids.unsqueeze(1)).squeeze(1)
    outside = ~kept.gather(1, kept_ids.unsqueeze(1)).squeeze(1)
    assert torch.equal(scores.logprobs.isneginf(), outside)
    torch.testing.assert_close(scores.logprobs[~outside], expected[~outside], rtol=0, atol=2e-5)
    torch.testing.assert_close(scores.entropy, _entropy(table), rtol=0, atol=2e-5)
    assert torch.equal(scores.top_ids, torch.sort(table, dim=1, descending=True, stable=True).indices[:, :4])


def _head(vocab: int = 300, hidden: int = 16, padded: int = 310) -> RegisteredWeight:
    gen = torch.Generator().manual_seed(2)
    finish = LogitsFinish(vocab_size=vocab, bias=torch.randn(padded, generator=gen), soft_cap=5.0, logit_scale=0.8)
    return RegisteredWeight("head", torch.randn(padded, hidden, generator=gen), finish, "")


def test_hidden_states_score_as_their_logits_without_building_them(monkeypatch) -> None:
    head = _head()
    states = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(300, (12,), generator=torch.Generator().manual_seed(4))
    expected = score_tokens(LogitSource(logits=head.logits(states)), _scoring(ids, top_logprobs=3, entropy=True), CPU)
    widths: list[tuple[int, int]] = []
    original = RegisteredWeight.logit_slice

    def recorded(self, hidden, start, stop):
        widths.append((hidden.shape[0], stop - start))
        return original(self, hidden, start, stop)

    def whole(self, hidden):
        raise AssertionError("the [N, V] logits were computed")

    monkeypatch.setattr(RegisteredWeight, "logit_slice", recorded)
    monkeypatch.setattr(RegisteredWeight, "logits", whole)
    monkeypatch.setattr(score_module, "_SLICE_ELEMENTS", 12 * 64)
    scores = score_tokens(LogitSource(hidden=states, lm_head=head), _scoring(ids, top_logprobs=3, entropy=True), CPU)
    assert widths and all(rows * width <= 12 * 64 for rows, width in widths) and sum(w for _, w in widths) == 300
    for name in ("logprobs", "entropy", "top_values"):
        torch.testing.assert_close(getattr(scores, name), getattr(expected, name), rtol=0, atol=2e-5)
    assert torch.equal(scores.top_ids, expected.top_ids)


def test_filtered_rows_from_hidden_states_take_bounded_groups_of_rows(monkeypatch) -> None:
    head = _head()
    states = torch.randn(12, 16, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(300, (12,), generator=torch.Generator().manual_seed(6))
    scoring = _scoring(ids, processed=True, temperature=0.9, top_p=0.9, entropy=True)
    expected = score_tokens(LogitSource(logits=head.logits(states)), scoring, CPU)
    monkeypatch.setattr(score_module, "_SLICE_ELEMENTS", 4 * 300)
    rows_seen: list[int] = []
    original = RegisteredWeight.logit_slice
    monkeypatch.setattr(RegisteredWeight, "logit_slice",
                        lambda self, h, a, b: rows_seen.append(h.shape[0]) or original(self, h, a, b))
    scores = score_tokens(LogitSource(hidden=states, lm_head=head), scoring, CPU)
    assert rows_seen == [4, 4, 4]
    assert torch.equal(scores.logprobs.isneginf(), expected.logprobs.isneginf())
    torch.testing.assert_close(scores.logprobs, expected.logprobs, rtol=0, atol=2e-5)


def _request(logits=None, ids=None, **params) -> pb.ScoreTokensRequest:
    logits = torch.zeros(2, 3, 40) if logits is None else logits
    ids = torch.zeros(2, 3, dtype=torch.int64) if ids is None else ids
    return build_score_request(logits, ids, **params)


@pytest.mark.parametrize("request_, field, expected", [
    (_request(ids=torch.zeros(2, 4, dtype=torch.int64)), "token_ids.shape", "[B, T] = [2, 3]"),
    (_request(ids=torch.full((2, 3), 40)), "token_ids", "[0, V=40)"),
    (_request(ids=torch.full((2, 3), -1)), "token_ids", "[0, V=40)"),
    (_request(top_p=0.0), "top_p", "0 < p <= 1"),
    (pb.ScoreTokensRequest(logits=_request().logits, token_ids=_request().token_ids, temperature=[1.0, 2.0, 3.0]),
     "temperature", "B=2"),
    (_request(top_logprobs=21), "top_logprobs", "at most 20"),
    (pb.ScoreTokensRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 40], data=bytes(320)),
                           token_ids=_request().token_ids), "logits.shape", "3 sizes"),
    (pb.ScoreTokensRequest(), "input", "expected logits, or hidden"),
], ids=["ids shape", "id past V", "negative id", "top_p", "column length", "top_logprobs", "rank", "no input"])
def test_validation_names_the_field(request_, field: str, expected: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_score_request(request_, Limits(max_top_logprobs=20))
    assert err.value.field == field and expected in err.value.message


def test_top_logprobs_past_v_list_the_whole_vocabulary_as_sample_does() -> None:
    """N = 5 over V = 4: the min(N, V) best (step 11), as Sample returns them, not a refusal."""
    logits = torch.tensor([[[0.5, 2.0, -1.0, 2.0]]])
    _, source, scoring = validate_score_request(_request(logits=logits, ids=torch.zeros(1, 1, dtype=torch.int64),
                                                         top_logprobs=5), Limits())
    scores = score_tokens(source, scoring, CPU)
    assert scores.top_ids.tolist() == [[1, 3, 0, 2]]
    torch.testing.assert_close(scores.top_values, torch.log_softmax(logits[0], dim=1)[:, [1, 3, 0, 2]])


def test_positions_are_bounded_by_the_row_limit() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_score_request(_request(logits=torch.zeros(2, 5, 4), ids=torch.zeros(2, 5, dtype=torch.int64)),
                               Limits(max_batch_rows=8))
    assert err.value.field == "logits.shape" and "at most 8" in err.value.message


def test_end_to_end_raw_processed_and_hidden(client: SamplerClient) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 5, 64, generator=gen) * 2
    ids = torch.randint(64, (2, 5), generator=gen)
    raw = client.score_tokens(logits, ids, top_logprobs=3, return_entropy=True)
    table = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(raw.logprobs, table.gather(2, ids.unsqueeze(2)).squeeze(2), rtol=0, atol=2e-5)
    assert raw.top_logprob_ids.shape == (2, 5, 3) and raw.entropy.shape == (2, 5)
    processed = client.score_tokens(logits, ids, mode="processed", temperature=[0.5, 1.0], top_k=5)
    plain = client.score_tokens(logits, ids)
    assert processed.entropy is None and processed.top_logprob_ids is None
    expected = score_tokens(LogitSource(logits=logits.reshape(10, 64)), _scoring(
        ids.reshape(-1), processed=True, temperature=torch.tensor([0.5, 1.0]).repeat_interleave(5), top_k=5), CPU)
    torch.testing.assert_close(processed.logprobs.reshape(-1), expected.logprobs, rtol=0, atol=0)
    assert not torch.equal(processed.logprobs, plain.logprobs)

    head = torch.randn(64, 8, generator=gen)
    client.register_weights("score-head", head)
    try:
        states = torch.randn(2, 5, 8, generator=gen)
        by_hidden = client.score_tokens_hidden(states, "score-head", ids, return_entropy=True)
        by_logits = client.score_tokens(states @ head.T, ids, return_entropy=True)
        torch.testing.assert_close(by_hidden.logprobs, by_logits.logprobs, rtol=0, atol=1e-4)
        torch.testing.assert_close(by_hidden.entropy, by_logits.entropy, rtol=0, atol=1e-4)
    finally:
        client.unregister_weights("score-head")
    with pytest.raises(TokenSamplerError) as err:
        client.score_tokens(logits, torch.full((2, 5), 64))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.value.details


def test_a_large_answer_is_serialised_off_the_event_loop_and_complete(client: SamplerClient) -> None:
    """4096 positions with 64 top log-probs and the entropy each: an answer of 2 MB, past ON_LOOP_ANSWER_BYTES, made
    on a thread; every value as torch's log_softmax gives it."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 4096, 64, generator=gen) * 3
    ids = torch.randint(64, (1, 4096), generator=gen)
    scores = client.score_tokens(logits, ids, top_logprobs=64, return_entropy=True)
    assert 4 * (scores.logprobs.numel() + 2 * scores.top_logprob_ids.numel() + scores.entropy.numel()) \
        > ON_LOOP_ANSWER_BYTES
    table = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(scores.logprobs, table.gather(2, ids.unsqueeze(2)).squeeze(2), rtol=0, atol=2e-5)
    torch.testing.assert_close(scores.top_logprobs, table.sort(dim=-1, descending=True).values, rtol=0, atol=2e-5)
    torch.testing.assert_close(scores.entropy, -(table.exp() * table).sum(-1), rtol=0, atol=1e-4)


def test_the_cli_scores_and_takes_a_bitmask(server: RunningServer, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", server.target, "score", "--random-logits", "2x3x50", "--entropy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert np.asarray(out["logprobs"]).shape == (2, 3) and np.asarray(out["entropy"]).shape == (2, 3)
    mask = tmp_path / "mask.npy"
    np.save(mask, np.array([[1 << 3, 0]], dtype=np.int32))  # token 3 alone
    assert cli.main(["--target", server.target, "sample", "--random-logits", "1x50", "--token-bitmask", str(mask),
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [[3]]
