"""The Sample and SampleStream paths of the servicer: hold the weights and regions a request names,
validate it, queue it on the batcher, encode the answer.

Both methods take the request's bytes: on the CUDA backend the native path (native_path.py) takes the plain
requests (logits in a region or carried) from them, in C++, and its future gets response bytes; everything else
(and whatever it declines after all) is parsed here and takes the Python path. There a request is handled in two
halves: `start` runs synchronously up to the batcher's future, `finish` builds the response from the result. A
stream answers natively answered messages in one loop; from its first message on the Python path, a reader
starts each message as it arrives (so the batcher can merge them) without a task per message, and the stream
answers in order by awaiting the futures one after the other: the fewest event-loop turns per message
(docs/design/service-path.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor

from tokensampler_server.batching.batcher import BatchTimes, DynamicBatcher
from tokensampler_server.rpc.call_record import CallRecord, current_message_tracer
from tokensampler_server.rpc.input_scan import head_of
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument, ServiceError, bounded, failure_status, unparsable
from tokensampler_server.resources.leases import Lease
from tokensampler_server.rpc.metrics import ServerMetrics
from tokensampler_server.rpc.native_path import NativePath
from tokensampler_server.rpc.parsing import Parses
from tokensampler_server.resources.regions import OutputTarget, Region, RegionRegistry, referenced_bytes
from tokensampler_server.core.request_context import current_request_id
from tokensampler_server.core.threads import on_thread
from tokensampler_server.model.sampling import SamplingResult
from tokensampler_server.rpc.stream_flow import StreamBudget, StreamWindow
from tokensampler_server.validation.wire import UnusualWire
from tokensampler_server.validation.wire_counts import WireRefusal
from tokensampler_server.validation.sample import (
    LOGITS_DTYPES,
    DecodedLists,
    check_rows_shape,
    declared_rows,
    decode_token_lists,
    heavy_token_lists,
    validate_sample_request,
)
from tokensampler_server.resources.weights import WeightRegistry

STREAM_METHOD = "tokensampler.v1.Sampler/SampleStream"


async def _message_bytes(message: bytes | pb.SampleRequest, regions: RegionRegistry, limits: Limits,
                         parses: Parses) -> int:
    """What a stream message holds in the server once begun: its own bytes, the bytes of an input it references in
    a shared-memory region (read into memory when the message starts) and its answer until the client reads it.
    Found without parsing the rest of the message (input_scan.py), or by parsing it where the walk declines."""
    size = len(message) if isinstance(message, bytes) else message.ByteSize()
    try:  # counted before the head's parse too: its shapes and row offsets are repeated values
        if isinstance(message, bytes):
            await parses.count(message, pb.SampleRequest.DESCRIPTOR)
    except WireRefusal:
        return size  # its start answers its refusal
    try:
        head = head_of(message) if isinstance(message, bytes) else message
    except (UnusualWire, DecodeError):
        try:
            head = await parses.parse(as_request, message, pb.SampleRequest.DESCRIPTOR)
        except ServiceError:
            return size  # its start answers that it does not parse
    held = size + _answer_bytes(head, limits)
    ref, _ = _input_ref(head)
    if ref is not None and regions.copied(ref.region):
        held += referenced_bytes(ref)
    return held


def _answer_bytes(request: pb.SampleRequest, limits: Limits) -> int:
    """The most a request's result and answer hold, within the server's limits (an int64 token and a float32
    log-prob a sample, an id and a log-prob a top log-prob, a seed and the flags a row): 64 samples with log-probs
    of 4096 rows hold 3 MiB, and a client that does not read its answers used to hold 64 of them a stream."""
    rows = min(declared_rows(request), limits.max_batch_rows)
    samples = min(request.num_samples if request.HasField("num_samples") else 1, limits.max_num_samples)
    top = min(request.top_logprobs, limits.max_top_logprobs)
    return rows * (samples * (12 if request.return_logprobs else 8) + 12 * top + 10)


_READ_ON_LOOP_BYTES = 1 << 20
"""Shared-memory input read on the event loop up to this (well under a millisecond); larger on a thread (256 MiB
took 0.18 s, during which every other call waited)."""


def as_request(message: bytes | pb.SampleRequest, which: str = "") -> pb.SampleRequest:
    """The request a Sample / SampleStream message holds (its bytes, or an already parsed message); `which` as
    for errors.unparsable."""
    if not isinstance(message, bytes):
        return message
    try:
        return pb.SampleRequest.FromString(message)
    except DecodeError as err:
        raise unparsable(message, err, which) from None


def _input_ref(request: pb.SampleRequest) -> tuple[pb.TensorRef | pb.RowsRef | None, str]:
    """The region reference holding the request's input tensor, if any, and its field name."""
    kind = request.WhichOneof("input")
    if kind in ("logits_ref", "logits_rows"):
        return getattr(request, kind), kind
    if kind == "hidden" and request.hidden.HasField("states_ref"):
        return request.hidden.states_ref, "hidden.states_ref"
    return None, ""


