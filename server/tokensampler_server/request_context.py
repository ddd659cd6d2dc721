"""The id of the request being served, visible to every layer through a context variable."""

from __future__ import annotations

import uuid
from contextvars import ContextVar

REQUEST_ID_METADATA_KEY = "x-request-id"
_MAX_CLIENT_ID_LENGTH = 128

current_request_id: ContextVar[str] = ContextVar("current_request_id", default="")


def request_id_from_metadata(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The client's `x-request-id` when it sent a printable one, else a fresh uuid4 hex."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA_KEY and isinstance(value, str):
            if 0 < len(value) <= _MAX_CLIENT_ID_LENGTH and value.isprintable():
                return value
    return uuid.uuid4().hex
