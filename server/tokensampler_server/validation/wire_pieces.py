"""A serialized message cut into pieces that merge into the message it holds, its long packed runs cut too.

protobuf's parser holds the interpreter's lock for a whole parse, also on a thread: a Sample of 2^25 token ids (the
max_token_entries it may hold, 33.5 MB) took 0.93 s to parse, and the event loop waited as long, every other call
with it. The wire format concatenates: parsing A + B is parsing A, then merging B (repeated values append, a
message's occurrences merge, the last scalar and oneof case win). So a long packed run is cut at varint boundaries,
each part wrapped in the tags of the messages around it, and the pieces are merged one by one: the lock is handed
over between them (about 9 ms of parse a piece).
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tokensampler_client.wire import length_prefix

from tokensampler_server.validation.wire import MAX_VARINT_BYTES, UnusualWire, fields
from tokensampler_server.validation.wire_counts import FIXED_BYTES, is_repeated

PIECE_BYTES = 256 << 10
"""Bytes of a packed run merged at once: 256 Ki one-byte varints parse in ~9 ms."""
_NOT_PACKED = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE,
               FieldDescriptor.TYPE_GROUP}

Piece = tuple[bytes, memoryview]
"""(the tags and lengths of the messages around it, its bytes of the message): head + body is the piece."""


def pieces(message: bytes | memoryview, descriptor: Descriptor) -> list[Piece] | None:
    """Pieces that, merged in order into an empty message of type `descriptor`, give the message `message` holds
    (each copied only when it is merged); None when it holds no packed run longer than PIECE_BYTES (parse it whole)
    or its wire is not walked (a group, bytes cut short: its whole parse answers it)."""
    try:
        return _pieces(memoryview(message), descriptor)
    except UnusualWire:
        return None


def _pieces(view: memoryview, descriptor: Descriptor) -> list[Piece] | None:
    out: list[Piece] = []
    kept = 0  # the fields from view[kept:] not yet in a piece
    at = 0
    for number, wire, whole, payload in fields(view):
        begins, at = at, at + len(whole)
        field = descriptor.fields_by_number.get(number)
        if field is None or wire != 2 or len(payload) <= PIECE_BYTES:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE and not is_repeated(field):  # an element a piece would add
            parts = _pieces(payload, field.message_type)
        elif field.type not in _NOT_PACKED and is_repeated(field):
            parts = _run_parts(payload, FIXED_BYTES.get(field.type))
        else:
            parts = None
        if parts is None:
            continue
        if kept < begins:
            out.append((b"", view[kept:begins]))
        out.extend((length_prefix(number, len(head) + len(body)) + head, body) for head, body in parts)
        kept = at
    if not out:
        return None
    if kept < len(view):
        out.append((b"", view[kept:]))
    return out


def _run_parts(run: memoryview, fixed: int | None) -> list[Piece] | None:
    """A packed run cut into parts of about PIECE_BYTES, each of whole values; None when its last value is cut."""
    parts, begin = [], 0
    while len(run) - begin > PIECE_BYTES:
        end = begin + PIECE_BYTES
        if fixed is not None:
            end -= end % fixed
        else:  # past the first varint that ends at or after the cut
            stop = min(end + MAX_VARINT_BYTES, len(run))
            while end < stop and run[end - 1] >= 0x80:
                end += 1
            if run[end - 1] >= 0x80:
                return None
        parts.append((b"", run[begin:end]))
        begin = end
    if begin < len(run):
        parts.append((b"", run[begin:]))
    return parts

