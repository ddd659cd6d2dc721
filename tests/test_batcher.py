"""Server-side dynamic batching: merged backend calls give every request exactly its own rows."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest
import torch
from tokensampler_server.backends.base import Backend, BackendInfo
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.batching.batcher import DynamicBatcher
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.model.sampling import (HiddenInput, LogitProcessing, SamplingBatch, SamplingResult,
                                                TokenEntries)
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from .batches import make_batch
from .polling import wait_until_async

VOCAB = 300


def random_batch(rng: random.Random) -> SamplingBatch:
    rows = rng.randint(1, 5)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    processing = None
    if rng.random() < 0.5:
        banned_rows = torch.arange(rows).repeat_interleave(2)
        processing = LogitProcessing(
            banned=TokenEntries(banned_rows, torch.randint(0, VOCAB, (2 * rows,))),
            output_tokens=TokenEntries(torch.zeros(3, dtype=torch.int64), torch.tensor([1, 1, 7])),
            frequency_penalty=torch.full((rows,), 0.5) if rng.random() < 0.5 else None,
            repetition_penalty=torch.full((rows,), 1.3),
        )
    return make_batch(
        logits,
        temperature=[rng.choice([0.0, 0.8, 1.0]) for _ in range(rows)],
        top_k=rng.choice([0, 10]),
        top_p=rng.choice([1.0, 0.9]),
        seed=[rng.randrange(-(2**63), 2**63) for _ in range(rows)],
        position=rng.randrange(100),
        processing=processing,
        return_logprobs=True,
        top_logprobs=3,
    )


GATE_TIMEOUT_S = 60.0
"""How long a gated job waits for its test at most: a failed test does not leave it blocked for good."""


class CountingBackend(Backend):
    """The CPU backend, recording the rows of every call it gets; with `gate`, each call waits for it
    (`entered` tells that a call has begun)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[int] = []
        self._gate = gate
        self.entered = threading.Event()

    def info(self) -> BackendInfo:
        return BackendInfo(name="cpu", device="cpu")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        self.entered.set()
        if self._gate is not None:
            self._gate.wait(GATE_TIMEOUT_S)
        self.calls.append(batch.num_rows)
        return CpuBackend().sample(batch)


def test_concurrent_requests_are_merged_and_each_gets_its_own_rows() -> None:
    rng = random.Random(0)
    batches = [random_batch(rng) for _ in range(60)]
    backend = CountingBackend()

    async def run() -> list[SamplingResult]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, max_queue_delay_us=2000)
        results = await asyncio.gather(*(batcher.submit(b) for b in batches))
        await batcher.close()
        return [result for result, _ in results]

    results = asyncio.run(run())
    assert len(backend.calls) < len(batches) and max(backend.calls) <= 64
    reference = CpuBackend()
    for batch, result in zip(batches, results):
        alone = reference.sample(batch)
        assert torch.equal(result.tokens, alone.tokens)
        assert torch.equal(result.logprobs, alone.logprobs)
        assert torch.equal(result.top_logprob_ids, alone.top_logprob_ids)


def _refusal_behind_a_busy_backend(queued_batches: int, vocab: int, **limits: int) -> ServiceError:
    """The error a 1-row request gets from a batcher of 4-row batches with `limits` while its backend is busy with
    a first 4-row batch and `queued_batches` more wait."""
    gate = threading.Event()
    backend = CountingBackend(gate)
    queued_rows = 4 * queued_batches

    async def run() -> ServiceError:
        batcher = DynamicBatcher(backend, max_batch_rows=4, **limits)
        busy = [asyncio.ensure_future(batcher.submit(make_batch(torch.zeros(4, vocab))))]
        await wait_until_async(backend.entered.is_set, "the first batch in the backend, blocked on the gate")
        busy += [asyncio.ensure_future(batcher.submit(make_batch(torch.zeros(4, vocab))))
                 for _ in range(queued_batches)]
        await wait_until_async(lambda: batcher.queued_rows == queued_rows, f"{queued_rows} rows waiting")
        assert batcher.queued_rows == queued_rows
        with pytest.raises(ServiceError) as raised:
            await batcher.submit(make_batch(torch.zeros(1, vocab)))
        gate.set()
        await asyncio.gather(*busy)
        await batcher.close()
        return raised.value

    return asyncio.run(run())


