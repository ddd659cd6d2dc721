"""Work handed to a thread that holds something: released also when the work never runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def on_thread(work: Callable[[], T], unrun: Callable[[], None]) -> T:
    """work() on a thread (asyncio.to_thread). A call cancelled while its job still waits for a free thread drops
    the job, so work() never runs and never releases what it would have (a reserved name, a descriptor, a share of
    a lease): `unrun` runs instead. Exactly one of the two runs: each first takes the same lock."""
    taken = threading.Lock()

    def run() -> T:
        if not taken.acquire(blocking=False):
            raise asyncio.CancelledError  # the call left first and ran `unrun`; nobody awaits this
        return work()

    try:
        return await asyncio.to_thread(run)
    except asyncio.CancelledError:
        if taken.acquire(blocking=False):
            unrun()
        raise
