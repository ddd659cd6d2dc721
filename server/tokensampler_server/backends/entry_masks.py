"""Allowed and banned token lists (step 2's masks; min_tokens' bans are banned entries) as token-bitmask rows.

A call whose only processing they are is then read once by the sampling kernels, as a structured-output mask is,
instead of masking a float32 copy of the logits in torch (a copy, a scatter and their host work: 49-59 us a call at
B = 1 and 64, V = 151936, on an H200). The words are built on the host, into the pinned stage the call uploads
anyway, so only the rows with entries cost a mask row (4 ceil(V / 32) bytes each); past MAX_BYTES of them the
torch path stays cheaper than the upload. Device-agnostic numpy; the CUDA backend lays the words out.
"""

from __future__ import annotations

import numpy as np

from tokensampler_server.model.entries import TokenEntries
from tokensampler_server.model.sampling import LogitProcessing

MAX_BYTES = 256 << 10
"""Mask rows a call builds on the host at most: 13 rows of V = 151936 (19 KB each)."""

_MASK_FIELDS = frozenset({"allowed", "banned"})


def mask_rows(processing: LogitProcessing, num_rows: int, vocab_size: int) -> np.ndarray | None:
    """The rows (int64, ascending) of the num_rows that the allowed and banned entries touch, when those entries are
    all the processing does and their mask rows fit MAX_BYTES; else None (a token bitmask of the request's own, or
    any other processing, keeps the torch path)."""
    if processing.changes_beyond(_MASK_FIELDS):
        return None
    touched = np.zeros(num_rows, dtype=bool)
    for entries in (processing.allowed, processing.banned):
        if entries is not None:
            touched[entries.rows.numpy()] = True
    rows = np.flatnonzero(touched)
    return rows if 0 < rows.size and rows.size * 4 * words_of(vocab_size) <= MAX_BYTES else None


def words_of(vocab_size: int) -> int:
    """int32 words of a bitmask row: ceil(V / 32)."""
    return -(-vocab_size // 32)


def fill_mask_words(words: np.ndarray, rows: np.ndarray, processing: LogitProcessing) -> None:
    """words (int32 [len(rows), W]): row i becomes the mask of batch row rows[i] (docs/semantics.md, choice 17):
    all ones, only the allowed tokens where the row has allowed entries, less its banned tokens. Bits past V stay
    set; the kernels ignore them."""
    bits = words.view(np.uint32)
    bits.fill(0xFFFFFFFF)
    if processing.allowed is not None and len(processing.allowed):
        at, word, bit = _coordinates(processing.allowed, rows)
        bits[at] = 0  # restricted rows keep only what their entries set
        np.bitwise_or.at(bits, (at, word), bit)
    if processing.banned is not None and len(processing.banned):
        at, word, bit = _coordinates(processing.banned, rows)
        np.bitwise_and.at(bits, (at, word), ~bit)


def _coordinates(entries: TokenEntries, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each entry's mask row, word and bit (uint32)."""
    tokens = entries.tokens.numpy()
    return np.searchsorted(rows, entries.rows.numpy()), tokens >> 5, np.uint32(1) << (tokens & 31).astype(np.uint32)
