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

import errno
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import DTYPE_TO_TORCH, dtype_name

from tokensampler_server.core.errors import InvalidArgument, ServiceError, quoted
from tokensampler_server.resources import gpu_waits
from tokensampler_server.resources.host_memory import host_bytes
from tokensampler_server.resources.refcounted import RefCountedRegistry, check_name

_SHM_KEY = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_MAX_CACHED_VIEWS = 64
_SHM_DIR = "/dev/shm"
# Each shared-memory region holds one file descriptor; well inside the usual limit of 1024 per process.
DEFAULT_MAX_REGIONS = 256


@dataclass(eq=False)
class Region:
    """A registered region. Compared by identity: a name can come back as another region."""

    name: str
    kind: str
    """"shm" or "cuda_ipc"."""
    release: Callable[[], None]
    buffer: torch.Tensor | None = None
    """uint8 [byte_size] on a GPU (cuda_ipc); None for shm, which is read and written through `segment`."""
    segment: SharedSegment | None = None
    """The shared-memory segment (shm), opened as a regular file and never mapped (docs/hardening.md)."""
    producer_pid: int = 0
    """The producing process (cuda_ipc), 0 when unknown: its memory goes when it exits."""
    ready_event: torch.cuda.Event | None = None
    """The producer's interprocess event (cuda_ipc), recorded after each write: work on the region waits for it."""
    weights: set = field(default_factory=set)
    """The registered weights (RegisteredWeight objects) that lie in this region."""
    views: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = field(default_factory=dict, repr=False)
    """Tensors of the references already resolved in a GPU region: a decode loop names the same few every step,
    and slicing a view anew costs more than the rest of the lookup."""
    on_unregister: set[Callable[[], None]] = field(default_factory=set, repr=False)
    """Called as the region is unregistered, before the wait for its users: what holds it for long (a colocated
    loop) lets it go."""
    gpu_bytes: int = field(init=False, default=0)
    gpu: torch.device | None = field(init=False, default=None)
    """A CUDA region's size and GPU, kept apart from `buffer`, which the region lets go when it is unregistered."""

    def __post_init__(self) -> None:
        if self.buffer is not None:
            self.gpu_bytes, self.gpu = int(self.buffer.numel()), self.buffer.device

    @property
    def byte_size(self) -> int:
        return self.segment.byte_size if self.segment is not None else self.gpu_bytes

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.segment is not None else self.gpu

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
            torch.cuda.current_stream(self.device).wait_event(self.ready_event)

    def tensor(self, ref: pb.TensorRef, field: str, dtypes: tuple[int, ...], max_bytes: int,
               claim: Callable[[int], None] = lambda nbytes: None) -> torch.Tensor:
        """The tensor `ref` points to (a view of a GPU region; a copy read from a shared-memory segment):
        OUT_OF_RANGE past the region's end, INVALID_ARGUMENT if malformed or larger than max_bytes (checked before
        a byte is read: a sparse segment may be far larger than anything the server would accept). `claim` is given
        a copy's bytes before they are allocated (and may refuse them)."""
        _check_dtype(ref.dtype, field, dtypes)
        shape = tuple(ref.shape)
        size = referenced_bytes(ref)
        if size > max_bytes:
            raise InvalidArgument(f"{field}.shape", f"got {list(shape)}: {size} bytes, expected at most {max_bytes}")
        key = (ref.offset, ref.dtype, shape)
        view = self.views.get(key)
        if view is None:
            offset, nbytes = self._span(ref, field, shape)
            if self.segment is not None:
                claim(nbytes)
            view = self._read(offset, nbytes, field).view(DTYPE_TO_TORCH[ref.dtype]).view(shape)
            if self.segment is not None:  # a copy, read anew for every request
                return view
            if len(self.views) >= _MAX_CACHED_VIEWS:
                self.views.clear()
            self.views[key] = view
        return view

    def target(self, ref: pb.TensorRef, field: str, dtypes: tuple[int, ...]) -> OutputTarget:
        """Where an output of the reference's shape is written: checked as `tensor` checks a reference."""
        _check_dtype(ref.dtype, field, dtypes)
        shape = tuple(ref.shape)
        offset, _ = self._span(ref, field, shape)
        return OutputTarget(self, offset, DTYPE_TO_TORCH[ref.dtype], shape, field)

    def _span(self, ref: pb.TensorRef, field: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """(offset, byte count) of a reference, checked against the region's bounds."""
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
        return ref.offset, size

    def _read(self, offset: int, size: int, field: str) -> torch.Tensor:
        """uint8 [size] of the region from `offset`: a view of a GPU region, a copy of a segment's bytes."""
        if self.segment is not None:
            return self.segment.read(offset, size, f"{field}: region {self.name!r}")
        return self.buffer[offset : offset + size]

    def rows(self, ref: pb.RowsRef, field: str, dtypes: tuple[int, ...]) -> torch.Tensor:
        """The [B, row_size] tensor whose row i starts at byte row_offsets[i]: one view when the rows lie back to
        back in a GPU region, else a copy made of one read per run of adjacent rows. The caller bounds
        B·row_size first."""
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
        slices = [self._read(start, n * row_bytes, field).view(dtype).view(n, ref.row_size) for start, n in runs]
        return slices[0] if len(slices) == 1 else torch.cat(slices)


@dataclass(frozen=True)
class OutputTarget:
    """A checked place in a region where the server writes one output tensor."""

    region: Region
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    field: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def write(self, tensor: torch.Tensor) -> None:
        """Writes `tensor` (of `shape`, converted to `dtype`) there."""
        values = tensor.to(self.dtype).reshape(self.shape)
        region = self.region
        if region.segment is not None:
            region.segment.write(self.offset, values.contiguous().view(torch.uint8).reshape(-1),
                                 f"{self.field}: region {region.name!r}")
        else:
            size = values.numel() * values.element_size()
            region.buffer[self.offset : self.offset + size].view(self.dtype).view(self.shape).copy_(values)


def referenced_bytes(ref: pb.TensorRef | pb.RowsRef) -> int:
    """The bytes a reference names, as declared (its bounds are checked when it is read); an element of a dtype the
    server does not know counts 4 bytes, a negative dimension (refused when read) 0."""
    itemsize = DTYPE_TO_TORCH[ref.dtype].itemsize if ref.dtype in DTYPE_TO_TORCH else 4
    if isinstance(ref, pb.RowsRef):
        return len(ref.row_offsets) * ref.row_size * itemsize
    return math.prod(max(d, 0) for d in ref.shape) * itemsize


def _check_dtype(dtype: int, field: str, dtypes: tuple[int, ...]) -> None:
    if dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise InvalidArgument(f"{field}.dtype", f"got {dtype_name(dtype)}, expected one of {names}")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class SharedSegment:
    """A POSIX shared-memory segment, opened as a regular file and read and written with pread/pwrite.

    Never mapped: a producer may shrink (ftruncate) its segment at any time, and touching a mapping past the
    new end raises SIGBUS, which kills the process. A size check before each use would be racy; a read past
    the end is only a short read. So every access is a copy, and a short one answers FAILED_PRECONDITION.
    """

    def __init__(self, fd: int, byte_size: int) -> None:
        self._fd = fd
        self.byte_size = byte_size

    def read(self, offset: int, size: int, what: str) -> torch.Tensor:
        out = host_bytes(size, what)
        view = memoryview(out.numpy())
        done = 0
        while done < size:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise _shrunk(what, offset + done)
            done += got
        return out

    def write(self, offset: int, data: torch.Tensor, what: str) -> None:
        size = os.fstat(self._fd).st_size
        if size < offset + data.numel():  # a write past the end would grow the producer's segment
            raise _shrunk(what, size)
        view = memoryview(data.numpy())
        done = 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], offset + done)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


