"""An unexpected backend error becomes INTERNAL with the request id, and the server keeps serving; an answer counts in
the requests' budget until it is delivered."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.backends.base import Backend, BackendInfo
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.core.budget import ByteBudget
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.rpc.call_guard import CallGuard
from tokensampler_server.model.sampling import SamplingBatch, SamplingResult
from tokensampler_server.rpc.service import SamplerService


class FailsOnWideRows(Backend):
    """The CPU backend, except that a batch with V > 100 raises a bug-like error."""

    def info(self) -> BackendInfo:
        return BackendInfo(name="cpu", device="cpu")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        if batch.vocab_size > 100:
            raise RuntimeError("simulated bug")
        return CpuBackend().sample(batch)


def _request(vocab_size: int) -> pb.SampleRequest:
    request = pb.SampleRequest()
    encode_tensor(torch.randn(2, vocab_size), out=request.logits)
    return request


def test_unexpected_errors_become_internal_with_the_request_id(caplog) -> None:
    async def run() -> tuple[grpc.aio.AioRpcError, pb.SampleResponse]:
        server = grpc.aio.server()
        service = SamplerService(FailsOnWideRows(), Limits())
        pb_grpc.add_SamplerServicer_to_server(service, CallGuard().registration(server))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SamplerStub(channel)
                try:
                    await stub.Sample(_request(101), metadata=(("x-request-id", "req-42"),))
                except grpc.aio.AioRpcError as err:
                    failure = err
                ok = await stub.Sample(_request(8))
        finally:
            await server.stop(None)
            await service.close()
        return failure, ok

    failure, ok = asyncio.run(run())
    assert failure.code() == grpc.StatusCode.INTERNAL
    assert "req-42" in failure.details() and "simulated bug" not in failure.details()
    assert any("req-42" in record.getMessage() and record.exc_info for record in caplog.records)
    assert len(ok.valid) == 2 and ok.request_id


class _Context:
    """The part of a grpc.aio.ServicerContext a guarded unary call uses, with its done callbacks run by the test."""

    def __init__(self) -> None:
        self.done_callbacks: list = []

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, metadata: tuple) -> None:
        pass

    def add_done_callback(self, callback) -> None:
        self.done_callbacks.append(callback)


def test_an_answer_counts_in_the_requests_budget_until_the_call_ends() -> None:
    """A unary call's answer is held by the server until grpc has delivered it: the requests' budget counts it from
    the handler's return to the call's end, so that callers who never read their answers are refused past it."""
    budget = ByteBudget(1000, "request", "requests", "--max-queue-mb")
    answer = pb.TopKProbsResponse(request_id="x" * 600)

    async def handler(request: object, context: object) -> pb.TopKProbsResponse:
        return answer

    guard = CallGuard(request_bytes=budget)
    method = guard.guard(grpc.unary_unary_rpc_method_handler(handler), "tokensampler.v1.Sampler/TopKProbs")
    context = _Context()
    assert asyncio.run(method.unary_unary(pb.TopKProbsRequest(k=1).SerializeToString(), context)) is answer
    assert budget.held == answer.ByteSize()
    with pytest.raises(ServiceError):  # 600 bytes held by an answer not delivered: the next 500 do not fit
        budget.take(500)
    for callback in context.done_callbacks:
        callback(context)
    assert budget.held == 0


def test_a_stream_message_is_counted_before_grpc_parses_it() -> None:
    """grpc parses stream messages (RegisterWeights' chunks, Colocate's) on the event loop as it reads them: their
    repeated values are counted first, and a message past the limits is the call's error, not an expanded parse."""
    from tokensampler_server.rpc.call_guard import _Unparsable
    from tokensampler_server.rpc.parsing import COUNTED_FROM_BYTES

    guard = CallGuard()
    chunk = pb.RegisterWeightsChunk(shape=[1] * 9, data=b"\0" * COUNTED_FROM_BYTES).SerializeToString()
    refused = guard._stream_parse(pb.RegisterWeightsChunk.FromString, chunk)
    assert isinstance(refused, _Unparsable) and refused.error.field == "shape"
    fine = pb.RegisterWeightsChunk(shape=[4, 2], data=b"\0" * COUNTED_FROM_BYTES).SerializeToString()
    assert list(guard._stream_parse(pb.RegisterWeightsChunk.FromString, fine).shape) == [4, 2]
