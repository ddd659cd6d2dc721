"""Host-clock timing, for paths whose cost is host work (a gRPC call, the backend's Python) that CUDA events of the
kernels alone would miss."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def wall_us(call: Callable[[], object], iters: int, warmup: int) -> np.ndarray:
    """The wall time of each of `iters` calls of call(), in microseconds, after `warmup` calls."""
    for _ in range(warmup):
        call()
    times = np.empty(iters)
    for i in range(iters):
        started = time.perf_counter_ns()
        call()
        times[i] = (time.perf_counter_ns() - started) / 1e3
    return times
