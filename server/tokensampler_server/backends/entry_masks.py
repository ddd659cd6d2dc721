"""Allowed and banned token lists (step 2's masks; min_tokens' bans are banned entries) as token-bitmask rows.

A call whose only processing they are is then read once by the sampling kernels, as a structured-output mask is,
instead of masking a float32 copy of the logits in torch (a copy, a scatter and their host work: 49-59 us a call at
B = 1 and 64, V = 151936, on an H200). The words are built on the host, into the pinned stage the call uploads
anyway. When every row with lists has the same lists (min_tokens' stop ids, shared by a batch's requests), they
share one mask row; otherwise each row with lists costs one (4 ceil(V / 32) bytes), and past MAX_BYTES of them the
torch path stays cheaper than the upload. Device-agnostic numpy; the CUDA backend lays the words out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tokensampler_server.model.sampling import LogitProcessing

MAX_BYTES = 256 << 10
"""Mask rows a call builds on the host at most: 13 rows of V = 151936 (19 KB each)."""

CACHED_ROW_BYTES = 64 << 10
"""Shared mask rows up to this size (V up to 2^19), of lists of up to as many bytes (8192 entries), are kept for the
next call with the same lists: 64 rows and their lists, 8 MiB at most."""

_MASK_FIELDS = ("allowed", "banned")
_MASK_ONLY = frozenset(_MASK_FIELDS)


@dataclass(frozen=True)
class EntryMask:
    """Where a call's allowed and banned lists go as bitmask rows."""

    rows: np.ndarray
    """int64 [M]: the batch rows that have lists, ascending."""
    mask_rows: np.ndarray
    """int32 [M]: the mask row of each of them."""
    num_masks: int
    lists: dict[str, tuple[np.ndarray, np.ndarray]]
    """allowed / banned: (mask row, token) of each entry that builds the mask rows."""
    shared_words: np.ndarray | None = None
    """uint32 [W], read-only: the one mask row when every row with lists shares it, built once for those lists."""


def words_of(vocab_size: int) -> int:
    """int32 words of a bitmask row: ceil(V / 32)."""
    return -(-vocab_size // 32)


def entry_mask(processing: LogitProcessing, num_rows: int, vocab_size: int) -> EntryMask | None:
    """The mask rows of the allowed and banned lists when those lists are all the processing does and their rows
    fit MAX_BYTES; else None (a token bitmask of the request's own, or any other processing, keeps the torch
    path)."""
    if processing.changes_beyond(_MASK_ONLY):
        return None
    lists = {name: (entries.rows.numpy(), entries.tokens.numpy()) for name in _MASK_FIELDS
             if (entries := getattr(processing, name)) is not None and len(entries)}
    if not lists:
        return None
    touched = np.zeros(num_rows, dtype=bool)
    for rows, _ in lists.values():
        touched[rows] = True
    rows = np.flatnonzero(touched)
    shared = {name: tokens for name, (_, tokens) in lists.items()} if rows.size == 1 else _shared(lists, rows, num_rows)
    if shared is not None:
        key = [np.ascontiguousarray(shared[name], dtype=np.int64).tobytes() if name in shared else None
               for name in _MASK_FIELDS]
        cached = 4 * words_of(vocab_size) <= CACHED_ROW_BYTES and sum(len(k or b"") for k in key) <= CACHED_ROW_BYTES
        row_of = _shared_row if cached else _shared_row.__wrapped__
        return EntryMask(rows, np.zeros(rows.size, dtype=np.int32), 1, {}, row_of(vocab_size, *key))
    if rows.size * 4 * words_of(vocab_size) > MAX_BYTES:
        return None
    mask_of = np.full(num_rows, -1, dtype=np.int64)
    mask_of[rows] = np.arange(rows.size)
    by_mask = {name: (mask_of[entry_rows], tokens) for name, (entry_rows, tokens) in lists.items()}
    return EntryMask(rows, np.arange(rows.size, dtype=np.int32), rows.size, by_mask)


def _shared(lists: dict[str, tuple[np.ndarray, np.ndarray]], rows: np.ndarray,
            num_rows: int) -> dict[str, np.ndarray] | None:
    """Each kind's tokens when every row of `rows` has the same list of it (as a multiset), else None."""
    shared = {}
    for name, (entry_rows, tokens) in lists.items():
        counts = np.bincount(entry_rows, minlength=num_rows)[rows]
        if (counts != counts[0]).any():  # a row without this kind's list differs too
            return None
        if (entry_rows[1:] < entry_rows[:-1]).any():  # a request's one list comes in row order: no sort then
            tokens = tokens[np.argsort(entry_rows, kind="stable")]
        grid = tokens.reshape(rows.size, counts[0])
        if (grid != grid[0]).any():
            grid = np.sort(grid, axis=1)  # the same lists in another order
            if (grid != grid[0]).any():
                return None
        shared[name] = grid[0]
    return shared


@lru_cache(maxsize=64)
def _shared_row(vocab_size: int, allowed: bytes | None, banned: bytes | None) -> np.ndarray:
    """The mask row of one allowed and one banned list (int64 token bytes; None: no such list), read-only. Cached:
    the same lists come back at every step of a request and across requests (min_tokens' stop ids), and building a
    row was most of such a call's host work (docs/design/kernel-routing.md)."""
    lists = {name: (np.zeros(len(tokens) // 8, dtype=np.int64), np.frombuffer(tokens, dtype=np.int64))
             for name, tokens in zip(_MASK_FIELDS, (allowed, banned)) if tokens is not None}
    words = np.empty((1, words_of(vocab_size)), dtype=np.uint32)
    _fill(words, lists)
    words.flags.writeable = False
    return words[0]


def fill_mask_words(words: np.ndarray, mask: EntryMask) -> None:
    """words (int32 [mask.num_masks, W]) become the mask rows (docs/semantics.md, choice 17): all ones, only the
    allowed tokens where the lists have allowed entries, less the banned tokens. Bits past V are left as the lists
    leave them; the kernels ignore them."""
    if mask.shared_words is not None:
        words.view(np.uint32)[0] = mask.shared_words
        return
    _fill(words.view(np.uint32), mask.lists)


def _fill(bits: np.ndarray, lists: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """bits: uint32 [mask rows, W]; lists: allowed / banned as (mask row, token) of each entry."""
    bits.fill(0xFFFFFFFF)
    flat = bits.reshape(-1)
    width = bits.shape[1]
    if "allowed" in lists:
        at, tokens = lists["allowed"]
        bits[at] = 0  # restricted rows keep only what their entries set
        np.bitwise_or.at(flat, at * width + (tokens >> 5), _bit(tokens))
    if "banned" in lists:
        at, tokens = lists["banned"]
        np.bitwise_and.at(flat, at * width + (tokens >> 5), ~_bit(tokens))


def _bit(tokens: np.ndarray) -> np.ndarray:
    return np.uint32(1) << (tokens & 31).astype(np.uint32)
