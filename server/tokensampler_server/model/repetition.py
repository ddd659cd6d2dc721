"""What a row's token sequence bans and penalises (docs/semantics.md L2-L3): no-repeat-n-gram's bans and DRY's
penalties, in the form validation lays out and every backend derives on its own device.

They depend on the token ids alone, never on the logits. Validation lays each row's sequence (its prompt ids, then
its output ids) out in tiles with the row's settings (SequenceSamplers), host work proportional to the request's
ids; the backend compares every tile position with the end of its sequence on the logits' device, and applies the
bans in step 2 and the penalties in step 4 (backends/sequence_samplers.py): the CPU reference and the CUDA backend
run the same code.

A tile holds `width` consecutive positions of one sequence, latest first, followed by the HALO tokens before them:
position i of a tile is at sequence index q = top - i, and its tokens from i on read s[q], s[q-1], ... A position's
repeat is the length of the longest common suffix of s[..q-1] and the whole sequence (at most DRY_MAX_REPEAT): the
number of leading equal columns when tokens[i+1 : i+1+HALO] is compared with the tile's `suffix`, the sequence's
last DRY_MAX_REPEAT tokens, latest first, then a sentinel no token equals. no-repeat-n-gram bans s[q] when that
repeat reaches n - 1 (the n-gram ending at q repeats the sequence's last n - 1 tokens); DRY penalises s[q] by its
row's table at the repeat, bounded by the window and by the breakers' restart (L3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from tokensampler_server.model.entries import TokenEntries

MAX_NGRAM_SIZE = 32
MAX_BREAKERS = 32
MAX_BREAKER_LENGTH = 16
MAX_DRY_WINDOW = 8192
MAX_SEQUENCE_READS = 1 << 20
"""Sequence tokens DRY (its windows) and no-repeat-n-gram (whole sequences) read in one request, all rows together:
what validation lays out in tiles, and what a backend uploads (4 bytes a token, and the tiles' settings) and
compares up to HALO times on every call."""
DRY_MAX_REPEAT = 50
"""Repeats count at most this many tokens (text-generation-webui's cap; docs/semantics.md L3)."""

HALO = DRY_MAX_REPEAT + 1
"""Tokens a tile holds past its last position, and entries of a suffix and of a penalty table."""
PAD_TOKEN = -1
"""Tile tokens outside the row's span: equal to no token, and to no suffix entry."""
PAD_SUFFIX = -2
"""Suffix entries before the sequence's start, and the sentinel that ends every comparison."""
PAD_BREAKER = -3
"""Padding of a tile's single-token breakers."""
NGRAM_OFF = HALO
"""A tile's NEED when no-repeat-n-gram is off: more than any repeat."""
_TILE_WIDTHS = tuple(64 << k for k in range(6))  # 64 .. 2048 positions
# Pads breakers and tails in the restart search: no int32 token id equals it.
_NO_TOKEN = -(1 << 40)
# Pads a row's breakers in the restart search: equal to no tail token, _NO_TOKEN included.
_NO_BREAKER = _NO_TOKEN - 1
_TAIL = DRY_MAX_REPEAT + MAX_BREAKER_LENGTH
BREAKER_STARTS = _TAIL
"""Starts at which DRY's restart search compares each breaker of a row (_restart_caps): what a request's breakers
cost to search is rows x breakers x BREAKER_STARTS comparisons of one byte (validation counts them)."""
SEARCH_ROWS = 512
"""Rows whose breakers the restart search compares at once: its temporaries stay within 512 x 32 x 66 bytes."""


@dataclass(frozen=True)
class TileLayout:
    """The int32 columns of a tile: its settings, its single-token breakers, then its tokens."""

    width: int
    """Positions per tile."""
    singles: int
    """Single-token breakers per tile."""

    ROW = 0
    """The row the tile serves (when SequenceSamplers.instances is None)."""
    NEED = 1
    """no-repeat-n-gram: position i is banned when its repeat is at least NEED (n - 1; NGRAM_OFF: off)."""
    DRY_TOP = 2
    """DRY: top - W (W the window's first index), so that position i ends DRY_TOP - i window tokens; the repeat
    of a position counts at most those (none when DRY is off)."""
    CAP = 3
    """DRY: min(the restart limit, DRY_MAX_REPEAT), the most a repeat counts (0 when DRY is off)."""
    SUFFIX = 4
    """HALO columns: the sequence's last DRY_MAX_REPEAT tokens, latest first, then PAD_SUFFIX."""
    TABLE = SUFFIX + HALO
    """HALO columns: DRY's penalty at each repeat length, float32 bits (0 below dry_allowed_length)."""
    SINGLES = TABLE + HALO
    """`singles` columns: the row's one-token breakers (DRY never penalises them), padded with PAD_BREAKER."""

    @property
    def tokens(self) -> int:
        """First column of the width + HALO tokens."""
        return self.SINGLES + self.singles

    @property
    def columns(self) -> int:
        return self.tokens + self.width + HALO


@dataclass(frozen=True)
class SequenceSamplers:
    """no-repeat-n-gram and DRY of the rows that use them: their sequences in tiles, with their settings."""

    tiles: torch.Tensor
    """int32 [U, layout.columns], on the CPU."""
    layout: TileLayout
    instances: torch.Tensor | None
    """int32 [P, 2] (row, tile), rows ascending: the tiles each row reads, when tiles serve several rows (a
    diffusion step's positions). None: tile u serves row tiles[u, ROW] alone."""
    bans: bool
    """Some tile bans (no-repeat-n-gram)."""
    penalties: bool
    """Some tile penalises (DRY)."""

    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, tile) of every instance, int64, rows ascending."""
        if self.instances is None:
            return self.tiles[:, TileLayout.ROW].long(), torch.arange(self.tiles.shape[0])
        return self.instances[:, 0].long(), self.instances[:, 1].long()

    def rows(self, index: torch.Tensor) -> SequenceSamplers | None:
        """The rows `index` (int64, CPU: the row each new row is), in that order; None when none reads a tile."""
        row, tile = self._pairs()
        size = max(int(row.max()) + 1 if row.numel() else 0, int(index.max()) + 1 if index.numel() else 0)
        counts = torch.bincount(row, minlength=size)
        starts = torch.cumsum(counts, 0) - counts
        taken = counts[index]
        total = int(taken.sum())
        if total == 0:
            return None
        new_row = torch.repeat_interleave(torch.arange(index.numel()), taken)
        first = torch.cumsum(taken, 0) - taken
        source = torch.repeat_interleave(starts[index] - first, taken) + torch.arange(total)
        new_tile = tile[source]
        if int(torch.bincount(new_tile).max()) == 1:  # every tile serves one row: it keeps the row itself
            tiles = torch.index_select(self.tiles, 0, new_tile, out=_host_tiles(new_tile.numel(), self.layout))
            tiles[:, TileLayout.ROW] = new_row.to(torch.int32)
            return replace(self, tiles=tiles, instances=None)
        return replace(self, instances=torch.stack([new_row, new_tile], dim=1).to(torch.int32))

    @staticmethod
    def concat(parts: list[tuple[SequenceSamplers | None, int]]) -> SequenceSamplers | None:
        """The rows of every part, in order: (samplers of the part or None, the part's number of rows)."""
        present = []
        offset = 0
        for samplers, num_rows in parts:
            if samplers is not None:
                present.append((samplers, offset))
            offset += num_rows
        if not present:
            return None
        layout = TileLayout(max(s.layout.width for s, _ in present), max(s.layout.singles for s, _ in present))
        tiles = torch.cat([_relaid(s.tiles, s.layout, layout) for s, _ in present],
                          out=_host_tiles(sum(s.tiles.shape[0] for s, _ in present), layout))
        bans = any(s.bans for s, _ in present)
        penalties = any(s.penalties for s, _ in present)
        if all(s.instances is None for s, _ in present):
            tiles[:, TileLayout.ROW] += torch.cat([torch.full((s.tiles.shape[0],), row_offset, dtype=torch.int32)
                                                   for s, row_offset in present])
            return SequenceSamplers(tiles, layout, None, bans, penalties)
        pairs = []
        tile_offset = 0
        for samplers, row_offset in present:
            row, tile = samplers._pairs()
            pairs.append(torch.stack([row + row_offset, tile + tile_offset], dim=1))
            tile_offset += samplers.tiles.shape[0]
        return SequenceSamplers(tiles, layout, torch.cat(pairs).to(torch.int32), bans, penalties)


def _host_tiles(count: int, layout: TileLayout) -> torch.Tensor:
    """An int32 [count, layout.columns] tensor for tiles, in page-locked memory when this process uses CUDA: the
    backend uploads the tiles on every call, and from page-locked memory that is one copy at the bus's full speed
    that the host does not wait for (from pageable memory the driver stages it, and the host waits)."""
    return torch.empty((count, layout.columns), dtype=torch.int32, pin_memory=torch.cuda.is_initialized())


def _relaid(tiles: torch.Tensor, old: TileLayout, new: TileLayout) -> torch.Tensor:
    """`tiles` in the wider layout `new`: more single breakers (PAD_BREAKER) and more positions (PAD_TOKEN)."""
    if old == new:
        return tiles
    out = torch.full((tiles.shape[0], new.columns), PAD_TOKEN, dtype=torch.int32)
    out[:, :old.SINGLES] = tiles[:, :old.SINGLES]
    out[:, new.SINGLES:new.tokens] = PAD_BREAKER
    out[:, new.SINGLES:new.SINGLES + old.singles] = tiles[:, old.SINGLES:old.tokens]
    out[:, new.tokens:new.tokens + old.width + HALO] = tiles[:, old.tokens:]
    return out


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

    def flat(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sequences of `rows` (bool [B]) end to end, and where each row's begins: (tokens int64, starts [B])."""
        parts = [(entries.tokens.numpy(), np.diff(self._bounds(entries)))
                 for entries in (self.prompt, self.output) if entries is not None]
        lengths = np.where(rows, sum(counts for _, counts in parts), 0)
        starts = np.cumsum(lengths) - lengths
        every = bool(rows.all())
        if len(parts) == 1 and every:  # one list for every row: the sequences as they came
            return parts[0][0], starts
        tokens = np.empty(int(lengths.sum()), dtype=np.int64)
        placed = np.zeros(self.num_rows, dtype=np.int64)  # each row's tokens of the lists before
        for values, counts in parts:
            # Entry j of a row whose list begins at entry `first` goes to start + placed + j - first.
            destination = np.repeat(starts + placed - (np.cumsum(counts) - counts), counts) + np.arange(len(values))
            if every:
                tokens[destination] = values
            else:
                keep = np.repeat(rows, counts)
                tokens[destination[keep]] = values[keep]
            placed += counts
        return tokens, starts


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

    def pairs(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, breaker) of every breaker of `rows` (int64 row ids), rows in the given order."""
        count = self.count[rows]
        row = np.repeat(rows, count)
        within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        return row, self.first[row] + within


def _restart_caps(tokens: np.ndarray, ends: np.ndarray, windows: np.ndarray, breakers: Breakers | None,
                  rows: np.ndarray) -> np.ndarray:
    """L3.1 for `rows` (int64 row ids), counted up to DRY_MAX_REPEAT: min(the window tokens after the latest-starting
    breaker occurrence in the window, DRY_MAX_REPEAT); `ends` [B] and `windows` [B] where each row's window ends in
    `tokens` and its length.

    Only starts from DRY_MAX_REPEAT + MAX_BREAKER_LENGTH tokens before the end can leave fewer than DRY_MAX_REPEAT
    tokens after them, so the search reads that tail alone, SEARCH_ROWS rows at a time (its temporaries bounded)."""
    limit = windows[rows].copy()
    if breakers is not None:
        for first in range(0, len(rows), SEARCH_ROWS):
            block = rows[first:first + SEARCH_ROWS]
            after = _tokens_after_breakers(_tails(tokens, ends, windows, block), *_row_breakers(breakers, block))
            limit[first:first + len(block)] = np.where(after >= 0, after, windows[block])
    return np.minimum(limit, DRY_MAX_REPEAT)


def _tails(tokens: np.ndarray, ends: np.ndarray, windows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """int64 [R, MAX_BREAKER_LENGTH + _TAIL]: MAX_BREAKER_LENGTH columns past each row's end, then its last _TAIL
    tokens, latest first; _NO_TOKEN outside the window, so that no breaker occurrence crosses its bounds."""
    back = np.arange(MAX_BREAKER_LENGTH + _TAIL) - MAX_BREAKER_LENGTH  # how many tokens before the last
    at = ends[rows, None] - 1 - back
    inside = (back >= 0) & (back < windows[rows, None])
    return np.where(inside, tokens[np.where(inside, at, 0)], _NO_TOKEN)


def _row_breakers(breakers: Breakers, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's breakers side by side: ids int64 [J, R, K] (id j of each, J the longest's length) and lengths
    int64 [R, K], K the most any of `rows` has; a row with fewer is padded with breakers of length 0 and ids
    _NO_BREAKER, which occur nowhere. R is 1 when every row has the same breakers (one list given to all): the
    search broadcasts it rather than copy it per row."""
    first, count = breakers.first[rows], breakers.count[rows]
    if (first == first[0]).all() and (count == count[0]).all():
        first, count = first[:1], count[:1]
    slot = np.arange(int(count.max()))
    present = slot < count[:, None]
    index = np.where(present, first[:, None] + slot, 0)
    lengths = np.where(present, breakers.lengths[index], 0)
    ids = np.where(present, breakers.padded.T[:int(lengths.max(initial=0)), index], _NO_BREAKER)
    return ids, lengths


def _tokens_after_breakers(tails: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 [R]: the tail tokens after the latest-starting occurrence of a row's breakers (the longest of those
    starting there), -1 where none occurs; `tails` from _tails, `ids` and `lengths` from _row_breakers.

    match[r, s, k] says breaker k of row r occurs from start s (s tokens before the last): the starts its first id
    agrees with, kept while each later id agrees too. Bool [R, _TAIL, K] temporaries, one byte a comparison: no
    breaker is ever copied per start (that took 16 int64 a comparison)."""
    rows, width = len(tails), lengths.shape[1]
    if width == 0:
        return np.full(rows, -1, dtype=np.int64)
    past = MAX_BREAKER_LENGTH  # id j of an occurrence from start s is tail column past + s - j
    match = tails[:, past:, None] == ids[0][:, None]
    for j in range(1, len(ids)):
        if not match.any():  # nothing left to extend
            break
        same = tails[:, past - j:past - j + _TAIL, None] == ids[j][:, None]
        done = lengths <= j
        if done.any():  # shorter breakers keep the starts they reached
            same |= done[:, None]
        match &= same
    flat = match.reshape(rows, -1)  # latest start first: a row's first true is its latest-starting occurrence
    first = flat.argmax(axis=1)
    latest = first // width
    longest = np.where(match[np.arange(rows), latest], lengths, 0).max(axis=1)  # lengths [1, K] broadcast too
    return np.where(flat[np.arange(rows), first], latest + 1 - longest, -1)


def _penalty_tables(multiplier: np.ndarray, base: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """float32 [R, HALO]: fp32(multiplier · base^(L - allowed)) at each repeat length L >= allowed (float64, rounded
    once; past float32's range +inf), 0 below."""
    length = np.arange(HALO)
    exponent = length - allowed[:, None]
    with np.errstate(over="ignore"):
        values = (multiplier.astype(np.float64)[:, None]
                  * base.astype(np.float64)[:, None] ** np.maximum(exponent, 0).astype(np.float64)).astype(np.float32)
    return np.where(exponent >= 0, values, np.float32(0))


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

    def samplers(self, sequences: Sequences) -> SequenceSamplers | None:
        """Every row's sequence in tiles with its settings; None when no row can ban or penalise."""
        lengths = sequences.lengths()
        windows = np.where(self.dry_last_n > 0, np.minimum(self.dry_last_n, lengths), lengths)
        dry = self.dry_rows() & (windows >= 2)
        windows = np.where(dry, windows, 0)
        ngram = (self.ngram > 0) & (lengths >= self.ngram)
        tokens, starts = sequences.flat(dry | ngram)
        ends = starts + lengths
        caps = np.zeros(sequences.num_rows, dtype=np.int64)
        dry_ids = np.nonzero(dry)[0]
        caps[dry_ids] = _restart_caps(tokens, ends, windows, self.breakers, dry_ids)
        dry &= caps >= self.dry_allowed  # a repeat never reaches the allowed length: nothing to penalise
        used = np.nonzero(dry | ngram)[0]
        if not len(used):
            return None
        # A row's span: its whole sequence for no-repeat-n-gram, its window for DRY alone.
        span_start = np.where(ngram, 0, lengths - windows)[used]
        spans = lengths[used] - span_start
        width = min(_TILE_WIDTHS, key=lambda w: int((-(-spans // w)).sum()) * (w + 3 * HALO))
        counts = -(-spans // width)
        singles = self._singles(used)
        layout = TileLayout(width, singles.shape[1])
        held = _host_tiles(int(counts.sum()), layout)
        tiles = held.numpy()
        row_of_tile = np.repeat(np.arange(len(used)), counts)
        nth = np.arange(len(row_of_tile)) - np.repeat(np.cumsum(counts) - counts, counts)  # of its row's tiles
        top = lengths[used][row_of_tile] - 1 - nth * width
        tiles[:, TileLayout.ROW] = used[row_of_tile]
        tiles[:, TileLayout.NEED] = np.where(ngram, self.ngram - 1, NGRAM_OFF)[used][row_of_tile]
        tiles[:, TileLayout.DRY_TOP] = top - (lengths - windows)[used][row_of_tile]
        tiles[:, TileLayout.CAP] = np.where(dry, caps, 0)[used][row_of_tile]
        # The last DRY_MAX_REPEAT tokens, latest first (PAD_SUFFIX before the start), and the sentinel.
        back = np.arange(HALO)
        suffix_at = ends[used, None] - 1 - back
        suffix_ok = (back < DRY_MAX_REPEAT) & (suffix_at >= starts[used, None])
        suffix = np.where(suffix_ok, tokens[np.where(suffix_ok, suffix_at, 0)], PAD_SUFFIX)
        tiles[:, TileLayout.SUFFIX:TileLayout.TABLE] = suffix[row_of_tile]
        tables = _penalty_tables(self.dry_multiplier[used], self.dry_base[used], self.dry_allowed[used])
        tables = np.where(dry[used, None], tables, np.float32(0))
        tiles[:, TileLayout.TABLE:TileLayout.SINGLES] = tables.view(np.int32)[row_of_tile]
        tiles[:, TileLayout.SINGLES:layout.tokens] = singles[row_of_tile]
        tiles[:, layout.tokens:] = _tile_tokens(tokens, starts[used] + span_start, spans, width)
        return SequenceSamplers(held, layout, None, bans=bool(ngram.any()), penalties=bool(dry.any()))

    def _singles(self, rows: np.ndarray) -> np.ndarray:
        """int32 [R, S]: the one-token breakers of `rows`, padded with PAD_BREAKER."""
        if self.breakers is None:
            return np.zeros((len(rows), 0), dtype=np.int32)
        row, breaker = self.breakers.pairs(rows)
        which = np.repeat(np.arange(len(rows)), self.breakers.count[rows])
        single = self.breakers.lengths[breaker] == 1
        which, token = which[single], self.breakers.padded[breaker[single], 0]
        count = np.bincount(which, minlength=len(rows))
        out = np.full((len(rows), int(count.max()) if len(rows) else 0), PAD_BREAKER, dtype=np.int32)
        out[which, np.arange(len(which)) - (np.cumsum(count) - count)[which]] = token
        return out


def _tile_tokens(tokens: np.ndarray, span_starts: np.ndarray, spans: np.ndarray, width: int) -> np.ndarray:
    """int32 [U, width + HALO]: each span's tiles, latest position first, each followed by the HALO tokens before
    its last position (PAD_TOKEN before the span's start).

    The spans are written reversed into one buffer, a block of `width` per tile and one block of padding per span;
    tile k of a span is then the window of width + HALO tokens at its k-th block."""
    counts = -(-spans // width)
    blocks = counts + 1
    block_start = np.cumsum(blocks) - blocks
    buffer = np.full(int(blocks.sum()) * width, PAD_TOKEN, dtype=np.int32)
    step = np.arange(int(spans.sum()))
    span_first = np.cumsum(spans) - spans  # each span's first step: its last token
    buffer[np.repeat(block_start * width - span_first, spans) + step] = \
        tokens[np.repeat(span_starts + spans - 1 + span_first, spans) - step]
    windows = np.lib.stride_tricks.sliding_window_view(buffer, width + HALO)[::width]
    return windows[np.repeat(block_start - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))]
