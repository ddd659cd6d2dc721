"""A SampleStream whose client never reads its answers holds a bounded amount of the server's memory."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import grpc
import torch
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.batcher import DynamicBatcher
from tokensampler_server.config import Limits
from tokensampler_server.regions import RegionRegistry
from tokensampler_server.sample_rpc import SamplePath
from tokensampler_server.stream_flow import STREAM_BYTES_IN_FLIGHT
from tokensampler_server.weights import WeightRegistry

from .conftest import start_server

MESSAGE_ROWS, VOCAB = 1, 1 << 18  # 1 MiB of fp32 logits a message


def test_a_stream_is_not_read_past_its_bytes_in_flight() -> None:
    message = build_sample_request(logits=torch.zeros(MESSAGE_ROWS, VOCAB), seed=[1]).SerializeToString()
    bound = STREAM_BYTES_IN_FLIGHT // len(message)
    read = 0

    async def requests():  # noqa: ANN202 - an endless client stream
        nonlocal read
        while True:
            read += 1
            yield message

    async def run() -> None:
        batcher = DynamicBatcher(CpuBackend(), max_batch_rows=64)
        path = SamplePath(Limits(), batcher, WeightRegistry(torch.device("cpu")), RegionRegistry(), None)
        tracemalloc.start()
        answers = path.stream(requests(), "s")
        await answers.__anext__()  # the first answer; the client reads no more
        previous = -1
        for _ in range(600):  # until reading stops: each message is sampled in a few ms
            await asyncio.sleep(0.05)
            if read == previous and batcher.idle:
                break
            previous = read
        # the answered first message, `bound` unanswered ones, and one read and waiting for room
        assert read <= bound + 2, (read, bound)
        assert read >= bound, (read, bound)  # it did read up to the bound
        held = tracemalloc.get_traced_memory()[0]
        print(f"\nan unread stream: {read} messages read, {held / 2**20:.1f} MiB of Python objects held")
        tracemalloc.stop()
        # the window's request bytes, and the bytes the decoded logits view (one copy of the data each)
        assert held <= 2 * STREAM_BYTES_IN_FLIGHT + (4 << 20), held
        await answers.aclose()
        await batcher.close()

    asyncio.run(run())


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_streams_that_are_never_read_hold_bounded_server_memory() -> None:
    """4 streams offer 80 messages of 1 MiB each, whose answers are 516 KiB (64 top log-probs of 1024 rows: more than
    any transport window takes in 80 answers) and never read an
    answer: once the client's transport stops taking answers, the server stops reading each stream when its
    unanswered messages hold STREAM_BYTES_IN_FLIGHT, so its memory grows by a bounded amount per stream. The
    server returns freed memory to the system at once (a fixed mmap threshold), so that its RSS follows what it
    holds."""
    streams, cap = 4, 80  # a window of 64 messages (the bound before) took all 80
    rows = 1024
    message = build_sample_request(logits=torch.zeros(rows, VOCAB // rows), seed=list(range(rows)), top_logprobs=64)
    sent = [0] * streams

    def offered(i: int):  # noqa: ANN202
        for _ in range(cap):
            sent[i] += 1
            yield message

    server = start_server("--device", "cpu", env={"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.SamplerStub(channel)
            # a warm-up stream read to its end: torch's and grpc's first-use allocations are not the streams'
            assert sum(1 for _ in stub.SampleStream(iter([message] * 8), timeout=120)) == 8
            before = _rss_mib(server.process.pid)
            calls = [stub.SampleStream(offered(i), timeout=120) for i in range(streams)]
            last, stable_since = None, time.monotonic()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and time.monotonic() - stable_since < 3:
                time.sleep(0.2)
                if sent != last:
                    last, stable_since = list(sent), time.monotonic()
            grown = _rss_mib(server.process.pid) - before
            taken = list(sent)  # before the cancels, after which grpc may drain the iterators
            for call in calls:
                call.cancel()
        assert server.process.poll() is None
    finally:
        server.stop()
    bound_mib = STREAM_BYTES_IN_FLIGHT / 2**20
    print(f"\n{streams} unread streams: messages taken {taken}, server RSS +{grown:.0f} MiB "
          f"(window {bound_mib:.0f} MiB a stream)")
    # The resident memory is reported, not bounded here: beyond the windows' bytes it holds what grpc's transports
    # buffer and what the allocator keeps. What the server's own objects hold is bounded in process (above).
    assert all(count < cap for count in taken), "the server read every message offered"
