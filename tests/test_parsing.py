"""rpc/parsing.py: a large request is parsed on a thread, a few at a time, and a small one where it arrives."""

from __future__ import annotations

import asyncio
import threading

from tokensampler_server.core.config import Limits
from tokensampler_server.rpc.parsing import LARGE_PARSES, PARSE_ON_LOOP_BYTES, Parses


def test_a_large_message_is_parsed_off_the_event_loop_and_a_small_one_on_it() -> None:
    async def run() -> tuple[str, str]:
        parses = Parses(Limits())
        small = await parses.parse(lambda raw: threading.current_thread().name, b"\0" * PARSE_ON_LOOP_BYTES)
        large = await parses.parse(lambda raw: threading.current_thread().name, b"\0" * (PARSE_ON_LOOP_BYTES + 1))
        return small, large

    small, large = asyncio.run(run())
    assert small == threading.current_thread().name and large != small


def test_at_most_a_few_large_parses_run_at_once() -> None:
    """Each may hold several times its bytes (one-byte varints made int64): together they are bounded."""
    running, most, lock = 0, 0, threading.Lock()
    release = threading.Event()

    def parse(raw: bytes) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(5)
        with lock:
            running -= 1
        return len(raw)

    async def run() -> list[int]:
        parses = Parses(Limits())
        calls = [asyncio.ensure_future(parses.parse(parse, b"\0" * (PARSE_ON_LOOP_BYTES + 1))) for _ in range(6)]
        await asyncio.sleep(0.3)
        release.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(run()) == [PARSE_ON_LOOP_BYTES + 1] * 6
    assert most == LARGE_PARSES