class TwoWorkerBackend(Backend):
    """The CPU backend, declared able to take two calls at once, as CpuBackend is; a call of `long_elements`
    B·V·num_samples or more waits for `gate` (`entered` tells that it has begun)."""

    concurrent_calls = True

    def __init__(self, gate: threading.Event, long_elements: int) -> None:
        self.calls: list[int] = []
        self._gate = gate
        self._long_elements = long_elements
        self.entered = threading.Event()

    def info(self) -> BackendInfo:
        return BackendInfo(name="cpu", device="cpu")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        if batch.num_rows * batch.vocab_size * batch.num_samples >= self._long_elements:
            self.entered.set()
            self._gate.wait(GATE_TIMEOUT_S)
        self.calls.append(batch.num_rows)
        return CpuBackend().sample(batch)


@pytest.mark.parametrize("long_by", ["rows", "samples"])
def test_a_long_batch_runs_beside_the_short_ones_on_a_backend_of_concurrent_calls(long_by: str) -> None:
    """On a backend that takes two calls at once (the CPU reference), a batch of long_batch_elements logits or more
    (B·V·num_samples: many rows, or one row sampled many times) runs on a worker of its own: short requests queued
    after it are answered while it runs (on one worker they waited behind it: a legal maximum takes 20-37 s on the
    CPU), a second long one waits for the first, and no short request joins a long batch."""
    gate = threading.Event()
    backend = TwoWorkerBackend(gate, long_elements=4 * VOCAB)

    def long_batch(rows: int) -> SamplingBatch:
        if long_by == "rows":
            return make_batch(torch.randn(rows, VOCAB))
        return make_batch(torch.randn(1, VOCAB), num_samples=rows)

    async def run() -> tuple[list, list]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, long_batch_elements=4 * VOCAB)
        first = asyncio.ensure_future(batcher.submit(long_batch(4)))
        await wait_until_async(backend.entered.is_set, "the long worker busy with `first`")
        second = asyncio.ensure_future(batcher.submit(long_batch(5)))
        shorts = [asyncio.ensure_future(batcher.submit(make_batch(torch.randn(1, VOCAB), seed=s))) for s in range(3)]
        answered = await asyncio.wait_for(asyncio.gather(*shorts), GATE_TIMEOUT_S)
        assert not first.done() and not second.done(), "a long batch finished before its gate opened"
        gate.set()
        longs = await asyncio.wait_for(asyncio.gather(first, second), GATE_TIMEOUT_S)
        assert batcher.queued_rows == 0 and batcher._rows_to_merge() == 0  # the counts follow the queue
        await batcher.close()
        return answered, longs

    answered, longs = asyncio.run(run())
    assert [result.tokens.shape for result, _ in answered] == [(1, 1)] * 3
    assert [result.tokens.numel() for result, _ in longs] == [4, 5]
    long_rows = [4, 5] if long_by == "rows" else [1, 1]
    assert backend.calls[-2:] == long_rows and sum(backend.calls[:-2]) == 3  # the longs alone, after the shorts