def max_input_bytes(limits: Limits) -> int:
    """The most bytes an input tensor in a region may take: the batch's element limit in float32, the widest
    input dtype (its exact shape is checked after)."""
    return limits.max_batch_elements * 4


def referenced_input(region: Region, ref: pb.TensorRef | pb.RowsRef, field: str, limits: Limits) -> torch.Tensor:
    """The input tensor a region reference (`field`, from _input_ref) names in `region`: logits_rows' rows are
    bounded by the limits before they are copied together."""
    if field == "logits_rows":
        check_rows_shape(ref, limits)
        return region.rows(ref, field, LOGITS_DTYPES)
    return region.tensor(ref, field, LOGITS_DTYPES, max_input_bytes(limits))


def _output_refs(request: pb.SampleRequest) -> list[tuple[str, pb.TensorRef]]:
    if not request.HasField("output"):
        return []
    return [(name, getattr(request.output, name)) for name in ("tokens", "logprobs") if request.output.HasField(name)]


def _output_target(
    region: Region, ref: pb.TensorRef, name: str, shape: tuple[int, int], return_logprobs: bool
) -> OutputTarget:
    """Where output `name` ("tokens": int32, "logprobs": float32) of shape [B, num_samples] goes."""
    field = f"output.{name}"
    if name == "logprobs" and not return_logprobs:
        raise InvalidArgument(field, "set without return_logprobs; expected return_logprobs = true")
    target = region.target(ref, field, (pb.DTYPE_INT32,) if name == "tokens" else (pb.DTYPE_FLOAT32,))
    if tuple(target.shape) != shape:
        raise InvalidArgument(f"{field}.shape", f"got {list(target.shape)}, expected [B, num_samples] = {list(shape)}")
    return target


def _check_apart(targets: dict[str, OutputTarget]) -> None:
    """Two outputs in one region must not share a byte: the second write would overwrite the first's tokens."""
    if len(targets) < 2:
        return
    tokens, logprobs = targets["tokens"], targets["logprobs"]
    if tokens.region is logprobs.region and tokens.offset < logprobs.offset + logprobs.nbytes and \
            logprobs.offset < tokens.offset + tokens.nbytes:
        raise InvalidArgument("output.logprobs.offset", f"{logprobs.offset} overlaps output.tokens (bytes "
                                                        f"{tokens.offset} to {tokens.offset + tokens.nbytes}); "
                                                        "expected outputs that share no byte")


def _encode_host(tensor: torch.Tensor, dtype: int, out: pb.Tensor) -> None:
    """tensors.encode_tensor for a CPU tensor already of the wire dtype: fewer torch calls on the hot path."""
    out.dtype = dtype
    out.shape[:] = tensor.shape
    out.data = tensor.contiguous().numpy().tobytes()


