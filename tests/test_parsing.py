"""rpc/parsing.py: a large request is parsed on a thread, a few at a time, and a small one where it arrives."""

from __future__ import annotations

import asyncio
import threading
import time

from tokensampler_server.core.config import Limits
from tokensampler_server.rpc.call_record import CallRecord
from tokensampler_server.rpc.parsing import (COUNTED_FROM_BYTES, LARGE_PARSES, PARSE_ON_LOOP_BYTES,
                                            PARSE_ON_LOOP_VALUES, Parses)


def test_a_large_message_is_parsed_off_the_event_loop_and_a_small_one_on_it() -> None:
    async def run() -> tuple[str, str]:
        parses = Parses(Limits())
        small = await parses.parse(lambda raw: threading.current_thread().name, b"\0" * PARSE_ON_LOOP_BYTES)
        large = await parses.parse(lambda raw: threading.current_thread().name, b"\0" * (PARSE_ON_LOOP_BYTES + 1))
        return small, large

    small, large = asyncio.run(run())
    assert small == threading.current_thread().name and large != small


class GatedParse:
    """A parse that waits for `release`, counting the most that ran at once."""

    def __init__(self) -> None:
        self.running = self.most = 0
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, raw: bytes) -> int:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(5)
        with self._lock:
            self.running -= 1
        return len(raw)


LARGE = b"\0" * (PARSE_ON_LOOP_BYTES + 1)


def test_at_most_a_few_large_parses_run_at_once() -> None:
    """Each may hold several times its bytes (one-byte varints made int64): together they are bounded."""
    parse = GatedParse()

    async def run() -> list[int]:
        parses = Parses(Limits())
        calls = [asyncio.ensure_future(parses.parse(parse, LARGE)) for _ in range(6)]
        await asyncio.sleep(0.3)
        parse.release.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(run()) == [len(LARGE)] * 6
    assert parse.most == LARGE_PARSES


def test_the_wait_for_a_parse_thread_is_out_of_the_deserialize_stage() -> None:
    """A call queued behind LARGE_PARSES others records that wait apart (parse_wait_ns): its deserialize stage is
    its own parse, not the others'."""
    parse = GatedParse()

    async def timed_call(parses: Parses, call: CallRecord) -> None:
        started = time.perf_counter_ns()
        await parses.parse(parse, LARGE, timed=call)
        call.parse_ns = time.perf_counter_ns() - started

    async def run() -> list[CallRecord]:
        parses = Parses(Limits())
        calls = [CallRecord(method="m", request_id=str(i)) for i in range(LARGE_PARSES + 1)]
        tasks = [asyncio.ensure_future(timed_call(parses, call)) for call in calls]
        await asyncio.sleep(0.3)  # the first LARGE_PARSES hold the slots; the last waits
        parse.release.set()
        await asyncio.gather(*tasks)
        return calls

    calls = asyncio.run(run())
    last = calls[-1]
    assert last.parse_wait_ns >= 0.25e9  # it waited for a slot while the others' parses were held
    assert last.deserialize_ns() < 0.25e9 <= last.parse_ns  # the stage leaves the wait out; the parse time has it
    assert all(call.parse_wait_ns < 0.1e9 for call in calls[:-1])


def test_a_parse_whose_caller_left_holds_its_slot_until_its_thread_ends() -> None:
    """A cancelled caller does not end its thread's parse, nor give back a slot while that parse runs: six callers
    cancelled at once still leave at most LARGE_PARSES parses running."""
    parse = GatedParse()

    async def run() -> None:
        parses = Parses(Limits())
        for _ in range(6):
            call = asyncio.ensure_future(parses.parse(parse, LARGE))
            await asyncio.sleep(0.05)
            call.cancel()
        await asyncio.sleep(0.2)
        parse.release.set()
        await asyncio.sleep(0.3)  # the parses still admitted then run to their end

    asyncio.run(run())
    assert parse.most == LARGE_PARSES


def test_a_message_of_many_values_is_parsed_off_the_event_loop_however_small() -> None:
    """1 MiB of one-byte varints took 40 ms to parse: from COUNTED_FROM_BYTES the values are counted, and a message
    of more than PARSE_ON_LOOP_VALUES of them parses on a thread, within the limits as this one is."""
    from tokensampler_client._proto import sampler_pb2 as pb

    def banning(ids: int) -> pb.SampleRequest:
        return pb.SampleRequest(params=pb.SamplingParams(banned_token_ids=pb.TokenLists(ids=[5] * ids)))

    many, few = banning(PARSE_ON_LOOP_VALUES + 1), banning(PARSE_ON_LOOP_VALUES)

    async def where(message) -> str:
        return await Parses(Limits()).parse(lambda raw: threading.current_thread().name,
                                            message.SerializeToString(), pb.SampleRequest.DESCRIPTOR)

    assert len(many.SerializeToString()) < PARSE_ON_LOOP_BYTES and len(few.SerializeToString()) >= COUNTED_FROM_BYTES
    assert asyncio.run(where(many)) != threading.current_thread().name
    assert asyncio.run(where(few)) == threading.current_thread().name
