"""The validated form of a sampling request, as every backend receives it, and what it returns.

`validation/sample.py` turns a `SampleRequest` into a `SamplingBatch`; a backend turns a `SamplingBatch` into
a `SamplingResult`. Both are plain torch tensors so that the CPU reference and the CUDA kernels read
the same thing. docs/semantics.md defines what a backend computes from them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from tokensampler_server.model.entries import TokenEntries
from tokensampler_server.model.repetition import SequenceSamplers

if TYPE_CHECKING:
    from tokensampler_server.resources.weights import RegisteredWeight


class LogprobsMode(enum.Enum):
    """Which distribution reported log-probs are taken under (docs/semantics.md, steps 1 and 11)."""

    RAW = "raw"
    PROCESSED = "processed"


@dataclass(frozen=True)
class Truncation:
    """The local samplers of step 5 (docs/semantics.md L4-L6): one value per row, every tensor [B] on the CPU.

    A row at the off values (top_n_sigma <= 0, typical_p 1, xtc_probability 0) is left as it is."""

    top_n_sigma: torch.Tensor
    """float32; <= 0 is off."""
    typical_p: torch.Tensor
    """float32 in (0, 1]; 1 is off."""
    xtc_threshold: torch.Tensor
    """float32 in (0, 1]."""
    xtc_probability: torch.Tensor
    """float32 in [0, 1]; 0 is off."""
    seed: torch.Tensor
    position: torch.Tensor
    iteration: torch.Tensor
    """int64 each: the Philox key and counter words of the row's XTC coin (those of its token's noise)."""
    xtc_acts: torch.Tensor | None = None
    """bool: the rows whose XTC acts, drawn with the request's checks (a row's coin is host work, some 300 small
    operations whatever B); None: drawn from the columns above when the samplers apply."""

    @staticmethod
    def off(num_rows: int) -> Truncation:
        """Rows that truncate nothing."""
        zeros = torch.zeros(num_rows, dtype=torch.float32)
        counter = torch.zeros(num_rows, dtype=torch.int64)
        return Truncation(top_n_sigma=zeros, typical_p=torch.ones(num_rows, dtype=torch.float32),
                          xtc_threshold=torch.full((num_rows,), 0.1, dtype=torch.float32), xtc_probability=zeros,
                          seed=counter, position=counter, iteration=counter,
                          xtc_acts=torch.zeros(num_rows, dtype=torch.bool))

    def rows(self, index: torch.Tensor) -> Truncation:
        """The rows `index` (int64, CPU), in that order."""
        return Truncation(**{name: getattr(self, name)[index] for name in _TRUNCATION_COLUMNS},
                          xtc_acts=None if self.xtc_acts is None else self.xtc_acts[index])

    def at_positions(self, position: torch.Tensor) -> Truncation:
        """The same rows drawing their coins at `position` (int64 [B])."""
        return replace(self, position=position, xtc_acts=None)

    @staticmethod
    def concat(parts: list[Truncation]) -> Truncation:
        drawn = all(part.xtc_acts is not None for part in parts)
        return Truncation(**{name: torch.cat([getattr(part, name) for part in parts]) for name in _TRUNCATION_COLUMNS},
                          xtc_acts=torch.cat([part.xtc_acts for part in parts]) if drawn else None)


_TRUNCATION_COLUMNS = ("top_n_sigma", "typical_p", "xtc_threshold", "xtc_probability", "seed", "position", "iteration")


_ENTRY_FIELDS = ("allowed", "banned", "bias", "output_tokens", "prompt_tokens")
_HISTORY_FIELDS = ("output_tokens", "prompt_tokens")
_BITMASK_ONLY = frozenset({"token_bitmask"})


@dataclass(frozen=True)
class LogitProcessing:
    """Steps 2 to 5 of the semantics: masks, logit bias, penalties and the local samplers. Fields left None do
    nothing. The bans of min_tokens are entries of `banned`; no-repeat-n-gram's bans and DRY's penalties are
    derived from the rows' sequences on the logits' device (`sequence_samplers`)."""

    allowed: TokenEntries | None = None
    """Rows that have entries keep only those tokens; other rows are unrestricted."""
    banned: TokenEntries | None = None
    bias: TokenEntries | None = None
    bias_values: torch.Tensor | None = None
    """float32 [len(bias)], the value added at each bias entry."""
    output_tokens: TokenEntries | None = None
    """Generated tokens with multiplicity: repetition, presence and frequency penalties."""
    prompt_tokens: TokenEntries | None = None
    """Prompt tokens: the repetition penalty only."""
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    """float32 [B] each, or None when no row uses it."""
    sequence_samplers: SequenceSamplers | None = None
    """no-repeat-n-gram (banning in step 2) and DRY (penalising after the other penalties, step 4)."""
    truncation: Truncation | None = None
    token_bitmask: torch.Tensor | None = None
    """int32 [B, ceil(V / 32)]: the packed allowed-token mask of structured output (docs/semantics.md, choice 17);
    a row of all ones is unrestricted."""
    token_bitmask_rows: torch.Tensor | None = None
    """int64 [M]: the rows whose token_bitmask row came with their request; the others are all ones, filled in
    for requests without a mask merged beside ones with. None: every row's came with it. Says which rows a backend
    need not mask at all; the masks are the same either way."""

    def changes_beyond(self, fields: frozenset[str]) -> bool:
        """Whether anything but these fields changes a logit. `fields` may name token_bitmask, the token lists
        (allowed, banned, bias, output_tokens, prompt_tokens), sequence_bans (no-repeat-n-gram),
        sequence_penalties (DRY) and truncation (the local samplers). A history changes nothing without a penalty's
        values, nor the values without a history. Reads the fields, builds nothing: it runs on every processed
        call."""
        if self.truncation is not None and "truncation" not in fields:
            return True
        samplers = self.sequence_samplers
        if samplers is not None and ((samplers.bans and "sequence_bans" not in fields)
                                     or (samplers.penalties and "sequence_penalties" not in fields)):
            return True
        if self.token_bitmask is not None and "token_bitmask" not in fields:
            return True
        penalised = any(value is not None for value in (self.repetition_penalty, self.presence_penalty,
                                                        self.frequency_penalty))
        return any(name not in fields and (penalised or name not in _HISTORY_FIELDS)
                   and (entries := getattr(self, name)) is not None and len(entries) for name in _ENTRY_FIELDS)

    def without_bitmask(self) -> LogitProcessing | None:
        """This processing less its token bitmask; None when nothing else is left that changes a logit."""
        if not self.changes_beyond(_BITMASK_ONLY):
            return None
        return replace(self, token_bitmask=None, token_bitmask_rows=None)

    def host_bytes(self) -> int:
        """Bytes of its token entries on the CPU (a row and a token id, 16 bytes an entry). A list shared by every
        row is held once per row: a request of a few KiB can hold hundreds of MiB (Limits.max_token_entries)."""
        return sum(16 * len(entries) for name in _ENTRY_FIELDS if (entries := getattr(self, name)) is not None)

    def at_positions(self, position: torch.Tensor) -> LogitProcessing:
        """The same processing with the rows' XTC coins drawn at `position` (int64 [B]): for a row that samples
        at another position than its request's (a draft position, a diffusion position)."""
        if self.truncation is None:
            return self
        return replace(self, truncation=self.truncation.at_positions(position))


