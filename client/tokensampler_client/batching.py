"""Client-side batching: concurrent sample() calls coalesced into one Sample RPC.

A batch forms only when one of the `max_in_flight` RPC slots is free: while every slot is busy, calls
gather, so batches grow with the load instead of queueing behind each other. Once a slot is free, the
first call waits at most `max_delay_us` for company; a batch closes at `max_rows` rows. Calls that can
share a request (merge.merge_key) go out together and each gets exactly its own rows back (batch
invariance makes them the rows it would have got alone). Calls whose logits lie in one region merge into one
zero-copy call: wherever they lie when the server lists the feature "region_rows" (asked once), else when they
lie back to back.

A merged call is one call of the wrapped client: its retries (overload, UNAVAILABLE) and its deadline are those of
one call, shared by every caller in it, so N callers merged cost an overloaded server no more attempts than one
caller alone. When the merge is refused in a way that no retry gets past but its parts alone may not be, its
requests are re-sent one by one within what is left of the batch's deadline: INVALID_ARGUMENT or OUT_OF_RANGE (the
error then reaches only the callers whose rows were bad), or RESOURCE_EXHAUSTED without the overload mark (the merge
is larger than a bound of the server's, its message limit or the whole of its queue, which each call alone fits).
Any other error, an overload the retries did not get past included, reaches every caller of that batch.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import threading
import time
from collections import defaultdict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from ._proto import sampler_pb2 as pb
from .aio import AsyncSamplerClient
from .client import SamplerClient
from .errors import TokenSamplerError
from .merge import follows, merge_key, merge_requests, num_rows
from .params import build_sample_request
from .result import SampleResult


# A merged call rejected with one of these may hold a single bad request: each is re-sent alone.
_RESEND_ALONE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})
# Listed by servers that take `logits_rows`: region calls then merge wherever their rows lie.
_ROWS_FEATURE = "region_rows"


@dataclass
class _Call:
    request: pb.SampleRequest
    future: Any  # _Waiter (BatchingClient) or asyncio.Future
    rows: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = num_rows(self.request)
        self.nbytes = self.request.ByteSize()


class _Waiter:
    """The one result of a BatchingClient call, waited for on a bare lock: a concurrent.futures.Future's
    condition, callbacks and state machine cost a decode loop's thread more than the wait itself."""

    __slots__ = ("_done", "_value", "_error")

    def __init__(self) -> None:
        self._done = _thread.allocate_lock()
        self._done.acquire()  # held until the result is in
        self._value: SampleResult | None = None
        self._error: BaseException | None = None

    def set_result(self, value: SampleResult) -> None:
        self._value = value
        self._done.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done.release()

    def result(self) -> SampleResult:
        self._done.acquire()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _region_calls(calls: Sequence[_Call]) -> int:
    return sum(call.request.WhichOneof("input") == "logits_ref" for call in calls)


def _batches(calls: Sequence[_Call], max_rows: int, gather: bool, max_bytes: int) -> Iterator[list[_Call]]:
    """Groups calls by merge key, in arrival order (region references: by offset and, without `gather`, cut
    where one does not follow the other), each group cut at max_rows rows and at max_bytes of requests (a merged
    request is no larger than its parts together, and past the channel's limit every caller would fail)."""
    groups: dict[Hashable, list[_Call]] = defaultdict(list)
    for call in calls:
        groups[merge_key(call.request)].append(call)
    for group in groups.values():
        by_ref = group[0].request.WhichOneof("input") == "logits_ref"
        if by_ref:
            group.sort(key=lambda call: call.request.logits_ref.offset)
        batch: list[_Call] = []
        rows = nbytes = 0
        for call in group:
            apart = by_ref and not gather and bool(batch) and not follows(batch[-1].request, call.request)
            if batch and (rows + call.rows > max_rows or nbytes + call.nbytes > max_bytes or apart):
                yield batch
                batch, rows, nbytes = [], 0, 0
            batch.append(call)
            rows += call.rows
            nbytes += call.nbytes
        yield batch


def _merged_or_alone(batch: list[_Call], gather: bool) -> tuple[pb.SampleRequest | None, list[_Call]]:
    """The merged request of `batch`, or None with the calls that must go alone."""
    if len(batch) == 1:
        return batch[0].request, []
    try:
        return merge_requests([call.request for call in batch], gather=gather), []
    except ValueError:
        return None, batch


