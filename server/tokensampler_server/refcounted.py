"""A registry of named resources that requests hold while they use them.

Registering makes a complete resource visible at once; `use` holds a reference for one request;
`unregister` hides the name from new requests at once, waits until no request holds the resource,
then hands it back for freeing. Weights and shared-memory regions both live in one of these.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import grpc

from .errors import InvalidArgument, ServiceError

T = TypeVar("T")
_UNREGISTER_POLL_S = 0.005


class RefCountedRegistry(Generic[T]):
    """Thread-safe: `use` may end on the backend's worker thread."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._items: dict[str, T] = {}
        self._in_flight: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, name: str, item: T) -> T:
        """Makes `item` usable under `name` (ALREADY_EXISTS if taken)."""
        if not name:
            raise InvalidArgument("name", f"got an empty name, expected a non-empty {self._kind} name")
        with self._lock:
            if name in self._items:
                raise ServiceError(f"name: a {self._kind} named {name!r} is already registered",
                                   grpc.StatusCode.ALREADY_EXISTS)
            self._items[name] = item
            self._in_flight[id(item)] = 0
        return item

    def get(self, name: str) -> T | None:
        """The item registered as `name`, without holding it; None if there is none."""
        with self._lock:
            return self._items.get(name)

    def items(self) -> list[T]:
        with self._lock:
            return list(self._items.values())

    def in_flight(self, item: T) -> int:
        with self._lock:
            return self._in_flight.get(id(item), 0)

    @contextmanager
    def use(self, name: str, field: str) -> Iterator[T]:
        """Holds `name` for the duration of a request; NOT_FOUND naming `field` if unknown."""
        with self._lock:
            item = self._items.get(name)
            if item is None:
                raise ServiceError(f"{field}: no {self._kind} named {name!r} is registered", grpc.StatusCode.NOT_FOUND)
            self._in_flight[id(item)] += 1
        try:
            yield item
        finally:
            with self._lock:
                self._in_flight[id(item)] -= 1

    async def remove(self, name: str) -> T:
        """Hides `name` from new requests, waits for the ones using it, and returns the item."""
        with self._lock:
            item = self._items.pop(name, None)
        if item is None:
            raise ServiceError(f"name: no {self._kind} named {name!r} is registered", grpc.StatusCode.NOT_FOUND)
        # Unregistering is rare and requests are short: polling keeps the backend thread free of
        # any event-loop plumbing.
        while self.in_flight(item):
            await asyncio.sleep(_UNREGISTER_POLL_S)
        with self._lock:
            del self._in_flight[id(item)]
        return item
