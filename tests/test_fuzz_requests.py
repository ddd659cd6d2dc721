"""Property-based fuzzing of well-typed but hostile Sample requests against a real server.

Every answer must be OK and well-formed (dtypes, shapes, token ids in [0, V) or -1 in rows that are not
valid, the seeds given) or INVALID_ARGUMENT naming a request field; never INTERNAL or any other status,
and the server must keep serving afterwards.
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

ITEMSIZE = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT16: 2, pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8}
FIELD_PREFIXES = ("input", "logits.", "params.", "num_samples", "top_logprobs", "logprobs_mode")

hostile_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-45, 3.4e38, -3.4e38, 0.5, 0.999999]),
)
hostile_ints = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([-2, -1, 0, 1, 2, 50]))


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values four times in five."""
    return st.one_of(valid, valid, valid, valid, hostile)


# Valid values only: about half the requests are valid, so the sampling path is fuzzed too.
VALID_VALUES = {
    "temperature": st.floats(0, 3, width=32),
    "top_k": st.integers(-1, 40),
    "top_p": st.floats(0.125, 1, width=32),
    "min_p": st.floats(0, 0.875, width=32),
    "seed": st.integers(0, 2**64 - 1),
    "position": st.integers(0, 2**32 - 1),
    "iteration": st.integers(0, 2**32 - 1),
    "repetition_penalty": st.floats(0.25, 3, width=32),
    "presence_penalty": st.floats(-2, 2, width=32),
    "frequency_penalty": st.floats(-2, 2, width=32),
    # The local samplers (docs/semantics.md, "Local samplers").
    "min_tokens": st.integers(0, 6),
    "num_generated": st.integers(0, 6),
    "no_repeat_ngram_size": st.integers(0, 4),
    "dry_multiplier": st.floats(0, 2, width=32),
    "dry_base": st.floats(1, 3, width=32),
    "dry_allowed_length": st.integers(1, 4),
    "dry_penalty_last_n": st.integers(-1, 16),
    "typical_p": st.floats(0.125, 1, width=32),
    "top_n_sigma": st.floats(-1, 3, width=32),
    "xtc_threshold": st.floats(0.0625, 1, width=32),
    "xtc_probability": st.floats(0, 1, width=32),
}
UINT32 = ("min_tokens", "num_generated", "no_repeat_ngram_size", "dry_allowed_length")
# Out-of-range values one time in five; any uint32/uint64 is valid for the counter and key words.
HOSTILE_VALUES = {
    name: values if name in ("seed", "position", "iteration")
    else mostly(values, st.integers(0, 2**32 - 1)) if name in UINT32
    else mostly(values, hostile_ints if name in ("top_k", "dry_penalty_last_n") else hostile_floats)
    for name, values in VALID_VALUES.items()
}


@st.composite
def token_lists(draw, rows: int, vocab: int, hostile: bool) -> pb.TokenLists:
    count = draw(st.sampled_from([0, 1, rows, rows + 1] if hostile else [0, 1, rows]))
    lengths = draw(st.lists(st.integers(0, 4), min_size=count, max_size=count))
    total = sum(lengths) + (draw(st.sampled_from([0, 0, 1])) if hostile else 0)  # one id too many
    valid_ids = st.integers(0, max(vocab - 1, 0))
    ids = draw(st.lists(mostly(valid_ids, st.integers(-2, vocab + 2)) if hostile else valid_ids, min_size=total, max_size=total))
    return pb.TokenLists(ids=ids, lengths=lengths)


@st.composite
def token_sequences(draw, rows: int, vocab: int, hostile: bool) -> pb.TokenSequences:
    """DRY's breakers: shared by every row (no counts) or counted a row; sometimes too many, too long, empty or
    out of the vocabulary when hostile."""
    per_row = draw(st.booleans())
    counts = draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows)) if per_row else []
    if hostile and per_row and draw(st.integers(0, 3)) == 0:
        counts.append(1)  # a count too many
    sequences = sum(counts) if per_row else draw(st.integers(0, 3))
    if hostile and draw(st.integers(0, 4)) == 0:
        sequences = draw(st.sampled_from([sequences + 1, 33]))
    longest = 17 if hostile else 16
    lengths = draw(st.lists(st.integers(0 if hostile else 1, longest), min_size=sequences, max_size=sequences))
    ids = st.integers(0, max(vocab - 1, 0))
    ids = draw(st.lists(mostly(ids, st.integers(-2, vocab + 2)) if hostile else ids, min_size=sum(lengths),
                        max_size=sum(lengths)))
    return pb.TokenSequences(ids=ids, lengths=lengths, counts=counts)


