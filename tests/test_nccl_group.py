"""NcclGroup's collectives against a stand-in for the NCCL library (no GPU): which calls each one enqueues, on which
communicators and streams, and that the group call is always ended. The collectives themselves run in
tests/gpu/test_vocab_parallel_nccl.py."""

from __future__ import annotations

import ctypes

import pytest
import torch
from tokensampler_server.backends.nccl import NcclError, NcclGroup, _Api

STREAMS = [0x5000, 0x6000]


class FakeNccl:
    """The entry points NcclGroup calls, recording them; `fail` names one that returns ncclInternalError (3)."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple] = []
        self._fail = fail

    def _result(self, name: str) -> int:
        return 3 if name == self._fail else 0

    def ncclGroupStart(self) -> int:
        self.calls.append(("start",))
        return self._result("ncclGroupStart")

    def ncclGroupEnd(self) -> int:
        self.calls.append(("end",))
        return self._result("ncclGroupEnd")

    def ncclAllGather(self, send: int, receive: int, count: int, dtype: int, comm: ctypes.c_void_p,
                      stream: int) -> int:
        self.calls.append(("all_gather", comm.value, stream, count))
        return self._result("ncclAllGather")

    def ncclBroadcast(self, send: int, receive: int, count: int, dtype: int, root: int, comm: ctypes.c_void_p,
                      stream: int) -> int:
        self.calls.append(("broadcast", comm.value, stream, count, root, send == receive))
        return self._result("ncclBroadcast")

    def ncclGetErrorString(self, result: int) -> bytes:
        return b"internal error"


def _group(lib: FakeNccl, ranks: int = 2) -> NcclGroup:
    """A group over `ranks` devices whose communicators are 11, 22, ... and whose library is `lib`."""
    api = _Api.__new__(_Api)
    api.lib = lib
    group = NcclGroup.__new__(NcclGroup)
    group._api = api
    group.devices = list(range(ranks))
    group._comms = [ctypes.c_void_p(11 * (rank + 1)) for rank in range(ranks)]
    return group


def test_all_gather_is_one_group_call_of_a_call_a_rank() -> None:
    lib = FakeNccl()
    sends = [torch.zeros(3, dtype=torch.float32) for _ in range(2)]
    receives = [torch.zeros(2, 3, dtype=torch.float32) for _ in range(2)]
    _group(lib).all_gather(sends, receives, streams=STREAMS)
    assert lib.calls == [("start",), ("all_gather", 11, 0x5000, 12), ("all_gather", 22, 0x6000, 12), ("end",)]


def test_all_gather_over_some_ranks_calls_only_theirs() -> None:
    lib = FakeNccl()
    sends = [torch.zeros(4, dtype=torch.uint8) for _ in range(2)]
    receives = [torch.zeros(8, dtype=torch.uint8) for _ in range(2)]
    _group(lib).all_gather(sends, receives, streams=STREAMS, ranks=[1])
    assert lib.calls == [("start",), ("all_gather", 22, 0x6000, 4), ("end",)]


def test_a_refused_rank_still_ends_the_group_call() -> None:
    """Rank 1's receive buffer is too small: NcclError names the rank, and the group call started for rank 0 is
    ended, so that NCCL is not left inside a group."""
    lib = FakeNccl()
    sends = [torch.zeros(3) for _ in range(2)]
    receives = [torch.zeros(2, 3), torch.zeros(5)]
    with pytest.raises(NcclError, match="rank 1"):
        _group(lib).all_gather(sends, receives, streams=STREAMS)
    assert lib.calls == [("start",), ("all_gather", 11, 0x5000, 12), ("end",)]


def test_broadcast_is_one_group_call_in_place_from_rank_0() -> None:
    lib = FakeNccl()
    _group(lib).broadcast([torch.zeros(5, dtype=torch.int32) for _ in range(2)], streams=STREAMS)
    assert lib.calls == [("start",), ("broadcast", 11, 0x5000, 20, 0, True), ("broadcast", 22, 0x6000, 20, 0, True),
                         ("end",)]


def test_broadcast_of_unequal_buffers_is_refused_before_any_call() -> None:
    lib = FakeNccl()
    with pytest.raises(NcclError, match="20 contiguous bytes"):
        _group(lib).broadcast([torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)], streams=STREAMS)
    assert lib.calls == []


@pytest.mark.parametrize("failing", ["ncclBroadcast", "ncclGroupEnd"])
def test_a_failing_nccl_call_raises_and_the_group_call_is_ended(failing: str) -> None:
    lib = FakeNccl(fail=failing)
    with pytest.raises(NcclError, match=f"{failing}.*internal error"):
        _group(lib).broadcast([torch.zeros(2) for _ in range(2)], streams=STREAMS)
    assert lib.calls[0] == ("start",) and lib.calls[-1] == ("end",)


def test_an_aborted_group_refuses_collectives() -> None:
    lib = FakeNccl()
    group = _group(lib)
    group._comms = None  # as abort() leaves it, without the library's abort
    with pytest.raises(NcclError, match="aborted or closed"):
        group.broadcast([torch.zeros(2) for _ in range(2)], streams=STREAMS)
    assert lib.calls == []
