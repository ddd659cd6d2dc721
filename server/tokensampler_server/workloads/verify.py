"""Speculative-decoding verification (docs/semantics.md, choice 16) in torch: the reference.

A draft model proposed tokens d_0..d_{n-1} with distributions p_0..p_{n-1}; the target model gave
logits at the n draft positions and the next one. For each row:

- q_j, the target distribution at position j, is what Sample would draw from there: steps 2-9 with
  the row's parameters, renormalised over the kept set (one-hot at the argmax for T = 0).
- Draft token j is accepted when u_j * p_j(d_j) < q_j(d_j), u_j from the Philox word of counter
  (0xFFFFFFFF, position + j, iteration, 0xFFFFFFFF), word 0: a probability of min(1, q/p).
- At the first rejection j the correction is the Gumbel-max of log max(0, q_j - p_j) with the noise of
  position + j, sample 0 (of log q_j if that residual is all zero); when all n are accepted the bonus
  is drawn from q_n exactly as Sample draws at position + n.

Choices the contract leaves open, made here:

- The acceptance test is exact: p and q are float32 (as every backend computes them), u has 25
  significant bits and p 24, so u * p is exact in float64 and the comparison has no rounding.
- A row with no finite target logit at any of its n + 1 positions (after processing) is not valid:
  accepted 0 and tokens all -1. Other rows are unaffected.
- Philox positions position + j wrap modulo 2^32 (the counter word is 32 bits).
- `processing` applies to every position of a row alike: the history is the request's, not extended
  by the draft tokens; the XTC coin at position j is the one Sample draws at position + j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokensampler_server.core.request_context import raise_if_abandoned
from tokensampler_server.backends.cpu import kept_token_mask
from tokensampler_server.backends.philox import counter_uniforms, gumbel_noise
from tokensampler_server.backends.processing import apply_processing, sanitize_non_finite
from tokensampler_server.model.sampling import LogitProcessing, RowSampling
from tokensampler_server.workloads.diffusion import entries_per_request, expand_processing

_MASK32 = 0xFFFFFFFF
_CHUNK_ELEMENTS = 1 << 22
"""Logits, and token-list copies, processed at once (16 MiB of fp32 logits; 64 MiB of copies)."""
_NEG_INF = float("-inf")


@dataclass(frozen=True, kw_only=True)
class DraftVerification(RowSampling):
    """One batch of B rows to verify, n >= 1 draft tokens each, every tensor on the CPU.

    The per-row parameters are the target's, as in `SamplingBatch`; `position` is the Philox position of draft
    token 0, and `processing` (steps 2-4) applies to the target logits at every position.
    """

    draft_ids: torch.Tensor
    """int64 [B, n], each in [0, V)."""
    draft_probs: torch.Tensor
    """float32 [B, n, V], >= 0 with a positive sum per position; renormalised here. (The caller turns
    draft logits into probabilities with softmax.)"""
    target_logits: torch.Tensor
    """[B, n + 1, V] float32/bfloat16/float16; arithmetic in float32."""


def acceptance_uniforms(seed: torch.Tensor, position: torch.Tensor, iteration: torch.Tensor) -> torch.Tensor:
    """The u of the acceptance test at Philox `position`: float64, the broadcast shape of the inputs.

    seed, position, iteration: int64, broadcastable. Counter (0xFFFFFFFF, position, iteration,
    0xFFFFFFFF) under the seed's key, word 0 -- a block index and a sample index that no token's noise
    uses -- with u kept exact (philox.counter_uniforms).
    """
    return counter_uniforms(seed, _MASK32, position, iteration, _MASK32)


def _processed(v: DraftVerification) -> torch.Tensor:
    """Steps 2-5 at every target position: float32 [B, n + 1, V], position j of row b processed as Sample processes
    it at position + j (with its own XTC coin).

    Positions are processed a chunk at a time, the request's processing copied to each row of the chunk (diffusion's
    expand_processing): as many positions as keep a chunk within _CHUNK_ELEMENTS logits and as many token-list
    copies. One position at a time cost 2-9 ms a position with every local sampler on, whatever V: 4096 positions of
    two logits held the worker 9-18 s of CPU for a 49 KB request."""
    num_rows, num_positions, vocab_size = v.target_logits.shape
    x = torch.empty((num_rows, num_positions, vocab_size), dtype=torch.float32, device=v.target_logits.device)
    if v.processing is None:
        return x.copy_(v.target_logits)
    entries = int(entries_per_request(v.processing, num_rows).sum())  # copied once a position
    chunk = max(1, min(num_positions, _CHUNK_ELEMENTS // (num_rows * vocab_size), _CHUNK_ELEMENTS // max(1, entries)))
    first_positions = v.position.cpu()
    for start in range(0, num_positions, chunk):
        raise_if_abandoned()  # a chunk's processing is up to seconds of work on the CPU
        stop = min(start + chunk, num_positions)
        block = torch.empty((num_rows, stop - start, vocab_size), dtype=torch.float32, device=x.device)
        block.copy_(v.target_logits[:, start:stop])
        processing = _at_positions(v.processing, first_positions, start, stop)
        x[:, start:stop] = apply_processing(block.view(-1, vocab_size), processing).view_as(block)
    return x


def _at_positions(processing: LogitProcessing, first_positions: torch.Tensor, start: int,
                  stop: int) -> LogitProcessing:
    """The processing of rows (b, j), b in 0..B-1 and j in start..stop-1 in that order, at Philox position
    first_positions[b] + j; a single position's is the B rows' own, its lists not copied."""
    if stop - start == 1:
        return processing.at_positions(first_positions + start)
    num_rows = len(first_positions)
    request_rows = torch.arange(num_rows).repeat_interleave(stop - start)
    positions = first_positions[request_rows] + torch.arange(start, stop).repeat(num_rows)
    return expand_processing(processing, request_rows, positions, num_rows)


def _target_distributions(v: DraftVerification) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-9 at every target position, as CpuBackend.sample computes them.

    Returns (scores, q, valid): scores float32 [B, n + 1, V] are what Sample's Gumbel-max perturbs
    (z over the kept set, -inf elsewhere; 0 at the argmax and -inf elsewhere for greedy rows);
    q = softmax(scores) float32 [B, n + 1, V] (0 in rows that are not valid); valid bool [B].
    """
    num_rows, num_positions, vocab_size = v.target_logits.shape
    device = v.target_logits.device
    x, _ = sanitize_non_finite(_processed(v).view(num_rows * num_positions, vocab_size))
    finite = torch.isfinite(x).any(dim=1)
    x_max = x.max(dim=1, keepdim=True).values
    x_max = torch.where(finite.unsqueeze(1), x_max, torch.zeros_like(x_max))

    def per_position(column: torch.Tensor) -> torch.Tensor:
        return column.to(device).repeat_interleave(num_positions)

    # 6-7. z = (x - max x) / T, as CpuBackend.sample; greedy rows divide by 1 and use the argmax instead.
    greedy = per_position(v.temperature == 0)
    temperature = per_position(torch.where(v.temperature == 0, torch.ones_like(v.temperature), v.temperature))
    z = (x - x_max) / temperature.unsqueeze(1)
    z = torch.where(finite.unsqueeze(1), z, torch.full_like(z, _NEG_INF))
    # 8-9. Kept set; rows without filters keep every finite token and skip the sort.
    top_k, top_p, min_p = per_position(v.top_k), per_position(v.top_p), per_position(v.min_p)
    filtered = (top_k > 0) | (top_p < 1) | (min_p > 0)
    kept = torch.isfinite(z)
    if bool(filtered.any()):
        raise_if_abandoned()
        rows = filtered.nonzero().squeeze(1)
        kept[rows] = kept_token_mask(z[rows], top_k[rows], top_p[rows], min_p[rows])
    scores = torch.where(kept, z, torch.full_like(z, _NEG_INF))
    # Greedy: log of the one-hot at the argmax (ties to the lowest index), so q is exactly one-hot and
    # any Gumbel-max over it returns the argmax, as Sample does.
    one_hot_log = torch.full_like(z, _NEG_INF).scatter_(1, x.argmax(dim=1, keepdim=True), 0.0)
    scores = torch.where(greedy.unsqueeze(1), one_hot_log, scores)
    q = torch.softmax(scores, dim=1)
    q = torch.where(finite.unsqueeze(1), q, torch.zeros_like(q))
    valid = finite.view(num_rows, num_positions).all(dim=1)
    shape = (num_rows, num_positions, vocab_size)
    return scores.view(shape), q.view(shape), valid


