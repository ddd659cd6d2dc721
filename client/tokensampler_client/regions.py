"""The producer side of zero-copy regions (see the server's regions.py).

A colocated client registers memory once, then writes tensors into it and sends requests that point
at them instead of carrying their bytes:

    region = client.register_shm_region("logits", 64 * 151936 * 4)      # CPU tensors
    region.tensor(torch.float32, (64, 151936)).copy_(logits)
    client.sample(region.view(torch.float32, (64, 151936)), top_k=50)

    region = client.register_cuda_region("logits", gpu_logits)             # GPU tensors, by IPC
    torch.cuda.current_stream().synchronize()                             # the server reads it next
    client.sample(region.view_of(gpu_logits), top_k=50)
    client.sample(region.rows_of(gpu_logits, [3, 17, 40]), top_k=50)     # some rows, wherever they lie

    region = client.register_cuda_region("logits", gpu_logits, ready_event=True)
    region.mark_ready()                                                   # instead of synchronising
    client.sample(region.view_of(gpu_logits), top_k=50)                  # the server's GPU work waits

The producer keeps the memory alive while it is registered and finishes writing it before sending a
request that reads it: it synchronises its CUDA stream, or, for a region registered with a ready event,
records the event on the stream that wrote it (`mark_ready`), which costs the producer no host wait.
Close a region to unregister it.

Without torch, shared-memory regions take numpy dtypes and give numpy arrays (`region.tensor(np.float32, ...)`);
CUDA regions need torch.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import numpy as np

from ._proto import sampler_pb2 as pb
from ._torch import require_torch, torch
from .tensors import ITEMSIZE, Array, wire_dtype

if TYPE_CHECKING:
    import torch as _torch_types

_SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory segments live on Linux, which the server reads them from too."""


def _wire(dtype: Any) -> int:
    """The DType of a region's torch or numpy dtype."""
    wire = wire_dtype(dtype)
    if wire is None:
        raise TypeError(f"dtype {dtype} cannot be sent")
    return wire


@dataclass(frozen=True)
class RegionView:
    """A tensor inside a registered region: pass it to sample() instead of logits or hidden states,
    or as output_tokens / output_logprobs."""

    region: str
    offset: int
    dtype: Any  # a torch dtype, or a numpy dtype without torch
    shape: tuple[int, ...]

    def ref(self) -> pb.TensorRef:
        return pb.TensorRef(region=self.region, offset=self.offset, dtype=_wire(self.dtype), shape=self.shape)


@dataclass(frozen=True)
class RegionRows:
    """Logits rows of one size lying anywhere in a registered region (row i at byte row_offsets[i]): pass it
    to sample() instead of logits. Servers that list the feature "region_rows" take it."""

    region: str
    dtype: Any  # a torch dtype, or a numpy dtype without torch
    row_size: int
    row_offsets: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.row_offsets), self.row_size)

    def ref(self) -> pb.RowsRef:
        return pb.RowsRef(region=self.region, dtype=_wire(self.dtype), row_size=self.row_size,
                          row_offsets=self.row_offsets)


def _rows(region: str, byte_size: int, dtype: Any, row_size: int, row_offsets: Sequence[int]) -> RegionRows:
    itemsize = ITEMSIZE[_wire(dtype)]
    row_bytes = row_size * itemsize
    for i, start in enumerate(row_offsets):
        if start < 0 or start % itemsize or start + row_bytes > byte_size:
            raise ValueError(f"row_offsets[{i}]: row bytes [{start}, {start + row_bytes}) are misaligned for "
                             f"{dtype} or fall outside the region's {byte_size} bytes")
    return RegionRows(region, dtype, row_size, tuple(int(start) for start in row_offsets))


def _view(region: str, byte_size: int, dtype: Any, shape: tuple[int, ...], offset: int) -> RegionView:
    size = math.prod(shape) * ITEMSIZE[_wire(dtype)]
    if offset < 0 or offset + size > byte_size:
        raise ValueError(f"offset/shape: bytes [{offset}, {offset + size}) fall outside the region's {byte_size} bytes")
    return RegionView(region, offset, dtype, tuple(shape))


