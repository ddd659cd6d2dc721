"""Regions and weights live as long as the work that reads them, and unregistering is atomic.

In process, with a backend gated by events: every state is observed, not waited for with a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import replace
from multiprocessing import shared_memory

import grpc
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import build_sample_request
from tokensampler_client.regions import RegionView
from tokensampler_server.backends import cpu
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.batching.batcher import DynamicBatcher
from tokensampler_server.rpc.call_record import CallRecord
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.resources.regions import RegionRegistry
from tokensampler_server.core.request_context import current_abandoned
from tokensampler_server.rpc.sample_rpc import SampleRpc
from tokensampler_server.backends.truncation import apply_truncation
from tokensampler_server.model.sampling import SamplingBatch, Truncation
from tokensampler_server.resources.weights import LogitsFinish, WeightRegistry
from tokensampler_server.workloads.score import LogitSource, score_tokens
from tokensampler_server.workloads.topk_probs import topk_probs
from tokensampler_server.workloads.verify import verify_draft

from .test_workload_score import _scoring
from .test_workload_verify import make_verification

VOCAB = 64
WAIT_S = 30.0


class GatedBackend(CpuBackend):
    """The CPU reference, each call held until the test opens `gate`; `entered` tells a call started."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.finished: list[str] = []

    def sample(self, batch: SamplingBatch):  # noqa: ANN201 - the base class's type
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        try:
            return super().sample(batch)  # work whose callers have all gone stops early (CANCELLED)
        finally:
            self.finished.append("backend done")


async def _wait_for(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, WAIT_S), "never happened"


@contextlib.contextmanager
def _segment(nbytes: int):
    segment = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        yield segment
    finally:
        segment.close()
        segment.unlink()


def _register_shm(regions: RegionRegistry, name: str, segment: shared_memory.SharedMemory):
    key = segment.name.lstrip("/")
    return regions.register(pb.RegisterRegionRequest(name=name, shm=pb.SharedMemorySource(key=key, byte_size=segment.size)))


def test_a_region_stays_registered_until_the_work_of_a_cancelled_call_is_done() -> None:
    """A call cancelled while the backend samples its rows leaves its hold with the work: unregistering waits for
    the backend's call to end (here it stops early, nobody waiting), and only then releases the region."""
    backend = GatedBackend()
    regions = RegionRegistry(allow_shm=True)
    events: list[str] = backend.finished

    async def run() -> None:
        batcher = DynamicBatcher(backend, max_batch_rows=64)
        path = SampleRpc(Limits(), batcher, WeightRegistry(torch.device("cpu")), regions, None)
        with _segment(2 * VOCAB * 4) as segment:
            region = _register_shm(regions, "logits", segment)
            release = region.release
            region.release = lambda: (events.append("released"), release())
            request = build_sample_request(logits=RegionView("logits", 0, torch.float32, (2, VOCAB)), seed=[1, 2])
            call = asyncio.ensure_future(path.unary(request, CallRecord(method="Sample", request_id="r")))
            await _wait_for(backend.entered)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert regions.in_flight(region) == 1  # the backend's work still holds it
            unregister = asyncio.ensure_future(regions.unregister("logits"))
            await asyncio.sleep(0)
            assert [r.name for r in regions.list()] == [] and not unregister.done()  # hidden, not yet released
            backend.gate.set()
            assert await unregister is region
            await batcher.close()
        assert events == ["backend done", "released"]

    asyncio.run(run())


def _weight_in(region, registry: WeightRegistry, name: str):
    return registry.register(name, torch.zeros(VOCAB, 4), LogitsFinish(vocab_size=VOCAB), sha256="", region=region)


