"""The Sampler gRPC servicer: decode and validate, run the backend off the event loop, encode.

Every RPC of the contract is one method here; validation lives in validation.py / validation_ops.py,
sampling in the batcher and the backends, the torch references of the other workloads in ops/.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor

from . import __version__
from .backends import Backend
from .batcher import DynamicBatcher
from .call_record import CallRecord, current_call
from .config import Limits
from .errors import InvalidArgument, failure_status
from .metrics import ServerMetrics
from .ops.diffusion import diffusion_step
from .ops.topk_probs import topk_probs
from .ops.verify import verify_draft
from .regions import Region, RegionRegistry, region_info
from .request_context import current_request_id, request_id_from_metadata
from .sampling import SamplingResult
from .validation import LOGITS_DTYPES, validate_sample_request
from .validation_ops import validate_diffusion_request, validate_topk_request, validate_verify_request
from .weights import WEIGHT_DTYPES, RegisteredWeight, WeightRegistry, load_safetensors, resolve_weights_path, sha256_hex
from .weights_rpc import finish_from_options, read_upload, weights_info

API_VERSION = "tokensampler.v1"
STREAM_METHOD = "tokensampler.v1.Sampler/SampleStream"
# Messages of one stream sampled at once; past that, reading the stream waits (flow control).
STREAM_MESSAGES_IN_FLIGHT = 64
FEATURES = (
    "logits", "hidden_states", "weights_upload", "weights_from_file", "logprobs", "top_logprobs", "penalties",
    "logit_bias", "token_masks", "num_samples", "dynamic_batching", "sample_stream", "regions", "diffusion_step",
    "topk_probs", "verify_draft",
)


def _input_ref(request: pb.SampleRequest) -> tuple[pb.TensorRef | None, str]:
    """The region reference holding the request's input tensor, if any, and its field name."""
    if request.WhichOneof("input") == "logits_ref":
        return request.logits_ref, "logits_ref"
    if request.WhichOneof("input") == "hidden" and request.hidden.HasField("states_ref"):
        return request.hidden.states_ref, "hidden.states_ref"
    return None, ""


def _output_refs(request: pb.SampleRequest) -> list[tuple[str, pb.TensorRef]]:
    if not request.HasField("output"):
        return []
    return [(name, getattr(request.output, name)) for name in ("tokens", "logprobs") if request.output.HasField(name)]


def _output_tensor(
    region: Region, ref: pb.TensorRef, name: str, shape: tuple[int, int], return_logprobs: bool
) -> torch.Tensor:
    """Where output `name` ("tokens": int32, "logprobs": float32) of shape [B, num_samples] goes."""
    field = f"output.{name}"
    if name == "logprobs" and not return_logprobs:
        raise InvalidArgument(field, "set without return_logprobs; expected return_logprobs = true")
    target = region.tensor(ref, field, (pb.DTYPE_INT32,) if name == "tokens" else (pb.DTYPE_FLOAT32,))
    if tuple(target.shape) != shape:
        raise InvalidArgument(f"{field}.shape", f"got {list(target.shape)}, expected [B, num_samples] = {list(shape)}")
    return target


def _set_timings(timings: pb.Timings, arrived: int, started: int) -> None:
    """Timings of a request run with run_exclusive: no queue of its own, compute from `started`."""
    finished = time.perf_counter_ns()
    timings.compute_ns = finished - started
    timings.total_ns = finished - arrived


def encode_result(result: SamplingResult, seeds: np.ndarray) -> pb.SampleResponse:
    """Builds the response message of one sampled batch; tokens or log-probs set to None stay out."""
    response = pb.SampleResponse()
    if result.tokens is not None:
        encode_tensor(result.tokens.to(torch.int32), out=response.tokens)
    response.seeds.extend(seeds.tolist())
    response.valid.extend(result.valid.tolist())
    response.nan_detected.extend(result.nan_detected.tolist())
    if result.logprobs is not None:
        encode_tensor(result.logprobs, out=response.logprobs)
    if result.top_logprob_ids is not None:
        encode_tensor(result.top_logprob_ids.to(torch.int32), out=response.top_logprob_ids)
        encode_tensor(result.top_logprobs, out=response.top_logprobs)
    return response


