"""The CPU reference backend: docs/semantics.md in torch, written for clarity first.

It is the oracle every CUDA kernel is tested against and the default on machines without a GPU.
The code follows the numbered steps of docs/semantics.md in order:

 1. raw log-probs of the input logits (when asked)
 2-4. masks, logit bias, penalties                 (processing.apply_processing)
 5. NaN/+inf -> -inf, rows with nothing finite are invalid
 6. T == 0: argmax, ties to the lowest index
 7. z = (x - max x) / T and q = softmax(z)
 8. sort by (z desc, index asc); L1 = min(k, #{exp(z_i - max z) >= m}, #finite)
 9. top-p on the renormalised prefix of L1 tokens: L2 tokens kept
10. Gumbel-max over the kept set with the Philox noise of each token
11. processed log-probs over the kept set; top_logprobs in the chosen mode
"""

from __future__ import annotations

import torch

from tokensampler_server.core.request_context import raise_if_abandoned
from tokensampler_server.model.log_probs import log_softmax
from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch, SamplingResult, concat_results, select_rows
from tokensampler_server.backends.base import Backend, BackendInfo, Route
from tokensampler_server.backends.philox import gumbel_noise, gumbel_noise_at
from tokensampler_server.backends.processing import apply_processing, sanitize_non_finite

_NEG_INF = float("-inf")
# Rows whose kept sets are all at most this wide, and under 1/_SPARSE_NOISE_COST of the row, draw noise at the kept
# ids only: a kept id's draw costs about five of the whole row's vectorised draws (160 against 32 ns a token on a
# 2-core host), so rows keeping most of a small vocabulary (V = 4096, no filter) were 5x slower that way.
_SPARSE_NOISE_MAX_KEPT = 4096
_SPARSE_NOISE_COST = 5


