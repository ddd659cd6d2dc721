"""DRY's restart search (model/repetition.py _restart_caps): exact against a naive reading of L3.1, bounded in memory,
and counted towards what sends a request's token lists off the event loop.

Three 4 KB Sample requests (2048 rows of V=1, one 66-token history shared by every row, 32 one-id breakers) froze
the event loop 3.6 s and took 1.3 GB: the search laid every breaker out at each of the tail's 66 starts as 16 int64
(SampleDiffusionStep, validated on threads, took 7 GB with six at once)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import build_sample_request
from tokensampler_server.core.config import Limits
from tokensampler_server.model import repetition
from tokensampler_server.model.repetition import DRY_MAX_REPEAT, MAX_BREAKER_LENGTH, MAX_BREAKERS, Breakers
from tokensampler_server.validation.sample import OFF_LOOP_ENTRIES, decode_token_lists, heavy_token_lists
from tokensampler_server.validation.workloads import validate_diffusion_request

MIB = 1 << 20


def _reference_cap(sequence: Sequence[int], window: int, breakers: Sequence[Sequence[int]]) -> int:
    """L3.1 read naively over the whole window: the tokens after the latest-starting breaker occurrence (the longest
    there), the window when none occurs, at most DRY_MAX_REPEAT."""
    tokens = list(sequence[len(sequence) - window:])
    limit = window
    for start in range(window - 1, -1, -1):
        fits = [len(b) for b in breakers if tokens[start:start + len(b)] == list(b)]
        if fits:
            limit = window - start - max(fits)
            break
    return min(limit, DRY_MAX_REPEAT)


def _random_breakers(rng: np.random.Generator, sequence: list[int], vocab: int, count: int) -> list[list[int]]:
    """1 to 16 ids each, most copied from the sequence's tail so that long ones occur too."""
    breakers = []
    for _ in range(count):
        length = int(rng.integers(1, MAX_BREAKER_LENGTH + 1))
        start = len(sequence) - int(rng.integers(length, length + 80))
        if rng.random() < 0.7 and start >= 0:
            breakers.append(sequence[start:start + length])
        else:
            breakers.append(rng.integers(0, vocab, length).tolist())
    return breakers


def _caps(sequences: list[list[int]], windows: list[int], breakers: list[list[list[int]]], shared: bool,
          rows: np.ndarray) -> np.ndarray:
    """_restart_caps of `rows` with each row's breakers (or the first row's given once to every row)."""
    tokens = np.array([t for s in sequences for t in s], dtype=np.int64)
    ends = np.cumsum([len(s) for s in sequences])
    lists = breakers[:1] if shared else breakers
    flat = [b for row in lists for b in row]
    count = np.array([len(row) for row in lists], dtype=np.int64)
    built = Breakers.build(np.array([t for b in flat for t in b], dtype=np.int64),
                           np.array([len(b) for b in flat], dtype=np.int64),
                           np.zeros(len(sequences), dtype=np.int64) if shared else np.cumsum(count) - count,
                           np.full(len(sequences), count[0]) if shared else count)
    return repetition._restart_caps(tokens, ends, np.array(windows, dtype=np.int64), built, rows)


