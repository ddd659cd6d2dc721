"""Server-side dynamic batching: concurrent requests coalesced into one backend call.

Requests wait in a bounded queue. The backend runs one merged batch at a time on its worker thread;
while it runs, new requests gather, so batches grow with load by themselves. A batch closes at
`max_batch_rows` rows, or `max_queue_delay_us` after its first request arrived (0: no waiting beyond
the backend being busy). A full queue answers RESOURCE_EXHAUSTED at once. A caller that goes away
(cancelled, deadline passed) leaves its rows behind; the other requests of its batch are unaffected.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import torch

from .backends import Backend
from .batch_merge import merge_batches, merge_key, split_result
from .errors import ServiceError
from .sampling import SamplingBatch, SamplingResult


T = TypeVar("T")


def _out_of_memory_as_status(work: Callable[[], T]) -> T:
    """Runs `work`; running out of memory becomes RESOURCE_EXHAUSTED after the cache is given back."""
    try:
        return work()
    except (torch.cuda.OutOfMemoryError, MemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give back what the failed work had taken
        raise ServiceError(
            "out of memory: retry later or with fewer rows", grpc.StatusCode.RESOURCE_EXHAUSTED
        ) from None


def _host_bytes(batch: SamplingBatch) -> int:
    """Bytes of the batch's input held in host memory (tensors in GPU regions belong to their producer)."""
    tensor = batch.logits if batch.logits is not None else batch.hidden.states
    return tensor.numel() * tensor.element_size() if tensor.device.type == "cpu" else 0


@dataclass(frozen=True)
class BatchTimes:
    """Nanoseconds a request spent queued and in its backend call, and the rows of that call."""

    queue_ns: int
    compute_ns: int
    batch_rows: int


@dataclass
class _Pending:
    batch: SamplingBatch
    future: asyncio.Future
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    """The caller's context (request id): the backend logs a batch under its first request's."""


class DynamicBatcher:
    def __init__(
        self,
        backend: Backend,
        *,
        max_batch_rows: int,
        max_queue_delay_us: int = 0,
        max_queue_rows: int | None = None,
        max_queue_bytes: int = 2 << 30,
        observe_batch_rows: Callable[[int], None] | None = None,
    ) -> None:
        self._backend = backend
        self._max_batch_rows = max_batch_rows
        self._delay_s = max_queue_delay_us / 1e6
        self._max_queue_rows = max_queue_rows if max_queue_rows is not None else 8 * max_batch_rows
        self._max_queue_bytes = max_queue_bytes
        self._queue: list[_Pending] = []
        self._queued_rows = 0
        self._queued_bytes = 0
        self._wakeup: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None
        self._observe_batch_rows = observe_batch_rows
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokensampler-backend")

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    @property
    def queued_requests(self) -> int:
        """Requests waiting for the backend whose callers still want the answer."""
        return sum(not pending.future.done() for pending in self._queue)

    async def submit(self, batch: SamplingBatch) -> tuple[SamplingResult, BatchTimes]:
        """Samples `batch`, possibly together with other requests; returns its own rows."""
        if self._queued_rows + batch.num_rows > self._max_queue_rows:
            raise ServiceError(
                f"queue full: {self._queued_rows} rows waiting, at most {self._max_queue_rows}; retry with backoff",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        nbytes = _host_bytes(batch)
        if self._queued_bytes + nbytes > self._max_queue_bytes:
            raise ServiceError(
                f"queue full: {self._queued_bytes} bytes waiting, at most {self._max_queue_bytes}; retry with backoff",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if self._runner is None:
            self._wakeup = asyncio.Event()
            self._runner = asyncio.ensure_future(self._run())
        pending = _Pending(batch, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._queued_rows += batch.num_rows
        self._queued_bytes += nbytes
        self._wakeup.set()
        return await pending.future

    def _take(self) -> list[_Pending]:
        """Removes the next group from the queue: the oldest request and the later ones it can merge
        with, up to max_batch_rows rows. Requests whose callers are gone are dropped on the way."""
        group: list[_Pending] = []
        kept: list[_Pending] = []
        key: Hashable = None
        rows = 0
        for pending in self._queue:
            if pending.future.done():
                self._queued_rows -= pending.batch.num_rows
                self._queued_bytes -= _host_bytes(pending.batch)
            elif not group:
                group, key, rows = [pending], merge_key(pending.batch), pending.batch.num_rows
            elif merge_key(pending.batch) == key and rows + pending.batch.num_rows <= self._max_batch_rows:
                group.append(pending)
                rows += pending.batch.num_rows
            else:
                kept.append(pending)
        self._queue = kept
        self._queued_rows -= rows
        self._queued_bytes -= sum(_host_bytes(p.batch) for p in group)
        return group

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._delay_s and self._queued_rows < self._max_batch_rows:
                await asyncio.sleep(self._delay_s)
            group = self._take()
            if group:
                await self._run_group(loop, group)
            if self._queue:
                self._wakeup.set()

    async def _run_group(self, loop: asyncio.AbstractEventLoop, group: list[_Pending]) -> None:
        started = time.perf_counter_ns()
        try:
            merged = merge_batches([p.batch for p in group])
            result = await loop.run_in_executor(self._worker, group[0].context.run, self._sample, merged)
        except Exception as err:  # each caller gets the failure; the interceptor classifies it
            for pending in group:
                if not pending.future.done():
                    pending.future.set_exception(err)
            return
        finished = time.perf_counter_ns()
        if self._observe_batch_rows is not None:
            self._observe_batch_rows(merged.num_rows)
        parts = split_result(result, [p.batch.num_rows for p in group])
        for pending, part in zip(group, parts):
            if not pending.future.done():
                times = BatchTimes(started - pending.enqueued_ns, finished - started, merged.num_rows)
                pending.future.set_result((part, times))

    async def run_exclusive(self, work: Callable[[], T]) -> T:
        """Runs `work` on the backend's worker thread, between sampling batches (out-of-memory errors
        answer RESOURCE_EXHAUSTED, as for batches)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, contextvars.copy_context().run, _out_of_memory_as_status, work)

    def _sample(self, batch: SamplingBatch) -> SamplingResult:
        return _out_of_memory_as_status(lambda: self._backend.sample(batch.with_logits()))

    async def close(self) -> None:
        """Stops taking batches once the queue is empty; the worker thread finishes its batch."""
        while self._queue:
            await asyncio.sleep(0.001)
        if self._runner is not None:
            self._runner.cancel()
        self._worker.shutdown(wait=True)
