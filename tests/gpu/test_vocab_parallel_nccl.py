"""Vocabulary-parallel sampling (backends/vocab_parallel.py) over NCCL between two GPUs, against the single-device
reference.

Two processes, one a GPU, each holding its shard of the 2-rank layout of tests/test_vocab_parallel.py (333 + 667 of
V = 1000, every row kind under 100 seeds): the blocks are computed on the CPU and every exchange crosses between the
GPUs over NCCL. Every case must give CpuBackend's tokens, flags and top log-prob ids on the whole vocabulary, and
log-probs to fp32 rounding; a float64 all-reduce must return the same bits to both ranks (the threshold search
relies on it); a rank whose own step raises is named to the other at once, and the group serves the next call.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.vocab_parallel import Shard, ShardExchangeError, sample_sharded, shard_head
from tokensampler_server.model.sampling import HiddenInput

from ..test_vocab_parallel import (
    CASES,
    FLAGGED_WITHIN_S,
    LAYOUTS,
    PAIR_LAYOUT,
    assert_same,
    case_batch,
    hidden_batch,
    result_dict,
    shard_of,
    spawn_ranks,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                       reason="needs two CUDA GPUs and NCCL"),
]

RANKS = 2
DEADLINE_S = 300.0
REDUCED = 4096  # float64 values each rank all-reduces


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    layout = LAYOUTS[PAIR_LAYOUT]
    start, stop = layout.bounds[rank], layout.bounds[rank + 1]
    shard = Shard(start, layout.vocab_size)
    record: dict[str, object] = {"backend": dist.get_backend()}
    for name in CASES:
        batch = shard_of(case_batch(name, layout), start, stop)
        record[name] = result_dict(sample_sharded(batch, shard, candidates=layout.candidates))
    batch, head = hidden_batch(layout)
    sharded = replace(batch, hidden=HiddenInput(batch.hidden.states, shard_head(head, start, stop)))
    record["hidden"] = result_dict(sample_sharded(sharded, shard, candidates=layout.candidates))

    values = torch.randn(REDUCED, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)) * 1e3
    reduced = values.to(device)
    dist.all_reduce(reduced)
    record["reduced"] = reduced.cpu()

    small = shard_of(case_batch("top-k 5", layout), start, stop)
    wrong = Shard(layout.vocab_size - 1 if rank == 1 else start, layout.vocab_size)
    started = time.monotonic()
    try:
        sample_sharded(small, wrong)
        record["raises"] = {"error": None}
    except ShardExchangeError as err:
        record["raises"] = {"error": str(err), "seconds": time.monotonic() - started}
    record["after raise"] = sample_sharded(small, shard).tokens
    dist.destroy_process_group()
    torch.save(record, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """{rank: what the rank recorded}, from one run of two processes on GPUs 0 and 1."""
    return spawn_ranks(_worker, RANKS, tmp_path_factory.mktemp("nccl_ranks"), DEADLINE_S)


@pytest.mark.parametrize("case", CASES)
def test_same_as_one_device_over_nccl(runs: dict, case: str) -> None:
    want = CpuBackend().sample(case_batch(case, LAYOUTS[PAIR_LAYOUT]))
    for rank in range(RANKS):
        assert runs[rank]["backend"] == "nccl"
        assert_same(runs[rank][case], want)


def test_hidden_states_same_as_one_device_over_nccl(runs: dict) -> None:
    batch, _ = hidden_batch(LAYOUTS[PAIR_LAYOUT])
    want = CpuBackend().sample(batch)
    for rank in range(RANKS):
        assert_same(runs[rank]["hidden"], want)


def test_a_float64_all_reduce_gives_every_rank_the_same_bits(runs: dict) -> None:
    parts = [torch.randn(REDUCED, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) * 1e3
             for r in range(RANKS)]
    assert torch.equal(runs[0]["reduced"], runs[1]["reduced"])
    assert torch.equal(runs[0]["reduced"], parts[0] + parts[1])  # two addends: one rounding, in either order


def test_a_rank_that_raises_is_named_at_once_over_nccl(runs: dict) -> None:
    peer, failing = runs[0]["raises"], runs[1]["raises"]
    assert "failed on rank(s) [1] of 2" in peer["error"] and peer["seconds"] < FLAGGED_WITHIN_S
    assert "failed on this shard (rank 1)" in failing["error"]
    for rank in range(RANKS):
        assert torch.equal(runs[rank]["after raise"], runs[rank]["top-k 5"]["tokens"])
