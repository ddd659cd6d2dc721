"""The Sampler gRPC servicer: decode and validate, run the backend off the event loop, encode."""

from __future__ import annotations

import asyncio
import contextvars
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor

from . import __version__
from .backends import Backend
from .call_record import current_call
from .config import Limits
from .sampling import SamplingBatch, SamplingResult
from .validation import LOGITS_DTYPES, validate_sample_request

API_VERSION = "tokensampler.v1"
FEATURES = ("logits", "logprobs", "top_logprobs", "penalties", "logit_bias", "token_masks", "num_samples")


def encode_result(result: SamplingResult, seeds: np.ndarray) -> pb.SampleResponse:
    """Builds the response message of one sampled batch."""
    response = pb.SampleResponse()
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

    Batches run one at a time on a single worker thread, so the event loop keeps accepting and
    validating requests while the backend computes.
    """

    def __init__(self, backend: Backend, limits: Limits) -> None:
        self._backend = backend
        self._limits = limits
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokensampler-backend")
        # Each counter is written by one thread only (the event loop, or the worker), so no lock is needed.
        self._submitted = 0
        self._dropped = 0  # cancelled before the worker started them
        self._started = 0

    @property
    def queue_depth(self) -> int:
        """Validated batches waiting for the worker."""
        return self._submitted - self._dropped - self._started

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _run_backend(self, batch: SamplingBatch) -> tuple[SamplingResult, int, int]:
        self._started += 1
        started = time.perf_counter_ns()
        result = self._backend.sample(batch)
        return result, started, time.perf_counter_ns()

    async def Sample(self, request: pb.SampleRequest, context: grpc.aio.ServicerContext) -> pb.SampleResponse:
        call = current_call.get()
        arrived = time.perf_counter_ns()
        batch, seeds = validate_sample_request(request, self._limits)
        submitted = time.perf_counter_ns()
        call.batch, call.decode_ns = batch, submitted - arrived
        self._submitted += 1
        # The backend runs in this call's context, so what it logs carries the request id.
        job = self._worker.submit(contextvars.copy_context().run, self._run_backend, batch)
        try:
            result, started, finished = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancel():  # still queued: the worker will never start it
                self._dropped += 1
            raise
        call.queue_ns, call.compute_ns = started - submitted, finished - started
        response = encode_result(result, seeds)
        response.request_id = call.request_id
        response.timings.queue_ns = call.queue_ns
        response.timings.compute_ns = call.compute_ns
        encoded = time.perf_counter_ns()
        call.encode_ns = encoded - finished
        response.timings.total_ns = encoded - arrived
        return response

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        info = self._backend.info()
        return pb.ServerInfo(
            version=__version__,
            backend=info.name,
            device=info.device,
            limits=pb.Limits(
                max_batch_rows=self._limits.max_batch_rows,
                max_message_bytes=self._limits.max_message_bytes,
                max_num_samples=self._limits.max_num_samples,
                max_top_logprobs=self._limits.max_top_logprobs,
            ),
            logits_dtypes=LOGITS_DTYPES,
            features=FEATURES,
            kernels=info.kernels,
            api_version=API_VERSION,
        )
