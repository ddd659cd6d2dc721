"""The request being served, visible to every layer through context variables: its id, and whether its callers are gone."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextvars import ContextVar

import grpc

from tokensampler_server.core.errors import ServiceError

REQUEST_ID_METADATA_KEY = "x-request-id"
_MAX_CLIENT_ID_LENGTH = 128

current_request_id: ContextVar[str] = ContextVar("current_request_id", default="")


def request_id_from_metadata(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The client's `x-request-id` when it sent printable ASCII, else a fresh uuid4 hex. The id is echoed in the
    call's trailers, where grpc refuses any other byte: echoed, it turned the call's status into INTERNAL."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA_KEY and isinstance(value, str):
            if 0 < len(value) <= _MAX_CLIENT_ID_LENGTH and value.isascii() and value.isprintable():
                return value
    return uuid.uuid4().hex


def _never() -> bool:
    return False


current_abandoned: ContextVar[Callable[[], bool]] = ContextVar("current_abandoned", default=_never)
"""Whether every caller of the work running in this context has gone (set by the batcher's worker)."""


def raise_if_abandoned() -> None:
    """Long CPU work calls this between chunks: work nobody waits for any more stops there."""
    if current_abandoned.get()():
        raise ServiceError("cancelled: every caller of this work has gone", grpc.StatusCode.CANCELLED)
