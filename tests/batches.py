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


def make_batch(
    logits: torch.Tensor,
    *,
    temperature: Column = 1.0,
    top_k: Column = 0,
    top_p: Column = 1.0,
    min_p: Column = 0.0,
    seed: Column = 0,
    position: Column = 0,
    iteration: Column = 0,
    num_samples: int = 1,
    processing: LogitProcessing | None = None,
    return_logprobs: bool = False,
    logprobs_mode: LogprobsMode = LogprobsMode.RAW,
    top_logprobs: int = 0,
) -> SamplingBatch:
    """A batch over `logits` [B, V]; scalars are shared by every row, sequences give one value per row."""
    num_rows = logits.shape[0]
    return SamplingBatch(
        logits=logits,
        temperature=per_row(temperature, num_rows, torch.float32),
        top_k=per_row(top_k, num_rows, torch.int32),
        top_p=per_row(top_p, num_rows, torch.float32),
        min_p=per_row(min_p, num_rows, torch.float32),
        seed=per_row(seed, num_rows, torch.int64),
        position=per_row(position, num_rows, torch.int64),
        iteration=per_row(iteration, num_rows, torch.int64),
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
        temperature=batch.temperature[rows],
        top_k=batch.top_k[rows],
        top_p=batch.top_p[rows],
        min_p=batch.min_p[rows],
        seed=batch.seed[rows],
        position=batch.position[rows],
        iteration=batch.iteration[rows],
        num_samples=batch.num_samples,
        return_logprobs=batch.return_logprobs,
        logprobs_mode=batch.logprobs_mode,
        top_logprobs=batch.top_logprobs,
    )
