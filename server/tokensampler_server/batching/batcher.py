"""Server-side dynamic batching: concurrent requests coalesced into one backend call.

Requests wait in a bounded queue. The backend runs one merged batch at a time on its worker thread;
while it runs, new requests gather, so batches grow with load by themselves. A batch closes at
`max_batch_rows` rows (sampled at once when the queue holds that many), or `max_queue_delay_us` after its first
request arrived (0: no waiting beyond the backend being busy), and within max_batch_elements. A full queue answers
RESOURCE_EXHAUSTED at once.
A caller that goes away (cancelled, deadline passed) leaves its rows behind; the other requests of its batch
are unaffected, and work whose every caller has gone is dropped before it starts.

The queue also holds direct work: requests a sampler of their own answers on the event loop, in groups of one
merge key (the native path's prepared requests, rpc/native_path.py). They count against the same bounds,
wait out the same delay, and, being GPU work on their own stream, may run while a batch is on the worker.

Each queued request holds a share of its lease (leases.py): the regions and weights it reads stay registered
and mapped until the backend is done with it, however early its call ends. The other workloads
(`run_exclusive`) count against the same bounds, hold their leases the same way, and are dropped the same way.

Per-call cost matters as much as merging (docs/design/service-path.md): with no queue delay, an idle
backend gets a request's batch at once from `enqueue` (no runner task to wake), and the worker thread
hands each result straight back to the event loop with one call_soon_threadsafe. A small batch whose
input already lies on the GPU (a CUDA region) runs on the event loop itself when the worker is idle:
its kernels and one synchronisation take less time than the two thread handoffs would.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Protocol, TypeVar

import grpc
import torch

from tokensampler_server.backends import Backend
from tokensampler_server.backends.nccl import NcclError
from tokensampler_server.batching.batch_merge import merge_batches, merge_key, split_result
from tokensampler_server.core.errors import ServiceError, never_fits, queue_full
from tokensampler_server.resources.leases import Lease
from tokensampler_server.core.request_context import current_abandoned
from tokensampler_server.model.sampling import LogitProcessing, SamplingBatch, SamplingResult


T = TypeVar("T")
Done = Callable[[object, BaseException | None], None]
"""Called on the event loop with (outcome, None) or (None, error) when a worker job ends."""


def _backend_errors_as_status(work: Callable[[], T]) -> T:
    """Runs `work`; running out of memory becomes RESOURCE_EXHAUSTED after the cache is given back, and a failed
    exchange between vocabulary-parallel GPUs UNAVAILABLE (health turns NOT_SERVING until they recover)."""
    try:
        return work()
    except (torch.cuda.OutOfMemoryError, MemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give back what the failed work had taken
        raise ServiceError(
            "out of memory: retry later or with fewer rows", grpc.StatusCode.RESOURCE_EXHAUSTED, retry_mark="memory"
        ) from None
    except NcclError as err:
        raise ServiceError(f"vocabulary-parallel sampling failed: {err}; retry on another replica",
                           grpc.StatusCode.UNAVAILABLE) from None


def host_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a request's tensor held in host memory (tensors in GPU regions belong to their producer)."""
    return tensor.numel() * tensor.element_size() if tensor.device.type == "cpu" else 0


def entry_bytes(processing: LogitProcessing | None) -> int:
    """Bytes of a request's token entries in host memory (shared lists expanded); 0 without processing."""
    return 0 if processing is None else processing.host_bytes()


def _host_bytes(batch: SamplingBatch) -> int:
    """What a queued request holds in host memory: its input, and its token entries."""
    return host_bytes(batch.logits if batch.logits is not None else batch.hidden.states) + entry_bytes(batch.processing)


# Largest GPU-resident batch run on the event loop: B·V logits (64 rows of 262,144), a few hundred µs
# of kernels at most; larger ones, and those with top log-probs (a full sort), go to the worker.
_INLINE_MAX_ELEMENTS = 1 << 24


