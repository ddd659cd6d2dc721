"""backends/cuda_streams.py on the CPU, torch's stream pool replaced by a stand-in: a holder dropped in a reference
cycle gives its stream back from its finalizer, which the cyclic GC may run inside exclusive_stream itself (any
allocation there can start a collection); the same thread must not wait for the lock it holds."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from tokensampler_server.backends import cuda_streams


class _PoolStream:
    """A stream of a pool of 32 that forces a collection as it is made, as an allocation may."""

    made = 0

    def __init__(self, device: object) -> None:
        _PoolStream.made += 1
        self.cuda_stream = _PoolStream.made % 32 + 1
        gc.collect()


class _Holder:
    """Takes a stream as the scorer does, and sits in a reference cycle."""

    def __init__(self) -> None:
        self.stream = cuda_streams.exclusive_stream("cuda:0")
        weakref.finalize(self, cuda_streams.give_back, self.stream)
        self.me = self


def test_a_finalizer_run_inside_exclusive_stream_gives_back_without_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", _PoolStream)
    monkeypatch.setattr(cuda_streams, "_held", set())
    gc.disable()
    try:
        holder = _Holder()
        del holder  # collectable by the cyclic GC only
        taken: list[object] = []
        thread = threading.Thread(target=lambda: taken.append(cuda_streams.exclusive_stream("cuda:0")), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "exclusive_stream waited for the lock its own finalizer wanted"
        assert len(taken) == 1 and len(cuda_streams._held) == 1  # the dropped holder's stream came back
    finally:
        gc.enable()
