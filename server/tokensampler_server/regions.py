"""Zero-copy regions: memory a colocated client shares with the server, referenced by requests.

A region is a flat byte buffer: a POSIX shared-memory segment (CPU) or a CUDA allocation opened by
IPC handle (GPU). Requests name (region, offset, dtype, shape), or for logits rows anywhere in a region
(region, dtype, row size, one offset per row); every reference is bounds-checked.
Requests hold the region while they use it; unregistering waits for them, then releases the mapping.
A region that holds a registered LM-head weight (RegisterWeightsFromRegion) cannot be unregistered
until that weight is.
The producer owns the memory, keeps it alive while registered, and finishes writing before it sends a
request that reads it: it synchronises its CUDA stream, or records the region's ready event (a CUDA region
registered with one), which the server's work on the request then waits for on the GPU.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import DTYPE_TO_TORCH, dtype_name

from .errors import InvalidArgument, ServiceError
from .refcounted import RefCountedRegistry

_SHM_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_MAX_CACHED_VIEWS = 64


@dataclass
class Region:
    name: str
    kind: str
    """"shm" or "cuda_ipc"."""
    buffer: torch.Tensor
    """uint8 [byte_size], on the CPU (shm) or a GPU (cuda_ipc)."""
    release: Callable[[], None]
    producer_pid: int = 0
    """The producing process (cuda_ipc), 0 when unknown: its memory goes when it exits."""
    ready_event: torch.cuda.Event | None = None
    """The producer's interprocess event (cuda_ipc), recorded after each write: work on the region waits for it."""
    weights: set[str] = field(default_factory=set)
    """Names of the registered weights that lie in this region."""
    views: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = field(default_factory=dict, repr=False)
    """Tensors of the references already resolved: a decode loop names the same few every step, and
    slicing a view anew costs more than the rest of the lookup."""

    def check_producer(self, field: str) -> None:
        """FAILED_PRECONDITION once a CUDA region's producer has exited (reading it would fault)."""
        if self.producer_pid and not _process_exists(self.producer_pid):
            raise ServiceError(
                f"{field}: the process that shared region {self.name!r} (pid {self.producer_pid}) has exited; "
                "unregister the region", grpc.StatusCode.FAILED_PRECONDITION)

    def wait_for_producer_writes(self) -> None:
        """Orders the work this thread queues next on the region's GPU (the current stream, which the backend
        shares) after the producer's latest record of the ready event; nothing without one."""
        if self.ready_event is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self.ready_event)

    @property
    def byte_size(self) -> int:
        return int(self.buffer.numel())

    def tensor(self, ref: pb.TensorRef, field: str, dtypes: tuple[int, ...]) -> torch.Tensor:
        """The tensor `ref` points to: OUT_OF_RANGE past the region's end, INVALID_ARGUMENT if malformed."""
        _check_dtype(ref.dtype, field, dtypes)
        shape = tuple(ref.shape)
        key = (ref.offset, ref.dtype, shape)
        view = self.views.get(key)
        if view is None:
            view = self._view(ref, field, shape)
            if len(self.views) >= _MAX_CACHED_VIEWS:
                self.views.clear()
            self.views[key] = view
        return view

    def _view(self, ref: pb.TensorRef, field: str, shape: tuple[int, ...]) -> torch.Tensor:
        if any(dim < 0 for dim in shape):
            raise InvalidArgument(f"{field}.shape", f"got {list(shape)}, expected non-negative sizes")
        dtype = DTYPE_TO_TORCH[ref.dtype]
        itemsize = dtype.itemsize
        if ref.offset % itemsize:
            raise InvalidArgument(f"{field}.offset", f"got {ref.offset}, expected a multiple of {itemsize} ({dtype_name(ref.dtype)})")
        size = math.prod(shape) * itemsize
        if not size and math.prod(dim or 1 for dim in shape) * itemsize >= 2**63:  # torch's view sizes it in int64
            raise InvalidArgument(f"{field}.shape", f"got {list(shape)}, expected sizes whose product (zeros aside) "
                                                    f"times {itemsize} bytes is below 2^63")
        if ref.offset + size > self.byte_size:
            raise ServiceError(
                f"{field}: bytes [{ref.offset}, {ref.offset + size}) fall outside region {self.name!r} of {self.byte_size} bytes",
                grpc.StatusCode.OUT_OF_RANGE,
            )
        return self.buffer[ref.offset : ref.offset + size].view(dtype).view(shape)

    def rows(self, ref: pb.RowsRef, field: str, dtypes: tuple[int, ...]) -> torch.Tensor:
        """The [B, row_size] tensor whose row i starts at byte row_offsets[i]: one view when the rows lie back to
        back, else a copy made of one slice per run of adjacent rows. The caller bounds B·row_size first."""
        _check_dtype(ref.dtype, field, dtypes)
        dtype = DTYPE_TO_TORCH[ref.dtype]
        row_bytes = ref.row_size * dtype.itemsize
        runs: list[list[int]] = []  # [first byte, rows]
        for i, start in enumerate(ref.row_offsets):
            if start % dtype.itemsize:
                raise InvalidArgument(f"{field}.row_offsets[{i}]",
                                      f"got {start}, expected a multiple of {dtype.itemsize} ({dtype_name(ref.dtype)})")
            if start + row_bytes > self.byte_size:
                raise ServiceError(f"{field}.row_offsets[{i}]: bytes [{start}, {start + row_bytes}) fall outside "
                                   f"region {self.name!r} of {self.byte_size} bytes", grpc.StatusCode.OUT_OF_RANGE)
            if runs and runs[-1][0] + runs[-1][1] * row_bytes == start:
                runs[-1][1] += 1
            else:
                runs.append([start, 1])
        slices = [self.buffer[start : start + n * row_bytes].view(dtype).view(n, ref.row_size) for start, n in runs]
        return slices[0] if len(slices) == 1 else torch.cat(slices)


