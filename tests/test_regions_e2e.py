"""Zero-copy shared-memory regions end to end (CUDA IPC regions are tested in tests/gpu/)."""

from __future__ import annotations

import concurrent.futures
import threading

import grpc
import pytest
import torch
from tokensampler_client import BatchingClient, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.params import build_sample_request
from tokensampler_client.regions import RegionView
from tokensampler_client.tensors import encode_tensor

from .conftest import RunningServer, assert_unregister_waits, connected
from .gated_server import GATE_SEED

ROWS, VOCAB = 16, 4096


@pytest.fixture(scope="module")
def client(shm_server: RunningServer):
    yield from connected(shm_server)


def test_logits_in_a_region_sample_like_logits_on_the_wire(client: SamplerClient) -> None:
    region = client.register_shm_region("in", ROWS * VOCAB * 4 + ROWS * 8)
    try:
        logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
        region.tensor(torch.float32, (ROWS, VOCAB)).copy_(logits)
        params = dict(top_k=30, top_p=0.9, seed=list(range(ROWS)), return_logprobs=True)
        by_ref = client.sample(region.view(torch.float32, (ROWS, VOCAB)), **params)
        by_bytes = client.sample(logits, **params)
        assert torch.equal(by_ref.tokens, by_bytes.tokens) and torch.equal(by_ref.logprobs, by_bytes.logprobs)

        # Tokens written into the same region, after the logits; the response leaves them out.
        out = region.view(torch.int32, (ROWS, 1), offset=ROWS * VOCAB * 4)
        written = client.sample(region.view(torch.float32, (ROWS, VOCAB)), output_tokens=out, **params)
        assert written.tokens is None
        assert torch.equal(region.tensor(torch.int32, (ROWS, 1), ROWS * VOCAB * 4).long(), by_bytes.tokens)

        # Log-probs written after the tokens, the tokens returned: each output goes where it is named.
        out_logprobs = region.view(torch.float32, (ROWS, 1), offset=ROWS * VOCAB * 4 + ROWS * 4)
        written = client.sample(region.view(torch.float32, (ROWS, VOCAB)), output_logprobs=out_logprobs, **params)
        assert written.logprobs is None and torch.equal(written.tokens, by_bytes.tokens)
        assert torch.equal(region.tensor(torch.float32, (ROWS, 1), ROWS * VOCAB * 4 + ROWS * 4), by_bytes.logprobs)

        info = client.list_regions()
        assert [(r.name, r.kind, r.byte_size, r.device) for r in info] == [("in", "shm", region.byte_size, "cpu")]
    finally:
        client.unregister_region(region)
    assert client.list_regions() == []


def test_bad_references(client: SamplerClient) -> None:
    region = client.register_shm_region("small", 1024)
    try:
        cases = [
            (RegionView("small", 0, torch.float32, (2, 200)), grpc.StatusCode.OUT_OF_RANGE, "logits_ref"),
            (RegionView("small", 2, torch.float32, (1, 8)), grpc.StatusCode.INVALID_ARGUMENT, "logits_ref.offset"),
            (RegionView("small", 0, torch.int32, (1, 8)), grpc.StatusCode.INVALID_ARGUMENT, "logits_ref.dtype"),
            (RegionView("small", 0, torch.float32, (8,)), grpc.StatusCode.INVALID_ARGUMENT, "logits_ref.shape"),
            (RegionView("absent", 0, torch.float32, (1, 8)), grpc.StatusCode.NOT_FOUND, "logits_ref.region"),
        ]
        for view, code, field in cases:
            with pytest.raises(TokenSamplerError) as raised:
                client.sample(view)
            assert raised.value.code == code and raised.value.details.startswith(f"{field}"), raised.value
        with pytest.raises(TokenSamplerError) as raised:  # output of the wrong shape
            client.sample(torch.zeros(2, 8), output_tokens=RegionView("small", 0, torch.int32, (3, 1)))
        assert raised.value.details.startswith("output.tokens.shape")
        # Log-probs over the tokens' bytes would overwrite them: refused, and apart (even adjacent) they are taken.
        for offset, refused in ((4, True), (8, False)):
            outputs = dict(output_tokens=RegionView("small", 0, torch.int32, (2, 1)),
                           output_logprobs=RegionView("small", offset, torch.float32, (2, 1)), return_logprobs=True)
            if refused:
                with pytest.raises(TokenSamplerError) as raised:
                    client.sample(torch.zeros(2, 8), **outputs)
                assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert raised.value.details.startswith("output.logprobs.offset") and "overlaps" in raised.value.details
            else:
                client.sample(torch.zeros(2, 8), **outputs)
        with pytest.raises(ValueError, match="outside"):
            region.view(torch.float32, (2, 200))
        with pytest.raises(TokenSamplerError) as raised:
            client.register_shm_region("small", 16)
        assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        client.unregister_region(region)


