"""asyncio client of the tokensampler gRPC service (grpc.aio), with the API of SamplerClient."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from ._channel import (
    PemSource,
    call_metadata,
    channel_credentials,
    channel_options,
    channel_target,
    check_auth_token,
    health_request,
    health_status_name,
    new_request_id,
)
from ._proto import sampler_pb2 as pb
from ._proto import sampler_pb2_grpc
from ._retry import Backoff, CallPolicy
from .errors import error_from_rpc
from .params import SampleOptions, build_sample_request, serialize_sample_request
from .regions import CudaRegion, RegionView, SharedMemoryRegion
from .result import SampleResult
from .workloads import (
    DiffusionStepResult,
    ScoreTokensResult,
    TopKProbsResult,
    VerifyDraftResult,
    build_diffusion_request,
    build_score_request,
    build_topk_request,
    build_verify_request,
)
from .stream import AsyncSampleStream
from .weights import DEFAULT_CHUNK_BYTES, Progress, WeightUpload, region_weights_request, weight_options
from .wire import sample_methods

if TYPE_CHECKING:
    from typing_extensions import Unpack

Response = TypeVar("Response")


class AsyncSamplerClient:
    """asyncio client: `async with AsyncSamplerClient(target) as c: await c.sample(logits)`.

    Takes the same arguments as SamplerClient (see there). Create it inside the event loop that uses it.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = None,
        retries: int = 3,
        backoff: Backoff | None = None,
        max_message_mb: int = 256,
        options: Sequence[tuple[str, Any]] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        auth_token: str | None = None,
    ) -> None:
        self._policy = CallPolicy(timeout, retries, backoff or Backoff())
        self._auth_token = check_auth_token(auth_token)
        channel_args = channel_options(max_message_mb, options)
        credentials = channel_credentials(credentials, tls_ca, tls_cert, tls_key)
        target = channel_target(target)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=channel_args)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=channel_args)
        self._stub = sampler_pb2_grpc.SamplerStub(self._channel)
        self._sample, self._sample_stream = sample_methods(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def _call(
        self,
        method: Callable[..., Awaitable[Response]],
        request: Any,
        timeout: float | None,
        request_id: str | None,
        idempotent: bool = False,
    ) -> Response:
        """Awaits `method`, retrying UNAVAILABLE and overload with backoff within the deadline (see _retry.py)."""
        request_id = request_id or new_request_id()
        metadata = call_metadata(request_id, self._auth_token)
        state = self._policy.start(timeout)
        while True:
            try:
                return await method(request, timeout=state.remaining(), metadata=metadata)
            except grpc.RpcError as err:
                delay = state.next_delay(err.code(), err.trailing_metadata(), idempotent, err.details())  # type: ignore[attr-defined]
                if delay is None:
                    raise error_from_rpc(err, request_id) from err
            await asyncio.sleep(delay)

    async def sample(
        self, logits: Any, *, timeout: float | None = None, request_id: str | None = None,
        **options: Unpack[SampleOptions],
    ) -> SampleResult:
        """Samples `num_samples` tokens per row of `logits`; arguments as SamplerClient.sample (one `seed` value
        is shared by every row, whose tokens are then correlated: pass B seeds, or None, for independent rows)."""
        request = serialize_sample_request(logits, **options)
        return await self.sample_request(request, timeout=timeout, request_id=request_id)

    async def sample_request(
        self, request: pb.SampleRequest | bytes, *, timeout: float | None = None, request_id: str | None = None
    ) -> SampleResult:
        """Sends a SampleRequest built ahead of time (params.build_sample_request, or its bytes from
        params.serialize_sample_request) and decodes the answer."""
        response = await self._call(self._sample, request, timeout, request_id, idempotent=True)
        return SampleResult.from_response(response)

    async def sample_hidden(self, hidden: Any, weights: str, **params: Any) -> SampleResult:
        """Samples from hidden states [B, D] (or [D]) through the registered LM head `weights`.

        Takes every keyword of sample(), timeout and request_id included; the server computes the
        logits (docs/semantics.md: x = W·h, then the weight's bias, scale and soft cap).
        """
        timeout, request_id = params.pop("timeout", None), params.pop("request_id", None)
        request = build_sample_request(hidden=hidden, weights=weights, **params)
        return await self.sample_request(request, timeout=timeout, request_id=request_id)

    async def sample_diffusion_step(
        self, logits: Any, mask: Any, *, timeout: float | None = None, request_id: str | None = None, **params: Any
    ) -> DiffusionStepResult:
        """One denoising step of a diffusion LM: logits [B, L, V], mask [B, L] of undecided positions;
        keywords: confidence_threshold, commit_count and sample()'s per-row sampling parameters."""
        request = build_diffusion_request(logits, mask, **params)
        return DiffusionStepResult.from_response(await self._call(self._stub.SampleDiffusionStep, request, timeout, request_id))

    async def sample_diffusion_step_hidden(
        self, hidden: Any, weights: str, mask: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> DiffusionStepResult:
        """sample_diffusion_step() of the logits that the registered LM head `weights` makes of hidden
        states [B, L, D] (computed by the server, as for sample_hidden()); the same keywords."""
        request = build_diffusion_request(None, mask, hidden=hidden, weights=weights, **params)
        return DiffusionStepResult.from_response(await self._call(self._stub.SampleDiffusionStep, request, timeout, request_id))

    async def topk_probs(
        self, logits: Any, k: int, *, temperature: Any = None, timeout: float | None = None, request_id: str | None = None
    ) -> TopKProbsResult:
        """The k most probable ids of softmax(logits / T) for logits [B, S, V] or [B, V], sorted."""
        request = build_topk_request(logits, k, temperature)
        return TopKProbsResult.from_response(await self._call(self._stub.TopKProbs, request, timeout, request_id))

    async def topk_probs_hidden(
        self, hidden: Any, weights: str, k: int, *, temperature: Any = None, timeout: float | None = None,
        request_id: str | None = None,
    ) -> TopKProbsResult:
        """topk_probs() of the logits that the registered LM head `weights` makes of hidden states
        [B, S, D] or [B, D] (computed by the server, as for sample_hidden())."""
        request = build_topk_request(None, k, temperature, hidden=hidden, weights=weights)
        return TopKProbsResult.from_response(await self._call(self._stub.TopKProbs, request, timeout, request_id))

    async def score_tokens(
        self, logits: Any, token_ids: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> ScoreTokensResult:
        """The log-probs of token_ids [B, T] under logits [B, T, V] (docs/semantics.md, choice 18); keywords:
        mode ("raw" or "processed"), temperature, top_k, top_p, min_p (per row, PROCESSED), top_logprobs,
        return_entropy."""
        request = build_score_request(logits, token_ids, **params)
        return ScoreTokensResult.from_response(await self._call(self._stub.ScoreTokens, request, timeout, request_id))

    async def score_tokens_hidden(
        self, hidden: Any, weights: str, token_ids: Any, *, timeout: float | None = None,
        request_id: str | None = None, **params: Any,
    ) -> ScoreTokensResult:
        """score_tokens() under the logits that the registered LM head `weights` makes of hidden states
        [B, T, D]: the server walks the vocabulary in slices, never holding the [B·T, V] logits."""
        request = build_score_request(None, token_ids, hidden=hidden, weights=weights, **params)
        return ScoreTokensResult.from_response(await self._call(self._stub.ScoreTokens, request, timeout, request_id))

    async def verify_draft(
        self, draft_ids: Any, target_logits: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> VerifyDraftResult:
        """Speculative decoding: accepts a prefix of draft_ids [B, n] against target_logits [B, n + 1, V]
        by exact rejection sampling; keywords: draft_probs or draft_logits [B, n, V], and the target's
        per-row sampling parameters (position = the position of draft token 0)."""
        request = build_verify_request(draft_ids, target_logits, **params)
        return VerifyDraftResult.from_response(await self._call(self._stub.VerifyDraft, request, timeout, request_id))

    async def register_weights(
        self,
        name: str,
        weight: Any,
        *,
        vocab_size: int | None = None,
        bias: Any = None,
        soft_cap: float | None = None,
        logit_scale: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> pb.WeightsInfo:
        """Uploads an LM head W [V, D] (float32/bfloat16/float16) in chunks and registers it as `name`.

        progress(bytes_sent, total) is called after each chunk. The server uses the weight only once
        every byte arrived and the SHA-256 matches. Options: see weights.weight_options.
        """
        options = weight_options(vocab_size=vocab_size, bias=bias, soft_cap=soft_cap, logit_scale=logit_scale)
        upload = WeightUpload(name, weight, options, chunk_bytes, progress)
        # A fresh iterator of the chunks for every attempt: a retry re-sends the whole upload.
        def send(chunks: WeightUpload, **kwargs: Any) -> Any:
            return self._stub.RegisterWeights(iter(chunks), **kwargs)

        return await self._call(send, upload, timeout, None)

    async def register_weights_from_file(
        self,
        name: str,
        path: str,
        tensor: str = "lm_head.weight",
        *,
        vocab_size: int | None = None,
        bias: Any = None,
        soft_cap: float | None = None,
        logit_scale: float | None = None,
        timeout: float | None = None,
    ) -> pb.WeightsInfo:
        """Registers `tensor` of the safetensors file `path` (relative to the server's --weights-dir)."""
        options = weight_options(vocab_size=vocab_size, bias=bias, soft_cap=soft_cap, logit_scale=logit_scale)
        request = pb.RegisterWeightsFromFileRequest(name=name, path=path, tensor=tensor, options=options)
        return await self._call(self._stub.RegisterWeightsFromFile, request, timeout, None)

    async def register_weights_from_region(
        self,
        name: str,
        weight: RegionView,
        *,
        vocab_size: int | None = None,
        bias: Any = None,
        soft_cap: float | None = None,
        logit_scale: float | None = None,
        timeout: float | None = None,
    ) -> pb.WeightsInfo:
        """Registers the LM head W [V, D] that lies in a registered region, in place: the engine's own weight,
        `client.register_cuda_region("lm_head", w)` then `register_weights_from_region("lm_head", region.view_of(w))`.
        Keep W alive and unchanged until the weight is unregistered; the region cannot be unregistered before."""
        options = weight_options(vocab_size=vocab_size, bias=bias, soft_cap=soft_cap, logit_scale=logit_scale)
        request = region_weights_request(name, weight, options)
        return await self._call(self._stub.RegisterWeightsFromRegion, request, timeout, None)

    async def list_weights(self, *, timeout: float | None = None) -> list[pb.WeightsInfo]:
        """The registered weights."""
        return list((await self._call(self._stub.ListWeights, pb.ListWeightsRequest(), timeout, None)).weights)

    async def unregister_weights(self, name: str, *, timeout: float | None = None) -> pb.WeightsInfo:
        """Unregisters `name` once the requests using it have finished."""
        request = pb.UnregisterWeightsRequest(name=name)
        return (await self._call(self._stub.UnregisterWeights, request, timeout, None)).weights

    def stream(self, *, timeout: float | None = None, request_id: str | None = None) -> AsyncSampleStream:
        """Opens a SampleStream for a decode loop (see stream.py): `with client.stream() as s: s.sample(logits)`.

        `timeout` bounds the whole stream (default: none); UNAVAILABLE is not retried inside it.
        """
        metadata = call_metadata(request_id or new_request_id(), self._auth_token)
        return AsyncSampleStream(self._sample_stream, metadata, timeout)

    async def register_shm_region(self, name: str, byte_size: int, *, timeout: float | None = None) -> SharedMemoryRegion:
        """Creates a POSIX shared-memory segment of byte_size bytes and registers it as `name`
        (the server needs --allow-shm and the same machine). Write tensors into region.tensor(...)."""
        region = SharedMemoryRegion(name, byte_size)
        try:
            await self._call(self._stub.RegisterRegion, region.request, timeout, None)
        except BaseException:
            region.release()
            raise
        return region

    async def register_cuda_region(
        self, name: str, tensor: Any, *, ready_event: bool = False, timeout: float | None = None
    ) -> CudaRegion:
        """Shares the CUDA allocation under `tensor` with the server by IPC handle, as `name` (the server
        needs --allow-cuda-ipc and the same machine). Keep the tensor alive while it is registered and
        synchronise its stream before each request that reads it, or, with ready_event=True, call
        region.mark_ready() after writing: the server's GPU work then waits for the writes, the host does not."""
        region = CudaRegion(name, tensor, ready_event)
        await self._call(self._stub.RegisterRegion, region.request, timeout, None)
        return region

    async def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        return list((await self._call(self._stub.ListRegions, pb.ListRegionsRequest(), timeout, None)).regions)

    async def unregister_region(self, region: str | SharedMemoryRegion | CudaRegion, *, timeout: float | None = None) -> pb.RegionInfo:
        """Unregisters a region once no request uses it; a region object is then released too."""
        name = region if isinstance(region, str) else region.name
        info = (await self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name), timeout, None)).region
        if not isinstance(region, str):
            region.release()
        return info

    async def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        """The server's version, backend, device, limits, logits dtypes and features."""
        return await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout, None)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" = the whole server): "SERVING" or "NOT_SERVING"."""
        return health_status_name(await self._call(self._health.Check, health_request(service), timeout, None))

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncSamplerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
