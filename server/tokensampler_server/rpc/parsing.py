"""Request bytes parsed where they do not stall the server, their repeated values counted first.

protobuf parses a packed numeric field at ~40 ns a value into 8 bytes a value, holding the interpreter's lock: a
200 MB Sample whose params.seed held 200 M one-byte varints took 9.4 s of the event loop, during which no other call
was served, and 4 GB, and 1 MiB of them 40 ms. So a message from COUNTED_FROM_BYTES has its values counted from its
wire bytes (validation/wire_counts.py: refused by field past what validation accepts), and one of many values or
many bytes is parsed on a thread, LARGE_PARSES at a time, which bounds what such parses hold together, its long
packed runs merged a piece at a time so that the thread does not hold the lock the event loop needs for the whole
parse (validation/wire_pieces.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message

from tokensampler_server.core.config import Limits
from tokensampler_server.rpc.call_record import CallRecord
from tokensampler_server.validation.wire_counts import check_counts
from tokensampler_server.validation.wire_pieces import pieces

T = TypeVar("T")

COUNTED_FROM_BYTES = 64 << 10  # smaller, at most 64 Ki values: ~3 ms of parse
PARSE_ON_LOOP_VALUES = 1 << 16  # more values parse on a thread
PARSE_ON_LOOP_BYTES = 1 << 20  # and a larger message: its bytes fields alone take ~0.6 ms a MiB
LARGE_PARSES = 2


class Parses:
    """Parses of one owner (the call guard, the Sample service): counted (where the message's type is known), then
    parsed where it arrives, or on a thread, LARGE_PARSES at once."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._large = asyncio.Semaphore(LARGE_PARSES)

    def counted(self, raw: bytes, descriptor: Descriptor | None) -> int:
        """The repeated values of `raw` (0 when not counted); raises wire_counts.WireRefusal past the limits."""
        if descriptor is None or len(raw) < COUNTED_FROM_BYTES:
            return 0
        return check_counts(raw, descriptor, self._limits)

    async def count(self, raw: bytes, descriptor: Descriptor | None) -> int:
        """counted(), on a thread for a message over PARSE_ON_LOOP_BYTES."""
        if len(raw) <= PARSE_ON_LOOP_BYTES:
            return self.counted(raw, descriptor)
        return await self._on_thread(None, self.counted, raw, descriptor)

    def parse_here(self, parse: Callable[[bytes], T], raw: bytes, descriptor: Descriptor | None) -> T:
        """Counted, then parsed where it is called: for grpc's deserializers of stream messages, which it calls on
        the event loop."""
        self.counted(raw, descriptor)
        return parse(raw)

    async def parse(self, parse: Callable[[bytes], T], raw: bytes, descriptor: Descriptor | None = None,
                    timed: CallRecord | None = None) -> T:
        """parse(raw), counted first; `timed`: the call whose parse time this is, given the wait for a parse thread
        as its parse_wait_ns, so that its deserialize stage leaves that wait out."""
        if len(raw) > PARSE_ON_LOOP_BYTES:  # counted on the thread too: numpy's count lets the loop run
            return await self._on_thread(timed, self._counted_in_pieces, parse, raw, descriptor)
        if self.counted(raw, descriptor) <= PARSE_ON_LOOP_VALUES:
            return parse(raw)
        return await self._on_thread(timed, _in_pieces, parse, raw, descriptor)

    def _counted_in_pieces(self, parse: Callable[[bytes], T], raw: bytes, descriptor: Descriptor | None) -> T:
        self.counted(raw, descriptor)
        return _in_pieces(parse, raw, descriptor)

    async def _on_thread(self, timed: CallRecord | None, work: Callable[..., T], *args: object) -> T:
        """work(*args) on a thread, holding one of the LARGE_PARSES slots until the thread ends: a caller that
        leaves (cancelled, past its deadline) does not end the thread's parse, so it does not give its slot back
        before that either. The wait for the slot goes to `timed`'s parse_wait_ns."""
        waiting = time.perf_counter_ns()
        await self._large.acquire()
        if timed is not None:
            timed.parse_wait_ns += time.perf_counter_ns() - waiting
        try:
            running = asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, work, *args)
        except BaseException:
            self._large.release()
            raise
        running.add_done_callback(self._ended)
        return await asyncio.shield(running)

    def _ended(self, running: asyncio.Future) -> None:
        self._large.release()
        if not running.cancelled():
            running.exception()  # retrieved: a parse whose caller left may fail unheard


def _in_pieces(parse: Callable[[bytes], T], raw: bytes, descriptor: Descriptor | None) -> T:
    """parse(raw), its long packed runs merged a piece at a time (validation/wire_pieces.py), so that the thread
    hands the interpreter's lock to the event loop between pieces. Bytes that do not parse are parsed whole, for
    the caller's own error."""
    split = pieces(raw, descriptor) if descriptor is not None else None
    if split is None:
        return parse(raw)
    message = parse(b"")
    if not isinstance(message, Message):  # the caller's parse keeps raw bytes: nothing to merge into
        return parse(raw)
    try:
        for head, body in split:
            message.MergeFromString(head + body)
    except DecodeError:
        return parse(raw)
    return message
