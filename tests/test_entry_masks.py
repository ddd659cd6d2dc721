"""Allowed and banned token lists as bitmask rows (backends/entry_masks.py): the words keep exactly the tokens that
step 2 of the reference keeps (processing.apply_processing), and only calls whose processing the lists are all of,
on few enough rows, take them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokensampler_server.backends.entry_masks import MAX_BYTES, fill_mask_words, mask_rows, words_of
from tokensampler_server.backends.processing import apply_processing, unpack_bitmask
from tokensampler_server.model.sampling import LogitProcessing, TokenEntries, Truncation


def _entries(pairs: list[tuple[int, int]]) -> TokenEntries:
    rows, tokens = zip(*pairs) if pairs else ((), ())
    return TokenEntries(rows=torch.tensor(rows, dtype=torch.int64), tokens=torch.tensor(tokens, dtype=torch.int64))


def random_lists(num_rows: int, vocab: int, seed: int) -> LogitProcessing:
    """Rows with bans only, allowed lists only, both (a ban inside the allowed list, one outside), an allowed list
    that its bans empty, none; duplicate entries; tokens in the first and last words and at bit 31."""
    rng = np.random.default_rng(seed)
    edges = [t for t in (0, 31, 63, vocab - 1) if t < vocab]
    allowed, banned = [], []
    for row in range(num_rows):
        kind = row % 5
        if kind in (1, 2, 3):
            keep = [int(t) for t in rng.choice(vocab, size=min(7, vocab), replace=False)] + edges[1:]
            allowed += [(row, t) for t in keep + keep[:2]]
        if kind == 3:
            banned += [(row, t) for t in keep]
        elif kind in (0, 2):
            banned += [(row, int(t)) for t in rng.integers(0, vocab, 20)] + [(row, t) for t in edges + edges]
    return LogitProcessing(allowed=_entries(allowed) if allowed else None, banned=_entries(banned))


@pytest.mark.parametrize("vocab", [1, 33, 4096, 50001, 151936])
def test_the_words_keep_what_step_two_keeps(vocab: int) -> None:
    processing = random_lists(10, vocab, seed=vocab)
    rows = mask_rows(processing, 10, vocab)
    assert rows is not None and rows.tolist() == [r for r in range(10) if r % 5 != 4]
    words = np.empty((rows.size, words_of(vocab)), dtype=np.int32)
    fill_mask_words(words, rows, processing)
    kept = apply_processing(torch.zeros(10, vocab), processing) > float("-inf")
    assert torch.equal(unpack_bitmask(torch.from_numpy(words), vocab), kept[torch.from_numpy(rows)])
    assert not bool(kept[3].any())  # a row whose bans empty its allowed list allows nothing
    assert bool(kept[4].all())  # a row without lists has no mask row: unmasked


def test_bits_past_the_vocabulary_stay_set() -> None:
    processing = LogitProcessing(banned=_entries([(0, 0)]))
    words = np.empty((1, 2), dtype=np.int32)
    fill_mask_words(words, np.array([0]), processing)
    assert words.view(np.uint32).tolist() == [[0xFFFFFFFE, 0xFFFFFFFF]]


@pytest.mark.parametrize("processing", [
    LogitProcessing(),
    LogitProcessing(banned=_entries([])),
    LogitProcessing(banned=_entries([(0, 1)]), token_bitmask=torch.full((1, 2), -1, dtype=torch.int32)),
    LogitProcessing(banned=_entries([(0, 1)]), bias=_entries([(0, 2)]), bias_values=torch.ones(1)),
    LogitProcessing(allowed=_entries([(0, 1)]), output_tokens=_entries([(0, 2)]),
                    presence_penalty=torch.ones(1)),
    LogitProcessing(banned=_entries([(0, 1)]), truncation=Truncation.off(1)),
], ids=["nothing", "no entries", "a bitmask of its own", "bias", "penalties", "a local sampler"])
def test_lists_beside_other_processing_keep_the_torch_path(processing: LogitProcessing) -> None:
    assert mask_rows(processing, 1, 64) is None


def test_lists_on_more_rows_than_the_budget_keep_the_torch_path() -> None:
    vocab = 151936
    fits = MAX_BYTES // (4 * words_of(vocab))
    for num_rows, takes in ((fits, True), (fits + 1, False)):
        banned = _entries([(row, 5) for row in range(num_rows)])
        assert (mask_rows(LogitProcessing(banned=banned), num_rows, vocab) is not None) is takes
