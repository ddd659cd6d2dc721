"""Channel options, targets, credentials and call metadata shared by the sync and async clients."""

from __future__ import annotations

import ipaddress
import os
import sys
import uuid
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, Union

import grpc
from grpc_health.v1 import health_pb2

REQUEST_ID_METADATA_KEY = "x-request-id"
AUTHORIZATION_METADATA_KEY = "authorization"

PemSource = Union[str, os.PathLike, bytes]
"""PEM data as bytes, or the path of a PEM file."""


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


def call_metadata(request_id: str, auth_token: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata sent with every call: the request id, which the server logs and echoes back, the bearer
    token when the client has one (a server started with --auth-token-file requires it), and the caller's
    OpenTelemetry span (trace_context)."""
    metadata = ((REQUEST_ID_METADATA_KEY, request_id),)
    if auth_token is not None:
        metadata += ((AUTHORIZATION_METADATA_KEY, f"Bearer {auth_token}"),)
    return metadata + trace_context()


@cache
def _w3c_propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def trace_context() -> tuple[tuple[str, str], ...]:
    """W3C `traceparent` (and `tracestate`) of the caller's active OpenTelemetry span, which makes the server's
    span of the call its child; () without one. The client does not need opentelemetry: a process with an
    active span has loaded opentelemetry.context, and one that has not pays a dictionary look-up."""
    if "opentelemetry.context" not in sys.modules:
        return ()
    carrier: dict[str, str] = {}
    _w3c_propagator().inject(carrier)
    return tuple(carrier.items())


def check_auth_token(token: str | None) -> str | None:
    """The token as given, once it is one that can travel as metadata (else ValueError, not echoing it)."""
    if token is not None and (not token or not token.isascii() or not token.isprintable() or " " in token):
        raise ValueError("auth_token: expected printable ASCII characters without spaces")
    return token


def _pem(source: PemSource | None, name: str) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    try:
        return Path(source).read_bytes()
    except OSError as err:
        raise ValueError(f"{name}: cannot read {source}: {err}") from None


def channel_credentials(
    credentials: grpc.ChannelCredentials | None,
    tls_ca: PemSource | None,
    tls_cert: PemSource | None,
    tls_key: PemSource | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials from `credentials`, or from PEM sources: `tls_ca` the CA that signed the server's
    certificate (None: the system's roots), `tls_cert` + `tls_key` the client's own for mutual TLS.
    None (plaintext) when none is given."""
    given = (tls_ca, tls_cert, tls_key)
    if credentials is not None and any(item is not None for item in given):
        raise ValueError("credentials: give either credentials or tls_ca/tls_cert/tls_key, not both")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert, tls_key: give both (mutual TLS) or neither")
    if credentials is not None or all(item is None for item in given):
        return credentials
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca, "tls_ca"),
        private_key=_pem(tls_key, "tls_key"),
        certificate_chain=_pem(tls_cert, "tls_cert"),
    )


def channel_target(target: str | Sequence[str]) -> str:
    """A gRPC target: a string as is, or a list of "IP:port" replicas as one "ipv4:"/"ipv6:" target.

    Over such a list the channel talks to the first replica that answers (pick_first) and moves to
    the next when that one goes away: a call that fails with UNAVAILABLE meanwhile is retried there.
    Host names are refused: a DNS name that resolves to every replica ("dns:///name:port") does
    the same job.
    """
    if isinstance(target, str):
        return target
    families = set()
    for address in target:
        host, _, port = address.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        except ValueError:
            raise ValueError(f"target: {address!r} is not IP:port; for host names use one DNS target") from None
        if not port.isdigit():
            raise ValueError(f"target: {address!r} has no port")
        families.add(ip.version)
    if len(families) != 1:
        raise ValueError("target: expected a non-empty list of IPv4 or of IPv6 addresses, not both")
    return f"ipv{families.pop()}:{','.join(target)}"


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def health_status_name(response: health_pb2.HealthCheckResponse) -> str:
    """'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN' or 'UNKNOWN'."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
