"""What one request holds (its regions and weights), shared by the call and by the backend work that reads them.

A call can end before its work does (a deadline, a cancel): the memory it named must stay mapped until the
backend, GPU stream included, is done with it. So the call and the queued work each hold a share of the
request's lease, and the holds end when the last share is released.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, ExitStack
from typing import TypeVar

T = TypeVar("T")


class Lease:
    """Holds entered with `enter`, released when every share has been (the creator holds the first)."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._shares = 1
        self._lock = threading.Lock()

    def enter(self, hold: AbstractContextManager[T]) -> T:
        return self._stack.enter_context(hold)

    def share(self) -> Lease:
        """One more share, for work that outlives the caller's; `release` ends it."""
        with self._lock:
            if self._shares == 0:
                raise RuntimeError("a released lease cannot be shared")
            self._shares += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._shares -= 1
            last = self._shares == 0
        if last:
            self._stack.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
