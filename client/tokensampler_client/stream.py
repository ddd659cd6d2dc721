"""SampleStream sessions for decode loops: one bidirectional call, one message per step.

Responses come back in request order, so `receive()` returns the result of the oldest request not yet
received. `sample()` is send + receive; `send()` several times first to pipeline steps. A request the
server rejects raises TokenSamplerError from `receive()` and the stream stays usable.
"""

from __future__ import annotations

import asyncio

import queue
from typing import Any

import grpc

from ._proto import sampler_pb2 as pb
from .errors import TokenSamplerError, error_from_rpc
from .params import serialize_sample_request
from .result import SampleResult

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
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


class SampleStream:
    """A blocking SampleStream call; use `SamplerClient.stream()` to open one."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...], timeout: float | None) -> None:
        """`method`: the channel's SampleStream (wire.sample_methods)."""
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(iter(self._requests.get, _END), metadata=metadata, timeout=timeout)
        self._metadata = metadata
        self._outstanding = 0

    def send(self, logits: Any = None, **params: Any) -> None:
        """Queues one request: logits [B, V] (or hidden=..., weights=...) with sample()'s keywords,
        or a prebuilt SampleRequest or its bytes."""
        self._requests.put(stream_request(logits, params))
        self._outstanding += 1

    def receive(self) -> SampleResult:
        """The result of the oldest request sent and not yet received."""
        if not self._outstanding:
            raise RuntimeError("receive() with no request outstanding")
        self._outstanding -= 1
        try:
            message = next(self._call)
        except grpc.RpcError as err:
            raise error_from_rpc(err, dict(self._metadata).get("x-request-id")) from err
        return result_or_error(message)

    def sample(self, logits: Any = None, **params: Any) -> SampleResult:
        self.send(logits, **params)
        return self.receive()

    def close(self) -> None:
        """Ends the stream; results not yet received are dropped."""
        self._requests.put(_END)
        if self._outstanding:
            self._call.cancel()

    def __enter__(self) -> SampleStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSampleStream:
    """An asyncio SampleStream call; use `AsyncSamplerClient.stream()` to open one. Cancelling a receive() (its
    task, or asyncio.wait_for's timeout) cancels the whole call, as grpc.aio does: later calls of the stream raise
    TokenSamplerError CANCELLED, as they do once its client is closed."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...], timeout: float | None) -> None:
        self._call = method(metadata=metadata, timeout=timeout)
        self._metadata = metadata
        self._outstanding = 0

    async def send(self, logits: Any = None, **params: Any) -> None:
        request = stream_request(logits, params)
        try:
            await self._call.write(request)
        except grpc.RpcError as err:
            raise error_from_rpc(err, self._request_id) from err
        except asyncio.InvalidStateError:  # the call has ended (a deadline, the server): its status says why
            raise TokenSamplerError(await self._call.code(), await self._call.details(), self._request_id) from None
        except asyncio.CancelledError:
            if cancelled_by_caller() or not CAN_TELL_CANCELLER:
                raise
            raise self._cancelled() from None
        self._outstanding += 1

    @property
    def _request_id(self) -> str | None:
        return dict(self._metadata).get("x-request-id")

    async def receive(self) -> SampleResult:
        if not self._outstanding:
            raise RuntimeError("receive() with no request outstanding")
        self._outstanding -= 1
        try:
            message = await self._call.read()
        except grpc.RpcError as err:
            raise error_from_rpc(err, self._request_id) from err
        except asyncio.CancelledError:
            if cancelled_by_caller() or not CAN_TELL_CANCELLER:
                raise
            raise self._cancelled() from None
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
        if self._call.done():
            return
        if self._outstanding:
            self._call.cancel()
        else:
            await self._call.done_writing()

    async def __aenter__(self) -> AsyncSampleStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
