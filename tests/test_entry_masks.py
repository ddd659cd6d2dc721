"""Allowed and banned token lists as bitmask rows (backends/entry_masks.py): the words keep exactly the tokens that
step 2 of the reference keeps (processing.apply_processing), rows with the same lists share a mask row, and only
calls whose processing the lists are all of, on few enough distinct rows, take them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokensampler_server.backends.entry_masks import CACHED_ROW_BYTES, MAX_BYTES, entry_mask, fill_mask_words, words_of
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


def _masks_of_rows(processing: LogitProcessing, num_rows: int, vocab: int) -> torch.Tensor:
    """bool [B, V]: each row's allowed tokens through its mask row (every token where it has none)."""
    mask = entry_mask(processing, num_rows, vocab)
    assert mask is not None
    words = np.empty((mask.num_masks, words_of(vocab)), dtype=np.int32)
    fill_mask_words(words, mask)
    allowed = torch.ones(num_rows, vocab, dtype=torch.bool)
    allowed[torch.from_numpy(mask.rows)] = unpack_bitmask(torch.from_numpy(words), vocab)[torch.from_numpy(
        mask.mask_rows).long()]
    return allowed


@pytest.mark.parametrize("vocab", [1, 33, 4096, 50001, 151936])
def test_the_words_keep_what_step_two_keeps(vocab: int) -> None:
    processing = random_lists(10, vocab, seed=vocab)
    assert entry_mask(processing, 10, vocab).rows.tolist() == [r for r in range(10) if r % 5 != 4]
    kept = apply_processing(torch.zeros(10, vocab), processing) > float("-inf")
    assert torch.equal(_masks_of_rows(processing, 10, vocab), kept)
    assert not bool(kept[3].any())  # a row whose bans empty its allowed list allows nothing
    assert bool(kept[4].all())  # a row without lists has no mask row: unmasked


def test_rows_with_the_same_lists_share_one_mask_row() -> None:
    """min_tokens' stop ids on every other row of a batch (each row's list in either order, the entries in row order
    or shuffled, duplicates included): one mask row, at any B, and the same tokens kept as step 2 keeps."""
    vocab, num_rows = 151936, 256
    stops = [151643, 151645, 0, 31, 32, 7, 7]
    pairs = [(row, t) for row in range(1, num_rows, 2) for t in (stops if row % 3 else stops[::-1])]
    allowed_pairs = [(row, t) for row in range(1, num_rows, 2) for t in (5, 7, 151643, 40000)]
    shuffled = [pairs[i] for i in np.random.default_rng(0).permutation(len(pairs))]
    for processing in (LogitProcessing(banned=_entries(pairs)),
                       LogitProcessing(banned=_entries(shuffled)),
                       LogitProcessing(banned=_entries(pairs), allowed=_entries(allowed_pairs))):
        mask = entry_mask(processing, num_rows, vocab)
        assert mask.num_masks == 1 and mask.rows.tolist() == list(range(1, num_rows, 2))
        kept = apply_processing(torch.zeros(num_rows, vocab), processing) > float("-inf")
        assert torch.equal(_masks_of_rows(processing, num_rows, vocab), kept)


def test_rows_whose_lists_differ_in_one_token_do_not_share() -> None:
    pairs = [(0, 5), (0, 6), (1, 5), (1, 7)]
    mask = entry_mask(LogitProcessing(banned=_entries(pairs)), 2, 64)
    assert mask.num_masks == 2
    one_list_each = LogitProcessing(banned=_entries([(0, 5)]), allowed=_entries([(1, 5)]))
    assert entry_mask(one_list_each, 2, 64).num_masks == 2


@pytest.mark.parametrize("vocab", [40, 151936, 8 * CACHED_ROW_BYTES + 1])
def test_one_row_and_shared_rows_are_built_once_for_the_same_lists(vocab: int) -> None:
    """A one-row call (allowed and banned lists) keeps what step 2 keeps; the next call with the same lists, in any
    batch, reads the same read-only row, unless the row is larger than the cache keeps; other lists build another."""
    pairs = [(0, t) for t in (3, 31, 32, vocab - 1, 3)]
    one = LogitProcessing(allowed=_entries(pairs + [(0, 17)]), banned=_entries(pairs[:2]))
    kept = apply_processing(torch.zeros(1, vocab), one) > float("-inf")
    assert torch.equal(_masks_of_rows(one, 1, vocab), kept) and int(kept.sum()) == 3  # 17, 32, V - 1
    first = entry_mask(one, 1, vocab).shared_words
    assert not first.flags.writeable
    batch = LogitProcessing(allowed=_entries([(2, t) for _, t in pairs + [(0, 17)]]),
                            banned=_entries([(2, t) for _, t in pairs[:2]]))
    again = entry_mask(batch, 4, vocab).shared_words
    cached = 4 * words_of(vocab) <= CACHED_ROW_BYTES
    assert (again is first) == cached and np.array_equal(again, first)
    other = entry_mask(LogitProcessing(allowed=_entries(pairs), banned=_entries(pairs[:2])), 1, vocab).shared_words
    assert not np.array_equal(other, first)


def test_long_lists_build_their_row_each_time() -> None:
    """Lists past CACHED_ROW_BYTES of entries (repeats count) are not kept as cache keys: the row is built again, the
    same words."""
    tokens = [5, 7] * (CACHED_ROW_BYTES // 16 + 1)
    processing = LogitProcessing(banned=_entries([(0, t) for t in tokens]))
    first, again = (entry_mask(processing, 1, 64).shared_words for _ in range(2))
    assert again is not first and np.array_equal(again, first)
    assert first.tolist() == [0xFFFFFF5F, 0xFFFFFFFF]


def test_bits_past_the_vocabulary_stay_set() -> None:
    mask = entry_mask(LogitProcessing(banned=_entries([(0, 0)])), 1, 33)
    words = np.empty((1, 2), dtype=np.int32)
    fill_mask_words(words, mask)
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
    assert entry_mask(processing, 1, 64) is None


def test_a_history_without_penalty_values_changes_nothing_and_keeps_the_route() -> None:
    """An engine that sends every row's history (for penalties it may turn on later) with min_tokens alone: the
    history changes no logit (step 4 without values), so the bans still take the bitmask rows."""
    banned, history = _entries([(0, 1)]), _entries([(0, 2), (0, 3)])
    assert entry_mask(LogitProcessing(banned=banned, output_tokens=history, prompt_tokens=history), 1, 64) is not None
    with_values = LogitProcessing(banned=banned, output_tokens=history, frequency_penalty=torch.ones(1))
    assert entry_mask(with_values, 1, 64) is None


def test_distinct_lists_on_more_rows_than_the_budget_keep_the_torch_path() -> None:
    vocab = 151936
    fits = MAX_BYTES // (4 * words_of(vocab))
    for num_rows, takes in ((fits, True), (fits + 1, False)):
        banned = _entries([(row, row) for row in range(num_rows)])
        assert (entry_mask(LogitProcessing(banned=banned), num_rows, vocab) is not None) is takes