def _check_dtype(dtype: int, field: str, dtypes: tuple[int, ...]) -> None:
    if dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise InvalidArgument(f"{field}.dtype", f"got {dtype}, expected one of {names}")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def open_shared_memory(source: pb.SharedMemorySource) -> tuple[torch.Tensor, Callable[[], None]]:
    """Maps the client's segment /dev/shm/<key> (it must exist and hold byte_size bytes)."""
    from multiprocessing import resource_tracker, shared_memory

    if not _SHM_KEY.match(source.key):
        raise InvalidArgument("shm.key", f"got {source.key!r}, expected 1-200 letters, digits, '_', '.' or '-'")
    try:
        segment = shared_memory.SharedMemory(name=source.key, create=False)
    except FileNotFoundError:
        raise ServiceError(f"shm.key: no shared-memory segment named {source.key!r}", grpc.StatusCode.NOT_FOUND) from None
    # Attaching registers the segment with this process's resource tracker, which would unlink the
    # client's segment when the server exits: the client owns it, so take it back out.
    if sys.version_info < (3, 13):
        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 - the documented workaround
    if source.byte_size == 0 or source.byte_size > segment.size:
        segment.close()
        raise InvalidArgument("shm.byte_size", f"got {source.byte_size}, expected 1..{segment.size} (the segment's size)")
    buffer = torch.frombuffer(segment.buf, dtype=torch.uint8, count=source.byte_size)

    def release() -> None:
        nonlocal buffer
        del buffer
        try:
            segment.close()
        except BufferError:  # a result tensor still views it; the mapping goes when that does
            pass

    return buffer, release


def cuda_index_of(device_uuid: str) -> int:
    """This process's index of the GPU with this UUID (indices differ between processes)."""
    wanted = device_uuid.removeprefix("GPU-").lower()
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid).lower() == wanted:
            return index
    raise ServiceError(f"cuda_ipc.device_uuid: no GPU with UUID {device_uuid!r} is visible to the server",
                       grpc.StatusCode.NOT_FOUND)


def open_ready_event(source: pb.CudaIpcSource, device: torch.device) -> torch.cuda.Event | None:
    """The producer's ready event of a CUDA region, opened by its IPC handle; None when it sent none."""
    if not source.ready_event_handle:
        return None
    try:
        return torch.cuda.Event.from_ipc_handle(device, source.ready_event_handle)
    except RuntimeError as err:  # not an event handle, or another GPU's event
        raise ServiceError(f"cuda_ipc.ready_event_handle: could not open it: {err}",
                           grpc.StatusCode.FAILED_PRECONDITION) from None


