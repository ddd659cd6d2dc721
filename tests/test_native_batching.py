"""The native path's batching (native_path.py, queued on the batcher's one queue) over a stand-in for the C++
NativePath: which requests go out together, in what order, and what each caller gets back. The C++ side, and the answers themselves, are held to
the Python path on the GPU (tests/gpu/test_native_path.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from tokensampler_server.batching.batcher import DynamicBatcher
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.rpc.native_path import NativeAnswer, NativePath

from .batches import make_batch


@dataclass
class Prepared:
    request_id: str
    num_rows: int
    merge_key: tuple[int, int]
    rows_by_mode: tuple[int, int, int, int, int] = (0, 1, 0, 0, 0)


@dataclass
class StandInPath:
    """NativePath's methods. A request is b"ROWS,VOCAB" ("decline" is declined at once); a request id starting
    with "cpu" is declined after it was sampled; a batch holding a request id in `fail` raises."""

    fail: set[str] = field(default_factory=set)
    batches: list[list[str]] = field(default_factory=list)

    def prepare(self, request: bytes, request_id: str, stream_message: bool) -> Prepared | None:
        if request == b"decline":
            return None
        rows, vocab = map(int, request.split(b","))
        return Prepared(request_id, rows, (vocab, 0))

    def sample(self, batch: list[Prepared]) -> list[tuple | None]:
        assert len({p.merge_key for p in batch}) == 1
        if any(p.request_id in self.fail for p in batch):
            raise RuntimeError("sampling failed")
        self.batches.append([p.request_id for p in batch])
        rows = sum(p.num_rows for p in batch)
        return [None if p.request_id.startswith("cpu") else (p.request_id.encode(), 1, 2, 3, 4, rows) for p in batch]


LIMITS = Limits(max_batch_rows=8, max_batch_elements=8 * 100)


class NoBackend:
    """The batcher's backend: never called, since every request here is the native path's."""

    device = torch.device("cpu")
    concurrent_calls = False


def native_path(stand_in: StandInPath, observed: list[int] | None = None, limits: Limits = LIMITS,
                **batching) -> NativePath:
    batcher = DynamicBatcher(NoBackend(), max_batch_rows=limits.max_batch_rows,
                             max_batch_elements=limits.max_batch_elements,
                             observe_batch_rows=observed.append if observed is not None else None, **batching)
    return NativePath(stand_in, torch.device("cpu"), batcher)


def submit_all(path: NativePath, requests: dict[str, bytes]) -> dict[str, object]:
    """Submits every request in one loop turn; each caller's answer, or the error it got."""

    async def run() -> dict[str, object]:
        futures = {rid: path.submit(raw, rid, False) for rid, raw in requests.items()}
        outcomes = await asyncio.gather(*futures.values(), return_exceptions=True)
        return dict(zip(futures, outcomes))

    return asyncio.run(run())


DELAY_US = 20_000


def test_without_a_queue_delay_each_request_is_sampled_at_once() -> None:
    stand_in = StandInPath()
    path = native_path(stand_in)

    async def run():
        first = path.submit(b"2,100", "a", False)
        assert first.done() and stand_in.batches == [["a"]]
        return await first, await path.sample(b"1,100", "b", False)

    first, second = asyncio.run(run())
    assert (first.response, first.batch_rows, second.response) == (b"a", 2, b"b")
    assert (first.decode_ns, first.queue_ns, first.compute_ns, first.encode_ns) == (1, 2, 3, 4)


def test_queued_requests_go_out_together_by_vocabulary_within_the_row_limit() -> None:
    stand_in, observed = StandInPath(), []
    path = native_path(stand_in, observed, max_queue_delay_us=DELAY_US)
    answers = submit_all(path, {"a": b"2,100", "b": b"3,100", "c": b"1,200", "d": b"4,100", "e": b"2,100"})
    # d fills 8 queued rows: out at once, the oldest and the later ones of its vocabulary within 8 rows (d does
    # not fit); after the delay, the oldest left (c, alone in its vocabulary), then d with e
    assert stand_in.batches == [["a", "b"], ["c"], ["d", "e"]]
    assert observed == [5, 1, 6]
    for rid, answer in answers.items():
        assert isinstance(answer, NativeAnswer) and answer.response == rid.encode()
    assert answers["e"].batch_rows == 6 and answers["e"].rows_by_mode == (0, 1, 0, 0, 0)
    assert path._batcher.queued_requests == 0


