"""Hostile but well-typed requests for the diffusion, top-k-probs, verification and scoring RPCs.

Every answer must be OK and well-formed (dtypes, shapes, ids in [0, V) or -1 where the contract says so)
or INVALID_ARGUMENT naming a field; never INTERNAL; the server keeps serving.
"""

from __future__ import annotations

import collections
import math

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc

from .conftest import RunningServer

ITEMSIZE = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT16: 2, pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8,
            pb.DTYPE_UINT8: 1}
FIELDS = ("logits", "mask", "params.", "confidence_threshold", "commit_count", "k", "temperature", "draft",
          "target_logits", "draft_ids", "draft_probs", "draft_logits", "token_ids", "top_k", "top_p", "min_p", "mode",
          "top_logprobs", "input")
dims = st.integers(0, 5)
dtypes = st.sampled_from([pb.DTYPE_FLOAT32] * 4 + [pb.DTYPE_BFLOAT16, pb.DTYPE_INT32, pb.DTYPE_UINT8, 0])
numbers = st.one_of(st.floats(-3, 3, width=32), st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 2.0]))


@st.composite
def tensors(draw, shape: list[int], kinds=dtypes, exact: int | None = None) -> pb.Tensor:
    """A tensor of `shape`, sometimes with another shape, dtype or one byte too many or too few; with `exact` (a
    dtype), of `shape` and that dtype, every byte there."""
    if exact is None and draw(st.integers(0, 5)) == 0:
        shape = draw(st.lists(dims, min_size=1, max_size=4))
    dtype = draw(kinds) if exact is None else exact
    size = math.prod(shape) * ITEMSIZE.get(dtype, 4) + (0 if exact is not None else draw(st.sampled_from([0, 0, 0, 0, 1, -1])))
    raw = np.random.default_rng(draw(st.integers(0, 9))).integers(0, 4, max(size, 0), dtype=np.uint8).tobytes()
    return pb.Tensor(dtype=dtype, shape=shape, data=raw)


@st.composite
def requests(draw) -> tuple[str, object]:
    b, n, v = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["diffusion", "topk", "verify", "score"]))
    # Half the requests have well-formed tensors, so that the hostile parameters and lists meet answers to check.
    exact = pb.DTYPE_FLOAT32 if draw(st.booleans()) else None
    params = pb.SamplingParams(temperature=draw(st.lists(numbers, max_size=1)), top_k=draw(st.lists(st.integers(-2, 9), max_size=1)),
                               seed=draw(st.lists(st.integers(0, 2**64 - 1), max_size=1)))
    for name in ("banned_token_ids", "output_token_ids"):
        if draw(st.integers(0, 3)) == 0:  # one list shared by every row, or one per row, ids sometimes past V
            lengths = draw(st.sampled_from([[2], [1] * b, [1] * (b + 1)]))
            ids = draw(st.lists(st.integers(-1, v), min_size=sum(lengths), max_size=sum(lengths)))
            getattr(params, name).CopyFrom(pb.TokenLists(ids=ids, lengths=lengths))
    if kind == "diffusion":
        return "SampleDiffusionStep", pb.DiffusionStepRequest(
            logits=draw(tensors([b, n, v], exact=exact)),
            mask=draw(tensors([b, n], st.sampled_from([pb.DTYPE_UINT8, pb.DTYPE_INT32, 0]),
                              exact=None if exact is None else pb.DTYPE_UINT8)),
            params=params, confidence_threshold=draw(st.lists(numbers, max_size=2)),
            commit_count=draw(st.lists(st.integers(0, 9), max_size=2)))
    if kind == "topk":
        return "TopKProbs", pb.TopKProbsRequest(
            logits=draw(tensors([b, n, v], exact=exact)), k=draw(st.integers(0, 12)),
            temperature=draw(st.lists(numbers, max_size=2)))
    ids = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[b, n],
                    data=np.random.default_rng(draw(st.integers(0, 9))).integers(0, v + (exact is None), b * n).tobytes())
    if exact is None and draw(st.integers(0, 3)) == 0:  # sometimes a malformed id tensor
        ids = draw(tensors([b, n], st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_INT64, 0])))
    if kind == "score":  # half of them with valid columns, so that the scores are checked too
        valid = draw(st.booleans())
        sizes = st.sampled_from([0, 1, b] if valid else [1, b, b + 1])

        def column(values: st.SearchStrategy) -> list:
            size = draw(sizes)
            return draw(st.lists(values, min_size=size, max_size=size))

        return "ScoreTokens", pb.ScoreTokensRequest(
            logits=draw(tensors([b, n, v], exact=exact)), token_ids=ids,
            mode=draw(st.sampled_from([0, 1, 2] if valid else [0, 1, 2, 7])),
            temperature=column(st.floats(0.25, 2, width=32) if valid else numbers),
            top_k=column(st.integers(-1 if valid else -2, 9)),
            top_p=column(st.floats(0.125, 1, width=32) if valid else numbers),
            min_p=column(st.floats(0, 0.875, width=32) if valid else numbers),
            top_logprobs=draw(st.sampled_from([0, 1, 3, 64] if valid else [0, 1, 3, 64, 65])),
            return_entropy=draw(st.booleans()))
    request = pb.VerifyDraftRequest(draft_ids=ids, target_logits=draw(tensors([b, n + 1, v], exact=exact)), params=params)
    if draw(st.booleans()):
        request.draft_probs.CopyFrom(draw(tensors([b, n, v], exact=exact)))
    elif exact is not None or draw(st.booleans()):
        request.draft_logits.CopyFrom(draw(tensors([b, n, v], exact=exact)))
    return "VerifyDraft", request


