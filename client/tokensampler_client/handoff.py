"""The flags of a colocated loop and the CUDA stream memory operations on them (docs/colocated.md, "Flags").

Both sides of the hand-off use this module: the engine's loop (colocated.py) and the server. The flags are
two 32-bit words in a page of shared, pinned host memory that the GPU reads and writes through its mapping:

- READY holds n once the engine's stream has written the input of step n (the server's stream waits for it);
- RELEASE holds n once the tokens of step n are in the engine's output (the engine's stream waits for it).

Each word has its own 64-byte line, so neither side's write shares a cache line with the other's. A step number
only grows; ABORT in READY is the server's own way to end its wait when it ends a loop. The driver's "greater or
equal" is cyclic, (int32)(word - n) >= 0, so ABORT is the largest positive int32 and steps stay below it: ABORT
reaches every step, and no step reaches ABORT.
"""

from __future__ import annotations

import ctypes
import threading

READY_OFFSET = 0
RELEASE_OFFSET = 64
FLAGS_BYTES = 128
ABORT = 0x7FFFFFFF
MAX_STEP = ABORT - 1

_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # ordered after the stream's earlier work, with a memory barrier
_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2
_OPS = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]


class StreamMemOps:
    """cuStreamWaitValue32 and cuStreamWriteValue32 of the CUDA driver (torch does not expose them), and the
    registration of host memory the GPU maps. Loaded once per process."""

    _instance: StreamMemOps | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise RuntimeError(f"colocated sampling needs the CUDA driver (libcuda.so.1): {err}") from None
        self._wait = self._function(driver, "cuStreamWaitValue32", _OPS)
        self._write = self._function(driver, "cuStreamWriteValue32", _OPS)
        self._device_pointer = self._function(
            driver, "cuMemHostGetDevicePointer", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint])

    @classmethod
    def get(cls) -> StreamMemOps:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    @staticmethod
    def _function(driver: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
        for symbol in (f"{name}_v2", name):  # the driver's current entry point first
            function = getattr(driver, symbol, None)
            if function is not None:
                function.restype, function.argtypes = ctypes.c_int, argtypes
                return function
        raise RuntimeError(f"the CUDA driver has no {name}")

    def wait_at_least(self, stream: int, address: int, value: int) -> None:
        """Makes `stream`'s later work wait until the word at device address `address` is >= value (unsigned)."""
        self._check(self._wait(stream, address, value, _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def write(self, stream: int, address: int, value: int) -> None:
        """Writes `value` to the word at `address` once `stream`'s earlier work is done and visible."""
        self._check(self._write(stream, address, value, _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def register_host(self, address: int, nbytes: int) -> int:
        """Pins host memory [address, address + nbytes) and maps it for every GPU; returns its device address."""
        import torch  # colocated sampling needs torch; this module's constants do not

        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the flags failed: {err}")
        device = ctypes.c_uint64()
        self._check(self._device_pointer(ctypes.byref(device), address, 0), "cuMemHostGetDevicePointer")
        return device.value

    @staticmethod
    def unregister_host(address: int) -> None:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: CUresult {result}")
