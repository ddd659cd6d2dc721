"""The Colocate RPC: decode loops colocated on the server's GPU, their steps handed off on the GPU
(docs/colocated.md; the GPU side is backends/cuda_handoff.py).

A loop is one call. Its first message opens it over the engine's registered regions, which it holds until it
ends; each later message announces a step, queued on the loop's stream at once, up to MAX_STEPS_AHEAD past the
last delivered one (the host never waits for the GPU on a step's way). A thread of the loop's waits for each
step's event in turn and the call answers it. The loop ends, its waits ended by an abort, when the engine closes
the call (after its steps are answered), when the call breaks (the engine gone: at once), when a step's input is
not ready within the wait timeout (DEADLINE_EXCEEDED), or when one of its regions is unregistered
(FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, aclosing

import grpc
import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.handoff import MAX_STEP

from tokensampler_server.backends.base import Backend
from tokensampler_server.backends.cuda_handoff import Handoff
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument, ServiceError
from tokensampler_server.resources import gpu_waits
from tokensampler_server.resources.flags import MappedFlags
from tokensampler_server.resources.regions import Region, RegionRegistry
from tokensampler_server.resources.weights import RegisteredWeight, WeightRegistry
from tokensampler_server.rpc.sample_rpc import max_input_bytes
from tokensampler_server.validation.prepared import validate_prepared_request
from tokensampler_server.validation.sample import LOGITS_DTYPES

DEFAULT_WAIT_TIMEOUT_MS = 10_000
MAX_WAIT_TIMEOUT_MS = 600_000
DEFAULT_MAX_LOOPS = 8
_TOKEN_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)
_POSITION_LIMIT = 2**32  # positions are uint32 (SamplingParams.position)
_DRAIN_TIMEOUT_S = 10.0
MAX_STEPS_AHEAD = 4
"""Steps a loop queues on the GPU beyond the last delivered one; a later announcement waits for room. An engine
runs one or two steps ahead; the bound keeps an engine that never marks its input ready from filling the GPU's
launch queue (where a launch would block the event loop), and bounds the work queued when a loop ends."""
log = logging.getLogger(__name__)
# Loops whose stream did not drain, with their flags: the GPU may still poll the flags and the loop's stop word,
# so both stay pinned for good.
_STILL_POLLED: list[tuple[MappedFlags, _Loop]] = []


def _close_flags(flags: MappedFlags, decode: _Loop) -> None:
    if decode.drained:
        gpu_waits.when_idle(flags.close)  # unpinning waits for every stream of the GPU, a stuck loop's too
    else:
        log.error("a colocated loop's stream did not drain within %g s after its end; its flags stay pinned",
                  _DRAIN_TIMEOUT_S)
        _STILL_POLLED.append((flags, decode))


class ColocatedLoops:
    """The live loops of one server, at most `max_loops` at once (each holds a stream and a thread)."""

    def __init__(self, backend: Backend, limits: Limits, weights: WeightRegistry, regions: RegionRegistry,
                 max_loops: int = DEFAULT_MAX_LOOPS) -> None:
        self._backend = backend
        self._limits = limits
        self._weights = weights
        self._regions = regions
        self._max_loops = max_loops
        self._flags_in_use: set[str] = set()
        self._waiters = ThreadPoolExecutor(max_loops, thread_name_prefix="colocated")

    async def serve(self, requests: AsyncIterator[pb.ColocateRequest],
                    request_id: str) -> AsyncIterator[pb.ColocateResponse]:
        device = self._backend.device
        if device.type != "cuda":
            raise ServiceError("Colocate: this server samples on the CPU; a colocated loop needs its CUDA backend",
                               grpc.StatusCode.FAILED_PRECONDITION)
        first = await anext(aiter(requests), None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidArgument("open", "expected the call's first message to open the loop")
        opened = first.open
        if len(self._flags_in_use) >= self._max_loops:
            raise ServiceError(f"Colocate: {self._max_loops} loops are open, the most this server holds; close "
                               "one first", grpc.StatusCode.RESOURCE_EXHAUSTED)
        if opened.flags in self._flags_in_use:
            raise ServiceError(f"open.flags: region {opened.flags!r} holds the flags of an open loop",
                               grpc.StatusCode.FAILED_PRECONDITION)
        self._flags_in_use.add(opened.flags)
        try:
            with ExitStack() as held:
                regions: list[Region] = []
                handoff, flags, seeds = self._open(opened, held, regions)
                decode = _Loop(handoff, opened, self._waiters)
                held.callback(_close_flags, flags, decode)  # last: after the loop's stream has drained
                for region in regions:
                    region.on_unregister.add(decode.let_go)
                    held.callback(region.on_unregister.discard, decode.let_go)
                yield pb.ColocateResponse(step=0, seeds=[int(s) for s in seeds], request_id=request_id)
                # Closed here, however this call ends, so that the loop's end (the abort and the drain) comes
                # before its flags and regions are let go.
                async with aclosing(decode.run(requests)) as answers:
                    async for answer in answers:
                        answer.request_id = request_id
                        yield answer
        finally:
            self._flags_in_use.discard(opened.flags)

    def _open(self, opened: pb.ColocateOpen, held: ExitStack,
              regions: list[Region]) -> tuple[Handoff, MappedFlags, np.ndarray]:
        """Checks the opening message, holds its regions (listed in `regions`) and weight in `held`, plans the
        call: (its hand-off, the flags, the rows' seeds)."""
        device = self._backend.device
        kind = opened.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("open.input", "not set; expected logits or hidden")
        head: RegisteredWeight | None = None
        if kind == "logits":
            source = self._cuda_tensor(held, regions, opened.logits, "open.logits", LOGITS_DTYPES, 2)
            vocab_size = source.shape[1]
        else:
            if not opened.hidden.HasField("states_ref"):
                raise InvalidArgument("open.hidden.states_ref", "not set; expected the hidden states' region")
            if opened.hidden.HasField("states"):
                raise InvalidArgument("open.hidden.states", "set; a loop reads its states from states_ref alone")
            head = held.enter_context(self._weights.use(opened.hidden.weights, "open.hidden.weights"))
            if head.weight.device != device:
                raise ServiceError(f"open.hidden.weights: {opened.hidden.weights!r} is on {head.weight.device}, "
                                   f"expected the server's GPU ({device})", grpc.StatusCode.FAILED_PRECONDITION)
            source = self._cuda_tensor(held, regions, opened.hidden.states_ref, "open.hidden.states_ref", LOGITS_DTYPES, 2)
            if source.shape[1] != head.weight.shape[1]:
                raise InvalidArgument("open.hidden.states_ref.shape", f"got {list(source.shape)}, expected [B, "
                                      f"{head.weight.shape[1]}] (the weight's hidden size)")
            vocab_size = head.finish.vocab_size
        batch_size = source.shape[0]
        num_samples = opened.num_samples or 1
        outputs = (batch_size, num_samples)  # (B, num_samples), checked before the regions' bounds
        tokens = self._cuda_tensor(held, regions, opened.tokens, "open.tokens", _TOKEN_DTYPES, 2, outputs)
        logprobs = None
        if opened.HasField("logprobs"):
            logprobs = self._cuda_tensor(held, regions, opened.logprobs, "open.logprobs", (pb.DTYPE_FLOAT32,), 2,
                                         outputs)
        if opened.wait_timeout_ms > MAX_WAIT_TIMEOUT_MS:
            raise InvalidArgument("open.wait_timeout_ms", f"got {opened.wait_timeout_ms}, expected at most "
                                  f"{MAX_WAIT_TIMEOUT_MS} (0: {DEFAULT_WAIT_TIMEOUT_MS})")
        request = pb.SampleRequest(num_samples=num_samples, return_logprobs=logprobs is not None,
                                   logprobs_mode=opened.logprobs_mode, params=opened.params)
        if head is None:
            request.logits_ref.SetInParent()
        else:
            request.hidden.states_ref.SetInParent()
        template, seeds = validate_prepared_request(request, self._limits, batch_size, vocab_size, head, "open.params")
        flags_region = held.enter_context(self._regions.use(opened.flags, "open.flags"))
        regions.append(flags_region)
        flags = MappedFlags(flags_region, "open.flags")
        try:
            with torch.cuda.device(device):
                handoff = Handoff(device, self._backend.prepare(template, head), source, tokens, logprobs, flags)
        except BaseException:
            flags.close()
            raise
        held.callback(handoff.release)  # a loop that never queued a step: its idle streams
        return handoff, flags, seeds

    def _cuda_tensor(self, held: ExitStack, regions: list[Region], ref: pb.TensorRef, field: str,
                     dtypes: tuple[int, ...], dims: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor `ref` names in a CUDA region on the server's GPU, the region held in `held`; `shape`: the one
        it must have."""
        region: Region = held.enter_context(self._regions.use(ref.region, f"{field}.region"))
        regions.append(region)
        device = self._backend.device
        if region.buffer is None or region.device != device:
            raise ServiceError(f"{field}.region: region {ref.region!r} is on {region.device}; expected a CUDA region "
                               f"on the server's GPU ({device})", grpc.StatusCode.FAILED_PRECONDITION)
        if len(ref.shape) != dims or any(dim < 1 for dim in ref.shape):
            raise InvalidArgument(f"{field}.shape", f"got {list(ref.shape)}, expected {dims} sizes of at least 1")
        if ref.shape[0] > self._limits.max_batch_rows:
            raise InvalidArgument(f"{field}.shape", f"got {ref.shape[0]} rows, expected at most "
                                  f"{self._limits.max_batch_rows}")
        if shape is not None and tuple(ref.shape) != shape:
            raise InvalidArgument(f"{field}.shape", f"got {list(ref.shape)}, expected {list(shape)}")
        return region.tensor(ref, field, dtypes, max_input_bytes(self._limits))


class _Loop:
    """One open loop: its steps queued as they are announced, answered as the GPU finishes them."""

    def __init__(self, handoff: Handoff, opened: pb.ColocateOpen, waiters: ThreadPoolExecutor) -> None:
        self._handoff = handoff
        self._waiters = waiters
        self._timeout_s = (opened.wait_timeout_ms or DEFAULT_WAIT_TIMEOUT_MS) / 1000
        self._last_step = min(MAX_STEP, _POSITION_LIMIT - max(opened.params.position, default=0))
        self._queue: asyncio.Queue[tuple[int, torch.cuda.Event, int] | BaseException | None] = asyncio.Queue()
        self._ended: ServiceError | None = None
        self._ended_event = asyncio.Event()
        self._done = 0  # the last step delivered
        self._queued = 0  # the last step queued on the GPU
        self._announced = 0  # the last step announced
        self._read_all = False  # the engine closed its side: once every announced step is queued, the loop ends
        self._last_queued = False  # the loop's last item (None) is in the queue
        self._events: asyncio.AbstractEventLoop | None = None
        self.drained = True
        """Whether the loop's stream is known to have drained (else its flags must stay pinned); true until a step
        is queued."""
        self._timers: dict[int, asyncio.TimerHandle] = {}  # by step; all cancelled at the end, as an abort after it
        # would write to unpinned flags
        self._late_drain: asyncio.Future | None = None

    def let_go(self) -> None:
        """A region of the loop's is being unregistered: the loop ends."""
        self._end(ServiceError("Colocate: a region of the loop was unregistered; the loop ended",
                               grpc.StatusCode.FAILED_PRECONDITION))

    def _end(self, reason: ServiceError) -> None:
        if self._ended is None:
            self._ended = reason
            self._ended_event.set()
            self._handoff.abort()
            self._queue.put_nowait(reason)

    def _expire(self, step: int) -> None:
        if self._done < step:
            self._end(ServiceError(f"step {step}: the engine did not mark its input ready within "
                                   f"{self._timeout_s:g} s (open.wait_timeout_ms); the loop ended",
                                   grpc.StatusCode.DEADLINE_EXCEEDED))

    async def run(self, requests: AsyncIterator[pb.ColocateRequest]) -> AsyncIterator[pb.ColocateResponse]:
        events = self._events = asyncio.get_running_loop()
        reader = asyncio.ensure_future(self._read(requests))
        clean = False
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    clean = True
                    return
                if isinstance(item, BaseException):
                    raise item
                step, done, queued = item
                synchronized = events.run_in_executor(self._waiters, done.synchronize)
                ended = asyncio.ensure_future(self._ended_event.wait())
                await asyncio.wait({synchronized, ended}, return_when=asyncio.FIRST_COMPLETED)
                ended.cancel()
                if self._ended is not None:  # at once: the GPU's wait may end later, or (stuck) never
                    raise self._ended
                if synchronized.exception() is not None:
                    self._end(ServiceError(f"step {step}: the GPU failed ({synchronized.exception()}); the loop "
                                           "ended", grpc.StatusCode.INTERNAL))
                    raise self._ended
                self._done = step
                self._timers.pop(step).cancel()
                self._queue_steps()
                if self._queued == self._done:  # nothing of the loop's waits on the GPU
                    gpu_waits.end(self)
                elapsed = time.perf_counter_ns() - queued
                yield pb.ColocateResponse(step=step, timings=pb.Timings(compute_ns=elapsed, total_ns=elapsed))
        finally:
            reader.cancel()
            if not clean:
                self._end(ServiceError("Colocate: the call ended", grpc.StatusCode.CANCELLED))
            # Every wait ended (all answered, or the abort): the stream drains in a moment.
            drain = events.run_in_executor(self._waiters, self._handoff.drain, _DRAIN_TIMEOUT_S)
            drain.add_done_callback(self._after_drain)  # also when this call is cancelled meanwhile
            self.drained = await asyncio.shield(drain)
            for timer in self._timers.values():
                timer.cancel()

    def _after_drain(self, drain: asyncio.Future) -> None:
        """The releases held back while the loop had steps queued may go once its stream has drained; a stream that
        did not drain in time is asked again until it has (the GPU may still wait on it meanwhile)."""
        if not drain.cancelled() and drain.exception() is None and drain.result():
            gpu_waits.end(self)
        else:
            self._late_drain = asyncio.ensure_future(self._end_once_drained())

    async def _end_once_drained(self) -> None:
        while not self._handoff.drain(0):  # one query of the streams: no thread held
            await asyncio.sleep(_DRAIN_TIMEOUT_S)
        log.info("a colocated loop's stream drained late; the GPU mappings held back for it are released")
        gpu_waits.end(self)

    async def _read(self, requests: AsyncIterator[pb.ColocateRequest]) -> None:
        """Reads every announcement as it comes (so a broken call ends the loop at once) and queues the steps there
        is room for."""
        expected = 1
        try:
            async for message in requests:
                if message.WhichOneof("kind") != "step":
                    raise InvalidArgument("step", "expected a step announcement after the opening message")
                step = message.step.step
                if step != expected:
                    raise InvalidArgument("step.step", f"got {step}, expected {expected} (one more than the last)")
                if step > self._last_step:
                    raise ServiceError(f"step.step: step {step} would sample past position 2^32 - 1 or the last "
                                       f"step {MAX_STEP}; open a new loop", grpc.StatusCode.OUT_OF_RANGE)
                if self._ended is not None:
                    return
                self._announced = step
                self._queue_steps()
                expected += 1
            self._read_all = True
            self._queue_steps()
        except ServiceError as err:
            self._end(err)
        except Exception as err:  # the call broke under the reader (the engine gone)
            self._end(ServiceError(f"Colocate: the call broke ({err})", grpc.StatusCode.CANCELLED))

    def _queue_steps(self) -> None:
        """Queues announced steps on the GPU while at most MAX_STEPS_AHEAD lie past the last delivered one; once the
        engine has closed its side and every step is queued, the loop's last item."""
        while self._ended is None and self._queued < self._announced and self._queued - self._done < MAX_STEPS_AHEAD:
            step = self._queued + 1
            queued = time.perf_counter_ns()
            self.drained = False
            try:
                done = self._enqueue(step)
            except ServiceError as err:
                self._end(err)
                return
            self._queued = step
            gpu_waits.begin(self)
            self._timers[step] = self._events.call_later(self._timeout_s, self._expire, step)
            self._queue.put_nowait((step, done, queued))
        if self._ended is None and self._read_all and self._queued == self._announced and not self._last_queued:
            self._last_queued = True
            self._queue.put_nowait(None)

    def _enqueue(self, step: int) -> torch.cuda.Event:
        """Handoff.enqueue, its failures as the loop's status."""
        try:
            return self._handoff.enqueue(step)
        except torch.cuda.OutOfMemoryError as err:
            raise ServiceError(f"step {step}: the server's GPU is out of memory ({err}); the loop ended",
                               grpc.StatusCode.RESOURCE_EXHAUSTED) from None
        except Exception as err:  # noqa: BLE001 - a launch that failed: the server's fault, not the call's
            raise ServiceError(f"step {step}: queueing it on the GPU failed ({err}); the loop ended",
                               grpc.StatusCode.INTERNAL) from None