@pytest.fixture(scope="module")
def channel(server: RunningServer):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _array(tensor: pb.Tensor, dtype: int, shape: list[int]) -> np.ndarray:
    """The response tensor, once its dtype, shape and byte length are the ones the contract states."""
    assert tensor.dtype == dtype and list(tensor.shape) == shape, (tensor.dtype, list(tensor.shape), dtype, shape)
    kind = {pb.DTYPE_INT32: np.int32, pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_UINT8: np.uint8}[dtype]
    array = np.frombuffer(tensor.data, dtype=kind)
    assert array.size == math.prod(shape)
    return array.reshape(shape)


def assert_well_formed(method: str, request, response) -> None:
    """Dtypes, shapes and value ranges of a successful answer, as the contract states them."""
    if method == "SampleDiffusionStep":
        b, length, vocab = request.logits.shape
        tokens = _array(response.tokens, pb.DTYPE_INT32, [b, length])
        confidences = _array(response.confidences, pb.DTYPE_FLOAT32, [b, length])
        mask = _array(response.mask, pb.DTYPE_UINT8, [b, length])
        assert ((tokens == -1) | ((tokens >= 0) & (tokens < vocab))).all(), tokens
        assert ((confidences >= 0) & (confidences <= 1)).all(), confidences
        assert set(np.unique(mask)) <= {0, 1} and len(response.seeds) == b
    elif method == "TopKProbs":
        shape = [*request.logits.shape[:-1], request.k]
        probs = _array(response.probs, pb.DTYPE_FLOAT32, shape)
        ids = _array(response.ids, pb.DTYPE_INT32, shape)
        assert ((ids >= 0) & (ids < request.logits.shape[-1])).all(), ids
        assert ((probs >= 0) & (probs <= 1 + 1e-6)).all() and (np.diff(probs, axis=-1) <= 0).all(), probs
    elif method == "ScoreTokens":
        b, n, vocab = request.logits.shape
        logprobs = _array(response.logprobs, pb.DTYPE_FLOAT32, [b, n])
        assert not (logprobs > 1e-5).any(), logprobs
        if request.top_logprobs:
            listed = [b, n, min(request.top_logprobs, vocab)]
            ids = _array(response.top_logprob_ids, pb.DTYPE_INT32, listed)
            _array(response.top_logprobs, pb.DTYPE_FLOAT32, listed)
            assert ((ids >= -1) & (ids < vocab)).all(), ids
        if request.return_entropy:
            entropy = _array(response.entropy, pb.DTYPE_FLOAT32, [b, n])
            assert not (entropy < -1e-5).any(), entropy
    else:
        b, n = request.draft_ids.shape
        vocab = request.target_logits.shape[2]
        accepted = _array(response.accepted, pb.DTYPE_INT32, [b])
        tokens = _array(response.tokens, pb.DTYPE_INT32, [b, n + 1])
        assert ((accepted >= 0) & (accepted <= n)).all(), accepted
        for row, count in zip(tokens, accepted):  # the accepted ids and one more, then -1 (a row may hold none)
            assert ((row[: count + 1] == -1) | ((row[: count + 1] >= 0) & (row[: count + 1] < vocab))).all(), row
            assert (row[count + 1 :] == -1).all(), row
        assert len(response.seeds) == b


ANSWERED: collections.Counter[str] = collections.Counter()
"""The fuzzed requests each method answered OK, for the test after them: one whose every request is refused checks
nothing of its answers."""


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=requests())
def test_hostile_workload_requests_get_ok_or_invalid_argument(channel: grpc.Channel, call) -> None:
    method, request = call
    stub = pb_grpc.SamplerStub(channel)
    try:
        response = getattr(stub, method)(request, timeout=30)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.code(), err.details())
        assert err.details().startswith(FIELDS), err.details()
        event(f"{method}: rejected {err.details().split(':')[0]}")
        ANSWERED.setdefault(method, 0)  # fuzzed, if never answered OK
        return
    event(f"{method}: OK")
    ANSWERED[method] += 1
    assert_well_formed(method, request, response)


def test_server_still_serves(channel: grpc.Channel) -> None:
    """After the fuzzer (when it ran in the same test run: each method answers some of its requests), every
    method answered some OK, and the server still serves."""
    if ANSWERED:
        assert all(ANSWERED[method] > 0 for method in ANSWERED) and len(ANSWERED) == 4, ANSWERED
    logits = np.zeros((1, 2, 4), dtype=np.float32)
    request = pb.TopKProbsRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 2, 4], data=logits.tobytes()), k=2)
    assert list(pb_grpc.SamplerStub(channel).TopKProbs(request, timeout=30).probs.shape) == [1, 2, 2]
