"""Channel options and call metadata shared by the sync and async clients."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from grpc_health.v1 import health_pb2

REQUEST_ID_METADATA_KEY = "x-request-id"


def channel_options(max_message_mb: int, options: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """gRPC channel arguments: message-size limits for both directions, then the caller's `options`.

    A caller's option of the same name replaces the default rather than being listed twice.
    """
    if max_message_mb <= 0:
        raise ValueError(f"max_message_mb: expected a positive number of MiB, got {max_message_mb}")
    limit = int(max_message_mb * 1024 * 1024)
    merged: dict[str, Any] = {
        "grpc.max_send_message_length": limit,
        "grpc.max_receive_message_length": limit,
    }
    merged.update(dict(options or ()))
    return list(merged.items())


def new_request_id() -> str:
    """A fresh request id (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


def call_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """Metadata sent with every call: the request id, which the server logs and echoes back."""
    return ((REQUEST_ID_METADATA_KEY, request_id),)


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def health_status_name(response: health_pb2.HealthCheckResponse) -> str:
    """'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN' or 'UNKNOWN'."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
