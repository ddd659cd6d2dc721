"""Blocking client of the tokensampler gRPC service."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import grpc

from . import _core
from ._core import Call, ClientCore
from ._torch import require_torch
from .colocated import ColocatedLoop
from ._proto import sampler_pb2 as pb
from .params import SampleOptions
from .regions import CudaRegion, RegionView, SharedMemoryRegion
from .result import SampleResult
from .stream import SampleStream
from .weights import DEFAULT_CHUNK_BYTES, HeadOptions, Progress
from .workloads import DiffusionStepResult, ScoreTokensResult, TopKProbsResult, VerifyDraftResult

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


class SamplerClient(ClientCore):
    """Blocking client: `SamplerClient("localhost:50051").sample(logits, top_k=50)`.

    Args:
        target: "host:port", or any gRPC target such as "unix:///path/to/socket"; or a list of
            "IP:port" replicas, tried in order: when one goes away (shutdown), calls move to the next.
        timeout: default deadline of each call in seconds, retries included (None: no deadline).
        retries: how many times a call failing with UNAVAILABLE, or RESOURCE_EXHAUSTED because the
            server is overloaded, is retried; a Sample call also when a shutting-down server
            cancelled it before starting it (CANCELLED). Other codes never are.
        backoff: the wait between retries (default: 0.05 s doubling up to 2 s, with jitter).
        retry_throttle: a RetryThrottle shared by every call and stream of this client (gRPC's retry throttling):
            while most recent attempts failed, no call retries, so that retries do not add to an overloaded
            server's load; None (the default): each call retries up to `retries` times, whatever the others met.
        max_message_mb: the largest message sent or received, in MiB; the server has the same
            option (`--max-message-mb`), and a request must fit both.
        options: further gRPC channel arguments, e.g. [("grpc.keepalive_time_ms", 10000)].
        credentials: grpc.ChannelCredentials for TLS; None for a plaintext channel.
        tls_ca, tls_cert, tls_key: TLS from PEM files (paths) or PEM bytes, instead of `credentials`:
            the CA of the server's certificate (None: the system's roots), and the client's own
            certificate and key for a server that requires them (`--tls-client-ca`).
        auth_token: bearer token sent with every call, streams included (`--auth-token-file`).

    Every failed call raises TokenSamplerError carrying the gRPC status code.
    """

    _grpc: ClassVar[Any] = grpc

    def _run(self, call: Call[T]) -> T:
        """Sends `call` and decodes its answer, retrying UNAVAILABLE and overload with backoff within the deadline."""
        with self._attempts(call) as attempt:
            attempt.check_open(self._closed)
            while True:
                try:
                    return call.decode(attempt.answered(attempt.send(self._stub)))
                except grpc.RpcError as err:
                    delay = attempt.retry_delay(err, self._closed)
                except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
                    if self._closed:
                        raise attempt.closed() from None
                    raise
                time.sleep(delay)

    def sample(
        self, logits: Any, *, timeout: float | None = None, request_id: str | None = None,
        **options: Unpack[SampleOptions],
    ) -> SampleResult:
        """Samples `num_samples` tokens per row of `logits`.

        Args:
            logits: [B, V] float32, bfloat16 or float16, a torch tensor on any device (copied to the
                CPU) or a numpy array (no bfloat16 in numpy); a 1-D [V] tensor is one row (B = 1). Or, zero
                copy, a RegionView or RegionRows of a registered region (regions.py).
            temperature, top_k, top_p, min_p, seed, position, iteration, repetition_penalty,
            presence_penalty, frequency_penalty: None (server default), a scalar shared by every
                row, or B values, one per row. `seed` entries may be None (the server draws one).
                One `seed` value is the seed of every row: the rows then draw the same noise, so identical
                rows get identical tokens and the tokens of different rows are correlated. For independent
                rows pass B seeds, or None.
            num_samples: samples per row (default 1).
            allowed_token_ids, banned_token_ids, output_token_ids, prompt_token_ids: one list of
                token ids shared by every row, or B lists.
            logit_bias: one {token_id: bias} dict shared by every row, or B dicts.
            min_tokens, num_generated, stop_token_ids: while a row's num_generated < min_tokens, its
                stop_token_ids (one list shared by every row, or B lists; EOS included) are banned.
            no_repeat_ngram_size: bans tokens that would repeat an n-gram of the row's sequence (its
                prompt_token_ids then output_token_ids, in order); 0 is off.
            dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n: DRY, the sequence-repetition
                penalty over the last n tokens of the sequence (-1: all); multiplier 0 is off.
            dry_sequence_breakers: DRY's breakers as token-id sequences (each breaker string's tokenization):
                one list of sequences shared by every row, or B lists.
            typical_p, top_n_sigma: locally typical sampling (1 is off) and top-n-sigma (<= 0 is off).
            xtc_threshold, xtc_probability: XTC, which removes all but the least likely of the tokens above
                the threshold with the given probability (0 is off; its coin is reproducible from the seed).
            token_bitmask: structured output, a grammar engine's packed mask of allowed tokens (xgrammar's and
                llguidance's): int32 [B, W], W >= ceil(V / 32), token i allowed when bit i % 32 of word i // 32
                is set; a torch tensor or numpy array. A row of all ones is unrestricted.
            return_logprobs: also return the log-prob of each sampled token.
            logprobs_mode: "raw" (log_softmax of the input) or "processed" (after every step).
            top_logprobs: also return the N best (id, log-prob) pairs of each row.
            timeout: this call's deadline in seconds (default: the client's).
            request_id: sent as `x-request-id` (default: a fresh uuid4 hex).

        docs/semantics.md defines every parameter. Raises ValueError/TypeError for arguments of the
        wrong length or type, TokenSamplerError when the call fails (INVALID_ARGUMENT for values
        out of range).
        """
        return self._run(_core.sample(logits, timeout=timeout, request_id=request_id, **options))

    def sample_request(
        self, request: pb.SampleRequest | bytes, *, timeout: float | None = None, request_id: str | None = None
    ) -> SampleResult:
        """Sends a SampleRequest built ahead of time (params.build_sample_request, or its bytes from
        params.serialize_sample_request) and decodes the answer."""
        return self._run(_core.sample_request(request, timeout=timeout, request_id=request_id))

    def sample_hidden(self, hidden: Any, weights: str, **params: Any) -> SampleResult:
        """Samples from hidden states [B, D] (or [D]) through the registered LM head `weights`.

        Takes every keyword of sample(), timeout and request_id included; the server computes the
        logits (docs/semantics.md: x = W·h, then the weight's bias, scale and soft cap).
        """
        return self._run(_core.sample_hidden(hidden, weights, **params))

    def sample_diffusion_step(
        self, logits: Any, mask: Any, *, timeout: float | None = None, request_id: str | None = None, **params: Any
    ) -> DiffusionStepResult:
        """One denoising step of a diffusion LM: logits [B, L, V], mask [B, L] of undecided positions;
        keywords: confidence_threshold, commit_count and sample()'s per-row sampling parameters."""
        return self._run(_core.sample_diffusion_step(logits, mask, timeout=timeout, request_id=request_id, **params))

    def sample_diffusion_step_hidden(
        self, hidden: Any, weights: str, mask: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> DiffusionStepResult:
        """sample_diffusion_step() of the logits that the registered LM head `weights` makes of hidden
        states [B, L, D] (computed by the server, as for sample_hidden()); the same keywords."""
        return self._run(_core.sample_diffusion_step(
            None, mask, hidden=hidden, weights=weights, timeout=timeout, request_id=request_id, **params))

    def topk_probs(
        self, logits: Any, k: int, *, temperature: Any = None, timeout: float | None = None, request_id: str | None = None
    ) -> TopKProbsResult:
        """The k most probable ids of softmax(logits / T) for logits [B, S, V] or [B, V], sorted."""
        return self._run(_core.topk_probs(logits, k, temperature, timeout=timeout, request_id=request_id))

    def topk_probs_hidden(
        self, hidden: Any, weights: str, k: int, *, temperature: Any = None, timeout: float | None = None,
        request_id: str | None = None,
    ) -> TopKProbsResult:
        """topk_probs() of the logits that the registered LM head `weights` makes of hidden states
        [B, S, D] or [B, D] (computed by the server, as for sample_hidden())."""
        return self._run(_core.topk_probs(
            None, k, temperature, hidden=hidden, weights=weights, timeout=timeout, request_id=request_id))

    def score_tokens(
        self, logits: Any, token_ids: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> ScoreTokensResult:
        """The log-probs of token_ids [B, T] under logits [B, T, V] (docs/semantics.md, choice 18); keywords:
        mode ("raw" or "processed"), temperature, top_k, top_p, min_p (per row, PROCESSED), top_logprobs,
        return_entropy."""
        return self._run(_core.score_tokens(logits, token_ids, timeout=timeout, request_id=request_id, **params))

    def score_tokens_hidden(
        self, hidden: Any, weights: str, token_ids: Any, *, timeout: float | None = None,
        request_id: str | None = None, **params: Any,
    ) -> ScoreTokensResult:
        """score_tokens() under the logits that the registered LM head `weights` makes of hidden states
        [B, T, D]: the server walks the vocabulary in slices, never holding the [B·T, V] logits."""
        return self._run(_core.score_tokens(
            None, token_ids, hidden=hidden, weights=weights, timeout=timeout, request_id=request_id, **params))

    def verify_draft(
        self, draft_ids: Any, target_logits: Any, *, timeout: float | None = None, request_id: str | None = None,
        **params: Any,
    ) -> VerifyDraftResult:
        """Speculative decoding: accepts a prefix of draft_ids [B, n] against target_logits [B, n + 1, V]
        by exact rejection sampling; keywords: draft_probs or draft_logits [B, n, V], and the target's
        per-row sampling parameters (position = the position of draft token 0)."""
        return self._run(_core.verify_draft(draft_ids, target_logits, timeout=timeout, request_id=request_id, **params))

    def register_weights(
        self, name: str, weight: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
        timeout: float | None = None, **options: Unpack[HeadOptions],
    ) -> pb.WeightsInfo:
        """Uploads an LM head W [V, D] (float32/bfloat16/float16) in chunks and registers it as `name`.

        progress(bytes_sent, total) is called after each chunk. The server uses the weight only once
        every byte arrived and the SHA-256 matches. Options (vocab_size, bias, soft_cap, logit_scale): see
        weights.weight_options.
        """
        return self._run(_core.register_weights(name, weight, chunk_bytes, progress, timeout, options))

    def register_weights_from_file(
        self, name: str, path: str, tensor: str = "lm_head.weight", *, timeout: float | None = None,
        **options: Unpack[HeadOptions],
    ) -> pb.WeightsInfo:
        """Registers `tensor` of the safetensors file `path` (relative to the server's --weights-dir); options as
        for register_weights."""
        return self._run(_core.register_weights_from_file(name, path, tensor, timeout, options))

    def register_weights_from_region(
        self, name: str, weight: RegionView, *, timeout: float | None = None, **options: Unpack[HeadOptions]
    ) -> pb.WeightsInfo:
        """Registers the LM head W [V, D] that lies in a registered region, in place: the engine's own weight,
        `client.register_cuda_region("lm_head", w)` then `register_weights_from_region("lm_head", region.view_of(w))`.
        Keep W alive and unchanged until the weight is unregistered; the region cannot be unregistered before.
        Options as for register_weights."""
        return self._run(_core.register_weights_from_region(name, weight, timeout, options))

    def list_weights(self, *, timeout: float | None = None) -> list[pb.WeightsInfo]:
        """The registered weights."""
        return self._run(_core.list_weights(timeout))

    def unregister_weights(self, name: str, *, timeout: float | None = None) -> pb.WeightsInfo:
        """Unregisters `name` once the requests using it have finished."""
        return self._run(_core.unregister_weights(name, timeout))

    def stream(self, *, timeout: float | None = None, request_id: str | None = None) -> SampleStream:
        """Opens a SampleStream for a decode loop (see stream.py): `with client.stream() as s: s.sample(logits)`.

        `timeout` bounds the whole stream (default: none); within it, a stream that ends overloaded or UNAVAILABLE
        is opened again with this client's retries and backoff (stream.py).
        """
        return SampleStream(self._stub.SampleStream, self._stream_metadata(request_id), self._stream_retry(timeout))

    def colocate(self, source: Any, *, head: Any = None, num_samples: int = 1, tokens_dtype: Any = None,
                 logprobs: bool = False, logprobs_mode: str = "raw", wait_timeout_s: float = 10.0,
                 watchdog_s: float = 1.0, **params: Any) -> ColocatedLoop:
        """Opens a decode loop colocated on the server's GPU (docs/colocated.md; the server needs its CUDA backend,
        --allow-shm and --allow-cuda-ipc, and this machine): `loop.step()` each step, then `loop.close()`.

        source: the CUDA tensor the engine writes each step's input into, logits [B, V], or hidden states [B, D]
        with `head`, the engine's LM-head weight [V, D], used in place. Keywords: per-row temperature, top_k, top_p,
        min_p, seed, position (step n samples at position + n - 1) and iteration. `tokens_dtype`: int64 (default)
        or int32. The server ends the loop when a step's input is not ready within `wait_timeout_s` of its
        announcement; this process samples a step itself when the server has not delivered it within `watchdog_s`
        of its input being ready."""
        torch = require_torch("colocated sampling")
        return ColocatedLoop(self, source, head, num_samples, tokens_dtype or torch.int64, logprobs, logprobs_mode,
                             wait_timeout_s, watchdog_s, params)

    def register_shm_region(self, name: str, byte_size: int, *, timeout: float | None = None) -> SharedMemoryRegion:
        """Creates a POSIX shared-memory segment of byte_size bytes and registers it as `name`
        (the server needs --allow-shm and the same machine). Write tensors into region.tensor(...)."""
        return self._run(_core.register_shm_region(name, byte_size, timeout))

    def register_cuda_region(
        self, name: str, tensor: Any, *, ready_event: bool = False, timeout: float | None = None
    ) -> CudaRegion:
        """Shares the CUDA allocation under `tensor` with the server by IPC handle, as `name` (the server
        needs --allow-cuda-ipc and the same machine). Keep the tensor alive while it is registered and
        synchronise its stream before each request that reads it, or, with ready_event=True, call
        region.mark_ready() after writing: the server's GPU work then waits for the writes, the host does not."""
        return self._run(_core.register_cuda_region(name, tensor, ready_event, timeout))

    def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        return self._run(_core.list_regions(timeout))

    def unregister_region(self, region: str | SharedMemoryRegion | CudaRegion, *, timeout: float | None = None) -> pb.RegionInfo:
        """Unregisters a region once no request uses it; a region object is then released too."""
        return self._run(_core.unregister_region(region, timeout))

    def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        """The server's version, backend, device, limits, logits dtypes and features."""
        return self._run(_core.server_info(timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" = the whole server): "SERVING" or "NOT_SERVING".

        "NOT_SERVING" is reported while the server drains on shutdown; an unknown service raises
        TokenSamplerError with code NOT_FOUND.
        """
        return self._run(_core.health(service, timeout))

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled (TokenSamplerError CANCELLED)."""
        self._closed = True
        self._channel.close()

    def __enter__(self) -> SamplerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
