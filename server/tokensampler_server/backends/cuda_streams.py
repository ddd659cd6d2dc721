"""CUDA streams that no other holder of one shares.

torch.cuda.Stream() hands out a device's pool of 32 streams in turn (c10's pool), so a later call returns an earlier
stream again. Work queued on a stream waits for everything queued there before it; a colocated loop's stream waits
on the GPU for its engine, so a stream shared with it would hold another loop's steps, or a scorer's side work,
behind that wait. Each holder takes its streams here and gives them back when their work is done.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["exclusive_stream", "give_back"]

_POOL_STREAMS = 32
_held: set[int] = set()  # by address
_lock = threading.RLock()  # a holder's finalizer may give back inside exclusive_stream (its allocation runs the GC)


def exclusive_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of torch's pool that no other caller of this function holds until it is given back."""
    with _lock:
        for _ in range(2 * _POOL_STREAMS):
            stream = torch.cuda.Stream(device)
            if stream.cuda_stream not in _held:
                _held.add(stream.cuda_stream)
                return stream
    raise RuntimeError(f"every CUDA stream of {device}'s pool is held")


def give_back(*streams: torch.cuda.Stream) -> None:
    """Lets others have these streams (once nothing more is queued on them)."""
    with _lock:
        _held.difference_update(stream.cuda_stream for stream in streams)
