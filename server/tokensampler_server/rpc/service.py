"""The Sampler gRPC servicer: decode and validate, run the backend off the event loop, encode.

Every RPC of the contract is one method here; validation lives in validation/sample.py / validation/workloads.py,
sampling in the batcher and the backends, the torch references of the other workloads in workloads/.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
import math
from pathlib import Path

import grpc
from google.protobuf.message import Message
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor
from tokensampler_client.wire import serialized

from tokensampler_server import __version__
from tokensampler_server.backends import Backend
from tokensampler_server.batching.batcher import DynamicBatcher, entry_bytes, host_bytes
from tokensampler_server.rpc.call_record import current_call
from tokensampler_server.rpc.colocated import ColocatedLoops
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.resources.leases import Lease
from tokensampler_server.rpc.metrics import ServerMetrics
from tokensampler_server.workloads.cuda import workloads_of
from tokensampler_server.resources.regions import RegionRegistry, region_info
from tokensampler_server.core.request_context import current_request_id
from tokensampler_server.model.sampling import LogitProcessing
from tokensampler_server.rpc.native_path import NativePath
from tokensampler_server.rpc.sample_rpc import SampleRpc
from tokensampler_server.validation.sample import LOGITS_DTYPES
from tokensampler_server.validation.workloads import (TOPK_ENTRY_BYTES, validate_diffusion_request, validate_score_request,
                                                      validate_topk_request, validate_verify_request)
from tokensampler_server.resources.weight_files import open_weights_file, read_safetensor
from tokensampler_server.resources.weights import RegisteredWeight, WeightRegistry, sha256_hex
from tokensampler_server.rpc.weights_rpc import (WIRE_DTYPES, finish_from_options, read_upload, registered_off_loop,
                                                  upload_budget, weights_info)

API_VERSION = "tokensampler.v1"
FEATURES = (
    "logits", "hidden_states", "weights_upload", "weights_from_file", "logprobs", "top_logprobs", "penalties",
    "logit_bias", "token_masks", "num_samples", "dynamic_batching", "sample_stream", "regions", "diffusion_step",
    "topk_probs", "verify_draft", "diffusion_step_hidden", "topk_probs_hidden", "region_rows", "weights_from_region",
    "token_bitmask", "score_tokens", "colocated",
)
# Features that need a region, which a server registers only with --allow-shm or --allow-cuda-ipc.
_REGION_FEATURES = frozenset({"regions", "region_rows", "weights_from_region"})
ON_LOOP_ANSWER_BYTES = 1 << 20
"""Answers up to this size are encoded on the event loop (a thread's hand-off costs more); larger ones on a thread."""


async def _made(answer: Callable[[], Message], nbytes: int) -> Message | bytes:
    """The answer `answer` makes, of about `nbytes`: made on the event loop up to ON_LOOP_ANSWER_BYTES, else made and
    serialised on a thread (the method is registered with a serializer that passes bytes through)."""
    if nbytes <= ON_LOOP_ANSWER_BYTES:
        return answer()
    return await asyncio.to_thread(lambda: answer().SerializeToString())


def served_features(weights_dir: Path | None, region_kinds: frozenset[str], on_gpu: bool) -> list[str]:
    """FEATURES less those this server's settings switch off: a client reads the list to choose a path."""
    off = set() if region_kinds else set(_REGION_FEATURES)
    if weights_dir is None:
        off.add("weights_from_file")
    if not on_gpu or region_kinds != {"shm", "cuda_ipc"}:  # a loop's flags and its tensors
        off.add("colocated")
    return [feature for feature in FEATURES if feature not in off]


def _list_copies(processing: LogitProcessing | None, positions: int) -> int:
    """The token-list entries a workload copies to each of its positions, counted as logits toward the long worker:
    a 28 KB diffusion step whose one list of 8192 ids every one of 4096 positions shares makes 2^25 copies, 2.4 s
    of the CPU over 8192 logits."""
    return 0 if processing is None else positions * (processing.host_bytes() // 16)


def _set_timings(timings: pb.Timings, arrived: int, started: int) -> None:
    """Timings of a request run with run_exclusive: no queue of its own, compute from `started`."""
    finished = time.perf_counter_ns()
    timings.compute_ns = finished - started
    timings.total_ns = finished - arrived


class SamplerService(pb_grpc.SamplerServicer):
    """Serves tokensampler.v1.Sampler with one backend, under call_guard.CallGuard (which opens each call's record).

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
        native: NativePath | None = None,
    ) -> None:
        self._backend = backend
        self._workloads = workloads_of(backend)
        self._limits = limits
        self._batcher = batcher or DynamicBatcher(backend, max_batch_rows=limits.max_batch_rows,
                                                  max_batch_elements=limits.max_batch_elements)
        self._registry = registry or WeightRegistry(backend.device)
        self._uploads = upload_budget(limits.max_weight_bytes)  # one largest
        # weight's bytes at most, between every upload in progress
        self._weights_dir = weights_dir
        self._regions = regions or RegionRegistry()
        self._metrics = metrics
        self._native = native
        self._sample_path = SampleRpc(limits, self._batcher, self._registry, self._regions, metrics, native)
        self._colocated = ColocatedLoops(backend, limits, self._registry, self._regions)

    @property
    def queue_depth(self) -> int:
        """Validated requests waiting for the backend (the batcher's queue holds the native path's too)."""
        return self._batcher.queued_requests

    @property
    def registry(self) -> WeightRegistry:
        return self._registry

    @property
    def regions(self) -> RegionRegistry:
        return self._regions

    async def close(self) -> None:
        await self._batcher.close()

    async def Sample(
        self, request: bytes | pb.SampleRequest, context: grpc.aio.ServicerContext
    ) -> bytes | pb.SampleResponse:
        return await self._sample_path.unary(request, current_call.get())

    async def SampleStream(
        self, request_iterator: AsyncIterator[bytes | pb.SampleRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.SampleStreamResponse]:
        """Samples each message as it arrives (so the batcher can merge them) and answers in order."""
        async for answer in self._sample_path.stream(request_iterator, current_request_id.get()):
            yield answer

    async def Colocate(
        self, request_iterator: AsyncIterator[pb.ColocateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ColocateResponse]:
        """A decode loop's loop, its steps handed off on the GPU (colocated.py)."""
        async for answer in self._colocated.serve(request_iterator, current_request_id.get()):
            yield answer

    def _hold_lm_head(self, request: pb.DiffusionStepRequest | pb.TopKProbsRequest | pb.ScoreTokensRequest,
                      held: Lease) -> RegisteredWeight | None:
        """Holds the weight a hidden-state request names in `held` (NOT_FOUND if unknown), as Sample does;
        None for logits."""
        if request.WhichOneof("input") != "hidden" or request.hidden.HasField("states_ref"):
            return None  # a region reference is refused by validation, named whatever weight is given
        return held.enter(self._registry.use(request.hidden.weights))

    async def SampleDiffusionStep(
        self, request: pb.DiffusionStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.DiffusionStepResponse:
        arrived = time.perf_counter_ns()
        with Lease() as held:
            lm_head = self._hold_lm_head(request, held)
            # On a thread: its token lists expand over B·L positions (up to 2^25 entries, seconds of the event loop).
            logits, step, seeds = await asyncio.to_thread(validate_diffusion_request, request, self._limits,
                                                          lm_head=lm_head)
            started = time.perf_counter_ns()
            # Hidden states become logits on the worker, on the LM head's (the backend's) device; then the
            # CUDA kernels on a CUDA backend, the torch references otherwise (workloads/cuda.py).
            tokens, confidences, mask = await self._batcher.run_exclusive(
                lambda: self._workloads.diffusion_step(step(logits.compute())),
                rows=math.prod(logits.shape[:-1]),
                elements=math.prod(logits.shape) + _list_copies(step.keywords["processing"], logits.shape[1]),
                nbytes=host_bytes(logits.tensor) + entry_bytes(step.keywords["processing"]),  # the step's partial
                lease=held)
        response = pb.DiffusionStepResponse(request_id=current_call.get().request_id)
        encode_tensor(tokens.to(torch.int32).cpu(), out=response.tokens)
        encode_tensor(confidences.cpu(), out=response.confidences)
        encode_tensor(mask.to(torch.uint8).cpu(), out=response.mask)
        response.seeds.extend(seeds.tolist())
        _set_timings(response.timings, arrived, started)
        return response

    async def TopKProbs(self, request: pb.TopKProbsRequest,
                        context: grpc.aio.ServicerContext) -> pb.TopKProbsResponse | bytes:
        """The answer; past ON_LOOP_ANSWER_BYTES encoded and serialised on a thread (a 256 MiB answer held the event
        loop, and with it every other call, for 0.9 s)."""
        arrived = time.perf_counter_ns()
        with Lease() as held:
            lm_head = self._hold_lm_head(request, held)
            logits, temperature, k = validate_topk_request(request, self._limits, lm_head=lm_head)
            shape = [*logits.shape[:-1], k]
            started = time.perf_counter_ns()
            # Hidden states become logits on the worker, as for diffusion steps; one row per position. The answer
            # as computed (float32 probabilities, int64 ids) counts towards the bound as the input does.
            probs, ids = await self._batcher.run_exclusive(
                lambda: self._workloads.topk_probs(logits.compute().flatten(0, -2), temperature, k),
                rows=math.prod(shape[:-1]), elements=math.prod(logits.shape),
                nbytes=host_bytes(logits.tensor) + 12 * math.prod(shape), lease=held)
        request_id = current_call.get().request_id

        def answer() -> pb.TopKProbsResponse:
            response = pb.TopKProbsResponse(request_id=request_id)
            encode_tensor(probs.cpu().reshape(shape), out=response.probs)
            encode_tensor(ids.to(torch.int32).cpu().reshape(shape), out=response.ids)
            _set_timings(response.timings, arrived, started)
            return response

        return await _made(answer, TOPK_ENTRY_BYTES * math.prod(shape))

    async def ScoreTokens(
        self, request: pb.ScoreTokensRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreTokensResponse | bytes:
        """The answer; past ON_LOOP_ANSWER_BYTES encoded and serialised on a thread, as TopKProbs'."""
        arrived = time.perf_counter_ns()
        with Lease() as held:
            lm_head = self._hold_lm_head(request, held)
            logits, source, scoring = validate_score_request(request, self._limits, lm_head=lm_head)
            started = time.perf_counter_ns()
            # On the worker and the backend's device; from hidden states a vocabulary slice at a time (workloads/score.py,
            # workloads/score_cuda.py).
            scores = await self._batcher.run_exclusive(
                lambda: self._workloads.score_tokens(source, scoring),
                rows=source.num_rows, elements=math.prod(logits.shape), nbytes=host_bytes(logits.tensor), lease=held)
        shape = list(logits.shape[:-1])
        request_id = current_call.get().request_id

        def answer() -> pb.ScoreTokensResponse:
            response = pb.ScoreTokensResponse(request_id=request_id)
            encode_tensor(scores.logprobs.cpu().reshape(shape), out=response.logprobs)
            if scores.top_ids is not None:
                encode_tensor(scores.top_ids.to(torch.int32).cpu().reshape([*shape, -1]), out=response.top_logprob_ids)
                encode_tensor(scores.top_values.cpu().reshape([*shape, -1]), out=response.top_logprobs)
            if scores.entropy is not None:
                encode_tensor(scores.entropy.cpu().reshape(shape), out=response.entropy)
            _set_timings(response.timings, arrived, started)
            return response

        answer_bytes = sum(t.numel() * 4 for t in (scores.logprobs, scores.top_ids, scores.top_values, scores.entropy)
                           if t is not None)
        return await _made(answer, answer_bytes)

    async def VerifyDraft(self, request: pb.VerifyDraftRequest, context: grpc.aio.ServicerContext) -> pb.VerifyDraftResponse:
        arrived = time.perf_counter_ns()
        # On a thread, as for diffusion steps: token lists over B·(n+1) positions, and draft logits to softmax.
        verification, seeds = await asyncio.to_thread(validate_verify_request, request, self._limits)
        started = time.perf_counter_ns()
        accepted, tokens = await self._batcher.run_exclusive(
            lambda: self._workloads.verify_draft(verification),
            rows=int(verification.target_logits.shape[0] * verification.target_logits.shape[1]),
            elements=verification.target_logits.numel()
            + _list_copies(verification.processing, verification.target_logits.shape[1]),
            nbytes=host_bytes(verification.target_logits) + host_bytes(verification.draft_probs)
            + entry_bytes(verification.processing))
        response = pb.VerifyDraftResponse(request_id=current_call.get().request_id)
        encode_tensor(accepted.to(torch.int32).cpu(), out=response.accepted)
        encode_tensor(tokens.to(torch.int32).cpu(), out=response.tokens)
        response.seeds.extend(seeds.tolist())
        _set_timings(response.timings, arrived, started)
        return response

    async def RegisterWeights(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.WeightsInfo:
        upload = await read_upload(request_iterator, self._limits.max_weight_bytes, self._registry.check_free,
                                   self._uploads)
        return weights_info(await registered_off_loop(self._registry, upload.name, lambda: self._registry.register(
            upload.name, upload.weight, upload.finish, upload.sha256, reserved=True)))

    async def RegisterWeightsFromFile(
        self, request: pb.RegisterWeightsFromFileRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightsInfo:
        fd = open_weights_file(self._weights_dir, request.path)  # every later read goes through it (weight_files.py)
        return weights_info(await registered_off_loop(self._registry, request.name,
                                                      lambda: self._register_file(request, fd),
                                                      on_unrun=lambda: os.close(fd)))

    def _register_file(self, request: pb.RegisterWeightsFromFileRequest, fd: int) -> RegisteredWeight:
        """Reads, checks, hashes and registers a file's tensor, closing `fd`: seconds a GiB (registered_off_loop's
        work)."""
        try:
            weight = read_safetensor(fd, request.path, request.tensor, self._limits.max_weight_bytes,
                                     lambda nbytes: self._registry.claim(request.name, nbytes, "tensor"))
        finally:
            os.close(fd)
        finish = finish_from_options(request.options, int(weight.shape[0]))
        return self._registry.register(request.name, weight, finish, sha256_hex(weight), reserved=True)

    async def RegisterWeightsFromRegion(
        self, request: pb.RegisterWeightsFromRegionRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightsInfo:
        if not request.HasField("weight"):
            raise InvalidArgument("weight", "not set; expected a reference to W [V, D] in a registered region")
        return weights_info(await registered_off_loop(self._registry, request.name,
                                                      lambda: self._register_region_weight(request)))

    def _register_region_weight(self, request: pb.RegisterWeightsFromRegionRequest) -> RegisteredWeight:
        """Reads (a shared-memory region), checks and registers a region's weight (registered_off_loop's work),
        holding the region while it reads: the caller's going must not let the region go under the read."""
        with self._regions.use(request.weight.region, "weight.region") as region:
            weight = region.tensor(request.weight, "weight", WIRE_DTYPES, self._limits.max_weight_bytes,
                                   lambda nbytes: self._registry.claim(request.name, nbytes, "weight"))
            if weight.dim() != 2 or min(weight.shape) < 1:
                raise InvalidArgument("weight.shape", f"got {list(weight.shape)}, expected [V, D] with V, D >= 1")
            finish = finish_from_options(request.options, int(weight.shape[0]))
            return self._registry.register(request.name, weight, finish, sha256="", region=region, reserved=True)

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
            features=served_features(self._weights_dir, self._regions.allowed_kinds, on_gpu),
            kernels=info.kernels,
            routes=[pb.Route(rows=r.rows, kernels=r.kernels, cost=r.cost) for r in info.routes],
            mps=info.mps,
            api_version=API_VERSION,
            registered_weights=len(self._registry.list()),
            registered_weights_bytes=self._registry.total_bytes,
            device_memory_allocated_bytes=torch.cuda.memory_allocated(device) if on_gpu else 0,
            device_memory_reserved_bytes=torch.cuda.memory_reserved(device) if on_gpu else 0,
        )


class _HandlerCapture:
    """Stands in for a server while the generated code registers the Sampler's handlers."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, generic_handlers: tuple) -> None:
        pass

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers


def add_sampler_to_server(service: SamplerService, server: grpc.aio.Server) -> None:
    """The generated registration, except that Sample and SampleStream take the request's bytes and answer
    bytes or messages: the native path reads and writes the wire bytes itself (sample_rpc.py); and TopKProbs and
    ScoreTokens answer bytes when they serialised a large answer on a thread."""
    capture = _HandlerCapture()
    pb_grpc.add_SamplerServicer_to_server(service, capture)
    handlers = dict(capture.handlers)
    handlers["Sample"] = grpc.unary_unary_rpc_method_handler(service.Sample, response_serializer=serialized)
    handlers["SampleStream"] = grpc.stream_stream_rpc_method_handler(service.SampleStream,
                                                                     response_serializer=serialized)
    for method, request_type in (("TopKProbs", pb.TopKProbsRequest), ("ScoreTokens", pb.ScoreTokensRequest)):
        handlers[method] = grpc.unary_unary_rpc_method_handler(
            getattr(service, method), request_deserializer=request_type.FromString, response_serializer=serialized)
    name = pb.DESCRIPTOR.services_by_name["Sampler"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
