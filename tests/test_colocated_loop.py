"""The server's side of a colocated loop without a GPU: rpc/colocated.py's _Loop against a stand-in for the GPU
hand-off, whose steps finish when the test says their input is ready. Checks how announcements are queued (at most
MAX_STEPS_AHEAD past the last delivered step, the rest held back and queued as steps are delivered), that a broken
call ends the loop at once even with steps held back, how a clean close waits for every announced step, and the
status of a step that cannot be queued."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.resources import gpu_waits
from tokensampler_server.rpc.colocated import MAX_STEPS_AHEAD, _Loop

from .polling import wait_until_async


class _Step:
    """A queued step's event: synchronize() returns once the test marks the step ready, or the loop is aborted."""

    def __init__(self, handoff: _Handoff) -> None:
        self._handoff = handoff
        self.ready = threading.Event()

    def synchronize(self) -> None:
        while not (self.ready.wait(0.01) or self._handoff.aborted):
            pass


class _Handoff:
    def __init__(self, fail_at: int = 0, error: Exception | None = None) -> None:
        self.steps: dict[int, _Step] = {}
        self.aborted = False
        self.drains = 0
        self._fail_at, self._error = fail_at, error

    def enqueue(self, step: int) -> _Step:
        if step == self._fail_at:
            raise self._error
        self.steps[step] = _Step(self)
        return self.steps[step]

    def abort(self) -> None:
        self.aborted = True

    def drain(self, timeout_s: float) -> bool:
        self.drains += 1
        return True


class _Announcements:
    """The engine's side of the call: steps announced on cue, then the end of the call or a break."""

    def __init__(self) -> None:
        self._items: asyncio.Queue[pb.ColocateRequest | BaseException | None] = asyncio.Queue()

    def announce(self, *steps: int) -> None:
        for step in steps:
            self._items.put_nowait(pb.ColocateRequest(step=pb.ColocateStep(step=step)))

    def close(self) -> None:
        self._items.put_nowait(None)

    def break_call(self) -> None:
        self._items.put_nowait(ConnectionResetError("the engine is gone"))

    def __aiter__(self) -> AsyncIterator[pb.ColocateRequest]:
        return self

    async def __anext__(self) -> pb.ColocateRequest:
        item = await self._items.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


def _open(wait_timeout_ms: int = 30_000) -> pb.ColocateOpen:
    return pb.ColocateOpen(wait_timeout_ms=wait_timeout_ms)


def _answering(loop: _Loop, engine: _Announcements) -> tuple[asyncio.Future, list[int]]:
    """Runs the loop's answers in a task; the steps answered, in order, as they come."""
    answers: list[int] = []

    async def answer() -> None:
        async for response in loop.run(engine):
            answers.append(response.step)

    return asyncio.ensure_future(answer()), answers


def test_a_flood_of_announcements_queues_only_a_few_steps_and_the_rest_as_steps_are_delivered() -> None:
    handoff, engine = _Handoff(), _Announcements()

    async def run() -> list[int]:
        with ThreadPoolExecutor(2) as waiters:
            loop = _Loop(handoff, _open(), waiters)
            task, answers = _answering(loop, engine)
            engine.announce(*range(1, 201))
            await _settle()
            assert sorted(handoff.steps) == list(range(1, MAX_STEPS_AHEAD + 1))
            for step in range(1, 11):
                handoff.steps[step].ready.set()
                while step not in answers:
                    await asyncio.sleep(0.001)
                await _settle()
                assert max(handoff.steps) == step + MAX_STEPS_AHEAD  # one more queued per step delivered
            engine.break_call()
            await asyncio.wait_for(task, 5)  # the loop ends on the break, with 186 steps still held back
            assert handoff.aborted and handoff.drains == 1
            return answers

    with pytest.raises(ServiceError) as ended:
        asyncio.run(run())
    assert ended.value.code == grpc.StatusCode.CANCELLED and "broke" in ended.value.message


def test_a_clean_close_answers_every_announced_step_first() -> None:
    handoff, engine = _Handoff(), _Announcements()

    async def run() -> tuple[list[int], bool]:
        with ThreadPoolExecutor(2) as waiters:
            loop = _Loop(handoff, _open(), waiters)
            engine.announce(*range(1, 11))
            engine.close()  # the engine has announced its last step before any is delivered

            async def deliver() -> None:
                for step in range(1, 11):
                    while step not in handoff.steps:
                        await asyncio.sleep(0.001)
                    handoff.steps[step].ready.set()

            feeder = asyncio.ensure_future(deliver())
            answers = [response.step async for response in loop.run(engine)]
            await feeder
            return answers, loop.drained

    answers, drained = asyncio.run(run())
    assert answers == list(range(1, 11)) and drained and not handoff.aborted


@pytest.mark.parametrize("error,code", [(torch.cuda.OutOfMemoryError("CUDA out of memory"),
                                         grpc.StatusCode.RESOURCE_EXHAUSTED),
                                        (RuntimeError("CUDA error: launch failure"), grpc.StatusCode.INTERNAL)])
def test_a_step_that_cannot_be_queued_ends_the_loop_with_the_servers_status(error, code) -> None:
    handoff, engine = _Handoff(fail_at=2, error=error), _Announcements()

    async def run() -> None:
        with ThreadPoolExecutor(2) as waiters:
            loop = _Loop(handoff, _open(), waiters)
            engine.announce(1, 2)
            async for _ in loop.run(engine):
                pass

    with pytest.raises(ServiceError) as ended:
        asyncio.run(run())
    assert ended.value.code == code and "step 2" in ended.value.message and handoff.aborted