def verify_draft(v: DraftVerification) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling of the draft against the target (docs/semantics.md, choice 16).

    Returns (accepted, tokens): accepted int64 [B] in 0..n, the number of draft tokens accepted;
    tokens int64 [B, n + 1], the accepted draft tokens, then the correction (after a rejection) or the
    bonus token (all accepted), then -1. Rows that are not valid: accepted 0, tokens all -1.
    Computed, and returned, on the target logits' device (the per-row columns may stay on the CPU).
    """
    num_rows, num_drafts = v.draft_ids.shape
    vocab_size = v.target_logits.shape[2]
    device = v.target_logits.device
    scores, q, valid = _target_distributions(v)
    p = v.draft_probs.to(device=device, dtype=torch.float32)
    p = p / p.sum(dim=2, keepdim=True)
    draft_ids = v.draft_ids.to(device)
    seed, position, iteration = (column.to(device) for column in (v.seed, v.position, v.iteration))

    # Acceptance of every draft token at once; only the prefix up to the first rejection counts.
    draft = draft_ids.unsqueeze(2)
    q_draft = q[:, :num_drafts].gather(2, draft).squeeze(2).to(torch.float64)
    p_draft = p.gather(2, draft).squeeze(2).to(torch.float64)
    offsets = torch.arange(num_drafts, dtype=torch.int64, device=device)
    u = acceptance_uniforms(seed.unsqueeze(1), position.unsqueeze(1) + offsets, iteration.unsqueeze(1))
    accept = u * p_draft < q_draft
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    accepted = torch.where(valid, accepted, torch.zeros_like(accepted))

    # Each row draws one more token, at position `accepted`: from the residual after a rejection, from
    # q_n (exactly as Sample) after none. One noise draw per row, at that position.
    rows = torch.arange(num_rows, device=device)
    rejected = accepted < num_drafts
    at = accepted.clamp(max=num_drafts - 1)
    q_at = q[rows, at]
    residual = (q_at - p[rows, at]).clamp(min=0)
    # A residual rounded to all zero means q <= p everywhere, i.e. q == p up to rounding: draw from q.
    residual_scores = torch.where((residual > 0).any(dim=1, keepdim=True), residual.log(), q_at.log())
    final_scores = torch.where(rejected.unsqueeze(1), residual_scores, scores[:, num_drafts])
    noise = gumbel_noise(seed, position + accepted, iteration, 0, vocab_size)
    final = (final_scores + noise).argmax(dim=1)

    tokens = torch.full((num_rows, num_drafts + 1), -1, dtype=torch.int64, device=device)
    tokens[:, :num_drafts] = torch.where(offsets < accepted.unsqueeze(1), draft_ids, tokens[:, :num_drafts])
    tokens[rows, accepted] = final
    tokens[~valid] = -1
    return accepted, tokens
