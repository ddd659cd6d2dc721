"""Per-row columns of SamplingParams: 0 values (the default), 1 (shared by every row) or B (one per row),
expanded to B values and checked, every rejection an InvalidArgument naming the field."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tokensampler_server.core.errors import InvalidArgument


def column(values: Sequence, field: str, num_rows: int, default: float | int, dtype: np.dtype) -> np.ndarray:
    """Expands a 0/1/B-valued column to B values."""
    count = len(values)
    if count == 0:
        return np.full(num_rows, default, dtype=dtype)
    if count == 1:
        return np.full(num_rows, values[0], dtype=dtype)
    if count == num_rows:
        return np.asarray(values, dtype=dtype)
    raise InvalidArgument(field, f"got {count} values, expected 0, 1 or B={num_rows}")


def check(values: np.ndarray, ok: np.ndarray, field: str, expected: str) -> None:
    """Rejects the first value where `ok` is false."""
    if not bool(ok.all()):
        raise InvalidArgument(field, f"got {values[int(np.argmin(ok))].item()}, expected {expected}")


def checked_column(
    values: Sequence, field: str, num_rows: int, default: float | int, dtype: type[np.generic],
    ok: Callable[[np.ndarray], np.ndarray], expected: str,
) -> np.ndarray:
    """column, then check of every value against `ok`. The common 0- and 1-valued columns are checked
    as one scalar (numpy calls on arrays cost microseconds each, which add up on the hot path)."""
    count = len(values)
    if count == 0:
        return np.full(num_rows, default, dtype=dtype)  # the defaults are valid
    if count == 1:
        value = dtype(values[0])  # the same conversion np.full does
        if not ok(value):
            raise InvalidArgument(field, f"got {value.item()}, expected {expected}")
        return np.full(num_rows, value, dtype=dtype)
    expanded = column(values, field, num_rows, default, dtype)
    check(expanded, ok(expanded), field, expected)
    return expanded
