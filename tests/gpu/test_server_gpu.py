"""The server on the CUDA backend end to end: logits on the wire, CUDA IPC regions, hidden states (for
Sample and for the diffusion and top-k workloads)."""

from __future__ import annotations

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_server.backends.cpu import CpuBackend

from ..batches import make_batch
from ..conftest import RunningServer, connected, serving
from ..test_workloads_hidden_e2e import check_diffusion_step, check_topk_probs, make_heads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

V = 151936


@pytest.fixture(scope="module")
def cuda_server():
    yield from serving("--device", "cuda", "--allow-cuda-ipc", timeout=300)


@pytest.fixture(scope="module")
def client(cuda_server: RunningServer):
    yield from connected(cuda_server, timeout=300)


def spiky(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x.scatter_(1, torch.randint(0, vocab, (rows, 50), generator=gen), torch.rand(rows, 50, generator=gen) * 20 + 10)
    return x


def test_server_reports_the_cuda_backend(client: SamplerClient) -> None:
    info = client.server_info()
    assert info.backend == "cuda" and info.device.startswith("cuda:0") and len(info.kernels) > 0
    assert any("k > 255" in route.rows and "filter_kernel" in route.kernels for route in info.routes)
    assert info.device_memory_allocated_bytes > 0


def test_logits_over_the_wire_agree_with_the_cpu_reference(client: SamplerClient) -> None:
    logits = spiky(64, V, 0)
    seeds = list(range(64))
    result = client.sample(logits, top_k=50, top_p=0.9, seed=seeds, num_samples=4)
    reference = CpuBackend().sample(make_batch(logits, top_k=50, top_p=0.9, seed=torch.tensor(seeds), num_samples=4))
    agreement = (result.tokens == reference.tokens).float().mean().item()
    assert agreement >= 0.999, agreement
    greedy = client.sample(logits, temperature=0.0)
    assert torch.equal(greedy.tokens[:, 0], logits.argmax(dim=1))


def test_cuda_ipc_region_in_and_out(client: SamplerClient) -> None:
    logits = spiky(32, V, 1).cuda()
    tokens_out = torch.full((32, 2), -7, dtype=torch.int32, device="cuda")
    region = client.register_cuda_region("gpu-logits", logits)
    out_region = client.register_cuda_region("gpu-tokens", tokens_out)
    try:
        torch.cuda.synchronize()  # the producer finishes writing before the server reads
        seeds = list(range(32))
        by_ref = client.sample(region.view_of(logits), top_k=50, seed=seeds, num_samples=2)
        by_bytes = client.sample(logits.cpu(), top_k=50, seed=seeds, num_samples=2)
        assert torch.equal(by_ref.tokens, by_bytes.tokens)
        written = client.sample(region.view_of(logits), top_k=50, seed=seeds, num_samples=2,
                                output_tokens=out_region.view_of(tokens_out))
        assert written.tokens is None
        torch.cuda.synchronize()
        assert torch.equal(tokens_out.cpu().long(), by_bytes.tokens)
        half = logits[16:]  # a view into the middle of the registered allocation
        assert torch.equal(client.sample(region.view_of(half), top_k=50, seed=seeds[16:], num_samples=2).tokens,
                           by_bytes.tokens[16:])
        info = {r.name: r for r in client.list_regions()}
        assert info["gpu-logits"].kind == "cuda_ipc" and info["gpu-logits"].device.startswith("cuda:")
    finally:
        client.unregister_region(region)
        client.unregister_region(out_region)


WRITE_DELAY_CYCLES = 1_000_000_000
"""GPU sleep ahead of the producer's write: about 0.5 s on an H200, far longer than a server that does not wait
takes to answer from the zeroed buffer."""


def test_a_producer_marks_its_region_ready_with_an_event_instead_of_synchronising(client: SamplerClient) -> None:
    """The producer queues its write on a side stream behind a GPU sleep, records the region's ready event and
    calls at once, without synchronising: the native path (tokens only), the Python path (log-probs) and a stream
    message are each answered only once the write has landed (an event recorded after it has completed when the
    answer arrives: no timing assumed), and read what it wrote, not what the buffer held before."""
    rows = 4
    logits = torch.zeros(rows, V, device="cuda")
    region = client.register_cuda_region("evented", logits, ready_event=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    calls = (
        lambda view: client.sample(view, temperature=0),
        lambda view: client.sample(view, temperature=0, return_logprobs=True),
        lambda view: stream.sample(view, temperature=0),
    )
    try:
        with client.stream() as stream:
            for step, call in enumerate(calls):
                targets = [1 + step * 7 + row * 1000 for row in range(rows)]  # a new argmax every step
                flat = torch.tensor([row * V + t for row, t in enumerate(targets)], device="cuda")
                written = torch.cuda.Event()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # nothing in here waits on the host
                    torch.cuda._sleep(WRITE_DELAY_CYCLES)
                    logits.zero_()
                    logits.view(-1).index_fill_(0, flat, 5.0)
                    written.record(side)
                    region.mark_ready(side)
                answer = call(region.view_of(logits))
                assert written.query(), step  # answered before the write landed: the event was not waited for
                assert answer.tokens[:, 0].tolist() == targets, step
    finally:
        side.synchronize()
        client.unregister_region(region)


def test_a_ready_event_handle_that_does_not_open_is_refused(cuda_server: RunningServer) -> None:
    from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
    from tokensampler_client.regions import CudaRegion

    tensor = torch.zeros(1024, device="cuda")
    request = CudaRegion("bad-event", tensor).request
    request.cuda_ipc.ready_event_handle = b"\x01" * 64
    with grpc.insecure_channel(cuda_server.target) as channel, pytest.raises(grpc.RpcError) as raised:
        pb_grpc.SamplerStub(channel).RegisterRegion(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert raised.value.details().startswith("cuda_ipc.ready_event_handle")


def test_hidden_states_on_the_gpu(client: SamplerClient) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(V, 1024, generator=gen) / 32).bfloat16()
    client.register_weights("gpu-head", weight, chunk_bytes=64 << 20)
    try:
        hidden = torch.randn(16, 1024, generator=gen)
        seeds = list(range(16))
        result = client.sample_hidden(hidden, "gpu-head", top_k=50, top_p=0.9, seed=seeds, num_samples=8)
        logits = hidden @ weight.float().T
        reference = CpuBackend().sample(make_batch(logits, top_k=50, top_p=0.9, seed=torch.tensor(seeds), num_samples=8))
        agreement = (result.tokens == reference.tokens).float().mean().item()
        assert agreement >= 0.999, agreement
        hidden_gpu = hidden.cuda()
        region = client.register_cuda_region("gpu-hidden", hidden_gpu)
        torch.cuda.synchronize()
        by_ref = client.sample_hidden(region.view_of(hidden_gpu), "gpu-head", top_k=50, top_p=0.9, seed=seeds, num_samples=8)
        assert torch.equal(by_ref.tokens, result.tokens)
        client.unregister_region(region)
    finally:
        client.unregister_weights("gpu-head")


def test_a_weight_registered_from_an_ipc_region_is_the_engines_own_memory(client: SamplerClient) -> None:
    """The engine's bf16 head shared by CUDA IPC and registered in place: the server allocates no copy of W,
    the fused kernel samples from it what it samples from the same head uploaded, and the engine's later
    writes to it are what the next request sees."""
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(V, 1024, generator=gen) / 32).bfloat16().cuda()
    region = client.register_cuda_region("engine-head", weight)
    torch.cuda.synchronize()
    allocated = client.server_info().device_memory_allocated_bytes
    info = client.register_weights_from_region("ipc-head", region.view_of(weight))
    try:
        assert (info.region, info.padded_vocab_size, info.hidden_size) == ("engine-head", V, 1024)
        assert client.server_info().device_memory_allocated_bytes - allocated < weight.numel()  # under half of W
        client.register_weights("uploaded-head", weight.cpu(), chunk_bytes=64 << 20)
        hidden = torch.randn(16, 1024, generator=gen).bfloat16()  # bf16 like W: the fused kernel's case
        params = dict(top_k=50, top_p=0.9, seed=list(range(16)), num_samples=4, return_logprobs=True)
        in_place = client.sample_hidden(hidden, "ipc-head", **params)
        uploaded = client.sample_hidden(hidden, "uploaded-head", **params)
        assert torch.equal(in_place.tokens, uploaded.tokens) and torch.equal(in_place.logprobs, uploaded.logprobs)
        weight[7].fill_(1.0)  # the engine rewrites its head: token 7 now scores 1024 against ones
        torch.cuda.synchronize()
        greedy = client.sample_hidden(torch.ones(2, 1024, dtype=torch.bfloat16), "ipc-head", temperature=0)
        assert greedy.tokens.flatten().tolist() == [7, 7]
        uploaded_held = client.server_info().device_memory_allocated_bytes
        client.unregister_weights("uploaded-head")  # the server's own copy is freed
        assert uploaded_held - client.server_info().device_memory_allocated_bytes >= weight.numel() * 2
    finally:
        for name in ("ipc-head", "uploaded-head"):
            if name in {w.name for w in client.list_weights()}:
                client.unregister_weights(name)
        client.unregister_region(region)


@pytest.mark.parametrize("rows", [256, 512])
def test_large_hidden_batches_through_the_backend_agree_with_the_cpu_reference(client: SamplerClient, rows: int) -> None:
    """B = 256 and 512 take cuBLAS into fp32 logits and the logits kernels (cuda_fused.fused_is_faster): the
    tokens agree with the CPU reference on W·h for >= 99.9 % of them, greedy and sampled, filtered or not."""
    vocab, dim = 32007, 1024
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(vocab, dim, generator=gen) / 32).bfloat16()
    client.register_weights(f"large-{rows}", weight, chunk_bytes=64 << 20)
    try:
        hidden = torch.randn(rows, dim, generator=gen).bfloat16()
        logits = hidden.float() @ weight.float().T
        seeds = list(range(rows))
        for params in (dict(temperature=0.0), dict(), dict(top_k=50, top_p=0.9), dict(min_p=0.05, temperature=0.7)):
            result = client.sample_hidden(hidden, f"large-{rows}", seed=seeds, **params)
            batch = make_batch(logits, seed=torch.tensor(seeds), **params)
            reference = CpuBackend().sample(batch)
            agreement = (result.tokens == reference.tokens).float().mean().item()
            assert agreement >= 0.999, (params, agreement)
    finally:
        client.unregister_weights(f"large-{rows}")