@st.composite
def token_bitmask(draw, out: pb.Tensor, rows: int, vocab: int, hostile: bool) -> None:
    """A structured-output mask int32 [rows, W], W >= ceil(V / 32), rows allowing nothing among them; when hostile,
    sometimes too few words, a wrong dtype or rank, or a byte too many."""
    words = (vocab + 31) // 32 + draw(st.sampled_from([0, 0, 1]))
    shape, dtype, extra = [rows, words], pb.DTYPE_INT32, 0
    if hostile and draw(st.integers(0, 2)) == 0:
        shape = draw(st.sampled_from([[rows, max(words - 1, 0)], [rows], [rows + 1, words], [rows, words]]))
        dtype = draw(st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_INT64, pb.DTYPE_FLOAT32]))
        extra = draw(st.sampled_from([0, 1]))
    size = math.prod(shape) * ITEMSIZE[dtype] + extra
    bits = np.random.default_rng(draw(st.integers(0, 99))).integers(0, 2**32, size // 4 + 1, dtype=np.uint32)
    if draw(st.booleans()):
        bits[: max(size // 4 // max(rows, 1), 1)] = 0  # the first row allows nothing
    out.dtype = dtype
    out.shape[:] = shape
    out.data = bits.tobytes()[:size]


@st.composite
def logits_tensor(draw, out: pb.Tensor) -> tuple[int, int]:
    """Fills `out`, valid four times in five; returns (rows, vocab)."""
    rows = draw(st.sampled_from([1, 2, 3, 5]))
    vocab = draw(st.sampled_from([1, 2, 7, 33]))
    dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16]))
    shape = [rows, vocab]
    size_error = 0
    if draw(st.integers(0, 4)) == 0:
        shape = draw(st.sampled_from([[rows], [rows, vocab, 2], [-1, vocab], [0, vocab], [rows, 0], [rows, vocab]]))
        dtype = draw(st.sampled_from([dtype, pb.DTYPE_INT32, pb.DTYPE_INT64, 0, 42]))
        size_error = draw(st.sampled_from([0, -1, 1]))
    size = math.prod(max(d, 0) for d in shape) * ITEMSIZE.get(dtype, 4) + size_error
    # Random bit patterns, sometimes with NaN, +inf or -inf halves written in.
    values = np.random.default_rng(draw(st.integers(0, 99))).standard_normal(max(size, 0) // 2 + 1).astype(np.float16)
    special = draw(st.sampled_from([None, None, np.nan, np.inf, -np.inf]))
    if special is not None:
        values[:: draw(st.sampled_from([1, 3]))] = special
    out.dtype = dtype
    out.shape[:] = shape
    out.data = values.tobytes()[: max(size, 0)]
    return rows, vocab


@st.composite
def sample_requests(draw) -> pb.SampleRequest:
    request = pb.SampleRequest()
    rows, vocab = draw(logits_tensor(request.logits))
    hostile = draw(st.integers(0, 9)) < 3
    params = request.params
    for name, values in (HOSTILE_VALUES if hostile else VALID_VALUES).items():
        count = draw(st.sampled_from([0, 0, 1, rows, rows + 1] if hostile else [0, 1, rows]))
        getattr(params, name).extend(draw(st.lists(values, min_size=count, max_size=count)))
    if draw(st.booleans()) and len(params.seed):
        has_seed_count = draw(st.sampled_from([rows, rows + 1])) if hostile else rows
        params.has_seed.extend(draw(st.lists(st.booleans(), min_size=has_seed_count, max_size=has_seed_count)))
    for name in ("allowed_token_ids", "banned_token_ids", "output_token_ids", "prompt_token_ids", "stop_token_ids"):
        if draw(st.booleans()):
            getattr(params, name).CopyFrom(draw(token_lists(rows, vocab, hostile)))
    if draw(st.integers(0, 3)) == 0:
        params.dry_sequence_breakers.CopyFrom(draw(token_sequences(rows, vocab, hostile)))
    if draw(st.integers(0, 3)) == 0:
        draw(token_bitmask(params.token_bitmask, rows, vocab, hostile))
    if draw(st.booleans()):
        params.logit_bias.tokens.CopyFrom(draw(token_lists(rows, vocab, hostile)))
        count = len(params.logit_bias.tokens.ids) + (draw(st.sampled_from([0, 0, 1])) if hostile else 0)
        bias = mostly(st.floats(-5, 5, width=32), hostile_floats) if hostile else st.floats(-5, 5, width=32)
        params.logit_bias.values.extend(draw(st.lists(bias, min_size=count, max_size=count)))
    if draw(st.booleans()):
        request.num_samples = draw(st.sampled_from([1, 2, 3, 0, 65, 2**32 - 1] if hostile else [1, 2, 3]))
    request.return_logprobs = draw(st.booleans())
    request.logprobs_mode = draw(st.sampled_from([0, 1, 2, 3] if hostile else [0, 1, 2]))
    request.top_logprobs = draw(st.sampled_from([0, 1, 3, 64, 65, 2**32 - 1] if hostile else [0, 1, 3, 64]))
    return request


@pytest.fixture(scope="module")
def stub(server: RunningServer):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.SamplerStub(channel)


def _array(tensor: pb.Tensor, dtype: int, shape: list[int]) -> np.ndarray:
    """The response tensor, once its dtype, shape and byte length are the ones the contract states."""
    assert tensor.dtype == dtype and list(tensor.shape) == shape, (tensor.dtype, list(tensor.shape), dtype, shape)
    array = np.frombuffer(tensor.data, dtype=np.int32 if dtype == pb.DTYPE_INT32 else np.float32)
    assert array.size == math.prod(shape)
    return array.reshape(shape)


def assert_well_formed(request: pb.SampleRequest, response: pb.SampleResponse) -> None:
    """Shapes, dtypes and values of a Sample response as docs/semantics.md states them."""
    rows, vocab = request.logits.shape
    samples = request.num_samples if request.HasField("num_samples") else 1
    assert len(response.valid) == len(response.seeds) == len(response.nan_detected) == rows
    tokens = _array(response.tokens, pb.DTYPE_INT32, [rows, samples])
    valid = np.array(response.valid)
    assert ((tokens >= 0) & (tokens < vocab))[valid].all(), tokens
    assert (tokens[~valid] == -1).all(), tokens
    if len(request.params.seed) and not len(request.params.has_seed):
        given = np.broadcast_to(np.array(request.params.seed, dtype=np.uint64), rows)
        assert (np.array(response.seeds, dtype=np.uint64) == given).all()
    if request.return_logprobs:
        logprobs = _array(response.logprobs, pb.DTYPE_FLOAT32, [rows, samples])
        assert not (logprobs[valid] > 1e-5).any() and np.isnan(logprobs[~valid]).all(), logprobs
    else:
        assert not response.HasField("logprobs")
    if request.top_logprobs:
        listed = min(request.top_logprobs, vocab)
        ids = _array(response.top_logprob_ids, pb.DTYPE_INT32, [rows, listed])
        _array(response.top_logprobs, pb.DTYPE_FLOAT32, [rows, listed])
        assert ((ids >= 0) & (ids < vocab))[valid].all() and (ids[~valid] == -1).all(), ids


OUTCOMES: collections.Counter[str] = collections.Counter()
"""How the fuzzed requests ended, for the test after them: a fuzzer whose every request is refused checks nothing."""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=sample_requests())
def test_hostile_requests_get_ok_or_invalid_argument(stub: pb_grpc.SamplerStub, request: pb.SampleRequest) -> None:
    try:
        response = stub.Sample(request, timeout=30)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert err.details().startswith(FIELD_PREFIXES), err.details()
        event(f"rejected: {err.details().split(':')[0]}")
        OUTCOMES["rejected"] += 1
        return
    event("sampled")
    OUTCOMES["sampled"] += 1
    assert_well_formed(request, response)


def test_server_still_serves_after_fuzzing(stub: pb_grpc.SamplerStub) -> None:
    """After the fuzzer (when it ran in the same test run: about half its requests sample), the server samples."""
    total = sum(OUTCOMES.values())
    if total:
        assert OUTCOMES["sampled"] >= total // 4, OUTCOMES
    request = pb.SampleRequest()
    request.logits.dtype = pb.DTYPE_FLOAT32
    request.logits.shape[:] = [1, 4]
    request.logits.data = np.zeros(4, dtype=np.float32).tobytes()
    assert list(stub.Sample(request, timeout=30).valid) == [True]
