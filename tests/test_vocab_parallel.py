"""Vocabulary-parallel sampling (backends/vocab_parallel.py) over gloo on the CPU, against the single-device reference.

RANKS processes are spawned once (torch.multiprocessing, loopback, one torch thread a rank); each layout of shards
runs every case on a group of them, and the tests compare what every rank returned with CpuBackend on the whole
vocabulary: the same tokens, valid and NaN flags and top log-prob ids, log-probs to fp32 rounding (RTOL, ATOL). The
chi-square test draws DRAWS seeded rows and fails when p < ALPHA (significance 0.001) or when a token outside the
distribution's support is drawn. The failure tests bound how long a rank waits when another raises, stalls or dies.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.philox import random_words
from tokensampler_server.backends.vocab_parallel import (
    CANDIDATES,
    Exchange,
    Shard,
    ShardExchangeError,
    order_keys,
    sample_sharded,
    shard_head,
    threshold_search,
)
from tokensampler_server.model.sampling import HiddenInput, LogprobsMode, SamplingBatch, SamplingResult
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from .batches import make_batch
from .local_reference import filtered_distribution

RTOL = ATOL = 1e-5
ALPHA = 1e-3
DRAWS = 20_000
STALL_TIMEOUT_S = 2.0
# A rank told of a peer's failure answers in well under a second; one left waiting gives up after the timeout.
FLAGGED_WITHIN_S = 1.0
DEADLINE_S = 240.0
PROCESSED = LogprobsMode.PROCESSED


@dataclass(frozen=True)
class Layout:
    vocab_size: int
    bounds: tuple[int, ...]
    """Rank r holds tokens [bounds[r], bounds[r + 1])."""
    candidates: int
    seeds: int
    """Each base row is sampled under this many seeds."""
    hidden_size: int = 0
    """Above 0: the layout also samples hidden states through a head of this width."""

    @property
    def ranks(self) -> int:
        return len(self.bounds) - 1


PAIR_LAYOUT, TRIO_LAYOUT = "2 ranks, 333 + 667 of 1000", "3 ranks, 20 + 50 + 41 of 111, 8 candidates"
LAYOUTS = {
    PAIR_LAYOUT: Layout(1000, (0, 333, 1000), CANDIDATES, seeds=100, hidden_size=48),
    # Few candidates, so that most filtered rows take the threshold search even at this size.
    TRIO_LAYOUT: Layout(111, (0, 20, 70, 111), 8, seeds=200),
}
# The processes: the 2-rank layout runs on a group of the first two.
RANKS = 3


def _large_k(vocab_size: int) -> int:
    """A k beyond every shard's size but the widest, and beyond the candidates."""
    return vocab_size // 2 + 10


CASES = {
    "greedy": dict(temperature=0.0),
    "greedy, raw log-probs": dict(temperature=0.0, return_logprobs=True, top_logprobs=5),
    "greedy, processed log-probs of the filtered set": dict(
        temperature=0.0, top_k=30, top_p=0.7, min_p=0.05, return_logprobs=True, logprobs_mode=PROCESSED,
        top_logprobs=5),
    "Gumbel T = 0.8, raw log-probs": dict(temperature=0.8, return_logprobs=True, top_logprobs=5),
    "Gumbel T = 1, processed log-probs": dict(temperature=1.0, return_logprobs=True, logprobs_mode=PROCESSED,
                                             top_logprobs=4),
    "top-k 5": dict(temperature=0.8, top_k=5, return_logprobs=True),
    "top-k beyond a shard": dict(temperature=0.8, top_k="large", return_logprobs=True, logprobs_mode=PROCESSED,
                                 top_logprobs=3),
    "top-p 0.1": dict(temperature=0.8, top_p=0.1),
    "top-p 0.5": dict(temperature=0.8, top_p=0.5, return_logprobs=True, logprobs_mode=PROCESSED, top_logprobs=5),
    "top-p 0.99": dict(temperature=1.2, top_p=0.99, return_logprobs=True, logprobs_mode=PROCESSED),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05, return_logprobs=True, logprobs_mode=PROCESSED, top_logprobs=2),
    "min-p 0.3": dict(temperature=1.0, min_p=0.3),
    "top-k beyond a shard + top-p 0.9 + min-p 0.02": dict(
        temperature=0.7, top_k="large", top_p=0.9, min_p=0.02, return_logprobs=True, logprobs_mode=PROCESSED,
        top_logprobs=6),
    "top-k 20 + top-p 0.8": dict(temperature=0.9, top_k=20, top_p=0.8),
    "3 samples, top-p 0.9": dict(temperature=1.0, top_p=0.9, num_samples=3, return_logprobs=True),
    "per-row parameters": dict(return_logprobs=True, top_logprobs=3),
}


