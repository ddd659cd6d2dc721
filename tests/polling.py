"""Waiting for a state that a server, thread or task reaches on its own schedule: polled, with a deadline
generous enough for a loaded machine; reaching the deadline fails the test, saying what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.005
DEADLINE_S = 60.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(POLL_S)


async def wait_until_async(condition: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> None:
    """wait_until inside an event loop, which runs on while it waits."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        await asyncio.sleep(POLL_S)