def test_a_region_pins_weight_objects_not_names() -> None:
    """A weight's delayed unregister cannot take the pin of a new weight of the same name: the name is refused
    until the removal ends, and the pin set holds the objects themselves."""
    regions = RegionRegistry(allow_shm=True)
    weights = WeightRegistry(torch.device("cpu"))

    async def run() -> None:
        with _segment(VOCAB * 16) as segment:
            region = _register_shm(regions, "heads", segment)
            first = _weight_in(region, weights, "w")
            with weights.use("w", "hidden.weights"):
                leaving = asyncio.ensure_future(weights.unregister("w"))
                await asyncio.sleep(0)
                with pytest.raises(ServiceError) as raised:
                    _weight_in(region, weights, "w")
                assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS and "being unregistered" in raised.value.message
            assert await leaving is first
            second = _weight_in(region, weights, "w")
            assert region.weights == {second}
            with pytest.raises(ServiceError) as raised:
                await regions.unregister("heads")
            assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
            await weights.unregister("w")
            assert region.weights == set()
            await regions.unregister("heads")

    asyncio.run(run())


def test_an_unregister_whose_caller_leaves_still_ends_in_one_state() -> None:
    """Cancelled while it waits for a request, UnregisterWeights still finishes when the request ends: the name is
    gone and so is the region's pin (before, the region stayed pinned until restart)."""
    regions = RegionRegistry(allow_shm=True)
    weights = WeightRegistry(torch.device("cpu"))

    async def run() -> None:
        with _segment(VOCAB * 16) as segment:
            region = _register_shm(regions, "heads", segment)
            _weight_in(region, weights, "w")
            hold = weights.use("w", "hidden.weights")
            hold.__enter__()
            caller = asyncio.ensure_future(weights.unregister("w"))
            await asyncio.sleep(0)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            assert weights.list() == [] and len(region.weights) == 1  # waiting for the request
            hold.__exit__(None, None, None)
            for _ in range(2000):  # the removal polls every 5 ms
                if not region.weights:
                    break
                await asyncio.sleep(0.005)
            assert region.weights == set() and weights.list() == []
            await regions.unregister("heads")

    asyncio.run(run())


def test_an_unregister_that_times_out_leaves_everything_as_it_was() -> None:
    regions = RegionRegistry(allow_shm=True)
    weights = WeightRegistry(torch.device("cpu"), unregister_timeout_s=0.05)

    async def run() -> None:
        with _segment(VOCAB * 16) as segment:
            region = _register_shm(regions, "heads", segment)
            entry = _weight_in(region, weights, "w")
            with weights.use("w", "hidden.weights"):
                with pytest.raises(ServiceError) as raised:
                    await weights.unregister("w")
            assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "still used by 1 request(s)" in raised.value.message
            assert weights.list() == [entry] and region.weights == {entry}
            with weights.use("w", "hidden.weights") as again:  # usable as before
                assert again is entry
            await weights.unregister("w")
            await regions.unregister("heads")

    asyncio.run(run())


def test_registries_refuse_past_their_caps() -> None:
    weights = WeightRegistry(torch.device("cpu"), max_weights=2)
    for name in ("a", "b"):
        weights.register(name, torch.zeros(VOCAB, 4), LogitsFinish(vocab_size=VOCAB), sha256="")
    with pytest.raises(ServiceError) as raised:
        weights.register("c", torch.zeros(VOCAB, 4), LogitsFinish(vocab_size=VOCAB), sha256="")
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.message.startswith("name: 2 weights are registered, the server's limit")


def test_work_whose_caller_left_before_it_started_is_dropped() -> None:
    """A TopKProbs-like job queued behind a busy worker, whose caller goes away, never runs; its rows and bytes
    leave the queue's bounds."""
    backend = GatedBackend()
    ran: list[str] = []

    async def run() -> None:
        batcher = DynamicBatcher(backend, max_batch_rows=64, max_queue_rows=10)
        busy = asyncio.ensure_future(batcher.run_exclusive(lambda: backend.sample(_batch(2)), rows=4, elements=0, nbytes=0))
        await _wait_for(backend.entered)
        queued = asyncio.ensure_future(batcher.run_exclusive(lambda: ran.append("queued"), rows=6, elements=0, nbytes=0))
        await asyncio.sleep(0)
        with pytest.raises(ServiceError) as raised:  # 4 + 6 rows wait: the bound is full
            await batcher.run_exclusive(lambda: ran.append("refused"), rows=1, elements=0, nbytes=0)
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        queued.cancel()
        backend.gate.set()
        await busy
        with pytest.raises(asyncio.CancelledError):
            await queued
        await batcher.run_exclusive(lambda: None, rows=0, elements=0, nbytes=0)  # the worker is past the dropped job
        await batcher.run_exclusive(lambda: ran.append("after"), rows=10, elements=0, nbytes=0)  # its rows left the bound
        await batcher.close()
        assert ran == ["after"]

    asyncio.run(run())


