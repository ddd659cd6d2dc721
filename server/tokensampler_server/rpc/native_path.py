"""The native request path beside the Python one (csrc/request_path.cpp; docs/design/service-path.md).

On the CUDA backend, a SampleRequest whose logits lie in a CUDA region of the backend's GPU or are carried in
the request (uploaded straight from its bytes), and that asks for tokens alone (no log-probs, no logit
processing, no output regions, one sample) is parsed, validated, sampled and answered in C++ from its bytes:
the per-message Python that dominated a stream message's time (docs/design/service-path.md) is not run.
Everything else, errors included, is declined before anything a client could see, and sample_rpc.py answers it
as before. The region registry tells this path which CUDA regions exist (`region_added` / `region_removed`).

Batching follows the dynamic batcher's rule for small GPU-resident batches (batcher.py): with no queue delay a
request is sampled at once, on the event loop (its launches and one synchronisation cost less than a hand-off
to a thread, and polling from the loop instead showed no gain: docs/design/service-path.md). With
`--max-queue-delay-us`, requests wait in a bounded queue until that long after the oldest arrived, or until
they fill `max_batch_rows`; then the oldest and the waiting requests of its vocabulary and dtype are sampled as
one batch (one set of launches, one synchronisation), each answered with its own rows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tokensampler_server.backends import Backend
from tokensampler_server.batching.batcher import settle
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import queue_full
from tokensampler_server.resources.regions import Region

log = logging.getLogger(__name__)


class NativeAnswer(NamedTuple):
    response: bytes
    """The serialized SampleResponse, or SampleStreamResponse for a stream message."""
    decode_ns: int
    queue_ns: int
    compute_ns: int
    encode_ns: int
    batch_rows: int
    """Rows of the batch the request was sampled in."""
    rows_by_mode: tuple[int, int, int, int, int]
    """Rows per mode in metrics.ROW_MODES order (fused excluded: never on this path)."""


@dataclass
class _Waiting:
    prepared: Any
    """The C++ PreparedRequest."""
    request: bytes
    """Kept until sampled: carried logits are read from these bytes."""
    future: asyncio.Future
    arrived_ns: int


class NativePath:
    """The C++ path of one CUDA backend, with the CUDA regions it may read and its queue of requests."""

    def __init__(self, path: Any, device: torch.device, limits: Limits, *, max_queue_delay_us: int = 0,
                 max_queue_rows: int | None = None, observe_batch_rows: Callable[[int], None] | None = None) -> None:
        """`path`: the C++ RequestPath of `device` (for_backend), or a stand-in with its methods."""
        self._path = path
        self._device = device
        self._limits = limits
        self._delay_s = max_queue_delay_us / 1e6
        self._max_queue_rows = max_queue_rows if max_queue_rows is not None else 8 * limits.max_batch_rows
        self._observe_batch_rows = observe_batch_rows
        self._waiting: list[_Waiting] = []
        self._queued_rows = 0
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def for_backend(cls, backend: Backend, limits: Limits, **batching: Any) -> NativePath:
        """The path of a CUDA backend's GPU; `batching`: __init__'s keyword arguments."""
        from tokensampler_server.backends.cuda_build import load_kernels

        device = backend.device
        path = load_kernels(device.index).RequestPath(device.index, limits.max_batch_rows, limits.max_batch_elements,
                                                      backend.fallback_counter_address)
        return cls(path, device, limits, **batching)

    def region_added(self, region: Region) -> None:
        """A region the registry has just made usable: CUDA regions of this GPU become readable here."""
        if region.kind == "cuda_ipc" and region.buffer.device == self._device:
            event = region.ready_event.cuda_event if region.ready_event is not None else 0
            self._path.add_region(region.name, region.buffer.data_ptr(), region.byte_size, region.producer_pid, event)

    def region_removed(self, name: str) -> None:
        """A region about to go: waits for a batch being sampled, then forgets it (queued requests that name it
        are declined, and the Python path answers them NOT_FOUND)."""
        self._path.remove_region(name)

    @property
    def queued_requests(self) -> int:
        """Queued requests whose callers still want the answer."""
        return sum(not waiting.future.done() for waiting in self._waiting)

    def submit(self, request: bytes, request_id: str, stream_message: bool) -> asyncio.Future | None:
        """Queues `request` (SampleRequest bytes), or returns None: the Python path must answer it. The future
        gets its NativeAnswer (at once when there is no queue delay), or None when the request is declined after
        all (a row for the CPU reference, or its region gone before it was sampled). RESOURCE_EXHAUSTED past
        max_queue_rows."""
        prepared = self._path.prepare(request, request_id, stream_message)
        if prepared is None:
            return None
        if self._queued_rows + prepared.num_rows > self._max_queue_rows:
            raise queue_full(self._queued_rows, self._max_queue_rows, "rows")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(prepared, request, loop.create_future(), time.perf_counter_ns())
        self._waiting.append(waiting)
        self._queued_rows += prepared.num_rows
        self._schedule(loop)
        return waiting.future

    async def sample(self, request: bytes, request_id: str, stream_message: bool) -> NativeAnswer | None:
        """The answer to `request`, or None: the Python path must answer it."""
        pending = self.submit(request, request_id, stream_message)
        return None if pending is None else await pending

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._delay_s or self._queued_rows >= self._limits.max_batch_rows:
            self._launch(loop)
        elif self._timer is None:
            waited_s = (time.perf_counter_ns() - self._waiting[0].arrived_ns) / 1e9
            self._timer = loop.call_later(max(0.0, self._delay_s - waited_s), self._launch, loop)

    def _take(self) -> list[_Waiting]:
        """Removes the next batch from the queue: the oldest request and the later ones of its vocabulary and
        dtype, within the rows and elements one request may have. Requests whose callers are gone are dropped
        on the way."""
        group: list[_Waiting] = []
        kept: list[_Waiting] = []
        key, rows, most_rows = None, 0, 0
        for waiting in self._waiting:
            prepared = waiting.prepared
            if waiting.future.done():
                self._queued_rows -= prepared.num_rows
            elif not group:
                key, rows = prepared.merge_key, prepared.num_rows
                most_rows = min(self._limits.max_batch_rows, self._limits.max_batch_elements // key[0])
                group.append(waiting)
            elif prepared.merge_key == key and rows + prepared.num_rows <= most_rows:
                rows += prepared.num_rows
                group.append(waiting)
            else:
                kept.append(waiting)
        self._waiting = kept
        self._queued_rows -= rows
        return group

    def _launch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Samples the next batch and answers its callers; schedules what still waits."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        group = self._take()
        if group:
            self._sample(group)
        if self._waiting:
            self._schedule(loop)

    def _sample(self, group: list[_Waiting]) -> None:
        try:
            answers = self._path.sample([waiting.prepared for waiting in group])
        except Exception as err:  # noqa: BLE001 - each caller gets the failure; the call guard classifies it
            for waiting in group:
                settle(waiting.future, None, err)
            return
        batch_rows = 0
        for waiting, answer in zip(group, answers):
            if answer is None:
                settle(waiting.future, None, None)
            else:
                batch_rows = answer[-1]
                settle(waiting.future, NativeAnswer(*answer, waiting.prepared.rows_by_mode), None)
        if batch_rows and self._observe_batch_rows is not None:
            self._observe_batch_rows(batch_rows)


def create_native_path(backend: Backend, limits: Limits, enabled: bool, *, max_queue_delay_us: int = 0,
                       max_queue_rows: int | None = None,
                       observe_batch_rows: Callable[[int], None] | None = None) -> NativePath | None:
    """The native path of a CUDA backend; None on the CPU backend, when turned off, or when it fails to start
    (logged: the Python path serves everything then)."""
    if not enabled or backend.info().name != "cuda":
        return None
    try:
        path = NativePath.for_backend(backend, limits, max_queue_delay_us=max_queue_delay_us,
                                             max_queue_rows=max_queue_rows, observe_batch_rows=observe_batch_rows)
    except Exception as err:  # noqa: BLE001 - the Python path still serves every request
        log.warning("native request path unavailable (%s): every request takes the Python path", err)
        return None
    log.info("native request path on: plain requests (logits in a CUDA region or carried) are answered in C++")
    return path