def test_long_batches_waiting_do_not_cut_short_the_queue_delay() -> None:
    """With --max-queue-delay-us, short requests wait for company until they fill a batch; long ones, which run
    alone, do not count towards it: three short requests queued while two long ones wait still go out as one
    call."""
    gate = threading.Event()
    backend = TwoWorkerBackend(gate, long_elements=4 * VOCAB)

    async def run() -> None:
        batcher = DynamicBatcher(backend, max_batch_rows=6, long_batch_elements=4 * VOCAB,
                                 max_queue_delay_us=200_000)
        longs = [asyncio.ensure_future(batcher.submit(make_batch(torch.randn(4, VOCAB)))) for _ in range(2)]
        await wait_until_async(backend.entered.is_set, "the long worker busy")
        shorts = [asyncio.ensure_future(batcher.submit(make_batch(torch.randn(1, VOCAB), seed=s))) for s in range(3)]
        await asyncio.wait_for(asyncio.gather(*shorts), GATE_TIMEOUT_S)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*longs), GATE_TIMEOUT_S)
        await batcher.close()

    asyncio.run(run())
    assert sorted(backend.calls) == [3, 4, 4]


def test_long_batches_waiting_hold_at_most_half_the_queue() -> None:
    """Long batches waiting for the long worker may fill half the queue's rows, not all of it: the next long one is
    refused as overload (retryable), while a short request still gets in and is answered beside the running one."""
    gate = threading.Event()
    backend = TwoWorkerBackend(gate, long_elements=4 * VOCAB)

    async def run() -> tuple[ServiceError, object]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, max_queue_rows=16, long_batch_elements=4 * VOCAB)
        longs = [asyncio.ensure_future(batcher.submit(make_batch(torch.randn(4, VOCAB))))]
        await wait_until_async(backend.entered.is_set, "the long worker busy")
        longs += [asyncio.ensure_future(batcher.submit(make_batch(torch.randn(4, VOCAB)))) for _ in range(2)]
        await wait_until_async(lambda: batcher.queued_requests == 2, "two long batches waiting: 8 rows, half of 16")
        with pytest.raises(ServiceError) as refused:
            await batcher.submit(make_batch(torch.randn(4, VOCAB)))
        short, _ = await asyncio.wait_for(batcher.submit(make_batch(torch.randn(1, VOCAB))), GATE_TIMEOUT_S)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*longs), GATE_TIMEOUT_S)
        await batcher.close()
        return refused.value, short

    error, short = asyncio.run(run())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rows of long batches" in error.message
    assert short.tokens.shape == (1, 1)


def _gated_workload() -> tuple[threading.Event, TwoWorkerBackend, threading.Event, Callable[[], str]]:
    """(gate, a backend of two workers whose long batches wait on it, set once the workload starts, a workload
    that waits on the gate and returns "scored")."""
    gate = threading.Event()
    started = threading.Event()

    def workload() -> str:
        started.set()
        gate.wait(GATE_TIMEOUT_S)
        return "scored"

    return gate, TwoWorkerBackend(gate, long_elements=4 * VOCAB), started, workload


def test_long_workloads_hold_at_most_half_the_queue_with_the_long_batches() -> None:
    """Long workloads (run_exclusive, TopKProbs/ScoreTokens of long_batch_elements logits or more) are held to half
    the queue's rows as long batches are, and share that half with them: past it the next long one, workload or
    batch, is refused as overload (retryable), while a short Sample and a short workload still get in. Twelve
    ScoreTokens of 4096 rows filled all 32768 rows of the default queue, and every short Sample was refused."""
    gate, backend, started, workload = _gated_workload()

    async def run() -> tuple[list[ServiceError], object, str]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, max_queue_rows=16, long_batch_elements=4 * VOCAB)

        def long_workload() -> asyncio.Future:
            return asyncio.ensure_future(batcher.run_exclusive(workload, rows=4, elements=4 * VOCAB, nbytes=0))

        longs = [long_workload()]
        await wait_until_async(started.is_set, "the long worker busy with the first workload")
        longs.append(long_workload())  # 8 rows of long workloads: half of 16
        refused = []
        with pytest.raises(ServiceError) as raised:
            await long_workload()
        refused.append(raised.value)
        with pytest.raises(ServiceError) as raised:
            await batcher.submit(make_batch(torch.randn(4, VOCAB)))
        refused.append(raised.value)
        short, _ = await asyncio.wait_for(batcher.submit(make_batch(torch.randn(1, VOCAB))), GATE_TIMEOUT_S)
        short_work = await asyncio.wait_for(
            batcher.run_exclusive(lambda: "short", rows=8, elements=8, nbytes=0), GATE_TIMEOUT_S)
        assert not any(long.done() for long in longs), "a long workload finished before its gate opened"
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*longs), GATE_TIMEOUT_S) == ["scored"] * 2
        more = await asyncio.wait_for(long_workload(), GATE_TIMEOUT_S)  # their share is given back as they end
        await batcher.close()
        return refused, short, short_work + " " + more

    refused, short, outcomes = asyncio.run(run())
    for error in refused:
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rows of long batches" in error.message
    assert short.tokens.shape == (1, 1) and outcomes == "short scored"


