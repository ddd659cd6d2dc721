"""NCCL communicators over several GPUs of this process (docs/design/vocab-parallel.md, "N GPUs in one process").

torch.distributed's NCCL backend wants one process a GPU; a server that drives N GPUs from one process makes one
communicator a device with `ncclCommInitAll` and issues the N calls of a collective from one thread between
`ncclGroupStart` / `ncclGroupEnd`, each on its device's stream. torch links NCCL but exposes neither the
communicators nor `ncclCommAbort`, so this module reaches the library through ctypes, as torch itself loaded it.

A collective never blocks the host: it is enqueued on the streams. `wait` waits for it on the host with a
deadline; past it, `abort` makes the kernels stuck in the collective return, and the group must be rebuilt
(`NcclGroup(devices)` again) before the next collective.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

_UINT8 = 1  # ncclDataType_t ncclUint8
_SUCCESS = 0
_IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator's call still running


class NcclError(RuntimeError):
    """An NCCL call failed, or a collective missed its deadline (the group is then aborted)."""


def _library() -> ctypes.CDLL:
    """libnccl as torch loaded it (its wheel's nvidia/nccl/lib), else the system's."""
    torch.cuda.init()
    candidates = ["libnccl.so.2"]
    try:
        import nvidia.nccl  # the pip wheel torch depends on

        candidates.insert(0, str(Path(next(iter(nvidia.nccl.__path__))) / "lib" / "libnccl.so.2"))
    except ImportError:
        pass
    errors = []
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError as err:
            errors.append(str(err))
    raise NcclError(f"NCCL is not available: {'; '.join(errors)}")


class _Api:
    """The few NCCL entry points used here, loaded once."""

    _instance: _Api | None = None

    def __init__(self) -> None:
        lib = _library()
        comm_p, void_p, c_int = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int
        self.lib = lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [c_int]
        lib.ncclCommInitAll.argtypes = [ctypes.POINTER(comm_p), c_int, ctypes.POINTER(c_int)]
        lib.ncclAllGather.argtypes = [void_p, void_p, ctypes.c_size_t, c_int, comm_p, void_p]
        lib.ncclBroadcast.argtypes = [void_p, void_p, ctypes.c_size_t, c_int, c_int, comm_p, void_p]
        lib.ncclCommAbort.argtypes = [comm_p]
        lib.ncclCommDestroy.argtypes = [comm_p]
        lib.ncclCommGetAsyncError.argtypes = [comm_p, ctypes.POINTER(c_int)]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
        for name in ("ncclCommInitAll", "ncclAllGather", "ncclBroadcast", "ncclCommAbort", "ncclCommDestroy",
                     "ncclGroupStart", "ncclGroupEnd", "ncclCommGetAsyncError", "ncclGetVersion"):
            getattr(lib, name).restype = c_int

    @classmethod
    def get(cls) -> _Api:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def check(self, result: int, call: str) -> None:
        if result not in (_SUCCESS, _IN_PROGRESS):
            raise NcclError(f"{call} failed: {self.lib.ncclGetErrorString(result).decode()} (ncclResult_t {result})")


def nccl_version() -> str:
    """The loaded NCCL's version, e.g. "2.28.9"."""
    api = _Api.get()
    code = ctypes.c_int()
    api.check(api.lib.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
    major, rest = divmod(code.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def record_events(devices: Iterable[int]) -> list[torch.cuda.Event]:
    """An event recorded on each device's current stream: what `wait` waits for."""
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


class NcclGroup:
    """One NCCL communicator per device of `devices` (rank r on devices[r]), made by ncclCommInitAll and connected
    within timeout_s."""

    def __init__(self, devices: Sequence[int], timeout_s: float = 60.0) -> None:
        self._api = _Api.get()
        self.devices = list(devices)
        comms = (ctypes.c_void_p * len(self.devices))()
        ids = (ctypes.c_int * len(self.devices))(*self.devices)
        self._api.check(self._api.lib.ncclCommInitAll(comms, len(self.devices), ids), "ncclCommInitAll")
        self._comms: list[ctypes.c_void_p] | None = [ctypes.c_void_p(c) for c in comms]
        try:
            self._connect(timeout_s)
        except BaseException:
            self.abort()  # a group that never connected holds no call: its communicators go with it
            raise

    def _connect(self, timeout_s: float) -> None:
        """One small all-gather, waited for: NCCL connects the ranks at a communicator's first collective, inside
        ncclGroupEnd on the host, which would block a later call there if a GPU stalled; after it, a collective
        only enqueues and `wait` keeps its deadline."""
        sends = [torch.zeros(1, dtype=torch.uint8, device=f"cuda:{d}") for d in self.devices]
        receives = [torch.empty(len(self.devices), dtype=torch.uint8, device=f"cuda:{d}") for d in self.devices]
        self.all_gather(sends, receives)
        self.wait(record_events(self.devices), timeout_s)

    @property
    def usable(self) -> bool:
        return self._comms is not None

    def all_gather(self, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor],
                   streams: Sequence[int] | None = None, ranks: Sequence[int] | None = None) -> None:
        """Rank r's `sends[r]` (contiguous, on its device) into every rank's `receives[r]` ([N, *send's shape]), on
        streams[r] (cudaStream_t addresses; by default each device's current stream), enqueued by one group call.
        `ranks`: the ranks that take part (all by default); a collective that some rank never joins waits until
        `abort`."""
        comms = self._live()
        api = self._api
        nbytes = sends[0].numel() * sends[0].element_size()
        with self._grouped():
            for rank in range(len(comms)) if ranks is None else ranks:
                send, receive = sends[rank], receives[rank]
                if send.numel() * send.element_size() != nbytes or receive.numel() * receive.element_size() != \
                        nbytes * len(comms) or not (send.is_contiguous() and receive.is_contiguous()):
                    raise NcclError(f"all_gather on rank {rank}: {nbytes} contiguous bytes a rank expected")
                api.check(api.lib.ncclAllGather(send.data_ptr(), receive.data_ptr(), nbytes, _UINT8, comms[rank],
                                                self._stream(rank, streams)), f"ncclAllGather on rank {rank}")

    def broadcast(self, buffers: Sequence[torch.Tensor], streams: Sequence[int] | None = None) -> None:
        """Rank 0's `buffers[0]` into every other rank's `buffers[r]` (contiguous, as many bytes, on its device), on
        streams[r] (cudaStream_t addresses; by default each device's current stream), enqueued by one group call.
        Each rank's stream waits for the data through NCCL's own flags, not through a cross-device event."""
        comms = self._live()
        api = self._api
        nbytes = buffers[0].numel() * buffers[0].element_size()
        if any(b.numel() * b.element_size() != nbytes or not b.is_contiguous() for b in buffers):
            raise NcclError(f"broadcast: {nbytes} contiguous bytes on every rank expected")
        with self._grouped():
            for rank, buffer in enumerate(buffers):
                api.check(api.lib.ncclBroadcast(buffer.data_ptr(), buffer.data_ptr(), nbytes, _UINT8, 0, comms[rank],
                                                self._stream(rank, streams)), f"ncclBroadcast on rank {rank}")

    @contextmanager
    def _grouped(self) -> Iterator[None]:
        """The NCCL calls inside as one group call: enqueued together at ncclGroupEnd, which runs even when one of
        them fails or a rank's buffers are refused."""
        api = self._api
        api.check(api.lib.ncclGroupStart(), "ncclGroupStart")
        try:
            yield
        finally:
            api.check(api.lib.ncclGroupEnd(), "ncclGroupEnd")

    def _stream(self, rank: int, streams: Sequence[int] | None) -> int:
        """streams[rank], or by default the current stream of rank's device (cudaStream_t addresses)."""
        return torch.cuda.current_stream(self.devices[rank]).cuda_stream if streams is None else streams[rank]

    def wait(self, events: Sequence[torch.cuda.Event], timeout_s: float) -> None:
        """Waits on the host for `events` (recorded after a collective) for at most timeout_s; past it, or when a
        communicator reports an error, aborts the group and raises NcclError."""
        deadline = time.monotonic() + timeout_s
        pending = list(events)
        while pending:
            pending = [event for event in pending if not event.query()]
            if not pending:
                return
            error = self._async_error()
            if error is not None or time.monotonic() > deadline:
                self.abort()
                reason = error or f"not done after {timeout_s:g} s: a GPU stalled or never joined"
                raise NcclError(f"collective over devices {self.devices} {reason}; the communicators were aborted")
            time.sleep(20e-6)

    def abort(self) -> None:
        """ncclCommAbort on every communicator: kernels stuck in a collective return. The group is then unusable."""
        comms, self._comms = self._comms, None
        for comm in comms or ():
            self._api.lib.ncclCommAbort(comm)

    def close(self) -> None:
        comms, self._comms = self._comms, None
        for comm in comms or ():
            self._api.lib.ncclCommDestroy(comm)

    def _live(self) -> list[ctypes.c_void_p]:
        if self._comms is None:
            raise NcclError(f"the NCCL group over devices {self.devices} was aborted or closed; build a new one")
        return self._comms

    def _async_error(self) -> str | None:
        for rank, comm in enumerate(self._comms or ()):
            state = ctypes.c_int()
            self._api.lib.ncclCommGetAsyncError(comm, ctypes.byref(state))
            if state.value not in (_SUCCESS, _IN_PROGRESS):
                return f"failed on rank {rank}: {self._api.lib.ncclGetErrorString(state.value).decode()}"
        return None
