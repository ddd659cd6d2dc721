"""Builds SamplingBatch objects for tests from plain Python values."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokensampler_server.model.sampling import LogitProcessing, LogprobsMode, SamplingBatch

Column = float | int | Sequence[float] | Sequence[int] | torch.Tensor


def per_row(value: Column, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A scalar shared by every row, or one value per row, as a [num_rows] tensor of `dtype`."""
    tensor = torch.as_tensor(value, dtype=dtype)
    return tensor.expand(num_rows).clone() if tensor.dim() == 0 else tensor.clone()


# Each per-row column of a request: its dtype and the value a row gets when the column is not given.
COLUMNS: dict[str, tuple[torch.dtype, float | int]] = {
    "temperature": (torch.float32, 1.0),
    "top_k": (torch.int32, 0),
    "top_p": (torch.float32, 1.0),
    "min_p": (torch.float32, 0.0),
    "seed": (torch.int64, 0),
    "position": (torch.int64, 0),
    "iteration": (torch.int64, 0),
}


def row_columns(
    num_rows: int, values: dict[str, Column], names: Sequence[str] = tuple(COLUMNS)
) -> dict[str, torch.Tensor]:
    """The columns `names` as [num_rows] tensors: each the one in `values` (a scalar shared by every row, or one
    value per row) or its default. A name in `values` that is not in `names` is a TypeError, as a misspelled
    keyword argument would be."""
    unknown = values.keys() - set(names)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    return {name: per_row(values.get(name, COLUMNS[name][1]), num_rows, COLUMNS[name][0]) for name in names}


def make_batch(
    logits: torch.Tensor,
    *,
    num_samples: int = 1,
    processing: LogitProcessing | None = None,
    return_logprobs: bool = False,
    logprobs_mode: LogprobsMode = LogprobsMode.RAW,
    top_logprobs: int = 0,
    **columns: Column,
) -> SamplingBatch:
    """A batch over `logits` [B, V] with the given COLUMNS; scalars are shared by every row, sequences give one
    value per row."""
    return SamplingBatch(
        logits=logits,
        **row_columns(logits.shape[0], columns),
        num_samples=num_samples,
        processing=processing,
        return_logprobs=return_logprobs,
        logprobs_mode=logprobs_mode,
        top_logprobs=top_logprobs,
    )


def select_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The same requests as `batch`'s rows `rows`, in that order (no processing)."""
    assert batch.processing is None
    return SamplingBatch(
        logits=batch.logits[rows],
        **{name: getattr(batch, name)[rows] for name in COLUMNS},
        num_samples=batch.num_samples,
        return_logprobs=batch.return_logprobs,
        logprobs_mode=batch.logprobs_mode,
        top_logprobs=batch.top_logprobs,
    )
