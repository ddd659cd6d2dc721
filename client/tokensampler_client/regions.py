"""The producer side of zero-copy regions (see the server's regions.py).

A colocated client registers memory once, then writes tensors into it and sends requests that point
at them instead of carrying their bytes:

    region = client.register_shm_region("logits", 64 * 151936 * 4)      # CPU tensors
    region.tensor(torch.float32, (64, 151936)).copy_(logits)
    client.sample(region.view(torch.float32, (64, 151936)), top_k=50)

    region = client.register_cuda_region("logits", gpu_logits)             # GPU tensors, by IPC
    torch.cuda.current_stream().synchronize()                             # the server reads it next
    client.sample(region.view_of(gpu_logits), top_k=50)

The producer keeps the memory alive while it is registered and finishes writing it (synchronises
its CUDA stream) before sending a request that reads it. Close a region to unregister it.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from ._proto import sampler_pb2 as pb
from .tensors import TORCH_TO_DTYPE


@dataclass(frozen=True)
class RegionView:
    """A tensor inside a registered region: pass it to sample() instead of logits or hidden states,
    or as output_tokens / output_logprobs."""

    region: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def ref(self) -> pb.TensorRef:
        return pb.TensorRef(region=self.region, offset=self.offset, dtype=TORCH_TO_DTYPE[self.dtype], shape=self.shape)


def _view(region: str, byte_size: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> RegionView:
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offset < 0 or offset + size > byte_size:
        raise ValueError(f"offset/shape: bytes [{offset}, {offset + size}) fall outside the region's {byte_size} bytes")
    return RegionView(region, offset, dtype, tuple(shape))


class SharedMemoryRegion:
    """A POSIX shared-memory segment this process created; `request` registers it with a server."""

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self._segment = shared_memory.SharedMemory(name=f"tokensampler-{secrets.token_hex(8)}", create=True, size=byte_size)
        self.byte_size = byte_size
        self.buffer = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=byte_size)
        self.request = pb.RegisterRegionRequest(name=name, shm=pb.SharedMemorySource(key=self._segment.name, byte_size=byte_size))

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A writable tensor over bytes [offset, offset + size) of the segment."""
        view = _view(self.name, self.byte_size, dtype, shape, offset)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.buffer[view.offset : view.offset + size].view(dtype).view(shape)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> RegionView:
        return _view(self.name, self.byte_size, dtype, shape, offset)

    def release(self) -> None:
        """Frees the segment (after the server unregistered it)."""
        del self.buffer
        self._segment.close()
        self._segment.unlink()


class CudaRegion:
    """The CUDA allocation under `tensor`, shared by IPC handle; holds the tensor alive."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        if not tensor.is_cuda:
            raise ValueError(f"tensor: expected a CUDA tensor, got one on {tensor.device}")
        self.name = name
        self._tensor = tensor
        storage = tensor.untyped_storage()
        # torch's own CUDA sharing (torch.multiprocessing): the handle plus its reference counter, so
        # the caching allocator keeps the block while the server maps it.
        device, handle, size_bytes, offset_bytes, counter_handle, counter_offset, event_handle, event_sync = (
            storage._share_cuda_()  # noqa: SLF001
        )
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self.byte_size = int(size_bytes)
        self.request = pb.RegisterRegionRequest(
            name=name,
            cuda_ipc=pb.CudaIpcSource(
                device_uuid=uuid, handle=handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                ref_counter_handle=counter_handle, ref_counter_offset=counter_offset,
                event_handle=event_handle or b"", event_sync_required=event_sync, producer_pid=os.getpid(),
            ),
        )

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> RegionView:
        return _view(self.name, self.byte_size, dtype, shape, offset)

    def view_of(self, tensor: torch.Tensor) -> RegionView:
        """The view of a contiguous tensor that lives in this region's storage (e.g. a slice of it)."""
        if tensor.untyped_storage().data_ptr() != self._tensor.untyped_storage().data_ptr() or not tensor.is_contiguous():
            raise ValueError("tensor: expected a contiguous tensor in this region's storage")
        return self.view(tensor.dtype, tuple(tensor.shape), tensor.storage_offset() * tensor.element_size())

    def release(self) -> None:
        """Drops this region's hold on the tensor (after the server unregistered it)."""
        self._tensor = None
