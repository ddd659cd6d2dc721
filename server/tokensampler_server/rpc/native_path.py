"""The native path beside the Python one (csrc/native_path.cpp; docs/design/service-path.md).

On the CUDA backend, a SampleRequest whose logits lie in a CUDA region of the backend's GPU or are carried in
the request (uploaded straight from its bytes), and that asks for tokens alone (no log-probs, no logit
processing, no output regions, one sample) is parsed, validated, sampled and answered in C++ from its bytes:
the per-message Python that dominated a stream message's time (docs/design/service-path.md) is not run.
Everything else, errors included, is declined before anything a client could see, and sample_rpc.py answers it
as before. The region registry tells this path which CUDA regions exist (`region_added` / `region_removed`).

Prepared requests wait in the dynamic batcher's one queue (batcher.py: `enqueue_direct`), under its bounds and
queue delay: with no delay a request is sampled at once, on the event loop (its launches and one synchronisation
cost less than a hand-off to a thread, and polling from the loop instead showed no gain:
docs/design/service-path.md); with `--max-queue-delay-us` the waiting requests of one vocabulary and dtype are
sampled as one batch (one set of launches, one synchronisation), each answered with its own rows.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tokensampler_server.backends import Backend
from tokensampler_server.batching.batcher import DynamicBatcher
from tokensampler_server.core.config import Limits
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


class NativePath:
    """The C++ path of one CUDA backend, with the CUDA regions it may read; its requests queue on the batcher."""

    def __init__(self, path: Any, device: torch.device, batcher: DynamicBatcher) -> None:
        """`path`: the C++ NativePath of `device` (for_backend), or a stand-in with its methods."""
        self._path = path
        self._device = device
        self._batcher = batcher

    @classmethod
    def for_backend(cls, backend: Backend, limits: Limits, batcher: DynamicBatcher) -> NativePath:
        """The path of a CUDA backend's GPU."""
        from tokensampler_server.backends.cuda_build import load_kernels

        device = backend.device
        path = load_kernels(device.index).NativePath(device.index, limits.max_batch_rows, limits.max_batch_elements,
                                                      backend.fallback_counter_address)
        return cls(path, device, batcher)

    def region_added(self, region: Region) -> None:
        """A region the registry has just made usable: CUDA regions of this GPU become readable here."""
        if region.kind == "cuda_ipc" and region.buffer.device == self._device:
            event = region.ready_event.cuda_event if region.ready_event is not None else 0
            self._path.add_region(region.name, region.buffer.data_ptr(), region.byte_size, region.producer_pid, event)

    def region_removed(self, name: str) -> None:
        """A region about to go: waits for a batch being sampled, then forgets it (queued requests that name it
        are declined, and the Python path answers them NOT_FOUND)."""
        self._path.remove_region(name)

    def submit(self, request: bytes, request_id: str, stream_message: bool) -> asyncio.Future | None:
        """Queues `request` (SampleRequest bytes), or returns None: the Python path must answer it. The future
        gets its NativeAnswer (at once when there is no queue delay), or None when the request is declined after
        all (a row for the exact filter, or its region gone before it was sampled). RESOURCE_EXHAUSTED when the
        batcher's queue is full."""
        prepared = self._path.prepare(request, request_id, stream_message)
        if prepared is None:
            return None
        # Carried logits are read from the request's bytes when it is sampled: the queue holds them till then.
        return self._batcher.enqueue_direct(_Queued(prepared, request), self._sample, len(request))

    async def sample(self, request: bytes, request_id: str, stream_message: bool) -> NativeAnswer | None:
        """The answer to `request`, or None: the Python path must answer it."""
        pending = self.submit(request, request_id, stream_message)
        return None if pending is None else await pending

    def _sample(self, group: list[_Queued]) -> list[NativeAnswer | None]:
        """One batch of prepared requests of one vocabulary and dtype: each request's answer, or None (declined)."""
        answers = self._path.sample([queued.prepared for queued in group])
        return [None if answer is None else NativeAnswer(*answer, queued.prepared.rows_by_mode)
                for queued, answer in zip(group, answers)]


@dataclass(frozen=True)
class _Queued:
    """A prepared request in the batcher's queue (batcher.DirectWork), with the bytes its carried logits are read
    from."""

    prepared: Any
    """The C++ PreparedRequest."""
    request: bytes

    @property
    def num_rows(self) -> int:
        return self.prepared.num_rows

    @property
    def vocab_size(self) -> int:
        return self.prepared.merge_key[0]

    @property
    def merge_key(self) -> tuple[int, int]:
        return self.prepared.merge_key


def create_native_path(backend: Backend, limits: Limits, enabled: bool, batcher: DynamicBatcher) -> NativePath | None:
    """The native path of a CUDA backend, queueing on `batcher`; None on the CPU backend, when turned off, or when
    it fails to start (logged: the Python path serves everything then)."""
    if not enabled or backend.info().name != "cuda":
        return None
    try:
        path = NativePath.for_backend(backend, limits, batcher)
    except Exception as err:  # noqa: BLE001 - the Python path still serves every request
        log.warning("native path unavailable (%s): every request takes the Python path", err)
        return None
    log.info("native path on: plain requests (logits in a CUDA region or carried) are answered in C++")
    return path
