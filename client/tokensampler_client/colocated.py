"""A decode loop's sampling on a server that shares its GPU, handed off on the GPU (docs/colocated.md).

    loop = client.colocate(logits_buffer, temperature=0.8, top_k=50, top_p=0.9, seed=seeds)  # registers, opens
    for n in range(steps):
        logits_buffer.copy_(model(...))   # or the model writes it in place (a captured graph's output)
        tokens = loop.step()              # int64 [B, 1] on the GPU, valid on the current stream: no host wait
        ...                               # the next forward reads `tokens` on the same stream
    loop.close()

`step()` queues on the engine's stream "input n ready" (a write into the flags page) and a wait for "tokens n
done", and hands the server the announcement of step n on a gRPC thread: the host never waits. The server's
stream waits for the first flag, samples, writes the tokens and the second flag (server/.../cuda_handoff.py).

It fails safe. A watchdog thread looks at the oldest step whose input is ready: when the server has not delivered
it within `watchdog_s`, or the call has broken (the server gone, or it ended the loop), the step is sampled in
this process by the same kernels (tokensampler_server.inprocess, same seeds, so the same tokens), written into
`tokens`, and the flag is set by this thread itself, never by work queued behind the blocked stream. Every later
step is sampled in this process too (`fallbacks` counts them, and a warning says why). The server, for its part,
ends a loop whose engine is gone: its waits end and it never touches the engine's memory again.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from collections import deque
from typing import Any

import grpc
import numpy as np

from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._torch import require_torch
from tokensampler_client.errors import error_from_rpc
from tokensampler_client.handoff import ABORT, FLAGS_BYTES, MAX_STEP, READY_OFFSET, RELEASE_OFFSET, StreamMemOps
from tokensampler_client.params import PREPARED_KEYWORDS, fill_sampling_params, logprobs_mode_value
from tokensampler_client.regions import CudaRegion, SharedMemoryRegion

log = logging.getLogger("tokensampler.colocated")

_DONE = object()


class ColocatedLoop:
    """One decode loop (SamplerClient.colocate): `step()` per step, `close()` at the end (or `with`)."""

    def __init__(self, client: Any, source: Any, head: Any, num_samples: int, tokens_dtype: Any, logprobs: bool,
                 logprobs_mode: str, wait_timeout_s: float, watchdog_s: float, params: dict[str, Any]) -> None:
        torch = require_torch("colocated sampling")
        for name in params:
            if name not in PREPARED_KEYWORDS:
                raise ValueError(f"{name}: not taken by a colocated loop; expected only {', '.join(PREPARED_KEYWORDS)}")
        logprobs_mode_value(logprobs_mode)  # refused here, before any region is registered
        for name, seconds in (("wait_timeout_s", wait_timeout_s), ("watchdog_s", watchdog_s)):
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{name}: got {seconds!r}, expected a number of seconds > 0")
        if not (isinstance(num_samples, int) and num_samples >= 1):
            raise ValueError(f"num_samples: got {num_samples!r}, expected an integer >= 1")
        if not (isinstance(source, torch.Tensor) and source.is_cuda and source.dim() == 2 and source.is_contiguous()):
            raise ValueError("source: expected a contiguous [B, V] logits (or [B, D] hidden-state) CUDA tensor")
        self._torch = torch
        self._client = client
        self._source = source
        self._device = source.device
        self._watchdog_s = watchdog_s
        batch_size = source.shape[0]
        device = self._device
        self.tokens = torch.full((batch_size, num_samples), -1, dtype=tokens_dtype, device=device)
        """The tokens of the latest step, [B, num_samples] on the GPU (-1 in rows that are not valid)."""
        self.logprobs = torch.zeros((batch_size, num_samples), dtype=torch.float32, device=device) if logprobs else None
        """Their log-probs (float32, in `logprobs_mode`), when asked for."""
        self.fallbacks = 0
        """Steps sampled in this process because the server did not deliver them."""
        self._ops = StreamMemOps.get()
        self._fallback = _Fallback(source, head, num_samples, logprobs, logprobs_mode, params)
        self._regions: list[CudaRegion | SharedMemoryRegion] = []
        self._weights: str | None = None
        self._flags_host = 0
        try:
            self._open(head, num_samples, logprobs_mode, wait_timeout_s, params)
        except BaseException:
            self._release()
            raise
        self._step = 0
        self._pending: deque[tuple[int, Any]] = deque()  # (step, event after its "ready" write)
        self._lock = threading.Lock()
        self._local = False
        self._broken: BaseException | None = None
        self._cancelled = False  # by this side, on its first fallback: CANCELLED is then no error
        self._stopping = False  # close(): the watchdog leaves once nothing is pending
        self._watchdog_error: BaseException | None = None
        self._last_event: Any = None
        self._reader = threading.Thread(target=self._read, name="tokensampler-colocated-reader", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="tokensampler-colocated-watchdog", daemon=True)
        self._reader.start()
        self._watchdog.start()

    # -- opening ---------------------------------------------------------------------------------------
    def _open(self, head: Any, num_samples: int, logprobs_mode: str, wait_timeout_s: float,
              params: dict[str, Any]) -> None:
        client, tag = self._client, f"colocated-{secrets.token_hex(6)}"
        source = self._register(client.register_cuda_region(f"{tag}-input", self._source))
        opened = pb.ColocateOpen(num_samples=num_samples, logprobs_mode=logprobs_mode_value(logprobs_mode),
                                 wait_timeout_ms=int(wait_timeout_s * 1000))
        if head is None:
            opened.logits.CopyFrom(source.view_of(self._source).ref())
        else:
            weight = self._register(client.register_cuda_region(f"{tag}-head", head))
            self._weights = f"{tag}-head"
            client.register_weights_from_region(self._weights, weight.view_of(head))
            opened.hidden.weights = self._weights
            opened.hidden.states_ref.CopyFrom(source.view_of(self._source).ref())
        opened.tokens.CopyFrom(self._register(client.register_cuda_region(f"{tag}-tokens", self.tokens))
                               .view_of(self.tokens).ref())
        if self.logprobs is not None:
            opened.logprobs.CopyFrom(self._register(client.register_cuda_region(f"{tag}-logprobs", self.logprobs))
                                     .view_of(self.logprobs).ref())
        flags = self._register(client.register_shm_region(f"{tag}-flags", FLAGS_BYTES))
        opened.flags = flags.name
        self._words = flags.buffer.numpy().view(np.uint32)  # zeroed by the kernel on creation
        self._flags_host = flags.buffer.data_ptr()
        self._flags = self._ops.register_host(self._flags_host, FLAGS_BYTES)
        fill_sampling_params(opened.params, self._source.shape[0], **params)

        self._requests: queue.SimpleQueue[pb.ColocateRequest | object] = queue.SimpleQueue()
        self._request_id = secrets.token_hex(8)

        def messages() -> Any:
            yield pb.ColocateRequest(open=opened)
            while (message := self._requests.get()) is not _DONE:
                yield message

        self._call = client._stub.Colocate(messages(), metadata=client._stream_metadata(self._request_id))
        try:
            answer = next(self._call)
        except grpc.RpcError as err:
            self._requests.put(_DONE)  # the request iterator's thread waits for it
            raise error_from_rpc(err, self._request_id) from None
        self.seeds = [int(seed) for seed in answer.seeds]
        """The seed of each row (drawn by the server where none was given)."""
        self._fallback.plan(self.seeds)

    def _register(self, region: Any) -> Any:
        self._regions.append(region)
        return region

    # -- steps -----------------------------------------------------------------------------------------
    def step(self, stream: Any = None) -> Any:
        """Samples the next step from `source` as written on `stream` (default: the current one) and returns
        `tokens`, whose values are there for the work queued on `stream` after this call. The host does not wait."""
        torch = self._torch
        stream = stream if stream is not None else torch.cuda.current_stream(self._device)
        n = self._step + 1
        if n > MAX_STEP:
            raise RuntimeError(f"step {n}: a colocated loop takes at most {MAX_STEP} steps; open another")
        with self._lock:
            local = self._local
        if local:
            self._fallback.sample(n, stream, self.tokens, self.logprobs)
        else:
            self._requests.put(pb.ColocateRequest(step=pb.ColocateStep(step=n)))  # first: it travels meanwhile
            raw = stream.cuda_stream
            self._ops.write(raw, self._flags + READY_OFFSET, n)
            reached = torch.cuda.Event()
            reached.record(stream)
            self._ops.wait_at_least(raw, self._flags + RELEASE_OFFSET, n)
            with self._lock:
                self._pending.append((n, reached))
        self._last_event = torch.cuda.Event()
        self._last_event.record(stream)
        self._step = n
        return self.tokens

    def _read(self) -> None:
        """The server's answers: one per step delivered; an error ends the loop's remote part."""
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as err:
            if not self._cancelled or err.code() != grpc.StatusCode.CANCELLED:
                self._broken = error_from_rpc(err, self._request_id)

    def _watch(self) -> None:
        """Falls back, step by step, where the server does not deliver (see the module's docstring)."""
        try:
            self._watch_steps()
        except BaseException as err:  # a fallback that failed: nothing more delivers the steps, close() says so
            log.exception("colocated loop %s: the watchdog stopped", self._request_id)
            self._watchdog_error = err

    def _watch_steps(self) -> None:
        poll_s = min(0.01, self._watchdog_s / 10)
        ready_since: float | None = None
        while True:
            with self._lock:
                head = self._pending[0] if self._pending else None
            if head is None:
                if self._stopping:
                    return
                time.sleep(poll_s)
                continue
            n, reached = head
            if int(self._words[RELEASE_OFFSET // 4]) >= n:
                ready_since = None
                with self._lock:
                    self._pending.popleft()
                continue
            if not reached.query():  # the engine's GPU has not reached the hand-off
                time.sleep(poll_s)
                continue
            now = time.monotonic()
            ready_since = ready_since if ready_since is not None else now
            reason = ("an earlier step fell back" if self._local else
                      f"the call ended: {self._broken}" if self._broken is not None else
                      f"step {n} not delivered within {self._watchdog_s:g} s" if now - ready_since > self._watchdog_s
                      else None)
            if reason is None:
                time.sleep(poll_s)
                continue
            self._fall_back(n, reason)
            ready_since = None
            with self._lock:
                self._pending.popleft()

    def _fall_back(self, n: int, reason: str) -> None:
        with self._lock:
            first = not self._local
            self._local = True
        # Every gate of the server's closes (the engine's stream wrote "ready n" before it reached this step): a late
        # step of the server's would otherwise copy a later input and write over a later step's tokens.
        self._words[READY_OFFSET // 4] = ABORT
        if first:
            log.warning("colocated loop %s: sampling in this process from step %d on (%s)", self._request_id, n, reason)
            self._cancelled = True
            self._call.cancel()  # the server ends its side: its waits end
        side = self._fallback.stream
        self._fallback.sample(n, side, self.tokens, self.logprobs)
        side.synchronize()
        self._words[RELEASE_OFFSET // 4] = n  # by this thread: the engine's stream is blocked on it
        self.fallbacks += 1

    # -- closing ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the loop once its steps are delivered (by the server or the watchdog) and the engine's stream has
        passed them; then unregisters the regions."""
        if self._flags_host == 0:
            return
        self._requests.put(_DONE)
        while True:
            with self._lock:
                if not self._pending:
                    break
            if not self._watchdog.is_alive():
                raise RuntimeError(f"colocated loop {self._request_id}: steps are left undelivered, the watchdog "
                                   f"stopped: {self._watchdog_error!r}")
            time.sleep(0.001)
        if self._last_event is not None:
            self._last_event.synchronize()  # no queued operation reads the flags any more
        self._stopping = True
        self._reader.join(timeout=self._watchdog_s + 5)
        self._watchdog.join(timeout=self._watchdog_s + 5)
        self._release()

    def _release(self) -> None:
        if self._flags_host:
            self._ops.unregister_host(self._flags_host)
            self._flags_host = 0
            self._words = None
        client = self._client
        for best_effort in ([lambda: client.unregister_weights(self._weights)] if self._weights else []) + [
                (lambda region=region: client.unregister_region(region.name)) for region in self._regions]:
            try:
                best_effort()
            except Exception as err:  # a server gone: nothing of it holds the memory any more
                log.debug("colocated loop: unregistering failed: %s", err)
        for region in self._regions:
            region.release()
        self._regions = []

    def __enter__(self) -> ColocatedLoop:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Fallback:
    """The loop's steps sampled in this process: a prepared call of tokensampler_server.inprocess, with the seeds
    the server drew, so its tokens are the server's."""

    def __init__(self, source: Any, head: Any, num_samples: int, logprobs: bool, logprobs_mode: str,
                 params: dict[str, Any]) -> None:
        try:
            from tokensampler_server.inprocess import LocalSampler
        except ImportError as err:
            raise RuntimeError("a colocated loop samples in this process when the server fails, which needs the "
                               f"tokensampler server package here (pip install tokensampler): {err}") from None
        import torch

        self._torch = torch
        self._source = source
        self._sampler = LocalSampler(str(source.device))
        self._head = self._sampler.register_head(head) if head is not None else None
        self._options = dict(num_samples=num_samples, return_logprobs=logprobs, logprobs_mode=logprobs_mode)
        self._params = params
        # From torch's pool of high-priority streams: not one of the engine's default-priority pooled streams, one
        # of which may be blocked at the very wait that a fallback step releases.
        self.stream = torch.cuda.Stream(source.device, priority=-1)
        self._lock = threading.Lock()

    def plan(self, seeds: list[int]) -> None:
        torch = self._torch
        params = {**self._params, "seed": seeds}
        vocab = None if self._head is not None else self._source.shape[1]
        self._call = self._sampler.prepare(self._source.shape[0], vocab, head=self._head, **self._options, **params)
        self._base_position = self._call.position.clone()
        # The call's stage went up on this stream; its fallback steps run on `stream`, which does not wait for it.
        torch.cuda.current_stream(self._source.device).synchronize()

    def sample(self, n: int, stream: Any, tokens: Any, logprobs: Any) -> None:
        torch = self._torch
        with self._lock, torch.cuda.stream(stream):
            torch.add(self._base_position, n - 1, out=self._call.position)
            out = self._call(self._source)
            tokens.copy_(out.tokens)
            if logprobs is not None:
                logprobs.copy_(out.logprobs)
