"""no-repeat-n-gram's bans and DRY's penalties derived from the rows' tiles (repetition.py,
backends/sequence_samplers.py) against tests/local_reference.py, bit for bit, on the CPU: random, periodic and
constant sequences, prompts and outputs, windows, breakers that occur in the tail, every n, and the rows taken
apart, merged and repeated as batching and diffusion steps do."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tokensampler_client.params import build_sample_request
from tokensampler_client.workloads import build_diffusion_request
from tokensampler_server.backends import sequence_samplers
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.batching.batch_merge import merge_batches
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.repetition import MAX_SEQUENCE_READS
from tokensampler_server.model.sampling import select_rows
from tokensampler_server.validation.sample import validate_sample_request
from tokensampler_server.validation.workloads import validate_diffusion_request
from tokensampler_server.workloads.diffusion import diffusion_step

from . import local_reference as ref

MULTIPLIERS = [0.8, 1e-3, 3.0, 1e30]  # 1e30: penalties past float32's range, +inf
BASES = [1.75, 1.0, 1.1, 9.0]
ALLOWED = [1, 2, 3, 7, 50, 51]
WINDOWS = [-1, 0, 1, 2, 5, 20, 63, 200]
NGRAMS = [0, 1, 2, 3, 5, 32]


def _sequence(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    kind = rng.integers(0, 4)
    if kind == 0:  # periodic: repeats as long as the sequence
        period = rng.integers(0, vocab, int(rng.integers(1, 6)))
        return np.tile(period, length // len(period) + 1)[:length].tolist()
    if kind == 1:
        return np.full(length, rng.integers(0, vocab)).tolist()
    return rng.integers(0, int(rng.integers(1, vocab + 1)), length).tolist()


def _breakers(rng: np.random.Generator, sequence: list[int], vocab: int) -> list[list[int]]:
    """Up to 4 breakers of 1 to 16 ids; most copied from the sequence's last 70 tokens, so that they occur."""
    breakers = []
    for _ in range(int(rng.integers(0, 5))):
        length = int(rng.integers(1, 17)) if rng.random() < 0.5 else 1
        if len(sequence) >= length and rng.random() < 0.7:
            start = int(rng.integers(max(0, len(sequence) - 70), len(sequence) - length + 1))
            breakers.append(sequence[start:start + length])
        else:
            breakers.append(rng.integers(0, vocab, length).tolist())
    return breakers


def _case(seed: int, rows: int, vocab: int, longest: int) -> tuple[dict[str, Any], list[list[int]]]:
    rng = np.random.default_rng(seed)
    sequences = [_sequence(rng, int(rng.integers(0, longest)), vocab) for _ in range(rows)]
    cut = [int(rng.integers(0, len(s) + 1)) for s in sequences]
    params = {
        "prompt_token_ids": [s[:k] for s, k in zip(sequences, cut)],
        "output_token_ids": [s[k:] for s, k in zip(sequences, cut)],
        "no_repeat_ngram_size": rng.choice(NGRAMS, rows).tolist(),
        "dry_multiplier": rng.choice(MULTIPLIERS, rows).tolist(),
        "dry_base": rng.choice(BASES, rows).tolist(),
        "dry_allowed_length": rng.choice(ALLOWED, rows).tolist(),
        "dry_penalty_last_n": rng.choice(WINDOWS, rows).tolist(),
        "dry_sequence_breakers": [_breakers(rng, s, vocab) or None for s in sequences],
    }
    return params, sequences


def _expected(params: dict[str, Any], sequences: list[list[int]], vocab: int) -> torch.Tensor:
    """Zero logits after the reference's bans (-inf) and penalties (DRY is off with a window of 0)."""
    x = np.zeros((len(sequences), vocab), dtype=np.float32)
    with np.errstate(over="ignore"):  # penalties past float32's range
        for row, sequence in enumerate(sequences):
            _reference_row(x[row], params, row, sequence)
    return torch.from_numpy(x)


def _reference_row(x: np.ndarray, params: dict[str, Any], row: int, sequence: list[int]) -> None:
    window = params["dry_penalty_last_n"][row]
    penalties = {} if window == 0 else ref.dry_penalties(
        sequence, params["dry_multiplier"][row], params["dry_base"][row], params["dry_allowed_length"][row], window,
        params["dry_sequence_breakers"][row] or [])
    for token, penalty in penalties.items():
        x[token] -= penalty
    n = params["no_repeat_ngram_size"][row]
    if n:
        x[sorted(ref.ngram_bans(sequence, n))] = -np.inf


def _validated(rows: int, vocab: int, **params: Any):
    return validate_sample_request(build_sample_request(torch.zeros(rows, vocab), seed=1, **params), Limits())[0]


