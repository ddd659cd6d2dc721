"""validation/wire_counts.py: a request holding more repeated values than validation accepts is refused by its field
from its wire bytes, before protobuf parses (and expands) it, whatever its type; one within the limits passes, its
values packed, or unpacked within the message's field budget. rpc/parsing.py counts only messages from
COUNTED_FROM_BYTES: the smaller parse at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.wire import varint
from tokensampler_server.core.config import Limits
from tokensampler_server.rpc.parsing import Parses
from tokensampler_server.validation.wire_counts import MOST_FIELDS, WireRefusal, check_counts

LIMITS = Limits(max_batch_rows=64, max_token_entries=1000)
PAD = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1 << 18], data=np.zeros(1 << 18, np.float32).tobytes())  # 1 MiB


def _sample(**params) -> bytes:
    return pb.SampleRequest(logits=PAD, params=pb.SamplingParams(**params)).SerializeToString()


SAMPLE, DIFFUSION, VERIFY, TOPK = (pb.SampleRequest.DESCRIPTOR, pb.DiffusionStepRequest.DESCRIPTOR,
                                  pb.VerifyDraftRequest.DESCRIPTOR, pb.TopKProbsRequest.DESCRIPTOR)


@pytest.mark.parametrize("message, descriptor, field", [
    (_sample(seed=[0] * 65), SAMPLE, "params.seed"),  # one-byte varints
    (_sample(temperature=[1.0] * 65), SAMPLE, "params.temperature"),  # fixed32
    (_sample(top_k=[-1] * 65), SAMPLE, "params.top_k"),  # ten-byte varints
    (_sample(banned_token_ids=pb.TokenLists(ids=list(range(600))),
             allowed_token_ids=pb.TokenLists(ids=list(range(401)))), SAMPLE, "params"),  # the lists together
    (_sample(logit_bias=pb.LogitBias(tokens=pb.TokenLists(ids=[1] * 1001), values=[0.5] * 1001)), SAMPLE, "params"),
    (_sample(dry_sequence_breakers=pb.TokenSequences(ids=[1] * (32 * 16 * 64 + 1))), SAMPLE,
     "params.dry_sequence_breakers.ids"),
    (pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1] * 9, data=PAD.data)).SerializeToString(),
     SAMPLE, "logits.shape"),
    (pb.SampleRequest(logits=PAD).SerializeToString() + b"\x78\x00" * MOST_FIELDS, SAMPLE, "request"),  # unknown
    (pb.DiffusionStepRequest(logits=PAD, params=pb.SamplingParams(seed=[0] * 65)).SerializeToString(), DIFFUSION,
     "params.seed"),
    (pb.VerifyDraftRequest(target_logits=PAD, params=pb.SamplingParams(position=[1] * 65)).SerializeToString(),
     VERIFY, "params.position"),
    (pb.TopKProbsRequest(logits=PAD, temperature=[1.0] * 65).SerializeToString(), TOPK, "temperature"),
    (_sample(seed=[0] * 64) + b"\x0b\x0c", SAMPLE, "request"),  # a group after the values: not walked, not parsed
])
def test_a_request_past_the_limits_is_refused_by_its_field(message: bytes, descriptor, field: str) -> None:
    with pytest.raises(WireRefusal) as raised:
        check_counts(message, descriptor, LIMITS)
    assert raised.value.field == field


def test_a_run_longer_than_its_limit_allows_is_refused_from_its_length() -> None:
    """A varint takes at most 10 bytes: a run of more than 10 bytes a value allowed is refused uncounted."""
    with pytest.raises(WireRefusal) as raised:
        check_counts(_sample(seed=[0] * 650), SAMPLE, LIMITS)
    assert raised.value.field == "params.seed" and "at least 65 values" in str(raised.value)
    with pytest.raises(WireRefusal) as raised:
        check_counts(_sample(seed=[0] * 640 + [2**63] * 1), SAMPLE, LIMITS)  # 650 bytes, 641 values
    assert "at least 65" in str(raised.value)
    with pytest.raises(WireRefusal) as raised:
        check_counts(_sample(seed=[0] * 65), SAMPLE, LIMITS)
    assert "65 values" in str(raised.value) and "at least" not in str(raised.value)


def test_a_request_within_the_limits_passes_packed_and_unpacked() -> None:
    check_counts(_sample(seed=[2**63] * 64, temperature=[0.5] * 64, top_k=[-1] * 64,
                         banned_token_ids=pb.TokenLists(ids=list(range(1000)), lengths=[1000])),
                 pb.SampleRequest.DESCRIPTOR, LIMITS)
    # the same per-row values unpacked, each a field of its own (tag 5, varint): as protobuf accepts them
    head = pb.SampleRequest(logits=PAD).SerializeToString()
    check_counts(head + _params_field(b"\x28\x07" * 64), pb.SampleRequest.DESCRIPTOR, LIMITS)
    with pytest.raises(WireRefusal):
        check_counts(head + _params_field(b"\x28\x07" * 65), pb.SampleRequest.DESCRIPTOR, LIMITS)


def test_an_unpacked_list_is_walked_up_to_the_messages_field_budget() -> None:
    """Unpacked, every id is a field of its own, walked in Python: a list within the budget passes, one past it is
    refused with the advice to pack it (protobuf's parser would take it; no library writes it)."""
    def unpacked(ids: int) -> bytes:
        ids_run = b"\x08\x05" * ids  # TokenLists.ids (1), varint 5, one field each
        lists = b"\x6a" + varint(len(ids_run)) + ids_run  # SamplingParams.banned_token_ids (13)
        return pb.SampleRequest(logits=PAD).SerializeToString() + b"\x22" + varint(len(lists)) + lists

    check_counts(unpacked(1000), pb.SampleRequest.DESCRIPTOR, LIMITS)
    with pytest.raises(WireRefusal) as raised:
        check_counts(unpacked(MOST_FIELDS), pb.SampleRequest.DESCRIPTOR, Limits(max_token_entries=1 << 20))
    assert "go packed" in str(raised.value)



def test_a_oneof_case_replaced_takes_its_counts_with_it() -> None:
    """protobuf keeps a oneof's last case: the rows of a case that another replaced are not counted (the input's
    cases one after another, each of 40 rows under a limit of 64, the last kept)."""
    rows = pb.SampleRequest(logits_rows=pb.RowsRef(region="r", row_offsets=list(range(40)))).SerializeToString()
    message = rows + pb.SampleRequest(logits=PAD).SerializeToString() + rows
    check_counts(message, SAMPLE, LIMITS)
    assert len(pb.SampleRequest.FromString(message).logits_rows.row_offsets) == 40
    with pytest.raises(WireRefusal) as raised:  # the same case twice merges: 80 rows
        check_counts(rows + rows, SAMPLE, LIMITS)
    assert raised.value.field == "logits_rows.shape"


def test_a_oneof_case_replaced_in_a_later_occurrence_of_its_message_takes_its_counts_with_it() -> None:
    """The occurrences of a message merge: a case of a later occurrence replaces an earlier one's (logits of 7
    dimensions, then hidden, then logits of 2 in three occurrences of `open`: protobuf keeps the 2)."""
    def opened(**case) -> bytes:
        return pb.ColocateRequest(open=pb.ColocateOpen(**case)).SerializeToString()

    message = (opened(logits=pb.TensorRef(shape=[1] * 7)) + opened(hidden=pb.HiddenStates(weights="w"))
               + opened(logits=pb.TensorRef(shape=[4, 8])))
    assert list(pb.ColocateRequest.FromString(message).open.logits.shape) == [4, 8]
    assert check_counts(message, pb.ColocateRequest.DESCRIPTOR, LIMITS) == 2


def test_bytes_cut_short_are_left_to_the_parse_that_refuses_them() -> None:
    message = _sample(seed=[0] * 64)
    assert check_counts(message[:-3], SAMPLE, LIMITS) <= 64
    with pytest.raises(Exception, match="parse|Error"):
        pb.SampleRequest.FromString(message[:-3])


def test_only_a_message_past_the_counted_size_is_counted_before_its_parse() -> None:
    small = pb.SampleRequest(params=pb.SamplingParams(seed=[0] * 65)).SerializeToString()

    async def run(message: bytes):
        return await Parses(LIMITS).parse(pb.SampleRequest.FromString, message, pb.SampleRequest.DESCRIPTOR)

    assert len(asyncio.run(run(small)).params.seed) == 65  # parsed at once; validation refuses it afterwards
    with pytest.raises(WireRefusal):
        asyncio.run(run(_sample(seed=[0] * 65)))


def _params_field(payload: bytes) -> bytes:
    assert len(payload) < 1 << 14
    length = bytes([len(payload) & 0x7F | 0x80, len(payload) >> 7])
    return b"\x22" + length + payload  # SampleRequest.params (4), length-delimited
