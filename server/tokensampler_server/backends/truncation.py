"""The local samplers of step 5 (docs/semantics.md L4-L6): top-n-sigma, typical-p and XTC, in torch.

Device-agnostic, like the rest of processing: the CPU reference runs it, and the tests hold the CUDA backend's own
kernels (cuda_local_samplers.py) to it on the GPU. The statistics are float64, so that a cut does not hinge on the
order of a float32 sum; they are accumulated from the float32 logits, and the only float64 rows materialised are the
ones a statistic needs elementwise.
Non-finite entries read as -inf and are left as they are (step 5 flags NaN and +inf); a removed token becomes -inf.

Typical-p keeps one stable float64 sort of its score |log q + H|, the simplest exact order (the kernels cut it by
bins of the score and sort only the cut bin, csrc/local_samplers.cuh):
- a float32 key of the score merges scores that differ in float64 (logits closer than the score's float32 spacing,
  common among 151936 logits), whose order then falls to the id;
- the logits are exact float32 keys, and on either side of the centre (log-sum-exp - H) the score's order is theirs,
  but the two sides interleave by float64 score: putting them back in one order is a second sort-like pass;
- a bisection on the score with exact masses reads the whole row at every step, up to 64 steps for a float64
  threshold.
"""

from __future__ import annotations

import numpy as np
import torch

from tokensampler_server.core.request_context import raise_if_abandoned
from tokensampler_server.model.sampling import Truncation
from tokensampler_server.backends.philox import counter_uniforms

_NEG_INF = float("-inf")
# XTC's coin: counter (0xFFFFFFFE, position, iteration, 0xFFFFFFFF), word 0 (docs/semantics.md L6).
_XTC_BLOCK = 0xFFFFFFFE
_XTC_SAMPLE = 0xFFFFFFFF

Argument = float | torch.Tensor
"""A sampler's value for its rows: one number for all of them, or float64 [R, 1] on the logits' device."""


def _top_n_sigma(work: torch.Tensor, n: Argument) -> torch.Tensor:
    """L4: bool [R, V], true at the tokens below max - n·σ (and perhaps at -inf ones); work float32 [R, V], -inf
    where not finite."""
    finite = torch.isfinite(work)
    count = finite.sum(dim=1, keepdim=True).clamp_(min=1)
    mean = torch.nan_to_num(work, neginf=0.0).sum(dim=1, keepdim=True, dtype=torch.float64) / count
    # x - mean at the finite tokens, exactly 0 elsewhere.
    deviation = torch.where(finite, work, mean).sub_(mean)
    sigma = deviation.square_().sum(dim=1, keepdim=True).div_(count).sqrt_()
    return work < work.amax(dim=1, keepdim=True) - n * sigma


def _typical(work: torch.Tensor, p: Argument) -> torch.Tensor:
    """L5: bool [R, V], true at the tokens outside the typical set (and perhaps at -inf ones)."""
    log_q = torch.log_softmax(work, dim=1, dtype=torch.float64)
    q = log_q.exp()
    # -H: the -inf tokens' 0 · -inf is NaN, and counts 0.
    negative_entropy = (q * log_q).nan_to_num_(nan=0.0).sum(dim=1, keepdim=True)
    score = log_q.sub_(negative_entropy).abs_()  # |-log q - H|; +inf at the -inf tokens
    order = torch.sort(score, dim=1, stable=True).indices  # ties to the lower id
    cumulative = q.gather(1, order).cumsum_(dim=1)
    # The cumulative mass only grows, so the tokens up to the first that exceeds p are those at or below p, and it.
    width = work.shape[1]
    kept_count = (cumulative <= p).sum(dim=1, keepdim=True).add_(1).clamp_(max=width)
    kept_sorted = torch.arange(width, device=work.device) < kept_count
    return ~torch.zeros_like(kept_sorted).scatter_(1, order, kept_sorted)


def _xtc(work: torch.Tensor, threshold: Argument) -> torch.Tensor:
    """L6 for rows whose coin came up: bool [R, V], true at the top choices removed."""
    q = torch.softmax(work, dim=1, dtype=torch.float64)
    above = q >= threshold  # a -inf token's q is 0, below any threshold
    # The one kept: the last of the top choices in (q descending, id ascending), the least likely one; a row with
    # one top choice keeps it, a row with none removes nothing.
    least = torch.where(above, q, float("inf")).amin(dim=1, keepdim=True)
    ids = torch.arange(work.shape[1], device=work.device)
    kept_id = torch.where(q == least, ids, -1).amax(dim=1, keepdim=True)
    return above & (ids != kept_id)


def xtc_coins(truncation: Truncation) -> torch.Tensor:
    """bool [B]: the rows whose XTC acts (u < xtc_probability, u from the coin's own Philox counter); drawn only when
    some row's probability is above 0."""
    if truncation.xtc_acts is not None:
        return truncation.xtc_acts
    probability = truncation.xtc_probability.to(torch.float64)
    if not bool((probability > 0).any()):
        return torch.zeros(probability.shape, dtype=torch.bool)
    u = counter_uniforms(truncation.seed, _XTC_BLOCK, truncation.position, truncation.iteration, _XTC_SAMPLE)
    return (probability > 0) & (u < probability)


def _argument(values: np.ndarray, device: torch.device) -> Argument:
    """One number when every row has the same value (nothing to upload), else float64 [R, 1] on `device`."""
    first = values[0]
    if (values == first).all():
        return float(first)
    return torch.from_numpy(values.astype(np.float64)).to(device, non_blocking=True).unsqueeze(1)


def apply_truncation(x: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """Applies L4-L6, in this order, to float32 logits x [B, V]; rows at the off values are not read. In place where
    it can, so use the returned tensor. Which rows each sampler reads is decided on the host, in numpy (the columns
    are small, and a torch operation costs more to dispatch than numpy's does to run)."""
    device = x.device
    n, p, threshold = truncation.top_n_sigma.numpy(), truncation.typical_p.numpy(), truncation.xtc_threshold.numpy()
    xtc = xtc_coins(truncation).numpy()
    samplers = [(sampler, on, argument) for sampler, on, argument in (
        (_top_n_sigma, n > 0, n), (_typical, p < 1, p), (_xtc, xtc, threshold)) if on.any()]
    if not samplers:
        return x
    active = (n > 0) | (p < 1) | xtc
    every = bool(active.all())
    rows = None if every else torch.from_numpy(np.nonzero(active)[0]).to(device, non_blocking=True)
    source = x if every else x[rows]
    finite = torch.isfinite(source)
    work = torch.where(finite, source, _NEG_INF)
    for sampler, on, argument in samplers:
        raise_if_abandoned()  # each sampler over a wide row is seconds of work on the CPU
        on, argument = on[active], argument[active]
        if on.all():
            work.masked_fill_(sampler(work, _argument(argument, device)), _NEG_INF)
        else:
            local = torch.from_numpy(np.nonzero(on)[0]).to(device, non_blocking=True)
            part = work[local]
            work[local] = part.masked_fill_(sampler(part, _argument(argument[on], device)), _NEG_INF)
    truncated = torch.where(finite, work, source)  # NaN and +inf stay, for step 5 to flag
    if every:
        return truncated
    x[rows] = truncated
    return x