def _batch(rows: int, vocab: int = VOCAB) -> SamplingBatch:
    def column(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)

    return SamplingBatch(logits=torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)),
                         temperature=column(1.0, torch.float32), top_k=column(0, torch.int32),
                         top_p=column(1.0, torch.float32), min_p=column(0.0, torch.float32),
                         seed=torch.arange(rows), position=column(0, torch.int64), iteration=column(0, torch.int64))


def test_the_cpu_reference_samples_in_chunks_and_stops_when_nobody_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked sampling gives the tokens of one pass; work abandoned by every caller stops between chunks."""
    monkeypatch.setattr(cpu, "_CHUNK_ELEMENTS", 4000)
    batch = _batch(12, vocab=1000)  # three chunks of four rows
    backend = CpuBackend()
    chunked = backend.sample(batch)
    whole = backend._sample(batch)  # noqa: SLF001 - one pass, the oracle
    assert torch.equal(chunked.tokens, whole.tokens) and torch.equal(chunked.valid, whole.valid)
    _assert_stops_at_the_second_question(backend, batch)


def _assert_stops_at_the_second_question(backend: CpuBackend, batch: SamplingBatch) -> None:
    """Sampling `batch` whose callers are gone from the backend's second question on ends there, CANCELLED."""
    asked: list[int] = []

    def abandoned_after_first() -> bool:
        asked.append(1)
        return len(asked) > 1

    current_abandoned.set(abandoned_after_first)
    try:
        with pytest.raises(ServiceError) as raised:
            backend.sample(batch)
    finally:
        current_abandoned.set(lambda: False)
    assert raised.value.code == grpc.StatusCode.CANCELLED and len(asked) == 2


def test_a_row_wider_than_a_chunk_stops_between_steps_when_nobody_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row is the smallest chunk: a row of many times a chunk's logits (seconds a step) asks between its steps
    and samples, so work abandoned by every caller stops there too."""
    monkeypatch.setattr(cpu, "_CHUNK_ELEMENTS", 4000)
    batch = replace(_batch(1, vocab=20000), top_p=torch.tensor([0.9]), num_samples=3)
    backend = CpuBackend()
    assert backend.sample(batch).valid.all()
    _assert_stops_at_the_second_question(backend, batch)


@pytest.mark.parametrize("workload", ["topk_probs", "score_processed", "score_raw", "verify", "local_samplers"])
def test_workloads_stop_between_steps_when_nobody_waits(workload: str) -> None:
    """TopKProbs and ScoreTokens (a filtered position's sort, a raw row's vocabulary slices), VerifyDraft (each
    position's processing, the kept sets' sort) and the local samplers (each sampler) ask between their steps, as the
    sampler does, so work whose callers have all gone stops there."""
    logits = torch.randn(2, 3000)
    ids = torch.tensor([5, 7])
    drafts = torch.tensor([[1, 2], [3, 4]])
    work = {
        "topk_probs": lambda: topk_probs(logits, torch.ones(2), 2000),
        "score_processed": lambda: score_tokens(LogitSource(logits=logits), _scoring(ids, processed=True, top_p=0.9),
                                                torch.device("cpu")),
        "score_raw": lambda: score_tokens(LogitSource(logits=logits), _scoring(ids), torch.device("cpu")),
        "verify": lambda: verify_draft(make_verification(drafts, torch.full((2, 2, 3000), 1 / 3000),
                                                         torch.randn(2, 3, 3000), top_p=0.9)),
        "local_samplers": lambda: apply_truncation(logits.clone(), replace(
            Truncation.off(2), typical_p=torch.full((2,), 0.5), top_n_sigma=torch.full((2,), 1.0))),
    }[workload]
    work()  # runs whole while someone waits
    current_abandoned.set(lambda: True)
    try:
        with pytest.raises(ServiceError) as raised:
            work()
    finally:
        current_abandoned.set(lambda: False)
    assert raised.value.code == grpc.StatusCode.CANCELLED
