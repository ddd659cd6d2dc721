"""Colocated decode loops (docs/colocated.md) against a CUDA server in another process: the tokens of the GPU
hand-off are those of the in-process prepared call for the same seeds and positions, and every failure ends
safe: a server killed mid-loop, an input late past the server's wait, an engine that exits mid-loop, refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.handoff import ABORT, FLAGS_BYTES, READY_OFFSET
from tokensampler_server.inprocess import LocalSampler

from ..conftest import start_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

B, V, STEPS = 8, 32000, 10
PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9)


@pytest.fixture(scope="module")
def server():
    running = start_server("--device", "cuda", "--allow-shm", "--allow-cuda-ipc", timeout=300)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def local() -> LocalSampler:
    return LocalSampler("cuda")


def step_inputs(steps: int, shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype) for _ in range(steps)]


def reference(local: LocalSampler, inputs: list[torch.Tensor], positions: list[int], head=None, first: int = 1,
              **params) -> list[torch.Tensor]:
    """Step n's tokens (and log-probs) from the in-process prepared call, at position + n - 1."""
    rows = inputs[0].shape[0]
    call = local.prepare(rows, None if head is not None else inputs[0].shape[1], head=head, position=positions,
                         **params)
    base = call.position.clone()
    out = []
    for n, x in enumerate(inputs, start=first):
        torch.add(base, n - 1, out=call.position)
        got = call(x)
        out.append((got.tokens.clone(), None if got.logprobs is None else got.logprobs.clone()))
    torch.cuda.synchronize()
    return out


def run_loop(loop, buffer: torch.Tensor, inputs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    got = []
    for x in inputs:
        buffer.copy_(x)
        tokens = loop.step()
        got.append((tokens.clone(), None if loop.logprobs is None else loop.logprobs.clone()))
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("tokens_dtype,extra", [(torch.int64, {}),
                                                (torch.int32, dict(logprobs=True, logprobs_mode="processed"))])
def test_colocated_logits_are_the_in_process_tokens(server, local, tokens_dtype, extra) -> None:
    seeds, positions = [11 * r + 3 for r in range(B)], [5 * r for r in range(B)]
    inputs = step_inputs(STEPS, (B, V), torch.bfloat16)
    want = reference(local, inputs, positions, seed=seeds, num_samples=1,
                     return_logprobs=extra.get("logprobs", False), logprobs_mode=extra.get("logprobs_mode", "raw"),
                     **PARAMS)
    buffer = torch.zeros(B, V, dtype=torch.bfloat16, device="cuda")
    with SamplerClient(server.target, timeout=120) as client:
        info = client.server_info()
        assert "colocated" in info.features and info.mps in ("active", "inactive")
        with client.colocate(buffer, tokens_dtype=tokens_dtype, seed=seeds, position=positions, **extra,
                             **PARAMS) as loop:
            assert loop.seeds == seeds
            got = run_loop(loop, buffer, inputs)
            assert loop.fallbacks == 0
    for n, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, want), start=1):
        assert tokens.dtype == tokens_dtype
        assert torch.equal(tokens.long(), want_tokens), f"step {n}"
        if want_logprobs is not None:
            assert torch.equal(logprobs, want_logprobs), f"step {n}"


def test_colocated_hidden_states_through_the_engines_head(server, local) -> None:
    rows, hidden, vocab = 4, 512, 1000
    gen = torch.Generator(device="cuda").manual_seed(7)
    weight = (torch.randn(vocab, hidden, generator=gen, device="cuda") / hidden**0.5).to(torch.bfloat16)
    inputs = step_inputs(STEPS, (rows, hidden), torch.bfloat16, seed=1)
    seeds = [100 + r for r in range(rows)]
    want = reference(local, inputs, [0] * rows, head=local.register_head(weight), seed=seeds, **PARAMS)
    buffer = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
    with SamplerClient(server.target, timeout=120) as client:
        with client.colocate(buffer, head=weight, seed=seeds, position=0, **PARAMS) as loop:
            got = run_loop(loop, buffer, inputs)
            assert loop.fallbacks == 0
    for n, ((tokens, _), (want_tokens, _)) in enumerate(zip(got, want), start=1):
        assert torch.equal(tokens, want_tokens), f"step {n}"


