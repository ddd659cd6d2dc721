"""A serialized SampleRequest's repeated values counted from its wire bytes, before protobuf parses it.

protobuf parses a repeated numeric field at ~40 ns a value, holding the interpreter's lock (on a thread too), into
8 bytes a value: a 200 MB Sample whose params.seed held 200 M one-byte varints took 9.4 s, during which no other
call ran, and 4 GB, before validation refused it. Each varint of a packed run ends at a byte below 0x80, so numpy
counts a run's values at memory speed; a request holding more than validation accepts is refused by its field first.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.repetition import MAX_BREAKER_LENGTH, MAX_BREAKERS
from tokensampler_server.validation.wire import UnusualWire, fields

COUNTED_FROM_BYTES = 1 << 20  # a smaller message parses in well under a millisecond: not worth the walk
_SLICE_BYTES = 16 << 20  # a run's bytes compared at once: bounds the temporary

# SamplingParams' per-row fields (1 or B values each): number -> (name, fixed32)
_PER_ROW = {
    1: ("temperature", True), 2: ("top_k", False), 3: ("top_p", True), 4: ("min_p", True), 5: ("seed", False),
    6: ("has_seed", False), 7: ("position", False), 8: ("iteration", False), 9: ("repetition_penalty", True),
    10: ("presence_penalty", True), 11: ("frequency_penalty", True), 17: ("min_tokens", False),
    18: ("num_generated", False), 20: ("no_repeat_ngram_size", False), 21: ("dry_multiplier", True),
    22: ("dry_base", True), 23: ("dry_allowed_length", False), 24: ("dry_penalty_last_n", False),
    26: ("typical_p", True), 27: ("top_n_sigma", True), 28: ("xtc_threshold", True), 29: ("xtc_probability", True),
}
# SamplingParams' token lists (TokenLists: ids = 1), within max_token_entries together with logit_bias (LogitBias:
# tokens = 1); DRY's breakers (TokenSequences: ids = 1) within their own bound, a row's at most
_LISTS = {12: "allowed_token_ids", 13: "banned_token_ids", 15: "output_token_ids", 16: "prompt_token_ids",
          19: "stop_token_ids"}
_BIAS, _BREAKERS = 14, 25
_BREAKER_IDS = MAX_BREAKERS * MAX_BREAKER_LENGTH
_LOGITS, _PARAMS, _SHAPE, _IDS = 1, 4, 2, 1  # SampleRequest.logits, .params; Tensor.shape; TokenLists.ids
_MOST_DIMS = 8
_MOST_TOP_FIELDS = 64  # a SampleRequest has 10
_MOST_LIST_FIELDS = 1024  # a token list, a bias or a tensor has a few: its values packed


class TooManyValues(InvalidArgument):
    """A request that parses, refused by its counts before it is parsed: its own error, not unparsable bytes."""


def check_counts(message: bytes, limits: Limits) -> None:
    """Raises TooManyValues naming the field where `message` (a serialized SampleRequest) holds more values than
    validation accepts: a per-row parameter past max_batch_rows values, token ids past max_token_entries, a shape
    past 8 dimensions, or more fields than such values could fill (each walked field costs the interpreter ~0.5 us).
    Wire it cannot walk (a group, a cut field) is left to the parse."""
    if len(message) <= COUNTED_FROM_BYTES:
        return
    try:
        for number, wire, _, payload in _walk(message, _MOST_TOP_FIELDS, "request"):
            if number == _PARAMS and wire == 2:
                _check_params(payload, limits)
            elif number == _LOGITS and wire == 2:
                _at_most(_values(payload, _SHAPE, "logits"), _MOST_DIMS, "logits.shape", "dimensions")
    except UnusualWire:
        return


def _check_params(params: memoryview, limits: Limits) -> None:
    # Unpacked, each per-row value is a field of its own: up to every row's parameters, and the lists.
    most = len(_PER_ROW) * limits.max_batch_rows + 4 * (len(_LISTS) + 2) + 64
    counts: dict[int, int] = {}
    ids = breaker_ids = 0
    for number, wire, _, payload in _walk(params, most, "params"):
        if number in _PER_ROW:
            counts[number] = counts.get(number, 0) + _count(wire, payload, _PER_ROW[number][1])
        elif number in _LISTS and wire == 2:
            ids += _values(payload, _IDS, f"params.{_LISTS[number]}")
        elif number == _BIAS and wire == 2:
            for n, w, _, tokens in _walk(payload, _MOST_LIST_FIELDS, "params.logit_bias"):
                if n == 1 and w == 2:
                    ids += _values(tokens, _IDS, "params.logit_bias.tokens")
        elif number == _BREAKERS and wire == 2:
            breaker_ids += _values(payload, _IDS, "params.dry_sequence_breakers")
    for number, count in counts.items():
        _at_most(count, limits.max_batch_rows, f"params.{_PER_ROW[number][0]}", "values (one, or one a row)")
    _at_most(ids, limits.max_token_entries, "params", "token ids in its lists (max_token_entries)")
    _at_most(breaker_ids, _BREAKER_IDS * limits.max_batch_rows, "params.dry_sequence_breakers", "ids")


Field = tuple[int, int, memoryview, memoryview | None]  # as fields() yields them


def _walk(message: memoryview | bytes, most: int, field: str) -> Iterator[Field]:
    """fields(message), refused past `most` fields."""
    for index, walked in enumerate(fields(message)):
        if index >= most:
            raise TooManyValues(field, f"more than {most} fields (repeated values go packed, each field once)")
        yield walked


def _values(message: memoryview, number: int, field: str) -> int:
    """How many varints field `number` of `message` holds, packed and unpacked occurrences together."""
    return sum(_count(wire, payload, False) for n, wire, _, payload in _walk(message, _MOST_LIST_FIELDS, field)
               if n == number)


def _count(wire: int, payload: memoryview | None, fixed32: bool) -> int:
    if wire != 2:  # one unpacked value
        return 1
    if fixed32:
        return len(payload) // 4
    data = np.frombuffer(payload, dtype=np.uint8)
    return sum(int(np.count_nonzero(data[at:at + _SLICE_BYTES] < 0x80)) for at in range(0, len(data), _SLICE_BYTES))


def _at_most(count: int, most: int, field: str, what: str) -> None:
    if count > most:
        raise TooManyValues(field, f"{count} {what}, more than {most}")