def _base_rows(vocab_size: int, bounds: tuple[int, ...]) -> torch.Tensor:
    """Logit rows of every kind: flat, spiky, heavily tied, masked with NaN and +inf, finite in one shard only,
    and without a finite logit."""
    gen = torch.Generator().manual_seed(vocab_size)
    flat = torch.randn(vocab_size, generator=gen)
    spiky = torch.randn(vocab_size, generator=gen) * 4
    tied = torch.randint(-4, 3, (vocab_size,), generator=gen).to(torch.float32)
    masked = torch.randn(vocab_size, generator=gen) * 2
    masked[torch.rand(vocab_size, generator=gen) < 0.4] = float("-inf")
    masked[3], masked[vocab_size - 2] = float("nan"), float("inf")
    one_shard = torch.full((vocab_size,), float("-inf"))
    one_shard[bounds[-2]:bounds[-2] + 6] = torch.tensor([1.0, 3.0, 3.0, -1.0, 0.5, 3.0])
    invalid = torch.full((vocab_size,), float("nan"))
    return torch.stack([flat, spiky, tied, masked, one_shard, invalid])


def case_batch(name: str, layout: Layout) -> SamplingBatch:
    """The batch of a case: every base row under the layout's seeds."""
    base = _base_rows(layout.vocab_size, layout.bounds)
    logits = base.repeat_interleave(layout.seeds, dim=0)
    rows = logits.shape[0]
    params = dict(CASES[name])
    if params.get("top_k") == "large":
        params["top_k"] = _large_k(layout.vocab_size)
    if name == "per-row parameters":
        gen = torch.Generator().manual_seed(7)

        def pick(options: list[float]) -> torch.Tensor:
            return torch.tensor(options)[torch.randint(len(options), (rows,), generator=gen)]

        params.update(temperature=pick([0.0, 0.5, 1.0, 1.5]), top_k=pick([0, 3, 40, _large_k(layout.vocab_size)]),
                      top_p=pick([1.0, 0.3, 0.9, 0.99]), min_p=pick([0.0, 0.01, 0.2]))
    seeds = torch.arange(rows)
    return make_batch(logits, seed=seeds, position=seeds % 7, iteration=3, **params)