def test_a_late_input_ends_the_loop_on_the_server_and_the_watchdog_delivers(server, local) -> None:
    seeds = list(range(B))
    inputs = step_inputs(3, (B, V), torch.float32, seed=2)
    want = reference(local, inputs, [0] * B, seed=seeds, **PARAMS)
    buffer = torch.zeros(B, V, device="cuda")
    with SamplerClient(server.target, timeout=120) as client:
        loop = client.colocate(buffer, seed=seeds, position=0, wait_timeout_s=0.3, watchdog_s=0.5, **PARAMS)
        got = run_loop(loop, buffer, inputs[:1])
        torch.cuda._sleep(2_000_000_000)  # about a second of the engine's GPU before step 2's input is ready
        got += run_loop(loop, buffer, inputs[1:])
        assert loop.fallbacks == 2, loop._broken  # step 2 after the server's DEADLINE_EXCEEDED, step 3 in process after it
        assert int(loop._words[READY_OFFSET // 4]) == ABORT  # no late step of the server's copies or delivers
        loop.close()
        assert client.health() == "SERVING"
    for n, ((tokens, _), (want_tokens, _)) in enumerate(zip(got, want), start=1):
        assert torch.equal(tokens, want_tokens), f"step {n}"


def test_a_server_killed_mid_loop_leaves_the_engine_sampling_in_process(local) -> None:
    running = start_server("--device", "cuda", "--allow-shm", "--allow-cuda-ipc", timeout=300)
    seeds = [9 * r for r in range(B)]
    inputs = step_inputs(8, (B, V), torch.bfloat16, seed=3)
    want = reference(local, inputs, [0] * B, seed=seeds, **PARAMS)
    buffer = torch.zeros(B, V, dtype=torch.bfloat16, device="cuda")
    client = SamplerClient(running.target, timeout=5, retries=0)
    try:
        loop = client.colocate(buffer, seed=seeds, position=0, watchdog_s=0.5, **PARAMS)
        got = run_loop(loop, buffer, inputs[:4])
        running.process.send_signal(signal.SIGKILL)
        running.process.wait(timeout=30)
        started = time.monotonic()
        got += run_loop(loop, buffer, inputs[4:])
        assert time.monotonic() - started < 10
        assert loop.fallbacks == 4
        loop.close()  # unregistering fails quietly: the server is gone
    finally:
        client.close()
        running.stop()
    for n, ((tokens, _), (want_tokens, _)) in enumerate(zip(got, want), start=1):
        assert torch.equal(tokens, want_tokens), f"step {n}"


def test_bad_openings_are_refused_by_field(server) -> None:
    with SamplerClient(server.target, timeout=60) as client:
        logits = torch.zeros(4, 100, device="cuda")
        tokens = torch.zeros(4, 1, dtype=torch.int64, device="cuda")
        logits_region = client.register_cuda_region("refusal-logits", logits)
        tokens_region = client.register_cuda_region("refusal-tokens", tokens)
        small = client.register_shm_region("refusal-small-flags", 16)
        flags = client.register_shm_region("refusal-flags", FLAGS_BYTES)
        good = pb.ColocateOpen(logits=logits_region.view_of(logits).ref(), tokens=tokens_region.view_of(tokens).ref(),
                               flags="refusal-flags")

        def refused(opened: pb.ColocateOpen) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as raised:
                next(client._stub.Colocate(iter([pb.ColocateRequest(open=opened)])))
            return raised.value

        cases = []
        wrong_shape = pb.ColocateOpen(); wrong_shape.CopyFrom(good); wrong_shape.tokens.shape[:] = [4, 2]
        cases.append((wrong_shape, grpc.StatusCode.INVALID_ARGUMENT, "open.tokens.shape"))
        tiny = pb.ColocateOpen(); tiny.CopyFrom(good); tiny.flags = "refusal-small-flags"
        cases.append((tiny, grpc.StatusCode.INVALID_ARGUMENT, "open.flags"))
        shm_input = pb.ColocateOpen(); shm_input.CopyFrom(good); shm_input.logits.region = "refusal-flags"
        cases.append((shm_input, grpc.StatusCode.FAILED_PRECONDITION, "open.logits.region"))
        penalty = pb.ColocateOpen(); penalty.CopyFrom(good); penalty.params.repetition_penalty[:] = [1.2]
        cases.append((penalty, grpc.StatusCode.INVALID_ARGUMENT, "open.params.repetition_penalty"))
        missing = pb.ColocateOpen(); missing.CopyFrom(good); missing.flags = "no-such-region"
        cases.append((missing, grpc.StatusCode.NOT_FOUND, "open.flags"))
        for opened, code, field in cases:
            err = refused(opened)
            assert err.code() == code and field in err.details(), (field, err.code(), err.details())
        with pytest.raises(grpc.RpcError) as raised:  # a step before the opening
            next(client._stub.Colocate(iter([pb.ColocateRequest(step=pb.ColocateStep(step=1))])))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for region in (logits_region, tokens_region, small, flags):
            client.unregister_region(region)  # and released
        assert client.health() == "SERVING"


def test_a_loop_announcing_far_ahead_holds_up_no_other_call(server, local) -> None:
    """An engine announces 200 steps and marks none ready: the server queues a few and holds the rest back, so its
    event loop and GPU queue stay free. Meanwhile a plain call is served, and so are 16 loops opened and closed
    and a 17th that checks its tokens: each loop has streams of its own, none of them the stuck loop's."""
    with SamplerClient(server.target, timeout=60) as client:
        stuck_buffer = torch.zeros(B, V, device="cuda")
        stuck = client.colocate(stuck_buffer, seed=list(range(B)), wait_timeout_s=60, **PARAMS)
        for n in range(1, 201):  # announcements only: the engine's stream never writes "ready"
            stuck._requests.put(pb.ColocateRequest(step=pb.ColocateStep(step=n)))
        started = time.monotonic()
        assert client.sample(torch.randn(4, 1000), top_k=5, seed=[1, 2, 3, 4]).valid.all()
        assert time.monotonic() - started < 10
        buffer = torch.zeros(B, V, device="cuda")
        for _ in range(16):
            with client.colocate(buffer, seed=list(range(B)), **PARAMS) as loop:
                run_loop(loop, buffer, step_inputs(1, (B, V), torch.float32, seed=5))
        seeds = [3 * r for r in range(B)]
        inputs = step_inputs(3, (B, V), torch.float32, seed=6)
        want = reference(local, inputs, [0] * B, seed=seeds, **PARAMS)
        with client.colocate(buffer, seed=seeds, position=0, watchdog_s=5, **PARAMS) as loop:
            got = run_loop(loop, buffer, inputs)
            assert loop.fallbacks == 0
        stuck._call.cancel()  # the server ends the stuck loop: its waits end, its stream drains
        stuck.close()
        assert client.health() == "SERVING"
    for (tokens, _), (want_tokens, _) in zip(got, want):
        assert torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("dtype,width", [(torch.float32, 32000), (torch.bfloat16, 4096), (torch.uint8, 1001)])
def test_the_gated_copy_moves_the_input_only_while_its_gate_is_open(dtype, width) -> None:
    """The copy's gate is read once a step into a device word: the copy happens when "ready" holds the step and the
    stop word is clear, and not at all for a stale step or once the stop word is set (also with the word still
    holding an earlier open step's verdict). Odd sizes take the byte-wise copy."""
    from tokensampler_server.backends.cuda_build import load_kernels

    kernels = load_kernels(torch.cuda.current_device())
    ready = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    stop = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    verdict = torch.zeros(1, dtype=torch.int32, device="cuda")
    src = torch.randint(1, 100, (B, width), device="cuda").to(dtype)
    stream = torch.cuda.current_stream().cuda_stream

    def copy(step: int) -> torch.Tensor:
        dst = torch.zeros_like(src)
        kernels.gated_copy(src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size(), ready.data_ptr(),
                           stop.data_ptr(), step, verdict.data_ptr(), stream)
        torch.cuda.synchronize()
        return dst

    ready[0] = 3
    assert torch.equal(copy(3), src)
    assert not copy(4).any()  # "ready" holds an earlier step
    assert torch.equal(copy(3), src)  # the word holds step 3's verdict from here
    stop[0] = 1
    assert not copy(3).any()


# Last in the file: when it fails, the module's server is left unusable.
def test_the_server_survives_an_engine_that_exits_mid_loop(server, local) -> None:
    engine = textwrap.dedent(f"""
        import os, torch
        from tokensampler_client import SamplerClient
        from tokensampler_client._proto import sampler_pb2 as pb
        client = SamplerClient({server.target!r})
        buffer = torch.randn({B}, {V}, device="cuda")
        loop = client.colocate(buffer, seed=list(range({B})), temperature=0.8, top_k=50)
        for _ in range(2):
            loop.step()
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # step 3's input is never ready: the server waits on the GPU
        loop._requests.put(pb.ColocateRequest(step=pb.ColocateStep(step=3)))
        import time; time.sleep(0.5)
        print("exiting", flush=True)
        os._exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", engine], capture_output=True, text=True, timeout=300,
                          env={**os.environ})
    assert "exiting" in done.stdout, done.stderr[-2000:]
    time.sleep(1.0)
    assert server.process.poll() is None
    with SamplerClient(server.target, timeout=60) as client:
        assert client.health() == "SERVING"
        for region in client.list_regions():  # the engine's, left behind: still unregistered cleanly
            if region.name.startswith("colocated-"):
                client.unregister_region(region.name)
        seeds = list(range(B))
        inputs = step_inputs(3, (B, V), torch.float32, seed=4)
        want = reference(local, inputs, [0] * B, seed=seeds, **PARAMS)
        buffer = torch.zeros(B, V, device="cuda")
        with client.colocate(buffer, seed=seeds, position=0, **PARAMS) as loop:
            got = run_loop(loop, buffer, inputs)
            assert loop.fallbacks == 0
        sampled = client.sample(torch.randn(4, 1000), top_k=5, seed=[1, 2, 3, 4])
        assert sampled.valid.all()
    for (tokens, _), (want_tokens, _) in zip(got, want):
        assert torch.equal(tokens, want_tokens)