def test_rows_gathered_from_anywhere_in_a_region_sample_like_those_rows_on_the_wire(client: SamplerClient) -> None:
    """logits_rows: rows out of order and repeated, with gaps between them; the server lists the feature."""
    assert "region_rows" in client.server_info().features
    region = client.register_shm_region("rows", 2 * ROWS * VOCAB * 4)
    try:
        logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(4))
        region.tensor(torch.float32, (2 * ROWS, VOCAB))[::2].copy_(logits)  # row i at 2i: a row's gap after each
        order = [5, 0, 9, 9, 15, 3]
        request = build_sample_request(logits[order], top_k=30, top_p=0.9, seed=list(range(len(order))),
                                       return_logprobs=True)
        by_bytes = client.sample_request(request)
        request.logits_rows.CopyFrom(pb.RowsRef(region="rows", dtype=pb.DTYPE_FLOAT32, row_size=VOCAB,
                                                row_offsets=[2 * i * VOCAB * 4 for i in order]))
        by_rows = client.sample_request(request)
        assert torch.equal(by_rows.tokens, by_bytes.tokens) and torch.equal(by_rows.logprobs, by_bytes.logprobs)
    finally:
        client.unregister_region(region)


def test_region_rows_through_the_client_and_its_batcher(client: SamplerClient) -> None:
    """The client's RegionRows (region.rows): sample() and BatchingClient send it as logits_rows."""
    region = client.register_shm_region("client-rows", ROWS * VOCAB * 4)
    try:
        logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(6))
        region.tensor(torch.float32, (ROWS, VOCAB)).copy_(logits)
        order = [7, 2, 2, 11]
        rows = region.rows(torch.float32, VOCAB, [i * VOCAB * 4 for i in order])
        assert rows.shape == (4, VOCAB)
        expected = client.sample(logits[order], top_k=40, seed=[1, 2, 3, 4])
        assert torch.equal(client.sample(rows, top_k=40, seed=[1, 2, 3, 4]).tokens, expected.tokens)
        with BatchingClient(client, max_delay_us=1000) as batcher:
            assert torch.equal(batcher.sample(rows, top_k=40, seed=[1, 2, 3, 4]).tokens, expected.tokens)
        with pytest.raises(ValueError, match=r"row_offsets\[1\]"):
            region.rows(torch.float32, VOCAB, [0, ROWS * VOCAB * 4])
        with pytest.raises(ValueError, match=r"row_offsets\[0\]"):
            region.rows(torch.float32, VOCAB, [2])
    finally:
        client.unregister_region(region)


def test_bad_row_references(client: SamplerClient) -> None:
    region = client.register_shm_region("small-rows", 1024)
    try:
        def rows(**fields) -> pb.SampleRequest:
            ref = dict(region="small-rows", dtype=pb.DTYPE_FLOAT32, row_size=8, row_offsets=[0, 32]) | fields
            return pb.SampleRequest(logits_rows=pb.RowsRef(**ref))

        cases = [
            (rows(row_offsets=[0, 1000]), grpc.StatusCode.OUT_OF_RANGE, "logits_rows.row_offsets[1]"),
            (rows(row_offsets=[0, 6]), grpc.StatusCode.INVALID_ARGUMENT, "logits_rows.row_offsets[1]"),
            (rows(dtype=pb.DTYPE_INT32), grpc.StatusCode.INVALID_ARGUMENT, "logits_rows.dtype"),
            (rows(row_offsets=[]), grpc.StatusCode.INVALID_ARGUMENT, "logits_rows.shape"),
            (rows(row_size=0), grpc.StatusCode.INVALID_ARGUMENT, "logits_rows.shape"),
            (rows(row_size=1 << 40), grpc.StatusCode.INVALID_ARGUMENT, "logits_rows.shape"),  # before any copy
            (rows(row_offsets=[0] * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "logits_rows.shape"),
            (rows(region="absent"), grpc.StatusCode.NOT_FOUND, "logits_rows.region"),
        ]
        for request, code, field in cases:
            with pytest.raises(TokenSamplerError) as raised:
                client.sample_request(request)
            assert raised.value.code == code and raised.value.details.startswith(field), raised.value
    finally:
        client.unregister_region(region)


def test_unregister_waits_for_the_request_reading_the_region(shm_server: RunningServer, client: SamplerClient) -> None:
    rows, vocab = 48, 1000
    region = client.register_shm_region("busy-region", rows * vocab * 4)
    region.tensor(torch.float32, (rows, vocab)).copy_(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)))
    assert shm_server.gate is not None
    assert_unregister_waits(
        shm_server.gate, lambda: client.sample(region.view(torch.float32, (rows, vocab)), top_p=0.9, seed=GATE_SEED),
        client.list_regions, lambda: client.unregister_region(region), "region",
    )
    assert client.list_regions() == []


