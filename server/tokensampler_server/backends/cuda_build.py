"""Builds the logits-path CUDA kernels (csrc/) on first use, into a cache directory.

torch.utils.cpp_extension.load compiles csrc/sampling.cu and the binding csrc/bindings.cpp with
ninja. The build directory is keyed by a hash of the sources, the flags and the torch version, so a
change rebuilds and an unchanged tree loads the cached module at once.

No --use_fast_math: it would turn logf/expf and the divisions into approximations, and the noise
and z = (x - max) / T must match the CPU reference. The kernels call the fast intrinsics by name
only where the error is bounded and checked (csrc/philox.cuh, gumbel_fast).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

_SOURCES = ("sampling.cu", "bindings.cpp")
_HEADERS = ("sampling.cuh", "sampling.h", "common.cuh", "philox.cuh")
_lock = threading.Lock()
_module: ModuleType | None = None


class CudaBackendUnavailable(RuntimeError):
    """The CUDA kernels cannot be used here (no GPU, no nvcc, or the build failed); says why."""


def csrc_dir() -> Path:
    """csrc/ of the checkout (TOKENSAMPLER_CSRC overrides)."""
    override = os.environ.get("TOKENSAMPLER_CSRC")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[3] / "csrc"


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """sm_90a machine code plus portable compute_90 PTX; the device's own target if it is not Hopper."""
    flags = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90"]
    major, minor = capability
    if (major, minor) != (9, 0):
        flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
    return flags


def _build_dir(flags: list[str], src: Path) -> Path:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((src / name).read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    root = os.environ.get("TOKENSAMPLER_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokensampler")
    path = Path(root) / f"kernels-{digest.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_environment(src: Path) -> None:
    if not torch.cuda.is_available():
        raise CudaBackendUnavailable("torch sees no CUDA GPU")
    if torch.version.cuda is None:
        raise CudaBackendUnavailable(f"torch {torch.__version__} is built without CUDA")
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        raise CudaBackendUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    missing = [name for name in _SOURCES + _HEADERS if not (src / name).is_file()]
    if missing:
        raise CudaBackendUnavailable(f"kernel sources missing in {src}: {', '.join(missing)}")


def load_kernels(device_index: int = 0) -> ModuleType:
    """The compiled extension module, built on the first call (later calls return it at once)."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        src = csrc_dir()
        _check_environment(src)
        from torch.utils.cpp_extension import load

        cuda_flags = ["-O3", "-std=c++17", "-lineinfo", *arch_flags(torch.cuda.get_device_capability(device_index))]
        try:
            _module = load(
                name="tokensampler_cuda",
                sources=[str(src / name) for name in _SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=cuda_flags,
                extra_include_paths=[str(src)],
                build_directory=str(_build_dir(cuda_flags, src)),
                verbose=os.environ.get("TOKENSAMPLER_BUILD_VERBOSE") == "1",
            )
        except Exception as err:  # compiler or linker failure: report it, the caller falls back
            raise CudaBackendUnavailable(f"building the CUDA kernels failed: {err}") from err
        return _module
