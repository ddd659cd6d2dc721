"""The input of a serialized SampleRequest, found without parsing its payload.

A stream message is counted against its stream's window as it arrives, with the region bytes its input references
(read into the server when it starts). Parsing a large message to look costs its copy on the event loop (a 64 MiB
message: 39 ms), and trusting a large message to hold no reference let one padded past the size limit reference
32 MiB each uncounted (2.5 GB for one stream). So the top-level fields are walked by their tags and lengths, and
only the input's own reference (a few bytes) is parsed, with protobuf's rules: the oneof's last case wins and the
occurrences of a message field since then merge.
"""

from __future__ import annotations

from tokensampler_client._proto import sampler_pb2 as pb

# Field numbers of sampler.proto: SampleRequest's input oneof, and HiddenStates.states_ref.
_LOGITS, _HIDDEN, _LOGITS_REF, _LOGITS_ROWS = 1, 2, 3, 10
_STATES_REF = 3
_INPUT_CASES = (_LOGITS, _HIDDEN, _LOGITS_REF, _LOGITS_ROWS)


class UnusualWire(ValueError):
    """A field of a wire type the walk does not skip (a group), or a length past the message: parse it whole."""


def input_of(message: bytes) -> pb.SampleRequest:
    """A SampleRequest holding only the message's input reference (logits_ref, logits_rows or hidden.states_ref),
    empty when its input is none. Raises UnusualWire where only a whole parse can tell."""
    case, parts = 0, []
    for number, payload in _fields(message):
        if number in _INPUT_CASES:
            if number != case:
                case, parts = number, []
            parts.append(payload)
    if case == _LOGITS_REF:
        return pb.SampleRequest(logits_ref=pb.TensorRef.FromString(b"".join(parts)))
    if case == _LOGITS_ROWS:
        return pb.SampleRequest(logits_rows=pb.RowsRef.FromString(b"".join(parts)))
    if case == _HIDDEN:
        refs = [ref for part in parts for number, ref in _fields(part) if number == _STATES_REF]
        if refs:
            return pb.SampleRequest(hidden=pb.HiddenStates(states_ref=pb.TensorRef.FromString(b"".join(refs))))
    return pb.SampleRequest()


def _fields(message: bytes | memoryview):  # noqa: ANN202 - a generator of (field number, payload)
    """(field number, payload) of each length-delimited field at this level, in order, the payload a view (nothing
    copied); fields of other wire types skipped."""
    view = memoryview(message)
    at, end = 0, len(view)
    while at < end:
        key, at = _varint(view, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, at = _varint(view, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            length, at = _varint(view, at)
            if at + length > end:
                raise UnusualWire("a length past the message")
            yield number, view[at:at + length]
            at += length
        else:
            raise UnusualWire(f"wire type {wire}")
    if at != end:
        raise UnusualWire("a field past the message")


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(view) or shift > 63:
            raise UnusualWire("a varint past the message")
        byte = view[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