def test_a_drain_cut_short_leaves_the_flags_pinned() -> None:
    """drained turns false with the first queued step, true only once a drain has finished: a call cancelled while
    its loop drains keeps its flags (the GPU may still read them)."""
    handoff, engine = _Handoff(), _Announcements()
    release = threading.Event()
    handoff.drain = lambda timeout_s: release.wait(5)  # a drain still running when the call is cancelled

    async def run() -> _Loop:
        with ThreadPoolExecutor(2) as waiters:
            loop = _Loop(handoff, _open(), waiters)
            assert loop.drained
            engine.announce(1)
            task = asyncio.ensure_future(anext(loop.run(engine)))
            await _settle()
            engine.break_call()
            await _settle()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            released: list[str] = []
            gpu_waits.when_idle(lambda: released.append("mapping"))  # the GPU may still wait for the engine
            assert released == []
            release.set()  # the drain ends after the call did
            await wait_until_async(lambda: released, "the release held back runs once the drain has ended")
            return loop

    assert not asyncio.run(run()).drained


def test_a_stream_that_drains_late_lets_the_held_back_releases_go_then(monkeypatch) -> None:
    """A drain past its timeout: the loop's stream is asked again until it has drained, and only then do the
    releases held back for it run (before, they were held for the server's life)."""
    from tokensampler_server.rpc import colocated

    monkeypatch.setattr(colocated, "_DRAIN_TIMEOUT_S", 0.05)
    handoff, engine = _Handoff(), _Announcements()
    drained = threading.Event()
    handoff.drain = lambda timeout_s: drained.is_set()

    async def run() -> None:
        with ThreadPoolExecutor(2) as waiters:
            loop = _Loop(handoff, _open(), waiters)
            task, _ = _answering(loop, engine)
            engine.announce(1)
            await _settle()
            engine.break_call()
            with pytest.raises(ServiceError):
                await asyncio.wait_for(task, 5)
            assert not loop.drained
            released: list[str] = []
            gpu_waits.when_idle(lambda: released.append("mapping"))
            await asyncio.sleep(0.2)
            assert released == []  # asked again meanwhile, not drained
            drained.set()
            await wait_until_async(lambda: released, "the release held back runs once the stream has drained")

    asyncio.run(run())
    assert gpu_waits.pending() == 0


def test_gpu_mappings_are_released_only_while_no_step_of_a_loop_is_queued() -> None:
    """Closing a mapping waits for every stream of the GPU, so a loop whose input never comes would hold it, and the
    event loop with it (resources/gpu_waits.py): a release asked for while a step is queued runs once none is."""
    handoff, engine = _Handoff(), _Announcements()
    released: list[str] = []

    async def run() -> None:
        with ThreadPoolExecutor(2) as waiters:
            loop = _Loop(handoff, _open(), waiters)
            task, answers = _answering(loop, engine)
            gpu_waits.when_idle(lambda: released.append("before"))  # no step queued: at once
            assert released == ["before"]
            engine.announce(1, 2)
            await _settle()
            gpu_waits.when_idle(lambda: released.append("held"))
            for step in (1, 2):
                assert released == ["before"]  # a step still waits on the GPU
                handoff.steps[step].ready.set()
                while step not in answers:
                    await asyncio.sleep(0.001)
            assert released == ["before", "held"]
            engine.close()
            await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert gpu_waits.pending() == 0


def test_exclusive_streams_skip_those_of_torchs_pool_still_held(monkeypatch) -> None:
    """torch.cuda.Stream() cycles through a pool of 32 streams; exclusive_stream never hands out one that is held,
    and a stream given back is handed out again."""
    from tokensampler_server.backends import cuda_streams

    class _PoolStream:
        def __init__(self, address: int) -> None:
            self.cuda_stream = address

    turn = iter(range(10**6))
    monkeypatch.setattr(cuda_streams.torch.cuda, "Stream", lambda device: _PoolStream(0x1000 + next(turn) % 32))
    monkeypatch.setattr(cuda_streams, "_held", set())
    device = torch.device("cuda", 0)
    held = [cuda_streams.exclusive_stream(device) for _ in range(32)]
    assert len({stream.cuda_stream for stream in held}) == 32  # the 17th loop's streams are not the first's
    with pytest.raises(RuntimeError, match="every CUDA stream"):
        cuda_streams.exclusive_stream(device)
    cuda_streams.give_back(held[5])
    assert cuda_streams.exclusive_stream(device).cuda_stream == held[5].cuda_stream


def test_a_cuda_region_s_mapping_closes_in_its_deferred_release_not_where_the_region_object_goes() -> None:
    """The mapping closes with its storage's last reference: unregistering hands the region's own to the deferred
    release, so that dropping the region object while a loop waits closes nothing (a CPU tensor stands in)."""
    import gc
    import weakref

    from tokensampler_server.resources import regions

    buffer = torch.zeros(8, dtype=torch.uint8)
    alive = weakref.ref(buffer)
    region = regions.Region(name="r", kind="cuda_ipc", release=lambda: None, buffer=buffer)
    del buffer
    loop = object()
    gpu_waits.begin(loop)
    try:
        regions._release(region)
        assert region.byte_size == 8 and region.buffer is None
        del region
        gc.collect()
        assert alive() is not None  # a loop waits on the GPU: the mapping stays
    finally:
        gpu_waits.end(loop)
    assert alive() is None and gpu_waits.pending() == 0
