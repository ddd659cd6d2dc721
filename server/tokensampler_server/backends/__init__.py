"""Sampling backends: `cpu` (the torch reference) and `cuda` (compiled kernels)."""

from __future__ import annotations

import logging

from .base import Backend, BackendInfo

__all__ = ["Backend", "BackendInfo", "create_backend"]

log = logging.getLogger(__name__)


def _cuda_backend(device: str) -> Backend:
    from .cuda import CudaBackend  # imported lazily: it builds the kernels on first use

    index = int(device.partition(":")[2] or 0)
    return CudaBackend(device_index=index)


def create_backend(device: str) -> Backend:
    """The backend for `--device`: auto, cpu, cuda or cuda:N.

    auto picks CUDA when torch sees a GPU and the kernels build, and falls back to the CPU reference
    otherwise, logging why; an explicit cuda device that cannot be used is an error.
    """
    from .cpu import CpuBackend

    if device == "cpu":
        return CpuBackend()
    if device.startswith("cuda"):
        return _cuda_backend(device)
    if device != "auto":
        raise ValueError(f"--device: got {device!r}, expected auto, cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        log.info("no CUDA GPU visible: using the CPU reference backend")
        return CpuBackend()
    try:
        return _cuda_backend("cuda")
    except Exception as err:  # a failed build or driver problem must not stop the server
        log.warning("CUDA backend unavailable (%s): falling back to the CPU reference backend", err)
        return CpuBackend()