def _shrunk(what: str, size: int) -> ServiceError:
    return ServiceError(f"{what}: the segment ends at byte {size}, before the bytes named: its producer shrank it "
                        "after registering; register it again", grpc.StatusCode.FAILED_PRECONDITION)


def open_shared_memory(source: pb.SharedMemorySource) -> SharedSegment:
    """Opens the client's segment /dev/shm/<key>: a regular file (no link, directory or FIFO) of at least
    byte_size bytes."""
    if not _SHM_KEY.fullmatch(source.key) or source.key in (".", ".."):
        raise InvalidArgument("shm.key", f"got {quoted(source.key)}, expected 1-200 letters, digits, '_', '.' or '-' "
                              "naming a segment (not '.' or '..')")
    path = os.path.join(_SHM_DIR, source.key)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: no symbolic links.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ServiceError(f"shm.key: no shared-memory segment named {quoted(source.key)}",
                           grpc.StatusCode.NOT_FOUND) from None
    except OSError as err:
        if err.errno in (errno.EMFILE, errno.ENFILE):
            raise ServiceError("shm.key: the server has no file descriptors left; unregister regions first",
                               grpc.StatusCode.RESOURCE_EXHAUSTED) from None
        raise ServiceError(f"shm.key: cannot open segment {quoted(source.key)} ({os.strerror(err.errno)}); expected a "
                           "shared-memory segment the server may read and write",
                           grpc.StatusCode.FAILED_PRECONDITION) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ServiceError(f"shm.key: {quoted(source.key)} is not a shared-memory segment (a regular file)",
                               grpc.StatusCode.FAILED_PRECONDITION)
        if source.byte_size == 0 or source.byte_size > info.st_size:
            raise InvalidArgument("shm.byte_size", f"got {source.byte_size}, expected 1..{info.st_size} (the segment's size)")
    except BaseException:
        os.close(fd)
        raise
    return SharedSegment(fd, source.byte_size)


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
    """Registered regions by name; each kind only when the server allows it, at most `max_regions` at once."""

    def __init__(self, *, allow_shm: bool = False, allow_cuda_ipc: bool = False,
                 mirror: RegionMirror | None = None, max_regions: int = DEFAULT_MAX_REGIONS,
                 unregister_timeout_s: float = 60.0) -> None:
        self._allow = {"shm": allow_shm, "cuda_ipc": allow_cuda_ipc}
        self._regions: RefCountedRegistry[Region] = RefCountedRegistry(
            "region", max_items=max_regions, unregister_timeout_s=unregister_timeout_s)
        self._mirror = mirror

    @property
    def allowed_kinds(self) -> frozenset[str]:
        """The kinds of region this server registers ("shm", "cuda_ipc")."""
        return frozenset(kind for kind, allowed in self._allow.items() if allowed)

    def register(self, request: pb.RegisterRegionRequest) -> Region:
        kind = request.WhichOneof("source")
        if kind is None:
            raise InvalidArgument("source", "not set; expected shm or cuda_ipc")
        if not self._allow[kind]:
            flag = "--allow-shm" if kind == "shm" else "--allow-cuda-ipc"
            raise ServiceError(f"source: {kind} regions are off on this server (start it with {flag})",
                               grpc.StatusCode.PERMISSION_DENIED)
        check_name(request.name, "region")  # before the segment is opened or the memory mapped
        if kind == "shm":
            segment = open_shared_memory(request.shm)
            region = Region(name=request.name, kind=kind, release=segment.close, segment=segment)
        else:
            buffer, release = open_cuda_ipc(request.cuda_ipc)
            region = Region(name=request.name, kind=kind, release=release, buffer=buffer,
                            producer_pid=request.cuda_ipc.producer_pid)
        try:  # a bad event handle, a name taken, too many regions: the mapping goes again
            if kind == "cuda_ipc":
                region.ready_event = open_ready_event(request.cuda_ipc, region.device)
            self._regions.add(request.name, region)
        except ServiceError:
            _release(region)
            raise
        if self._mirror is not None:
            self._mirror.region_added(region)
        return region

    def list(self) -> list[Region]:
        return self._regions.items()

    def in_flight(self, region: Region) -> int:
        return self._regions.in_flight(region)

    def copied(self, name: str) -> bool:
        """Whether a reference into region `name` is read into the server's memory (a shared-memory segment; a
        CUDA region is read in place)."""
        return any(region.name == name and region.kind == "shm" for region in self.list())

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
        """Removes region `name` once no request and no registered weight uses it (refcounted.py: atomic, and
        bounded by the registry's timeout)."""
        mirror = self._mirror
        return await self._regions.remove(
            name, check=_holds_no_weights,
            # first: from here on the mirror (the native path) serves only requests that see NOT_FOUND
            hidden=lambda region: _hidden(region, mirror),
            restored=None if mirror is None else mirror.region_added,
            finalize=_release)


