"""GPU faults the server must survive: device memory running out, a CUDA IPC producer exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client.regions import RegionView

from ..conftest import start_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

V = 151936


def test_out_of_device_memory_is_resource_exhausted_and_the_server_recovers() -> None:
    # 0.5 % of the card: the context and kernels fit, sorting 2048 x V rows for top_logprobs does not.
    running = start_server("--device", "cuda", "--allow-cuda-ipc", "--gpu-memory-fraction", "0.005", timeout=300)
    try:
        with SamplerClient(running.target, timeout=300, retries=0) as client:
            big = torch.randn(2048, V, device="cuda")
            region = client.register_cuda_region("big", big)
            torch.cuda.synchronize()
            with pytest.raises(TokenSamplerError) as raised:
                client.sample(region.view_of(big), top_logprobs=5)
            assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "out of memory" in raised.value.details
            small = client.sample(torch.randn(4, V), top_k=50, seed=[1, 2, 3, 4])
            assert small.valid.all() and client.health() == "SERVING"
            client.unregister_region(region)
    finally:
        assert running.stop() == 0


def test_a_region_whose_producer_exited_fails_cleanly() -> None:
    running = start_server("--device", "cuda", "--allow-cuda-ipc", timeout=300)
    try:
        producer = textwrap.dedent(f"""
            import os, sys, torch
            from tokensampler_client import SamplerClient
            logits = torch.randn(8, 1000, device="cuda")
            with SamplerClient("{running.target}", timeout=60) as client:
                client.register_cuda_region("orphan", logits)
            torch.cuda.synchronize()
            print("registered", flush=True)
            os._exit(0)  # gone without unregistering: its GPU memory goes with it
        """)
        done = subprocess.run([sys.executable, "-c", producer], capture_output=True, text=True, timeout=120)
        assert "registered" in done.stdout, done.stdout + done.stderr
        with SamplerClient(running.target, timeout=60, retries=0) as client:
            with pytest.raises(TokenSamplerError) as raised:
                client.sample(RegionView("orphan", 0, torch.float32, (8, 1000)), seed=1)
            assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "has exited" in raised.value.details
            assert client.sample(torch.randn(2, 1000), seed=1).valid.all()  # the server keeps serving
            assert client.unregister_region("orphan").name == "orphan"
            assert client.list_regions() == []
    finally:
        assert running.stop() == 0


def test_bad_requests_do_not_grow_gpu_memory() -> None:
    """2,000 bad requests of several kinds against the CUDA backend: device memory stays put."""
    from tokensampler_client._proto import sampler_pb2 as pb
    from tokensampler_client.params import build_sample_request

    running = start_server("--device", "cuda", "--allow-cuda-ipc", timeout=300)
    try:
        with SamplerClient(running.target, timeout=60, retries=0) as client:
            for _ in range(3):  # warm up: kernels, caches, the allocator's first blocks
                client.sample(torch.randn(64, V), top_k=50, top_p=0.9, top_logprobs=5, return_logprobs=True)
            before = client.server_info().device_memory_allocated_bytes
            good = build_sample_request(torch.randn(1, V))
            bad = []
            for kind in range(4):
                request = pb.SampleRequest()
                request.CopyFrom(good)
                if kind == 0:
                    request.params.top_p.append(0.0)
                elif kind == 1:
                    request.logits.data = request.logits.data[:-1]
                elif kind == 2:
                    request.params.banned_token_ids.ids.append(V)
                    request.params.banned_token_ids.lengths.append(1)
                else:
                    request.ClearField("logits")
                    request.hidden.weights = "absent"
                    request.hidden.states.CopyFrom(good.logits)
                bad.append(request)
            refused = 0
            for index in range(2000):
                try:
                    client.sample_request(bad[index % len(bad)])
                except TokenSamplerError as err:
                    refused += err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            after = client.server_info().device_memory_allocated_bytes
            assert refused == 2000
            assert after - before <= 16 << 20, (before, after)  # margin: 16 MiB
            assert client.sample(torch.randn(2, V), seed=1).valid.all()
            print(f"GPU memory allocated before {before} after {after} bytes, {refused} bad requests refused")
    finally:
        assert running.stop() == 0
