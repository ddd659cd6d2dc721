"""Whether this process's GPU work shares the GPU through an MPS daemon (docs/colocated.md, "MPS").

Without MPS, two processes' kernels take turns on the GPU by time slices, and a hand-off between them pays a
context switch (about 140 µs on an H200); under MPS they run side by side like two streams of one process. A
CUDA client connects to the daemon whose control pipe lies in CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps)
when it makes its context, so the pipe's presence then is what decides.
"""

from __future__ import annotations

import os
import stat

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_state() -> str:
    """"active" when an MPS control daemon's pipe is there, else "inactive"."""
    pipe = os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY, "control")
    try:
        return "active" if stat.S_ISSOCK(os.stat(pipe).st_mode) else "inactive"
    except OSError:
        return "inactive"
