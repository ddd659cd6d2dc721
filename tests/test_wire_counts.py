"""validation/wire_counts.py: a large Sample request holding more values than validation accepts is refused by its
field from its wire bytes, before protobuf parses (and expands) it; one within the limits passes, packed or not."""

from __future__ import annotations

import numpy as np
import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.core.config import Limits
from tokensampler_server.validation.wire_counts import COUNTED_FROM_BYTES, TooManyValues, check_counts

LIMITS = Limits(max_batch_rows=64, max_token_entries=1000)
PAD = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, COUNTED_FROM_BYTES // 4 + 1],
                data=np.zeros(COUNTED_FROM_BYTES // 4 + 1, np.float32).tobytes())  # past the size checked


def _request(**params) -> bytes:
    return pb.SampleRequest(logits=PAD, params=pb.SamplingParams(**params)).SerializeToString()


@pytest.mark.parametrize("params, field", [
    ({"seed": [0] * 65}, "params.seed"),                          # one-byte varints
    ({"temperature": [1.0] * 65}, "params.temperature"),           # fixed32
    ({"top_k": [-1] * 65}, "params.top_k"),                        # ten-byte varints
    ({"banned_token_ids": pb.TokenLists(ids=list(range(1001)))}, "params"),
    ({"logit_bias": pb.LogitBias(tokens=pb.TokenLists(ids=[1] * 1001), values=[0.5] * 1001)}, "params"),
    ({"dry_sequence_breakers": pb.TokenSequences(ids=[1] * (32 * 16 * 64 + 1))}, "params.dry_sequence_breakers"),
])
def test_a_request_past_the_limits_is_refused_by_its_field(params: dict, field: str) -> None:
    with pytest.raises(TooManyValues) as raised:
        check_counts(_request(**params), LIMITS)
    assert raised.value.field == field


def test_a_request_within_the_limits_passes_packed_and_unpacked() -> None:
    check_counts(_request(seed=[2**63] * 64, temperature=[0.5] * 64, top_k=[-1] * 64,
                          banned_token_ids=pb.TokenLists(ids=list(range(1000)), lengths=[1000])), LIMITS)
    # the same per-row values unpacked, each a field of its own (tag 5, varint): as protobuf accepts them
    unpacked = pb.SampleRequest(logits=PAD).SerializeToString() + _params_field(b"\x28\x07" * 64)
    check_counts(unpacked, LIMITS)
    with pytest.raises(TooManyValues):
        check_counts(pb.SampleRequest(logits=PAD).SerializeToString() + _params_field(b"\x28\x07" * 65), LIMITS)


def test_a_request_of_many_top_level_fields_is_refused_and_a_small_one_is_not_walked() -> None:
    padded = pb.SampleRequest(logits=PAD).SerializeToString() + b"\x78\x00" * 65  # field 15, unknown
    with pytest.raises(TooManyValues) as raised:
        check_counts(padded, LIMITS)
    assert raised.value.field == "request"
    check_counts(pb.SampleRequest(params=pb.SamplingParams(seed=[0] * 65)).SerializeToString(), LIMITS)


def _params_field(payload: bytes) -> bytes:
    assert len(payload) < 1 << 14
    length = bytes([len(payload) & 0x7F | 0x80, len(payload) >> 7])
    return b"\x22" + length + payload  # SampleRequest.params (4), length-delimited