def test_a_batch_holds_no_more_elements_than_one_request_may() -> None:
    stand_in = StandInPath()
    path = native_path(stand_in, limits=Limits(max_batch_rows=64, max_batch_elements=1000), max_queue_delay_us=DELAY_US)
    submit_all(path, {"a": b"1,250", "b": b"2,250", "c": b"2,250", "d": b"1,250"})
    assert stand_in.batches == [["a", "b", "d"], ["c"]]  # 4 rows of 250 elements at most


def test_declined_requests_go_back_to_the_python_path() -> None:
    path = native_path(StandInPath())

    async def run():
        assert path.submit(b"decline", "x", False) is None
        return await path.sample(b"1,100", "cpu-row", False), await path.sample(b"1,100", "ok", False)

    declined_late, answered = asyncio.run(run())
    assert declined_late is None and answered.response == b"ok"


def test_a_failed_batch_reaches_its_callers_only_and_the_path_goes_on() -> None:
    stand_in = StandInPath(fail={"b"})
    path = native_path(stand_in, max_queue_delay_us=DELAY_US)
    answers = submit_all(path, {"a": b"1,100", "b": b"1,100", "c": b"1,300", "d": b"1,100"})
    assert isinstance(answers["a"], RuntimeError) and isinstance(answers["b"], RuntimeError)
    assert isinstance(answers["d"], RuntimeError) and answers["c"].response == b"c"
    assert stand_in.batches == [["c"]]
    assert asyncio.run(path.sample(b"1,100", "e", False)).response == b"e"


def test_a_caller_gone_before_its_batch_is_left_out() -> None:
    stand_in = StandInPath()
    path = native_path(stand_in, max_queue_delay_us=DELAY_US)

    async def run():
        first, gone, last = (path.submit(raw, rid, False) for rid, raw in
                             (("a", b"1,100"), ("gone", b"3,100"), ("c", b"1,100")))
        gone.cancel()
        return await first, await last

    first, last = asyncio.run(run())
    assert first.response == b"a" and last.response == b"c" and last.batch_rows == 2
    assert stand_in.batches == [["a", "c"]]


def test_the_queue_is_bounded_in_rows() -> None:
    path = native_path(StandInPath(), max_queue_delay_us=DELAY_US, max_queue_rows=6)

    async def run():
        first = path.submit(b"4,100", "a", False)
        with pytest.raises(ServiceError) as raised:
            path.submit(b"3,100", "b", False)
        assert path._batcher.queued_requests == 1
        return raised.value, await first

    refused, answered = asyncio.run(run())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.message == "queue full: 4 rows waiting, at most 6; retry with backoff"
    assert answered.response == b"a"


def test_a_queue_delay_gathers_requests_until_it_passes_or_the_rows_fill_a_batch() -> None:
    stand_in = StandInPath()
    path = native_path(stand_in, max_queue_delay_us=30_000)

    async def run():
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = path.submit(b"1,100", "a", False)
        # One loop turn later: the delay's timer, even if already due, runs after this task in that turn.
        await asyncio.sleep(0)
        assert stand_in.batches == []  # still within the delay
        second = path.submit(b"2,100", "b", False)
        answers = await asyncio.gather(first, second)
        waited = loop.time() - started
        full = [path.submit(b"4,100", rid, False) for rid in ("c", "d")]  # 8 rows: out at once
        assert all(future.done() for future in full) and stand_in.batches[-1] == ["c", "d"]
        return answers, waited

    answers, waited = asyncio.run(run())
    assert stand_in.batches[0] == ["a", "b"] and answers[0].batch_rows == 3
    assert 0.025 <= waited < 1.0


def test_native_and_python_requests_wait_in_one_bounded_queue() -> None:
    """The native path's requests and the Python path's batches count against the same queue bound."""
    path = native_path(StandInPath(), max_queue_delay_us=DELAY_US, max_queue_rows=6)
    batcher = path._batcher

    async def run():
        first = path.submit(b"4,100", "a", False)
        with pytest.raises(ServiceError) as raised:
            batcher.enqueue(make_batch(torch.zeros(3, 100)))
        assert batcher.queued_requests == 1
        return raised.value, await first

    refused, answered = asyncio.run(run())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.message == "queue full: 4 rows waiting, at most 6; retry with backoff"
    assert answered.response == b"a"
