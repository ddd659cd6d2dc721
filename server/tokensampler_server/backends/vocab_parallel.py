"""Vocabulary-parallel sampling: each shard of the LM head samples its own tokens, and a few small exchanges make
the answer the single-device one (docs/design/vocab-parallel.md).

A shard holds tokens [start, start + V_s) of a vocabulary of V. What the contract needs decomposes over shards:
the row max and argmax, counts and masses (sums), and the Gumbel winner (the max of z_i + g_i, g keyed by the
GLOBAL id, so a shard draws the numbers the single device draws for its tokens). The kept set of top-k / top-p /
min-p is a prefix of the order (z desc, id asc), so a shard needs only the prefix's last token, the boundary: the
merged per-shard candidates give it when the prefix is short, a threshold search over all-reduced counts or
masses when it is long.

Each step is a local block (what a shard computes: a [R, W] tensor) and a merge (what every rank computes from the
N gathered blocks), so that the CUDA backend can compute the blocks with its kernels and reuse the merges;
sample_sharded runs them over a torch.distributed process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch, SamplingResult
from tokensampler_server.resources.weights import RegisteredWeight
from tokensampler_server.backends.cpu import gumbel_argmax, kept_prefix_count, top_k_candidates
from tokensampler_server.backends.philox import gumbel_noise_at
from tokensampler_server.backends.processing import sanitize_non_finite

_NEG_INF = float("-inf")
_F64 = torch.float64
# The order key of no token: padding, and the tokens a search does not count.
_PAD_KEY = torch.iinfo(torch.int64).max
# Candidates per shard and row: a kept prefix of at most this many tokens is found from the merged candidates.
CANDIDATES = 64
# Split points each shard sends in a search round: its quantiles of the keys left in the range.
_QUANTILES = 32
# A range holding at most this many tokens over all shards is gathered and finished in one exchange. With
# _QUANTILES, two rounds reach it from about 165,000 tokens.
_FINISH = 160


class ShardExchangeError(RuntimeError):
    """A vocabulary-parallel call failed on some rank: a shard's own step raised, or a shard stalled past the
    group's timeout or died. The call has no answer on any rank."""


@dataclass(frozen=True)
class Shard:
    """This rank's tokens: [start, start + the width of its logits) of a vocabulary of vocab_size tokens."""

    start: int
    vocab_size: int


def shard_head(head: RegisteredWeight, start: int, stop: int) -> RegisteredWeight:
    """Rows start..stop-1 of a registered head as a head of its own, with the same finish (bias, scale, soft cap):
    hidden states through it give a shard's columns of the whole head's logits."""
    finish = head.finish
    bias = None if finish.bias is None else finish.bias[start:stop]
    return RegisteredWeight(name=f"{head.name}[{start}:{stop}]", weight=head.weight[start:stop],
                            finish=replace(finish, vocab_size=stop - start, bias=bias), sha256="")


