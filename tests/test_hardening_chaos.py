"""Interleavings that a concurrent campaign against a real server met (many clients mixing every RPC with
cancellations, deadlines and killed clients while /metrics was scraped), each made deterministic here."""

from __future__ import annotations

import asyncio
import sys
import threading
from types import FrameType
from typing import Any

import torch
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.batching import batcher as batcher_module
from tokensampler_server.batching.batcher import DynamicBatcher

from .batches import make_batch
from .polling import wait_until_async

WAIT_S = 10.0


def _count_while_the_loop_queues(batcher: DynamicBatcher, loop: asyncio.AbstractEventLoop) -> int:
    """batcher.queued_requests read on this thread, as the metrics endpoint's thread reads it for the
    tokensampler_queue_depth gauge, with the event loop queueing one more request once the count walks the queue:
    the interleaving that a thread switch makes at any bytecode."""
    added = threading.Event()

    def add_one() -> None:
        batcher.enqueue(make_batch(torch.zeros(1, 8)))
        added.set()

    def trace(frame: FrameType, event: str, _arg: Any) -> Any:
        walking = frame.f_code.co_filename == batcher_module.__file__ and frame.f_code.co_name == "<genexpr>"
        if walking and event == "line" and not added.is_set():
            loop.call_soon_threadsafe(add_one)
            assert added.wait(WAIT_S), "the event loop did not queue the request"
        return trace

    sys.settrace(trace)
    try:
        return batcher.queued_requests
    finally:
        sys.settrace(None)


def test_queue_depth_read_by_the_metrics_thread_while_the_queue_changes() -> None:
    """Before: the count walked the queue itself, and the event loop changing it meanwhile made the scrape fail
    with "OrderedDict mutated during iteration" (HTTP 500 and a traceback in the server's log; 2 in a 3-minute
    campaign of 12 clients with /metrics scraped every 50 ms)."""

    async def run() -> int:
        batcher = DynamicBatcher(CpuBackend(), max_batch_rows=64, max_queue_delay_us=60_000_000)  # requests wait
        for seed in range(2):
            batcher.enqueue(make_batch(torch.zeros(1, 8), seed=seed))
        await wait_until_async(lambda: batcher.queued_requests == 2, "two requests queued")
        depth = await asyncio.to_thread(_count_while_the_loop_queues, batcher, asyncio.get_running_loop())
        batcher.drain()  # the queue delay ends: the three are sampled
        await batcher.close()
        return depth

    assert asyncio.run(run()) in (2, 3)
