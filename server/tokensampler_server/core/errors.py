"""Errors the service raises on purpose; call_guard.py turns each into its gRPC status."""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


MAX_DETAILS_BYTES = 1024
"""The most UTF-8 bytes of a status message (and of a logged error) before it is cut. A message quoting a caller's
long string would pass gRPC's metadata limit (8 KiB by default; the message travels percent-encoded, up to 3 bytes a
byte), and the caller would read RESOURCE_EXHAUSTED instead of the status."""
MAX_QUOTED_CHARS = 200
"""The most characters of a client's string that a message quotes."""


def bounded(message: str) -> str:
    """A message cut to MAX_DETAILS_BYTES, saying how long it was."""
    encoded = message.encode()
    if len(encoded) <= MAX_DETAILS_BYTES:
        return message
    return f"{encoded[:MAX_DETAILS_BYTES].decode(errors='ignore')}... ({len(encoded)} bytes)"


def quoted(text: str) -> str:
    """A client's string as a message quotes it: its repr, of at most MAX_QUOTED_CHARS characters, so that an error
    about a 64 MiB name does not copy it several times over before the status cuts it."""
    if len(text) <= MAX_QUOTED_CHARS:
        return repr(text)
    return f"{text[:MAX_QUOTED_CHARS]!r}... ({len(text)} characters)"


class ServiceError(Exception):
    """An error with the gRPC status code the client should see and a message for a person."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = True
    """For RESOURCE_EXHAUSTED: whether a later try can succeed, which the call guard marks."""
    retry_mark: str = "overload"
    """Why it can, the mark's value: "overload" (a full queue or cap: the same request later), "memory" (the
    server ran out of it: later, or fewer rows; a client that merged calls sends them again one by one)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retryable: bool = True,
                 retry_mark: str = "overload") -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.retry_mark = retry_mark
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    """A request field that is malformed or out of range: the message names the field and what was expected."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def never_fits(needed: int, limit: int, unit: str, flag: str) -> ServiceError:
    """RESOURCE_EXHAUSTED of a request larger than a bound's whole room, which no retry gets past: not marked
    retryable."""
    return ServiceError(f"queue full for good: this request needs {needed} {unit}, more than the whole bound of "
                        f"{limit} ({flag}); send less, or raise {flag}", grpc.StatusCode.RESOURCE_EXHAUSTED,
                        retryable=False)


def queue_full(waiting: int, limit: int, unit: str) -> ServiceError:
    """RESOURCE_EXHAUSTED of a request that does not fit a bounded queue (the batcher's, which the native path's
    requests share)."""
    return ServiceError(f"queue full: {waiting} {unit} waiting, at most {limit}; retry with backoff",
                        grpc.StatusCode.RESOURCE_EXHAUSTED)


def unparsable(raw: bytes, err: Exception, which: str = "") -> InvalidArgument:
    """The error of request bytes that do not parse as the method's message; `which` names the message of a
    stream ("message 3 of the stream: ")."""
    return InvalidArgument("request", f"{which}{len(raw)} bytes that do not parse ({err}); "
                           "expected a serialized protobuf message of the method's request type")


def failure_status(err: Exception, method: str, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed call ends with: a ServiceError's own; anything else is a bug,
    answered INTERNAL without its details and logged with its traceback under the request id."""
    if isinstance(err, ServiceError):
        return err.code, err.message
    log.error("%s %s failed", method, request_id, exc_info=err)
    return grpc.StatusCode.INTERNAL, "internal error"
