"""Steps 2-5 of docs/semantics.md as backends/processing.py applies them (the CPU reference here; the CUDA backend runs
the same function on the GPU): penalties that overflow float32 against masks and non-finite inputs (choice 1)."""

from __future__ import annotations

import math

import pytest
import torch
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.processing import apply_processing, sanitize_non_finite
from tokensampler_server.model.sampling import LogitProcessing, TokenEntries

from .batches import make_batch

INF = math.inf


def _entries(tokens: list[int]) -> TokenEntries:
    """Entries of row 0."""
    return TokenEntries(torch.zeros(len(tokens), dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64))


@pytest.mark.parametrize("logits, banned, history, penalties, flagged", [
    # A banned token (-inf at step 2) that a frequency penalty of -3e38 hits twice: -inf - (-6e38 = -inf) stays -inf.
    ([0.0, 1.0, 2.0, 3.0], [2], [2, 2], {"frequency": -3e38}, False),
    # ... and a NaN or +inf input on it, which the ban masks (choice 1).
    ([0.0, 1.0, math.nan, 3.0], [2], [2, 2], {"frequency": -3e38}, False),
    ([0.0, 1.0, INF, 3.0], [2], [2, 2], {"frequency": 3e38}, False),
    # An input -inf (a mask) under the same penalty.
    ([0.0, 1.0, -INF, 3.0], [], [2, 2], {"frequency": -3e38}, False),
    ([0.0, 1.0, -INF, 3.0], [], [2, 2], {"frequency": -3e38, "presence": -1.0, "repetition": 0.5}, False),
    # Finite logits taken past float32's range: -inf masks the token, +inf is masked and flagged.
    ([0.0, 1.0, 2.0, 3.0], [], [2, 2], {"frequency": 3e38}, False),
    ([0.0, 1.0, 2.0, 3.0], [], [2, 2], {"frequency": -3e38}, True),
    # repetition takes 3e38 to +inf first (3e38 / 1e-3), then frequency·count = +inf meets it: +inf, not NaN.
    ([0.0, 1.0, 2.0, 3e38], [], [3, 3], {"repetition": 1e-3, "frequency": 3e38}, True),
])
def test_penalties_leave_masks_masked_and_take_finite_logits_to_inf_never_nan(
        logits: list[float], banned: list[int], history: list[int], penalties: dict, flagged: bool) -> None:
    x = torch.tensor([logits], dtype=torch.float32)
    processing = LogitProcessing(
        banned=_entries(banned) if banned else None,
        output_tokens=_entries(history),
        **{f"{name}_penalty": torch.tensor([value], dtype=torch.float32) for name, value in penalties.items()},
    )
    processed = apply_processing(x.clone(), processing)
    finite_in = torch.isfinite(x[0])
    masked = ~finite_in & (x[0] == -INF)
    masked[banned] = True
    assert not torch.isnan(processed[0][finite_in | masked]).any(), processed
    assert (processed[0][masked] == -INF).all(), processed
    assert bool(sanitize_non_finite(processed.clone())[1][0]) == flagged
    result = CpuBackend().sample(make_batch(x, temperature=0.0, processing=processing))
    assert bool(result.nan_detected[0]) == flagged
    assert bool(result.valid[0]) and int(result.tokens[0, 0]) not in banned