def hidden_batch(layout: Layout) -> tuple[SamplingBatch, RegisteredWeight]:
    """Hidden states through a head with a bias and a soft cap, top-k + top-p with log-probs."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(layout.vocab_size, layout.hidden_size, generator=gen) * 0.3
    finish = LogitsFinish(vocab_size=layout.vocab_size, bias=torch.randn(layout.vocab_size, generator=gen) * 0.1,
                          soft_cap=20.0)
    head = RegisteredWeight(name="head", weight=weight, finish=finish, sha256="")
    rows = 4 * layout.seeds
    states = torch.randn(rows, layout.hidden_size, generator=gen)
    batch = make_batch(torch.empty(rows, 0), seed=torch.arange(rows), temperature=0.9, top_k=50, top_p=0.9,
                       return_logprobs=True)
    return replace(batch, logits=None, hidden=HiddenInput(states, head)), head


# Tokens a shard in the direct test of the threshold search: enough for several rounds before the finish.
SEARCH_WIDTH = 20_000
SEARCH_K, SEARCH_P = 12_345, 0.9


def search_rows(ranks: int) -> torch.Tensor:
    """z [4, ranks * SEARCH_WIDTH], max 0: two rows of a bf16 head (ties everywhere), two of fp32 logits."""
    x = torch.randn(4, ranks * SEARCH_WIDTH, generator=torch.Generator().manual_seed(3)) * 3
    x[:2] = x[:2].bfloat16().float()
    return x - x.max(dim=1, keepdim=True).values


class CountingExchange(Exchange):
    """Counts the all-reduces, so that a test knows the search took several rounds."""

    reductions = 0

    def reduce(self, *args, **kwargs) -> torch.Tensor:
        self.reductions += 1
        return super().reduce(*args, **kwargs)


CHI_LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -2.0, 1.0, 0.7, -3.0, 0.2, 1.5])
CHI_PARAMS = dict(temperature=0.8, top_k=7, top_p=0.8)
CHI_SPLIT = 5
CHI_CANDIDATES = {"merged candidates": CANDIDATES, "threshold search": 1}


def chi_batch() -> SamplingBatch:
    logits = CHI_LOGITS.unsqueeze(0).expand(DRAWS, -1).contiguous()
    return make_batch(logits, seed=torch.arange(DRAWS), **CHI_PARAMS)


def result_dict(result: SamplingResult) -> dict[str, torch.Tensor | None]:
    return {name: getattr(result, name) for name in
            ("tokens", "valid", "nan_detected", "logprobs", "top_logprob_ids", "top_logprobs")}


def shard_of(batch: SamplingBatch, start: int, stop: int) -> SamplingBatch:
    return replace(batch, logits=batch.logits[:, start:stop].contiguous())


def _timed_failure(call: Callable[[], object]) -> dict[str, object]:
    started = time.monotonic()
    try:
        call()
    except ShardExchangeError as err:
        return {"error": str(err), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _run_layout(rank: int, layout: Layout, group: dist.ProcessGroup | None) -> dict[str, object]:
    """Every case of a layout on this rank's shard; with a head width, hidden states and the chi-square draws."""
    start, stop = layout.bounds[rank], layout.bounds[rank + 1]
    shard = Shard(start, layout.vocab_size)
    record: dict[str, object] = {}
    for name in CASES:
        batch = shard_of(case_batch(name, layout), start, stop)
        record[name] = result_dict(sample_sharded(batch, shard, group, candidates=layout.candidates))
    if layout.hidden_size:
        batch, head = hidden_batch(layout)
        sharded = replace(batch, hidden=HiddenInput(batch.hidden.states, shard_head(head, start, stop)))
        record["hidden"] = result_dict(sample_sharded(sharded, shard, group, candidates=layout.candidates))
        chi_bounds = (0, CHI_SPLIT, CHI_LOGITS.numel())
        for variant, candidates in CHI_CANDIDATES.items():
            batch = shard_of(chi_batch(), chi_bounds[rank], chi_bounds[rank + 1])
            chi_shard = Shard(chi_bounds[rank], CHI_LOGITS.numel())
            record[f"chi {variant}"] = sample_sharded(batch, chi_shard, group, candidates=candidates).tokens
    return record


