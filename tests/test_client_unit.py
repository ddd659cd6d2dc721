"""Client unit tests without a real server: result parsing, retry policy, error mapping, CLI.

RPC behaviour is checked against an in-process gRPC server on a free localhost port whose fake
Sampler servicer fails on demand.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokensampler_client import AsyncSamplerClient, Backoff, SampleResult, SamplerClient, TokenSamplerError
from tokensampler_client import cli
from tokensampler_client._channel import channel_options
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc
from tokensampler_client._retry import CallPolicy, RetryState
from tokensampler_client.tensors import decode_tensor, encode_tensor
from tokensampler_client.weights import weight_options
from tokensampler_client.workloads import build_diffusion_request, build_score_request, build_topk_request

from .polling import wait_until

FAST = Backoff(initial=0.001, maximum=0.002)


# ---- result parsing ---------------------------------------------------------------------------


def hand_built_response(with_logprobs: bool) -> pb.SampleResponse:
    response = pb.SampleResponse(
        tokens=encode_tensor(torch.tensor([[3, 4], [-1, -1]], dtype=torch.int32)),
        seeds=[11, 2**64 - 1],
        valid=[True, False],
        nan_detected=[False, True],
        timings=pb.Timings(queue_ns=1, compute_ns=2, total_ns=3),
        request_id="abc",
    )
    if with_logprobs:
        response.logprobs.CopyFrom(encode_tensor(torch.tensor([[-0.5, -1.5], [float("nan")] * 2])))
        response.top_logprob_ids.CopyFrom(encode_tensor(torch.tensor([[3], [-1]], dtype=torch.int32)))
        response.top_logprobs.CopyFrom(encode_tensor(torch.tensor([[-0.5], [float("nan")]])))
    return response


def test_result_from_response() -> None:
    result = SampleResult.from_response(hand_built_response(with_logprobs=True))
    assert result.tokens.dtype == torch.int64 and result.tokens.tolist() == [[3, 4], [-1, -1]]
    assert result.seeds == [11, 2**64 - 1]
    assert result.valid.dtype == torch.bool and result.valid.tolist() == [True, False]
    assert result.nan_detected.tolist() == [False, True]
    assert (result.timings.queue_ns, result.timings.compute_ns, result.timings.total_ns) == (1, 2, 3)
    assert result.request_id == "abc"
    assert result.logprobs is not None and result.logprobs.dtype == torch.float32
    assert result.logprobs[0].tolist() == [-0.5, -1.5] and result.logprobs[1].isnan().all()
    assert result.top_logprob_ids is not None and result.top_logprob_ids.dtype == torch.int64
    assert result.top_logprob_ids.tolist() == [[3], [-1]]
    assert result.top_logprobs is not None and result.top_logprobs[0].tolist() == [-0.5]
    result.logprobs.add_(1.0)  # the caller owns the memory: writing is allowed


def test_result_without_logprobs() -> None:
    result = SampleResult.from_response(hand_built_response(with_logprobs=False))
    assert result.logprobs is None and result.top_logprob_ids is None and result.top_logprobs is None


def test_result_fields_decoded_on_read_equal_the_whole_result() -> None:
    """from_response decodes a field when it is read; what is read, in any order, is what rows() copies out."""
    response = hand_built_response(with_logprobs=True)
    lazy = SampleResult.from_response(response)
    assert lazy.seeds == [11, 2**64 - 1]  # read first: the rest are still undecoded
    whole = SampleResult.from_response(response).rows(0, 2)
    assert type(whole) is SampleResult and torch.equal(lazy.tokens, whole.tokens)
    assert torch.equal(lazy.valid, whole.valid) and torch.equal(lazy.top_logprob_ids, whole.top_logprob_ids)
    assert lazy.tokens is lazy.tokens  # decoded once, then kept
    assert "tokens=int64[2, 2]" in repr(lazy)
    with pytest.raises(AttributeError, match="no attribute 'token'"):
        lazy.token  # noqa: B018 - a misspelt field is an AttributeError, not a decode


def test_result_rejects_malformed_tensor() -> None:
    response = hand_built_response(with_logprobs=False)
    response.tokens.data = b"\x00"
    with pytest.raises(ValueError, match="tokens.data"):
        SampleResult.from_response(response)


# ---- retry policy -----------------------------------------------------------------------------


def test_backoff_grows_caps_and_jitters() -> None:
    backoff = Backoff(initial=0.05, multiplier=2.0, maximum=2.0, jitter=0.5)
    rng = random.Random(0)
    for retry, base in enumerate([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]):
        delays = [backoff.delay(retry, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays)
        assert len(set(delays)) > 1  # jittered
    assert Backoff(jitter=0.0).delay(3) == pytest.approx(0.4)
    assert Backoff().delay(10_000) <= 2.0  # no overflow for huge retry counts


def test_backoff_rejects_invalid_settings() -> None:
    with pytest.raises(ValueError):
        Backoff(multiplier=0.5)
    with pytest.raises(ValueError):
        Backoff(jitter=1.5)


def test_retry_state_only_retries_unavailable_up_to_the_limit() -> None:
    state = RetryState(retries=2, backoff=FAST, timeout=None)
    assert state.remaining() is None
    assert state.next_delay(grpc.StatusCode.INVALID_ARGUMENT) is None
    assert state.next_delay(grpc.StatusCode.DEADLINE_EXCEEDED) is None
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE) is not None
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE) is not None
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE) is None
    assert state.retries_done == 2


def test_retry_state_never_waits_past_the_deadline() -> None:
    now = [100.0]
    state = RetryState(retries=10, backoff=Backoff(initial=1.0, jitter=0.0), timeout=2.5, clock=lambda: now[0])
    assert state.remaining() == 2.5
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE) == 1.0  # retry at 101 < 102.5
    now[0] = 101.0
    assert state.remaining() == 1.5
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE) is None  # 101 + 2 would pass the deadline
    now[0] = 103.0
    assert state.remaining() == 0.0


def test_call_policy_validation_and_override() -> None:
    with pytest.raises(ValueError, match="retries"):
        CallPolicy(retries=-1)
    with pytest.raises(ValueError, match="timeout"):
        CallPolicy(timeout=0)
    assert CallPolicy(timeout=5.0).start(timeout=1.0).remaining() <= 1.0


def test_channel_options_set_both_limits_and_let_caller_override() -> None:
    opts = dict(channel_options(256, None))
    assert opts["grpc.max_send_message_length"] == opts["grpc.max_receive_message_length"] == 256 << 20
    merged = channel_options(1, [("grpc.max_receive_message_length", 5), ("grpc.keepalive_time_ms", 1000)])
    assert len(merged) == 3 and dict(merged)["grpc.max_receive_message_length"] == 5
    with pytest.raises(ValueError, match="max_message_mb"):
        channel_options(0, None)


# ---- against an in-process fake server --------------------------------------------------------


class FakeSampler(sampler_pb2_grpc.SamplerServicer):
    """Fails the first `failures` calls with `code`, then answers the argmax of each row."""

    def __init__(self) -> None:
        self.failures = 0
        self.code = grpc.StatusCode.UNAVAILABLE
        self.calls = 0
        self.request_ids: list[str] = []
        self.release = threading.Event()
        self.block = False

    def _maybe_fail(self, context: grpc.ServicerContext) -> None:
        self.calls += 1
        self.request_ids.append(dict(context.invocation_metadata()).get("x-request-id", ""))
        if self.block:
            self.release.wait(10)
        if self.calls <= self.failures:
            context.abort(self.code, f"fake failure {self.calls}")

    def Sample(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> pb.SampleResponse:
        self._maybe_fail(context)
        logits = decode_tensor(request.logits, "logits").float()
        n = request.num_samples if request.HasField("num_samples") else 1
        tokens = logits.argmax(dim=1, keepdim=True).to(torch.int32).expand(-1, n)
        rows = logits.shape[0]
        seeds = list(request.params.seed) * (rows if len(request.params.seed) == 1 else 1) or [7] * rows
        response = pb.SampleResponse(
            tokens=encode_tensor(tokens),
            seeds=seeds,
            valid=[True] * rows,
            nan_detected=[False] * rows,
            timings=pb.Timings(queue_ns=1, compute_ns=2, total_ns=3),
            request_id=self.request_ids[-1],
        )
        if request.return_logprobs:
            response.logprobs.CopyFrom(encode_tensor(torch.zeros(rows, n)))
        return response

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfo:
        self._maybe_fail(context)
        return pb.ServerInfo(version="9.9", backend="cpu", device="cpu", api_version="tokensampler.v1",
                             logits_dtypes=[pb.DTYPE_FLOAT32], features=["logprobs"])


@pytest.fixture
def fake() -> Iterator[tuple[FakeSampler, str]]:
    servicer = FakeSampler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.release.set()
    server.stop(grace=None)


def test_sample_round_trip(fake: tuple[FakeSampler, str]) -> None:
    servicer, target = fake
    logits = torch.full((2, 5), -1.0)
    logits[0, 3] = logits[1, 1] = 5.0
    with SamplerClient(target, retries=0) as client:
        result = client.sample(logits.to(torch.bfloat16), seed=5, num_samples=2, return_logprobs=True, request_id="r1")
    assert result.tokens.tolist() == [[3, 3], [1, 1]]
    assert result.seeds == [5, 5]
    assert result.logprobs is not None and result.logprobs.shape == (2, 2)
    assert result.request_id == "r1" and servicer.request_ids == ["r1"]


def test_request_id_generated_when_not_given(fake: tuple[FakeSampler, str]) -> None:
    servicer, target = fake
    with SamplerClient(target) as client:
        first = client.sample(torch.zeros(4)).request_id
        second = client.sample(torch.zeros(4)).request_id
    assert len(first) == 32 and first != second and servicer.request_ids == [first, second]


def test_retries_unavailable_then_succeeds(fake: tuple[FakeSampler, str]) -> None:
    servicer, target = fake
    servicer.failures = 2
    with SamplerClient(target, retries=3, backoff=FAST) as client:
        assert client.sample(torch.zeros(1, 4), request_id="same").tokens.shape == (1, 1)
    assert servicer.calls == 3
    assert servicer.request_ids == ["same"] * 3  # one request id across the retries


def test_retries_exhausted_raise_unavailable(fake: tuple[FakeSampler, str]) -> None:
    servicer, target = fake
    servicer.failures = 100
    with SamplerClient(target, retries=2, backoff=FAST) as client:
        with pytest.raises(TokenSamplerError) as info:
            client.sample(torch.zeros(1, 4), request_id="rid")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.details == "fake failure 3"
    assert info.value.request_id == "rid"
    assert servicer.calls == 3


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_other_codes_are_not_retried(fake: tuple[FakeSampler, str], code: grpc.StatusCode) -> None:
    servicer, target = fake
    servicer.failures, servicer.code = 1, code
    with SamplerClient(target, retries=3, backoff=FAST) as client:
        with pytest.raises(TokenSamplerError) as info:
            client.sample(torch.zeros(1, 4))
        assert info.value.code == code and servicer.calls == 1
        assert str(info.value).startswith(f"{code.name}: fake failure 1 (request_id ")
        client.sample(torch.zeros(1, 4))  # the next call succeeds


def test_deadline_exceeded(fake: tuple[FakeSampler, str]) -> None:
    servicer, target = fake
    servicer.block = True
    with SamplerClient(target, timeout=0.2, retries=3) as client:
        with pytest.raises(TokenSamplerError) as info:
            client.server_info()
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.calls <= 1  # not retried


def test_unreachable_server_is_unavailable() -> None:
    with SamplerClient("127.0.0.1:1", retries=1, backoff=FAST, timeout=10) as client:
        with pytest.raises(TokenSamplerError) as info:
            client.health()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_server_info_and_health(fake: tuple[FakeSampler, str]) -> None:
    _, target = fake
    with SamplerClient(target) as client:
        info = client.server_info()
        assert (info.version, info.backend, info.api_version) == ("9.9", "cpu", "tokensampler.v1")
        assert client.health() == "SERVING"
        with pytest.raises(TokenSamplerError) as err:
            client.health("no.such.Service")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_async_client_retries_and_maps_errors(fake: tuple[FakeSampler, str]) -> None:
    servicer, target = fake
    servicer.failures = 2

    async def scenario() -> tuple[SampleResult, str, grpc.StatusCode]:
        async with AsyncSamplerClient(target, retries=3, backoff=FAST) as client:
            result = await client.sample(torch.tensor([[0.0, 9.0, 1.0]]), temperature=0.0)
            status = await client.health()
            servicer.failures, servicer.code = servicer.calls + 1, grpc.StatusCode.INVALID_ARGUMENT
            try:
                await client.server_info()
            except TokenSamplerError as err:
                return result, status, err.code
        raise AssertionError("server_info did not fail")

    result, status, code = asyncio.run(scenario())
    assert result.tokens.tolist() == [[1]]
    assert status == "SERVING"
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.calls == 4  # 2 failures + 1 success + 1 unretried failure


# ---- command line -----------------------------------------------------------------------------


def test_cli_sample_json(fake: tuple[FakeSampler, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, target = fake
    argv = ["--target", target, "sample", "--random-logits", "3x50", "--dtype", "float16", "--seed", "9", "--logprobs", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 3 and out["seeds"] == ["9", "9", "9"] and out["valid"] == [True] * 3
    assert set(out["timings"]) == {"queue_ns", "compute_ns", "total_ns"} and len(out["logprobs"]) == 3


def test_cli_sample_text_info_and_health(fake: tuple[FakeSampler, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, target = fake
    assert cli.main(["--target", target, "sample", "--random-logits", "2x8", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "row 0: tokens" in out and "row 1: tokens" in out
    assert cli.main(["--target", target, "info"]) == 0
    assert "backend: cpu" in capsys.readouterr().out
    assert cli.main(["--target", target, "health"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_cli_error_exits_non_zero_with_one_line(fake: tuple[FakeSampler, str], capsys: pytest.CaptureFixture[str]) -> None:
    servicer, target = fake
    servicer.failures, servicer.code = 1, grpc.StatusCode.INVALID_ARGUMENT
    assert cli.main(["--target", target, "sample", "--random-logits", "1x4"]) == 1
    err = capsys.readouterr().err
    assert err == "tokensampler: error: INVALID_ARGUMENT: fake failure 1\n"


def test_cli_rejects_bad_shape(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["sample", "--random-logits", "4by10"])
    assert info.value.code == 2
    assert "expected BxV" in capsys.readouterr().err


def test_a_diffusion_mask_is_nonzero_not_cast() -> None:
    """Integers past uint8 and fractions are undecided positions (nonzero), not what a uint8 cast makes of them."""
    from tokensampler_client.workloads import build_diffusion_request

    for mask in (np.array([[256, 0, -256]]), torch.tensor([[0.5, 0.0, 1.0]])):
        request = build_diffusion_request(torch.zeros(1, 3, 4), mask)
        assert decode_tensor(request.mask, "mask").tolist() == [[1, 0, 1]]


@pytest.mark.parametrize("ids", [np.array([[1.7]]), torch.tensor([[1.0]])])
def test_float_token_ids_are_refused_not_truncated(ids) -> None:
    from tokensampler_client.workloads import build_score_request, build_verify_request

    with pytest.raises(TypeError, match="draft_ids: got .*float.*expected integer"):
        build_verify_request(ids, torch.zeros(1, 2, 4), draft_probs=torch.ones(1, 1, 4))
    with pytest.raises(TypeError, match="token_ids: got .*float.*expected integer"):
        build_score_request(torch.zeros(1, 1, 4), ids)


def test_closing_a_client_ends_its_calls_in_flight_with_cancelled() -> None:
    """Not a retry of the caller's own cancellation on the closed channel (ValueError), nor a bare CancelledError
    in an asyncio caller that nobody cancelled."""
    attempts: list[float] = []

    class Slow(grpc.GenericRpcHandler):
        def service(self, details):
            def handle(request, context):
                attempts.append(1.0)
                time.sleep(1.0)
                context.abort(grpc.StatusCode.INTERNAL, "late")
            return grpc.unary_unary_rpc_method_handler(handle)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((Slow(),))
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        client, outcome = SamplerClient(target, timeout=10), {}

        def call() -> None:
            try:
                client.sample(torch.randn(1, 10))
            except Exception as err:  # noqa: BLE001 - what the caller sees is the point
                outcome["error"] = err

        thread = threading.Thread(target=call)
        thread.start()
        wait_until(lambda: attempts, "the call reached the server")
        client.close()
        thread.join(5)
        assert isinstance(outcome["error"], TokenSamplerError) and outcome["error"].code == grpc.StatusCode.CANCELLED
        assert len(attempts) == 1

        async def run() -> BaseException:
            aclient = AsyncSamplerClient(target, timeout=10)
            task = asyncio.ensure_future(aclient.sample(torch.randn(1, 10)))
            await asyncio.sleep(0.3)
            await aclient.close()
            try:
                await asyncio.wait_for(task, 5)
            except BaseException as err:  # noqa: BLE001
                return err
            raise AssertionError("the call succeeded")

        error = asyncio.run(run())
        assert isinstance(error, TokenSamplerError) and error.code == grpc.StatusCode.CANCELLED, error
    finally:
        server.stop(0)


def test_stream_and_calls_cancelled_under_the_caller_raise_token_sampler_errors() -> None:
    """A stream's receive() after one that asyncio.wait_for cancelled (which cancels the call), a receive() waiting
    when its client closes, and calls and streams opened on a closed client (sync and asyncio) raise
    TokenSamplerError CANCELLED; before, grpc's CancelledError, UsageError or ValueError came through. The caller's
    own cancellation stays a CancelledError (asyncio.wait_for's timeout)."""

    class Silent(grpc.GenericRpcHandler):
        def service(self, details):
            def handle(requests, context):
                for _ in requests:  # reads every request and answers none
                    pass
                return iter(())
            return grpc.stream_stream_rpc_method_handler(handle)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((Silent(),))
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    logits = torch.randn(1, 10)

    async def run() -> None:
        client = AsyncSamplerClient(target, timeout=10)
        stream = client.stream()
        await stream.send(logits)
        await stream.send(logits)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stream.receive(), 0.2)
        with pytest.raises(TokenSamplerError) as raised:
            await stream.receive()
        assert raised.value.code == grpc.StatusCode.CANCELLED
        waiting_stream = client.stream()
        await waiting_stream.send(logits)
        waiting = asyncio.ensure_future(waiting_stream.receive())
        await asyncio.sleep(0.2)
        await client.close()
        with pytest.raises(TokenSamplerError) as raised:
            await asyncio.wait_for(waiting, 5)
        assert raised.value.code == grpc.StatusCode.CANCELLED
        for after_close in (lambda: client.sample(logits), lambda: client.health()):
            with pytest.raises(TokenSamplerError) as raised:
                await after_close()
            assert raised.value.code == grpc.StatusCode.CANCELLED and "closed" in raised.value.details
        with pytest.raises(TokenSamplerError):
            client.stream()

    try:
        asyncio.run(run())
        client = SamplerClient(target, timeout=10)
        client.close()
        for after_close in (lambda: client.sample(logits), client.stream):
            with pytest.raises(TokenSamplerError) as raised:
                after_close()
            assert raised.value.code == grpc.StatusCode.CANCELLED
    finally:
        server.stop(0)