@pytest.mark.parametrize("search_rows", [3, repetition.SEARCH_ROWS])
def test_the_breaker_search_matches_a_naive_reading(search_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random windows, sequences and breakers (shared and per row, some rows without any), several blocks of rows."""
    monkeypatch.setattr(repetition, "SEARCH_ROWS", search_rows)
    rng = np.random.default_rng(20261201)
    for case in range(200):
        num_rows, vocab = int(rng.integers(1, 10)), int(rng.integers(1, 4))
        sequences = [rng.integers(0, vocab, int(rng.integers(2, 160))).tolist() for _ in range(num_rows)]
        windows = [min(len(s), int(rng.choice([2, 3, 17, 50, 66, 67, 90, 1000]))) for s in sequences]
        shared = case % 3 == 0
        breakers = [_random_breakers(rng, s, vocab, int(rng.integers(1 if shared else 0, MAX_BREAKERS + 1)))
                    for s in sequences]
        rows = np.nonzero(rng.random(num_rows) < 0.8)[0]
        got = _caps(sequences, windows, breakers, shared, rows)
        want = [_reference_cap(sequences[r], windows[r], breakers[0 if shared else r]) for r in rows]
        assert got.tolist() == want, case


def test_constant_sequences_restart_after_the_latest_longest_breaker() -> None:
    """Every breaker occurs at every start: the latest start wins, then the longest breaker there."""
    sequence = [0] * 70
    for lengths in ([1], [16], [3, 16, 1], [MAX_BREAKER_LENGTH] * MAX_BREAKERS):
        breakers = [[0] * n for n in lengths]
        assert _caps([sequence], [70], [breakers], False, np.array([0])).tolist() == [0]
    assert _caps([sequence + [1, 1]], [72], [[[0] * 16, [0, 1]]], True, np.array([0])).tolist() == [1]
    assert _caps([[1] * 60 + [0] * 3], [63], [[[0] * 4]], True, np.array([0])).tolist() == [DRY_MAX_REPEAT]


def _reproducer(rows: int, breaker_length: int = 1) -> pb.SampleRequest:
    """The audit's request: V=1, one 66-token history of zeros given to every row, 32 breakers of zeros."""
    request = build_sample_request(torch.zeros(rows, 1, dtype=torch.float16), seed=1, dry_multiplier=1.0)
    params = request.params
    params.output_token_ids.ids.extend([0] * 66)
    params.output_token_ids.lengths.append(66)
    params.dry_sequence_breakers.ids.extend([0] * (MAX_BREAKERS * breaker_length))
    params.dry_sequence_breakers.lengths.extend([breaker_length] * MAX_BREAKERS)
    return request


def _peak(work: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("breaker_length", [1, MAX_BREAKER_LENGTH])
def test_the_reproducer_is_decoded_off_the_event_loop_in_bounded_memory(breaker_length: int) -> None:
    """2048 rows × 32 breakers × 66 starts: off the event loop, and within a few MiB (before: 1.3 GB for one-id
    breakers, many GB for 16-id ones)."""
    request = _reproducer(2048, breaker_length)
    assert request.ByteSize() < 5000
    assert heavy_token_lists(request)
    peak = _peak(lambda: decode_token_lists(request, Limits()))
    assert peak < 64 * MIB, peak


def test_a_diffusion_step_is_validated_in_bounded_memory() -> None:
    """SampleDiffusionStep validates on threads, several at once: each stays within a few MiB (before: 1.2 GB)."""
    sample = _reproducer(2048)
    request = pb.DiffusionStepRequest(
        logits=pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[2048, 2, 1], data=b"\0\0" * 4096),
        mask=pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[2048, 2], data=b"\1" * 4096), params=sample.params)
    peak = _peak(lambda: validate_diffusion_request(request, Limits()))
    assert peak < 64 * MIB, peak


def test_the_search_of_the_most_rows_is_bounded_in_memory() -> None:
    """4096 distinct rows of 32 breakers of 16 ids, every one occurring at every start (the most comparisons):
    temporaries of SEARCH_ROWS rows at a time, a few MiB (before: 5.8 s and several GB)."""
    rows, per_row = 4096, MAX_BREAKERS
    breakers = Breakers.build(np.zeros(rows * per_row * MAX_BREAKER_LENGTH, dtype=np.int64),
                              np.full(rows * per_row, MAX_BREAKER_LENGTH, dtype=np.int64),
                              np.arange(rows, dtype=np.int64) * per_row, np.full(rows, per_row, dtype=np.int64))
    tokens, ends, windows = np.zeros(66 * rows, dtype=np.int64), np.arange(1, rows + 1) * 66, np.full(rows, 66)
    peak = _peak(lambda: repetition._restart_caps(tokens, ends, windows, breakers, np.arange(rows)))
    assert peak < 32 * MIB, peak


def test_few_searched_breakers_stay_on_the_event_loop() -> None:
    """The search counts rows × breakers × starts, each up to what validation accepts."""
    request = _reproducer(8)
    assert not heavy_token_lists(request)  # 8 × 32 × 66 starts
    many = _reproducer(8)
    many.params.dry_sequence_breakers.lengths.extend([1] * 10_000)  # refused from the count: never searched
    many.params.dry_sequence_breakers.ids.extend([0] * 10_000)
    assert not heavy_token_lists(many)
    rows = OFF_LOOP_ENTRIES // (MAX_BREAKERS * repetition.BREAKER_STARTS) + 1
    assert heavy_token_lists(_reproducer(rows))
