"""Concatenates validated SamplingBatches into one and splits the result back, for server batching.

Batch invariance (docs/semantics.md) makes every row's answer independent of the rows around it, so
a merged batch gives each request exactly the rows it would have got alone. Batches merge when their
`merge_key`s are equal: same input kind, dtype and width, same per-request options.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from tokensampler_server.model.repetition import SequenceSamplers
from tokensampler_server.model.sampling import HiddenInput, LogitProcessing, SamplingBatch, SamplingResult, TokenEntries, Truncation

_PENALTY_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_ENTRY_FIELDS = ("allowed", "banned", "bias", "output_tokens", "prompt_tokens")


def merge_key(batch: SamplingBatch) -> Hashable:
    if batch.hidden is not None:
        source: Hashable = ("hidden", id(batch.hidden.lm_head), batch.hidden.states.dtype, batch.hidden.states.shape[1])
    else:
        source = ("logits", batch.logits.dtype, batch.logits.shape[1], batch.logits.device)
    return source, batch.num_samples, batch.return_logprobs, batch.logprobs_mode, batch.top_logprobs


def _merge_entries(batches: Sequence[SamplingBatch], name: str, offsets: list[int]) -> TokenEntries | None:
    parts = [(getattr(b.processing, name) if b.processing else None, offset) for b, offset in zip(batches, offsets)]
    parts = [(entries, offset) for entries, offset in parts if entries is not None]
    if not parts:
        return None
    return TokenEntries(
        rows=torch.cat([entries.rows + offset for entries, offset in parts]),
        tokens=torch.cat([entries.tokens for entries, _ in parts]),
    )


def _merge_processing(batches: Sequence[SamplingBatch], offsets: list[int]) -> LogitProcessing | None:
    if all(b.processing is None for b in batches):
        return None
    merged = {name: _merge_entries(batches, name, offsets) for name in _ENTRY_FIELDS}
    parts = [b.processing.bias_values for b in batches if b.processing and b.processing.bias is not None]
    merged["bias_values"] = torch.cat(parts) if parts else None
    merged["sequence_samplers"] = SequenceSamplers.concat(
        [(b.processing.sequence_samplers if b.processing else None, b.num_rows) for b in batches])
    if any(b.processing is not None and b.processing.truncation is not None for b in batches):
        merged["truncation"] = Truncation.concat([
            b.processing.truncation if b.processing is not None and b.processing.truncation is not None
            else Truncation.off(b.num_rows) for b in batches])
    bitmasks = [b.processing.token_bitmask if b.processing is not None else None for b in batches]
    present = [mask for mask in bitmasks if mask is not None]
    if present:  # rows without one get all ones: unrestricted (choice 17)
        words = present[0].shape[1]
        merged["token_bitmask"] = torch.cat([
            mask if mask is not None else torch.full((b.num_rows, words), -1, dtype=torch.int32)
            for b, mask in zip(batches, bitmasks)])
        masked = [_bitmask_rows(b) + offset for b, offset in zip(batches, offsets) if b.processing is not None
                  and b.processing.token_bitmask is not None]
        rows = torch.cat(masked)
        if rows.numel() < merged["token_bitmask"].shape[0]:  # which rows the filled ones are
            merged["token_bitmask_rows"] = rows
    for name, default in _PENALTY_DEFAULTS.items():
        columns = [getattr(b.processing, name) if b.processing else None for b in batches]
        if any(column is not None for column in columns):
            merged[name] = torch.cat([
                column if column is not None else torch.full((b.num_rows,), default, dtype=torch.float32)
                for b, column in zip(batches, columns)
            ])
    return LogitProcessing(**merged)


def _bitmask_rows(batch: SamplingBatch) -> torch.Tensor:
    """The rows of a batch with a token bitmask whose mask came with their request."""
    rows = batch.processing.token_bitmask_rows
    return rows if rows is not None else torch.arange(batch.num_rows)


def merge_batches(batches: Sequence[SamplingBatch]) -> SamplingBatch:
    """One batch whose rows are the rows of `batches`, in order. All must share a merge_key."""
    if len(batches) == 1:
        return batches[0]
    offsets = [0]
    for b in batches[:-1]:
        offsets.append(offsets[-1] + b.num_rows)
    first = batches[0]
    hidden = None
    if first.hidden is not None:
        hidden = HiddenInput(torch.cat([b.hidden.states for b in batches]), first.hidden.lm_head)
    return replace(
        first,
        logits=None if hidden is not None else torch.cat([b.logits for b in batches]),
        hidden=hidden,
        temperature=torch.cat([b.temperature for b in batches]),
        top_k=torch.cat([b.top_k for b in batches]),
        top_p=torch.cat([b.top_p for b in batches]),
        min_p=torch.cat([b.min_p for b in batches]),
        seed=torch.cat([b.seed for b in batches]),
        position=torch.cat([b.position for b in batches]),
        iteration=torch.cat([b.iteration for b in batches]),
        processing=_merge_processing(batches, offsets),
    )


def split_result(result: SamplingResult, sizes: Sequence[int]) -> list[SamplingResult]:
    """The rows of each merged batch, in order."""
    parts = []
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        parts.append(
            SamplingResult(
                tokens=result.tokens[rows],
                valid=result.valid[rows],
                nan_detected=result.nan_detected[rows],
                logprobs=None if result.logprobs is None else result.logprobs[rows],
                top_logprob_ids=None if result.top_logprob_ids is None else result.top_logprob_ids[rows],
                top_logprobs=None if result.top_logprobs is None else result.top_logprobs[rows],
            )
        )
        start += size
    return parts
