"""SampleStream sessions for decode loops: one bidirectional call, one message per step.

Responses come back in request order, so `receive()` returns the result of the oldest request not yet
received. `sample()` is send + receive; `send()` several times first to pipeline steps. A request the
server rejects raises TokenSamplerError from `receive()` and the stream stays usable.

A stream the server ends as overloaded (RESOURCE_EXHAUSTED marked retryable: it was refused at the cap of
concurrent calls, or its slot was given to a new call while it sat idle, `--reclaim-idle-calls-s`) is opened
again, with the client's backoff and retries, and the requests not yet answered are sent on the new call. The
server ends such a stream only while no request of it is being sampled, so none of them was sampled before. So is
a stream that ends UNAVAILABLE: a server shutting down ends its streams that way once every request of theirs is
answered (with a list of replicas the new call goes to another), and over a lost connection a request may have been
sampled whose answer never arrived: its caller still gets one answer, the same for a seeded request.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import time
from typing import Any

import grpc

from ._proto import sampler_pb2 as pb
from ._retry import RETRYABLE_METADATA_KEY, RetryState
from .errors import TokenSamplerError, error_from_rpc
from .params import serialize_sample_request
from .result import SampleResult

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
_STATUS_LOST_UNDER_A_WRITE = "Internal error from Core"
"""grpc.aio's status for a call whose write failed because the call had ended, in place of the status the server
ended it with (often not yet read then): such a call is opened again as an overloaded one, within the retries, and
its unanswered requests are sent again. Had the server sampled one of them, its caller still gets one answer, the
same for a seeded request."""
_END = object()

CAN_TELL_CANCELLER = hasattr(asyncio.Task, "cancelling")
"""Python 3.11 on: 3.10 cannot tell the caller's cancellation from grpc.aio's."""


def cancelled_by_caller() -> bool:
    """Whether the running task is being cancelled (asyncio.wait_for's timeout, task.cancel()), as opposed to a
    grpc.aio call ended under it (a closed channel), which raises the same CancelledError."""
    task = asyncio.current_task()
    return task is not None and CAN_TELL_CANCELLER and task.cancelling() > 0



def result_or_error(message: pb.SampleStreamResponse) -> SampleResult:
    """The result of one stream message, or its error raised as TokenSamplerError."""
    if message.WhichOneof("result") == "error":
        error = message.error
        code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
        raise TokenSamplerError(code, error.message, error.request_id)
    return SampleResult.from_response(message.response)


def stream_request(logits: Any, params: dict[str, Any]) -> pb.SampleRequest | bytes:
    """A prebuilt SampleRequest (or its bytes) as is, else one serialized from logits (or hidden=, weights=)
    and params."""
    if isinstance(logits, (pb.SampleRequest, bytes)):
        return logits
    return serialize_sample_request(logits, **params)


def _reopens(code: grpc.StatusCode | None, trailing_metadata: Any, details: str | None,
             retry: RetryState) -> float | None:
    """The wait before the stream is opened again after it ended with `code`, or None when it must fail now:
    overload and UNAVAILABLE are retried (module docstring). The retries are counted from the stream's last answer:
    each ending gets the client's retries, within the stream's deadline."""
    if code not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        return None
    return retry.next_delay(code, trailing_metadata, details=details or "")


class SampleStream:
    """A blocking SampleStream call; use `SamplerClient.stream()` to open one."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...], retry: RetryState) -> None:
        """`method`: the channel's SampleStream (wire.sample_methods); `retry`: the stream's deadline and reopens."""
        self._method = method
        self._metadata = metadata
        self._retry = retry
        self._pending: collections.deque = collections.deque()  # sent, not yet received
        self._closed = False
        self.reopens = 0
        """How many times the stream was opened again after it ended as overloaded or UNAVAILABLE."""
        self._open()

    def _open(self) -> None:
        """A new call, sent every pending request. grpc reads a call's requests from its queue on a thread of its
        own, which the queue's end lets go."""
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = self._method(iter(self._requests.get, _END), metadata=self._metadata,
                                  timeout=self._retry.remaining())
        for request in self._pending:
            self._requests.put(request)

    def send(self, logits: Any = None, **params: Any) -> None:
        """Queues one request: logits [B, V] (or hidden=..., weights=...) with sample()'s keywords,
        or a prebuilt SampleRequest or its bytes."""
        request = stream_request(logits, params)
        self._pending.append(request)
        self._requests.put(request)

    def receive(self) -> SampleResult:
        """The result of the oldest request sent and not yet received."""
        if not self._pending:
            raise RuntimeError("receive() with no request outstanding")
        while True:
            try:
                message = next(self._call)
                break
            except grpc.RpcError as err:
                delay = None if self._closed else _reopens(err.code(), err.trailing_metadata(), err.details(),
                                                           self._retry)
                if delay is None:
                    self._pending.popleft()
                    raise error_from_rpc(err, dict(self._metadata).get("x-request-id")) from err
            time.sleep(delay)
            self.reopens += 1
            self._requests.put(_END)  # the ended call's request thread
            self._open()
        self._pending.popleft()
        self._retry.answered()
        return result_or_error(message)

    def sample(self, logits: Any = None, **params: Any) -> SampleResult:
        self.send(logits, **params)
        return self.receive()

    def close(self) -> None:
        """Ends the stream; results not yet received are dropped, and it is not opened again."""
        self._closed = True
        self._requests.put(_END)
        if self._pending:
            self._call.cancel()

    def __enter__(self) -> SampleStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSampleStream:
    """An asyncio SampleStream call; use `AsyncSamplerClient.stream()` to open one. Cancelling a receive() (its
    task, or asyncio.wait_for's timeout) cancels the whole call, as grpc.aio does: later calls of the stream raise
    TokenSamplerError CANCELLED, as they do once its client is closed."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...], retry: RetryState) -> None:
        self._method = method
        self._metadata = metadata
        self._retry = retry
        self._pending: collections.deque = collections.deque()  # written, not yet received
        self._closed = False  # by close(), or by a caller's cancellation of a reopen
        self._write_failed = False  # on the current call: its status may be grpc.aio's, not the server's
        self.reopens = 0
        """How many times the stream was opened again after it ended as overloaded or UNAVAILABLE."""
        self._call = method(metadata=metadata, timeout=retry.remaining())

    async def send(self, logits: Any = None, **params: Any) -> None:
        request = stream_request(logits, params)
        if self._closed:
            raise self._cancelled()
        self._pending.append(request)
        try:
            await self._write(request)
        except BaseException:
            self._pending.pop()
            raise

    async def _write(self, request: Any) -> None:
        """Writes `request` on the call; if the server ended the call as overloaded, opens the stream again, which
        writes every pending request, this one too."""
        try:
            await self._call.write(request)
        except grpc.RpcError as err:
            self._write_failed = True
            if not await self._reopened():
                raise error_from_rpc(err, self._request_id) from err
        except asyncio.InvalidStateError:  # the call has ended (a deadline, the server): its status says why
            if not await self._reopened():
                raise TokenSamplerError(await self._call.code(), await self._call.details(), self._request_id) from None
        except asyncio.CancelledError:
            if cancelled_by_caller() or not CAN_TELL_CANCELLER:
                raise
            raise self._cancelled() from None

    async def _reopened(self) -> bool:
        """Whether the ended call was opened again (its status overload, with a retry left); the requests not yet
        answered are then written on the new call. Should that call end at once too, the next read finds why. A
        caller's cancellation during the reopen cancels the new call and ends the stream: a call left without the
        pending requests would answer later requests in their place."""
        if self._closed:
            return False
        try:  # a cancellation while the ended call's status is read ends the stream too: that call stays ended
            code, trailing, details = (await self._call.code(), await self._call.trailing_metadata(),
                                       await self._call.details())
            if (self._write_failed and code == grpc.StatusCode.INTERNAL
                    and details.startswith(_STATUS_LOST_UNDER_A_WRITE)):
                code, trailing = grpc.StatusCode.RESOURCE_EXHAUSTED, ((RETRYABLE_METADATA_KEY, "overload"),)
            delay = _reopens(code, trailing, details, self._retry)
            if delay is None:
                return False
            await asyncio.sleep(delay)
            self.reopens += 1
            self._call = self._method(metadata=self._metadata, timeout=self._retry.remaining())
            self._write_failed = False
            for request in list(self._pending):
                try:
                    await self._call.write(request)
                except (grpc.RpcError, asyncio.InvalidStateError):
                    self._write_failed = True
                    break
        except BaseException:
            self._closed = True
            self._call.cancel()
            raise
        return True

    @property
    def _request_id(self) -> str | None:
        return dict(self._metadata).get("x-request-id")

    async def receive(self) -> SampleResult:
        if not self._pending:
            raise RuntimeError("receive() with no request outstanding")
        if self._closed:
            raise self._cancelled()
        while True:
            try:
                message = await self._call.read()
            except grpc.RpcError as err:
                if await self._reopened():
                    continue
                self._pending.popleft()
                raise error_from_rpc(err, self._request_id) from err
            except asyncio.CancelledError:
                # The stream ends with its receive(), also when the call had already ended and grpc.aio's cancel
                # of it changed nothing: a later receive() would open it again without the caller.
                self._closed = True
                self._call.cancel()
                if cancelled_by_caller() or not CAN_TELL_CANCELLER:
                    raise
                raise self._cancelled() from None
            break
        self._pending.popleft()
        self._retry.answered()
        if message is grpc.aio.EOF:
            raise TokenSamplerError(grpc.StatusCode.UNAVAILABLE, "the stream ended early")
        return result_or_error(message)

    def _cancelled(self) -> TokenSamplerError:
        """The error of a call of the stream once grpc.aio has cancelled it under the caller."""
        return TokenSamplerError(grpc.StatusCode.CANCELLED, "the stream was cancelled: its client was closed, or a "
                                 "receive() of it was cancelled", self._request_id)

    async def sample(self, logits: Any = None, **params: Any) -> SampleResult:
        await self.send(logits, **params)
        return await self.receive()

    async def close(self) -> None:
        self._closed = True
        if self._call.done():
            return
        if self._pending:
            self._call.cancel()
        else:
            await self._call.done_writing()

    async def __aenter__(self) -> AsyncSampleStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