def test_a_long_workload_runs_beside_short_batches_on_a_backend_of_concurrent_calls() -> None:
    """A workload (run_exclusive) that reads long_batch_elements logits or more takes the long worker too: a short
    Sample queued after it is answered while it runs."""
    gate, backend, started, workload = _gated_workload()

    async def run() -> tuple[object, str]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, long_batch_elements=4 * VOCAB)
        long = asyncio.ensure_future(batcher.run_exclusive(workload, rows=8, elements=8 * VOCAB, nbytes=0))
        await wait_until_async(started.is_set, "the long worker busy with the workload")
        short = await asyncio.wait_for(batcher.submit(make_batch(torch.randn(1, VOCAB))), GATE_TIMEOUT_S)
        assert not long.done(), "the workload finished before its gate opened"
        gate.set()
        outcome = await asyncio.wait_for(long, GATE_TIMEOUT_S)
        await batcher.close()
        return short, outcome

    (result, _), outcome = asyncio.run(run())
    assert result.tokens.shape[0] == 1 and outcome == "scored"


def test_full_queue_answers_resource_exhausted_at_once() -> None:
    error = _refusal_behind_a_busy_backend(2, vocab=8, max_queue_rows=8)  # 8 rows waiting: the queue full
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in error.message


def test_a_cancelled_caller_does_not_disturb_its_batch() -> None:
    gate = threading.Event()
    backend = CountingBackend(gate)

    async def run() -> list:
        batcher = DynamicBatcher(backend, max_batch_rows=64)
        first = asyncio.ensure_future(batcher.submit(make_batch(torch.zeros(1, 8))))
        await wait_until_async(backend.entered.is_set, "the backend busy with `first`")  # the next three queue up
        waiting = [asyncio.ensure_future(batcher.submit(make_batch(torch.randn(2, 8), seed=s))) for s in range(3)]
        await wait_until_async(lambda: batcher.queued_requests == 3, "three requests queued")
        waiting[1].cancel()
        gate.set()
        done = await asyncio.gather(first, waiting[0], waiting[2])
        await batcher.close()
        return done

    done = asyncio.run(run())
    assert backend.calls == [1, 4]  # the cancelled caller's rows were dropped before the merge
    assert all(result.tokens.shape[1] == 1 for result, _ in done)


def test_queued_bytes_are_bounded() -> None:
    # 4 x 1000 float32 logits wait, 16000 bytes: all the queue takes
    error = _refusal_behind_a_busy_backend(1, vocab=1000, max_queue_bytes=4 * 1000 * 4)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes waiting" in error.message