def open_cuda_ipc(source: pb.CudaIpcSource) -> tuple[torch.Tensor, Callable[[], None]]:
    """Opens a CUDA allocation of another process by its IPC handle, as torch.multiprocessing does."""
    if not torch.cuda.is_available():
        raise ServiceError("cuda_ipc: the server has no GPU", grpc.StatusCode.FAILED_PRECONDITION)
    index = cuda_index_of(source.device_uuid)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001 - torch's own IPC import path
            index,
            source.handle,
            source.storage_size_bytes,
            source.storage_offset_bytes,
            source.ref_counter_handle,
            source.ref_counter_offset,
            source.event_handle,
            source.event_sync_required,
        )
    except RuntimeError as err:  # a stale handle, a dead producer, another GPU's memory
        raise ServiceError(f"cuda_ipc.handle: could not open it: {err}", grpc.StatusCode.FAILED_PRECONDITION) from None
    buffer = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (storage.nbytes(),))

    def release() -> None:
        nonlocal buffer
        del buffer  # torch closes the IPC mapping when the storage's last reference goes

    return buffer, release


class RegionMirror(Protocol):
    """Another reader of the registered regions (native_path.py): told of each region as it comes and goes."""

    def region_added(self, region: Region) -> None: ...

    def region_removed(self, name: str) -> None:
        """Returns once nothing of the mirror reads region `name` any more."""


class RegionRegistry:
    """Registered regions by name; each kind only when the server allows it."""

    def __init__(self, *, allow_shm: bool = False, allow_cuda_ipc: bool = False,
                 mirror: RegionMirror | None = None) -> None:
        self._allow = {"shm": allow_shm, "cuda_ipc": allow_cuda_ipc}
        self._regions: RefCountedRegistry[Region] = RefCountedRegistry("region")
        self._mirror = mirror

    def register(self, request: pb.RegisterRegionRequest) -> Region:
        kind = request.WhichOneof("source")
        if kind is None:
            raise InvalidArgument("source", "not set; expected shm or cuda_ipc")
        if not self._allow[kind]:
            flag = "--allow-shm" if kind == "shm" else "--allow-cuda-ipc"
            raise ServiceError(f"source: {kind} regions are off on this server (start it with {flag})",
                               grpc.StatusCode.PERMISSION_DENIED)
        if not request.name:
            raise InvalidArgument("name", "got an empty name, expected a non-empty region name")
        opener = open_shared_memory if kind == "shm" else open_cuda_ipc
        buffer, release = opener(getattr(request, kind))
        pid = request.cuda_ipc.producer_pid if kind == "cuda_ipc" else 0
        try:  # a bad event handle or a name taken: the mapping goes again
            event = open_ready_event(request.cuda_ipc, buffer.device) if kind == "cuda_ipc" else None
            region = Region(name=request.name, kind=kind, buffer=buffer, release=release, producer_pid=pid,
                            ready_event=event)
            self._regions.add(request.name, region)
        except ServiceError:
            release()
            raise
        if self._mirror is not None:
            self._mirror.region_added(region)
        return region

    def list(self) -> list[Region]:
        return self._regions.items()

    def in_flight(self, region: Region) -> int:
        return self._regions.in_flight(region)

    @property
    def total_bytes(self) -> int:
        return sum(region.byte_size for region in self.list())

    @contextmanager
    def use(self, name: str, field: str) -> Iterator[Region]:
        """Holds region `name` for a request; NOT_FOUND if unknown, FAILED_PRECONDITION if its producer died."""
        with self._regions.use(name, field) as region:
            region.check_producer(field)
            region.wait_for_producer_writes()
            yield region

    async def unregister(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is not None and region.weights:
            raise ServiceError(
                f"name: region {name!r} holds the registered weight(s) {sorted(region.weights)}; "
                "unregister them first", grpc.StatusCode.FAILED_PRECONDITION)
        if self._mirror is not None:  # first: from here on, only requests that see NOT_FOUND
            self._mirror.region_removed(name)
        region = await self._regions.remove(name)
        region.views.clear()  # the cached views hold the mapping open
        region.release()
        return region


def region_info(region: Region, in_flight: int = 0) -> pb.RegionInfo:
    device = "cpu" if region.buffer.device.type == "cpu" else f"cuda:{region.buffer.device.index}"
    return pb.RegionInfo(name=region.name, kind=region.kind, byte_size=region.byte_size, device=device,
                         in_flight=in_flight)
