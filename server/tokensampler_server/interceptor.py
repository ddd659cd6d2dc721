"""One place that knows how each call ended: it turns exceptions into gRPC statuses, counts the call
in the metrics and logs it, all under the call's request id.

A ServiceError becomes its own status and message. Anything else is a bug: it becomes INTERNAL, and
its traceback is logged under the request id; the server keeps serving. Every error message ends
with the request id. Each call gets one DEBUG line: method, request id, status, rows, duration.

Calls with a single response (unary and client-streaming) are wrapped; the server has no others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from .call_record import CallRecord, current_call
from .errors import ServiceError
from .metrics import ServerMetrics
from .request_context import REQUEST_ID_METADATA_KEY, current_request_id, request_id_from_metadata

log = logging.getLogger(__name__)

Handler = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]
"""A unary or client-streaming behaviour: (request or request iterator, context) -> response."""
Deserializer = Callable[[bytes], object]
Serializer = Callable[[object], bytes]


def _log_call(call: CallRecord, code: grpc.StatusCode, elapsed_ns: int, error: str) -> None:
    if not log.isEnabledFor(logging.DEBUG):  # the common case: skip building the fields on the hot path
        return
    rows = call.batch.num_rows if call.batch is not None else None
    fields = {"method": call.method, "request_id": call.request_id, "code": code.name, "rows": rows,
              "duration_ms": elapsed_ns / 1e6}
    if error:
        fields["error"] = error
    log.debug(
        "%s %s %s rows=%s %.3f ms%s", call.method, call.request_id, code.name, rows, elapsed_ns / 1e6,
        f": {error}" if error else "", extra=fields,
    )


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each call's behaviour, and the parsing and serialisation of its messages."""

    def __init__(self, metrics: ServerMetrics | None = None) -> None:
        self._metrics = metrics or ServerMetrics()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.response_streaming:
            return handler
        # grpc asks for the handler once per call, so this record belongs to this call alone.
        request_id = request_id_from_metadata(details.invocation_metadata)
        call = CallRecord(method=details.method.lstrip("/"), request_id=request_id)
        if handler.request_streaming:
            wrap, behaviour = grpc.stream_unary_rpc_method_handler, handler.stream_unary
        else:
            wrap, behaviour = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        return wrap(
            self._guard(behaviour, call),
            request_deserializer=self._timed_parse(handler.request_deserializer, call),
            response_serializer=self._timed_serialize(handler.response_serializer, call),
        )

    def _timed_parse(self, deserialize: Deserializer | None, call: CallRecord) -> Deserializer:
        def parse(raw: bytes) -> object:
            call.start()
            started = time.perf_counter_ns()
            message = deserialize(raw) if deserialize is not None else raw
            call.parse_ns += time.perf_counter_ns() - started
            return message

        return parse

    def _timed_serialize(self, serialize: Serializer | None, call: CallRecord) -> Serializer:
        def serialize_timed(message: object) -> bytes:
            started = time.perf_counter_ns()
            raw = serialize(message) if serialize is not None else message
            self._metrics.observe_serialized(call, time.perf_counter_ns() - started)
            return raw

        return serialize_timed

    def _guard(self, handler: Handler, call: CallRecord) -> Handler:
        async def guarded(request: object, context: grpc.aio.ServicerContext) -> object:
            call.start()
            current_request_id.set(call.request_id)
            current_call.set(call)
            context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, call.request_id),))
            code, error = grpc.StatusCode.OK, ""
            with self._metrics.in_flight.track_inprogress():
                try:
                    return await handler(request, context)
                except grpc.aio.AbortError:  # the handler set its own status
                    code = context.code() or grpc.StatusCode.UNKNOWN
                    raise
                except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                    code = grpc.StatusCode.CANCELLED
                    raise
                except ServiceError as err:
                    code, error = err.code, err.message
                except Exception:
                    log.exception("%s %s failed", call.method, call.request_id)
                    code, error = grpc.StatusCode.INTERNAL, "internal error"
                finally:
                    elapsed_ns = call.elapsed_ns()
                    self._metrics.observe_call(call, code, elapsed_ns)
                    _log_call(call, code, elapsed_ns, error)
            await context.abort(code, f"{error} (request id {call.request_id})")

        return guarded