class SharedMemoryRegion:
    """A POSIX shared-memory segment this process created; `request` registers it with a server."""

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self._segment = shared_memory.SharedMemory(name=f"tokensampler-{secrets.token_hex(8)}", create=True, size=byte_size)
        # The arrays of `tensor` keep a mapping of their own, not SharedMemory's, which its close() unmaps under
        # them: a mapping goes with the last reference to it, so an array kept past `release` never points at
        # unmapped memory (writing through one crashed the process).
        fd = os.open(os.path.join(_SHM_DIR, self._segment.name), os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        self._segment.close()
        self.byte_size = byte_size
        self.buffer: Array | None = (np.frombuffer(mapping, dtype=np.uint8, count=byte_size) if torch is None
                                     else torch.frombuffer(mapping, dtype=torch.uint8, count=byte_size))
        self.request = pb.RegisterRegionRequest(name=name, shm=pb.SharedMemorySource(key=self._segment.name, byte_size=byte_size))

    def tensor(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> Array:
        """A writable array over bytes [offset, offset + size) of the segment; it stays valid after `release`."""
        if self.buffer is None:
            raise ValueError(f"region {self.name!r}: released; register a region again")
        view = _view(self.name, self.byte_size, dtype, shape, offset)
        size = math.prod(shape) * ITEMSIZE[_wire(dtype)]
        return self.buffer[view.offset : view.offset + size].view(dtype).reshape(shape)

    def view(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> RegionView:
        return _view(self.name, self.byte_size, dtype, shape, offset)

    def rows(self, dtype: Any, row_size: int, row_offsets: Sequence[int]) -> RegionRows:
        """Rows of `row_size` elements starting at the given byte offsets of the segment."""
        return _rows(self.name, self.byte_size, dtype, row_size, row_offsets)

    def release(self) -> None:
        """Frees the segment (after the server unregistered it): its name at once, its memory with the last array
        from `tensor`. Once; a second call does nothing."""
        if self.buffer is None:
            return
        self.buffer = None
        self._segment.unlink()


class CudaRegion:
    """The CUDA allocation under `tensor`, shared by IPC handle; holds the tensor alive. With `ready_event`, an
    interprocess CUDA event is shared too: `mark_ready()` after each write tells the server's GPU work to wait."""

    def __init__(self, name: str, tensor: _torch_types.Tensor, ready_event: bool = False) -> None:
        require_torch("CUDA IPC regions")
        if not tensor.is_cuda:
            raise ValueError(f"tensor: expected a CUDA tensor, got one on {tensor.device}")
        self.name = name
        self._tensor = tensor
        self._device = tensor.device
        storage = tensor.untyped_storage()
        # torch's own CUDA sharing (torch.multiprocessing): the handle plus its reference counter, so
        # the caching allocator keeps the block while the server maps it.
        device, handle, size_bytes, offset_bytes, counter_handle, counter_offset, event_handle, event_sync = (
            storage._share_cuda_()  # noqa: SLF001
        )
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self.byte_size = int(size_bytes)
        self._ready_event: _torch_types.cuda.Event | None = None
        ready_handle = b""
        if ready_event:
            self._ready_event = torch.cuda.Event(interprocess=True)  # interprocess events cannot time
            with torch.cuda.device(tensor.device):
                ready_handle = self._ready_event.ipc_handle()  # creates the event on the tensor's GPU
        self.request = pb.RegisterRegionRequest(
            name=name,
            cuda_ipc=pb.CudaIpcSource(
                device_uuid=uuid, handle=handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                ref_counter_handle=counter_handle, ref_counter_offset=counter_offset,
                event_handle=event_handle or b"", event_sync_required=event_sync, producer_pid=os.getpid(),
                ready_event_handle=ready_handle,
            ),
        )

    def mark_ready(self, stream: _torch_types.cuda.Stream | None = None) -> None:
        """Records the ready event on `stream` (default: the tensor's current stream) once the writes a request
        will read are queued there: the server's work on the next request waits for them on the GPU."""
        if self._ready_event is None:
            raise RuntimeError(f"region {self.name!r} was registered without ready_event=True: synchronise instead")
        self._ready_event.record(stream if stream is not None else torch.cuda.current_stream(self._device))

    def view(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> RegionView:
        return _view(self.name, self.byte_size, dtype, shape, offset)

    def view_of(self, tensor: _torch_types.Tensor) -> RegionView:
        """The view of a contiguous tensor that lives in this region's storage (e.g. a slice of it)."""
        if tensor.untyped_storage().data_ptr() != self._tensor.untyped_storage().data_ptr() or not tensor.is_contiguous():
            raise ValueError("tensor: expected a contiguous tensor in this region's storage")
        return self.view(tensor.dtype, tuple(tensor.shape), tensor.storage_offset() * tensor.element_size())

    def rows(self, dtype: Any, row_size: int, row_offsets: Sequence[int]) -> RegionRows:
        """Rows of `row_size` elements starting at the given byte offsets of the shared storage."""
        return _rows(self.name, self.byte_size, dtype, row_size, row_offsets)

    def rows_of(self, tensor: _torch_types.Tensor, rows: Sequence[int]) -> RegionRows:
        """Rows `rows` (in that order, repeats allowed) of a contiguous [N, V] tensor in this region's storage: an
        engine's last-token rows of a packed batch, say, sampled without a gather."""
        view = self.view_of(tensor)
        if len(view.shape) != 2:
            raise ValueError(f"tensor: expected [N, V], got shape {list(view.shape)}")
        num_rows, row_size = view.shape
        row_bytes = row_size * tensor.element_size()
        for i, row in enumerate(rows):
            if not 0 <= row < num_rows:
                raise ValueError(f"rows[{i}]: got {row}, expected 0..{num_rows - 1}")
        return self.rows(tensor.dtype, row_size, [view.offset + row * row_bytes for row in rows])

    def release(self) -> None:
        """Drops this region's hold on the tensor (after the server unregistered it)."""
        self._tensor = None
