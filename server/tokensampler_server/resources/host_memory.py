"""Host buffers sized by what a client sends: an allocation the host cannot make answers the client
RESOURCE_EXHAUSTED, naming what it asked for, instead of failing the call as an internal error."""

from __future__ import annotations

import os

import grpc
import numpy as np
import torch

from tokensampler_server.core.errors import ServiceError


def host_memory_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_bytes(size: int, what: str) -> torch.Tensor:
    """An uninitialised uint8 tensor of `size` bytes on the host. Where the host has no memory for it:
    RESOURCE_EXHAUSTED, its message starting with `what` (the request's field, then what it names). Allocated by
    numpy, whose failure is a MemoryError; torch.empty's is a RuntimeError like any other. No bytes: torch's own
    empty tensor, which views as any dtype (numpy's has a stride that torch's view refuses)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    try:
        return torch.from_numpy(np.empty(size, dtype=np.uint8))
    except MemoryError:
        raise ServiceError(f"{what}: the server has no memory for its {size} bytes", grpc.StatusCode.RESOURCE_EXHAUSTED
                           ) from None