def test_queued_bytes_count_the_token_entries_a_shared_list_expands_to() -> None:
    """A list shared by every row is held once per row, 16 bytes an entry: one row of 8 logits with 100,000 banned
    entries holds 1.6 MB, past a queue of 1 MB: refused, for good (no retry can fit it: not retryable, naming the
    flag); the same row without them is sampled. Behind a waiting request, a request that fits the bound alone but
    not beside it is refused as retryable."""
    entries = TokenEntries(rows=torch.zeros(100_000, dtype=torch.int64), tokens=torch.zeros(100_000, dtype=torch.int64))

    async def run() -> tuple[ServiceError, ServiceError]:
        batcher = DynamicBatcher(CountingBackend(), max_batch_rows=4, max_queue_bytes=1_000_000,
                                 max_queue_delay_us=2_000_000)
        with pytest.raises(ServiceError) as never:
            await batcher.submit(make_batch(torch.zeros(1, 8), processing=LogitProcessing(banned=entries)))
        waiting = asyncio.ensure_future(batcher.submit(make_batch(torch.zeros(1, 8))))
        await asyncio.sleep(0)  # queued, waiting out its delay for others to batch with
        half = TokenEntries(rows=torch.zeros(62_000, dtype=torch.int64), tokens=torch.zeros(62_000, dtype=torch.int64))
        await batcher.submit(make_batch(torch.zeros(1, 8), processing=LogitProcessing(banned=half)))  # 0.99 MB fits
        with pytest.raises(ServiceError) as full:
            await asyncio.gather(batcher.submit(make_batch(torch.zeros(1, 8), processing=LogitProcessing(banned=half))),
                                 batcher.submit(make_batch(torch.zeros(1, 8), processing=LogitProcessing(banned=half))))
        await batcher.close()
        await waiting
        return never.value, full.value

    never, full = asyncio.run(run())
    assert never.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not never.retryable
    assert "needs 1600" in never.message and "(--max-queue-mb)" in never.message, never.message
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.retryable and "bytes waiting" in full.message


class OutOfMemoryBackend(Backend):
    """Fails like a GPU whose memory ran out on batches of more than 2 rows."""

    def info(self) -> BackendInfo:
        return BackendInfo(name="cpu", device="cpu")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        if batch.num_rows > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return CpuBackend().sample(batch)


def test_out_of_memory_is_resource_exhausted_and_the_next_batch_runs() -> None:
    async def run() -> tuple[ServiceError, SamplingResult]:
        batcher = DynamicBatcher(OutOfMemoryBackend(), max_batch_rows=64)
        with pytest.raises(ServiceError) as raised:
            await batcher.submit(make_batch(torch.zeros(3, 8)))
        result, _ = await batcher.submit(make_batch(torch.zeros(2, 8)))
        await batcher.close()
        return raised.value, result

    error, result = asyncio.run(run())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in error.message
    assert error.retryable and error.retry_mark == "memory"  # marked so: fewer rows, not only later, may get past
    assert result.tokens.shape == (2, 1)


