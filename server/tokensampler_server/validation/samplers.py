"""Validation of the local samplers' fields (docs/semantics.md, "Local samplers"): min_tokens, no-repeat-n-gram,
DRY, top-n-sigma, typical-p and XTC.

Same rules as validation/sample.py: every value is checked before any work, a rejection names the field and what was
expected, and every size a client chooses is bounded (repetition.py's MAX_* constants).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb

from tokensampler_server.backends.truncation import xtc_coins
from tokensampler_server.validation.columns import check, checked_column, column
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.repetition import (MAX_BREAKER_LENGTH, MAX_BREAKERS, MAX_DRY_WINDOW, MAX_NGRAM_SIZE, MAX_SEQUENCE_READS,
                         Breakers, SequenceRules)
from tokensampler_server.model.sampling import TokenEntries, Truncation

_BREAKERS = "params.dry_sequence_breakers"


@dataclass(frozen=True)
class DecodedBreakers:
    """DRY's breakers with their smallest and largest id (checked against V later)."""

    breakers: Breakers
    low: int
    high: int
    ids: np.ndarray


def decode_breakers(message: pb.TokenSequences, num_rows: int) -> DecodedBreakers | None:
    """The breakers of every row, or None when the message is empty; counts and lengths checked first."""
    num_ids, num_breakers, num_counts = len(message.ids), len(message.lengths), len(message.counts)
    # The sizes first, from the field lengths alone: reading tens of millions of lengths or counts held the event
    # loop for seconds.
    if num_counts not in (0, num_rows):
        raise InvalidArgument(f"{_BREAKERS}.counts", f"got {num_counts} values, expected 0 or B={num_rows}")
    if num_breakers == 0:  # no breakers: no ids, and no counts or B zero counts (no row has one)
        if num_ids or any(message.counts):
            raise InvalidArgument(f"{_BREAKERS}.lengths", f"got 0 values for {num_ids} ids and counts summing to "
                                                          f"{sum(message.counts)}, expected one length per breaker")
        return None
    most = MAX_BREAKERS * (num_rows if num_counts else 1)
    if num_breakers > most:
        raise InvalidArgument(f"{_BREAKERS}.lengths", f"got {num_breakers} breakers, expected at most {MAX_BREAKERS}"
                                                      + (f" per row ({most} for B={num_rows})" if num_counts else ""))
    if num_ids > MAX_BREAKER_LENGTH * num_breakers:
        raise InvalidArgument(f"{_BREAKERS}.lengths", f"got {num_ids} ids in {num_breakers} breakers, expected "
                                                      f"breakers of 1 to {MAX_BREAKER_LENGTH} ids")
    lengths = np.asarray(message.lengths, dtype=np.int64)
    check(lengths, (lengths >= 1) & (lengths <= MAX_BREAKER_LENGTH), f"{_BREAKERS}.lengths",
          f"breakers of 1 to {MAX_BREAKER_LENGTH} ids")
    if int(lengths.sum()) != num_ids:
        raise InvalidArgument(f"{_BREAKERS}.lengths", f"sum is {int(lengths.sum())}, expected len(ids)={num_ids}")
    if num_counts == 0:
        first, count = np.zeros(num_rows, dtype=np.int64), np.full(num_rows, num_breakers, dtype=np.int64)
    else:
        count = np.asarray(message.counts, dtype=np.int64)
        check(count, count <= MAX_BREAKERS, f"{_BREAKERS}.counts", f"at most {MAX_BREAKERS} breakers per row")
        if int(count.sum()) != num_breakers:
            raise InvalidArgument(f"{_BREAKERS}.counts", f"sum is {int(count.sum())}, expected len(lengths)={num_breakers}")
        first = np.cumsum(count) - count
    ids = np.asarray(message.ids, dtype=np.int64)
    return DecodedBreakers(Breakers.build(ids, lengths, first, count), int(ids.min()), int(ids.max()), ids)


def check_breaker_ids(breakers: DecodedBreakers | None, vocab_size: int) -> None:
    if breakers is not None and (breakers.low < 0 or breakers.high >= vocab_size):
        ids = breakers.ids
        check(ids, (ids >= 0) & (ids < vocab_size), f"{_BREAKERS}.ids", f"token ids in [0, V={vocab_size})")