@dataclass(frozen=True)
class HiddenInput:
    """Hidden states [B, D] (float32/bfloat16/float16, CPU) and the registered LM head they go through."""

    states: torch.Tensor
    lm_head: RegisteredWeight


ROW_FIELDS = ("seed", "position", "iteration", "temperature", "top_p", "min_p", "top_k")
"""The per-row parameters of docs/semantics.md that every workload which samples reads, in the kernels' order
(csrc/sampling.h TS_ROW_PARAMS): the bindings take their device addresses in this order."""


@dataclass(frozen=True, kw_only=True)
class RowSampling:
    """The per-row parameters, validated and expanded to one value per row: [B] tensors on the CPU. The one
    definition that a sampled batch, a validated request's rows and a draft verification compose."""

    temperature: torch.Tensor
    """float32; 0 means greedy."""
    top_k: torch.Tensor
    """int32; 0 means off (the validator maps -1 and k >= V to 0)."""
    top_p: torch.Tensor
    """float32 in (0, 1]; 1 means off."""
    min_p: torch.Tensor
    """float32 in [0, 1]; 0 means off."""
    seed: torch.Tensor
    """int64 holding the uint64 seed's bits (two's complement)."""
    position: torch.Tensor
    """int64 holding a uint32."""
    iteration: torch.Tensor
    """int64 holding a uint32."""
    processing: LogitProcessing | None = None
    """Steps 2-5; its TokenEntries rows and per-row tensors index the B rows."""

    def row_sampling(self, index: torch.Tensor | slice = slice(None)) -> dict[str, torch.Tensor]:
        """The per-row parameters (not processing) of the rows `index`, as keywords for another RowSampling."""
        return {name: getattr(self, name)[index] for name in ROW_FIELDS}


@dataclass(frozen=True, kw_only=True)
class SamplingBatch(RowSampling):
    """B rows to sample, every parameter already validated and expanded to one value per row.

    The input is either `logits` [B, V] (float32/bfloat16/float16; on the CPU, or on the backend's GPU when it
    came from a CUDA IPC region) or `hidden`; `with_logits()` turns the second into the first.
    """

    logits: torch.Tensor | None
    num_samples: int = 1
    return_logprobs: bool = False
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    top_logprobs: int = 0
    hidden: HiddenInput | None = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def vocab_size(self) -> int:
        if self.logits is not None:
            return int(self.logits.shape[1])
        return self.hidden.lm_head.finish.vocab_size

    def with_logits(self) -> SamplingBatch:
        """The same batch with hidden states turned into float32 logits on the LM head's device."""
        if self.hidden is None:
            return self
        return replace(self, logits=self.hidden.lm_head.logits(self.hidden.states), hidden=None)