class ThreadRecordingBackend(Backend):
    """Answers every row with token 0, recording the thread of each call; never reads the logits."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def info(self) -> BackendInfo:
        return BackendInfo(name="fake", device="meta")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        self.threads.append(threading.current_thread().name)
        rows = batch.num_rows
        return SamplingResult(tokens=torch.zeros((rows, 1), dtype=torch.int64), valid=torch.ones(rows, dtype=torch.bool),
                              nan_detected=torch.zeros(rows, dtype=torch.bool))


def test_small_batches_already_on_a_device_run_on_the_event_loop_and_host_ones_on_the_worker() -> None:
    backend = ThreadRecordingBackend()

    async def run() -> None:
        batcher = DynamicBatcher(backend, max_batch_rows=64)
        # "meta" stands for a GPU here: the input is not in host memory, as with a CUDA region.
        await batcher.submit(make_batch(torch.empty(2, 8, device="meta")))
        await batcher.submit(make_batch(torch.empty(2, 8, device="meta"), top_logprobs=2))  # a full sort: worker
        await batcher.submit(make_batch(torch.zeros(2, 8)))
        await batcher.run_exclusive(lambda: None, rows=0, elements=0, nbytes=0)
        await batcher.close()

    asyncio.run(run())
    loop_thread = threading.current_thread().name
    assert backend.threads == [loop_thread, "tokensampler-backend", "tokensampler-backend"]


class StallingBackend(ThreadRecordingBackend):
    """Says every batch may wait on other devices (as hidden states through a head split over GPUs)."""

    def may_stall(self, batch: SamplingBatch) -> bool:
        return True


def test_batches_that_may_stall_never_run_on_the_event_loop() -> None:
    backend = StallingBackend()

    async def run() -> None:
        batcher = DynamicBatcher(backend, max_batch_rows=64)
        await batcher.submit(make_batch(torch.empty(2, 8, device="meta")))  # small and on a device, yet the worker's
        await batcher.close()

    asyncio.run(run())
    assert backend.threads == ["tokensampler-backend"]


def test_the_event_loop_waits_for_the_worker_to_be_idle() -> None:
    backend = ThreadRecordingBackend()
    entered, gate = threading.Event(), threading.Event()

    async def run() -> None:
        batcher = DynamicBatcher(backend, max_batch_rows=64)
        busy = asyncio.ensure_future(batcher.run_exclusive(lambda: (entered.set(), gate.wait(GATE_TIMEOUT_S)), rows=0, elements=0, nbytes=0))
        await wait_until_async(entered.is_set, "the exclusive job on the worker")
        # enqueue, not submit: a batch run on the loop would be answered before this returns
        queued = batcher.enqueue(make_batch(torch.empty(1, 8, device="meta")))
        assert not queued.done()  # not run on the loop beside the exclusive job
        gate.set()
        await asyncio.gather(busy, queued)
        await batcher.close()

    asyncio.run(run())
    assert backend.threads == ["tokensampler-backend"]


class InputRecordingBackend(Backend):
    """The CPU backend, recording whether each call got hidden states or logits."""

    def __init__(self) -> None:
        self.hidden: list[bool] = []

    def info(self) -> BackendInfo:
        return BackendInfo(name="cpu", device="cpu")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        self.hidden.append(batch.hidden is not None)
        return CpuBackend().sample(batch)


def test_hidden_states_reach_the_backend_as_hidden_states() -> None:
    """The backend decides how hidden states become tokens (the CUDA backend: the fused kernel, or a head split
    over GPUs), so the batcher hands them over unconverted, merged, each request getting its own rows."""
    gen = torch.Generator().manual_seed(5)
    head = RegisteredWeight(name="w", weight=torch.randn(VOCAB, 16, generator=gen), sha256="",
                            finish=LogitsFinish(vocab_size=VOCAB))
    batches = [replace(make_batch(torch.empty(2, 0), seed=[seed, seed + 1]), logits=None,
                       hidden=HiddenInput(torch.randn(2, 16, generator=gen), head)) for seed in range(0, 12, 2)]
    backend = InputRecordingBackend()

    async def run() -> list[SamplingResult]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, max_queue_delay_us=2000)
        results = await asyncio.gather(*(batcher.submit(batch) for batch in batches))
        await batcher.close()
        return [result for result, _ in results]

    results = asyncio.run(run())
    assert backend.hidden and all(backend.hidden)
    for batch, result in zip(batches, results):
        assert torch.equal(result.tokens, CpuBackend().sample(batch).tokens)


def test_drain_starts_what_waits_out_the_queue_delay_at_once() -> None:
    """At shutdown nothing more comes to merge with: requests waiting out a 60 s --max-queue-delay-us start when the
    batcher drains, and later ones start at once, so that the grace period is not spent waiting."""
    backend = CountingBackend()

    async def run() -> tuple[float, float]:
        batcher = DynamicBatcher(backend, max_batch_rows=64, max_queue_delay_us=60_000_000)
        loop = asyncio.get_running_loop()
        waiting = [asyncio.ensure_future(batcher.submit(make_batch(torch.zeros(1, VOCAB)))) for _ in range(3)]
        await wait_until_async(lambda: batcher.queued_rows == 3, "3 rows waiting out the delay")
        started = loop.time()
        batcher.drain()
        await asyncio.wait_for(asyncio.gather(*waiting), 10)
        drained = loop.time() - started
        started = loop.time()
        await asyncio.wait_for(batcher.submit(make_batch(torch.zeros(2, VOCAB))), 10)
        later = loop.time() - started
        await batcher.close()
        return drained, later

    drained, later = asyncio.run(run())
    assert drained < 5 and later < 5 and backend.calls == [3, 2]


def test_requests_that_cannot_merge_wait_the_queue_delay_once() -> None:
    """Eight requests of eight vocabularies (eight groups) queued together: each group used to wait the whole
    --max-queue-delay-us again before it launched, the last request eight delays with the backend idle. Now each
    waits what is left of the oldest request's delay: all are answered in about one."""
    delay_s = 0.25

    async def run() -> float:
        batcher = DynamicBatcher(CpuBackend(), max_batch_rows=64, max_queue_delay_us=int(delay_s * 1e6))
        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(batcher.submit(make_batch(torch.randn(1, 100 + v))) for v in range(8)))
        elapsed = asyncio.get_running_loop().time() - started
        await batcher.close()
        return elapsed

    assert asyncio.run(run()) < 4 * delay_s  # eight delays (2 s) before


