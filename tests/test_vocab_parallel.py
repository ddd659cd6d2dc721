"""Vocabulary-parallel sampling (backends/vocab_parallel.py) over gloo on the CPU, against the single-device reference.

Each world of ranks is spawned once (torch.multiprocessing, loopback, one torch thread a rank) and runs every case;
the tests compare what its ranks returned with CpuBackend on the whole vocabulary: the same tokens, valid and NaN
flags and top log-prob ids, log-probs to fp32 rounding (RTOL, ATOL). The chi-square test draws DRAWS seeded rows
and fails when p < ALPHA (significance 0.001) or when a token outside the distribution's support is drawn. The
failure tests bound how long a rank waits when another raises, stalls or dies.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
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
from tokensampler_server.sampling import HiddenInput, LogprobsMode, SamplingBatch, SamplingResult
from tokensampler_server.weights import LogitsFinish, RegisteredWeight

from .batches import make_batch
from .local_reference import filtered_distribution

RTOL = ATOL = 1e-5
ALPHA = 1e-3
DRAWS = 20_000
STALL_TIMEOUT_S = 2.0
# A rank told of a peer's failure answers in well under a second; one left waiting gives up after the timeout.
FLAGGED_WITHIN_S = 1.0
WORLD_DEADLINE_S = 240.0
PROCESSED = LogprobsMode.PROCESSED


@dataclass(frozen=True)
class World:
    vocab_size: int
    bounds: tuple[int, ...]
    """Rank r holds tokens [bounds[r], bounds[r + 1])."""
    candidates: int
    seeds: int
    """Each base row is sampled under this many seeds."""
    hidden_size: int = 0
    """Above 0: the world also samples hidden states through a head of this width."""

    @property
    def ranks(self) -> int:
        return len(self.bounds) - 1


WORLDS = {
    "2 ranks, 333 + 667 of 1000": World(1000, (0, 333, 1000), CANDIDATES, seeds=100, hidden_size=48),
    # Few candidates, so that most filtered rows take the threshold search even at this size.
    "3 ranks, 20 + 50 + 41 of 111, 8 candidates": World(111, (0, 20, 70, 111), 8, seeds=200),
}


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


def case_batch(name: str, world: World) -> SamplingBatch:
    """The batch of a case: every base row under the world's seeds."""
    base = _base_rows(world.vocab_size, world.bounds)
    logits = base.repeat_interleave(world.seeds, dim=0)
    rows = logits.shape[0]
    params = dict(CASES[name])
    if params.get("top_k") == "large":
        params["top_k"] = _large_k(world.vocab_size)
    if name == "per-row parameters":
        gen = torch.Generator().manual_seed(7)

        def pick(options: list[float]) -> torch.Tensor:
            return torch.tensor(options)[torch.randint(len(options), (rows,), generator=gen)]

        params.update(temperature=pick([0.0, 0.5, 1.0, 1.5]), top_k=pick([0, 3, 40, _large_k(world.vocab_size)]),
                      top_p=pick([1.0, 0.3, 0.9, 0.99]), min_p=pick([0.0, 0.01, 0.2]))
    seeds = torch.arange(rows)
    return make_batch(logits, seed=seeds, position=seeds % 7, iteration=3, **params)


