"""Releases of GPU mappings held back while a stream waits on the GPU for another process.

A colocated loop queues, on a stream of its own, a wait for its engine's "ready" word (docs/colocated.md); an engine
that never writes it holds that stream until the loop's wait timeout. Closing a CUDA IPC mapping, unpinning host
memory and freeing device memory wait for every stream of the context: done on the event loop while such a wait is
queued, the close would stop the timer that ends the wait, and every call of the server with it. So these releases
run only when no loop has a step queued: at once when none has, else as the last such loop delivers its steps or
drains after its end (docs/design/colocated-handoff.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["begin", "end", "pending", "when_idle"]

log = logging.getLogger(__name__)
_lock = threading.Lock()
_waiting: set[object] = set()  # the holders with a wait queued on the GPU
_deferred: list[Callable[[], None]] = []


def begin(holder: object) -> None:
    """`holder` has work queued that may wait on the GPU for another process."""
    with _lock:
        _waiting.add(holder)


def end(holder: object) -> None:
    """`holder`'s queued work is done (or `holder` never began); the last such end runs the deferred releases."""
    with _lock:
        _waiting.discard(holder)
        if _waiting:
            return
        releases = _deferred[:]
        _deferred.clear()
    for release in releases:
        _run(release)


def when_idle(release: Callable[[], None]) -> None:
    """Runs `release` now when no holder has a wait queued, else at the last holder's end."""
    with _lock:
        if _waiting:
            _deferred.append(release)
            return
    _run(release)


def pending() -> int:
    """Releases held back (a figure for tests and logs)."""
    with _lock:
        return len(_deferred)


def _run(release: Callable[[], None]) -> None:
    try:
        release()
    except Exception:  # noqa: BLE001 - one failed release must not keep the others held
        log.exception("releasing a GPU mapping failed")