@pytest.mark.parametrize("build, name", [
    (lambda: build_topk_request(torch.zeros(1, 4), k=-1), "k"),
    (lambda: build_topk_request(torch.zeros(1, 4), k=2, temperature="1"), "temperature"),
    (lambda: build_diffusion_request(torch.zeros(1, 2, 4), torch.ones(1, 2), commit_count=-1), "commit_count"),
    (lambda: build_diffusion_request(torch.zeros(1, 2, 4), torch.ones(1, 2), confidence_threshold=[0.9, None]),
     "confidence_threshold"),
    (lambda: build_score_request(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.int64), top_logprobs=-1),
     "top_logprobs"),
    (lambda: build_score_request(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.int64), mode="x"), "mode"),
    (lambda: weight_options(vocab_size=-1), "vocab_size"),
    (lambda: weight_options(soft_cap="x"), "soft_cap"),
])
def test_workload_and_weight_arguments_are_named_in_their_errors(build, name: str) -> None:
    with pytest.raises((TypeError, ValueError)) as raised:
        build()
    assert str(raised.value).startswith(f"{name}:"), raised.value


def test_deadlines_too_far_off_for_grpc_are_sent_as_none() -> None:
    """grpc turns a timeout past ~1e10 s (inf included) into a deadline already passed: every call failed
    DEADLINE_EXCEEDED at once. Such deadlines go as none; NaN and non-positive ones are refused."""
    policy = CallPolicy(timeout=float("inf"))
    assert policy.start().remaining() is None and policy.start(timeout=1e10).remaining() is None
    assert 4.0 < policy.start(timeout=5.0).remaining() <= 5.0
    for bad in (float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="timeout"):
            CallPolicy(timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            policy.start(timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            SamplerClient("127.0.0.1:1").stream(timeout=bad)  # streams take the same timeouts
    client = SamplerClient("127.0.0.1:1")
    assert client._stream_retry(float("inf")).remaining() is None and client._stream_retry(None).remaining() is None
    assert 4.0 < client._stream_retry(5.0).remaining() <= 5.0


def test_an_array_of_a_released_shared_memory_region_stays_valid() -> None:
    """An engine may keep the arrays of a shared-memory region past its unregistration: they keep their own mapping
    of the segment, so writing through one after `release` works (before: SharedMemory.close unmapped the memory
    under them, and the write killed the process with SIGSEGV; run in a child process so that a crash fails only
    this test). The segment's name is gone at once, a second release does nothing, and `tensor` refuses."""
    import subprocess
    import sys

    child = """
import os, torch
from tokensampler_client.regions import SharedMemoryRegion
region = SharedMemoryRegion("r", 1 << 20)
x = region.tensor(torch.float32, (256, 1024))
x.fill_(1.0)
key = region.request.shm.key
region.release()
region.release()
assert not os.path.exists("/dev/shm/" + key)
x.add_(1.0)
print(float(x.sum()))
try:
    region.tensor(torch.float32, (1,))
except ValueError as err:
    print(err)
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [str(2.0 * 256 * 1024), "region 'r': released; register a region again"]