def _processed(batch) -> torch.Tensor:
    x = torch.zeros(batch.num_rows, batch.vocab_size)
    return x if batch.processing is None else apply_processing(x, batch.processing)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (-0.0 and 0.0 alike: a penalty of 0 is none)."""
    diff = (got + 0.0).view(torch.int32) != (want + 0.0).view(torch.int32)
    row, token = (diff.nonzero()[0].tolist() if diff.any() else (None, None))
    assert not diff.any(), f"row {row}, token {token}: got {got[row, token]}, expected {want[row, token]}"


@pytest.mark.parametrize("seed", range(24))
def test_short_sequences_match_the_reference(seed: int) -> None:
    vocab = 3 if seed % 3 == 0 else 8
    params, sequences = _case(seed, rows=12, vocab=vocab, longest=160)
    _assert_same(_processed(_validated(12, vocab, **params)), _expected(params, sequences, vocab))


@pytest.mark.parametrize("seed", range(3))
def test_long_sequences_match_the_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Histories of thousands of tokens: several tiles a row, windows of every size up to the whole sequence, the
    comparisons made a few tiles at a time."""
    monkeypatch.setattr(sequence_samplers, "_CHUNK_POSITIONS", 3000)
    params, sequences = _case(100 + seed, rows=4, vocab=40, longest=5000)
    params["dry_penalty_last_n"] = [-1, 4000, 700, 3]
    _assert_same(_processed(_validated(4, 40, **params)), _expected(params, sequences, 40))


def test_every_n_gram_size_up_to_the_sequence_length() -> None:
    sequence = [1, 2, 3, 1, 2, 3, 1, 2] + [4] * 5 + [1, 2, 3, 1, 2]
    for n in range(1, 33):
        params = {"output_token_ids": sequence, "no_repeat_ngram_size": n}
        want = _expected({**{key: [value] for key, value in params.items()}, "dry_multiplier": [0.0],
                          "dry_base": [1.75], "dry_allowed_length": [2], "dry_penalty_last_n": [-1],
                          "dry_sequence_breakers": [None]}, [sequence], 6)
        _assert_same(_processed(_validated(1, 6, **params)), want)


@pytest.mark.parametrize("seed", range(6))
def test_bans_alone_compare_as_many_columns_as_the_longest_n(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """no-repeat-n-gram without DRY: rows of different n (and rows without it) give the reference's bans while every
    window is compared over the largest n columns only (n - 1 tokens and the sentinel), not HALO."""
    columns: list[int] = []
    original = sequence_samplers._repeats
    monkeypatch.setattr(sequence_samplers, "_repeats", lambda tokens, suffix, width: columns.append(
        suffix.shape[1]) or original(tokens, suffix, width))
    monkeypatch.setattr(sequence_samplers, "_CHUNK_POSITIONS", 3000)
    params, sequences = _case(200 + seed, rows=8, vocab=6, longest=2000)
    params["dry_multiplier"] = [0.0] * 8
    longest_row = max(range(8), key=lambda row: len(sequences[row]))
    assert len(sequences[longest_row]) >= 5
    params["no_repeat_ngram_size"] = [n if row != longest_row else 5 for row, n in
                                      enumerate(np.random.default_rng(seed).choice([0, 1, 2, 3], 8).tolist())]
    _assert_same(_processed(_validated(8, 6, **params)), _expected(params, sequences, 6))
    assert columns == [5]  # the largest n - 1 (4) and the sentinel


def test_rows_taken_apart_merged_and_repeated_keep_their_answers() -> None:
    """select_rows (the CPU backend's chunks), merge_batches (server batching: tiles of other widths and other
    single breakers) and repeated rows (a diffusion step's positions) each give a row what it had alone."""
    batches, answers = [], []
    for seed, (rows, longest) in enumerate([(6, 40), (3, 3000), (5, 300)]):
        params, _ = _case(200 + seed, rows=rows, vocab=8, longest=longest)
        batch = _validated(rows, 8, **params)
        batches.append(batch)
        answers.append(_processed(batch))
    widths = {batch.processing.sequence_samplers.layout.width for batch in batches}
    assert len(widths) > 1  # the merge lays tiles out anew
    merged = merge_batches(batches)
    every = torch.cat(answers)
    _assert_same(_processed(merged), every)
    picked = torch.tensor([9, 0, 13, 2, 7])
    _assert_same(_processed(select_rows(merged, picked)), every[picked])
    repeated = torch.tensor([1, 1, 1, 4, 6, 6, 10, 10, 13])
    sequences = merged.processing.sequence_samplers.rows(repeated)
    assert sequences.instances is not None  # tiles read by several rows, stored once
    processing = type(merged.processing)(sequence_samplers=sequences)
    _assert_same(apply_processing(torch.zeros(len(repeated), 8), processing), every[repeated])
    _assert_same(apply_processing(torch.zeros(3, 8), type(processing)(sequence_samplers=sequences.rows(
        torch.tensor([2, 0, 8])))), every[repeated[[2, 0, 8]]])


def test_a_banned_nan_is_not_flagged_and_a_penalised_one_is() -> None:
    """Bans overwrite the logit (step 2, before step 5 reads NaN); penalties subtract from it."""
    logits = torch.zeros(2, 6)
    logits[:, 3] = float("nan")
    sequence = [1, 3, 2, 1, 3, 2, 1]  # "... 2 1" was followed by 3: both samplers act on token 3
    result = CpuBackend().sample(validate_sample_request(build_sample_request(
        logits, seed=1, output_token_ids=[sequence, sequence], no_repeat_ngram_size=[3, 0],
        dry_multiplier=[0.0, 1.0]), Limits())[0])
    assert result.nan_detected.tolist() == [False, True]


def test_diffusion_positions_get_their_request_rows_bans_and_penalties() -> None:
    """Every masked position of a diffusion step samples as a Sample row of its request at that position."""
    params, _ = _case(300, rows=3, vocab=8, longest=400)
    params["no_repeat_ngram_size"] = [2, 0, 1]
    params["dry_penalty_last_n"] = [-1, 100, 0]
    logits = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(4)) * 3
    mask = torch.ones(3, 5, dtype=torch.uint8)
    step = validate_diffusion_request(build_diffusion_request(logits, mask, seed=[1, 2, 3], temperature=0.0, **params),
                                      Limits())
    tokens = diffusion_step(step[1](step[0].compute()), CpuBackend())[0]
    assert not torch.equal(tokens, logits.argmax(dim=2))  # the bans and penalties move tokens
    for row in range(3):
        alone = {key: [value[row]] for key, value in params.items() if key != "dry_sequence_breakers"}
        if params["dry_sequence_breakers"][row]:
            alone["dry_sequence_breakers"] = params["dry_sequence_breakers"][row]
        for position in range(5):
            request = build_sample_request(logits[row, position].unsqueeze(0), seed=row + 1, position=position,
                                           temperature=0.0, **alone)
            batch = validate_sample_request(request, Limits())[0]
            assert int(tokens[row, position]) == int(CpuBackend().sample(batch).tokens[0, 0]), (row, position)