@dataclass(frozen=True)
class SamplingResult:
    """What a backend returns: on the CPU from `sample`, on the device from a prepared call (backends/base.py)."""

    tokens: torch.Tensor | None
    """int64 [B, num_samples]; -1 in rows that are not valid. (None only after the service wrote them
    into an output region.)"""
    valid: torch.Tensor
    """bool [B]: false where no finite logit remained after processing."""
    nan_detected: torch.Tensor
    """bool [B]: the row held NaN or +inf logits (treated as -inf)."""
    logprobs: torch.Tensor | None = None
    """float32 [B, num_samples] when asked; NaN in rows that are not valid."""
    top_logprob_ids: torch.Tensor | None = None
    """int64 [B, N] when top_logprobs = N > 0."""
    top_logprobs: torch.Tensor | None = None
    """float32 [B, N] when top_logprobs = N > 0."""


def _select(entries: TokenEntries | None, mapping: torch.Tensor) -> tuple[TokenEntries | None, torch.Tensor | None]:
    if entries is None:
        return None, None
    new_rows = mapping[entries.rows]
    keep = new_rows >= 0
    return TokenEntries(new_rows[keep], entries.tokens[keep]), keep


def merge_rows(result: SamplingResult, rows: torch.Tensor, sub: SamplingResult) -> SamplingResult:
    """`result` with its `rows` replaced by the rows of `sub` (sampled again on another path)."""
    def put(full: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
        if full is None or part is None:
            return full
        full = full.clone()
        full[rows] = part
        return full

    return SamplingResult(tokens=put(result.tokens, sub.tokens), valid=put(result.valid, sub.valid),
                          nan_detected=put(result.nan_detected, sub.nan_detected),
                          logprobs=put(result.logprobs, sub.logprobs),
                          top_logprob_ids=put(result.top_logprob_ids, sub.top_logprob_ids),
                          top_logprobs=put(result.top_logprobs, sub.top_logprobs))


def _select_row_ids(row_ids: torch.Tensor | None, mapping: torch.Tensor) -> torch.Tensor | None:
    """The new numbers of those of `row_ids` that `mapping` keeps (None stays None: every row)."""
    if row_ids is None:
        return None
    new_rows = mapping[row_ids]
    return new_rows[new_rows >= 0]


def select_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The sub-batch of `rows` (int64, CPU) of a logits or hidden-state batch, processing entries remapped
    to the new row numbers."""
    if batch.logits is not None:
        selected_input = {"logits": batch.logits[rows.to(batch.logits.device)].cpu()}
    else:
        states = batch.hidden.states
        selected_input = {"hidden": HiddenInput(states[rows.to(states.device)], batch.hidden.lm_head)}
    processing = batch.processing
    if processing is not None:
        mapping = torch.full((batch.num_rows,), -1, dtype=torch.int64)
        mapping[rows] = torch.arange(rows.numel())
        bias, keep = _select(processing.bias, mapping)
        sequences = processing.sequence_samplers
        per_row = {name: getattr(processing, name)[rows] if getattr(processing, name) is not None else None
                   for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")}
        processing = LogitProcessing(
            allowed=_select(processing.allowed, mapping)[0], banned=_select(processing.banned, mapping)[0],
            bias=bias, bias_values=processing.bias_values[keep] if keep is not None else None,
            output_tokens=_select(processing.output_tokens, mapping)[0],
            prompt_tokens=_select(processing.prompt_tokens, mapping)[0],
            sequence_samplers=sequences.rows(rows) if sequences is not None else None,
            truncation=processing.truncation.rows(rows) if processing.truncation is not None else None,
            token_bitmask=processing.token_bitmask[rows] if processing.token_bitmask is not None else None,
            token_bitmask_rows=_select_row_ids(processing.token_bitmask_rows, mapping), **per_row)
    return replace(batch, **selected_input, **batch.row_sampling(rows), processing=processing)


def concat_results(parts: list[SamplingResult]) -> SamplingResult:
    """One result whose rows are the rows of `parts`, in order (the inverse of batch_merge.split_result)."""

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(part, name) for part in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return SamplingResult(tokens=cat("tokens"), valid=cat("valid"), nan_detected=cat("nan_detected"),
                          logprobs=cat("logprobs"), top_logprob_ids=cat("top_logprob_ids"),
                          top_logprobs=cat("top_logprobs"))
