"""What the blocking and the asyncio client share: each call built once, as a Call (its request, the RPC that
carries it, how the answer is decoded), and the channel, retry policy and metadata the calls go out with.

The clients are transports: SamplerClient runs a Call to its result, AsyncSamplerClient awaits it
(client.py, aio.py); every request, parameter and decoding is made here, once for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

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
from ._retry import Backoff, CallPolicy, RetryState, RetryThrottle, check_timeout
from .errors import TokenSamplerError, error_from_rpc
from .params import SampleOptions, build_sample_request, serialize_sample_request
from .regions import CudaRegion, RegionView, SharedMemoryRegion
from .result import SampleResult
from .weights import HeadOptions, Progress, WeightUpload, region_weights_request, weight_options
from .wire import sample_methods
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

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Call(Generic[T]):
    """One call, ready to send: `rpc` names the Stub method that carries `request`, `decode` makes the
    caller's result of its answer."""

    rpc: str
    request: Any
    decode: Callable[[Any], T]
    timeout: float | None = None
    request_id: str | None = None
    idempotent: bool = False
    """Sample: the same request samples the same tokens, so a call cancelled before it started is retried too."""
    streamed: bool = False
    """The request is an iterable of messages, iterated afresh by each attempt: a retry re-sends all of it."""
    on_failure: Callable[[], object] | None = None
    """Undoes what building the call set up (a shared-memory segment) when the call fails."""


class Stub(sampler_pb2_grpc.SamplerStub):
    """The Sampler methods of a blocking or asyncio channel, Sample and SampleStream taking prebuilt bytes as well
    (wire.py), and the health service's Check."""

    def __init__(self, channel: Any) -> None:
        super().__init__(channel)
        self.Sample, self.SampleStream = sample_methods(channel)
        self.Check = health_pb2_grpc.HealthStub(channel).Check


class Attempts:
    """The attempts of one call: the request id and metadata each sends, the deadline they share, the wait before
    the next; as a context, it runs the call's on_failure when the call ends in an exception."""

    __slots__ = ("_call", "_request_id", "_metadata", "_state")

    def __init__(self, call: Call[Any], policy: CallPolicy, auth_token: str | None) -> None:
        self._call = call
        self._request_id = call.request_id or new_request_id()
        self._metadata = call_metadata(self._request_id, auth_token)
        self._state = policy.start(call.timeout)

    def send(self, stub: Stub) -> Any:
        """One attempt: the answer on a blocking channel, the call to await on an asyncio one."""
        call = self._call
        request = iter(call.request) if call.streamed else call.request
        return getattr(stub, call.rpc)(request, timeout=self._state.remaining(), metadata=self._metadata)

    def answered(self, response: T) -> T:
        """The answer of an attempt, counted as one by the client's retry throttle."""
        self._state.answered()
        return response

    def closed(self) -> TokenSamplerError:
        """The error of this call when its client is closed, before or while it was in flight."""
        return TokenSamplerError(grpc.StatusCode.CANCELLED, "the client was closed during the call", self._request_id)

    def check_open(self, client_closed: bool) -> None:
        """Raises client_is_closed() for a call made on a closed client (grpc's own error there is a bare ValueError
        or UsageError)."""
        if client_closed:
            raise client_is_closed(self._request_id)

    def retry_delay(self, err: grpc.RpcError, client_closed: bool = False) -> float:
        """The wait before retrying after `err` (see _retry.py); `err` raised as TokenSamplerError when it ends the
        call, as it does once the client is closed."""
        if client_closed:
            raise self.closed() from err
        code, metadata, details = err.code(), err.trailing_metadata(), err.details()  # type: ignore[attr-defined]
        delay = self._state.next_delay(code, metadata, self._call.idempotent, details)
        if delay is None:
            raise error_from_rpc(err, self._request_id) from err
        return delay

    def __enter__(self) -> Attempts:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is not None and self._call.on_failure is not None:
            self._call.on_failure()


class ClientCore:
    """The channel, stub, retry policy and bearer token of a client; the arguments are SamplerClient's."""

    _grpc: ClassVar[Any]
    """The module whose channels the client opens: grpc, or grpc.aio for the asyncio client."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = None,
        retries: int = 3,
        backoff: Backoff | None = None,
        retry_throttle: RetryThrottle | None = None,
        max_message_mb: int = 256,
        options: Sequence[tuple[str, Any]] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        auth_token: str | None = None,
    ) -> None:
        self._policy = CallPolicy(timeout, retries, backoff or Backoff(), retry_throttle)
        self._closed = False
        self._auth_token = check_auth_token(auth_token)
        channel_args = channel_options(max_message_mb, options)
        self.max_message_bytes = int(max_message_mb * 1024 * 1024)
        """The largest message this client sends or receives (max_message_mb)."""
        credentials = channel_credentials(credentials, tls_ca, tls_cert, tls_key)
        target = channel_target(target)
        if credentials is None:
            self._channel = self._grpc.insecure_channel(target, options=channel_args)
        else:
            self._channel = self._grpc.secure_channel(target, credentials, options=channel_args)
        self._stub = Stub(self._channel)

    @property
    def timeout(self) -> float | None:
        """The default deadline of each call in seconds, retries included (None: none)."""
        return self._policy.timeout

    def _attempts(self, call: Call[Any]) -> Attempts:
        return Attempts(call, self._policy, self._auth_token)

    def _stream_metadata(self, request_id: str | None) -> Metadata:
        """A new stream's metadata; CANCELLED (TokenSamplerError) on a closed client."""
        if self._closed:
            raise client_is_closed(request_id)
        return call_metadata(request_id or new_request_id(), self._auth_token)

    def _stream_retry(self, timeout: float | None) -> RetryState:
        """A stream's deadline (`timeout` checked as a call's; none by default, whatever the client's) and its
        reopens after overload, with the client's retries and backoff."""
        check_timeout(timeout)
        return RetryState(self._policy.retries, self._policy.backoff, timeout, throttle=self._policy.throttle)


