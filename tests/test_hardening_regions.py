"""Shared-memory regions and the registries under hostile and unlucky producers, against a real CPU server.

Each of these killed or wedged the server before: a segment shrunk after registering (SIGBUS), keys that name
no plain segment (INTERNAL), regions past the descriptor limit (EMFILE), concurrent register/unregister of the
same weight names (a live weight left in an unregistered region), and unbounded work of the other workloads.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor

from .conftest import RunningServer, serving

VOCAB = 32
DIM = 8


@pytest.fixture(scope="module")
def capped_server() -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--allow-shm", "--max-regions", "4", "--max-weights", "3",
                       "--max-queue-mb", "1")


@pytest.fixture()
def client(capped_server: RunningServer) -> Iterator[SamplerClient]:
    with SamplerClient(capped_server.target, timeout=30) as client:
        yield client
        for weight in client.list_weights():
            client.unregister_weights(weight.name)
        for region in client.list_regions():
            client.unregister_region(region.name)


def _status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except TokenSamplerError as err:
        return err.code, err.details
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def _print_refusal_times(server: RunningServer, what: str, method: str, request: object, count: int = 50) -> None:
    """Times `count` refused calls of `method` (each must be refused; no client retries) and prints p50 / p99
    (pytest -s)."""
    times = []
    with grpc.insecure_channel(server.target) as channel:
        call = getattr(pb_grpc.SamplerStub(channel), method)
        for _ in range(count):
            started = time.perf_counter()
            assert _status(lambda: call(request, timeout=30))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            times.append(time.perf_counter() - started)
    times.sort()
    print(f"\n{what}: refused in p50 {times[count // 2] * 1e3:.2f} ms, p99 {times[-1] * 1e3:.2f} ms ({count} calls)")


def _segment_path(region) -> str:  # noqa: ANN001 - the client's SharedMemoryRegion
    return f"/dev/shm/{region.request.shm.key}"


def test_a_segment_shrunk_after_registering_is_refused_not_a_crash(client: SamplerClient,
                                                                   capped_server: RunningServer) -> None:
    """Reading or writing bytes past a segment's new end answers FAILED_PRECONDITION; the server keeps serving."""
    width = 4096  # rows of 16 KiB: a read past the new end touches pages the segment no longer has
    region = client.register_shm_region("shrinks", 4 * width * 4)
    region.tensor(torch.float32, (4, width)).copy_(torch.randn(4, width))
    logits = region.view(torch.float32, (4, width))
    assert client.sample(logits, seed=[1, 2, 3, 4]).tokens.shape == (4, 1)
    os.truncate(_segment_path(region), width * 4)  # one row left
    code, details = _status(lambda: client.sample(logits, seed=[1, 2, 3, 4]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("logits_ref: region 'shrinks'"), details
    out = client.register_shm_region("out-shrinks", 4 * width * 4)
    os.truncate(_segment_path(out), 4)
    code, details = _status(lambda: client.sample(torch.randn(4, VOCAB), seed=[1, 2, 3, 4],
                                                  output_tokens=out.view(torch.int32, (4, 1), offset=width * 8)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("output.tokens: region"), details
    assert capped_server.process.poll() is None
    assert client.sample(torch.randn(2, VOCAB), seed=[1, 2]).tokens.shape == (2, 1)


def test_keys_that_name_no_plain_segment_get_a_specific_status(capped_server: RunningServer, tmp_path) -> None:
    """'.', '..', a directory, a link, a FIFO and an empty segment: never INTERNAL, never a hang."""
    suffix = f"{os.getpid()}-{random.getrandbits(32)}"
    directory, link, fifo, empty = (f"ts-test-{kind}-{suffix}" for kind in ("dir", "link", "fifo", "empty"))
    os.mkdir(f"/dev/shm/{directory}")
    os.symlink(str(tmp_path), f"/dev/shm/{link}")
    os.mkfifo(f"/dev/shm/{fifo}")
    open(f"/dev/shm/{empty}", "wb").close()
    expected = {
        ".": (grpc.StatusCode.INVALID_ARGUMENT, "shm.key"),
        "..": (grpc.StatusCode.INVALID_ARGUMENT, "shm.key"),
        directory: (grpc.StatusCode.FAILED_PRECONDITION, "shm.key"),
        link: (grpc.StatusCode.FAILED_PRECONDITION, "shm.key"),
        fifo: (grpc.StatusCode.FAILED_PRECONDITION, "shm.key"),
        empty: (grpc.StatusCode.INVALID_ARGUMENT, "shm.byte_size"),
    }
    try:
        with grpc.insecure_channel(capped_server.target) as channel:
            stub = pb_grpc.SamplerStub(channel)
            for key, (code, field) in expected.items():
                request = pb.RegisterRegionRequest(name="odd", shm=pb.SharedMemorySource(key=key, byte_size=8))
                got, details = _status(lambda: stub.RegisterRegion(request, timeout=30))
                assert (got, details.split(":")[0]) == (code, field), (key, got, details)
    finally:
        os.rmdir(f"/dev/shm/{directory}")
        for name in (link, fifo, empty):
            os.unlink(f"/dev/shm/{name}")
    assert capped_server.process.poll() is None


def test_regions_and_weights_past_their_caps_are_refused(client: SamplerClient, capped_server: RunningServer) -> None:
    regions = [client.register_shm_region(f"r{i}", 64) for i in range(4)]
    code, details = _status(lambda: client.register_shm_region("r4", 64))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("name: 4 regions are registered"), details
    extra = regions[1].request
    extra.name = "r5"
    _print_refusal_times(capped_server, "RegisterRegion past --max-regions", "RegisterRegion", extra)
    client.unregister_region(regions[0])
    client.register_shm_region("r4", 64)  # room again
    for i in range(3):
        client.register_weights(f"w{i}", torch.randn(VOCAB, DIM))
    code, details = _status(lambda: client.register_weights("w3", torch.randn(VOCAB, DIM)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("name: 3 weights are registered"), details


def test_the_other_workloads_count_against_the_queue_bound(client: SamplerClient,
                                                          capped_server: RunningServer) -> None:
    """--max-queue-mb 1: a TopKProbs request of 2 MiB is refused at once, as a Sample of that size is."""
    logits = torch.randn(1, 16, VOCAB * 1024)
    code, details = _status(lambda: client.topk_probs(logits, k=4))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("queue full"), details
    request = pb.TopKProbsRequest(k=4, temperature=[1.0])
    encode_tensor(logits, out=request.logits)
    _print_refusal_times(capped_server, "TopKProbs of 2 MiB past --max-queue-mb 1", "TopKProbs", request)
    assert client.topk_probs(torch.randn(1, 2, VOCAB), k=4).ids.shape == (1, 2, 4)


def test_concurrent_register_and_unregister_of_the_same_names_keeps_the_registries_consistent(
        client: SamplerClient, capped_server: RunningServer) -> None:
    """6 threads register weights of three names from one region and sample through them while 2 unregister
    them and 1 unregisters the region (registering it again whenever that succeeds), for a bounded time: every
    call ends OK or with a status that names why, the server lives, and at the end the region holds exactly the
    weights that are listed."""
    region = client.register_shm_region("heads", VOCAB * DIM * 4)
    region.tensor(torch.float32, (VOCAB, DIM)).copy_(torch.randn(VOCAB, DIM))
    view = region.view(torch.float32, (VOCAB, DIM))
    names = ("a", "b", "c")
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
    seen: list[grpc.StatusCode] = []
    stop = time.monotonic() + 4.0

    def registrar(seed: int) -> None:
        rng = random.Random(seed)
        with SamplerClient(capped_server.target, timeout=30) as own:
            while time.monotonic() < stop:
                name = rng.choice(names)
                seen.append(_status(lambda: own.register_weights_from_region(name, view))[0])
                seen.append(_status(lambda: own.sample_hidden(torch.randn(2, DIM), name, seed=[1, 2]))[0])

    def remover(seed: int) -> None:
        rng = random.Random(seed)
        with SamplerClient(capped_server.target, timeout=30) as own:
            while time.monotonic() < stop:
                seen.append(_status(lambda: own.unregister_weights(rng.choice(names)))[0])

    def region_churner() -> None:
        with grpc.insecure_channel(capped_server.target) as channel:
            stub = pb_grpc.SamplerStub(channel)
            while time.monotonic() < stop:
                code, _ = _status(lambda: stub.UnregisterRegion(pb.UnregisterRegionRequest(name="heads"), timeout=30))
                seen.append(code)
                if code == grpc.StatusCode.OK:
                    seen.append(_status(lambda: stub.RegisterRegion(region.request, timeout=30))[0])

    threads = [threading.Thread(target=registrar, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=remover, args=(100 + i,)) for i in range(2)]
    threads.append(threading.Thread(target=region_churner))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert capped_server.process.poll() is None
    assert set(seen) <= allowed, set(seen) - allowed
    assert seen.count(grpc.StatusCode.OK) > 0
    if "heads" not in {r.name for r in client.list_regions()}:
        with grpc.insecure_channel(capped_server.target) as channel:
            pb_grpc.SamplerStub(channel).RegisterRegion(region.request, timeout=30)
    listed = {weight.name: weight.region for weight in client.list_weights()}
    assert set(listed.values()) <= {"heads"}
    code, _ = _status(lambda: client.unregister_region("heads"))
    assert code == (grpc.StatusCode.FAILED_PRECONDITION if listed else grpc.StatusCode.OK)
    if listed:
        for name in listed:
            client.unregister_weights(name)
        client.unregister_region("heads")
    assert client.list_regions() == [] and client.list_weights() == []


def test_a_reference_larger_than_the_caller_may_send_is_refused_before_it_is_read(monkeypatch) -> None:
    """A sparse segment can be far larger than any input the server takes: Region.tensor refuses a reference past
    its max_bytes by field, without reading a byte of it."""
    from multiprocessing import shared_memory

    from tokensampler_server.core.errors import InvalidArgument
    from tokensampler_server.resources.regions import Region, RegionRegistry

    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        regions = RegionRegistry(allow_shm=True)
        region = regions.register(pb.RegisterRegionRequest(
            name="sparse", shm=pb.SharedMemorySource(key=segment.name.lstrip("/"), byte_size=segment.size)))
        monkeypatch.setattr(Region, "_read", lambda *args: pytest.fail("the reference was read"))
        ref = pb.TensorRef(region="sparse", dtype=pb.DTYPE_FLOAT32, shape=[1, 1 << 18])  # the whole 1 MiB
        with pytest.raises(InvalidArgument) as refused:
            region.tensor(ref, "logits_ref", (pb.DTYPE_FLOAT32,), max_bytes=1 << 16)
        assert refused.value.field == "logits_ref.shape" and "at most 65536" in str(refused.value)
        region.release()
    finally:
        segment.close()
        segment.unlink()


def test_names_past_the_limit_are_refused_and_long_names_do_not_break_the_status(
        client: SamplerClient, capped_server: RunningServer) -> None:
    """A name of more than 256 bytes is INVALID_ARGUMENT naming `name` (every listing repeats every name), and a
    status quoting a caller's 100,000-character string stays a status, cut short, not a metadata overflow."""
    code, details = _status(lambda: client.register_shm_region("r" * 257, 64))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("name:"), details
    weight = torch.randn(VOCAB, DIM)
    code, details = _status(lambda: client.register_weights("w" * 300, weight))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("name:"), details
    assert client.list_weights() == [] and client.list_regions() == []
    with grpc.insecure_channel(capped_server.target) as channel:
        code, details = _status(lambda: pb_grpc.SamplerStub(channel).UnregisterWeights(
            pb.UnregisterWeightsRequest(name="y" * 100_000), timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND and "characters)" in details and len(details) < 2000, (code, len(details))