class Exchange:
    """The collectives of one call. Every payload carries one failure flag per rank: a rank whose local step
    raised still joins the collective it was due at, flagged, so the others fail at once naming it instead of
    waiting for the group's timeout (and the group stays usable: every rank ran the same collectives).

    The blocks are computed on the CPU; over an NCCL group each payload crosses on this rank's current CUDA device
    (NCCL moves device memory only) and comes back to the CPU for the merges."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        nccl = dist.get_backend(group) == dist.Backend.NCCL
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def gather(self, stage: str, shape: tuple[int, ...], dtype: torch.dtype,
               compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Every rank's block, [N, *shape], in rank order."""
        return self._run(stage, shape, dtype, compute, gather=True)

    def reduce(self, stage: str, shape: tuple[int, ...], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The sum of every rank's float64 block, [*shape]."""
        return self._run(stage, shape, _F64, compute, gather=False)

    def _run(self, stage: str, shape: tuple[int, ...], dtype: torch.dtype, compute: Callable[[], torch.Tensor],
             gather: bool) -> torch.Tensor:
        failure: Exception | None = None
        try:
            local = compute()
            if tuple(local.shape) != shape:
                raise ValueError(f"a block of shape {list(local.shape)}, expected {list(shape)}")
        except Exception as err:  # reported to the other ranks first, then raised here
            failure, local = err, torch.zeros(shape, dtype=dtype)
        flags = torch.zeros(self.world, dtype=dtype)
        flags[self.rank] = failure is not None
        payload = torch.cat([local.reshape(-1).to(dtype), flags]).to(self.device)
        started = time.monotonic()
        try:
            if gather:
                parts = [torch.empty_like(payload) for _ in range(self.world)]
                dist.all_gather(parts, payload, group=self.group)
                out = torch.stack(parts).cpu()
            else:
                dist.all_reduce(payload, group=self.group)
                out = payload.cpu()
        except RuntimeError as err:
            raise ShardExchangeError(
                f"vocabulary-parallel exchange '{stage}' failed on rank {self.rank} of {self.world} after "
                f"{time.monotonic() - started:.1f} s: a shard stalled past the group's timeout or died ({err}). "
                "The group cannot be used again: destroy it and build a new one") from err
        if failure is not None:
            raise ShardExchangeError(f"vocabulary-parallel step '{stage}' failed on this shard (rank {self.rank}): "
                                     f"{failure}") from failure
        failed = (out.reshape(-1, payload.numel())[:, -self.world:].sum(0) != 0).nonzero().flatten().tolist()
        if failed:
            raise ShardExchangeError(f"vocabulary-parallel step '{stage}' failed on rank(s) {failed} of {self.world} "
                                     "(their own errors say why); the group is still usable")
        body = out[..., :-self.world]
        return body.reshape((self.world, *shape)) if gather else body.reshape(shape)


# ---- local blocks ---------------------------------------------------------------------------------------------

def order_keys(z: torch.Tensor, start: int) -> torch.Tensor:
    """int64 keys whose ascending order is the contract's (z desc, id asc): the bits of -z (z <= 0, so -z >= 0
    and its bits order as it does) above the global id. Non-finite tokens get _PAD_KEY."""
    negated = (0.0 - z).contiguous()  # 0 - z: +0.0 for z = 0 and -0.0 alike, so equal z get equal bits
    ids = torch.arange(start, start + z.shape[1], dtype=torch.int64)
    keys = (negated.view(torch.int32).to(torch.int64) << 32) | ids
    return torch.where(torch.isfinite(z), keys, torch.full_like(keys, _PAD_KEY))


def _leading(values: torch.Tensor, start: int, vocab_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` tokens of a shard by (value desc, id asc): (values, global ids), [R, width], padded
    with (-inf, vocab_size) where the shard has fewer tokens."""
    rows, shard_width = values.shape
    if width == 0:
        return values.new_empty((rows, 0)), torch.empty((rows, 0), dtype=torch.int64)
    leading, columns = top_k_candidates(values, torch.full((rows,), width))
    leading, columns = leading[:, :width], columns[:, :width]
    ids = torch.where(columns < shard_width, columns + start, vocab_size)
    missing = width - leading.shape[1]
    return (torch.nn.functional.pad(leading, (0, missing), value=_NEG_INF),
            torch.nn.functional.pad(ids, (0, missing), value=vocab_size))


def stats_block(x: torch.Tensor, start: int, nan_detected: torch.Tensor) -> torch.Tensor:
    """[R, 4]: the shard's max logit, its first argmax's global id, whether any logit is finite, whether it read
    NaN/+inf. x: the shard's sanitized float32 logits."""
    return torch.stack([x.max(dim=1).values.to(_F64), (x.argmax(dim=1) + start).to(_F64),
                        torch.isfinite(x).any(dim=1).to(_F64), nan_detected.to(_F64)], dim=1)


def draw_block(z: torch.Tensor, xm: torch.Tensor, kept: torch.Tensor, start: int, vocab_size: int,
               batch: SamplingBatch, rows: torch.Tensor, top_width: int) -> torch.Tensor:
    """A shard's part of steps 10-11 for `rows` of the batch, whose kept tokens among the shard's are `kept`:
    [R, 1 + 4n + 2 top_width] = the kept mass sum exp(z); per sample the best z + g with its global id, its z and
    its x - max x; the first top_width tokens by (z if kept else -inf desc, id asc), value and id."""
    z_kept = torch.where(kept, z, _NEG_INF)
    mass = torch.where(kept, torch.exp(z).to(_F64), 0.0).sum(dim=1, keepdim=True)
    columns = gumbel_argmax(z_kept, kept, batch, rows, vocab_offset=start)
    ids = columns + start
    seed, position, iteration = batch.seed[rows], batch.position[rows], batch.iteration[rows]
    # The winner's key again (noise is a pure function of the id), for the merge to compare across shards.
    keys = torch.cat([z_kept.gather(1, columns[:, s:s + 1])
                      + gumbel_noise_at(seed, position, iteration, s, ids[:, s:s + 1])
                      for s in range(batch.num_samples)], dim=1)
    winners = torch.stack([keys, ids, z.gather(1, columns), xm.gather(1, columns)], dim=2).flatten(1)
    top_values, top_ids = _leading(z_kept, start, vocab_size, top_width)
    return torch.cat([mass, winners.to(_F64), top_values.to(_F64), top_ids.to(_F64)], dim=1)


def _empty_draw(rows: int, num_samples: int, top_width: int, vocab_size: int) -> torch.Tensor:
    """draw_block's layout for rows with nothing to draw: no mass, no winner, no top tokens."""
    winner = torch.tensor([_NEG_INF, vocab_size, 0.0, 0.0], dtype=_F64).repeat(num_samples)
    top = torch.cat([torch.full((top_width,), _NEG_INF, dtype=_F64), torch.full((top_width,), vocab_size, dtype=_F64)])
    return torch.cat([torch.zeros(1, dtype=_F64), winner, top]).expand(rows, -1)


def search_counts(keys: torch.Tensor, cumulative: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """[2, R, P]: how many of a shard's sorted keys are <= each point, and their weight. cumulative: [R, W + 1],
    the running weight of the sorted keys from 0."""
    at = torch.searchsorted(keys, points.contiguous(), right=True)
    return torch.stack([at.to(_F64), cumulative.gather(1, at)])


# ---- merges ---------------------------------------------------------------------------------------------------

def _order(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The permutation of each row that sorts it by (value desc, id asc)."""
    by_id = ids.argsort(dim=1, stable=True)
    return by_id.gather(1, values.gather(1, by_id).argsort(dim=1, descending=True, stable=True))


def _best(keys: torch.Tensor, ids: torch.Tensor, dim: int) -> torch.Tensor:
    """The index along dim of the largest key, ties to the lowest id (the contract's argmax)."""
    at_top = keys == keys.amax(dim=dim, keepdim=True)
    return torch.where(at_top, ids.to(_F64), float("inf")).argmin(dim=dim)


def merge_top(values: torch.Tensor, ids: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` of the shards' leading lists [N, R, width] by (value desc, id asc): every shard sent its
    own first `width`, so the global first `width` are among them."""
    values, ids = values.permute(1, 0, 2).flatten(1), ids.permute(1, 0, 2).flatten(1)
    order = _order(values, ids)[:, :width]
    return values.gather(1, order), ids.gather(1, order)


def merge_draw(blocks: torch.Tensor, num_samples: int, top_width: int) -> dict[str, torch.Tensor]:
    """draw_block's blocks of N shards, [N, R, W], merged: the kept mass, per sample the winning id with its z and
    x - max x, and the top_width leading (z, id)."""
    wins = blocks[..., 1:1 + 4 * num_samples].unflatten(-1, (num_samples, 4))  # [N, R, n, 4]
    pick = _best(wins[..., 0], wins[..., 1], dim=0).unsqueeze(0).unsqueeze(-1).expand(1, *wins.shape[1:])
    winner = wins.gather(0, pick).squeeze(0)
    top = blocks[..., 1 + 4 * num_samples:]
    top_values, top_ids = merge_top(top[..., :top_width], top[..., top_width:], top_width)
    return {"mass": blocks[..., 0].sum(0), "token": winner[..., 1].long(), "z": winner[..., 2],
            "xm": winner[..., 3], "top_values": top_values, "top_ids": top_ids.long()}


def _with_tail(values: torch.Tensor, ids: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` of the kept tokens (values [R, W], -inf where not kept, in order) followed by the lowest
    ids outside the kept set at -inf (choice 12), from merged candidates."""
    rows, candidates = ids.shape
    span = width + candidates  # holds at least `width` ids outside any kept set of at most `candidates`
    kept = torch.isfinite(values)
    marked = torch.zeros((rows, span + 1), dtype=torch.bool)
    marked.scatter_(1, torch.where(kept, ids, span).clamp(max=span), True)
    free = torch.arange(span).expand(rows, span)
    tail = torch.where(marked[:, :span], span + free, free).sort(dim=1).values[:, :width]  # kept ids sort last
    all_values = torch.cat([values, torch.full((rows, width), _NEG_INF, dtype=values.dtype)], dim=1)
    all_ids = torch.cat([torch.where(kept, ids, span + width), tail], dim=1)
    order = _order(all_values, all_ids)[:, :width]
    return all_values.gather(1, order), all_ids.gather(1, order)


# ---- the threshold search -------------------------------------------------------------------------------------

def _quantiles(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, count: int) -> torch.Tensor:
    """[R, count]: the shard's own keys that split its sorted keys in [lo, hi] into count + 1 equal parts (hi
    where it has none there)."""
    first = torch.searchsorted(keys, lo.unsqueeze(1))
    inside = torch.searchsorted(keys, hi.unsqueeze(1), right=True) - first
    at = first + inside * torch.arange(1, count + 1) // (count + 1)
    return torch.where(inside > 0, keys.gather(1, at.clamp(max=keys.shape[1] - 1)), hi.unsqueeze(1))


def threshold_search(exchange: Exchange, stage: str, keys: torch.Tensor, weights: torch.Tensor,
                     target: torch.Tensor | None = None, fraction: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the smallest key tau of any shard with G(tau) >= target, where G(tau) is the weight of every
    shard's keys <= tau: with unit weights the target-th token of the order, with weights exp(z) the token where
    the running mass reaches the target. target is given, or is `fraction` of the weight of every counted key
    (the others are _PAD_KEY).

    Exact: the answer stays in [lo, hi], with G(lo - 1) < target <= G(hi). A round gathers each shard's
    _QUANTILES quantiles of its keys in [lo, hi] and all-reduces G at all of them; the piece where G first
    reaches the target holds at most 1/(_QUANTILES + 1) of each shard's keys there plus one, whatever the data and
    its ties. Once every row's piece holds at most _FINISH keys, one gather of them with their weights gives G at
    each, from G(lo - 1) on. Two rounds (5 exchanges) up to about 165,000 tokens."""
    rows = keys.shape[0]
    keys, order = keys.sort(dim=1)
    weights = weights.to(_F64).gather(1, order)
    cumulative = torch.cat([torch.zeros((rows, 1), dtype=_F64), weights.cumsum(1)], dim=1)
    lo = torch.zeros(rows, dtype=torch.int64)
    hi = torch.full((rows,), _PAD_KEY - 1)
    while True:
        split = exchange.gather(stage, (rows, _QUANTILES), torch.int64, lambda: _quantiles(keys, lo, hi, _QUANTILES))
        pivots = split.permute(1, 0, 2).flatten(1).sort(dim=1).values
        points = torch.cat([(lo - 1).unsqueeze(1), pivots, hi.unsqueeze(1)], dim=1)
        count, mass = exchange.reduce(stage, (2, *points.shape), lambda: search_counts(keys, cumulative, points))
        if target is None:
            target = fraction.to(_F64) * mass[:, -1]
        piece = (mass[:, 1:] >= target.unsqueeze(1)).to(torch.int8).argmax(dim=1, keepdim=True)
        below = mass.gather(1, piece).squeeze(1)  # G(lo - 1) of the new piece
        lo, hi = points.gather(1, piece).squeeze(1) + 1, points.gather(1, piece + 1).squeeze(1)
        if bool((count.gather(1, piece + 1) - count.gather(1, piece) <= _FINISH).all()):
            break
    width = keys.shape[1]
    take = torch.searchsorted(keys, lo.unsqueeze(1)) + torch.arange(_FINISH)
    at = take.clamp(max=width - 1)
    inside = (take < width) & (keys.gather(1, at) <= hi.unsqueeze(1))
    # Keys and the bits of their float64 weights in one int64 block.
    local = torch.stack([torch.where(inside, keys.gather(1, at), _PAD_KEY),
                         torch.where(inside, weights.gather(1, at), 0.0).view(torch.int64)])
    found = exchange.gather(stage, (2, rows, _FINISH), torch.int64, lambda: local)
    union, union_weights = (found[:, part].permute(1, 0, 2).flatten(1) for part in (0, 1))
    union, order = union.sort(dim=1)
    running = below.unsqueeze(1) + union_weights.contiguous().view(_F64).gather(1, order).cumsum(1)
    real = union != _PAD_KEY
    hit = (running >= target.unsqueeze(1)) & real
    # Where rounding leaves the running weight short of the target, the last key: G(hi) reaches it.
    pick = torch.where(hit.any(dim=1), hit.to(torch.int8).argmax(dim=1), real.sum(dim=1) - 1)
    return union.gather(1, pick.unsqueeze(1)).squeeze(1)


# ---- the driver -----------------------------------------------------------------------------------------------

def _shard_logits(batch: SamplingBatch, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's float32 logits [B, V_s], NaN/+inf read as -inf (step 5), and the rows that held them."""
    if batch.processing is not None:
        raise ValueError("vocabulary-parallel sampling takes requests without processing (masks, bias, penalties, "
                         "local samplers); apply them to the logits first")
    x = batch.with_logits().logits.to("cpu", torch.float32, copy=True)
    fits = 0 <= shard.start and 1 <= x.shape[-1] and shard.start + x.shape[-1] <= shard.vocab_size
    if x.dim() != 2 or x.shape[0] != batch.num_rows or not fits:
        raise ValueError(f"logits of shape {list(x.shape)} at token {shard.start} do not fit {batch.num_rows} rows "
                         f"of a vocabulary of {shard.vocab_size}")
    return sanitize_non_finite(x)


def _check_tiling(headers: torch.Tensor) -> None:
    """Every rank sent the same request and the shards tile [0, V) in some order, or every rank raises."""
    if not bool((headers[:, 2:] == headers[0, 2:]).all()):
        raise ShardExchangeError("the ranks sampled different requests: (V, B, samples, top log-probs, raw, "
                                 f"candidates) = {headers[:, 2:].tolist()}")
    starts, widths = headers[:, 0], headers[:, 1]
    order = starts.argsort()
    ends = (starts + widths)[order]
    if not (starts[order][0] == 0 and bool((starts[order][1:] == ends[:-1]).all()) and ends[-1] == headers[0, 2]):
        raise ShardExchangeError(f"the shards (start, width) = {headers[:, :2].tolist()} do not tile a vocabulary "
                                 f"of {int(headers[0, 2])}")


def sample_sharded(batch: SamplingBatch, shard: Shard, group: dist.ProcessGroup | None = None,
                   candidates: int = CANDIDATES) -> SamplingResult:
    """Samples `batch` with this rank holding the shard's logits (batch.logits [B, V_s], or hidden states through
    shard_head's head) and the other ranks of `group` theirs: every rank returns what the single-device reference
    returns for the whole vocabulary. Every rank passes the same request parameters and its own shard.

    A failure anywhere raises ShardExchangeError on every rank: at once when a rank's own step raised, after the
    group's timeout when a rank stalled, when its connections close when it died. Requests with processing (masks,
    bias, penalties, local samplers: steps 2-5) are refused."""
    exchange = Exchange(group)
    rows, num_samples, vocab = batch.num_rows, batch.num_samples, shard.vocab_size
    raw = batch.logprobs_mode is LogprobsMode.RAW
    top_width = min(batch.top_logprobs, vocab)
    processed = (batch.return_logprobs or top_width > 0) and not raw
    header = torch.tensor([shard.start, 0, vocab, rows, num_samples, top_width, raw, candidates], dtype=_F64)
    x = nan_local = torch.empty(0)

    def stats() -> torch.Tensor:
        nonlocal x, nan_local
        x, nan_local = _shard_logits(batch, shard)
        header[1] = x.shape[1]
        return torch.cat([header, stats_block(x, shard.start, nan_local).flatten()])

    # Exchange 1: the row max (z = (x - max x) / T rounds as on one device only with the global max), the greedy
    # token, validity and the NaN flag.
    gathered = exchange.gather("stats", (header.numel() + 4 * rows,), _F64, stats)
    _check_tiling(gathered[:, :header.numel()])
    local_max, argmax, finite, nan = gathered[:, header.numel():].unflatten(1, (rows, 4)).unbind(-1)
    valid, nan_detected = (finite > 0).any(0), (nan > 0).any(0)
    row_max = local_max.amax(0)
    at_max = (local_max == row_max) & (finite > 0)
    greedy_token = torch.where(at_max, argmax, float("inf")).amin(0).nan_to_num(posinf=0).long()
    row_max = torch.where(valid, row_max, 0.0).to(torch.float32).unsqueeze(1)

    greedy = batch.temperature == 0
    sampled = ~greedy & valid
    if not bool(sampled.any()) and not (batch.return_logprobs or top_width > 0):
        tokens = torch.where(valid, greedy_token, -1).unsqueeze(1).repeat(1, num_samples)
        return SamplingResult(tokens=tokens, valid=valid, nan_detected=nan_detected)  # greedy: one exchange
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)  # choice 6
    xm = x - row_max
    z = xm / temperature.unsqueeze(1)
    filtered = (batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0)
    needs_kept = valid & filtered & (sampled | processed)
    direct = valid & ~filtered & (sampled | processed)  # kept set: every finite token, known to each shard
    width = candidates if bool(needs_kept.any()) else 0
    p_width, r_width = (top_width, 0) if processed else (0, top_width)
    draw_width = 1 + 4 * num_samples + 2 * p_width

    passes = torch.isfinite(z) & (torch.exp(z) >= batch.min_p.unsqueeze(1))  # min-p, with max z = 0

    def partials() -> torch.Tensor:
        sums = torch.stack([passes.sum(1).to(_F64), torch.where(passes, torch.exp(z).to(_F64), 0.0).sum(1),
                            torch.exp(xm).to(_F64).sum(1)], dim=1)
        cand_z, cand_ids = _leading(z, shard.start, vocab, width)
        cand_xm = xm.gather(1, (cand_ids - shard.start).clamp(0, x.shape[1] - 1))
        draw = _empty_draw(rows, num_samples, p_width, vocab).clone()
        if bool(direct.any()):
            index = direct.nonzero().squeeze(1)
            draw[index] = draw_block(z[index], xm[index], torch.isfinite(z[index]), shard.start, vocab, batch,
                                     index, p_width)
        raw_values, raw_ids = _leading(xm, shard.start, vocab, r_width)
        return torch.cat([sums, cand_z.to(_F64), cand_xm.to(_F64), cand_ids.to(_F64), draw,
                          raw_values.to(_F64), raw_ids.to(_F64)], dim=1)

    # Exchange 2: counts and masses, the candidates, the draw of rows that keep every finite token, and the
    # raw top log-probs.
    block = exchange.gather("partials", (rows, 3 + 3 * width + draw_width + 2 * r_width), _F64, partials)
    sums, cand, draw, raw_top = block.split([3, 3 * width, draw_width, 2 * r_width], dim=-1)
    num_passing, passing_mass, raw_sum = sums.sum(0).unbind(-1)
    cand_z, cand_xm, cand_ids = (part.permute(1, 0, 2).flatten(1) for part in cand.tensor_split(3, dim=-1))
    order = _order(cand_z, cand_ids)
    cand_z, cand_xm, cand_ids = cand_z.gather(1, order), cand_xm.gather(1, order), cand_ids.gather(1, order).long()
    direct_draw = merge_draw(draw, num_samples, p_width)

    tokens = greedy_token.unsqueeze(1).repeat(1, num_samples)
    token_z = torch.zeros((rows, num_samples), dtype=_F64)  # greedy rows: z = 0 and x - max x = 0 at the argmax
    token_xm = torch.zeros((rows, num_samples), dtype=_F64)
    norm = torch.zeros(rows, dtype=_F64)  # log of the kept mass: the processed log-probs' normaliser
    p_values = torch.full((rows, p_width), _NEG_INF, dtype=_F64)
    p_ids = torch.full((rows, p_width), vocab, dtype=torch.int64)

    def take(index: torch.Tensor, drawn: dict[str, torch.Tensor], log_mass: torch.Tensor) -> None:
        draws = sampled[index]
        tokens[index[draws]] = drawn["token"][draws]
        token_z[index[draws]], token_xm[index[draws]] = drawn["z"][draws], drawn["xm"][draws]
        norm[index] = log_mass
        p_values[index], p_ids[index] = drawn["top_values"], drawn["top_ids"]

    index = direct.nonzero().squeeze(1)
    take(index, {name: value[index] for name, value in direct_draw.items()}, direct_draw["mass"][index].log())

    # Kept sets: L1 = min(k, #passing min-p) leading tokens, then top-p's L2 <= L1.
    top_k = batch.top_k.to(torch.int64)
    limit = torch.where(top_k > 0, torch.minimum(top_k, num_passing.long()), num_passing.long())
    narrow = needs_kept & (limit <= width)  # every shard's share of the prefix is among its candidates
    bounded = (top_k > 0) & (top_k < num_passing.long())  # the prefix ends at the k-th token, not where min-p does
    kept_count = torch.zeros(rows, dtype=torch.int64)
    if bool(narrow.any()):
        at = narrow.nonzero().squeeze(1)
        kept_count[at] = kept_prefix_count(cand_z[at].to(torch.float32), batch.top_k[at], batch.top_p[at],
                                           batch.min_p[at])
    nucleus = torch.zeros_like(narrow)
    if width:
        # A nucleus inside the global top candidates: the merged candidates' first `width` are the global first.
        running = torch.exp(cand_z[:, :width].to(torch.float32)).to(_F64).cumsum(1)
        reached = running >= (batch.top_p.to(_F64) * passing_mass).unsqueeze(1)
        nucleus = needs_kept & ~narrow & ~bounded & (batch.top_p < 1) & reached.any(1)
        kept_count = torch.where(nucleus, reached.to(torch.int8).argmax(1) + 1, kept_count)
    resolved = narrow | nucleus
    if bool(resolved.any()):
        index = resolved.nonzero().squeeze(1)
        take(index, *_draw_candidates(cand_z[index], cand_ids[index], cand_xm[index], kept_count[index], batch,
                                      index, p_width))

    wide = needs_kept & ~resolved
    if bool(wide.any()):
        index = wide.nonzero().squeeze(1)
        kept = _searched_kept(exchange, z[index], passes[index], shard.start, top_k[index], bounded[index],
                              batch.top_p[index])
        # Exchange 3: the draw over the kept tokens of rows whose boundary was searched.
        wide_draw = merge_draw(exchange.gather(
            "draw", (index.numel(), draw_width), _F64,
            lambda: draw_block(z[index], xm[index], kept, shard.start, vocab, batch, index, p_width)),
            num_samples, p_width)
        take(index, wide_draw, wide_draw["mass"].log())

    tokens[~valid] = -1
    logprobs = top_ids = top_values = None
    shift = raw_sum.log().unsqueeze(1) if raw else norm.unsqueeze(1)
    if batch.return_logprobs:
        logprobs = ((token_xm if raw else token_z) - shift).to(torch.float32)
        logprobs[~valid] = float("nan")
    if top_width > 0:
        if raw:
            values, ids = merge_top(raw_top[..., :r_width], raw_top[..., r_width:], r_width)
        else:
            values, ids = p_values, p_ids
        values = (values - shift).to(torch.float32)
        # Ties after the subtraction go to the lower id, as when the table itself is sorted.
        order = _order(values, ids)
        top_values, top_ids = values.gather(1, order), ids.gather(1, order).long()
        top_ids[~valid] = -1
        top_values[~valid] = float("nan")
    return SamplingResult(tokens=tokens, valid=valid, nan_detected=nan_detected, logprobs=logprobs,
                          top_logprob_ids=top_ids, top_logprobs=top_values)


def _searched_kept(exchange: Exchange, z: torch.Tensor, passes: torch.Tensor, start: int, top_k: torch.Tensor,
                   bounded: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The shard's kept tokens, bool [R, V_s], of rows whose prefix is longer than the candidates: the prefix is the
    tokens passing min-p, cut at the k-th by a count search where k binds (`bounded`); top-p then cuts it where its
    running mass reaches p of its whole mass, by a mass search."""
    keys = torch.where(passes, order_keys(z, start), _PAD_KEY)
    boundary = torch.full((z.shape[0],), _PAD_KEY)
    if bool(bounded.any()):
        boundary[bounded] = threshold_search(exchange, "top-k boundary", keys[bounded],
                                             torch.ones(keys[bounded].shape, dtype=_F64),
                                             target=top_k[bounded].to(_F64))
        keys = torch.where(keys <= boundary.unsqueeze(1), keys, _PAD_KEY)
    with_p = top_p < 1
    if bool(with_p.any()):
        boundary[with_p] = threshold_search(exchange, "top-p boundary", keys[with_p], torch.exp(z[with_p]).to(_F64),
                                            fraction=top_p[with_p])
    return (keys != _PAD_KEY) & (keys <= boundary.unsqueeze(1))


def _draw_candidates(cand_z: torch.Tensor, cand_ids: torch.Tensor, cand_xm: torch.Tensor, kept_count: torch.Tensor,
                     batch: SamplingBatch, rows: torch.Tensor,
                     top_width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Steps 10-11 for rows whose kept set is the first kept_count merged candidates: every rank computes them
    alike, with no further exchange (the noise of a candidate is a pure function of its global id)."""
    kept = torch.arange(cand_z.shape[1]) < kept_count.unsqueeze(1)
    z_kept = torch.where(kept, cand_z.to(torch.float32), _NEG_INF)
    seed, position, iteration = batch.seed[rows], batch.position[rows], batch.iteration[rows]
    picks = []
    for sample in range(batch.num_samples):
        keys = z_kept + gumbel_noise_at(seed, position, iteration, sample, cand_ids)
        picks.append(_best(keys, cand_ids, dim=1))
    pick = torch.stack(picks, dim=1)
    top_values, top_ids = _with_tail(z_kept.to(_F64), cand_ids, top_width)
    drawn = {"token": cand_ids.gather(1, pick), "z": cand_z.gather(1, pick), "xm": cand_xm.gather(1, pick),
             "top_values": top_values, "top_ids": top_ids}
    return drawn, torch.logsumexp(z_kept, dim=1).to(_F64)
