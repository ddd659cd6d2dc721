"""Steps 2 to 5 of docs/semantics.md in torch: masks (no-repeat-n-gram's included), logit bias, penalties (DRY's
included), non-finite inputs, and the local samplers of step 5 (truncation.py).

Device-agnostic: the CPU reference runs it on the CPU and the CUDA backend on the GPU, so both apply
exactly the same processing before they sample; the CUDA backend passes its own kernels for the local samplers
(cuda_local_samplers.py), which keep the same tokens as truncation.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokensampler_server.model.sampling import LogitProcessing, TokenEntries, Truncation
from tokensampler_server.backends.sequence_samplers import apply_bans, apply_penalties, derive
from tokensampler_server.backends.truncation import apply_truncation


def _index(entries: TokenEntries, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return entries.rows.to(device, non_blocking=True), entries.tokens.to(device, non_blocking=True)


def _token_counts(entries: TokenEntries, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Occurrences of each (row, token) in entries, as float32 [B, V]."""
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    ones = torch.ones(len(entries), dtype=torch.float32, device=device)
    return counts.index_put_(_index(entries, device), ones, accumulate=True)


def apply_processing(x: torch.Tensor, processing: LogitProcessing | None,
                     truncate: Callable[[torch.Tensor, Truncation], torch.Tensor] = apply_truncation) -> torch.Tensor:
    """Applies masks (step 2), logit bias (3), penalties (4) and the local samplers of step 5 to float32 logits
    x [B, V]; in place where it can, so use the returned tensor (contiguous: bans and DRY write through its flat
    view). truncate: the local samplers' implementation (the CUDA backend passes its kernels'; the torch one is the
    reference)."""
    if processing is None:
        return x
    x = x.contiguous()
    device = x.device
    # 2. Masks (min_tokens' bans are entries of `banned`; no-repeat-n-gram's come from the rows' sequences).
    if processing.token_bitmask is not None:
        words = processing.token_bitmask.to(device, non_blocking=True)
        x.masked_fill_(~unpack_bitmask(words, x.shape[1]), float("-inf"))
    if processing.allowed is not None and len(processing.allowed):
        rows, tokens = _index(processing.allowed, device)
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.bool))
        restricted = torch.zeros(x.shape[0], dtype=torch.bool, device=device)
        restricted[rows] = True
        x.masked_fill_(restricted.unsqueeze(1) & ~keep, float("-inf"))
    if processing.banned is not None and len(processing.banned):
        banned = processing.banned  # one upload of flat indices, and -inf as a scalar (no upload)
        x.view(-1).scatter_(0, (banned.rows * x.shape[1] + banned.tokens).to(device, non_blocking=True),
                              float("-inf"))
    sequences = None
    if processing.sequence_samplers is not None:
        sequences = derive(processing.sequence_samplers, x.shape[1], device)
        if sequences.banned is not None:
            x = apply_bans(x, sequences)
    # 3. Logit bias; duplicate entries add up.
    if processing.bias is not None and len(processing.bias):
        values = processing.bias_values.to(device=device, dtype=torch.float32, non_blocking=True)
        x.index_put_(_index(processing.bias, device), values, accumulate=True)
    # 4. Penalties on the row's history, then DRY's.
    x = _penalties(x, processing)
    if sequences is not None and sequences.penalty is not None:
        x = apply_penalties(x, sequences)
    # 5. The local samplers (the backend's sanitize_non_finite flags the non-finite entries they leave).
    if processing.truncation is not None:
        x = truncate(x, processing.truncation)
    return x


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size]: token i is set when bit i % 32 of word i // 32 of its row is (choice 17), unpacked
    on the words' device with shifts, no loop over tokens. words: int32 [B, W], W >= ceil(vocab_size / 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    # An arithmetic shift copies the sign bit into the high bits; `& 1` keeps bit `shift` alone.
    bits = (words.unsqueeze(2) >> shifts).bitwise_and_(1)
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()


def _penalties(x: torch.Tensor, processing: LogitProcessing) -> torch.Tensor:
    """Repetition, presence and frequency penalties (step 4). The penalties are finite (validated) and r > 0, so only
    frequency·count can be an infinite term; a non-finite entry (-inf mask, NaN, +inf) leaves every stage as it came
    and a finite one leaves as a number or ±inf (choice 1), never NaN."""
    if all(value is None for value in (processing.repetition_penalty, processing.presence_penalty,
                                       processing.frequency_penalty)):
        return x  # a history sent for DRY or no-repeat-n-gram alone is not counted
    device = x.device
    has_output = processing.output_tokens is not None and len(processing.output_tokens) > 0
    has_prompt = processing.prompt_tokens is not None and len(processing.prompt_tokens) > 0
    if not (has_output or has_prompt):
        return x
    output_counts = (
        _token_counts(processing.output_tokens, x.shape, device) if has_output else torch.zeros_like(x)
    )
    if processing.repetition_penalty is not None:
        seen = output_counts > 0
        if has_prompt:
            seen |= _token_counts(processing.prompt_tokens, x.shape, device) > 0
        r = processing.repetition_penalty.to(device, non_blocking=True).unsqueeze(1)
        penalised = torch.where(x > 0, x / r, x * r)
        x = torch.where(seen, penalised, x)
    if processing.presence_penalty is not None:
        presence = processing.presence_penalty.to(device, non_blocking=True).unsqueeze(1)
        x = x - presence * (output_counts > 0).to(torch.float32)
    if processing.frequency_penalty is not None:
        frequency = processing.frequency_penalty.to(device, non_blocking=True).unsqueeze(1)
        # frequency·count may overflow to ±inf (the other terms are finite): it must leave a non-finite entry as it
        # is, so that a masked -inf stays -inf (not -inf + inf = NaN, which would flag the row) and a finite logit
        # only ever becomes ±inf (choice 1), never NaN.
        x = torch.where(torch.isfinite(x), x - frequency * output_counts, x)
    return x


def sanitize_non_finite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 5: NaN and +inf become -inf, in place. Returns (x, nan_detected [B])."""
    bad = torch.isnan(x) | torch.isposinf(x)
    nan_detected = bad.any(dim=1)
    x.masked_fill_(bad, float("-inf"))
    return x, nan_detected
