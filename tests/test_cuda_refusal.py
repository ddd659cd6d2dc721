"""A GPU the kernels cannot run on, on the CPU: torch's device queries are replaced by a fake GPU's.

`--device cuda` there must stop the server with a reason (a pod that asked for a GPU must not serve on the
CPU unnoticed); `--device auto` falls back to the CPU backend with a warning, and GetServerInfo says so.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokensampler_client import SamplerClient

from tokensampler_server.backends import create_backend, cuda_build
from tokensampler_server.backends import cuda as cuda_backend
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import StartupError

from .conftest import start_command

# Runs the server's CLI in a process whose torch reports one GPU of the given capability and name.
_FAKE_GPU = """
import sys, torch
major, minor, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda device=None: (major, minor)
torch.cuda.get_device_name = lambda device=None: name
from tokensampler_server.app.cli import main
sys.exit(main(sys.argv[4:]))
"""
_SERVER_ARGS = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]


def _fake_gpu_command(capability: tuple[int, int], name: str, *args: str) -> list[str]:
    return [sys.executable, "-c", _FAKE_GPU, str(capability[0]), str(capability[1]), name, *_SERVER_ARGS, *args]


@pytest.mark.parametrize(("capability", "name"), [((8, 0), "NVIDIA A100-SXM4-80GB"), ((8, 9), "NVIDIA L4")])
def test_device_cuda_refuses_to_start_on_a_gpu_older_than_hopper(capability: tuple[int, int], name: str) -> None:
    result = subprocess.run(_fake_gpu_command(capability, name, "--device", "cuda"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "tokensampler-server: error: --device cuda: the CUDA backend cannot run here: " in result.stderr
    assert f"{name} has compute capability {capability[0]}.{capability[1]}; the kernels need 9.0" in result.stderr
    assert "serving on" not in result.stderr


def test_device_auto_falls_back_to_the_cpu_with_a_warning_and_says_so() -> None:
    running = start_command(_fake_gpu_command((8, 9), "NVIDIA L4", "--device", "auto"), env={})
    try:
        warnings = [line for line in running.log if " WARNING " in line and "CUDA backend unavailable" in line]
        assert warnings and "NVIDIA L4 has compute capability 8.9" in warnings[0], running.log
        with SamplerClient(running.target, timeout=30) as client:
            info = client.server_info()
        assert (info.backend, info.device) == ("cpu", "cpu")
        assert running.stop(signal.SIGTERM) == 0
    finally:
        running.stop(signal.SIGKILL)


def _gpu_present_but_the_backend_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hopper GPU on which loading the backend fails, as a driver too old for the CUDA runtime makes it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")

    def fail(self: object, device_index: int = 0, vocab_parallel_devices: tuple[int, ...] = ()) -> None:
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(cuda_backend.CudaBackend, "__init__", fail)


def test_a_backend_that_fails_to_load_stops_device_cuda_and_auto_falls_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _gpu_present_but_the_backend_fails(monkeypatch)
    with pytest.raises(StartupError, match="--device cuda:0: the CUDA backend cannot run here: RuntimeError: CUDA "
                                           "driver version is insufficient"):
        create_backend("cuda:0")
    with caplog.at_level(logging.WARNING, logger="tokensampler_server.backends"):
        backend = create_backend("auto")
    assert isinstance(backend, CpuBackend)
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "CUDA driver version is insufficient" in caplog.records[0].getMessage()


def test_an_unknown_device_is_a_startup_error() -> None:
    with pytest.raises(StartupError, match="expected auto, cpu, cuda or cuda:N"):
        create_backend("tpu")


def test_a_cuda_runtime_without_nvcc_is_no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CUDA runtime image: torch guesses CUDA_HOME=/usr/local/cuda, which holds libraries but no nvcc. A GPU
    whose kernels were not prebuilt there gets the reason, not a compiler's failure."""
    from torch.utils import cpp_extension

    (tmp_path / "cuda" / "lib64").mkdir(parents=True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cuda_build.CudaBackendUnavailable, match="no kernels prebuilt at .* for this GPU, and nvcc "
                                                                "not found to build them"):
        cuda_build._check_compiler(tmp_path / "kernels-0" / "tokensampler_cuda.so")


def test_prebuild_refuses_a_capability_the_kernels_cannot_run_on(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "tokensampler_server.app.prebuild", "--capability", "8.0"],
                           env={**os.environ, "TOKENSAMPLER_BUILD_DIR": str(tmp_path)},
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 1
    assert "sm_80 has compute capability 8.0; the kernels need 9.0 or newer" in built.stderr
    assert not list(tmp_path.iterdir())