def hidden_batch(world: World) -> tuple[SamplingBatch, RegisteredWeight]:
    """Hidden states through a head with a bias and a soft cap, top-k + top-p with log-probs."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(world.vocab_size, world.hidden_size, generator=gen) * 0.3
    finish = LogitsFinish(vocab_size=world.vocab_size, bias=torch.randn(world.vocab_size, generator=gen) * 0.1,
                          soft_cap=20.0)
    head = RegisteredWeight(name="head", weight=weight, finish=finish, sha256="")
    rows = 4 * world.seeds
    states = torch.randn(rows, world.hidden_size, generator=gen)
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


def _result_dict(result: SamplingResult) -> dict[str, torch.Tensor | None]:
    return {name: getattr(result, name) for name in
            ("tokens", "valid", "nan_detected", "logprobs", "top_logprob_ids", "top_logprobs")}


def _shard_of(batch: SamplingBatch, start: int, stop: int) -> SamplingBatch:
    return replace(batch, logits=batch.logits[:, start:stop].contiguous())


def _timed_failure(call) -> dict[str, object]:
    started = time.monotonic()
    try:
        call()
    except ShardExchangeError as err:
        return {"error": str(err), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _worker(rank: int, world_name: str, port: int, out: str) -> None:
    """One rank of a world: every case on its shard, then the failures (the stall last: it spends the group)."""
    torch.set_num_threads(1)
    world = WORLDS[world_name]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world.ranks,
                            timeout=datetime.timedelta(seconds=120))
    start, stop = world.bounds[rank], world.bounds[rank + 1]
    shard = Shard(start, world.vocab_size)
    record: dict[str, object] = {}
    for name in CASES:
        batch = case_batch(name, world)
        record[name] = _result_dict(sample_sharded(_shard_of(batch, start, stop), shard, candidates=world.candidates))
    if world.hidden_size:
        batch, head = hidden_batch(world)
        sharded = replace(batch, hidden=HiddenInput(batch.hidden.states, shard_head(head, start, stop)))
        record["hidden"] = _result_dict(sample_sharded(sharded, shard, candidates=world.candidates))
        chi_bounds = (0, CHI_SPLIT, CHI_LOGITS.numel())
        for variant, candidates in CHI_CANDIDATES.items():
            batch = _shard_of(chi_batch(), chi_bounds[rank], chi_bounds[rank + 1])
            tokens = sample_sharded(batch, Shard(chi_bounds[rank], CHI_LOGITS.numel()), candidates=candidates).tokens
            record[f"chi {variant}"] = tokens
        # A rank whose own step raises (a shard that does not fit the vocabulary) is named at once to the others,
        # and the group still serves the next call.
        small = case_batch("top-k 5", world)
        wrong = Shard(world.vocab_size - 1 if rank == 1 else start, world.vocab_size)
        record["raises"] = _timed_failure(lambda: sample_sharded(_shard_of(small, start, stop), wrong))
        record["after raise"] = sample_sharded(_shard_of(small, start, stop), shard).tokens
        # A rank that stalls past the timeout.
        group = dist.new_group(list(range(world.ranks)), timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
        if rank == 1:
            time.sleep(STALL_TIMEOUT_S + 1)
        record["stalls"] = _timed_failure(lambda: sample_sharded(_shard_of(small, start, stop), shard, group))
    else:
        z = search_rows(world.ranks)[:, rank * SEARCH_WIDTH:(rank + 1) * SEARCH_WIDTH]
        keys = order_keys(z, rank * SEARCH_WIDTH)
        exchange = CountingExchange(None)
        record["search k"] = threshold_search(exchange, "k", keys, torch.ones(keys.shape, dtype=torch.float64),
                                              target=torch.full((4,), float(SEARCH_K), dtype=torch.float64))
        record["search k reductions"] = exchange.reductions
        record["search p"] = threshold_search(exchange, "p", keys, torch.exp(z).to(torch.float64),
                                              fraction=torch.full((4,), SEARCH_P))
        # A rank that dies.
        small = case_batch("top-k 5", world)
        dist.barrier()
        if rank == world.ranks - 1:
            os._exit(0)
        record["dies"] = _timed_failure(lambda: sample_sharded(_shard_of(small, start, stop), shard))
    torch.save(record, Path(out) / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """{world: {rank: what the rank recorded}}, each world run once in processes of its own."""
    folders = {name: tmp_path_factory.mktemp(f"world{index}") for index, name in enumerate(WORLDS)}
    # The worlds run side by side: their waits (process start, the stall, the timeout) overlap.
    contexts = {name: mp.start_processes(_worker, args=(name, _free_port(), str(folders[name])),
                                         nprocs=world.ranks, join=False, start_method="spawn")
                for name, world in WORLDS.items()}
    deadline = time.monotonic() + WORLD_DEADLINE_S
    for name, context in contexts.items():
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in (process for context in contexts.values() for process in context.processes):
                    process.kill()
                pytest.fail(f"{name}: the ranks did not finish within {WORLD_DEADLINE_S} s")
    return {name: {rank: torch.load(path, weights_only=False) for rank in range(world.ranks)
                   if (path := folders[name] / f"rank{rank}.pt").exists()}
            for name, world in WORLDS.items()}


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
@pytest.mark.parametrize("world_name", WORLDS)
def test_same_as_one_device(runs: dict, world_name: str, case: str) -> None:
    world = WORLDS[world_name]
    want = CpuBackend().sample(case_batch(case, world))
    for rank in range(world.ranks):
        if case in runs[world_name].get(rank, {}):
            assert_same(runs[world_name][rank][case], want)
    assert case in runs[world_name][0]


def test_hidden_states_same_as_one_device(runs: dict) -> None:
    name, world = next((name, world) for name, world in WORLDS.items() if world.hidden_size)
    batch, _ = hidden_batch(world)
    assert_same(runs[name][0]["hidden"], CpuBackend().sample(batch))


@pytest.mark.parametrize("variant", CHI_CANDIDATES)
def test_chi_square_top_k_top_p(runs: dict, variant: str) -> None:
    name = next(name for name, world in WORLDS.items() if world.hidden_size)
    tokens = runs[name][0][f"chi {variant}"][:, 0]
    counts = np.bincount(tokens.numpy(), minlength=CHI_LOGITS.numel())
    expected = filtered_distribution(CHI_LOGITS.numpy().astype(np.float64), **CHI_PARAMS)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {np.nonzero(counts * ~support)}"
    _, p_value = stats.chisquare(counts[support], expected[support] * DRAWS)
    assert p_value >= ALPHA, f"chi-square p = {p_value:.2e} < {ALPHA}"


def test_a_rank_that_raises_is_named_at_once(runs: dict) -> None:
    name = next(name for name, world in WORLDS.items() if world.hidden_size)
    peer, failing = runs[name][0]["raises"], runs[name][1]["raises"]
    assert "failed on rank(s) [1] of 2" in peer["error"] and "group is still usable" in peer["error"]
    assert peer["seconds"] < FLAGGED_WITHIN_S
    assert "failed on this shard (rank 1)" in failing["error"] and "do not fit" in failing["error"]
    assert torch.equal(runs[name][0]["after raise"], runs[name][1]["after raise"])


def test_a_rank_that_stalls_times_out_the_others(runs: dict) -> None:
    name = next(name for name, world in WORLDS.items() if world.hidden_size)
    peer = runs[name][0]["stalls"]
    assert peer["error"] is not None and "stalled past the group's timeout or died" in peer["error"]
    assert STALL_TIMEOUT_S * 0.9 <= peer["seconds"] < STALL_TIMEOUT_S + 5


def test_a_rank_that_dies_fails_the_others(runs: dict) -> None:
    name, world = next((name, world) for name, world in WORLDS.items() if not world.hidden_size)
    for rank in range(world.ranks - 1):
        record = runs[name][rank]["dies"]
        assert record["error"] is not None and "stalled past the group's timeout or died" in record["error"]
        assert record["seconds"] < FLAGGED_WITHIN_S


def test_threshold_search_over_several_rounds(runs: dict) -> None:
    """The k-th token of the order and the token where the running mass reaches p, over 3 shards of 20,000 tokens
    with and without ties, against a sort of the whole row."""
    name, world = next((name, world) for name, world in WORLDS.items() if not world.hidden_size)
    z = search_rows(world.ranks)
    keys, order = order_keys(z, 0).sort(dim=1)
    assert runs[name][0]["search k reductions"] >= 2  # two rounds or more before the finish
    assert torch.equal(runs[name][0]["search k"], keys[:, SEARCH_K - 1])
    mass = torch.exp(z).to(torch.float64).gather(1, order).cumsum(dim=1)
    reached = (mass >= SEARCH_P * mass[:, -1:]).to(torch.int8).argmax(dim=1, keepdim=True)
    assert torch.equal(runs[name][0]["search p"], keys.gather(1, reached).squeeze(1))


def test_noise_of_a_slice_is_the_noise_of_its_global_ids() -> None:
    seed, position, iteration = torch.tensor([5, -3]), torch.tensor([2, 9]), torch.tensor([0, 4])
    whole = random_words(seed, position, iteration, 1, 103)
    for start, stop in ((0, 3), (1, 2), (6, 103), (33, 70)):
        assert torch.equal(random_words(seed, position, iteration, 1, stop - start, start), whole[:, start:stop])