class VocabRecordingBackend(ThreadRecordingBackend):
    """Answers every row with token 0, recording the vocabulary of each call; never reads the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.vocabularies: list[int] = []

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        self.vocabularies.append(batch.vocab_size)
        return super().sample(batch)


class InspectedFuture(asyncio.Future):
    """A future that counts how often anyone asks whether it is done: the batcher asks it of each request it
    inspects."""

    inspections = 0

    def done(self) -> bool:
        InspectedFuture.inspections += 1
        return super().done()


def test_requests_that_cannot_merge_drain_without_walking_the_queue_at_every_group() -> None:
    """1024 requests of 1024 vocabularies (1024 groups) queued behind the delay: the batcher inspected every queued
    request at every group, 1024 · 1023 / 2 inspections (8192 requests took 226 s on 2 cores). Now finding a group
    reads the oldest request of each kind and the lane of the one chosen: a few inspections a request. The oldest
    still goes first, and the requests whose callers left are dropped, their rows with them."""
    count = 1024
    backend = VocabRecordingBackend()

    async def run() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        loop.create_future = lambda: InspectedFuture(loop=loop)  # the batcher's futures, one a request
        batcher = DynamicBatcher(backend, max_batch_rows=2 * count, max_queue_rows=count,
                                 max_queue_delay_us=60_000_000)
        # "meta" stands for a GPU: each group runs on the event loop, no thread in between
        calls = [asyncio.ensure_future(batcher.submit(make_batch(torch.empty(1, 100 + v, device="meta"))))
                 for v in range(count)]
        await wait_until_async(lambda: batcher.queued_rows == count, f"{count} requests waiting out the delay")
        for call in calls[::7]:
            call.cancel()
        InspectedFuture.inspections = 0
        batcher.drain()  # the delay ends
        answered = await asyncio.wait_for(asyncio.gather(*(c for i, c in enumerate(calls) if i % 7)), GATE_TIMEOUT_S)
        inspections = InspectedFuture.inspections
        assert batcher.queued_rows == 0 and batcher.queued_requests == 0 and batcher.idle
        await batcher.close()
        return inspections, [result.tokens.shape[0] for result, _ in answered]

    inspections, rows = asyncio.run(run())
    assert rows == [1] * (count - len(range(0, count, 7)))
    assert backend.vocabularies == [100 + v for v in range(count) if v % 7]  # oldest first; none cancelled sampled
    assert inspections <= 8 * count, f"{inspections} inspections of queued requests to drain {count}"
