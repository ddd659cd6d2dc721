"""rpc/input_scan.py: a serialized SampleRequest's head, found by walking its top-level fields, has the input and the
answer-sizing fields that protobuf's own parse gives (the oneof's last case wins, a message field's occurrences
merge), whatever the size of the message and of its other fields, with its tensors' data left out."""

from __future__ import annotations

import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.rpc.input_scan import head_of
from tokensampler_server.validation.wire import UnusualWire

REF = pb.TensorRef(region="r", offset=64, dtype=pb.DTYPE_FLOAT32, shape=[2, 1 << 20])
ROWS = pb.RowsRef(region="q", dtype=pb.DTYPE_BFLOAT16, row_offsets=[0, 4096], row_size=2048)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (numbers and lengths below 2^14: two-byte varints at most)."""
    def varint(value: int) -> bytes:
        out = b""
        while value >= 0x80:
            out += bytes([value & 0x7F | 0x80])
            value >>= 7
        return out + bytes([value])
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _head(request: pb.SampleRequest) -> tuple:
    """What the head must keep: the input's case, its reference or shape, and the answer's sizes."""
    kind = request.WhichOneof("input")
    shape = {"logits": lambda: list(request.logits.shape), "hidden": lambda: (
        list(request.hidden.states.shape), request.hidden.states_ref.SerializeToString()),
        "logits_ref": lambda: request.logits_ref.SerializeToString(),
        "logits_rows": lambda: request.logits_rows.SerializeToString()}.get(kind, lambda: None)()
    return (kind, shape, request.HasField("num_samples"), request.num_samples, request.return_logprobs,
            request.top_logprobs)


LOGITS = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 4], data=b"\0" * 16).SerializeToString()
PADDING = _field(1000, b"\0" * 100_000)  # an unknown field past any small-message limit
CASES = {
    "a reference": pb.SampleRequest(logits_ref=REF, params=pb.SamplingParams(temperature=[0.5])).SerializeToString(),
    "rows": pb.SampleRequest(logits_rows=ROWS).SerializeToString(),
    "hidden states by reference": pb.SampleRequest(hidden=pb.HiddenStates(weights="w", states_ref=REF))
    .SerializeToString(),
    "carried logits": pb.SampleRequest(logits=pb.Tensor(data=b"\0" * 200_000)).SerializeToString(),
    "padded reference": pb.SampleRequest(logits_ref=REF).SerializeToString() + PADDING,
    "padding before the reference": PADDING + pb.SampleRequest(logits_ref=REF).SerializeToString(),
    "a reference, then logits": _field(3, REF.SerializeToString()) + _field(1, LOGITS),
    "logits, then a reference": _field(1, LOGITS) + _field(3, REF.SerializeToString()),
    "a reference in two parts": _field(3, pb.TensorRef(region="r").SerializeToString())
    + _field(3, pb.TensorRef(shape=[3, 5], dtype=pb.DTYPE_FLOAT16).SerializeToString()),
    "a reference, logits, a reference": _field(3, REF.SerializeToString()) + _field(1, LOGITS)
    + _field(3, pb.TensorRef(region="s", shape=[1, 1]).SerializeToString()),
    "hidden in two parts": _field(2, pb.HiddenStates(states_ref=pb.TensorRef(region="r")).SerializeToString())
    + _field(2, pb.HiddenStates(weights="w", states_ref=pb.TensorRef(shape=[4, 8])).SerializeToString()),
    "hidden states carried": pb.SampleRequest(hidden=pb.HiddenStates(states=pb.Tensor(shape=[3, 3000],
                                                                                 data=b"\0" * 9000)))
    .SerializeToString(),
    "answer sizes": pb.SampleRequest(logits=pb.Tensor(shape=[4096, 1], data=b"\0" * 8192), num_samples=64,
                                     return_logprobs=True, top_logprobs=20).SerializeToString(),
    "answer sizes twice": pb.SampleRequest(num_samples=3, top_logprobs=2).SerializeToString()
    + pb.SampleRequest(num_samples=7).SerializeToString(),
    "empty": b"",
}


@pytest.mark.parametrize("message", list(CASES.values()), ids=list(CASES))
def test_the_head_found_is_protobufs_own(message: bytes) -> None:
    head = head_of(message)
    assert _head(head) == _head(pb.SampleRequest.FromString(message))
    assert not head.logits.data and not head.hidden.states.data and not head.HasField("params")
    assert head.ByteSize() < 1000


@pytest.mark.parametrize("message", [b"\x0b\x0c", b"\x1a\x05ab", b"\x80", b"\x08"],
                         ids=["a group", "a length past the end", "a cut varint", "a varint field cut"])
def test_unusual_wire_is_left_to_a_whole_parse(message: bytes) -> None:
    with pytest.raises(UnusualWire):
        head_of(message)


def test_the_packed_runs_stop_at_a_group_as_at_any_later_field() -> None:
    """packed_runs walks the same fields: a group a client sent as an unknown field ends the walk, past the runs."""
    from tokensampler_server.validation.packed import packed_runs

    runs = packed_runs(_field(1, b"\x01\x02") + _field(2, b"\x03") + b"\x0b\x0c", (1, 2))
    assert {number: bytes(run) for number, run in runs.items()} == {1: b"\x01\x02", 2: b"\x03"}


@pytest.mark.parametrize("where", ["top level", "inside the logits"])
def test_a_message_of_many_tiny_fields_is_left_to_a_whole_parse(where: str) -> None:
    """The walk is Python, ~0.5 us a field: 16 M two-byte unknown fields held the event loop for 7.8 s. Past a few
    dozen fields a level it declines, and protobuf's parser (0.18 s for those 32 MiB) takes the message."""
    padding = b"\x78\x00" * 1000  # field 15, varint 0: unknown to SampleRequest and to Tensor
    message = (pb.SampleRequest(logits=pb.Tensor.FromString(LOGITS)).SerializeToString() + padding
               if where == "top level" else _field(1, LOGITS + padding))
    with pytest.raises(UnusualWire):
        head_of(message)
    assert _head(pb.SampleRequest.FromString(message))[:2] == ("logits", [1, 4])  # what the whole parse gives


def test_a_request_of_a_few_fields_a_level_is_walked() -> None:
    message = _field(1, LOGITS + b"\x78\x00" * 8) + b"\x78\x00" * 40
    assert _head(head_of(message)) == _head(pb.SampleRequest.FromString(message))
