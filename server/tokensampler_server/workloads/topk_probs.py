"""Top-k probabilities (docs/semantics.md, "Top-k probabilities" and choice 15) in torch.

The reference the fused softmax + top-k kernel is held to: probs = softmax(x / T) over the whole
vocabulary in fp32 (NaN and +inf read as -inf), the k largest with their ids, probability descending and
id ascending on ties. Device-agnostic: it runs where the logits are.
"""

from __future__ import annotations

import torch

from tokensampler_server.core.request_context import raise_if_abandoned

SORT_FRACTION = 4
"""Past k = V / SORT_FRACTION a whole-row sort ranks the tokens: 12 bytes a token, where the top-k cut holds int64
[N, k] several times over (about 44 bytes a row and k); below it the cut is the faster (2.2 s against 10.1 s for 2^26
logits on two CPU cores at k = 1025)."""


def topk_probs(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable ids of every row and their probabilities.

    logits: float32/bfloat16/float16 [N, V] on any device. temperature: float32 [N], every value > 0
    (moved to the logits' device). 1 <= k <= V.
    Returns (probs float32 [N, k], ids int64 [N, k]) on the logits' device, sorted by probability
    descending, then id ascending. A row with no finite logit gets probabilities 0 and ids -1.
    Temporaries: up to k = V / SORT_FRACTION fp32/int32/bool [N, V] and int64 [N, k] (no float64 and no int64
    [N, V] tensor); past it one sort's fp32 and int64 [N, V].
    """
    num_rows, vocab_size = logits.shape
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k = {k} is outside [1, {vocab_size}]")
    device = logits.device
    x = logits.to(torch.float32, copy=True)
    x.masked_fill_(torch.isnan(x) | torch.isposinf(x), float("-inf"))
    valid = torch.isfinite(x).any(dim=1)
    if num_rows == 0:
        return torch.zeros((0, k), dtype=torch.float32, device=device), torch.zeros((0, k), dtype=torch.int64, device=device)

    # z = (x - max x) / T (choice 2); rows with nothing finite use a shift of 0 so they stay -inf, not NaN.
    x_max = x.amax(dim=1, keepdim=True)
    x_max = torch.where(valid.unsqueeze(1), x_max, torch.zeros_like(x_max))
    t = temperature.to(device=device, dtype=torch.float32).unsqueeze(1)
    z = x.sub_(x_max).div_(t)
    probs = z.sub_(torch.logsumexp(z, dim=1, keepdim=True)).exp_()  # in place: one fp32 [N, V] buffer
    probs.masked_fill_(~valid.unsqueeze(1), 0.0)

    raise_if_abandoned()  # the softmax above and the ranking below are each up to seconds on the CPU
    if k * SORT_FRACTION > vocab_size:
        # One stable descending sort ranks every token as the contract does (ties to the lower id): 12 bytes a
        # token, where the cut below holds int64 [N, k] several times over (about 44 bytes a row and k).
        values, ids = torch.sort(probs, dim=1, descending=True, stable=True)
        values, ids = values[:, :k].clone(), ids[:, :k].clone()
        ids.masked_fill_(~valid.unsqueeze(1), -1)
        return values, ids

    # torch.topk fixes the k-th largest value t_k exactly but not which of the ids tied at t_k it returns.
    # Keep every id above t_k (there are fewer than k) and the lowest ids equal to t_k until k are kept.
    kth = torch.topk(probs, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = probs > kth
    at_kth = probs == kth
    ties_needed = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
    tie_rank = torch.cumsum(at_kth.to(torch.int32), dim=1, dtype=torch.int32)  # 1-based among ties, by id
    keep = above | (at_kth & (tie_rank <= ties_needed))
    # Exactly k per row, so the row-major nonzero list reshapes to [N, k] with ids ascending in each row.
    ids = keep.nonzero()[:, 1].view(num_rows, k)
    values = probs.gather(1, ids)
    # A stable descending sort of ids already in ascending order breaks probability ties by the lower id.
    values, order = torch.sort(values, dim=1, descending=True, stable=True)
    ids = ids.gather(1, order)
    ids.masked_fill_(~valid.unsqueeze(1), -1)
    return values, ids