def test_a_diffusion_step_counts_the_sequence_reads_of_every_position() -> None:
    """Each of a row's L positions reads its sequence again (DRY and no-repeat-n-gram): a history within the read
    bound for one position is refused, by field, when L positions together would pass it."""
    history = [1, 2, 3, 4] * 256  # 1,024 tokens, read by DRY and by the n-gram ban: 2,048 reads a position
    per_position = 2 * len(history)
    length = MAX_SEQUENCE_READS // per_position  # the most positions that fit
    for positions, refused in ((length, False), (length + 1, True)):
        logits = torch.zeros(1, positions, 8)
        request = build_diffusion_request(logits, torch.ones(1, positions, dtype=torch.uint8), seed=[1],
                                          output_token_ids=[history], dry_multiplier=[0.8],
                                          dry_penalty_last_n=[-1], no_repeat_ngram_size=[3])
        if not refused:
            validate_diffusion_request(request, Limits())
            continue
        with pytest.raises(InvalidArgument) as raised:
            validate_diffusion_request(request, Limits())
        assert raised.value.field == "params.output_token_ids" and "would read" in raised.value.message


def test_bans_alone_and_penalties_alone_are_told_apart_from_other_processing() -> None:
    """The CUDA backend's own routes take no-repeat-n-gram alone (a mask) and DRY alone (its kernels): not the two
    together, nor beside a token list, a bias or a penalty."""
    from tokensampler_server.backends.cuda_sequence_samplers import bans_only, penalties_only
    from tokensampler_server.backends.entry_masks import entry_mask

    history = {"output_token_ids": [[1, 2, 1, 2, 1]]}
    ngram, dry = {"no_repeat_ngram_size": 2}, {"dry_multiplier": 0.8}
    alone = _validated(1, 8, **history, **ngram).processing
    assert bans_only(alone) and not penalties_only(alone) and entry_mask(alone, 1, 8) is None
    alone = _validated(1, 8, **history, **dry).processing
    assert penalties_only(alone) and not bans_only(alone)
    both = _validated(1, 8, **history, **ngram, **dry).processing
    assert not bans_only(both) and not penalties_only(both)
    for extra in ({"banned_token_ids": [[3]]}, {"logit_bias": {4: 1.0}}, {"repetition_penalty": 1.2}):
        for sampler in (ngram, dry):
            processing = _validated(1, 8, **history, **sampler, **extra).processing
            assert not bans_only(processing) and not penalties_only(processing), (sampler, extra)
    assert not bans_only(_validated(1, 8, output_token_ids=[[1, 2, 1]], no_repeat_ngram_size=0,
                                    banned_token_ids=[[3]]).processing)  # no sequence sampler at all