def sequence_rules(params: pb.SamplingParams, num_rows: int,
                   breakers: DecodedBreakers | None) -> SequenceRules | None:
    """The checked settings of no-repeat-n-gram and DRY; None when the request sets none of them (both off)."""
    if breakers is None and not (params.no_repeat_ngram_size or params.dry_multiplier or params.dry_base
                                 or params.dry_allowed_length or params.dry_penalty_last_n):
        return None
    return SequenceRules(
        ngram=checked_column(params.no_repeat_ngram_size, "params.no_repeat_ngram_size", num_rows, 0, np.int64,
                             lambda n: n <= MAX_NGRAM_SIZE, f"0 <= n <= {MAX_NGRAM_SIZE} (0 is off)"),
        dry_multiplier=checked_column(params.dry_multiplier, "params.dry_multiplier", num_rows, 0.0, np.float32,
                                      lambda m: np.isfinite(m) & (m >= 0), "a finite multiplier >= 0 (0 is off)"),
        dry_base=checked_column(params.dry_base, "params.dry_base", num_rows, 1.75, np.float32,
                                lambda b: np.isfinite(b) & (b >= 1), "a finite base >= 1"),
        dry_allowed=checked_column(params.dry_allowed_length, "params.dry_allowed_length", num_rows, 2, np.int64,
                                   lambda a: a >= 1, "a length >= 1"),
        dry_last_n=checked_column(params.dry_penalty_last_n, "params.dry_penalty_last_n", num_rows, -1, np.int64,
                                  lambda n: (n >= -1) & (n <= MAX_DRY_WINDOW),
                                  f"-1 (the whole sequence), 0 (off) or a window of at most {MAX_DRY_WINDOW} tokens"),
        breakers=None if breakers is None else breakers.breakers,
    )


def check_sequence_reads(rules: SequenceRules, lengths: np.ndarray, positions: int = 1) -> None:
    """Bounds what DRY and no-repeat-n-gram read: a DRY row reading its whole sequence (-1) reads at most
    MAX_DRY_WINDOW tokens, and the rows together at most MAX_SEQUENCE_READS, counted once for each of the
    `positions` a workload samples per row (each reads the row's sequence again)."""
    dry = rules.dry_rows()
    too_long = dry & (rules.dry_last_n == -1) & (lengths > MAX_DRY_WINDOW)
    if bool(too_long.any()):
        row = int(np.argmax(too_long))
        raise InvalidArgument("params.dry_penalty_last_n",
                              f"got -1 for row {row}, whose sequence has {int(lengths[row])} tokens; expected a window "
                              f"of at most {MAX_DRY_WINDOW} tokens (send a window, or fewer ids)")
    windows = np.where(rules.dry_last_n > 0, np.minimum(rules.dry_last_n, lengths), lengths)
    reads = (int(windows[dry].sum()) + int(lengths[rules.ngram > 0].sum())) * positions
    if reads > MAX_SEQUENCE_READS:
        raise InvalidArgument("params.output_token_ids",
                              f"DRY and no-repeat-n-gram would read {reads} tokens of the rows' sequences; expected at "
                              f"most {MAX_SEQUENCE_READS} in one request (send shorter histories or windows)")


def stop_bans(params: pb.SamplingParams, stop: TokenEntries | None, num_rows: int) -> TokenEntries | None:
    """L1: the stop ids of the rows that have generated fewer than min_tokens tokens."""
    minimum = column(params.min_tokens, "params.min_tokens", num_rows, 0, np.int64)
    generated = column(params.num_generated, "params.num_generated", num_rows, 0, np.int64)
    if stop is None or not len(stop):
        return None
    under = torch.from_numpy(generated < minimum)[stop.rows]
    if not bool(under.any()):
        return None
    return TokenEntries(rows=stop.rows[under], tokens=stop.tokens[under])


def truncation(params: pb.SamplingParams, num_rows: int, seed: torch.Tensor, position: torch.Tensor,
               iteration: torch.Tensor) -> Truncation | None:
    """L4-L6 of every row, or None when every row is at the off values."""
    if not (params.top_n_sigma or params.typical_p or params.xtc_threshold or params.xtc_probability):
        return None  # the common request: nothing to check or expand
    n = checked_column(params.top_n_sigma, "params.top_n_sigma", num_rows, 0.0, np.float32, np.isfinite,
                       "a finite n (n <= 0 is off)")
    p = checked_column(params.typical_p, "params.typical_p", num_rows, 1.0, np.float32, lambda v: (v > 0) & (v <= 1),
                       "0 < p <= 1 (1 is off)")
    threshold = checked_column(params.xtc_threshold, "params.xtc_threshold", num_rows, 0.1, np.float32,
                               lambda t: (t > 0) & (t <= 1), "0 < t <= 1")
    probability = checked_column(params.xtc_probability, "params.xtc_probability", num_rows, 0.0, np.float32,
                                 lambda q: (q >= 0) & (q <= 1), "0 <= q <= 1 (0 is off)")
    if not ((n > 0).any() or (p < 1).any() or (probability > 0).any()):
        return None
    columns = Truncation(top_n_sigma=torch.from_numpy(n), typical_p=torch.from_numpy(p),
                         xtc_threshold=torch.from_numpy(threshold), xtc_probability=torch.from_numpy(probability),
                         seed=seed, position=position, iteration=iteration)
    return replace(columns, xtc_acts=xtc_coins(columns))
