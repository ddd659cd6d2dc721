"""One place that turns exceptions into gRPC statuses and tags each call with its request id.

A ServiceError becomes its own status and message. Anything else is a bug: it becomes INTERNAL with
the request id in the message, and its traceback is logged under that id; the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from .errors import ServiceError
from .request_context import REQUEST_ID_METADATA_KEY, current_request_id, request_id_from_metadata

log = logging.getLogger(__name__)

UnaryHandler = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]


def _guard(handler: UnaryHandler, method: str, request_id: str) -> UnaryHandler:
    async def guarded(request: object, context: grpc.aio.ServicerContext) -> object:
        current_request_id.set(request_id)
        context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, request_id),))
        try:
            return await handler(request, context)
        except grpc.aio.AbortError:
            raise
        except ServiceError as err:
            log.debug("%s %s -> %s: %s", method, request_id, err.code.name, err.message)
            await context.abort(err.code, err.message)
        except Exception:
            log.exception("%s %s failed", method, request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")

    return guarded


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary-unary handler with `_guard`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        request_id = request_id_from_metadata(details.invocation_metadata)
        return grpc.unary_unary_rpc_method_handler(
            _guard(handler.unary_unary, details.method, request_id),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
