"""on_thread: work handed to a thread, and what it holds released when the call leaves before a thread takes it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokensampler_server.core.threads import on_thread


def test_the_work_runs_and_unrun_does_not() -> None:
    unrun = []
    assert asyncio.run(on_thread(lambda: 7, lambda: unrun.append(True))) == 7
    assert unrun == []


def test_a_call_cancelled_while_its_job_waits_for_a_thread_runs_unrun_instead_once() -> None:
    busy, ran, unrun = threading.Event(), [], []

    async def scenario() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        blocker = asyncio.ensure_future(asyncio.to_thread(busy.wait, 10))
        call = asyncio.ensure_future(on_thread(lambda: ran.append(True), lambda: unrun.append(True)))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        busy.set()
        await blocker
        await asyncio.to_thread(lambda: None)

    asyncio.run(scenario())
    assert ran == [] and unrun == [True]


def test_a_call_cancelled_while_its_work_runs_leaves_the_release_to_the_work() -> None:
    started, finish, done, ran, unrun = threading.Event(), threading.Event(), threading.Event(), [], []

    def work() -> None:
        started.set()
        finish.wait(10)
        ran.append(True)
        done.set()

    async def scenario() -> None:
        call = asyncio.ensure_future(on_thread(work, lambda: unrun.append(True)))
        await asyncio.to_thread(started.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        finish.set()
        await asyncio.to_thread(done.wait, 10)

    asyncio.run(scenario())
    assert ran == [True] and unrun == []
