"""A registry of named resources that requests hold while the server's work uses them.

Registering makes a complete resource visible at once; `use` holds a reference; `remove` hides the name
from new requests at once, waits until nothing holds the resource, then hands it back for freeing.
Weights and shared-memory regions both live in one of these.

A hold lasts as long as the work that reads the memory, not as long as the call that asked for it: a
request hands its holds to the batcher (leases.py), which lets go only once the backend is done.

Removal is atomic: it runs to its end even when its caller cancels or its deadline passes, and when
holders do not let go within the registry's timeout it puts the name back and raises FAILED_PRECONDITION, so that
state is either the old one or the new one, never between. A name being removed cannot be registered
again until the removal ends, so that putting it back never collides.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import grpc

from tokensampler_server.core.errors import InvalidArgument, ServiceError, quoted

T = TypeVar("T")
_UNREGISTER_POLL_S = 0.005
MAX_NAME_BYTES = 256
"""The longest name of a registered resource, in UTF-8 bytes: every listing repeats every name, and a few names of
megabytes would push ListWeights or ListRegions past the message limit for every client."""


def check_name(name: str, kind: str, field: str = "name") -> None:
    """INVALID_ARGUMENT naming `field` unless `name` is a non-empty name of printable characters (it reaches logs and
    listings: no line breaks or control characters) of at most MAX_NAME_BYTES."""
    if not name:
        raise InvalidArgument(field, f"got an empty name, expected a non-empty {kind} name")
    size = len(name.encode())
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(field, f"got a name of {size} bytes, expected at most {MAX_NAME_BYTES}")
    if not name.isprintable():
        raise InvalidArgument(field, f"got {quoted(name)}, expected a {kind} name of printable characters (no control "
                                     "characters or line breaks)")


class RefCountedRegistry(Generic[T]):
    """Thread-safe: a hold may end on the backend's worker thread. Items are tracked by identity."""

    def __init__(self, kind: str, *, max_items: int | None = None, unregister_timeout_s: float = 60.0) -> None:
        self._kind = kind
        self._max_items = max_items
        self._unregister_timeout_s = unregister_timeout_s
        self._items: dict[str, T] = {}
        self._leaving: dict[str, T] = {}
        """Items whose removal waits for their holders, by name."""
        self._reserved: set[str] = set()
        """Names a registration has taken before its long work (reading, checking a weight), until it adds or gives
        up: a second registration of the name is refused at once instead of doing the same work for nothing."""
        self._holds: dict[int, int] = {}
        """Holds per item, by id: ids are unique while the item is here, and the dict keeps it alive."""
        self._lock = threading.Lock()

    def add(self, name: str, item: T, *, reserved: bool = False) -> T:
        """Makes `item` usable under `name` (ALREADY_EXISTS if taken, RESOURCE_EXHAUSTED past the cap); `reserved`:
        the caller holds the name's reservation (`reserve`), which this ends."""
        check_name(name, self._kind)
        with self._lock:
            if reserved:
                self._reserved.remove(name)
            self._refuse_locked(name)
            self._items[name] = item
            self._holds[id(item)] = 0
        return item

    def reserve(self, name: str) -> None:
        """Takes `name` for a registration about to do long work (raising what `add` would raise now); `add(...,
        reserved=True)` or `unreserve` ends it, on any thread."""
        check_name(name, self._kind)
        with self._lock:
            self._refuse_locked(name)
            self._reserved.add(name)

    def unreserve(self, name: str) -> None:
        """Gives up a reservation that `add` did not end; nothing if it did."""
        with self._lock:
            self._reserved.discard(name)

    def check_free(self, name: str) -> None:
        """Raises what `add` would raise for `name` now, without adding: lets a long registration be refused
        before its work."""
        check_name(name, self._kind)
        with self._lock:
            self._refuse_locked(name)

    def _refuse_locked(self, name: str) -> None:
        if name in self._items or name in self._leaving or name in self._reserved:
            state = ("being unregistered" if name in self._leaving else "being registered" if name in self._reserved
                     else "already registered")
            raise ServiceError(f"name: a {self._kind} named {quoted(name)} is {state}", grpc.StatusCode.ALREADY_EXISTS)
        taken = len(self._items) + len(self._leaving) + len(self._reserved)
        if self._max_items is not None and taken >= self._max_items:
            raise ServiceError(
                f"name: {self._max_items} {self._kind}s are registered, the server's limit; unregister one first",
                grpc.StatusCode.RESOURCE_EXHAUSTED)

    def get(self, name: str) -> T | None:
        """The item registered as `name`, without holding it; None if there is none."""
        with self._lock:
            return self._items.get(name)

    def items(self) -> list[T]:
        with self._lock:
            return list(self._items.values())

    def in_flight(self, item: T) -> int:
        with self._lock:
            return self._holds.get(id(item), 0)

    def hold(self, name: str, field: str) -> T:
        """Takes a hold on `name` (INVALID_ARGUMENT naming `field` if empty, NOT_FOUND if unknown); `release` ends
        it."""
        if not name:
            raise InvalidArgument(field, f"not set; expected the name of a registered {self._kind}")
        with self._lock:
            item = self._items.get(name)
            if item is None:
                raise ServiceError(f"{field}: no {self._kind} named {quoted(name)} is registered",
                                   grpc.StatusCode.NOT_FOUND)
            self._holds[id(item)] += 1
        return item

    def release(self, item: T) -> None:
        with self._lock:
            self._holds[id(item)] -= 1

    @contextmanager
    def use(self, name: str, field: str) -> Iterator[T]:
        """Holds `name` for the block; NOT_FOUND naming `field` if unknown."""
        item = self.hold(name, field)
        try:
            yield item
        finally:
            self.release(item)

    async def remove(self, name: str, *, check: Callable[[T], None] | None = None,
                     hidden: Callable[[T], None] | None = None, restored: Callable[[T], None] | None = None,
                     finalize: Callable[[T], None] | None = None) -> T:
        """Hides `name` from new requests (then calls `hidden(item)`), waits for its holders, runs
        `finalize(item)` and returns the item.

        Runs to its end even if the caller goes away. `check(item)` may raise to refuse the removal: it runs
        under the lock before anything changes, and again once the holders are gone (a holder may have tied
        something to the item meanwhile). When holders remain after the registry's timeout, or the second check
        raises, `name` is registered again as it was, `restored(item)` is called and the error is raised
        (FAILED_PRECONDITION for holders)."""
        with self._lock:
            item = self._items.get(name)
            if item is None:
                raise ServiceError(f"name: no {self._kind} named {quoted(name)} is registered",
                                   grpc.StatusCode.NOT_FOUND)
            if check is not None:
                check(item)
            del self._items[name]
            self._leaving[name] = item
        if hidden is not None:
            hidden(item)
        # Shielded: a caller that cancels leaves the removal to end by itself, in one state or the other.
        return await asyncio.shield(asyncio.ensure_future(self._drain(name, item, check, restored, finalize)))

    async def _drain(self, name: str, item: T, check: Callable[[T], None] | None,
                     restored: Callable[[T], None] | None, finalize: Callable[[T], None] | None) -> T:
        # Unregistering is rare and requests are short: polling keeps the backend thread free of any
        # event-loop plumbing.
        timeout_s = self._unregister_timeout_s
        deadline = time.monotonic() + timeout_s
        while self.in_flight(item) and time.monotonic() < deadline:
            await asyncio.sleep(_UNREGISTER_POLL_S)
        refusal: ServiceError | None = None
        with self._lock:
            del self._leaving[name]
            holders = self._holds[id(item)]
            if holders:
                refusal = ServiceError(
                    f"name: {self._kind} {quoted(name)} is still used by {holders} request(s) after {timeout_s:g} s; "
                    "it stays registered", grpc.StatusCode.FAILED_PRECONDITION)
            elif check is not None:
                try:
                    check(item)
                except ServiceError as err:
                    refusal = err
            if refusal is not None:
                self._items[name] = item
            else:
                del self._holds[id(item)]
        if refusal is not None:
            if restored is not None:
                restored(item)
            raise refusal
        if finalize is not None:
            finalize(item)
        return item
