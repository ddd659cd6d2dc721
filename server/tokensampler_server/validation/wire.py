"""Serialized protobuf messages walked field by field, by their tags and lengths, without parsing them: what the
packed-run decoder (packed.py) and the stream's input scan (rpc/input_scan.py) read. Views of the message only,
nothing copied; checked against the message's end, so untrusted bytes never read past it."""

from __future__ import annotations

from collections.abc import Iterator


MAX_VARINT_BYTES = 10
"""The most bytes a varint takes (a negative int32 or int64 is ten)."""


class UnusualWire(ValueError):
    """A field of a wire type the walk does not skip (a group), or one past the message: parse it whole."""


class CutShort(UnusualWire):
    """Bytes that no parser takes: a field or varint past the message's end, or a wire type that does not exist."""


def fields(message: bytes | memoryview,
           most: int | None = None) -> Iterator[tuple[int, int, memoryview, memoryview | None]]:
    """(field number, wire type, the field's bytes, its payload for a length-delimited field) at this level, in
    order; UnusualWire past `most` fields (the walk is Python, ~0.5 us a field: protobuf's parser is the faster way
    through a message of millions of tiny fields)."""
    view = memoryview(message)
    at, end, count = 0, len(view), 0
    while at < end:
        count += 1
        if most is not None and count > most:
            raise UnusualWire(f"more than {most} fields")
        start = at
        key, at = _varint(view, at)
        number, wire = key >> 3, key & 7
        payload = None
        if wire == 0:
            _, at = _varint(view, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            length, at = _varint(view, at)
            payload = view[at:at + length]
            at += length
        elif wire in (3, 4):
            raise UnusualWire(f"wire type {wire} (a group)")
        else:
            raise CutShort(f"wire type {wire}")
        if at > end:
            raise CutShort("a field past the message")
        yield number, wire, view[start:at], payload


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    """The varint at view[at:] and the position after it."""
    value, shift = 0, 0
    while True:
        if at >= len(view) or shift > 63:
            raise CutShort("a varint past the message")
        byte = view[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
