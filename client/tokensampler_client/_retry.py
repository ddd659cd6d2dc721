"""Retry policy shared by the sync and async clients: which failures are retried, and when.

Two failures are retried, with backoff and jitter: UNAVAILABLE (the server was not reached, or is
shutting down), and RESOURCE_EXHAUSTED when it is overload: the server's queue is full (trailing
metadata `x-retryable`), or grpc refused the call at the server's limit of concurrent calls (its own
message, which carries no metadata). Any other RESOURCE_EXHAUSTED is a message over a size limit,
which no retry can fix. Every other code is the server's answer and is final. No retry starts
after the call's deadline.

Sample calls, which are idempotent (the same request samples the same tokens), also retry
CANCELLED: a server that shuts down cancels the calls it had received but not yet started.

Each call has its own count of retries (CallPolicy.retries). A client may also share a RetryThrottle among all its
calls, gRPC's retry throttling: while most recent attempts failed, no call retries, so an overloaded server does not
get more attempts the more overloaded it is.
"""

from __future__ import annotations

import math
import random
import threading
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


def retry_mark(code: grpc.StatusCode | None, trailing_metadata: Metadata | None = None,
               details: str = "") -> str | None:
    """Why a RESOURCE_EXHAUSTED can be got past later: "overload" (marked so, or grpc's concurrency limit: the same
    request later), "memory" (the server ran out of it: later, or with fewer rows); None for any other failure,
    RESOURCE_EXHAUSTED without the mark included (a request larger than a bound, which no retry gets past)."""
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    if details == CONCURRENCY_LIMIT_DETAILS:
        return "overload"
    return next((str(value) for key, value in trailing_metadata or () if key == RETRYABLE_METADATA_KEY), None)


def is_retryable(
    code: grpc.StatusCode | None, trailing_metadata: Metadata | None = None, idempotent: bool = False, details: str = ""
) -> bool:
    if code in RETRYABLE_CODES or (idempotent and code == grpc.StatusCode.CANCELLED):
        return True
    return retry_mark(code, trailing_metadata, details) is not None


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


class RetryThrottle:
    """gRPC's retry throttling (its service config's retryThrottling), shared by every call of one client.

    The throttle holds `max_tokens` tokens to begin with. Each attempt that fails with a retryable code takes one
    (down to 0), each answered attempt gives `token_ratio` back (up to `max_tokens`); no call retries while
    max_tokens / 2 or fewer are left: its failure is final. With the defaults, a client whose attempts all fail stops
    retrying after 5 failures, and retries again once its answers outnumber its failures ten to one. First attempts
    are never held back.
    """

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        if not 0 < max_tokens <= 1000 or not 0 < token_ratio < math.inf:  # gRPC's bounds; NaN refused too
            raise ValueError(f"retry throttle: expected 0 < max_tokens <= 1000 and a finite token_ratio > 0, "
                             f"got max_tokens={max_tokens}, token_ratio={token_ratio}")
        self.max_tokens = max_tokens
        self.token_ratio = token_ratio
        self._tokens = max_tokens
        self._lock = threading.Lock()  # one client's calls fail and succeed on many threads

    @property
    def tokens(self) -> float:
        """The tokens left now."""
        return self._tokens

    def failed(self) -> bool:
        """Counts a failure that could be retried; whether a retry may go."""
        with self._lock:
            self._tokens = max(0.0, self._tokens - 1)
            return self._tokens > self.max_tokens / 2

    def answered(self) -> None:
        """Counts an answered attempt."""
        with self._lock:
            self._tokens = min(self.max_tokens, self._tokens + self.token_ratio)


class RetryState:
    """Deadline and retry bookkeeping of one call (one instance per call); `throttle`: the client's, if it has one."""

    def __init__(
        self,
        retries: int,
        backoff: Backoff,
        timeout: float | None,
        clock: Callable[[], float] = time.monotonic,
        throttle: RetryThrottle | None = None,
    ) -> None:
        self._retries = retries
        self._backoff = backoff
        self._clock = clock
        self._throttle = throttle
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
        message), or None when the call must fail now: the failure is final, the retries are spent, the throttle
        holds retries back, or the wait would pass the deadline."""
        if not is_retryable(code, trailing_metadata, idempotent, details):
            return None
        if (self._throttle is not None and not self._throttle.failed()) or self.retries_done >= self._retries:
            return None
        delay = self._backoff.delay(self.retries_done)
        if self._deadline is not None and self._clock() + delay >= self._deadline:
            return None
        self.retries_done += 1
        return delay

    def answered(self) -> None:
        """An attempt was answered: the throttle counts it, and the retries count afresh (a stream's next
        message gets them all)."""
        self.retries_done = 0
        if self._throttle is not None:
            self._throttle.answered()


@dataclass(frozen=True)
class CallPolicy:
    """A client's defaults for every call: deadline (seconds, None for none), retries and backoff, and the retry
    throttle its calls share (None: none)."""

    timeout: float | None = None
    retries: int = 3
    backoff: Backoff = Backoff()
    throttle: RetryThrottle | None = None

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries: expected >= 0, got {self.retries}")
        check_timeout(self.timeout)

    def start(self, timeout: float | None = None) -> RetryState:
        """The retry state of a new call; `timeout` overrides the client's default deadline."""
        check_timeout(timeout)
        return RetryState(self.retries, self.backoff, self.timeout if timeout is None else timeout,
                          throttle=self.throttle)


def grpc_timeout(seconds: float | None) -> float | None:
    """`seconds` as grpc takes a timeout: None for none, or for one further off than LONGEST_TIMEOUT_S."""
    return None if seconds is None or seconds > LONGEST_TIMEOUT_S else seconds


def check_timeout(timeout: float | None) -> None:
    """ValueError unless `timeout` is None or a number of seconds > 0 (inf: no deadline)."""
    if timeout is not None and not timeout > 0:  # NaN too
        raise ValueError(f"timeout: expected a positive number of seconds or None, got {timeout}")
