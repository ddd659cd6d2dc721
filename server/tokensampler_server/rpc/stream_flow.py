"""Flow control of SampleStream: how many of a stream's messages the server begins before it has answered them.

While a stream's window is full the server stops reading that stream, so HTTP/2 flow control pushes back on the
client: a client that never reads its answers holds a bounded share of the server's memory. A window holds at
most STREAM_MESSAGES_IN_FLIGHT messages and STREAM_BYTES_IN_FLIGHT bytes (each message's own, the region bytes its
input references and the answer it will hold: sample_rpc._message_bytes), and all windows together at most the
budget's total (the server's --max-queue-mb). A stream with nothing in flight never waits, so that other clients'
unread answers, which hold the budget, stall no stream: its next message is taken if it is no larger than a
window's bytes, or the budget has room for it, or holds nothing; a larger one is refused unparsed (as a unary call
past the requests' budget is), so that the streams' first messages together hold at most a window each beyond the
budget. docs/hardening.md has the measured figures.
"""

from __future__ import annotations

import asyncio

import grpc

from tokensampler_server.core.errors import ServiceError

STREAM_MESSAGES_IN_FLIGHT = 64
STREAM_BYTES_IN_FLIGHT = 16 << 20


class StreamBudget:
    """The bytes of every stream's begun, unanswered messages."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.used_bytes = 0
        self._room = asyncio.Event()
        """Set whenever a window lets go of bytes: waiting windows look again."""

    def window(self) -> StreamWindow:
        return StreamWindow(self)

    async def _wait(self) -> None:
        self._room.clear()
        await self._room.wait()

    def _free(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        self._room.set()


class StreamWindow:
    """One stream's begun and unanswered messages."""

    def __init__(self, budget: StreamBudget) -> None:
        self._budget = budget
        self._messages = 0
        self._bytes = 0

    def _full(self, nbytes: int) -> bool:
        budget = self._budget
        return bool(self._messages) and (self._messages >= STREAM_MESSAGES_IN_FLIGHT
                                         or self._bytes + nbytes > STREAM_BYTES_IN_FLIGHT
                                         or budget.used_bytes + nbytes > budget.total_bytes)

    async def admit(self, nbytes: int) -> bool:
        """Waits until a message of `nbytes` fits, then counts it in: True. A message larger than a window's bytes
        that finds the window empty and other streams' messages filling the budget is counted as a message of no
        bytes (answered(0) gives it back): False, and the caller refuses it without parsing it."""
        while self._full(nbytes):
            await self._budget._wait()  # noqa: SLF001 - the window and its budget are one mechanism
        budget = self._budget
        taken = (nbytes <= STREAM_BYTES_IN_FLIGHT or not budget.used_bytes
                 or budget.used_bytes + nbytes <= budget.total_bytes)
        counted = nbytes if taken else 0
        self._messages += 1
        self._bytes += counted
        budget.used_bytes += counted
        return taken

    def refusal(self, nbytes: int) -> ServiceError:
        """What a message that admit() did not take answers: RESOURCE_EXHAUSTED, retryable."""
        budget = self._budget
        return ServiceError(f"stream message: {nbytes} bytes, and the streams' messages in progress hold "
                            f"{budget.used_bytes} of at most {budget.total_bytes} (--max-queue-mb); retry with "
                            "backoff", grpc.StatusCode.RESOURCE_EXHAUSTED)

    def answered(self, nbytes: int) -> None:
        self._messages -= 1
        self._bytes -= nbytes
        self._budget._free(nbytes)  # noqa: SLF001

    def close(self) -> None:
        """The stream ended: whatever it still counted goes back to the budget."""
        self._messages = 0
        self._budget._free(self._bytes)  # noqa: SLF001
        self._bytes = 0
