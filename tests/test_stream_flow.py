"""A SampleStream whose client never reads its answers: the server stops reading it once its window is full, so the
server's own objects for it stay bounded (how much more grpc's transport buffers is not the server's to bound)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable
from multiprocessing import shared_memory

import grpc
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.batching.batcher import DynamicBatcher
from tokensampler_server.core.config import Limits
from tokensampler_server.resources.regions import RegionRegistry
from tokensampler_server.rpc import sample_rpc
from tokensampler_server.rpc.call_record import CallRecord
from tokensampler_server.rpc.sample_rpc import SampleRpc
from tokensampler_server.rpc.stream_flow import STREAM_BYTES_IN_FLIGHT
from tokensampler_server.resources.weights import WeightRegistry

MESSAGE_ROWS, VOCAB = 1, 1 << 18  # 1 MiB of fp32 logits a message


async def _until_reading_stops(read: Callable[[], int], batcher: DynamicBatcher) -> None:
    """Waits until the server stops reading a stream (each message is sampled in a few ms), 30 s at most."""
    previous = -1
    for _ in range(600):
        await asyncio.sleep(0.05)
        if read() == previous and batcher.idle:
            return
        previous = read()


def _read_by_an_unread_stream(message: bytes, max_batch_rows: int) -> tuple[int, int]:
    """How many messages the server reads of an endless stream of `message` whose answers, but the first, are never
    read, and the bytes of Python objects it holds then."""
    read = 0

    async def requests():  # noqa: ANN202 - an endless client stream
        nonlocal read
        while True:
            read += 1
            yield message

    async def run() -> int:
        batcher = DynamicBatcher(CpuBackend(), max_batch_rows=max_batch_rows)
        path = SampleRpc(Limits(), batcher, WeightRegistry(torch.device("cpu")), RegionRegistry(), None)
        tracemalloc.start()
        answers = path.stream(requests(), "s")
        await answers.__anext__()  # the first answer; the client reads no more
        await _until_reading_stops(lambda: read, batcher)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        await answers.aclose()
        await batcher.close()
        return held

    held = asyncio.run(run())
    return read, held


def test_a_stream_is_not_read_past_its_bytes_in_flight() -> None:
    message = build_sample_request(logits=torch.zeros(MESSAGE_ROWS, VOCAB), seed=[1]).SerializeToString()
    bound = STREAM_BYTES_IN_FLIGHT // len(message)
    read, held = _read_by_an_unread_stream(message, 64)
    # the answered first message, `bound` unanswered ones, and one read and waiting for room
    assert bound <= read <= bound + 2, (read, bound)
    print(f"\nan unread stream: {read} messages read, {held / 2**20:.1f} MiB of Python objects held")
    # the window's request bytes, and the bytes the decoded logits view (one copy of the data each)
    assert held <= 2 * STREAM_BYTES_IN_FLIGHT + (4 << 20), held


def test_a_stream_is_not_read_past_the_answers_it_holds() -> None:
    """Small messages with large answers (4096 rows of 64 samples with log-probs: 8 KiB asked, 3 MiB answered) never
    read: the window counts each answer as its message is read, so an unread stream holds a few answers, not 64
    (48 such streams used to hold 6.4 GB)."""
    request = build_sample_request(logits=torch.zeros(4096, 1, dtype=torch.float16), seed=1, num_samples=64,
                                   return_logprobs=True)
    message = request.SerializeToString()
    bound = STREAM_BYTES_IN_FLIGHT // (len(message) + 4096 * (64 * 12 + 10))
    read, _ = _read_by_an_unread_stream(message, 4096)
    assert bound <= read <= bound + 2, (read, bound)


@contextlib.asynccontextmanager
async def _over_a_segment(size: int) -> AsyncIterator[tuple[SampleRpc, RegionRegistry, DynamicBatcher]]:
    """A CPU SampleRpc whose region "r" is a shared-memory segment of `size` bytes; all closed after."""
    segment = shared_memory.SharedMemory(create=True, size=size)
    batcher = DynamicBatcher(CpuBackend(), max_batch_rows=64)
    regions = RegionRegistry(allow_shm=True)
    try:
        regions.register(pb.RegisterRegionRequest(name="r", shm=pb.SharedMemorySource(key=segment.name,
                                                                                      byte_size=size)))
        yield SampleRpc(Limits(), batcher, WeightRegistry(torch.device("cpu")), regions, None), regions, batcher
        await batcher.close()
        await regions.unregister("r")
    finally:
        segment.close()
        segment.unlink()


@pytest.mark.parametrize("padding", [b"", b"\xc2\x3e\x80\x40" + b"\0" * 8192], ids=["small", "padded"])
def test_references_into_shared_memory_count_the_bytes_they_read(padding: bytes) -> None:
    """Messages of a few bytes that each reference 1 MiB of a shared-memory region: their start reads that MiB
    into the server, so the window counts it, and an unread stream stops being read at the same bound. Its
    sampled messages hold the region no longer than their batch. Padded with 8 KiB of an unknown field, they are
    counted the same (a size limit on the messages looked into let padded ones through uncounted)."""
    size = MESSAGE_ROWS * VOCAB * 4
    read = 0

    async def requests():  # noqa: ANN202 - an endless client stream
        nonlocal read
        request = build_sample_request(logits=torch.zeros(1, 1), seed=[1])
        request.logits_ref.CopyFrom(pb.TensorRef(region="r", dtype=pb.DTYPE_FLOAT32, shape=[MESSAGE_ROWS, VOCAB]))
        message = request.SerializeToString() + padding
        while True:
            read += 1
            yield message

    async def run() -> None:
        async with _over_a_segment(size) as (path, regions, batcher):
            answers = path.stream(requests(), "s")
            await answers.__anext__()
            await _until_reading_stops(lambda: read, batcher)
            bound = STREAM_BYTES_IN_FLIGHT // (size + len(padding))
            assert bound <= read <= bound + 2, (read, bound)
            # Sampled and unanswered, the messages no longer hold the region: it can be unregistered meanwhile.
            assert regions.in_flight(regions.list()[0]) == 0
            await answers.aclose()

    asyncio.run(run())


def test_a_large_shared_memory_input_is_read_off_the_event_loop(monkeypatch) -> None:
    """256 MiB read from a segment took 0.18 s of the event loop, every other call waiting: inputs past 1 MiB are
    read on a thread, smaller ones on the loop (a thread hop costs more than their read)."""
    read_on: list[bool] = []
    real = sample_rpc.referenced_input

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        read_on.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_rpc, "referenced_input", recording)

    async def run() -> None:
        async with _over_a_segment(4 << 20) as (path, _, _):
            for rows in (1, 4):  # fp16 [rows, 2^19]: 1 MiB, then 4 MiB
                request = build_sample_request(logits=torch.zeros(1, 1), seed=[1])
                request.logits_ref.CopyFrom(pb.TensorRef(region="r", dtype=pb.DTYPE_FLOAT16, shape=[rows, 1 << 19]))
                await path.unary(request, CallRecord(method="Sample", request_id=str(rows)))

    asyncio.run(run())
    assert read_on == [True, False]


class _HeldBackend(CpuBackend):
    """A CPU backend whose batches wait until `go` is set: their messages stay in flight meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def sample(self, batch):  # noqa: ANN001, ANN201 - the Backend interface
        self.go.wait(30)
        return super().sample(batch)