def _worker(rank: int, port: int, out: str) -> None:
    """One of RANKS processes: the cases of every layout it holds a shard of, the search alone, then the failures
    (a stall spends its group, a death every group: they come last)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=120))
    pair = dist.new_group([0, 1])  # every rank makes every group, in the same order
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
    record: dict[str, object] = {}
    for name, layout in LAYOUTS.items():
        if rank < layout.ranks:
            record[name] = _run_layout(rank, layout, None if layout.ranks == RANKS else pair)

    z = search_rows(RANKS)[:, rank * SEARCH_WIDTH:(rank + 1) * SEARCH_WIDTH]
    keys = order_keys(z, rank * SEARCH_WIDTH)
    exchange = CountingExchange(None)
    record["search k"] = threshold_search(exchange, "k", keys, torch.ones(keys.shape, dtype=torch.float64),
                                          target=torch.full((4,), float(SEARCH_K), dtype=torch.float64))
    record["search k reductions"] = exchange.reductions
    record["search p"] = threshold_search(exchange, "p", keys, torch.exp(z).to(torch.float64),
                                          fraction=torch.full((4,), SEARCH_P))

    if rank < 2:
        # A rank whose own step raises (a shard that does not fit the vocabulary) is named at once to the other,
        # and the group still serves the next call.
        layout = LAYOUTS[PAIR_LAYOUT]
        start, stop = layout.bounds[rank], layout.bounds[rank + 1]
        small = shard_of(case_batch("top-k 5", layout), start, stop)
        wrong = Shard(layout.vocab_size - 1 if rank == 1 else start, layout.vocab_size)
        record["raises"] = _timed_failure(lambda: sample_sharded(small, wrong, pair))
        record["after raise"] = sample_sharded(small, Shard(start, layout.vocab_size), pair).tokens
        # Rank 1 stalls past the short group's timeout.
        if rank == 1:
            time.sleep(STALL_TIMEOUT_S + 1)
        else:
            record["stalls"] = _timed_failure(lambda: sample_sharded(small, Shard(start, layout.vocab_size), short))
    # The last rank dies.
    layout = LAYOUTS[TRIO_LAYOUT]
    start, stop = layout.bounds[rank], layout.bounds[rank + 1]
    small = shard_of(case_batch("top-k 5", layout), start, stop)
    dist.barrier()
    if rank == RANKS - 1:
        torch.save(record, Path(out) / f"rank{rank}.pt")
        os._exit(0)
    record["dies"] = _timed_failure(lambda: sample_sharded(small, Shard(start, layout.vocab_size)))
    torch.save(record, Path(out) / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_ranks(worker: Callable[[int, int, str], None], ranks: int, folder: Path,
                deadline_s: float) -> dict[int, dict]:
    """{rank: what the rank saved}: runs worker(rank, port, folder) in `ranks` spawned processes, each of which saves
    its record to folder/rank<r>.pt; kills them and fails the test past deadline_s."""
    context = mp.start_processes(worker, args=(_free_port(), str(folder)), nprocs=ranks, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {deadline_s} s")
    return {rank: torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """{rank: what the rank recorded}, from one run of RANKS processes."""
    return spawn_ranks(_worker, RANKS, tmp_path_factory.mktemp("ranks"), DEADLINE_S)


def assert_same(got: dict[str, torch.Tensor | None], want: SamplingResult) -> None:
    differ = (got["tokens"] != want.tokens).any(dim=1).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} rows differ, first {differ[:5].tolist()}: " \
        f"{got['tokens'][differ[:5]].tolist()} against {want.tokens[differ[:5]].tolist()}"
    assert torch.equal(got["valid"], want.valid) and torch.equal(got["nan_detected"], want.nan_detected)
    if want.logprobs is not None:
        torch.testing.assert_close(got["logprobs"], want.logprobs, rtol=RTOL, atol=ATOL, equal_nan=True)
    if want.top_logprob_ids is not None:
        assert torch.equal(got["top_logprob_ids"], want.top_logprob_ids)
        torch.testing.assert_close(got["top_logprobs"], want.top_logprobs, rtol=RTOL, atol=ATOL, equal_nan=True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_same_as_one_device(runs: dict, layout_name: str, case: str) -> None:
    layout = LAYOUTS[layout_name]
    want = CpuBackend().sample(case_batch(case, layout))
    for rank in range(layout.ranks):
        assert_same(runs[rank][layout_name][case], want)


def test_hidden_states_same_as_one_device(runs: dict) -> None:
    batch, _ = hidden_batch(LAYOUTS[PAIR_LAYOUT])
    assert_same(runs[0][PAIR_LAYOUT]["hidden"], CpuBackend().sample(batch))


@pytest.mark.parametrize("variant", CHI_CANDIDATES)
def test_chi_square_top_k_top_p(runs: dict, variant: str) -> None:
    tokens = runs[0][PAIR_LAYOUT][f"chi {variant}"][:, 0]
    counts = np.bincount(tokens.numpy(), minlength=CHI_LOGITS.numel())
    expected = filtered_distribution(CHI_LOGITS.numpy().astype(np.float64), **CHI_PARAMS)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {np.nonzero(counts * ~support)}"
    _, p_value = stats.chisquare(counts[support], expected[support] * DRAWS)
    assert p_value >= ALPHA, f"chi-square p = {p_value:.2e} < {ALPHA}"


def test_threshold_search_over_several_rounds(runs: dict) -> None:
    """The k-th token of the order and the token where the running mass reaches p, over 3 shards of 20,000 tokens
    with and without ties, against a sort of the whole row."""
    z = search_rows(RANKS)
    keys, order = order_keys(z, 0).sort(dim=1)
    assert runs[0]["search k reductions"] >= 2  # two rounds or more before the finish
    mass = torch.exp(z).to(torch.float64).gather(1, order).cumsum(dim=1)
    reached = (mass >= SEARCH_P * mass[:, -1:]).to(torch.int8).argmax(dim=1, keepdim=True)
    for rank in range(RANKS):
        assert torch.equal(runs[rank]["search k"], keys[:, SEARCH_K - 1])
        assert torch.equal(runs[rank]["search p"], keys.gather(1, reached).squeeze(1))


def test_a_rank_that_raises_is_named_at_once(runs: dict) -> None:
    peer, failing = runs[0]["raises"], runs[1]["raises"]
    assert "failed on rank(s) [1] of 2" in peer["error"] and "group is still usable" in peer["error"]
    assert peer["seconds"] < FLAGGED_WITHIN_S
    assert "failed on this shard (rank 1)" in failing["error"] and "do not fit" in failing["error"]
    for rank in (0, 1):
        assert torch.equal(runs[rank]["after raise"], runs[rank][PAIR_LAYOUT]["top-k 5"]["tokens"])


def test_a_rank_that_stalls_times_out_the_others(runs: dict) -> None:
    peer = runs[0]["stalls"]
    assert peer["error"] is not None and "stalled past the group's timeout or died" in peer["error"]
    assert STALL_TIMEOUT_S * 0.9 <= peer["seconds"] < STALL_TIMEOUT_S + 5


def test_a_rank_that_dies_fails_the_others(runs: dict) -> None:
    for rank in range(RANKS - 1):
        record = runs[rank]["dies"]
        assert record["error"] is not None and "stalled past the group's timeout or died" in record["error"]
        assert record["seconds"] < FLAGGED_WITHIN_S


def test_noise_of_a_slice_is_the_noise_of_its_global_ids() -> None:
    seed, position, iteration = torch.tensor([5, -3]), torch.tensor([2, 9]), torch.tensor([0, 4])
    whole = random_words(seed, position, iteration, 1, 103)
    for start, stop in ((0, 3), (1, 2), (6, 103), (33, 70)):
        assert torch.equal(random_words(seed, position, iteration, 1, stop - start, start), whole[:, start:stop])


@pytest.mark.parametrize("vocab,shards", [(151936, 2), (262144, 4), (1000, 3), (129, 2), (128, 1), (32000, 7)])
def test_shard_bounds_tile_the_vocabulary_in_whole_tiles(vocab: int, shards: int) -> None:
    """The fused path's split (cuda_vocab_parallel.shard_bounds): contiguous, covering [0, V), each shard starting
    at a multiple of the kernel's 128-row tile, sizes within one tile of each other but for the last's tail."""
    from tokensampler_server.backends.cuda_vocab_parallel import TILE_ROWS, shard_bounds

    bounds = shard_bounds(vocab, shards)
    assert len(bounds) == shards and bounds[0][0] == 0 and bounds[-1][1] == vocab
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))
    assert all(start % TILE_ROWS == 0 and stop > start for start, stop in bounds)
    tiles = [-(-(stop - start) // TILE_ROWS) for start, stop in bounds]
    assert max(tiles) - min(tiles) <= 1


def test_shard_bounds_refuse_more_shards_than_tiles() -> None:
    from tokensampler_server.backends.cuda_vocab_parallel import shard_bounds

    with pytest.raises(ValueError, match="devices: 3 shards of a vocabulary of 200 tokens"):
        shard_bounds(200, 3)
