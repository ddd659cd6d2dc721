"""Request bytes parsed where they do not stall the server: a large message on a thread, a few at a time.

protobuf parses a packed numeric field at ~30 ns a value into 8 bytes a value: a 200 MB Sample whose params.seed
held 200 M one-byte varints took 9.4 s on the event loop, during which no other call was served, and 4 GB. On a
thread the loop serves the others meanwhile; LARGE_PARSES at a time bounds what such parses hold together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.descriptor import Descriptor

from tokensampler_server.core.config import Limits
from tokensampler_server.validation.wire_counts import check_counts

T = TypeVar("T")

PARSE_ON_LOOP_BYTES = 1 << 20  # a message this size parses in well under a millisecond
LARGE_PARSES = 2


class Parses:
    """Parses of one owner (the call guard, the Sample service): larger messages on threads, LARGE_PARSES at once,
    each counted first (wire_counts.py) where its type is known."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._large = asyncio.Semaphore(LARGE_PARSES)

    async def parse(self, parse: Callable[[bytes], T], raw: bytes, descriptor: Descriptor | None = None) -> T:
        if len(raw) <= PARSE_ON_LOOP_BYTES:
            return parse(raw)

        def counted_then_parsed(raw: bytes) -> T:
            if descriptor is not None:
                check_counts(raw, descriptor, self._limits)  # before protobuf expands what validation refuses
            return parse(raw)

        async with self._large:
            return await asyncio.to_thread(counted_then_parsed, raw)
