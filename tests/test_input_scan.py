"""rpc/input_scan.py: a serialized SampleRequest's input reference, found by walking its top-level fields, is the one
protobuf's own parse gives (the oneof's last case wins, a message field's occurrences merge), whatever the size of
the message and of its other fields; and a stream message padded past any size still counts the region bytes its
input references."""

from __future__ import annotations

import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.rpc.input_scan import UnusualWire, input_of

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


def _input(request: pb.SampleRequest) -> tuple[str | None, bytes]:
    kind = request.WhichOneof("input")
    if kind == "hidden":
        return ("hidden.states_ref", request.hidden.states_ref.SerializeToString()) \
            if request.hidden.HasField("states_ref") else (None, b"")
    if kind in ("logits_ref", "logits_rows"):
        return kind, getattr(request, kind).SerializeToString()
    return None, b""


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
    "hidden states carried": pb.SampleRequest(hidden=pb.HiddenStates(states=pb.Tensor(data=b"\0" * 9000)))
    .SerializeToString(),
    "empty": b"",
}


@pytest.mark.parametrize("message", list(CASES.values()), ids=list(CASES))
def test_the_input_found_is_protobufs_own(message: bytes) -> None:
    assert _input(input_of(message)) == _input(pb.SampleRequest.FromString(message))


@pytest.mark.parametrize("message", [b"\x0b\x0c", b"\x1a\x05ab", b"\x80", b"\x08"],
                         ids=["a group", "a length past the end", "a cut varint", "a varint field cut"])
def test_unusual_wire_is_left_to_a_whole_parse(message: bytes) -> None:
    with pytest.raises(UnusualWire):
        input_of(message)
