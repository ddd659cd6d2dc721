"""The local samplers of step 5 (docs/semantics.md L4-L6): top-n-sigma, typical-p and XTC, in torch.

Device-agnostic, like the rest of processing: the CPU reference runs it on the CPU and the CUDA backend on the
GPU. The statistics are float64, so that a cut does not hinge on the order of a float32 sum. Non-finite
entries read as -inf and are left as they are (step 5 flags NaN and +inf); a removed token becomes -inf.
"""

from __future__ import annotations

import torch

from tokensampler_server.model.sampling import Truncation
from tokensampler_server.backends.philox import counter_uniforms

_NEG_INF = float("-inf")
# XTC's coin: counter (0xFFFFFFFE, position, iteration, 0xFFFFFFFF), word 0 (docs/semantics.md L6).
_XTC_BLOCK = 0xFFFFFFFE
_XTC_SAMPLE = 0xFFFFFFFF


def _top_n_sigma(work: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """L4: the finite tokens below max - n·σ, bool [R, V]; work float64 [R, V] (-inf where not finite)."""
    finite = torch.isfinite(work)
    count = finite.sum(dim=1, keepdim=True).clamp(min=1)
    zeroed = torch.where(finite, work, torch.zeros((), dtype=work.dtype, device=work.device))
    mean = zeroed.sum(dim=1, keepdim=True) / count
    deviation = torch.where(finite, work - mean, torch.zeros((), dtype=work.dtype, device=work.device))
    sigma = (deviation.square().sum(dim=1, keepdim=True) / count).sqrt()
    top = work.amax(dim=1, keepdim=True)
    return finite & (work < top - n.unsqueeze(1) * sigma)


def _typical(work: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """L5: the finite tokens outside the typical set, bool [R, V]."""
    finite = torch.isfinite(work)
    log_q = torch.log_softmax(work, dim=1)
    q = log_q.exp()
    entropy = -torch.where(finite, q * log_q, torch.zeros((), dtype=work.dtype, device=work.device)).sum(dim=1, keepdim=True)
    score = torch.where(finite, (-log_q - entropy).abs(), torch.full_like(work, float("inf")))
    order = torch.sort(score, dim=1, stable=True).indices  # ties to the lower id
    cumulative = q.gather(1, order).cumsum(dim=1)
    exceeds = cumulative > p.unsqueeze(1)
    width = work.shape[1]
    kept_count = torch.where(exceeds.any(dim=1), exceeds.to(torch.int8).argmax(dim=1) + 1, width)
    kept_sorted = torch.arange(width, device=work.device).unsqueeze(0) < kept_count.unsqueeze(1)
    kept = torch.zeros_like(finite).scatter_(1, order, kept_sorted)
    return finite & ~kept


def _xtc(work: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """L6 for rows whose coin came up: the top choices removed, bool [R, V]."""
    q = torch.softmax(work, dim=1)
    above = torch.isfinite(work) & (q >= threshold.unsqueeze(1))
    # The one kept: the last of the top choices in (q descending, id ascending), the least likely one.
    least = torch.where(above, q, torch.full_like(q, float("inf"))).amin(dim=1, keepdim=True)
    ids = torch.arange(work.shape[1], device=work.device).expand_as(work)
    kept_id = torch.where(above & (q == least), ids, torch.full_like(ids, -1)).amax(dim=1, keepdim=True)
    several = (above.sum(dim=1) >= 2).unsqueeze(1)
    return several & above & (ids != kept_id)


def xtc_coins(truncation: Truncation) -> torch.Tensor:
    """bool [B]: the rows whose XTC acts (u < xtc_probability, u from the coin's own Philox counter)."""
    probability = truncation.xtc_probability.to(torch.float64)
    u = counter_uniforms(truncation.seed, _XTC_BLOCK, truncation.position, truncation.iteration, _XTC_SAMPLE)
    return (probability > 0) & (u < probability)


def apply_truncation(x: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """Applies L4-L6, in this order, to float32 logits x [B, V] in place; rows at the off values are not read."""
    device = x.device
    n, p = truncation.top_n_sigma, truncation.typical_p
    xtc = xtc_coins(truncation)
    active = (n > 0) | (p < 1) | xtc
    if not bool(active.any()):
        return x
    rows = active.nonzero().squeeze(1)
    rows_d = rows.to(device)
    work = x[rows_d].to(torch.float64)
    work = torch.where(torch.isfinite(work), work, torch.full_like(work, _NEG_INF))
    removed = torch.zeros_like(work, dtype=torch.bool)
    for sampler, on, argument in (
        (_top_n_sigma, n[rows] > 0, n[rows]),
        (_typical, p[rows] < 1, p[rows]),
        (_xtc, xtc[rows], truncation.xtc_threshold[rows]),
    ):
        if bool(on.any()):
            local = on.nonzero().squeeze(1).to(device)
            cut = sampler(work[local], argument[on].to(device=device, dtype=torch.float64))
            removed[local] |= cut
            work[local] = work[local].masked_fill(cut, _NEG_INF)
    x[rows_d] = x[rows_d].masked_fill(removed, _NEG_INF)
    return x
