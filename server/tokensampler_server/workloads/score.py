"""Scoring given tokens (docs/semantics.md, "Scoring given tokens" and choice 18) in torch.

Device-agnostic: it runs where the logits, or the LM head, are. Positions whose distribution needs no sort (RAW,
and PROCESSED without top-k, top-p or min-p) walk the vocabulary a slice at a time with a running max, sum of
exponentials and entropy sum (the online softmax of Milakov and Gimelshein, 2018), picking the target's logit
and the N best as their slice passes: from hidden states no [N, V] logits exist, and the extra memory is
O(N·(top_n + slice)). Positions with a filter need the sorted row for their kept set (backends/cpu.py's
kept_token_mask, as Sample): they are scored a group of whole rows at a time, at most _SLICE_ELEMENTS logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokensampler_server.backends.cpu import kept_token_mask, top_n
from tokensampler_server.model.log_probs import log_softmax, row_sums64
from tokensampler_server.resources.weights import RegisteredWeight
from tokensampler_server.core.request_context import raise_if_abandoned

# Logits computed at once (a vocabulary slice of every row, or whole rows of filtered positions): 16 MiB of fp32.
_SLICE_ELEMENTS = 1 << 22
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class LogitSource:
    """The logits [N, V] of the positions: `logits` as given, or W·h of `hidden` [N, D] through `lm_head`."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    lm_head: RegisteredWeight | None = None

    @property
    def num_rows(self) -> int:
        return int((self.logits if self.logits is not None else self.hidden).shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[1]) if self.logits is not None else self.lm_head.finish.vocab_size

    def block(self, rows: torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """float32 logits [len(rows), stop - start] of tokens start..stop-1, NaN and +inf read as -inf (choice 1)."""
        if self.logits is not None:
            x = self.logits[rows.to(self.logits.device), start:stop].to(device, torch.float32)
        else:
            x = self.lm_head.logit_slice(self.hidden[rows.to(self.hidden.device)], start, stop).to(device)
        return x.masked_fill_(torch.isnan(x) | torch.isposinf(x), _NEG_INF)


@dataclass(frozen=True)
class TokenScoring:
    """What to score at N positions: every tensor [N] on the CPU."""

    token_ids: torch.Tensor
    """int64, in [0, V)."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    """float32 / int32 / float32 / float32 with SamplingParams' meanings (read in PROCESSED mode only)."""
    processed: bool
    top_logprobs: int = 0
    entropy: bool = False


@dataclass(frozen=True)
class Scores:
    """float32 logprobs [N]; top_ids int64 / top_values float32 [N, top_logprobs] when asked; entropy [N] when asked."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None
    entropy: torch.Tensor | None

    def cpu(self) -> Scores:
        """The same scores on the CPU."""
        return Scores(*(None if t is None else t.cpu() for t in (self.logprobs, self.top_ids, self.top_values,
                                                                   self.entropy)))


StreamedScorer = Callable[[LogitSource, TokenScoring, torch.Tensor, torch.device, Scores], None]
"""Scores the unfiltered rows given (int64 indices on the CPU) into the outputs: score_streamed, or the CUDA
backend's kernel (workloads/score_cuda.py)."""


def score_tokens(source: LogitSource, scoring: TokenScoring, device: torch.device,
                 streamed: StreamedScorer | None = None) -> Scores:
    """The scores of every position, on `device`; the unfiltered rows by `streamed` (score_streamed if None)."""
    num_rows, n = source.num_rows, scoring.top_logprobs
    logprobs = torch.full((num_rows,), float("nan"), device=device)
    top_ids = torch.full((num_rows, n), -1, dtype=torch.int64, device=device) if n else None
    top_values = torch.full((num_rows, n), float("nan"), device=device) if n else None
    entropy = torch.full((num_rows,), float("nan"), device=device) if scoring.entropy else None
    out = Scores(logprobs, top_ids, top_values, entropy)
    filtered = torch.zeros(num_rows, dtype=torch.bool)
    if scoring.processed:
        filtered = (scoring.top_k > 0) | (scoring.top_p < 1) | (scoring.min_p > 0)
    unfiltered = (~filtered).nonzero().squeeze(1)
    if unfiltered.numel():
        (streamed or score_streamed)(source, scoring, unfiltered, device, out)
    kept_rows = filtered.nonzero().squeeze(1)
    group = max(1, _SLICE_ELEMENTS // source.vocab_size)
    for begin in range(0, kept_rows.numel(), group):
        raise_if_abandoned()  # a group's sort is up to seconds on the CPU
        _filtered(source, scoring, kept_rows[begin:begin + group], device, out)
    return out


def row_temperature(scoring: TokenScoring, rows: torch.Tensor) -> torch.Tensor | None:
    """float32 [R] on the CPU: the rows' T in PROCESSED mode (T = 1 for greedy rows, choice 6); None in RAW mode."""
    if not scoring.processed:
        return None
    t = scoring.temperature[rows]
    return torch.where(t == 0, torch.ones_like(t), t)


def _temperature(scoring: TokenScoring, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[R, 1]: the rows' T in PROCESSED mode, 1 in RAW mode."""
    t = row_temperature(scoring, rows)
    return torch.ones((rows.numel(), 1), device=device) if t is None else t.to(device).unsqueeze(1)


def score_streamed(source: LogitSource, scoring: TokenScoring, rows: torch.Tensor, device: torch.device,
                   out: Scores) -> None:
    """Rows whose distribution is softmax(z), z = (x - max) / T over the whole vocabulary (choice 2), a vocabulary
    slice at a time. The sums are kept about the largest x seen so far and rescaled as it grows: x / T alone
    overflows for a small T, and max(z) + log Σ e^(z - max(z)) loses the log term in float32 for a large |z|.
    The sums are float64: the slices' width depends on the rows scored together, and a float32 sum's rounding with
    it (a log-prob moved by up to 7e-5 at V = 2^20 between ScoreTokens and Sample); in float64 the float32 results
    are the same whatever the batch."""
    num_rows, vocab = rows.numel(), source.vocab_size
    width = max(1, min(vocab, _SLICE_ELEMENTS // num_rows))
    t = _temperature(scoring, rows, device)
    targets = scoring.token_ids[rows].to(device)
    running_max = torch.full((num_rows,), _NEG_INF, device=device)  # of x
    sum_exp = torch.zeros(num_rows, dtype=torch.float64, device=device)  # Σ e^c, c = (x - running_max) / T
    sum_terms = torch.zeros(num_rows, dtype=torch.float64, device=device)  # Σ e^c·c: the entropy's numerator
    target_x = torch.full((num_rows,), _NEG_INF, device=device)
    best_x = best_ids = None
    for start in range(0, vocab, width):
        raise_if_abandoned()
        stop = min(start + width, vocab)
        x = source.block(rows, start, stop, device)
        new_max = torch.maximum(running_max, x.amax(dim=1))
        shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))  # no -inf - -inf
        centred = (x - shift.unsqueeze(1)).div_(t)
        e = centred.exp()
        terms = row_sums64(torch.where(e > 0, e * centred, torch.zeros_like(e))).squeeze(1)
        # Rescale what the earlier slices summed to the new max: e^(c') = e^c·e^d, c' = c + d, d = (m - m') / T.
        d = (running_max - shift).div_(t.squeeze(1)).double()
        scale = d.exp()
        moved = torch.where(scale > 0, sum_terms + sum_exp * d, torch.zeros_like(sum_exp))
        sum_terms = scale * moved + terms
        sum_exp = scale * sum_exp + row_sums64(e).squeeze(1)
        running_max = new_max
        inside = (targets >= start) & (targets < stop)
        picked = x.gather(1, (targets - start).clamp(0, stop - start - 1).unsqueeze(1)).squeeze(1)
        target_x = torch.where(inside, picked, target_x)
        if scoring.top_logprobs:
            best_x, best_ids = _merge_best(best_x, best_ids, x, start, scoring.top_logprobs)
    valid = torch.isfinite(running_max)
    shift = torch.where(valid, running_max, torch.zeros_like(running_max))
    log_sum = sum_exp.log()
    index = rows.to(device)
    target_z = (target_x - shift).div_(t.squeeze(1))
    log_sum32 = log_sum.float()  # rounded before the subtraction, as Sample's log_softmax does
    out.logprobs[index] = torch.where(valid, target_z - log_sum32, out.logprobs[index])
    if out.entropy is not None:
        out.entropy[index] = torch.where(valid, (log_sum - sum_terms / sum_exp).float(), out.entropy[index])
    if scoring.top_logprobs:
        best_z = (best_x - shift.unsqueeze(1)).div_(t)
        _write_top(out, index, valid, best_ids, best_z - log_sum32.unsqueeze(1))


def _merge_best(best_z: torch.Tensor | None, best_ids: torch.Tensor | None, z: torch.Tensor, start: int,
                n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best (z desc, id asc) of the best so far and a slice of ids start.. (all higher than theirs): a
    stable sort keeps the earlier, lower ids first among ties. Ranked by x, whose order is z's (T > 0)."""
    ids = torch.arange(start, start + z.shape[1], device=z.device).expand_as(z)
    if best_z is not None:
        z, ids = torch.cat([best_z, z], dim=1), torch.cat([best_ids, ids], dim=1)
    z, order = torch.sort(z, dim=1, descending=True, stable=True)
    return z[:, :n], ids.gather(1, order[:, :n])


def _write_top(out: Scores, index: torch.Tensor, valid: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    out.top_ids[index] = torch.where(valid.unsqueeze(1), ids, out.top_ids[index])
    out.top_values[index] = torch.where(valid.unsqueeze(1), values, out.top_values[index])


def _filtered(source: LogitSource, scoring: TokenScoring, rows: torch.Tensor, device: torch.device,
              out: Scores) -> None:
    """PROCESSED rows with top-k, top-p or min-p: whole rows, the kept set as Sample's (steps 8-9)."""
    x = source.block(rows, 0, source.vocab_size, device)
    valid = torch.isfinite(x).any(dim=1)
    x_max = torch.where(valid, x.amax(dim=1), torch.zeros(rows.numel(), device=device))
    z = (x - x_max.unsqueeze(1)) / _temperature(scoring, rows, device)
    kept = kept_token_mask(z, *(column[rows].to(device) for column in (scoring.top_k, scoring.top_p, scoring.min_p)))
    z_kept = torch.where(kept, z, torch.full_like(z, _NEG_INF))
    table = log_softmax(z_kept)
    index = rows.to(device)
    picked = table.gather(1, scoring.token_ids[rows].to(device).unsqueeze(1)).squeeze(1)
    out.logprobs[index] = torch.where(valid, picked, out.logprobs[index])
    if out.entropy is not None:
        p = table.exp()
        h = -torch.where(p > 0, p * table, torch.zeros_like(p)).sum(dim=1)
        out.entropy[index] = torch.where(valid, h, out.entropy[index])
    if scoring.top_logprobs:
        ids, values = top_n(table, scoring.top_logprobs)
        _write_top(out, index, valid, ids, values)