def _hidden(region: Region, mirror: RegionMirror | None) -> None:
    for let_go in list(region.on_unregister):
        let_go()
    if mirror is not None:
        mirror.region_removed(region.name)


def _holds_no_weights(region: Region) -> None:
    if region.weights:
        names = sorted(weight.name for weight in region.weights)
        raise ServiceError(f"name: region {region.name!r} holds the registered weight(s) {names}; "
                           "unregister them first", grpc.StatusCode.FAILED_PRECONDITION)


def _release(region: Region) -> None:
    region.views.clear()  # the cached views hold the mapping open
    if region.kind != "cuda_ipc":
        region.release()
        return
    # The mapping closes with its storage's last reference. Closing waits for every stream of the GPU, a colocated
    # loop's waiting on its engine too (gpu_waits.py): the region's own reference goes into the deferred release,
    # so that the close happens there and not wherever the region object is dropped.
    held = [region.buffer]
    region.buffer = None

    def close() -> None:
        held.clear()
        region.release()

    gpu_waits.when_idle(close)


def region_info(region: Region, in_flight: int = 0) -> pb.RegionInfo:
    device = "cpu" if region.device.type == "cpu" else f"cuda:{region.device.index}"
    return pb.RegionInfo(name=region.name, kind=region.kind, byte_size=region.byte_size, device=device,
                         in_flight=in_flight)
