"""Repeated numeric fields of a parsed message as numpy arrays, without a Python step per element.

A repeated field of the upb runtime yields one Python int per element: 20 million token ids took
2.2 s through np.asarray (65 ns an id through np.fromiter), all of it holding the interpreter.
Serializing the message instead gives its packed runs in C (16 ns an id), which numpy decodes in
slices (25 ns an id, mostly without the interpreter): the temporaries stay a few MiB.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tokensampler_server.validation.wire import MAX_VARINT_BYTES, UnusualWire, fields

# Bytes of varints decoded at once: bounds the temporaries (about 17 bytes per input byte) to ~17 MiB.
_SLICE_BYTES = 1 << 20


def packed_runs(serialized: bytes | memoryview, numbers: tuple[int, ...]) -> dict[int, memoryview]:
    """The packed run (or nested message) of each length-delimited field `numbers` of a serialized message,
    absent when empty.

    SerializeToString writes the known fields first, in field-number order, a packed repeated field as one
    run: only the fields up to the last wanted one are walked (unknown fields come after them).
    """
    runs: dict[int, memoryview] = {}
    try:
        for number, wire, _, payload in fields(serialized):
            if number > max(numbers) or wire != 2:
                break
            if number in numbers:
                runs[number] = payload
    except UnusualWire:  # a group a client sent as an unknown field: past the wanted runs, as any other field
        pass
    return runs


def _slices(data: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(bytes, end offsets of the varints in them) of consecutive slices of whole varints; each slice's
    bytes are followed by ten zeros, so that byte j of every varint can be gathered without a bound."""
    pos = 0
    while pos < len(data):
        ends = np.flatnonzero(data[pos : pos + _SLICE_BYTES] < 0x80)
        if len(ends) == 0:
            raise ValueError("a packed run that ends inside a varint")
        chunk = np.zeros(int(ends[-1]) + 1 + MAX_VARINT_BYTES, dtype=np.uint8)
        chunk[: int(ends[-1]) + 1] = data[pos : pos + int(ends[-1]) + 1]
        yield chunk, ends
        pos += int(ends[-1]) + 1


def decode_varints(run: memoryview | None, count: int) -> np.ndarray:
    """int64 [count]: the varints of a packed run of an integer field (a negative int32 is ten bytes,
    sign-extended to 64 bits)."""
    out = np.empty(count, dtype=np.int64)
    data = np.frombuffer(run if run is not None else b"", dtype=np.uint8)
    done = 0
    for chunk, ends in _slices(data):
        if done + len(ends) > count:
            break
        width = np.diff(ends, prepend=-1)  # bytes of each varint
        most = int(width.max())
        wide = np.uint64 if most > 4 else np.uint32  # 4 bytes hold 28 bits: every vocabulary's ids
        starts = ends - (width - 1)
        value = chunk[starts].astype(wide)
        value &= 0x7F
        for j in range(1, min(most, MAX_VARINT_BYTES)):
            part = chunk[starts + j].astype(wide)
            part &= 0x7F
            part *= width > j  # zero past the varint's last byte
            part <<= wide(7 * j)
            value |= part
        out[done : done + len(ends)] = value.view(np.int64) if wide is np.uint64 else value
        done += len(ends)
    if done != count:
        raise ValueError(f"a packed run of another number of values than {count}")
    return out


def decode_floats(run: memoryview | None, count: int) -> np.ndarray:
    """float32 [count]: the values of a packed run of a float field (little-endian fixed32)."""
    data = run if run is not None else b""
    if len(data) != 4 * count:
        raise ValueError(f"a packed run of {len(data)} bytes, expected {4 * count}")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)