def encode_result(result: SamplingResult, seeds: np.ndarray) -> pb.SampleResponse:
    """Builds the response message of one sampled batch; tokens or log-probs set to None stay out."""
    response = pb.SampleResponse()
    if result.tokens is not None:
        _encode_host(result.tokens.to(torch.int32), pb.DTYPE_INT32, response.tokens)
    response.seeds.extend(seeds.tolist())
    response.valid.extend(result.valid.tolist())
    response.nan_detected.extend(result.nan_detected.tolist())
    if result.logprobs is not None:
        encode_tensor(result.logprobs, out=response.logprobs)
    if result.top_logprob_ids is not None:
        encode_tensor(result.top_logprob_ids.to(torch.int32), out=response.top_logprob_ids)
        encode_tensor(result.top_logprobs, out=response.top_logprobs)
    return response


@dataclass
class _Started:
    """A validated request queued on the batcher. The call holds its inputs (weight, input region) until its batch
    is done, the batcher's share of them until the backend is done with them; `outputs` (the output regions the
    answer is written to) until it is answered. So an answer left unread (a stream's client that does not read)
    holds no input region or weight that someone is unregistering."""

    call: CallRecord
    outputs: Lease
    future: asyncio.Future
    seeds: np.ndarray
    targets: dict[str, OutputTarget]
    arrived: int

    def drop(self) -> None:
        """The answer is no longer wanted: let the batcher skip it (which ends the inputs' hold) and release the
        outputs."""
        self.future.cancel()
        self.outputs.release()


_StreamItem = tuple[CallRecord, bytes | pb.SampleRequest | None, asyncio.Future | _Started | Exception, int]
"""A stream message: its record, the message (None once it has started on the Python path: its bytes are no
longer needed), what _begin made of it, and its size in the stream's window."""


def _stream_item(record: CallRecord, message: bytes | pb.SampleRequest, begun: asyncio.Future | _Started | Exception,
                 nbytes: int) -> _StreamItem:
    return record, None if isinstance(begun, _Started) else message, begun, nbytes


def _drop(begun: asyncio.Future | _Started | Exception) -> None:
    """A begun stream message whose answer is no longer wanted."""
    if isinstance(begun, _Started):
        begun.drop()
    elif isinstance(begun, asyncio.Future):
        begun.cancel()


HEAVY_DECODES = 2
"""Requests whose long token lists decode on threads at once. Each may expand to max_token_entries (2^25 entries,
16 bytes each) before the queue's bound can refuse it: 24 requests of 139 KB, each one list shared by 4096 rows, took
the server from 0.7 to 5.7 GB, as many at once as the thread pool ran."""