def kept_token_mask(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Steps 8 and 9: the kept set K of each row as a bool mask [B, V], on z's device.

    z: float32 [B, V] with max 0 in every row (-inf for masked tokens); top_k int (0 = off),
    top_p float (1 = off), min_p float (0 = off), each [B]. Rows with top-k sort only the tokens that
    can enter their prefix; the others sort the whole row.
    """
    kept = torch.zeros_like(z, dtype=torch.bool)
    with_k = top_k > 0
    for rows, sorted_candidates in ((with_k, top_k_candidates), (~with_k, sorted_row)):
        if bool(rows.any()):
            index = rows.nonzero().squeeze(1)
            z_sorted, order = sorted_candidates(z[index], top_k[index])
            kept[index] = _kept_prefix(z_sorted, order, top_k[index], top_p[index], min_p[index], z.shape[1])
    return kept


def sorted_row(z: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token, sorted by (z descending, id ascending): (z_sorted, ids), both [R, V]."""
    return torch.sort(z, dim=1, descending=True, stable=True)


def top_k_candidates(z: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that can be in a row's top-k prefix — all at or above its k-th largest z, so ties at
    the cut are all there — sorted by (z descending, id ascending); padded with -inf and id V."""
    num_rows, vocab_size = z.shape
    k = top_k.to(torch.int64).clamp(max=vocab_size)  # k >= V keeps every token's candidacy
    kth = torch.topk(z, int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
    candidate = z >= kth
    count = candidate.sum(dim=1)
    row, ids = candidate.nonzero(as_tuple=True)  # row-major: ids ascend within a row
    slot = torch.arange(row.numel(), device=z.device) - (torch.cumsum(count, 0) - count)[row]
    width = int(count.max())
    cand_z = torch.full((num_rows, width), _NEG_INF, dtype=z.dtype, device=z.device)
    cand_ids = torch.full((num_rows, width), vocab_size, dtype=torch.int64, device=z.device)
    cand_z[row, slot] = z[row, ids]
    cand_ids[row, slot] = ids
    z_sorted, perm = torch.sort(cand_z, dim=1, descending=True, stable=True)  # stable: ids stay ascending on ties
    return z_sorted, cand_ids.gather(1, perm)


def _kept_prefix(
    z_sorted: torch.Tensor, order: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """The kept set from tokens sorted by (z desc, id asc): z_sorted and their ids `order`, [R, W]
    (W <= V; ids equal to V are padding). Returns the bool mask [R, V]."""
    num_rows, width = z_sorted.shape
    rank = torch.arange(width, device=z_sorted.device).unsqueeze(0)
    kept_sorted = rank < kept_prefix_count(z_sorted, top_k, top_p, min_p).unsqueeze(1)
    kept = torch.zeros((num_rows, vocab_size + 1), dtype=torch.bool, device=z_sorted.device)  # column V: the padding
    return kept.scatter_(1, order, kept_sorted)[:, :vocab_size]


def kept_prefix_count(
    z_sorted: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
) -> torch.Tensor:
    """Steps 8 and 9 on tokens sorted by (z desc, id asc), z_sorted [R, W] (-inf padding): L2, how many of the
    leading tokens are kept, int64 [R]. The sort may hold only the candidates of the prefix (top_k_candidates,
    or a vocabulary shard's merged candidates) as long as the whole prefix of L1 tokens is among them."""
    width = z_sorted.shape[1]
    finite = torch.isfinite(z_sorted)
    # top-k and min-p both keep a prefix of the sorted order; -inf tokens are never kept.
    limit = finite.sum(dim=1)
    k = top_k.to(torch.int64)
    limit = torch.where(k > 0, torch.minimum(limit, k), limit)
    # max z is 0, so the min-p condition q_i >= m * max q reads exp(z_i) >= m.
    above_min_p = (torch.exp(z_sorted) >= min_p.unsqueeze(1)) & finite
    limit = torch.minimum(limit, above_min_p.sum(dim=1))
    rank = torch.arange(width, device=z_sorted.device).unsqueeze(0)
    in_prefix = rank < limit.unsqueeze(1)
    # top-p over the prefix, renormalised by the prefix's own mass: the running sum over the sorted
    # prefix, divided by its last value (one sequential sum, whatever the row's padding).
    probs = torch.where(in_prefix, torch.exp(z_sorted), torch.zeros((), dtype=z_sorted.dtype))
    running = torch.cumsum(probs, dim=1)
    cumulative = running / running[:, -1:]
    reached = (cumulative >= top_p.unsqueeze(1)) & in_prefix
    # L2 = first rank whose cumulative mass reaches p, plus one; L1 when rounding never reaches it.
    first_reached = torch.where(reached.any(dim=1), reached.to(torch.int8).argmax(dim=1) + 1, limit)
    use_top_p = top_p < 1.0
    return torch.where(use_top_p, torch.minimum(first_reached, limit), limit)


def gumbel_argmax(
    z_kept: torch.Tensor, kept: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor, vocab_offset: int = 0,
) -> torch.Tensor:
    """Step 10 for `rows` of the batch: argmax over the kept set of z + g, for every sample; int64 [R, n], the
    columns of z_kept. Column j is token vocab_offset + j, whose noise it gets (a vocabulary shard's columns).

    When every kept set is small (top-k, spiky top-p), the noise is drawn at the kept ids only: the
    same numbers as the full draw (noise is a pure function of the token id), at a fraction of the cost.
    """
    seed, position, iteration = batch.seed[rows], batch.position[rows], batch.iteration[rows]
    num_kept = kept.sum(dim=1)
    widest = int(num_kept.max())
    out = torch.empty((rows.numel(), batch.num_samples), dtype=torch.int64)
    if widest > _SPARSE_NOISE_MAX_KEPT or _SPARSE_NOISE_COST * widest > z_kept.shape[1]:
        for sample in range(batch.num_samples):
            raise_if_abandoned()  # a sample's noise over a wide row is seconds of work
            noise = gumbel_noise(seed, position, iteration, sample, z_kept.shape[1], vocab_offset)
            out[:, sample] = (z_kept + noise).argmax(dim=1)
        return out
    # The kept ids of each row in ascending order (nonzero is row-major), padded to the widest row:
    # argmax's first maximum is then the lowest id, as in the dense form.
    row, ids = kept.nonzero(as_tuple=True)
    slot = torch.arange(row.numel()) - (torch.cumsum(num_kept, 0) - num_kept)[row]
    kept_ids = torch.zeros((rows.numel(), max(widest, 1)), dtype=torch.int64)
    kept_ids[row, slot] = ids
    scores = torch.full(kept_ids.shape, _NEG_INF)
    scores[row, slot] = z_kept[row, ids]
    for sample in range(batch.num_samples):
        noise = gumbel_noise_at(seed, position, iteration, sample, kept_ids + vocab_offset)
        out[:, sample] = kept_ids.gather(1, (scores + noise).argmax(dim=1, keepdim=True)).squeeze(1)
    return out


def top_n(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest values of each row with their ids, sorted (value desc, id asc)."""
    sorted_values, ids = torch.sort(values, dim=1, descending=True, stable=True)
    return ids[:, :n], sorted_values[:, :n]


# Logits sampled at once: ~0.5 s and ~120 MiB of working memory on the CPU.
_CHUNK_ELEMENTS = 1 << 22


class CpuBackend(Backend):
    """The reference implementation of docs/semantics.md on the CPU."""

    concurrent_calls = True  # torch functions of each call's own tensors; the backend keeps no state

    def info(self) -> BackendInfo:
        route = Route(rows="every row", kernels=(),
                      cost="the torch reference on the CPU: ~0.5 s and ~120 MiB of working memory per 2^22 logits")
        return BackendInfo(name="cpu", device="cpu", routes=[route])

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        """Samples at most _CHUNK_ELEMENTS logits at a time (batch invariance makes the rows independent): the
        working memory stays bounded, and between chunks work whose callers have gone stops."""
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // batch.vocab_size)
        if batch.num_rows <= rows_per_chunk:
            return self._sample(batch.with_logits())
        parts = []
        for start in range(0, batch.num_rows, rows_per_chunk):
            raise_if_abandoned()
            rows = torch.arange(start, min(start + rows_per_chunk, batch.num_rows))
            parts.append(self._sample(select_rows(batch, rows).with_logits()))
        return concat_results(parts)

    def _sample(self, batch: SamplingBatch) -> SamplingResult:
        x = batch.logits.to(torch.float32, copy=True)
        num_rows, vocab_size = x.shape
        wants_logprobs = batch.return_logprobs or batch.top_logprobs > 0
        raw = batch.logprobs_mode is LogprobsMode.RAW

        # 1. Raw log-probs of the input (NaN/+inf read as -inf).
        raw_logprobs = None
        if wants_logprobs and raw:
            raw_logprobs = log_softmax(sanitize_non_finite(x.clone())[0])

        # 2-5. Processing, then non-finite entries. A chunk is one row at least: a row far wider than a chunk's
        # logits takes seconds a step, so work whose callers have gone also stops between steps.
        raise_if_abandoned()
        x = apply_processing(x, batch.processing)
        x, nan_detected = sanitize_non_finite(x)
        valid = torch.isfinite(x).any(dim=1)
        x_max = x.max(dim=1, keepdim=True).values
        x_max = torch.where(valid.unsqueeze(1), x_max, torch.zeros_like(x_max))

        # 6. Greedy rows: argmax, ties to the lowest index (torch.argmax returns the first maximum).
        greedy = batch.temperature == 0
        greedy_tokens = x.argmax(dim=1)

        # 7. z = (x - max x) / T; greedy rows use T = 1 (only their processed log-probs read z).
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        z = (x - x_max) / temperature.unsqueeze(1)
        z = torch.where(valid.unsqueeze(1), z, torch.full_like(z, _NEG_INF))

        # 8-9. Kept set; rows without filters keep every finite token and skip the sort.
        filtered = (batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0)
        kept = torch.isfinite(z)
        if bool(filtered.any()):
            raise_if_abandoned()
            rows = filtered.nonzero().squeeze(1)
            kept[rows] = kept_token_mask(z[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
        z_kept = torch.where(kept, z, torch.full_like(z, _NEG_INF))

        # 10. Gumbel-max over the kept set, one noise draw per sample (greedy rows draw none).
        tokens = greedy_tokens.unsqueeze(1).repeat(1, batch.num_samples)
        sampled = (~greedy & valid).nonzero().squeeze(1)
        if sampled.numel():
            tokens[sampled] = gumbel_argmax(z_kept[sampled], kept[sampled], batch, sampled)
        tokens[~valid] = -1

        # 11. Log-probs in the requested mode.
        logprobs = top_ids = top_values = None
        if wants_logprobs:
            raise_if_abandoned()
            if raw:
                table = raw_logprobs
            else:
                table = log_softmax(z_kept)
            if batch.return_logprobs:
                logprobs = table.gather(1, tokens.clamp(min=0))
                logprobs[~valid] = float("nan")
            if batch.top_logprobs > 0:
                n = min(batch.top_logprobs, vocab_size)
                top_ids, top_values = top_n(table, n)
                top_ids[~valid] = -1
                top_values[~valid] = float("nan")
        return SamplingResult(
            tokens=tokens,
            valid=valid,
            nan_detected=nan_detected,
            logprobs=logprobs,
            top_logprob_ids=top_ids,
            top_logprobs=top_values,
        )