def test_ipc_region_of_another_gpu_uuid_is_not_found(cuda_server: RunningServer) -> None:
    from tokensampler_client._proto import sampler_pb2 as pb
    from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc

    request = pb.RegisterRegionRequest(name="x", cuda_ipc=pb.CudaIpcSource(device_uuid="GPU-00000000-0000-0000-0000-000000000000"))
    with grpc.insecure_channel(cuda_server.target) as channel, pytest.raises(grpc.RpcError) as raised:
        pb_grpc.SamplerStub(channel).RegisterRegion(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_report_the_gpu(cuda_server: RunningServer, client: SamplerClient) -> None:
    import re
    import urllib.request

    client.sample(spiky(4, V, 3), seed=1)
    port = next(int(m.group(1)) for line in cuda_server.log if (m := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line)))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    allocated = re.search(r'^tokensampler_gpu_memory_allocated_bytes\{device="[^"]+"\} (\S+)$', text, re.MULTILINE)
    assert allocated and float(allocated.group(1)) > 0
    assert re.search(r'^tokensampler_build_info\{[^}]*backend="cuda"[^}]*\} 1\.0$', text, re.MULTILINE)


def test_workloads_from_hidden_states_equal_the_logits_ones(client: SamplerClient) -> None:
    """tests/test_workloads_hidden_e2e.py's equalities on the CUDA backend; the test computes the logits'
    finish on the GPU too, so that they round as the server's."""
    heads = make_heads("gpu-workload-head")
    for head in heads:
        head.register(client)
    try:
        for head in heads:
            check_diffusion_step(client, head, "cuda")
            check_topk_probs(client, head, "cuda")
    finally:
        for head in heads:
            client.unregister_weights(head.name)