def _resent_alone(batch: list[_Call], err: Exception) -> bool:
    """Whether the calls of a failed merged request go again one by one (within the batch's deadline): so that a bad
    request fails alone, and calls that each fit the server's bounds are answered when their merge does not. Never
    after an overload: re-sent, the merge's callers would make an overloaded server more calls, not fewer."""
    if not isinstance(err, TokenSamplerError) or len(batch) < 2:
        return False
    return err.code in _RESEND_ALONE or (err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not err.overload)


def _time_left(timeout: float | None, started: float) -> float | None:
    """What is left of a deadline of `timeout` seconds from `started` (None: none), as a call's timeout: once it has
    passed, a microsecond, so that the call fails DEADLINE_EXCEEDED as one sent too late does."""
    return None if timeout is None else max(started + timeout - time.monotonic(), 1e-6)


def _deliver(batch: list[_Call], result: SampleResult, set_result) -> None:
    start = 0
    for call in batch:
        set_result(call.future, result.rows(start, start + call.rows))
        start += call.rows


Client = TypeVar("Client", SamplerClient, AsyncSamplerClient)


class _Batcher(Generic[Client]):
    """What both batching clients keep: the wrapped client, the limits, the calls waiting to go out, and whether
    the server gathers region rows."""

    def __init__(self, client: Client, max_rows: int, max_delay_us: int, max_in_flight: int) -> None:
        if max_rows < 1 or max_delay_us < 0 or max_in_flight < 1:
            raise ValueError("max_rows and max_in_flight must be >= 1 and max_delay_us >= 0")
        self._client = client
        self._max_rows = max_rows
        self._max_delay_s = max_delay_us / 1e6
        self._pending: list[_Call] = []
        self._pending_rows = 0
        self._closed = False  # later calls are refused
        self._gather: bool | None = None  # whether the server takes logits_rows: asked when first needed


class BatchingClient(_Batcher[SamplerClient]):
    """Thread-safe wrapper of SamplerClient whose sample() calls from many threads share RPCs.

    `BatchingClient(SamplerClient(target), max_rows=256, max_delay_us=500)`; sample() takes the
    arguments of SamplerClient.sample (but no per-call timeout or request id: the batch uses the
    wrapped client's deadline and retries, see the module's docstring). Up to `max_in_flight` batches are in flight
    at once; calls arriving meanwhile wait for a free slot and go out together. Two (the default) keep one batch
    gathering while the server works on the other: with 16 threads, 1 reached 5-10 % fewer rows/s and 4 15-25 %
    fewer (docs/design/service-path.md).
    """

    def __init__(
        self, client: SamplerClient, *, max_rows: int = 256, max_delay_us: int = 500, max_in_flight: int = 2
    ) -> None:
        super().__init__(client, max_rows, max_delay_us, max_in_flight)
        self._lock = threading.Condition()
        self._slots = threading.Semaphore(max_in_flight)
        self._senders = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="tokensampler-batch")
        self._collector = threading.Thread(target=self._collect, name="tokensampler-batcher", daemon=True)
        self._collector.start()

    def sample(self, logits: Any, **params: Any) -> SampleResult:
        """Samples like SamplerClient.sample; blocks until this call's rows are back."""
        call = _Call(build_sample_request(logits, **params), _Waiter())
        with self._lock:
            if self._closed:
                raise RuntimeError("BatchingClient is closed")
            self._pending.append(call)
            self._pending_rows += call.rows
            # The collector waits for a first call, then for max_rows: it need not wake for the calls between.
            if len(self._pending) == 1 or self._pending_rows >= self._max_rows:
                self._lock.notify()
        return call.future.result()

    def _collect(self) -> None:
        while True:
            self._slots.acquire()  # calls keep gathering while every slot is busy
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                if not self._pending:
                    return
                deadline = time.monotonic() + self._max_delay_s
                while self._pending_rows < self._max_rows and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._lock.wait(remaining)
                calls, self._pending, self._pending_rows = self._pending, [], 0
            gather = _region_calls(calls) > 1 and self._server_gathers()
            for index, batch in enumerate(_batches(calls, self._max_rows, gather, self._client.max_message_bytes)):
                if index:  # the first batch has the slot taken above
                    self._slots.acquire()
                self._senders.submit(self._send_in_slot, batch, gather, time.monotonic())

    def _server_gathers(self) -> bool:
        if self._gather is None:
            try:
                self._gather = _ROWS_FEATURE in self._client.server_info().features
            except TokenSamplerError:
                return False  # asked again with the next batch
        return self._gather

    def _send_in_slot(self, batch: list[_Call], gather: bool, started: float) -> None:
        try:
            self._send(batch, gather, started)
        finally:
            self._slots.release()

    def _send(self, batch: list[_Call], gather: bool, started: float) -> None:
        """Sends `batch` within the wrapped client's deadline from `started`, when the batch went out."""
        request, alone = _merged_or_alone(batch, gather)
        if request is None:
            for call in alone:
                self._send([call], gather, started)
            return
        try:
            result = self._client.sample_request(request, timeout=_time_left(self._client.timeout, started))
        except Exception as err:  # delivered to the callers, who re-raise it
            if _resent_alone(batch, err):
                for call in batch:
                    self._send([call], gather, started)
            else:
                for call in batch:
                    call.future.set_exception(err)
            return
        _deliver(batch, result, lambda future, value: future.set_result(value))

    def close(self) -> None:
        """Sends what is pending, waits for it, and stops; the wrapped client stays open."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._collector.join()
        self._senders.shutdown(wait=True)

    def __enter__(self) -> BatchingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncBatchingClient(_Batcher[AsyncSamplerClient]):
    """asyncio twin of BatchingClient around an AsyncSamplerClient; create it inside its event loop."""

    def __init__(
        self, client: AsyncSamplerClient, *, max_rows: int = 256, max_delay_us: int = 500, max_in_flight: int = 2
    ) -> None:
        super().__init__(client, max_rows, max_delay_us, max_in_flight)
        self._max_in_flight = max_in_flight
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        """Flushes in flight: each sends the batches of the calls it took."""

    async def sample(self, logits: Any, **params: Any) -> SampleResult:
        """Samples like AsyncSamplerClient.sample; returns when this call's rows are back."""
        if self._closed:
            raise RuntimeError("AsyncBatchingClient is closed")
        loop = asyncio.get_running_loop()
        call = _Call(build_sample_request(logits, **params), loop.create_future())
        self._pending.append(call)
        self._pending_rows += call.rows
        if self._pending_rows >= self._max_rows:
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = loop.call_later(self._max_delay_s, self._flush)
        return await call.future

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if len(self._tasks) >= self._max_in_flight:
            return  # the calls keep gathering; the next flush to finish sends them
        calls, self._pending, self._pending_rows = self._pending, [], 0
        task = asyncio.ensure_future(self._send_all(calls))
        self._tasks.add(task)
        task.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if self._pending:
            self._flush()

    async def _server_gathers(self) -> bool:
        if self._gather is None:
            try:
                self._gather = _ROWS_FEATURE in (await self._client.server_info()).features
            except TokenSamplerError:
                return False  # asked again with the next batch
        return self._gather

    async def _send_all(self, calls: list[_Call]) -> None:
        gather = _region_calls(calls) > 1 and await self._server_gathers()
        batches = _batches(calls, self._max_rows, gather, self._client.max_message_bytes)
        started = time.monotonic()
        await asyncio.gather(*(self._send(batch, gather, started) for batch in batches))

    async def _send(self, batch: list[_Call], gather: bool, started: float) -> None:
        """Sends `batch` within the wrapped client's deadline from `started`, when the batch went out."""
        request, alone = _merged_or_alone(batch, gather)
        if request is None:
            await asyncio.gather(*(self._send([call], gather, started) for call in alone))
            return
        try:
            result = await self._client.sample_request(request, timeout=_time_left(self._client.timeout, started))
        except Exception as err:  # delivered to the callers, who re-raise it
            if _resent_alone(batch, err):
                await asyncio.gather(*(self._send([call], gather, started) for call in batch))
            else:
                for call in batch:
                    if not call.future.done():
                        call.future.set_exception(err)
            return

        def set_result(future: asyncio.Future, value: SampleResult) -> None:
            if not future.done():  # a caller that was cancelled no longer wants its rows
                future.set_result(value)

        _deliver(batch, result, set_result)

    async def close(self) -> None:
        """Sends what is pending and waits for every batch in flight; later calls are refused."""
        self._closed = True
        while self._pending or self._tasks:
            if self._pending:
                self._flush()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> AsyncBatchingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
