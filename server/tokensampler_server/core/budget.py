"""Bytes that work in progress holds together: taken before the work, given back after it."""

from __future__ import annotations

import grpc

from tokensampler_server.core.errors import ServiceError

__all__ = ["ByteBudget"]


class ByteBudget:
    """At most `max_bytes` held at once; past it a taker gets RESOURCE_EXHAUSTED naming `field` (marked retryable by
    the call guard). A taker is always let in when nothing is held, so one piece of work larger than the budget
    (which a limit of its own bounds) is not refused for good. Used on the event loop only."""

    def __init__(self, max_bytes: int, field: str, what: str, flag: str) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._field, self._what, self._flag = field, what, flag

    def take(self, nbytes: int) -> None:
        if self.held and self.held + nbytes > self.max_bytes:
            raise ServiceError(f"{self._field}: {self._what} in progress hold {self.held} bytes and this one "
                               f"{nbytes}; the server holds at most {self.max_bytes} at once ({self._flag}), retry",
                               grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.hold(nbytes)

    def hold(self, nbytes: int) -> None:
        """Counts `nbytes` that are held already, past the bound if need be (an answer made, not yet delivered):
        later takers are refused until they are given back."""
        self.held += nbytes

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes
