"""What a row's token sequence bans and penalises (docs/semantics.md L1-L3): min_tokens' stop ids,
no-repeat-n-gram's bans and DRY's penalties, derived on the host when a request is validated.

They depend on the token ids alone, never on the logits, so they become entries of LogitProcessing (`banned`;
`dry` with its values) that every backend applies on its own device in step 2 or 4: the CPU reference and the
CUDA backend apply the very same numbers. The sequence of a row is its prompt ids, then its output ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokensampler_server.model.sampling import TokenEntries

MAX_NGRAM_SIZE = 32
MAX_BREAKERS = 32
MAX_BREAKER_LENGTH = 16
MAX_DRY_WINDOW = 8192
MAX_SEQUENCE_READS = 1 << 20
"""Sequence tokens DRY (its windows) and no-repeat-n-gram (whole sequences) read in one request, all rows
together: up to 50 comparisons each, about 0.4 ms per thousand on one core at worst (a periodic sequence)."""
DRY_MAX_REPEAT = 50
"""Repeats count at most this many tokens (text-generation-webui's cap; docs/semantics.md L3)."""
# Pads breakers in comparisons: no int32 token id equals it.
_NO_TOKEN = -(1 << 40)


@dataclass(frozen=True)
class Sequences:
    """The rows' sequences: prompt ids then output ids, each list in order (entries in row-major order)."""

    prompt: TokenEntries | None
    output: TokenEntries | None
    num_rows: int

    def _bounds(self, entries: TokenEntries | None) -> np.ndarray:
        if entries is None:
            return np.zeros(self.num_rows + 1, dtype=np.int64)
        return np.searchsorted(entries.rows.numpy(), np.arange(self.num_rows + 1))

    def lengths(self) -> np.ndarray:
        """int64 [B]: each row's sequence length."""
        return sum(np.diff(self._bounds(entries)) for entries in (self.prompt, self.output))

    def rows(self) -> list[np.ndarray]:
        """Each row's sequence, int64."""
        parts = [(entries.tokens.numpy(), self._bounds(entries)) for entries in (self.prompt, self.output)
                 if entries is not None]
        return [np.concatenate([tokens[bounds[row]:bounds[row + 1]] for tokens, bounds in parts] or [np.zeros(0, np.int64)])
                for row in range(self.num_rows)]


@dataclass(frozen=True)
class Breakers:
    """DRY's sequence breakers of every row, checked (at most MAX_BREAKERS of 1 to MAX_BREAKER_LENGTH ids each)."""

    padded: np.ndarray
    """int64 [K, MAX_BREAKER_LENGTH]: every breaker, padded with _NO_TOKEN."""
    lengths: np.ndarray
    """int64 [K]."""
    first: np.ndarray
    count: np.ndarray
    """int64 [B] each: row i's breakers are padded[first[i] : first[i] + count[i]]."""

    @staticmethod
    def build(ids: np.ndarray, lengths: np.ndarray, first: np.ndarray, count: np.ndarray) -> Breakers:
        padded = np.full((len(lengths), MAX_BREAKER_LENGTH), _NO_TOKEN, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        column = np.arange(len(ids)) - np.repeat(starts, lengths)
        padded[np.repeat(np.arange(len(lengths)), lengths), column] = ids
        return Breakers(padded, lengths.astype(np.int64), first, count)

    def of_row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        rows = slice(self.first[row], self.first[row] + self.count[row])
        return self.padded[rows], self.lengths[rows]


def ngram_bans(sequence: np.ndarray, n: int) -> np.ndarray:
    """L2: the tokens that would complete an n-gram of `sequence` (n >= 1), unique and sorted."""
    size = len(sequence)
    if size < n:
        return np.zeros(0, dtype=np.int64)
    prefix = sequence[size - n + 1:]
    starts = np.arange(size - n + 1)
    for offset in range(n - 1):  # the candidates shrink at each token of the prefix
        starts = starts[sequence[starts + offset] == prefix[offset]]
    return np.unique(sequence[starts + n - 1])


def _restart_limit(window: np.ndarray, breakers: np.ndarray, lengths: np.ndarray) -> int:
    """L3.1, counted up to DRY_MAX_REPEAT: the tokens after the latest-starting breaker occurrence in the window.

    Only starts from DRY_MAX_REPEAT + MAX_BREAKER_LENGTH tokens before the end can leave fewer than
    DRY_MAX_REPEAT tokens after them, so the scan reads that tail alone."""
    size = len(window)
    if not len(lengths):
        return min(size, DRY_MAX_REPEAT)
    tail_start = max(0, size - DRY_MAX_REPEAT - MAX_BREAKER_LENGTH)
    tail = np.concatenate([window[tail_start:], np.full(MAX_BREAKER_LENGTH, _NO_TOKEN, dtype=np.int64)])
    spans = np.lib.stride_tricks.sliding_window_view(tail, MAX_BREAKER_LENGTH)[: size - tail_start]  # [P, 16]
    used = np.arange(MAX_BREAKER_LENGTH) < lengths[:, None]  # [K, 16]
    matches = ((spans[None] == breakers[:, None]) | ~used[:, None]).all(axis=2)  # [K, P]; padding never matches
    breaker, start = np.nonzero(matches)
    if not len(start):
        return min(size, DRY_MAX_REPEAT)
    latest = start.max()
    end = tail_start + latest + lengths[breaker[start == latest]].max()
    return min(size - end, DRY_MAX_REPEAT)


def dry_penalties(sequence: np.ndarray, multiplier: float, base: float, allowed: int, last_n: int,
                  breakers: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """L3: (tokens int64, penalties float32) of one row with DRY on (multiplier > 0, last_n != 0)."""
    none = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    window = sequence[-last_n:] if last_n > 0 else sequence
    last = len(window) - 1
    limit = _restart_limit(window, breakers, lengths) if last > 0 else 0
    if limit < allowed:
        return none
    # repeat[j]: the common suffix of window[..j] and window[..last], up to `limit`; candidates drop out as
    # their match ends.
    repeat = np.zeros(last, dtype=np.int64)
    alive = np.arange(last)
    for offset in range(limit):
        alive = alive[alive >= offset]
        alive = alive[window[alive - offset] == window[last - offset]]
        if not len(alive):
            break
        repeat[alive] = offset + 1
    ends = np.nonzero(repeat >= allowed)[0]
    if not len(ends):
        return none
    tokens, inverse = np.unique(window[ends + 1], return_inverse=True)
    longest = np.zeros(len(tokens), dtype=np.int64)
    np.maximum.at(longest, inverse, repeat[ends])
    single = breakers[lengths == 1, 0]
    penalised = ~np.isin(tokens, single)
    tokens, longest = tokens[penalised], longest[penalised]
    with np.errstate(over="ignore"):
        values = (np.float64(multiplier) * np.float64(base) ** (longest - allowed).astype(np.float64)).astype(np.float32)
    return tokens, values


def _entries(rows: list[int], tokens: list[np.ndarray]) -> TokenEntries | None:
    if not rows:
        return None
    counts = [len(t) for t in tokens]
    return TokenEntries(rows=torch.from_numpy(np.repeat(np.asarray(rows, dtype=np.int64), counts)),
                        tokens=torch.from_numpy(np.concatenate(tokens).astype(np.int64)))


@dataclass(frozen=True)
class SequenceRules:
    """The per-row settings of L2 and L3, checked; numpy [B] each."""

    ngram: np.ndarray
    dry_multiplier: np.ndarray
    dry_base: np.ndarray
    dry_allowed: np.ndarray
    dry_last_n: np.ndarray
    breakers: Breakers | None

    def dry_rows(self) -> np.ndarray:
        return (self.dry_multiplier > 0) & (self.dry_last_n != 0)

    def derive(self, sequences: Sequences) -> tuple[TokenEntries | None, TokenEntries | None, torch.Tensor | None]:
        """(no-repeat-n-gram's bans, DRY's entries, DRY's penalties float32) of every row."""
        ngram_rows, dry_rows = np.nonzero(self.ngram > 0)[0], np.nonzero(self.dry_rows())[0]
        if not len(ngram_rows) and not len(dry_rows):
            return None, None, None
        rows = sequences.rows()
        bans = _entries(list(ngram_rows), [ngram_bans(rows[r], int(self.ngram[r])) for r in ngram_rows])
        dry_rows_out, dry_tokens, dry_values = [], [], []
        empty = np.zeros((0, MAX_BREAKER_LENGTH), dtype=np.int64), np.zeros(0, dtype=np.int64)
        for r in dry_rows:
            breakers, lengths = self.breakers.of_row(r) if self.breakers is not None else empty
            tokens, values = dry_penalties(rows[r], float(self.dry_multiplier[r]), float(self.dry_base[r]),
                                           int(self.dry_allowed[r]), int(self.dry_last_n[r]), breakers, lengths)
            dry_rows_out.append(int(r))
            dry_tokens.append(tokens)
            dry_values.append(values)
        dry = _entries(dry_rows_out, dry_tokens)
        values = torch.from_numpy(np.concatenate(dry_values)) if dry_values else None
        if dry is not None and not len(dry):
            dry, values = None, None
        if bans is not None and not len(bans):
            bans = None
        return bans, dry, values