class SampleRpc:
    """Sample and SampleStream over one batcher, weight registry and region registry."""

    def __init__(self, limits: Limits, batcher: DynamicBatcher, registry: WeightRegistry, regions: RegionRegistry,
                 metrics: ServerMetrics | None, native: NativePath | None = None) -> None:
        self._limits = limits
        self._batcher = batcher
        self._registry = registry
        self._regions = regions
        self._metrics = metrics
        self._native = native
        # streams' unanswered messages together: as much as the queue may hold
        self._stream_budget = StreamBudget(batcher.max_queue_bytes)
        self._heavy_decodes = asyncio.Semaphore(HEAVY_DECODES)
        self._parses = Parses(limits)

    def _submit_natively(self, message: bytes | pb.SampleRequest, call: CallRecord,
                         stream_message: bool) -> asyncio.Future | None:
        """`message` queued on the native path (the future of its answer), or None when the path declines it."""
        if self._native is None or not isinstance(message, bytes):
            return None
        return self._native.submit(message, call.request_id, stream_message)

    @staticmethod
    async def _native_response(pending: asyncio.Future, call: CallRecord) -> bytes | None:
        """The response bytes of a request submitted natively (its stages recorded in `call`), or None when
        the native path declined it after all."""
        answer = await pending
        if answer is None:
            return None
        call.row_modes = answer.rows_by_mode
        call.decode_ns, call.queue_ns = answer.decode_ns, answer.queue_ns
        call.compute_ns, call.encode_ns = answer.compute_ns, answer.encode_ns
        return answer.response

    async def _parsed(self, message: bytes | pb.SampleRequest, call: CallRecord,
                      which: str = "") -> pb.SampleRequest:
        """as_request (a large message on a thread: parsing.py), timed into the call's parse time (the deserialize
        metric)."""
        if not isinstance(message, bytes):
            return message
        started = time.perf_counter_ns()
        request = await self._parses.parse(lambda raw: as_request(raw, which), message, pb.SampleRequest.DESCRIPTOR,
                                           timed=call)
        call.parse_ns += time.perf_counter_ns() - started
        return request

    async def _begin(self, message: bytes | pb.SampleRequest,
                     call: CallRecord) -> asyncio.Future | _Started | Exception:
        """A stream message submitted natively (its future), started on the Python path, or its error."""
        try:
            pending = self._submit_natively(message, call, stream_message=True)
        except Exception as err:  # noqa: BLE001 - answered as this message's error
            return err
        return pending if pending is not None else await self._begin_python(message, call)

    async def _begin_python(self, message: bytes | pb.SampleRequest, call: CallRecord) -> _Started | Exception:
        """A stream message started on the Python path, or its error. Bytes that do not parse raise: they end
        the stream."""
        try:
            request = await self._parsed(message, call)
        except WireRefusal as err:  # it parses: answered as this message's error, and the stream goes on
            return err
        except InvalidArgument:  # bytes that do not parse end the stream; parsed again, its status names the message
            index = call.request_id.rsplit(".", 1)[-1]  # _stream_record's numbering
            await self._parsed(message, call, f"message {index} of the stream (request id {call.request_id}): ")
            raise
        try:
            return await self.start(request, call, await self._token_lists(request))
        except Exception as err:  # noqa: BLE001
            return err

    async def _token_lists(self, request: pb.SampleRequest) -> DecodedLists | None:
        """The request's token lists decoded on a thread when they are long (millions of ids take seconds, which
        would stall every other call on the event loop); None when validation may decode them itself."""
        if not heavy_token_lists(request):
            return None
        async with self._heavy_decodes:
            return await asyncio.to_thread(decode_token_lists, request, self._limits)

    async def _read_input(self, region: Region, ref: pb.TensorRef | pb.RowsRef, field: str,
                          held: Lease) -> torch.Tensor:
        """The referenced input: a view of a CUDA region, or the bytes of a shared-memory one, read on a thread when
        large. The thread holds a share of the request's lease until its read ends, also when the call is
        cancelled meanwhile (the region must not go under the read)."""
        if region.kind != "shm" or referenced_bytes(ref) <= _READ_ON_LOOP_BYTES:
            return referenced_input(region, ref, field, self._limits)
        share = held.share()

        def read() -> torch.Tensor:
            try:
                return referenced_input(region, ref, field, self._limits)
            finally:
                share.release()

        return await on_thread(read, share.release)

    async def start(self, request: pb.SampleRequest, call: CallRecord,
                    token_lists: DecodedLists | None = None) -> _Started:
        """Holds what the request names, validates it and queues it (errors raise here). `token_lists`: the
        request's lists already decoded (_token_lists)."""
        held, answered = Lease(), Lease()  # the inputs, and the output regions
        try:
            lm_head = None
            if request.WhichOneof("input") == "hidden":
                lm_head = held.enter(self._registry.use(request.hidden.weights))
            referenced = None
            ref, field = _input_ref(request)
            if ref is not None:
                region = held.enter(self._regions.use(ref.region, f"{field}.region"))
                referenced = await self._read_input(region, ref, field, held)
            outputs = [
                (name, answered.enter(self._regions.use(out.region, f"output.{name}.region")), out)
                for name, out in _output_refs(request)
            ]
            arrived = time.perf_counter_ns()
            batch, seeds = validate_sample_request(request, self._limits, lm_head=lm_head, referenced=referenced,
                                                   token_lists=token_lists)
            targets = {
                name: _output_target(region, out, name, (batch.num_rows, batch.num_samples), request.return_logprobs)
                for name, region, out in outputs
            }
            _check_apart(targets)
            submitted = time.perf_counter_ns()
            call.batch, call.decode_ns = batch, submitted - arrived
            future = self._batcher.enqueue(batch, held)
        except BaseException:
            held.release()
            answered.release()
            raise
        future.add_done_callback(lambda _: held.release())
        return _Started(call, answered, future, seeds, targets, arrived)

    @staticmethod
    def finish(started: _Started, result: SamplingResult, times: BatchTimes) -> pb.SampleResponse:
        """The response of a sampled request: outputs written to their regions, the rest encoded."""
        finished = time.perf_counter_ns()
        call, targets = started.call, started.targets
        call.queue_ns, call.compute_ns = times.queue_ns, times.compute_ns
        if "tokens" in targets:
            targets["tokens"].write(result.tokens)
            result = replace(result, tokens=None)
        if "logprobs" in targets:
            targets["logprobs"].write(result.logprobs)
            result = replace(result, logprobs=None)
        response = encode_result(result, started.seeds)
        response.request_id = call.request_id
        timings = response.timings
        timings.queue_ns = times.queue_ns
        timings.compute_ns = times.compute_ns
        encoded = time.perf_counter_ns()
        call.encode_ns = encoded - finished
        timings.total_ns = encoded - started.arrived
        return response

    async def unary(self, message: bytes | pb.SampleRequest, call: CallRecord) -> bytes | pb.SampleResponse:
        pending = self._submit_natively(message, call, stream_message=False)
        if pending is not None and (response := await self._native_response(pending, call)) is not None:
            return response
        request = await self._parsed(message, call)
        started = await self.start(request, call, await self._token_lists(request))
        with started.outputs:
            result, times = await started.future
            return self.finish(started, result, times)

    async def stream(
        self, requests: AsyncIterator[bytes | pb.SampleRequest], stream_id: str
    ) -> AsyncIterator[bytes | pb.SampleStreamResponse]:
        """Answers each message in order; a failed message gets an error message of its own and the stream
        goes on. While the native path answers every message, one loop reads and answers them (no task, no
        queue: 25-70 µs a message less on an H200 host, docs/design/service-path.md); from the first message it
        does not answer, the rest of the stream is pipelined (`_pipelined`)."""
        messages = aiter(requests)
        window = self._stream_budget.window()
        try:
            index = 0
            async for message in messages:
                record = self._stream_record(stream_id, index)
                index += 1
                nbytes = await _message_bytes(message, self._regions, self._limits, self._parses)
                if not await window.admit(nbytes):  # answered here: the stream stays on this loop
                    yield await self._answer(record, message, window.refusal(nbytes))
                    window.answered(0)
                    continue
                begun = await self._begin(message, record)
                if not isinstance(begun, asyncio.Future):
                    first = _stream_item(record, message, begun, nbytes)
                    # closed before the window, so that its reader is cancelled before the window lets go
                    async with contextlib.aclosing(self._pipelined(messages, stream_id, index, first, window)) as rest:
                        async for answer in rest:
                            yield answer
                    return
                yield await self._answer(record, message, begun)
                window.answered(nbytes)
        finally:
            window.close()

    async def _admitted(self, window: StreamWindow, message: bytes | pb.SampleRequest,
                        record: CallRecord) -> tuple[asyncio.Future | _Started | Exception, int]:
        """(what _begin makes of a stream message once the stream's window takes it, the bytes counted for it); a
        message the window refuses (other streams' messages fill the budget) is answered RESOURCE_EXHAUSTED without
        being parsed."""
        nbytes = await _message_bytes(message, self._regions, self._limits, self._parses)
        if not await window.admit(nbytes):
            return window.refusal(nbytes), 0
        return await self._begin(message, record), nbytes

    @staticmethod
    def _stream_record(stream_id: str, index: int) -> CallRecord:
        record = CallRecord(method=STREAM_METHOD, request_id=f"{stream_id}.{index}")
        record.start()
        current_request_id.set(record.request_id)  # the batcher runs the backend in this context
        return record

    async def _pipelined(
        self, messages: AsyncIterator[bytes | pb.SampleRequest], stream_id: str, index: int, first: _StreamItem,
        window: StreamWindow,
    ) -> AsyncIterator[bytes | pb.SampleStreamResponse]:
        """Starts each message as it arrives (so the batchers can merge them) and answers them in order,
        beginning with `first`, the message of number index - 1, which `window` counts already."""
        answers: asyncio.Queue[_StreamItem | None] = asyncio.Queue()
        answers.put_nowait(first)

        async def read() -> None:
            number = index
            async for message in messages:
                record = self._stream_record(stream_id, number)
                number += 1
                begun, nbytes = await self._admitted(window, message, record)
                answers.put_nowait(_stream_item(record, message, begun, nbytes))

        async def read_then_end() -> None:
            """Reads to the end of the stream, then marks the end (also after a request that did not parse)."""
            try:
                await read()
            except asyncio.CancelledError:  # the answers' side is gone: nobody to tell
                raise
            except BaseException:
                await answers.put(None)
                raise
            await answers.put(None)

        reader = asyncio.ensure_future(read_then_end())
        # Its end is read below, or, when this generator is closed first, retrieved here (no "never retrieved" log).
        reader.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            while (item := await answers.get()) is not None:
                yield await self._answer(*item[:3])
                window.answered(item[3])
            await reader  # a request that did not parse ends the stream with its status
        finally:
            reader.cancel()
            while not answers.empty():
                item = answers.get_nowait()
                if item is not None:
                    _drop(item[2])

    def _report(self, record: CallRecord, code: grpc.StatusCode) -> None:
        """A stream message, reported like a unary call: its span (with tracing on), then the metrics (at the next
        scrape; they trade the message's batch for its row counts, which the span reads first)."""
        elapsed_ns = record.elapsed_ns()
        trace = current_message_tracer.get()
        if trace is not None:
            trace(record, code, elapsed_ns)
        if self._metrics is not None:
            self._metrics.observe_call_later(record, code, elapsed_ns)

    def _answer_native(self, record: CallRecord, response: bytes) -> bytes:
        """A natively answered stream message, reported like every call."""
        self._report(record, grpc.StatusCode.OK)
        return response

    async def _answer(self, record: CallRecord, message: bytes | pb.SampleRequest,
                      started: asyncio.Future | _Started | Exception) -> bytes | pb.SampleStreamResponse:
        """One stream message's answer, reported like a unary call."""
        current_request_id.set(record.request_id)
        code, error = grpc.StatusCode.OK, ""
        if isinstance(started, asyncio.Future):
            try:
                response = await self._native_response(started, record)
            except Exception as err:  # noqa: BLE001 - answered below as this message's error
                started = err
            else:
                if response is not None:
                    return self._answer_native(record, response)
                started = await self._begin_python(message, record)
        try:
            if isinstance(started, Exception):
                raise started
            with started.outputs:
                result, times = await started.future
                return pb.SampleStreamResponse(response=self.finish(started, result, times))
        except Exception as err:
            code, error = failure_status(err, record.method, record.request_id)
        finally:
            self._report(record, code)
        text = f"{bounded(error)} (request id {record.request_id})"
        return pb.SampleStreamResponse(error=pb.StreamError(code=code.value[0], message=text, request_id=record.request_id))
