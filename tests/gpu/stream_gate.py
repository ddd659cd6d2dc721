"""Holds a CUDA stream until the test lets it go: a host function queued on the stream (cuLaunchHostFunc) waits
for the test, so the work queued behind it runs only then, however long the host takes meanwhile. A GPU sleep
of a fixed length would instead end on its own, before the host is ready on a loaded machine."""

from __future__ import annotations

import ctypes
import threading

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
OPEN_BY_ITSELF_S = 300.0
"""A test that fails before it opens the gate leaves the stream held this long at most."""


class StreamGate:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._opened = threading.Event()

        def wait(_: int | None) -> None:  # on the driver's callback thread
            self._opened.wait(OPEN_BY_ITSELF_S)

        self._callback = _HOST_FN(wait)  # kept alive here until the stream has run it
        driver = ctypes.CDLL("libcuda.so.1")
        driver.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        driver.cuLaunchHostFunc.restype = ctypes.c_int
        status = driver.cuLaunchHostFunc(stream.cuda_stream, self._callback, None)
        assert status == 0, f"cuLaunchHostFunc returned CUresult {status}"

    def open(self) -> None:
        self._opened.set()
