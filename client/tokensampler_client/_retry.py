"""Retry policy shared by the sync and async clients: which failures are retried, and when.

Two failures are retried, with backoff and jitter: UNAVAILABLE (the server was not reached, or is
shutting down), and RESOURCE_EXHAUSTED when it is overload: the server's queue is full (trailing
metadata `x-retryable`), or grpc refused the call at the server's limit of concurrent calls (its own
message, which carries no metadata). Any other RESOURCE_EXHAUSTED is a message over a size limit,
which no retry can fix. Every other code is the server's answer and is final. No retry starts
after the call's deadline.

Sample calls, which are idempotent (the same request samples the same tokens), also retry
CANCELLED: a server that shuts down cancels the calls it had received but not yet started.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
LONGEST_TIMEOUT_S = 1e8
"""Deadlines further off (about three years; inf included) are sent as none."""
RETRYABLE_METADATA_KEY = "x-retryable"
"""Set by the server on failures that a later retry can get past (RESOURCE_EXHAUSTED: queue full)."""

CONCURRENCY_LIMIT_DETAILS = "Concurrent RPC limit exceeded!"
"""grpc's own message when a server at its maximum_concurrent_rpcs (--max-concurrent-rpcs) refuses a call."""

Metadata = Iterable[tuple[str, str | bytes]]


def is_retryable(
    code: grpc.StatusCode | None, trailing_metadata: Metadata | None = None, idempotent: bool = False, details: str = ""
) -> bool:
    if code in RETRYABLE_CODES or (idempotent and code == grpc.StatusCode.CANCELLED):
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
        details == CONCURRENCY_LIMIT_DETAILS or any(key == RETRYABLE_METADATA_KEY for key, _ in trailing_metadata or ())
    )


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter, in seconds.

    The delay before retry n (0-based) is min(maximum, initial * multiplier**n), of which a random
    fraction of up to `jitter` is taken off, so that clients failing together do not retry together.
    """

    initial: float = 0.05
    multiplier: float = 2.0
    maximum: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.initial < 0 or self.maximum < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"invalid backoff {self}: need initial, maximum >= 0, multiplier >= 1, 0 <= jitter <= 1")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        # The exponent is capped so that huge retry counts cannot overflow the float.
        base = min(self.maximum, self.initial * self.multiplier ** min(retry, 64))
        return base * (1.0 - self.jitter * (rng or random).random())


class RetryState:
    """Deadline and retry bookkeeping of one call (one instance per call)."""

    def __init__(
        self,
        retries: int,
        backoff: Backoff,
        timeout: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._retries = retries
        self._backoff = backoff
        self._clock = clock
        self._deadline = None if timeout is None else clock() + timeout
        self.retries_done = 0

    def remaining(self) -> float | None:
        """Seconds left until the call's deadline (the per-attempt gRPC timeout), None without one (or one too far
        off for grpc, which turns a timeout past ~1e10 s into a deadline already passed)."""
        return None if self._deadline is None else grpc_timeout(max(0.0, self._deadline - self._clock()))

    def next_delay(
        self,
        code: grpc.StatusCode | None,
        trailing_metadata: Metadata | None = None,
        idempotent: bool = False,
        details: str = "",
    ) -> float | None:
        """The wait before retrying after a failure with `code` (and the failure's trailing metadata and
        message), or None when the call must fail now."""
        if not is_retryable(code, trailing_metadata, idempotent, details) or self.retries_done >= self._retries:
            return None
        delay = self._backoff.delay(self.retries_done)
        if self._deadline is not None and self._clock() + delay >= self._deadline:
            return None
        self.retries_done += 1
        return delay


@dataclass(frozen=True)
class CallPolicy:
    """A client's defaults for every call: deadline (seconds, None for none), retries and backoff."""

    timeout: float | None = None
    retries: int = 3
    backoff: Backoff = Backoff()

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries: expected >= 0, got {self.retries}")
        check_timeout(self.timeout)

    def start(self, timeout: float | None = None) -> RetryState:
        """The retry state of a new call; `timeout` overrides the client's default deadline."""
        check_timeout(timeout)
        return RetryState(self.retries, self.backoff, self.timeout if timeout is None else timeout)


def grpc_timeout(seconds: float | None) -> float | None:
    """`seconds` as grpc takes a timeout: None for none, or for one further off than LONGEST_TIMEOUT_S."""
    return None if seconds is None or seconds > LONGEST_TIMEOUT_S else seconds


def check_timeout(timeout: float | None) -> None:
    """ValueError unless `timeout` is None or a number of seconds > 0 (inf: no deadline)."""
    if timeout is not None and not timeout > 0:  # NaN too
        raise ValueError(f"timeout: expected a positive number of seconds or None, got {timeout}")