# A batch of at least this many logits (B·V·num_samples) is long on a backend with concurrent calls (the CPU
# reference: ~0.25 s with Gumbel noise on 2 cores, ~60 ns a logit) and runs on the long worker, so that the short
# ones go on beside it instead of waiting behind it: a legal maximum took 20-37 s (docs/hardening.md).
LONG_BATCH_ELEMENTS = 1 << 22


def _runs_inline(batch: SamplingBatch) -> bool:
    tensor = batch.logits if batch.logits is not None else batch.hidden.states
    return (tensor.device.type != "cpu" and batch.top_logprobs == 0
            and batch.num_rows * batch.vocab_size <= _INLINE_MAX_ELEMENTS)


def settle(future: asyncio.Future, outcome: object, error: BaseException | None) -> None:
    """Hands a caller its outcome or error, unless it went away (native_path.py shares it)."""
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)


def _watched(abandoned: Callable[[], bool], work: Callable[..., T], *args: object) -> T:
    """Runs `work(*args)` unless `abandoned()` (every caller gone), telling the work's long loops how to ask
    the same (request_context.raise_if_abandoned)."""
    if abandoned():
        raise ServiceError("cancelled: the caller went away before its work started", grpc.StatusCode.CANCELLED)
    # Reset after the work: the context outlives the job, and `abandoned` reaches the batch (its LM head
    # included), whose memory an unregister must free at once.
    token = current_abandoned.set(abandoned)
    try:
        return work(*args)
    finally:
        current_abandoned.reset(token)


def _finished_on(device: torch.device, work: Callable[[], T]) -> T:
    """`work()`, returned only once the device's stream has finished it: until then its inputs are still read."""
    outcome = work()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return outcome


class _Worker:
    """A backend thread (the batcher's one, or two with a long worker): runs jobs in order, and reports each on its
    event loop.

    Cheaper than run_in_executor (no concurrent Future to wrap, one loop turn less per job).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, loop: asyncio.AbstractEventLoop, context: contextvars.Context, work: Callable[[], object],
               done: Done) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="tokensampler-backend", daemon=True)
            self._thread.start()
        self._jobs.put((loop, context, work, done))

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, context, work, done = job
            try:
                outcome, error = context.run(work), None
            except BaseException as err:  # every job's caller hears how it ended
                outcome, error = None, err
            try:
                loop.call_soon_threadsafe(done, outcome, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            # The finished job's batch (and so its LM head) must not wait here for the next job to come.
            del job, context, work, done, outcome, error

    def shutdown(self) -> None:
        """Waits for the jobs already submitted, then stops the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


@dataclass(frozen=True)
class BatchTimes:
    """Nanoseconds a request spent queued and in its backend call, and the rows of that call."""

    queue_ns: int
    compute_ns: int
    batch_rows: int


