"""Sampling backends: `cpu` (the torch reference) and `cuda` (compiled kernels)."""

from __future__ import annotations

import logging

from tokensampler_server.core.config import StartupError
from tokensampler_server.backends.base import Backend, BackendInfo

__all__ = ["Backend", "BackendInfo", "create_backend"]

log = logging.getLogger(__name__)


def _cuda_backend(device: str, vocab_parallel_devices: tuple[int, ...] = ()) -> Backend:
    """The CUDA backend on `device` (its heads split over vocab_parallel_devices when given); CudaBackendUnavailable,
    saying why, when it cannot run here."""
    from tokensampler_server.backends.cuda_build import CudaBackendUnavailable, check_device

    index = int(device.partition(":")[2] or 0)
    for checked in dict.fromkeys((index, *vocab_parallel_devices)):
        check_device(checked)  # first: a GPU the kernels cannot run on is named as such, before torch touches it
    try:
        from tokensampler_server.backends.cuda import CudaBackend  # imported lazily: it builds the kernels on first use

        return CudaBackend(device_index=index, vocab_parallel_devices=vocab_parallel_devices)
    except CudaBackendUnavailable:
        raise
    except Exception as err:  # a driver or torch error: the same verdict, with its cause named
        raise CudaBackendUnavailable(f"{type(err).__name__}: {err}") from err


def create_backend(device: str, vocab_parallel_devices: tuple[int, ...] = ()) -> Backend:
    """The backend for `--device`: auto, cpu, cuda or cuda:N; with vocab_parallel_devices (--vocab-parallel-devices),
    the CUDA backend on the first of them, or a StartupError.

    auto picks CUDA when torch sees a GPU and the kernels load, and otherwise falls back to the CPU reference
    with a warning. An explicit cuda device that cannot be used stops the server (StartupError): a pod that
    asked for a GPU must not serve on the CPU unnoticed.
    """
    from tokensampler_server.backends.cpu import CpuBackend
    from tokensampler_server.backends.cuda_build import CudaBackendUnavailable

    if vocab_parallel_devices:
        if device not in ("auto", "cuda", f"cuda:{vocab_parallel_devices[0]}"):
            raise StartupError(f"--vocab-parallel-devices {vocab_parallel_devices} must start with --device {device}")
        device = f"cuda:{vocab_parallel_devices[0]}"  # a split head needs the GPUs: no CPU fallback
    if device == "cpu":
        return CpuBackend()
    if device.startswith("cuda"):
        try:
            return _cuda_backend(device, vocab_parallel_devices)
        except CudaBackendUnavailable as err:
            raise StartupError(f"--device {device}: the CUDA backend cannot run here: {err}; "
                               "--device cpu serves on the CPU reference backend") from err
    if device != "auto":
        raise StartupError(f"--device: got {device!r}, expected auto, cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        log.info("no CUDA GPU visible: using the CPU reference backend")
        return CpuBackend()
    try:
        return _cuda_backend("cuda")
    except CudaBackendUnavailable as err:
        log.warning("CUDA backend unavailable (%s): falling back to the CPU reference backend", err)
        return CpuBackend()
