"""The one exception type every failed RPC of the client raises."""

from __future__ import annotations

from typing import cast

import grpc

from ._retry import retry_mark


class TokenSamplerError(Exception):
    """A failed call to the tokensampler server.

    Attributes:
        code: the gRPC status code (INVALID_ARGUMENT for a rejected request, UNAVAILABLE when the
            server cannot be reached after the retries, DEADLINE_EXCEEDED, INTERNAL, ...).
        details: the server's message; for INVALID_ARGUMENT it names the offending field.
        request_id: the `x-request-id` the call was sent with, to find it in the server's log.
        overload: RESOURCE_EXHAUSTED of an overloaded server (its queue full, or its limit of concurrent calls),
            which a later call can get past, its retries spent; False for one no retry gets past (a request larger
            than a bound of the server's, such as `--max-message-mb` or the whole of `--max-queue-rows`) and for a
            server out of memory (fewer rows may get past it).
    """

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str | None = None,
                 overload: bool = False) -> None:
        self.code = code
        self.details = details
        self.request_id = request_id
        self.overload = overload
        # The server already ends its messages with the request id; add it only where it is missing.
        suffix = f" (request_id {request_id})" if request_id and request_id not in details else ""
        super().__init__(f"{code.name}: {details}{suffix}")


def error_from_rpc(err: grpc.RpcError, request_id: str | None) -> TokenSamplerError:
    """Maps a grpc (sync or aio) RpcError onto TokenSamplerError."""
    # Errors raised by a call are also grpc.Call objects (sync) or AioRpcError (aio): both have these.
    call = cast(grpc.Call, err)
    code, details = call.code() or grpc.StatusCode.UNKNOWN, call.details() or ""
    overload = retry_mark(code, call.trailing_metadata(), details) == "overload"
    return TokenSamplerError(code, details, request_id, overload)