class DirectWork(Protocol):
    """A request that a DirectSampler answers (the native path's PreparedRequest)."""

    @property
    def num_rows(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def merge_key(self) -> Hashable:
        """Requests of one key may be sampled together."""


DirectSampler = Callable[[list], list]
"""Samples a group of DirectWork of one merge key on the event loop: one outcome per request, or raises."""


@dataclass
class _Pending:
    work: SamplingBatch | DirectWork
    future: asyncio.Future
    nbytes: int
    """Host bytes it holds (queue bounds)."""
    sampler: DirectSampler | None = None
    """None: a SamplingBatch for the backend; else the sampler of this direct work."""
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    """The caller's context (request id): the backend logs a batch under its first request's."""
    lease: Lease | None = None
    """The batcher's share of what the request holds, released once the backend is done with it."""
    rows: int = field(init=False)
    """The work's rows, read once (a batch reads them off a tensor)."""
    arrival: int = 0
    """Its place in the queue: requests of different kinds compare by it."""
    kind: str = ""
    """What it waits for (_DIRECT, _SHORT, _LONG), set as it is queued."""
    lane: tuple[str, Hashable] = ("", None)
    """Its kind and merge key, set as it is queued: only requests of its lane may join its group."""

    def __post_init__(self) -> None:
        self.rows = self.work.num_rows

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


_DIRECT, _SHORT, _LONG = _KINDS = ("direct", "short", "long")
"""The kinds of queued request: direct work (starts at once), and batches for the short and the long worker."""

_Requests = OrderedDict[asyncio.Future, _Pending]
_ARRIVAL = attrgetter("arrival")


class _WaitQueue:
    """The queued requests, oldest first, also by kind, and by lane (`_Pending.lane`) and rows: the next group is
    found from the oldest request of each kind and, in the lane of the one chosen, the requests of as many rows
    as still fit, without walking the rest of the queue (N requests of N vocabularies, a group each, took O(N²) to
    drain; so did requests of one lane too large to share a group)."""

    def __init__(self) -> None:
        self._all: _Requests = OrderedDict()
        self._kinds: dict[str, _Requests] = {kind: OrderedDict() for kind in _KINDS}
        self._lanes: dict[tuple[str, Hashable], dict[int, _Requests]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[_Pending]:
        # A copy, which list() makes in one call that lets no other thread run: the metrics endpoint's thread counts
        # the queue (queued_requests) while the event loop changes it, and walking the dict itself failed the scrape
        # with "OrderedDict mutated during iteration".
        return iter(list(self._all.values()))

    def get(self, future: asyncio.Future) -> _Pending | None:
        return self._all.get(future)

    def oldest(self) -> _Pending:
        return next(iter(self._all.values()))

    def of_kind(self, kind: str) -> _Requests:
        """The requests of `kind`, oldest first."""
        return self._kinds[kind]

    def lane(self, pending: _Pending) -> dict[int, _Requests]:
        """The requests of `pending`'s lane by their rows, each oldest first."""
        return self._lanes[pending.lane]

    def add(self, pending: _Pending) -> None:
        future, rows = pending.future, pending.rows
        self._all[future] = self._kinds[pending.kind][future] = pending
        lane = self._lanes.setdefault(pending.lane, {})
        same_rows = lane.get(rows)
        if same_rows is None:
            same_rows = lane[rows] = OrderedDict()
        same_rows[future] = pending

    def remove(self, pending: _Pending) -> None:
        future, rows = pending.future, pending.rows
        del self._all[future], self._kinds[pending.kind][future]
        lane = self._lanes[pending.lane]
        same_rows = lane[rows]
        del same_rows[future]
        if not same_rows:
            del lane[rows]
            if not lane:
                del self._lanes[pending.lane]


class DynamicBatcher:
    def __init__(
        self,
        backend: Backend,
        *,
        max_batch_rows: int,
        max_batch_elements: int | None = None,
        max_queue_delay_us: int = 0,
        max_queue_rows: int | None = None,
        max_queue_bytes: int = 2 << 30,
        observe_batch_rows: Callable[[int], None] | None = None,
        long_batch_elements: int = LONG_BATCH_ELEMENTS,
    ) -> None:
        self._backend = backend
        self._max_batch_rows = max_batch_rows
        self._max_batch_elements = max_batch_elements
        self._delay_s = max_queue_delay_us / 1e6
        self._max_queue_rows = max_queue_rows if max_queue_rows is not None else 8 * max_batch_rows
        self._max_queue_bytes = max_queue_bytes
        self._queue = _WaitQueue()
        self._arrivals = itertools.count()
        self._gone: list[asyncio.Future] = []
        """Futures of queued requests that ended (their callers went away): _take drops them."""
        self._queued_rows = 0
        self._queued_bytes = 0
        self._queued_long_rows = 0
        """Rows of the queued long batches (_is_long), which no group merges: kept as requests come and go, so that
        a request's arrival does not walk the queue."""
        self._running = False
        """A merged batch is on the worker; the next one starts when it is back."""
        self._exclusive = 0
        """run_exclusive jobs on the worker: no batch runs on the event loop meanwhile."""
        self._exclusive_rows = 0
        self._exclusive_bytes = 0
        """Rows and host bytes of the run_exclusive jobs not yet finished, within the queue's bounds."""
        self._exclusive_long = 0
        self._exclusive_long_rows = 0
        self._exclusive_long_bytes = 0
        """The same of the long ones (on the long worker), held to half the queue with the long batches."""
        self._wakeup: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None
        """Waits out max_queue_delay_us before each batch (only when that delay is set)."""
        self._observe_batch_rows = observe_batch_rows
        self._worker = _Worker()
        self._long_elements = long_batch_elements if backend.concurrent_calls else None
        """Batches of at least this many logits run on `_long_worker`, one at a time (None: every batch on
        `_worker`)."""
        self._long_worker = _Worker() if self._long_elements is not None else None
        self._running_long = False
        """A long batch is on the long worker."""

    @property
    def max_queue_bytes(self) -> int:
        return self._max_queue_bytes

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    @property
    def queued_requests(self) -> int:
        """Requests waiting for the backend whose callers still want the answer."""
        return sum(not pending.future.done() for pending in self._queue)

    def _check_room(self, rows: int, nbytes: int) -> None:
        """RESOURCE_EXHAUSTED when `rows` and `nbytes` more would not fit the queue's bounds: marked retryable, unless
        the request alone is larger than a bound, which no retry gets past."""
        if nbytes > self._max_queue_bytes:
            raise never_fits(nbytes, self._max_queue_bytes, "bytes", "--max-queue-mb")
        if rows > self._max_queue_rows:
            raise never_fits(rows, self._max_queue_rows, "rows", "--max-queue-rows")
        waiting_rows = self._queued_rows + self._exclusive_rows
        waiting_bytes = self._queued_bytes + self._exclusive_bytes
        if waiting_rows + rows > self._max_queue_rows:
            raise queue_full(waiting_rows, self._max_queue_rows, "rows")
        if waiting_bytes + nbytes > self._max_queue_bytes:
            raise queue_full(waiting_bytes, self._max_queue_bytes, "bytes")

    def _check_long_share(self, rows: int, nbytes: int) -> None:
        """RESOURCE_EXHAUSTED (retryable) for long work of `rows` and `nbytes` (a long batch, or a workload that
        reads as many logits) when other long work holds queue room and together they would hold more than half
        the queue's rows or bytes: the other half stays for the short requests, which run beside them. Long work
        with none other holding room takes what the whole queue allows. Long batches hold it while they wait, long
        workloads until they end (as in _check_room)."""
        waiting = [p for p in self._queue.of_kind(_LONG).values() if not p.future.done()]
        if not waiting and not self._exclusive_long:
            return
        held_rows = self._exclusive_long_rows + sum(p.rows for p in waiting)
        held_bytes = self._exclusive_long_bytes + sum(p.nbytes for p in waiting)
        if held_rows + rows > self._max_queue_rows // 2:
            raise queue_full(held_rows, self._max_queue_rows // 2, "rows of long batches")
        if held_bytes + nbytes > self._max_queue_bytes // 2:
            raise queue_full(held_bytes, self._max_queue_bytes // 2, "bytes of long batches")

    def enqueue(self, batch: SamplingBatch, lease: Lease | None = None) -> asyncio.Future:
        """Queues `batch` to be sampled, possibly together with other requests; the future gets
        (its own rows, BatchTimes). Raises RESOURCE_EXHAUSTED at once when the queue is full. A share of
        `lease` is held until the backend is done with the batch."""
        loop = asyncio.get_running_loop()
        return self._queue_up(_Pending(batch, loop.create_future(), _host_bytes(batch),
                                       lease=None if lease is None else lease.share()), loop)

    def enqueue_direct(self, work: DirectWork, sampler: DirectSampler, nbytes: int) -> asyncio.Future:
        """Queues direct work that `sampler` answers (with other work of its key); the future gets its outcome.
        nbytes: the host memory it holds. RESOURCE_EXHAUSTED at once when the queue is full."""
        loop = asyncio.get_running_loop()
        return self._queue_up(_Pending(work, loop.create_future(), nbytes, sampler), loop)

    def _queue_up(self, pending: _Pending, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        try:
            self._check_room(pending.rows, pending.nbytes)
            if self._is_long(pending):
                self._check_long_share(pending.rows, pending.nbytes)
        except ServiceError:
            pending.release()
            raise
        self._place(pending)
        self._queue.add(pending)
        pending.future.add_done_callback(self._went)
        self._count(pending, 1)
        if not self._delay_s or self._rows_to_merge() >= self._max_batch_rows:
            self._launch(loop)  # an idle backend starts on this request now, as on a full batch
        else:
            self._wake_runner()
        return pending.future

    def _place(self, pending: _Pending) -> None:
        """Gives a request its place in the queue, its kind and its lane."""
        work = pending.work
        pending.arrival = next(self._arrivals)
        if pending.sampler is not None:
            pending.kind, key = _DIRECT, (pending.sampler, work.merge_key)
        else:
            pending.kind, key = _LONG if self._is_long(pending) else _SHORT, merge_key(work)
        pending.lane = pending.kind, key

    async def submit(self, batch: SamplingBatch) -> tuple[SamplingResult, BatchTimes]:
        """Samples `batch`, possibly together with other requests; returns its own rows."""
        return await self.enqueue(batch)

    def _reads_long(self, elements: int) -> bool:
        """Whether work that reads this many logits is long (LONG_BATCH_ELEMENTS): it runs on the long worker."""
        return self._long_elements is not None and elements >= self._long_elements

    def _is_long(self, pending: _Pending) -> bool:
        """Whether the request is a long batch: B·V·num_samples logits or more, as the CPU backend's
        --max-batch-elements counts them (its noise is drawn a sample at a time over the whole row)."""
        work = pending.work
        return pending.sampler is None and self._reads_long(pending.rows * work.vocab_size * work.num_samples)

    def _count(self, pending: _Pending, sign: int) -> None:
        """Adds (sign 1) or removes (-1) the queued request's rows and bytes to or from the queue's counts."""
        rows = sign * pending.rows
        self._queued_rows += rows
        self._queued_bytes += sign * pending.nbytes
        if pending.kind == _LONG:
            self._queued_long_rows += rows

    def _rows_to_merge(self) -> int:
        """Queued rows that the next groups may merge: long batches run alone, so they do not fill a group."""
        return self._queued_rows - self._queued_long_rows

    def _may_start(self, kind: str) -> bool:
        """Whether a request of `kind` could start now: direct work always, a batch when its worker is free."""
        if kind == _DIRECT:
            return True
        return not self._running_long if kind == _LONG else not self._running

    def _went(self, future: asyncio.Future) -> None:
        """A queued request's future ended: if its caller went away, _take drops the request."""
        self._gone.append(future)

    def _take(self) -> list[_Pending]:
        """Removes the next group from the queue: the oldest request that may start now (`_may_start`) and the
        later ones it can merge with, up to max_batch_rows rows; a long batch alone, a short group short. Requests
        whose callers are gone are dropped on the way."""
        self._drop_gone()
        head = self._next_head()
        if head is None:
            return []
        group = self._group_of(head)
        for pending in group:
            self._queue.remove(pending)
            pending.future.remove_done_callback(self._went)
            self._count(pending, -1)
        return group

    def _drop(self, pending: _Pending) -> None:
        """Takes a request whose caller went away out of the queue."""
        self._queue.remove(pending)
        self._count(pending, -1)
        pending.release()

    def _drop_gone(self) -> None:
        """Drops the requests whose futures ended while queued (their callers went away)."""
        if not self._gone:
            return
        gone, self._gone = self._gone, []
        for future in gone:
            pending = self._queue.get(future)
            if pending is not None:  # (else taken, or dropped already)
                self._drop(pending)

    def _oldest_of(self, kind: str) -> _Pending | None:
        """The oldest queued request of `kind` whose caller still waits; those before it are dropped."""
        waiting = self._queue.of_kind(kind)
        while waiting:
            oldest = next(iter(waiting.values()))
            if not oldest.future.done():
                return oldest
            self._drop(oldest)
        return None

    def _next_head(self) -> _Pending | None:
        """The oldest request that may start now: the oldest of one kind."""
        head = None
        for kind in _KINDS:
            oldest = self._oldest_of(kind)
            if oldest is not None and self._may_start(kind) and (head is None or oldest.arrival < head.arrival):
                head = oldest
        return head

    def _most_rows(self, head: _Pending) -> int:
        """The rows of a group that starts with `head`."""
        work = head.work
        if head.kind == _LONG:
            return head.rows
        most_rows = self._max_batch_rows
        if self._max_batch_elements is not None:  # one request alone is within it (validation)
            most_rows = min(most_rows, max(head.rows, self._max_batch_elements // work.vocab_size))
        if self._long_elements is not None and head.sampler is None:
            most_rows = min(most_rows, (self._long_elements - 1) // (work.vocab_size * work.num_samples))
        return most_rows

    def _group_of(self, head: _Pending) -> list[_Pending]:
        """`head` and the later requests of its lane that fit beside it, in order. Only its lane can: another kind
        never fits (a long batch runs alone; a short group stays short of a long one's logits). The requests of
        each size are read while that size fits, merged in order: those that would not fit are not walked."""
        lane = self._queue.lane(head)
        if len(lane) == 1 and len(lane[head.rows]) == 1:  # alone in its lane
            return [head]
        group, gone = [head], []
        rows, most_rows = head.rows, self._most_rows(head)

        def fits(size: int) -> Callable[[_Pending], bool]:
            return lambda _pending: rows + size <= most_rows  # rows: those of the group so far

        sizes = [itertools.takewhile(fits(size), same_rows.values())
                 for size, same_rows in lane.items() if rows + size <= most_rows]
        for pending in heapq.merge(*sizes, key=_ARRIVAL) if len(sizes) > 1 else itertools.chain(*sizes):
            if pending is head:
                continue
            if pending.future.done():
                gone.append(pending)
            elif rows + pending.rows <= most_rows:  # (it fitted when its size's turn was read)
                group.append(pending)
                rows += pending.rows
        for pending in gone:
            self._drop(pending)
        return group

    def _wake_runner(self) -> None:
        if self._runner is None or self._runner.done():  # (done: its event loop has ended)
            self._wakeup = asyncio.Event()
            self._runner = asyncio.ensure_future(self._run())
        self._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._rows_to_merge() < self._max_batch_rows:
                await asyncio.sleep(self._delay_left_s())
            self._launch(loop)  # what may start beside the batches on the workers; _finished wakes this again

    def _delay_left_s(self) -> float:
        """What is left of the oldest queued request's --max-queue-delay-us: a request waits the delay once, not
        again before every group launched ahead of it (20 requests of distinct vocabularies took 20 delays)."""
        if not self._queue or self._delay_s <= 0:
            return self._delay_s
        waited_s = (time.perf_counter_ns() - self._queue.oldest().enqueued_ns) * 1e-9
        return max(0.0, self._delay_s - waited_s)

    def _launch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs the next group, if any request still waits: direct work at once, on the event loop (also beside a
        batch on the worker: its own stream), a batch when no other batch of its kind (short or long) is running."""
        group = self._take()
        if not group:
            return
        if group[0].sampler is not None:
            self._sample_direct(group)
            self._next(loop)
            return
        started = time.perf_counter_ns()
        long = self._is_long(group[0])
        try:
            merged = merge_batches([p.work for p in group])
        except Exception as err:  # each caller gets the failure; the call guard classifies it
            self._finished(loop, group, started, 0, long, None, err)
            return
        done = partial(self._finished, loop, group, started, merged.num_rows, long)
        if not long and not self._exclusive and _runs_inline(merged) and not self._backend.may_stall(merged):
            try:
                outcome, error = group[0].context.run(self._sample, merged), None
            except Exception as err:  # handed to the callers, as from the worker
                outcome, error = None, err
            done(outcome, error)
            return
        if long:
            self._running_long = True
        else:
            self._running = True

        def abandoned() -> bool:
            return all(p.future.done() for p in group)

        worker = self._long_worker if long else self._worker
        worker.submit(loop, group[0].context, partial(_watched, abandoned, self._sample, merged), done)
        if self._long_worker is not None:
            self._next(loop)  # the other worker may take the next group

    def _sample_direct(self, group: list[_Pending]) -> None:
        """Direct work of one key, answered by its sampler."""
        try:
            outcomes = group[0].sampler([p.work for p in group])
        except Exception as err:  # noqa: BLE001 - each caller gets the failure; the call guard classifies it
            for pending in group:
                settle(pending.future, None, err)
            return
        for pending, outcome in zip(group, outcomes):
            settle(pending.future, outcome, None)
        if self._observe_batch_rows is not None:
            self._observe_batch_rows(sum(p.work.num_rows for p in group))

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        """Schedules the next group of what still waits."""
        if self._queue:
            if self._delay_s:
                self._wake_runner()
            else:  # on the next turn: requests that arrived meanwhile can join the group
                loop.call_soon(self._launch, loop)

    def _finished(self, loop: asyncio.AbstractEventLoop, group: list[_Pending], started: int, rows: int, long: bool,
                  result: SamplingResult | None, error: BaseException | None) -> None:
        """On the event loop: hands every caller its rows (or the error), then starts the next batch."""
        if long:
            self._running_long = False
        else:
            self._running = False
        finished = time.perf_counter_ns()
        if error is not None:
            for pending in group:
                settle(pending.future, None, error)
        else:
            if self._observe_batch_rows is not None:
                self._observe_batch_rows(rows)
            parts = split_result(result, [p.work.num_rows for p in group]) if len(group) > 1 else [result]
            for pending, part in zip(group, parts):
                settle(pending.future, (part, BatchTimes(started - pending.enqueued_ns, finished - started, rows)), None)
        for pending in group:  # the backend is done with their memory
            pending.release()
        self._next(loop)

    async def run_exclusive(self, work: Callable[[], T], *, rows: int, elements: int, nbytes: int,
                            lease: Lease | None = None) -> T:
        """Runs `work` on a backend worker thread, between sampling batches: the long worker's when there is one and
        the work reads at least long_batch_elements logits (`elements`), else the other's. Its `rows` and host
        `nbytes` count against the queue's bounds (RESOURCE_EXHAUSTED at once past them) until it ends. Work whose
        caller has gone is dropped before it starts; a share of `lease` is held until the work, GPU stream included,
        is done. Out-of-memory errors answer RESOURCE_EXHAUSTED, as for batches. Long work, with the long batches,
        holds at most half the queue (_check_long_share)."""
        long = self._reads_long(elements)
        self._check_room(rows, nbytes)
        if long:
            self._check_long_share(rows, nbytes)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        share = None if lease is None else lease.share()
        held = 1 if long else 0

        def done(outcome: object, error: BaseException | None) -> None:
            self._exclusive -= 1
            self._exclusive_rows -= rows
            self._exclusive_bytes -= nbytes
            self._exclusive_long -= held
            self._exclusive_long_rows -= held * rows
            self._exclusive_long_bytes -= held * nbytes
            if share is not None:
                share.release()
            settle(future, outcome, error)

        self._exclusive += 1
        self._exclusive_rows += rows
        self._exclusive_bytes += nbytes
        self._exclusive_long += held
        self._exclusive_long_rows += held * rows
        self._exclusive_long_bytes += held * nbytes
        device = self._backend.device
        job = partial(_watched, future.done, _backend_errors_as_status, partial(_finished_on, device, work))
        worker = self._long_worker if long else self._worker
        worker.submit(loop, contextvars.copy_context(), job, done)
        return await future

    def _sample(self, batch: SamplingBatch) -> SamplingResult:
        return _backend_errors_as_status(lambda: self._backend.sample(batch))

    def drain(self) -> None:
        """At shutdown: nothing more will arrive to merge with, so the queue delay ends. What waits in it starts now
        and every later request at once, rather than holding the grace period for up to --max-queue-delay-us."""
        self._delay_s = 0.0
        if self._runner is not None:
            self._runner.cancel()
            self._runner = None
        if self._queue:
            self._launch(asyncio.get_running_loop())

    @property
    def idle(self) -> bool:
        """Nothing queued, running, or on the workers."""
        return not (self._queue or self._running or self._running_long or self._exclusive)

    async def close(self) -> None:
        """Stops taking batches once the queue is empty and the last batch is back."""
        while not self.idle:
            await asyncio.sleep(0.001)
        if self._runner is not None:
            self._runner.cancel()
        self._worker.shutdown()
        if self._long_worker is not None:
            self._long_worker.shutdown()
