"""asyncio client of the tokensampler gRPC service (grpc.aio), with the API of SamplerClient."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import grpc

from . import _core
from ._core import Call, ClientCore
from ._proto import sampler_pb2 as pb
from .params import SampleOptions
from .regions import CudaRegion, RegionView, SharedMemoryRegion
from .result import SampleResult
from .stream import AsyncSampleStream, cancelled_by_caller
from .weights import DEFAULT_CHUNK_BYTES, HeadOptions, Progress
from .workloads import DiffusionStepResult, ScoreTokensResult, TopKProbsResult, VerifyDraftResult

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


class AsyncSamplerClient(ClientCore):
    """asyncio client: `async with AsyncSamplerClient(target) as c: await c.sample(logits)`.

    Takes the same arguments as SamplerClient (see there), and each method is SamplerClient's, awaited. Create it
    inside the event loop that uses it.
    """

    _grpc: ClassVar[Any] = grpc.aio

    async def _run(self, call: Call[T]) -> T:
        """Sends `call` and decodes its answer, retrying UNAVAILABLE and overload with backoff within the deadline."""
        with self._attempts(call) as attempt:
            attempt.check_open(self._closed)
            while True:
                try:
                    return call.decode(attempt.answered(await attempt.send(self._stub)))
                except grpc.RpcError as err:
                    delay = attempt.retry_delay(err, self._closed)
                except asyncio.CancelledError:  # grpc.aio cancels the calls of a closed channel this way
                    if self._closed and not cancelled_by_caller():
                        raise attempt.closed() from None
                    raise
                await asyncio.sleep(delay)

    async def sample(
        self, logits: Any, *, timeout: float | None = None, request_id: str | None = None,
        **options: Unpack[SampleOptions],
    ) -> SampleResult:
        """Samples `num_samples` tokens per row of `logits`; arguments as SamplerClient.sample (one `seed` value
        is shared by every row, whose tokens are then correlated: pass B seeds, or None, for independent rows)."""
        return await self._run(_core.sample(logits, timeout=timeout, request_id=request_id, **options))

    async def sample_request(
        self, request: pb.SampleRequest | bytes, *, timeout: float | None = None, request_id: str | None = None
    ) -> SampleResult:
        """As SamplerClient.sample_request: sends a SampleRequest built ahead of time."""
        return await self._run(_core.sample_request(request, timeout=timeout, request_id=request_id))

    async def sample_hidden(self, hidden: Any, weights: str, **params: Any) -> SampleResult:
        """As SamplerClient.sample_hidden: samples from hidden states through the registered LM head `weights`."""
        return await self._run(_core.sample_hidden(hidden, weights, **params))

    async def sample_diffusion_step(
        self, logits: Any, mask: Any, *, timeout: float | None = None, request_id: str | None = None, **params: Any
    ) -> DiffusionStepResult:
        """As SamplerClient.sample_diffusion_step: one denoising step of a diffusion LM."""
        return await self._run(_core.sample_diffusion_step(
            logits, mask, timeout=timeout, request_id=request_id, **params))

    async def sample_diffusion_step_hidden(
        self, hidden: Any, weights: str, mask: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> DiffusionStepResult:
        """As SamplerClient.sample_diffusion_step_hidden: a denoising step from hidden states."""
        return await self._run(_core.sample_diffusion_step(
            None, mask, hidden=hidden, weights=weights, timeout=timeout, request_id=request_id, **params))

    async def topk_probs(
        self, logits: Any, k: int, *, temperature: Any = None, timeout: float | None = None, request_id: str | None = None
    ) -> TopKProbsResult:
        """As SamplerClient.topk_probs: the k most probable ids of softmax(logits / T), sorted."""
        return await self._run(_core.topk_probs(logits, k, temperature, timeout=timeout, request_id=request_id))

    async def topk_probs_hidden(
        self, hidden: Any, weights: str, k: int, *, temperature: Any = None, timeout: float | None = None,
        request_id: str | None = None,
    ) -> TopKProbsResult:
        """As SamplerClient.topk_probs_hidden: topk_probs() from hidden states."""
        return await self._run(_core.topk_probs(
            None, k, temperature, hidden=hidden, weights=weights, timeout=timeout, request_id=request_id))

    async def score_tokens(
        self, logits: Any, token_ids: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> ScoreTokensResult:
        """As SamplerClient.score_tokens: the log-probs of token_ids under logits."""
        return await self._run(_core.score_tokens(logits, token_ids, timeout=timeout, request_id=request_id, **params))

    async def score_tokens_hidden(
        self, hidden: Any, weights: str, token_ids: Any, *, timeout: float | None = None,
        request_id: str | None = None, **params: Any,
    ) -> ScoreTokensResult:
        """As SamplerClient.score_tokens_hidden: score_tokens() from hidden states."""
        return await self._run(_core.score_tokens(
            None, token_ids, hidden=hidden, weights=weights, timeout=timeout, request_id=request_id, **params))

    async def verify_draft(
        self, draft_ids: Any, target_logits: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> VerifyDraftResult:
        """As SamplerClient.verify_draft: speculative decoding's exact rejection sampling of a draft."""
        return await self._run(_core.verify_draft(
            draft_ids, target_logits, timeout=timeout, request_id=request_id, **params))

    async def register_weights(
        self, name: str, weight: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
        timeout: float | None = None, **options: Unpack[HeadOptions],
    ) -> pb.WeightsInfo:
        """As SamplerClient.register_weights: uploads an LM head W [V, D] and registers it as `name`."""
        return await self._run(_core.register_weights(name, weight, chunk_bytes, progress, timeout, options))

    async def register_weights_from_file(
        self, name: str, path: str, tensor: str = "lm_head.weight", *, timeout: float | None = None,
        **options: Unpack[HeadOptions],
    ) -> pb.WeightsInfo:
        """As SamplerClient.register_weights_from_file: registers `tensor` of a safetensors file of the server's."""
        return await self._run(_core.register_weights_from_file(name, path, tensor, timeout, options))

    async def register_weights_from_region(
        self, name: str, weight: RegionView, *, timeout: float | None = None, **options: Unpack[HeadOptions]
    ) -> pb.WeightsInfo:
        """As SamplerClient.register_weights_from_region: registers the LM head W [V, D] where it lies in a region."""
        return await self._run(_core.register_weights_from_region(name, weight, timeout, options))

    async def list_weights(self, *, timeout: float | None = None) -> list[pb.WeightsInfo]:
        """The registered weights."""
        return await self._run(_core.list_weights(timeout))

    async def unregister_weights(self, name: str, *, timeout: float | None = None) -> pb.WeightsInfo:
        """Unregisters `name` once the requests using it have finished."""
        return await self._run(_core.unregister_weights(name, timeout))

    def stream(self, *, timeout: float | None = None, request_id: str | None = None) -> AsyncSampleStream:
        """Opens a SampleStream for a decode loop (see stream.py):
        `async with client.stream() as s: await s.sample(logits)`; `timeout` as for SamplerClient.stream."""
        return AsyncSampleStream(self._stub.SampleStream, self._stream_metadata(request_id),
                                 self._stream_retry(timeout))

    async def register_shm_region(self, name: str, byte_size: int, *, timeout: float | None = None) -> SharedMemoryRegion:
        """As SamplerClient.register_shm_region: a POSIX shared-memory segment registered as `name`."""
        return await self._run(_core.register_shm_region(name, byte_size, timeout))

    async def register_cuda_region(
        self, name: str, tensor: Any, *, ready_event: bool = False, timeout: float | None = None
    ) -> CudaRegion:
        """As SamplerClient.register_cuda_region: the CUDA allocation under `tensor`, shared by IPC handle."""
        return await self._run(_core.register_cuda_region(name, tensor, ready_event, timeout))

    async def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        return await self._run(_core.list_regions(timeout))

    async def unregister_region(self, region: str | SharedMemoryRegion | CudaRegion, *, timeout: float | None = None) -> pb.RegionInfo:
        """Unregisters a region once no request uses it; a region object is then released too."""
        return await self._run(_core.unregister_region(region, timeout))

    async def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        """The server's version, backend, device, limits, logits dtypes and features."""
        return await self._run(_core.server_info(timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" = the whole server): "SERVING" or "NOT_SERVING"."""
        return await self._run(_core.health(service, timeout))

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled (TokenSamplerError CANCELLED)."""
        self._closed = True
        await self._channel.close()

    async def __aenter__(self) -> AsyncSamplerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
