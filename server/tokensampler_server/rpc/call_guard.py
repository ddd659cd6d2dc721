"""One place that knows how each call ended: it turns exceptions into gRPC statuses, counts the call
in the metrics, logs it and, with tracing on, gives it a span (tracing.py), all under the call's request id.

A ServiceError becomes its own status and message. Anything else is a bug: it becomes INTERNAL, and
its traceback is logged under the request id; the server keeps serving. Every error message ends
with the request id. Each call gets one DEBUG line: method, request id, status, rows, duration.

The guard wraps each method's handler once, as services register (`CallGuard.registration`), rather
than as a grpc interceptor, whose chain grpc runs, and whose handler it would have us rebuild, for every
call (docs/design/service-path.md). Calls with a single response (unary and
client-streaming) are guarded whole. Calls with streamed responses (SampleStream, health Watch,
reflection) count, log and (through current_message_tracer) trace each message themselves; of those, only
failures to parse a request and ServiceErrors are turned into statuses here.

Request bytes that do not parse as the method's message answer INVALID_ARGUMENT (grpc alone would
answer UNKNOWN and log a traceback per call). A RESOURCE_EXHAUSTED raised by the service (a full
queue, a cap of admission.py, which the guard applies before the behaviour runs) carries the trailing
metadata `x-retryable: overload`, which tells a client that retrying later can succeed: grpc's own
RESOURCE_EXHAUSTED for a message over the size limit lacks it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import grpc
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError

from tokensampler_server.rpc.admission import Admission, IdleWatch, Slot
from tokensampler_server.rpc.call_record import CallRecord, current_call, current_message_tracer
from tokensampler_server.core.budget import ByteBudget
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument, ServiceError, bounded, failure_status, unparsable
from tokensampler_server.rpc.metrics import ServerMetrics
from tokensampler_server.rpc.parsing import Parses
from tokensampler_server.validation.wire_counts import WireRefusal
from tokensampler_server.core.request_context import REQUEST_ID_METADATA_KEY, current_request_id, request_id_from_metadata

if TYPE_CHECKING:  # tracing.py loads opentelemetry: only a server with tracing on imports it
    from tokensampler_server.rpc.tracing import CallTracer

log = logging.getLogger(__name__)

Handler = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]
"""A unary or client-streaming behaviour: (request or request iterator, context) -> response."""
Deserializer = Callable[[bytes], object]
Serializer = Callable[[object], bytes]

RETRYABLE_METADATA_KEY = "x-retryable"
Admit = Callable[[grpc.aio.ServicerContext], Slot]
"""Takes the call's admission slots, or raises RESOURCE_EXHAUSTED."""


def _one_line(text: str) -> str:
    """Text as a log line may carry it: line breaks, escapes and other control characters written as escapes."""
    return text.encode("unicode_escape").decode("ascii")


def _details(message: str, request_id: str) -> str:
    return f"{bounded(message)} (request id {request_id})"


@dataclass(frozen=True)
class _Unparsable:
    """Stands for a request message whose bytes did not parse; the call's guard raises `error`."""

    error: InvalidArgument


def _parse(deserialize: Deserializer | None, raw: bytes) -> object:
    if deserialize is None:
        return raw
    try:
        return deserialize(raw)
    except DecodeError as err:
        # Raising here would escape every guard (grpc parses before the behaviour runs).
        return _Unparsable(unparsable(raw, err))


def _descriptor(deserialize: Deserializer) -> Descriptor | None:
    """The message type a generated deserializer (a message class's FromString) parses, if it is one."""
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    return descriptor if isinstance(descriptor, Descriptor) else None


def _checked(request: object, streaming: bool) -> object:
    """The request (or the iterator of requests) the behaviour gets; unparsable bytes raise their error."""
    if streaming:
        return _checked_stream(request)
    if isinstance(request, _Unparsable):
        raise request.error
    return request


async def _checked_stream(requests: AsyncIterator[object]) -> AsyncIterator[object]:
    async for request in requests:
        if isinstance(request, _Unparsable):
            raise request.error
        yield request


