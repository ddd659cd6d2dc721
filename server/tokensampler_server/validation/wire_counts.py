"""A serialized request's repeated values counted from its wire bytes, before protobuf parses it.

protobuf parses a repeated numeric field at ~40 ns a value, holding the interpreter's lock (on a thread too), into
8 bytes a value: a 200 MB Sample whose params.seed held 200 M one-byte varints took 9.4 s, during which no other
call ran, and 4 GB, before validation refused it. Each varint of a packed run ends at a byte below 0x80, so numpy
counts a run's values at memory speed; a request holding more values than validation accepts anywhere is refused
by the field first. The walk follows the message's descriptor, so every request type is counted alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.repetition import MAX_BREAKER_LENGTH, MAX_BREAKERS
from tokensampler_server.validation.wire import MAX_VARINT_BYTES, CutShort, UnusualWire, fields

_SLICE_BYTES = 16 << 20  # a run's bytes compared at once: bounds the temporary
_MOST_DEPTH = 8  # the contract nests messages four deep
MOST_FIELDS = 8192
"""Fields walked in one message, its nested ones and unknown ones included (~4 ms of the interpreter): a request
packs its repeated values (each run one field) and holds a few dozen fields; unpacked, a run is a field a value."""
_MOST_DIMS = 8
FIXED_BYTES = {
    FieldDescriptor.TYPE_FLOAT: 4, FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4,
    FieldDescriptor.TYPE_DOUBLE: 8, FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8,
}
"""The bytes of a value of each fixed-width field type; every other packed type is varints."""

Field = tuple[int, int, memoryview, memoryview | None]  # as fields() yields them


class WireRefusal(InvalidArgument):
    """A request refused from its wire bytes before it is parsed: its own error, not unparsable bytes."""


def check_counts(message: bytes, descriptor: Descriptor, limits: Limits) -> int:
    """The repeated values `message` (serialized, of type `descriptor`) holds. Raises WireRefusal naming the field
    where it holds more than validation accepts: a per-row field past max_batch_rows values, token ids past
    max_token_entries, DRY's breakers past 32 of 16 ids a row, a shape past 8 dimensions, more than MOST_FIELDS
    fields in all (each walked field costs the interpreter ~0.5 us); and where its wire is not walked (a group, which
    no proto3 message holds): a count it could hide is not parsed. Bytes cut short are counted up to the cut, which
    protobuf's parse then refuses as bytes that do not parse (a stream's message so refused ends its stream)."""
    counts: dict[str, int] = {}
    try:
        _count_message(memoryview(message), descriptor, "", limits, counts, {}, [MOST_FIELDS], 0)
    except CutShort:
        pass
    except UnusualWire as err:
        raise WireRefusal("request", f"wire that is not counted before a parse ({err}): expected proto3 fields whole")
    return sum(counts.values())


def _count_message(view: memoryview, descriptor: Descriptor, path: str, limits: Limits, counts: dict[str, int],
                   cases: dict[tuple[str, str], str], left: list[int], depth: int) -> None:
    """Counts the message at `path` into `counts`. `cases`: each oneof's case so far, by the path of its message
    and its name (the occurrences of a message merge, so a case of a later one replaces an earlier one's), which
    another case replaces, and its counts with it."""
    for number, wire, _, payload in _walk(view, left, path or "request"):
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.containing_oneof is not None:
            oneof = (path, field.containing_oneof.name)
            replaced = cases.get(oneof, name)
            if replaced != name:
                for key in [key for key in counts if key == replaced or key.startswith(f"{replaced}.")]:
                    del counts[key]
            cases[oneof] = name
        if field.message_type is not None:
            if wire == 2 and depth < _MOST_DEPTH:
                _count_message(payload, field.message_type, name, limits, counts, cases, left, depth + 1)
        elif is_repeated(field):
            key, most, what = _budget(descriptor.name, field.name, name, limits)
            so_far = counts.get(key, 0)
            # refused from its length alone: n bytes hold at least n / 10 values (250 M took 0.18 s to count)
            if wire == 2 and so_far + len(payload) // MAX_VARINT_BYTES > most:
                raise WireRefusal(key, f"at least {so_far + len(payload) // MAX_VARINT_BYTES} {what}, more than {most}")
            counts[key] = so_far + _count(wire, payload, field.type)
            if counts[key] > most:
                raise WireRefusal(key, f"{counts[key]} {what}, more than {most}")


def is_repeated(field: FieldDescriptor) -> bool:
    # newer protobuf says is_repeated and deprecates label; an older one within the project's floor has label alone
    if hasattr(type(field), "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def _budget(message: str, field: str, path: str, limits: Limits) -> tuple[str, int, str]:
    """(the count a repeated field adds to, the most it may hold, what it counts) by the contract's types: token
    lists share max_token_entries, DRY's breakers their own bound, a shape 8 dimensions, anything else a value a
    row at most."""
    rows = limits.max_batch_rows
    if message == "TokenLists" and field == "ids":  # every list of the request's parameters together
        return path.split(".")[0], limits.max_token_entries, "token ids in its lists (max_token_entries)"
    if message == "LogitBias" and field == "values":
        return path, limits.max_token_entries, "values (one a biased id)"
    if message == "TokenSequences":
        most = {"ids": MAX_BREAKERS * MAX_BREAKER_LENGTH * rows, "lengths": MAX_BREAKERS * rows}.get(field, rows)
        return path, most, f"values ({MAX_BREAKERS} breakers of {MAX_BREAKER_LENGTH} ids a row at most)"
    if field == "shape":
        return path, _MOST_DIMS, "dimensions"
    if message == "RowsRef" and field == "row_offsets":  # a row each: validation names them the rows' shape
        return path.rsplit(".", 1)[0] + ".shape", rows, "rows (row offsets)"
    return path, rows, "values (one, or one a row)"


def _walk(message: memoryview, left: list[int], field: str) -> Iterator[Field]:
    """fields(message), each taken from the message's one budget `left` ([fields]): refused once it is spent."""
    for walked in fields(message):
        left[0] -= 1
        if left[0] < 0:
            raise WireRefusal(field, f"more than {MOST_FIELDS} fields in all (repeated values go packed, as every "
                                     "protobuf library writes them)")
        yield walked


def _count(wire: int, payload: memoryview | None, kind: int) -> int:
    if wire != 2:  # one unpacked value
        return 1
    if kind in FIXED_BYTES:
        return len(payload) // FIXED_BYTES[kind]
    data = np.frombuffer(payload, dtype=np.uint8)
    return sum(int(np.count_nonzero(data[at:at + _SLICE_BYTES] < 0x80)) for at in range(0, len(data), _SLICE_BYTES))
