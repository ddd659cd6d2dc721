"""Builds the logits-path CUDA kernels (csrc/) on first use, into a cache directory.

torch.utils.cpp_extension.load compiles every csrc/*.cu and *.cpp (bindings.cpp holds the module) with
ninja. The build directory is keyed by a hash of the sources, the flags and the torch version, so a
change rebuilds, and a module already built there is imported directly: neither nvcc nor ninja is
needed then (a container image prebuilds it and runs on the CUDA runtime base).

No --use_fast_math: it would turn logf/expf and the divisions into approximations, and the noise
and z = (x - max) / T must match the CPU reference. The kernels call the fast intrinsics by name
only where the error is bounded and checked (csrc/philox.cuh, gumbel_fast).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

# Every .cu/.cpp of csrc/ is compiled into the one module (bindings.cpp holds PYBIND11_MODULE and calls
# the register_* functions of the other binding files); every header is part of the cache key.
_SOURCE_SUFFIXES = (".cu", ".cpp")
_HEADER_SUFFIXES = (".cuh", ".h")
_MODULE_NAME = "tokensampler_cuda"
_lock = threading.Lock()
_module: ModuleType | None = None


# The kernels' TMA copies and mbarrier waits (fused_stream.cuh) are sm_90 instructions: ptxas rejects them for
# older targets, so the one module holding every kernel cannot be built for an A100 (8.0) or an L4 (8.9).
MIN_CAPABILITY = (9, 0)


class CudaBackendUnavailable(RuntimeError):
    """The CUDA kernels cannot be used here (no GPU, a GPU too old, no nvcc, or the build failed); says why."""


def check_capability(capability: tuple[int, int], gpu: str) -> None:
    """Raises CudaBackendUnavailable, naming `gpu`, when the kernels cannot run on GPUs of `capability`."""
    if tuple(capability) < MIN_CAPABILITY:
        need = ".".join(map(str, MIN_CAPABILITY))
        raise CudaBackendUnavailable(
            f"{gpu} has compute capability {capability[0]}.{capability[1]}; the kernels need {need} or newer "
            "(Hopper: H100, H200, GH200; or later)"
        )


def check_device(device_index: int) -> None:
    """Raises CudaBackendUnavailable unless torch sees GPU `device_index` and the kernels can run on it."""
    if not torch.cuda.is_available():
        raise CudaBackendUnavailable("torch sees no CUDA GPU")
    if not 0 <= device_index < torch.cuda.device_count():
        raise CudaBackendUnavailable(f"no CUDA device {device_index} ({torch.cuda.device_count()} visible)")
    check_capability(torch.cuda.get_device_capability(device_index), torch.cuda.get_device_name(device_index))


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


def _files(src: Path, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(p.name for p in src.iterdir() if p.suffix in suffixes) if src.is_dir() else []


def _build_dir(flags: list[str], src: Path) -> Path:
    digest = hashlib.sha256()
    for name in _files(src, _SOURCE_SUFFIXES + _HEADER_SUFFIXES):
        digest.update(name.encode())
        digest.update((src / name).read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    root = os.environ.get("TOKENSAMPLER_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokensampler")
    return Path(root) / f"kernels-{digest.hexdigest()[:16]}"


def _check_sources(src: Path) -> None:
    if "bindings.cpp" not in _files(src, _SOURCE_SUFFIXES):
        raise CudaBackendUnavailable(f"kernel sources missing in {src}: bindings.cpp")


def _check_compiler(library: Path) -> None:
    if torch.version.cuda is None:
        raise CudaBackendUnavailable(f"torch {torch.__version__} is built without CUDA")
    from torch.utils.cpp_extension import CUDA_HOME

    # CUDA_HOME alone is no compiler: torch guesses /usr/local/cuda, which a CUDA runtime image has without nvcc.
    nvcc = shutil.which("nvcc") or (CUDA_HOME and shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")))
    if not nvcc:
        # The container image's case: its kernels were prebuilt for another GPU generation.
        raise CudaBackendUnavailable(
            f"no kernels prebuilt at {library} for this GPU, and nvcc not found to build them (set CUDA_HOME or "
            "put nvcc on PATH; in the container image, build it with this GPU's CUDA_CAPABILITY)"
        )


def _cuda_flags(capability: tuple[int, int]) -> list[str]:
    return ["-O3", "-std=c++17", "-lineinfo", *arch_flags(capability)]


def _compile(src: Path, build_dir: Path, cuda_flags: list[str]) -> ModuleType:
    from torch.utils.cpp_extension import load

    try:
        # Only a build writes there: the prebuilt kernels of a read-only image are imported as they are.
        build_dir.mkdir(parents=True, exist_ok=True)
        return load(
            name=_MODULE_NAME,
            sources=[str(src / name) for name in _files(src, _SOURCE_SUFFIXES)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            verbose=os.environ.get("TOKENSAMPLER_BUILD_VERBOSE") == "1",
        )
    except Exception as err:  # compiler, linker or file system failure: report it, the caller falls back
        raise CudaBackendUnavailable(f"building the CUDA kernels failed: {err}") from err


def _import_built(library: Path) -> ModuleType:
    """Imports a module compiled earlier (torch is imported, so its libraries resolve)."""
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_kernels(capability: tuple[int, int]) -> Path:
    """Compiles the kernels for GPUs of `capability` into the cache, without needing a GPU.

    Returns the built library; a library already there is kept.
    """
    check_capability(capability, f"sm_{capability[0]}{capability[1]}")
    src = csrc_dir()
    _check_sources(src)
    cuda_flags = _cuda_flags(capability)
    build_dir = _build_dir(cuda_flags, src)
    library = build_dir / f"{_MODULE_NAME}.so"
    if not library.is_file():
        _check_compiler(library)
        _compile(src, build_dir, cuda_flags)
    return library


def load_kernels(device_index: int = 0) -> ModuleType:
    """The compiled extension module for this GPU: imported when built already, else built first."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        check_device(device_index)
        src = csrc_dir()
        _check_sources(src)
        cuda_flags = _cuda_flags(torch.cuda.get_device_capability(device_index))
        build_dir = _build_dir(cuda_flags, src)
        library = build_dir / f"{_MODULE_NAME}.so"
        if library.is_file():
            _module = _import_built(library)
        else:
            _check_compiler(library)
            _module = _compile(src, build_dir, cuda_flags)
        return _module