def test_unknown_segment_is_not_found(shm_server: RunningServer) -> None:
    request = pb.RegisterRegionRequest(name="ghost", shm=pb.SharedMemorySource(key="tokensampler-no-such-segment", byte_size=8))
    with grpc.insecure_channel(shm_server.target) as channel, pytest.raises(grpc.RpcError) as raised:
        pb_grpc.SamplerStub(channel).RegisterRegion(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_regions_are_off_by_default(server: RunningServer) -> None:
    with SamplerClient(server.target, timeout=30) as plain:
        with pytest.raises(TokenSamplerError) as raised:
            plain.register_shm_region("x", 64)
    assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED and "--allow-shm" in raised.value.details
    # A CUDA IPC registration is refused before the server opens anything the message names.
    request = pb.RegisterRegionRequest(name="y", cuda_ipc=pb.CudaIpcSource(device_uuid="GPU-0", handle=b"\0" * 64))
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.SamplerStub(channel).RegisterRegion(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-cuda-ipc" in refused.value.details()


def test_hidden_states_in_a_region(client: SamplerClient, shm_server: RunningServer) -> None:
    client.register_weights("head", torch.randn(500, 32, generator=torch.Generator().manual_seed(1)))
    region = client.register_shm_region("hidden", 4 * 32 * 4)
    try:
        hidden = torch.randn(4, 32)
        region.tensor(torch.float32, (4, 32)).copy_(hidden)
        by_ref = client.sample_hidden(region.view(torch.float32, (4, 32)), "head", seed=[1, 2, 3, 4])
        by_bytes = client.sample_hidden(hidden, "head", seed=[1, 2, 3, 4])
        assert torch.equal(by_ref.tokens, by_bytes.tokens)
        # Both the states and a reference: which to sample is not the server's to guess, even where they agree.
        both = pb.SampleRequest(hidden=pb.HiddenStates(states=encode_tensor(hidden), weights="head",
                                                       states_ref=region.view(torch.float32, (4, 32)).ref()))
        with grpc.insecure_channel(shm_server.target) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.SamplerStub(channel).Sample(both, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("hidden.states: set beside hidden.states_ref")
    finally:
        client.unregister_region(region)
        client.unregister_weights("head")


def assert_batched_calls_equal_calls_alone(client: SamplerClient, views: list[RegionView], slices: torch.Tensor,
                                           steps: int, **params) -> None:
    """One thread per view calls BatchingClient.sample `steps` times: each result equals the same call made alone
    on the thread's logits (slices[thread]), and some calls shared an RPC (the server's request id)."""
    results: dict[tuple[int, int], object] = {}
    with BatchingClient(client, max_rows=64, max_delay_us=5000) as batcher:

        def worker(thread: int) -> None:
            for step in range(steps):
                results[thread, step] = batcher.sample(views[thread], seed=[thread, step], position=step, **params)

        workers = [threading.Thread(target=worker, args=(t,)) for t in range(len(views))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    for (thread, step), result in results.items():
        alone = client.sample(slices[thread], seed=[thread, step], position=step, **params)
        assert torch.equal(result.tokens, alone.tokens), (thread, step)
    assert len({result.request_id for result in results.values()}) < len(results)


def test_client_batching_merges_slices_of_one_region_and_each_caller_gets_its_rows(client: SamplerClient) -> None:
    """Adjacent slices: merged calls name one reference spanning them."""
    threads, rows = 8, 2
    region = client.register_shm_region("batched", threads * rows * VOCAB * 4)
    try:
        slices = torch.randn(threads, rows, VOCAB, generator=torch.Generator().manual_seed(3))
        region.tensor(torch.float32, (threads, rows, VOCAB)).copy_(slices)
        views = [region.view(torch.float32, (rows, VOCAB), offset=t * rows * VOCAB * 4) for t in range(threads)]
        assert_batched_calls_equal_calls_alone(client, views, slices, steps=10, top_k=20)
    finally:
        client.unregister_region(region)


def test_client_batching_gathers_slices_with_gaps_between_them(client: SamplerClient) -> None:
    """Each thread's slice has a gap before the next one's: merged calls name every row's place (logits_rows)."""
    threads, rows = 8, 2
    region = client.register_shm_region("gathered", 2 * threads * rows * VOCAB * 4)
    try:
        slices = torch.randn(threads, rows, VOCAB, generator=torch.Generator().manual_seed(5))
        region.tensor(torch.float32, (threads, 2 * rows, VOCAB))[:, :rows].copy_(slices)
        views = [region.view(torch.float32, (rows, VOCAB), offset=t * 2 * rows * VOCAB * 4) for t in range(threads)]
        assert_batched_calls_equal_calls_alone(client, views, slices, steps=10, top_p=0.8)
    finally:
        client.unregister_region(region)


def test_client_batching_sends_a_reference_past_the_region_end_alone(client: SamplerClient) -> None:
    region = client.register_shm_region("batched-end", 2 * VOCAB * 4)
    try:
        region.tensor(torch.float32, (2, VOCAB)).copy_(torch.randn(2, VOCAB))
        with (BatchingClient(client, max_rows=64, max_delay_us=200_000) as batcher,
              concurrent.futures.ThreadPoolExecutor(2) as pool):
            good = pool.submit(batcher.sample, region.view(torch.float32, (1, VOCAB)), seed=1)
            bad = pool.submit(batcher.sample, RegionView("batched-end", VOCAB * 4, torch.float32, (2, VOCAB)), seed=2)
            assert good.result().tokens.shape == (1, 1)
            with pytest.raises(TokenSamplerError) as raised:
                bad.result()
        assert raised.value.code == grpc.StatusCode.OUT_OF_RANGE
    finally:
        client.unregister_region(region)