def test_streams_with_nothing_in_flight_parse_no_more_than_the_budget(monkeypatch) -> None:
    """Four streams, each sending one 17 MiB message (more than a window's bytes) while the first two are held in the
    backend, under a budget of 40 MiB: the first two are taken, the other two answered RESOURCE_EXHAUSTED without
    being parsed (each stream used to take its first message whatever the budget held: six 228 MiB messages under
    256 MiB were all parsed). A message of a window's bytes is still taken, and once the budget has room, so is the
    large one."""
    message = build_sample_request(logits=torch.zeros(1, 17 << 18), seed=[1]).SerializeToString()
    small = build_sample_request(logits=torch.zeros(1, 1 << 18), seed=[1]).SerializeToString()
    assert len(message) > STREAM_BYTES_IN_FLIGHT > len(small)
    begun = 0
    begin = SampleRpc._begin

    async def counted_begin(self, *args):  # noqa: ANN001, ANN202
        nonlocal begun
        begun += 1
        return await begin(self, *args)

    monkeypatch.setattr(SampleRpc, "_begin", counted_begin)

    async def one_message(stop: asyncio.Event, sent: bytes = message):  # noqa: ANN202 - left open after its message
        yield sent
        await stop.wait()

    async def run() -> None:
        backend = _HeldBackend()
        batcher = DynamicBatcher(backend, max_batch_rows=1, max_queue_bytes=40 << 20)
        path = SampleRpc(Limits(), batcher, WeightRegistry(torch.device("cpu")), RegionRegistry(), None)
        stop = asyncio.Event()
        streams = [path.stream(one_message(stop), f"s{i}") for i in range(4)]
        streams.append(path.stream(one_message(stop, small), "s-small"))
        pending = [asyncio.ensure_future(stream.__anext__()) for stream in streams[:2]]
        await asyncio.sleep(0.2)  # both taken and held in the backend
        refused = [await stream.__anext__() for stream in streams[2:4]]
        assert begun == 2
        small_answer = asyncio.ensure_future(streams[4].__anext__())
        await asyncio.sleep(0.2)
        assert begun == 3  # taken, held in the backend behind the first two
        for answer in refused:
            assert answer.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], answer
            assert "--max-queue-mb" in answer.error.message
        backend.go.set()
        for answer in await asyncio.gather(*pending, small_answer):
            assert answer.WhichOneof("result") == "response"
        stop.set()  # the streams end; so do their windows
        for stream in streams:
            assert [answer async for answer in stream] == []
        again = path.stream(one_message(stop), "s4")
        assert (await again.__anext__()).WhichOneof("result") == "response" and begun == 4
        await again.aclose()
        await batcher.close()

    asyncio.run(run())
