"""Kernels prebuilt without a GPU are imported later without a compiler (the container image's path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def test_prebuild_without_a_gpu_then_load_without_nvcc(tmp_path: Path) -> None:
    capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
    env = {**os.environ, "TOKENSAMPLER_BUILD_DIR": str(tmp_path)}
    built = subprocess.run(
        [sys.executable, "-m", "tokensampler_server.app.prebuild", "--capability", capability],
        env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert list(tmp_path.glob("kernels-*/tokensampler_cuda.so"))

    # No compiler anywhere: only the prebuilt module can make the backend work.
    no_compiler = {**env, "CUDA_HOME": "/nonexistent", "PATH": os.path.dirname(sys.executable)}
    script = (
        "import torch\n"
        "from tokensampler_server.backends.cuda import CudaBackend\n"
        "from tokensampler_server.model.sampling import SamplingBatch\n"
        "b = CudaBackend(0)\n"
        "x = torch.randn(4, 1000)\n"
        "f = lambda v, d: torch.full((4,), v, dtype=d)\n"
        "batch = SamplingBatch(logits=x, temperature=f(0.0, torch.float32), top_k=f(0, torch.int32),\n"
        "    top_p=f(1.0, torch.float32), min_p=f(0.0, torch.float32), seed=f(1, torch.int64),\n"
        "    position=f(0, torch.int64), iteration=f(0, torch.int64))\n"
        "assert torch.equal(b.sample(batch).tokens[:, 0], x.argmax(dim=1))\n"
        "print('ok')\n"
    )
    loaded = subprocess.run([sys.executable, "-c", script], env=no_compiler, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0 and "ok" in loaded.stdout, loaded.stdout + loaded.stderr