def client_is_closed(request_id: str | None) -> TokenSamplerError:
    """The error of a call or stream opened on a closed client."""
    return TokenSamplerError(grpc.StatusCode.CANCELLED, "the client is closed", request_id)


def sample(
    logits: Any, *, timeout: float | None, request_id: str | None, **options: Unpack[SampleOptions]
) -> Call[SampleResult]:
    return sample_request(serialize_sample_request(logits, **options), timeout=timeout, request_id=request_id)


def sample_request(
    request: pb.SampleRequest | bytes, *, timeout: float | None, request_id: str | None
) -> Call[SampleResult]:
    return Call("Sample", request, SampleResult.from_response, timeout, request_id, idempotent=True)


def sample_hidden(hidden: Any, weights: str, **params: Any) -> Call[SampleResult]:
    timeout, request_id = params.pop("timeout", None), params.pop("request_id", None)
    request = build_sample_request(hidden=hidden, weights=weights, **params)
    return sample_request(request, timeout=timeout, request_id=request_id)


def _workload(rpc: str, build: Callable[..., Any], decode: Callable[[Any], T]) -> Callable[..., Call[T]]:
    """The Call builder of a workload: `build` makes its request of the method's arguments (workloads.py)."""

    def call(*args: Any, timeout: float | None, request_id: str | None, **params: Any) -> Call[T]:
        return Call(rpc, build(*args, **params), decode, timeout, request_id)

    return call


sample_diffusion_step = _workload("SampleDiffusionStep", build_diffusion_request, DiffusionStepResult.from_response)
topk_probs = _workload("TopKProbs", build_topk_request, TopKProbsResult.from_response)
score_tokens = _workload("ScoreTokens", build_score_request, ScoreTokensResult.from_response)
verify_draft = _workload("VerifyDraft", build_verify_request, VerifyDraftResult.from_response)


def _as_is(response: T) -> T:
    return response


def register_weights(
    name: str, weight: Any, chunk_bytes: int, progress: Progress | None, timeout: float | None,
    options: HeadOptions,
) -> Call[pb.WeightsInfo]:
    upload = WeightUpload(name, weight, weight_options(**options), chunk_bytes, progress)
    return Call("RegisterWeights", upload, _as_is, timeout, streamed=True)


def register_weights_from_file(
    name: str, path: str, tensor: str, timeout: float | None, options: HeadOptions
) -> Call[pb.WeightsInfo]:
    request = pb.RegisterWeightsFromFileRequest(name=name, path=path, tensor=tensor, options=weight_options(**options))
    return Call("RegisterWeightsFromFile", request, _as_is, timeout)


def register_weights_from_region(
    name: str, weight: RegionView, timeout: float | None, options: HeadOptions
) -> Call[pb.WeightsInfo]:
    request = region_weights_request(name, weight, weight_options(**options))
    return Call("RegisterWeightsFromRegion", request, _as_is, timeout)


def list_weights(timeout: float | None) -> Call[list[pb.WeightsInfo]]:
    return Call("ListWeights", pb.ListWeightsRequest(), lambda response: list(response.weights), timeout)


def unregister_weights(name: str, timeout: float | None) -> Call[pb.WeightsInfo]:
    request = pb.UnregisterWeightsRequest(name=name)
    return Call("UnregisterWeights", request, lambda response: response.weights, timeout)


def register_shm_region(name: str, byte_size: int, timeout: float | None) -> Call[SharedMemoryRegion]:
    region = SharedMemoryRegion(name, byte_size)
    return Call("RegisterRegion", region.request, lambda _: region, timeout, on_failure=region.release)


def register_cuda_region(name: str, tensor: Any, ready_event: bool, timeout: float | None) -> Call[CudaRegion]:
    region = CudaRegion(name, tensor, ready_event)
    return Call("RegisterRegion", region.request, lambda _: region, timeout)


def list_regions(timeout: float | None) -> Call[list[pb.RegionInfo]]:
    return Call("ListRegions", pb.ListRegionsRequest(), lambda response: list(response.regions), timeout)


def unregister_region(region: str | SharedMemoryRegion | CudaRegion, timeout: float | None) -> Call[pb.RegionInfo]:
    name = region if isinstance(region, str) else region.name

    def decode(response: pb.UnregisterRegionResponse) -> pb.RegionInfo:
        if not isinstance(region, str):  # a region object is released once the server let go of it
            region.release()
        return response.region

    return Call("UnregisterRegion", pb.UnregisterRegionRequest(name=name), decode, timeout)


def server_info(timeout: float | None) -> Call[pb.ServerInfo]:
    return Call("GetServerInfo", pb.GetServerInfoRequest(), _as_is, timeout)


def health(service: str, timeout: float | None) -> Call[str]:
    return Call("Check", health_request(service), health_status_name, timeout)
