"""Log-probabilities of float32 rows that do not depend on the rows beside them.

torch splits a float32 reduction over [B, V] on the CPU by B, so a row's float32 sum of exponentials, and its
log-probs with it, changed with the batch it came in (by ~1e-6 at V = 2^20 with top-p). Summed in float64, the
float32 result is the same whatever the batch: the orders' differences stay far below float32's rounding.
"""

from __future__ import annotations

import torch


def log_softmax(z: torch.Tensor) -> torch.Tensor:
    """float32 [B, V] z - log Σ e^z of each row, as (z - max z) - log Σ e^(z - max z), the log rounded to float32
    first: ScoreTokens' streamed sums end the same way, so a token's log-prob is the same from either call. -inf
    entries allowed; a row of them all is NaN, as torch's own."""
    shift = z.amax(dim=1, keepdim=True)
    centred = z - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    return centred - torch.exp(centred).sum(dim=1, keepdim=True, dtype=torch.float64).log().float()
