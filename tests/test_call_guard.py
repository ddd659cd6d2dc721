"""An unexpected backend error becomes INTERNAL with the request id, and the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.backends.base import Backend, BackendInfo
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
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