class SamplerService(pb_grpc.SamplerServicer):
    """Serves tokensampler.v1.Sampler with one backend, under ErrorInterceptor (which opens each call's record).

    Sample requests are validated on the event loop and sampled by the DynamicBatcher, which merges
    concurrent ones into single backend calls on its worker thread.
    """

    def __init__(
        self,
        backend: Backend,
        limits: Limits,
        *,
        batcher: DynamicBatcher | None = None,
        registry: WeightRegistry | None = None,
        weights_dir: Path | None = None,
        regions: RegionRegistry | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self._backend = backend
        self._limits = limits
        self._batcher = batcher or DynamicBatcher(backend, max_batch_rows=limits.max_batch_rows)
        self._registry = registry or WeightRegistry(backend.device)
        self._weights_dir = weights_dir
        self._regions = regions or RegionRegistry()
        self._metrics = metrics

    @property
    def queue_depth(self) -> int:
        """Validated requests waiting for the backend."""
        return self._batcher.queued_requests

    @property
    def registry(self) -> WeightRegistry:
        return self._registry

    @property
    def regions(self) -> RegionRegistry:
        return self._regions

    async def close(self) -> None:
        await self._batcher.close()

    async def Sample(self, request: pb.SampleRequest, context: grpc.aio.ServicerContext) -> pb.SampleResponse:
        # Weights and regions the request names are held until its response is built.
        with ExitStack() as held:
            lm_head = None
            if request.WhichOneof("input") == "hidden":
                lm_head = held.enter_context(self._registry.use(request.hidden.weights))
            referenced = None
            ref, field = _input_ref(request)
            if ref is not None:
                region = held.enter_context(self._regions.use(ref.region, f"{field}.region"))
                referenced = region.tensor(ref, field, LOGITS_DTYPES)
            outputs = {
                name: (held.enter_context(self._regions.use(out.region, f"output.{name}.region")), out)
                for name, out in _output_refs(request)
            }
            return await self._sample(request, lm_head, referenced, outputs)

    async def SampleStream(
        self, request_iterator: AsyncIterator[pb.SampleRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SampleStreamResponse]:
        """Samples each message as it arrives (so the batcher can merge them) and answers in order."""
        stream_id = request_id_from_metadata(context.invocation_metadata())
        answers: asyncio.Queue[asyncio.Future | None] = asyncio.Queue(maxsize=STREAM_MESSAGES_IN_FLIGHT)

        async def read() -> None:
            try:
                index = 0
                async for request in request_iterator:
                    record = CallRecord(method=STREAM_METHOD, request_id=f"{stream_id}.{index}")
                    await answers.put(asyncio.ensure_future(self._stream_message(request, record)))
                    index += 1
            finally:
                await answers.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
            await reader
        finally:
            reader.cancel()

    async def _stream_message(self, request: pb.SampleRequest, record: CallRecord) -> pb.SampleStreamResponse:
        """One stream message, reported like a unary call; a failure becomes an error message."""
        record.start()
        current_request_id.set(record.request_id)
        current_call.set(record)
        code, error = grpc.StatusCode.OK, ""
        try:
            return pb.SampleStreamResponse(response=await self.Sample(request, None))
        except Exception as err:
            code, error = failure_status(err, record.method, record.request_id)
        finally:
            if self._metrics is not None:
                self._metrics.observe_call(record, code, record.elapsed_ns())
        message = f"{error} (request id {record.request_id})"
        return pb.SampleStreamResponse(error=pb.StreamError(code=code.value[0], message=message, request_id=record.request_id))

    async def _sample(
        self,
        request: pb.SampleRequest,
        lm_head: RegisteredWeight | None,
        referenced: torch.Tensor | None,
        outputs: dict[str, tuple[Region, pb.TensorRef]],
    ) -> pb.SampleResponse:
        call = current_call.get()
        arrived = time.perf_counter_ns()
        batch, seeds = validate_sample_request(request, self._limits, lm_head=lm_head, referenced=referenced)
        targets = {
            name: _output_tensor(region, ref, name, (batch.num_rows, batch.num_samples), request.return_logprobs)
            for name, (region, ref) in outputs.items()
        }
        submitted = time.perf_counter_ns()
        call.batch, call.decode_ns = batch, submitted - arrived
        result, times = await self._batcher.submit(batch)
        finished = time.perf_counter_ns()
        call.queue_ns, call.compute_ns = times.queue_ns, times.compute_ns
        if "tokens" in targets:
            targets["tokens"].copy_(result.tokens)
            result = replace(result, tokens=None)
        if "logprobs" in targets:
            targets["logprobs"].copy_(result.logprobs)
            result = replace(result, logprobs=None)
        response = encode_result(result, seeds)
        response.request_id = call.request_id
        response.timings.queue_ns = call.queue_ns
        response.timings.compute_ns = call.compute_ns
        encoded = time.perf_counter_ns()
        call.encode_ns = encoded - finished
        response.timings.total_ns = encoded - arrived
        return response

    async def SampleDiffusionStep(
        self, request: pb.DiffusionStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.DiffusionStepResponse:
        arrived = time.perf_counter_ns()
        # The torch references run on the CPU (the backend samples the masked positions on its own
        # device); CUDA kernels for these workloads are still to come.
        step, seeds = validate_diffusion_request(request, self._limits)
        started = time.perf_counter_ns()
        tokens, confidences, mask = await self._batcher.run_exclusive(lambda: diffusion_step(step, self._backend))
        response = pb.DiffusionStepResponse(request_id=current_call.get().request_id)
        encode_tensor(tokens.to(torch.int32).cpu(), out=response.tokens)
        encode_tensor(confidences.cpu(), out=response.confidences)
        encode_tensor(mask.to(torch.uint8).cpu(), out=response.mask)
        response.seeds.extend(seeds.tolist())
        _set_timings(response.timings, arrived, started)
        return response

    async def TopKProbs(self, request: pb.TopKProbsRequest, context: grpc.aio.ServicerContext) -> pb.TopKProbsResponse:
        arrived = time.perf_counter_ns()
        logits, temperature, k = validate_topk_request(request, self._limits)
        started = time.perf_counter_ns()
        probs, ids = await self._batcher.run_exclusive(lambda: topk_probs(logits, temperature, k))
        shape = [*request.logits.shape[:-1], k]
        response = pb.TopKProbsResponse(request_id=current_call.get().request_id)
        encode_tensor(probs.cpu().reshape(shape), out=response.probs)
        encode_tensor(ids.to(torch.int32).cpu().reshape(shape), out=response.ids)
        _set_timings(response.timings, arrived, started)
        return response

    async def VerifyDraft(self, request: pb.VerifyDraftRequest, context: grpc.aio.ServicerContext) -> pb.VerifyDraftResponse:
        arrived = time.perf_counter_ns()
        verification, seeds = validate_verify_request(request, self._limits)
        started = time.perf_counter_ns()
        accepted, tokens = await self._batcher.run_exclusive(lambda: verify_draft(verification))
        response = pb.VerifyDraftResponse(request_id=current_call.get().request_id)
        encode_tensor(accepted.to(torch.int32).cpu(), out=response.accepted)
        encode_tensor(tokens.to(torch.int32).cpu(), out=response.tokens)
        response.seeds.extend(seeds.tolist())
        _set_timings(response.timings, arrived, started)
        return response

    async def RegisterWeights(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.WeightsInfo:
        upload = await read_upload(request_iterator, self._limits.max_weight_bytes)
        return weights_info(self._registry.register(upload.name, upload.weight, upload.finish, upload.sha256))

    async def RegisterWeightsFromFile(
        self, request: pb.RegisterWeightsFromFileRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightsInfo:
        path = resolve_weights_path(self._weights_dir, request.path)
        loop = asyncio.get_running_loop()
        weight = await loop.run_in_executor(None, load_safetensors, path, request.tensor)
        if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES:
            raise InvalidArgument("tensor", f"{request.tensor!r} is {weight.dtype} {list(weight.shape)}, expected a [V, D] float tensor")
        if weight.numel() * weight.element_size() > self._limits.max_weight_bytes:
            raise InvalidArgument("tensor", f"{request.tensor!r} is larger than {self._limits.max_weight_bytes} bytes")
        finish = finish_from_options(request.options, int(weight.shape[0]))
        entry = self._registry.register(request.name, weight, finish, sha256_hex(weight))
        return weights_info(entry)

    async def ListWeights(self, request: pb.ListWeightsRequest, context: grpc.aio.ServicerContext) -> pb.ListWeightsResponse:
        registry = self._registry
        return pb.ListWeightsResponse(weights=[weights_info(entry, registry.in_flight(entry)) for entry in registry.list()])

    async def UnregisterWeights(
        self, request: pb.UnregisterWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterWeightsResponse:
        return pb.UnregisterWeightsResponse(weights=weights_info(await self._registry.unregister(request.name)))

    async def RegisterRegion(self, request: pb.RegisterRegionRequest, context: grpc.aio.ServicerContext) -> pb.RegionInfo:
        return region_info(self._regions.register(request))

    async def ListRegions(self, request: pb.ListRegionsRequest, context: grpc.aio.ServicerContext) -> pb.ListRegionsResponse:
        regions = self._regions
        return pb.ListRegionsResponse(regions=[region_info(r, regions.in_flight(r)) for r in regions.list()])

    async def UnregisterRegion(
        self, request: pb.UnregisterRegionRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterRegionResponse:
        return pb.UnregisterRegionResponse(region=region_info(await self._regions.unregister(request.name)))

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        info = self._backend.info()
        device = self._backend.device
        on_gpu = device.type == "cuda"
        return pb.ServerInfo(
            version=__version__,
            backend=info.name,
            device=info.device,
            limits=pb.Limits(
                max_batch_rows=self._limits.max_batch_rows,
                max_message_bytes=self._limits.max_message_bytes,
                max_num_samples=self._limits.max_num_samples,
                max_top_logprobs=self._limits.max_top_logprobs,
                max_weight_bytes=self._limits.max_weight_bytes,
                max_batch_elements=self._limits.max_batch_elements,
            ),
            logits_dtypes=LOGITS_DTYPES,
            features=FEATURES,
            kernels=info.kernels,
            api_version=API_VERSION,
            registered_weights=len(self._registry.list()),
            registered_weights_bytes=self._registry.total_bytes,
            device_memory_allocated_bytes=torch.cuda.memory_allocated(device) if on_gpu else 0,
            device_memory_reserved_bytes=torch.cuda.memory_reserved(device) if on_gpu else 0,
        )