def _trailing(code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...] = (),
              error: BaseException | None = None) -> tuple[tuple[str, str], ...]:
    """`trailing`, marked retryable for a RESOURCE_EXHAUSTED that a later try can get past, with the reason the
    error gives (ServiceError.retry_mark)."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and getattr(error, "retryable", True):
        return trailing + ((RETRYABLE_METADATA_KEY, getattr(error, "retry_mark", "overload")),)
    return trailing


def _log_call(call: CallRecord, code: grpc.StatusCode, elapsed_ns: int, error: str) -> None:
    if not log.isEnabledFor(logging.DEBUG):  # the common case: skip building the fields on the hot path
        return
    rows = call.num_rows
    fields = {"method": call.method, "request_id": call.request_id, "code": code.name, "rows": rows,
              "duration_ms": elapsed_ns / 1e6}
    if error:  # a client's text: cut, and in the text line escaped so that it cannot start a line of its own
        fields["error"] = bounded(error)
        error = _one_line(fields["error"])
    log.debug(
        "%s %s %s rows=%s %.3f ms%s", call.method, call.request_id, code.name, rows, elapsed_ns / 1e6,
        f": {error}" if error else "", extra=fields,
    )


class CallGuard:
    """Wraps each method's behaviour, and the parsing and serialisation of its messages, once per method."""

    def __init__(self, metrics: ServerMetrics | None = None, admission: Admission | None = None,
                 tracer: CallTracer | None = None, request_bytes: ByteBudget | None = None,
                 limits: Limits | None = None) -> None:
        """`request_bytes`: what unary requests in progress hold from before they are parsed (parsing costs
        several times a message's size, and the queues' own bound applies only after it); `limits`: what a large
        request's repeated values are counted against before it is parsed (parsing.py)."""
        self._metrics = metrics or ServerMetrics()
        self._admission = admission
        self._tracer = tracer
        self._request_bytes = request_bytes
        self._parses = Parses(limits or Limits())

    def registration(self, server: grpc.aio.Server) -> GuardedRegistration:
        """What services register on instead of `server`: every handler they add reaches it guarded."""
        return GuardedRegistration(server, self)

    def guard(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """`handler` of `method` (the full name without the leading slash) with this guard around it."""
        admit = self._admit(method)
        if handler.response_streaming:
            return self._wrap_streaming(handler, method, admit, self._tracer if self._tracer is not None
                                        and self._tracer.traces(method) else None)
        if handler.request_streaming:
            wrap, behaviour = grpc.stream_unary_rpc_method_handler, handler.stream_unary
            # grpc parses each message as the behaviour reads it, inside the guarded call
            deserializer = self._timed_stream_parse(handler.request_deserializer)
        else:
            wrap, behaviour = grpc.unary_unary_rpc_method_handler, handler.unary_unary
            deserializer = None  # the guard parses the request bytes itself, timed into the call's record
        return wrap(
            self._guard(behaviour, method, handler.request_deserializer, handler.request_streaming, admit,
                        self._tracer if self._tracer is not None and self._tracer.traces(method) else None),
            request_deserializer=deserializer,
            response_serializer=self._timed_serialize(handler.response_serializer),
        )

    def _admit(self, method: str) -> Admit | None:
        """What takes a call's admission slots for `method`; None when nothing is counted."""
        if self._admission is None:
            return None
        pool = self._admission.pool_of(method)
        return None if pool is None else partial(self._admission.admit, pool)

    def _wrap_streaming(self, handler: grpc.RpcMethodHandler, method: str, admit: Admit | None,
                        tracer: CallTracer | None) -> grpc.RpcMethodHandler:
        """A response-streaming handler whose unparsable requests and ServiceErrors become statuses; with
        `tracer`, its messages get spans through current_message_tracer. A bidirectional stream's slot may be
        taken back while it is idle (admission.py)."""
        streaming = handler.request_streaming
        admission = self._admission
        watched = streaming and admit is not None and admission.watches(method)
        if streaming:
            wrap, behaviour = grpc.stream_stream_rpc_method_handler, handler.stream_stream
        else:
            wrap, behaviour = grpc.unary_stream_rpc_method_handler, handler.unary_stream

        async def abort(context: grpc.aio.ServicerContext, err: ServiceError, request_id: str) -> None:
            log.debug("stream %s failed: %s", request_id, _one_line(bounded(err.message)))
            await context.abort(err.code, _details(err.message, request_id), _trailing(err.code, error=err))

        if inspect.isasyncgenfunction(behaviour):
            async def guarded(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                # One id for the stream: its messages' ids (the stream's id, a dot, their number) and its status.
                request_id = request_id_from_metadata(context.invocation_metadata())
                current_request_id.set(request_id)
                if tracer is not None:
                    current_message_tracer.set(partial(tracer.record, metadata=context.invocation_metadata()))
                try:
                    slot = admit(context) if admit is not None else None
                    requests = _checked(request, streaming)
                    watch = IdleWatch(admission, slot) if watched else None
                    if watch is not None:
                        requests = watch.requests(requests)
                    async for response in behaviour(requests, context):
                        if watch is not None:
                            watch.delivering()
                        yield response
                        if watch is not None:
                            watch.answered()
                except ServiceError as err:
                    await abort(context, err, request_id)
        else:  # a coroutine that writes its responses with context.write (health Watch)
            async def guarded(request: object, context: grpc.aio.ServicerContext) -> object:
                request_id = request_id_from_metadata(context.invocation_metadata())
                current_request_id.set(request_id)
                try:
                    if admit is not None:
                        admit(context)
                    return await behaviour(_checked(request, streaming), context)
                except ServiceError as err:
                    await abort(context, err, request_id)

        return wrap(
            guarded,
            request_deserializer=lambda raw: self._stream_parse(handler.request_deserializer, raw),
            response_serializer=handler.response_serializer,
        )

    def _stream_parse(self, deserialize: Deserializer | None, raw: bytes) -> object:
        """A stream message parsed as grpc reads it (on the event loop), its repeated values counted first
        (parsing.py): a refusal, like bytes that do not parse, is the call's error, raised when the message is read."""
        try:
            return self._parses.parse_here(lambda raw: _parse(deserialize, raw), raw, _descriptor(deserialize))
        except WireRefusal as err:
            return _Unparsable(err)

    def _timed_stream_parse(self, deserialize: Deserializer | None) -> Deserializer:
        def parse(raw: bytes) -> object:
            started = time.perf_counter_ns()
            message = self._stream_parse(deserialize, raw)
            call = current_call.get(None)
            if call is not None:
                call.parse_ns += time.perf_counter_ns() - started
            return message

        return parse

    def _timed_serialize(self, serialize: Serializer | None) -> Serializer:
        def serialize_timed(message: object) -> bytes:
            started = time.perf_counter_ns()
            raw = serialize(message) if serialize is not None else message
            call = current_call.get(None)  # the guarded behaviour's record: grpc serialises in the call's task
            if call is not None:
                self._metrics.observe_serialized_later(call, time.perf_counter_ns() - started)
            return raw

        return serialize_timed

    def _hold_until_delivered(self, response: object, context: grpc.aio.ServicerContext) -> None:
        """Counts an answer in the requests' budget until grpc has delivered it, or the call has ended otherwise: a
        caller that never reads its answers holds them in the server, and past the budget new calls are refused
        (before, unread 32 MiB answers held 3 GB for 24 calls with a budget of 64 MiB)."""
        nbytes = len(response) if isinstance(response, bytes) else response.ByteSize()
        self._request_bytes.hold(nbytes)
        context.add_done_callback(lambda _context: self._request_bytes.give_back(nbytes))

    def _guard(self, handler: Handler, method: str, deserialize: Deserializer | None, streaming: bool,
               admit: Admit | None, tracer: CallTracer | None) -> Handler:
        reclaims = admit is not None and self._admission.reclaims(method)

        async def guarded(request: object, context: grpc.aio.ServicerContext) -> object:
            call = CallRecord(method=method, request_id=request_id_from_metadata(context.invocation_metadata()))
            call.start()
            current_request_id.set(call.request_id)
            current_call.set(call)
            trailing = ((REQUEST_ID_METADATA_KEY, call.request_id),)
            context.set_trailing_metadata(trailing)
            code, error, failed = grpc.StatusCode.OK, "", None
            metrics = self._metrics
            metrics.calls_in_flight += 1  # every guarded call runs on the server's event loop: no lock needed
            held = 0
            try:
                slot = admit(context) if admit is not None else None
                if not streaming:
                    if self._request_bytes is not None and isinstance(request, bytes):
                        self._request_bytes.take(len(request))
                        held = len(request)
                    parse_started = time.perf_counter_ns()
                    if deserialize is not None and isinstance(request, bytes):  # (Sample parses its own)
                        request = await self._parses.parse(lambda raw: _parse(deserialize, raw), request,
                                                           _descriptor(deserialize), timed=call)
                    call.parse_ns = time.perf_counter_ns() - parse_started
                response = await handler(_checked(request, streaming), context)
                if self._request_bytes is not None:
                    self._hold_until_delivered(response, context)
                if reclaims:  # grpc sends the answer in this task: one its client does not take may lose the slot
                    task = asyncio.current_task()
                    self._admission.idle(slot, lambda _idle_s: task.cancel())
                return response
            except grpc.aio.AbortError:  # the handler set its own status
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as err:
                code, error = failure_status(err, call.method, call.request_id)
                failed = err
            finally:
                if held:
                    self._request_bytes.give_back(held)
                metrics.calls_in_flight -= 1
                elapsed_ns = call.elapsed_ns()
                if tracer is not None:  # before the metrics, which trade the call's batch for its row counts
                    tracer.record(call, code, elapsed_ns, context.invocation_metadata())
                metrics.observe_call_later(call, code, elapsed_ns)  # recorded at the next scrape
                _log_call(call, code, elapsed_ns, error)
            await context.abort(code, _details(error, call.request_id), _trailing(code, trailing, failed))

        return guarded


class _GuardedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose method handlers come guarded, each wrapped once, when first asked for."""

    def __init__(self, inner: grpc.GenericRpcHandler, guard: CallGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        guarded = self._guarded.get(details.method)
        if guarded is None:
            handler = self._inner.service(details)
            if handler is None:
                return None
            guarded = self._guarded[details.method] = self._guard.guard(handler, details.method.lstrip("/"))
        return guarded


class GuardedRegistration:
    """Stands for the grpc.aio.Server while services register (generated add_*_to_server, health,
    reflection): the handlers they add reach the server guarded."""

    def __init__(self, server: grpc.aio.Server, guard: CallGuard) -> None:
        self._server = server
        self._guard = guard

    def add_generic_rpc_handlers(self, generic_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGenericHandler(h, self._guard) for h in generic_handlers))

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(
            service_name, {name: self._guard.guard(h, f"{service_name}/{name}") for name, h in handlers.items()})
