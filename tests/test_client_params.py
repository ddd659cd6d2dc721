"""Columnar encoding of sample() arguments into SampleRequest (client side only, no server)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import build_sample_request, serialize_sample_request
from tokensampler_client.regions import RegionRows, RegionView
from tokensampler_client.tensors import decode_tensor

B, V = 3, 16


def request(**kwargs: object) -> pb.SampleRequest:
    return build_sample_request(torch.zeros(B, V), **kwargs)


def test_defaults_send_nothing() -> None:
    req = request()
    assert req.params == pb.SamplingParams()
    assert not req.HasField("num_samples")
    assert req.return_logprobs is False and req.top_logprobs == 0
    assert req.logprobs_mode == pb.LOGPROBS_MODE_RAW


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, []),
        (0.5, [0.5]),
        (np.float32(0.25), [0.25]),
        (torch.tensor(2.0), [2.0]),
        ([0.5, 1.0, 2.0], [0.5, 1.0, 2.0]),
        ((0.5, 1.0, 2.0), [0.5, 1.0, 2.0]),
        (np.array([0.5, 1.0, 2.0]), [0.5, 1.0, 2.0]),
        (torch.tensor([0.5, 1.0, 2.0], dtype=torch.bfloat16), [0.5, 1.0, 2.0]),
    ],
)
def test_float_column_scalar_per_row_or_none(value: object, expected: list[float]) -> None:
    assert list(request(temperature=value).params.temperature) == expected


def test_every_numeric_column_lands_in_its_field() -> None:
    req = request(
        top_k=[1, -1, 0],
        top_p=0.9,
        min_p=torch.tensor([0.0, 0.1, 0.2]),
        position=np.array([0, 5, 7], dtype=np.uint32),
        iteration=3,
        repetition_penalty=1.2,
        presence_penalty=[0.0, 0.5, 1.0],
        frequency_penalty=-0.5,
    )
    p = req.params
    assert list(p.top_k) == [1, -1, 0]
    assert list(p.top_p) == pytest.approx([0.9])
    assert list(p.min_p) == pytest.approx([0.0, 0.1, 0.2])
    assert list(p.position) == [0, 5, 7]
    assert list(p.iteration) == [3]
    assert list(p.repetition_penalty) == pytest.approx([1.2])
    assert list(p.presence_penalty) == [0.0, 0.5, 1.0]
    assert list(p.frequency_penalty) == [-0.5]
    assert list(p.temperature) == []


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "min_p", "position", "iteration", "presence_penalty"])
@pytest.mark.parametrize("value", [[1, 1], [1] * (B + 1), np.ones(B - 1), torch.ones(B + 2)])
def test_per_row_length_mismatch_names_the_argument(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: expected a scalar or {B} values"):
        request(**{name: value})


def test_two_dimensional_column_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^top_p: .*shape \(3, 1\)"):
        request(top_p=torch.ones(B, 1))


def test_wrong_types_and_ranges_name_the_argument() -> None:
    with pytest.raises(TypeError, match=r"^top_k: "):
        request(top_k=1.5)
    with pytest.raises(TypeError, match=r"^temperature: "):
        request(temperature="hot")
    with pytest.raises(ValueError, match=r"^position: "):
        request(position=-1)  # uint32 on the wire
    with pytest.raises(ValueError, match=r"^top_logprobs: "):
        request(top_logprobs=-1)


def test_seed_scalar_and_full_list_send_no_has_seed() -> None:
    assert list(request(seed=42).params.seed) == [42]
    p = request(seed=[1, 2, 2**64 - 1]).params
    assert list(p.seed) == [1, 2, 2**64 - 1]
    assert list(p.has_seed) == []


def test_seed_none_entries_fill_has_seed() -> None:
    p = request(seed=[None, 7, None]).params
    assert list(p.seed) == [0, 7, 0]
    assert list(p.has_seed) == [False, True, False]


def test_seed_int64_tensor_holds_uint64_bits() -> None:
    p = request(seed=torch.tensor([-1, 0, 5], dtype=torch.int64)).params
    assert list(p.seed) == [2**64 - 1, 0, 5]


def test_seed_errors() -> None:
    with pytest.raises(ValueError, match=r"^seed: expected a scalar or 3 values"):
        request(seed=[1, None])
    with pytest.raises(ValueError, match=r"^seed: "):
        request(seed=-1)
    with pytest.raises(ValueError, match=r"^seed: "):
        request(seed=2**64)


@pytest.mark.parametrize("name", ["allowed_token_ids", "banned_token_ids", "output_token_ids", "prompt_token_ids"])
def test_token_lists_shared_and_per_row(name: str) -> None:
    shared = getattr(request(**{name: [4, 5, 6]}).params, name)
    assert (list(shared.ids), list(shared.lengths)) == ([4, 5, 6], [3])

    per_row = getattr(request(**{name: [[1, 2], None, np.array([3])]}).params, name)
    assert (list(per_row.ids), list(per_row.lengths)) == ([1, 2, 3], [2, 0, 1])

    as_matrix = getattr(request(**{name: torch.tensor([[1, 2], [3, 4], [5, 6]])}).params, name)
    assert (list(as_matrix.ids), list(as_matrix.lengths)) == ([1, 2, 3, 4, 5, 6], [2, 2, 2])

    assert not request(**{name: []}).params.HasField(name)
    assert not request(**{name: None}).params.HasField(name)


def test_token_list_from_1d_tensor_is_shared() -> None:
    lists = request(banned_token_ids=torch.tensor([9, 8])).params.banned_token_ids
    assert (list(lists.ids), list(lists.lengths)) == ([9, 8], [2])


def test_token_list_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^allowed_token_ids: expected one list or 3 lists"):
        request(allowed_token_ids=[[1], [2]])
    with pytest.raises(ValueError, match=r"^output_token_ids: expected 3 rows"):
        request(output_token_ids=np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(TypeError, match=r"^banned_token_ids: "):
        request(banned_token_ids=[[1], 2, [3]])
    with pytest.raises(TypeError, match=r"^prompt_token_ids: "):
        request(prompt_token_ids=[1.5])


def test_logit_bias_shared_dict() -> None:
    bias = request(logit_bias={3: 1.5, 7: -2.0}).params.logit_bias
    assert list(bias.tokens.ids) == [3, 7]
    assert list(bias.tokens.lengths) == [2]
    assert list(bias.values) == [1.5, -2.0]
    assert not request(logit_bias={}).params.HasField("logit_bias")


def test_logit_bias_per_row_with_none() -> None:
    bias = request(logit_bias=[{1: 1.0}, None, {2: 2.0, 3: 3.0}]).params.logit_bias
    assert list(bias.tokens.ids) == [1, 2, 3]
    assert list(bias.tokens.lengths) == [1, 0, 2]
    assert list(bias.values) == [1.0, 2.0, 3.0]


def test_logit_bias_errors() -> None:
    with pytest.raises(ValueError, match=r"^logit_bias: expected one dict or 3 dicts"):
        request(logit_bias=[{1: 1.0}])
    with pytest.raises(TypeError, match=r"^logit_bias: "):
        request(logit_bias=[{1: 1.0}, [2], None])
    with pytest.raises(TypeError, match=r"^logit_bias: "):
        request(logit_bias=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_round_trip(dtype: torch.dtype) -> None:
    logits = torch.randn(B, V).to(dtype)
    req = build_sample_request(logits, temperature=[1.0] * B)
    assert torch.equal(decode_tensor(req.logits), logits)


def test_logits_numpy_and_one_dimensional() -> None:
    logits = np.random.default_rng(0).standard_normal(V).astype(np.float16)
    req = build_sample_request(logits, top_k=[5])  # a 1-D array is one row: B = 1
    decoded = decode_tensor(req.logits)
    assert decoded.shape == (1, V) and decoded.dtype == torch.float16
    assert np.array_equal(decoded[0].numpy(), logits)
    # A non-contiguous view is sent in row-major order.
    matrix = torch.randn(V, B).t()
    assert torch.equal(decode_tensor(build_sample_request(matrix).logits), matrix)


def test_logits_errors() -> None:
    with pytest.raises(TypeError, match=r"^logits: dtype torch.float64"):
        build_sample_request(np.zeros((B, V)))
    with pytest.raises(TypeError, match=r"^logits: dtype torch.int32"):
        build_sample_request(torch.zeros(B, V, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^logits: expected shape \[B, N\] or \[N\], got \[2, 3, 4\]"):
        build_sample_request(torch.zeros(2, 3, 4))


def test_request_level_options() -> None:
    req = request(num_samples=4, return_logprobs=True, logprobs_mode="processed", top_logprobs=5)
    assert req.HasField("num_samples") and req.num_samples == 4
    assert req.return_logprobs and req.top_logprobs == 5
    assert req.logprobs_mode == pb.LOGPROBS_MODE_PROCESSED
    assert request(logprobs_mode="RAW").logprobs_mode == pb.LOGPROBS_MODE_RAW
    with pytest.raises(ValueError, match=r"^logprobs_mode: "):
        request(logprobs_mode="softmax")


@pytest.mark.parametrize("logits", [
    torch.randn(B, V),
    torch.randn(1, 151936).to(torch.bfloat16),
    torch.randn(V).to(torch.float16),  # one row
    torch.randn(V, B).t(),  # not contiguous: sent row-major
    np.random.default_rng(1).standard_normal((2, 300)).astype(np.float32),
    torch.zeros(B, 0),  # no bytes: nothing to splice (the server refuses the shape)
], ids=["float32", "bfloat16", "1-d", "transposed", "numpy", "empty"])
@pytest.mark.parametrize("params", [
    {},
    dict(temperature=0.7, top_k=50, top_p=0.9, seed=7, return_logprobs=True, top_logprobs=3, num_samples=2),
    dict(logit_bias={5: -1.0}, banned_token_ids=[1, 2], repetition_penalty=1.1, logprobs_mode="processed"),
])
def test_serialized_requests_are_the_messages_bytes(logits: object, params: dict) -> None:
    """serialize_sample_request joins the logits' memory into the request: the bytes must be exactly those of
    the message build_sample_request builds, so that any protobuf parser reads the same request."""
    rows = 1 if logits.ndim == 1 else logits.shape[0]
    params = {k: ([v] * rows if k == "seed" else v) for k, v in params.items()}
    expected = build_sample_request(logits, **params).SerializeToString()
    assert serialize_sample_request(logits, **params) == expected
    assert pb.SampleRequest.FromString(expected) == build_sample_request(logits, **params)


def test_serialized_requests_without_carried_logits_and_their_errors() -> None:
    view = RegionView("region", 64, torch.float32, (B, V))
    rows = RegionRows("region", torch.float16, V, (0, 128))
    for built in (dict(logits=view, top_k=5), dict(logits=rows, seed=[1, 2]),
                  dict(hidden=torch.randn(2, 8), weights="head", temperature=0.0)):
        assert serialize_sample_request(**built) == build_sample_request(**built).SerializeToString()
    with pytest.raises(ValueError, match=r"^temperature: expected a scalar or 3 values"):
        serialize_sample_request(torch.zeros(B, V), temperature=[1.0, 2.0])
    with pytest.raises(TypeError, match=r"^logits: dtype torch.int32"):
        serialize_sample_request(torch.zeros(B, V, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^logits, hidden: expected exactly one"):
        serialize_sample_request(torch.zeros(B, V), hidden=torch.zeros(B, 4), weights="head")
