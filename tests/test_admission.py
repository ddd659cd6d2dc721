"""Admission control against real servers: caps on the calls held at once, counted after authentication.

Calls are held open without a gate in the server: streams that send nothing (SampleStream, RegisterWeights,
health Watch) and a unary Sample that waits out a long --max-queue-delay-us. What each server holds is read
from its metrics (`tokensampler_admitted_calls`), polled with a deadline. The caps are set through their
TOKENSAMPLER_* variables, the flags' other spelling.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import signal
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError
from tokensampler_client._channel import call_metadata
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.params import build_sample_request
from tokensampler_server.app.cli import parse_args
from tokensampler_server.rpc.admission import Admission

from .conftest import RunningServer, start_server
from .gated_server import GATE_SEED, ServerGate
from .raw_h2 import UnreadingConnection
from .test_metrics import metrics_port, parse_samples, scrape_text, value

TOKENS = [secrets.token_urlsafe(32), secrets.token_urlsafe(32)]
SAMPLER = "/tokensampler.v1.Sampler/"
WATCH = "/grpc.health.v1.Health/Watch"
OVERLOAD = ("x-retryable", "overload")


def start_capped(tmp_path: Path, *, calls: int, watchers: int = 64, per_client: int = 256, tokens: bool = True,
                 reclaim_idle_s: float = 0.0, args: Sequence[str] = ()) -> RunningServer:
    """A CPU server with these caps; idle streams keep their slots unless `reclaim_idle_s` is set."""
    flags = ["--device", "cpu", "--max-concurrent-rpcs", str(calls), "--reclaim-idle-calls-s", str(reclaim_idle_s),
             *args]
    if tokens:
        path = tmp_path / "tokens"
        path.write_text("\n".join(TOKENS) + "\n")
        flags += ["--auth-token-file", str(path)]
    return start_server(*flags, env={"TOKENSAMPLER_MAX_HEALTH_WATCHERS": str(watchers),
                                     "TOKENSAMPLER_MAX_CALLS_PER_CLIENT": str(per_client)})


def run_then_stop(running: RunningServer, scenario: Callable[[], Coroutine[Any, Any, None]],
                  sig: int = signal.SIGTERM) -> None:
    """Runs the async `scenario` against `running`, then stops the server with `sig` whatever the scenario did."""
    try:
        asyncio.run(scenario())
    finally:
        running.stop(sig)


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return call_metadata(secrets.token_hex(8), token)


def held(server: RunningServer) -> dict[str, float | None]:
    samples = parse_samples(scrape_text(metrics_port(server)))
    return {pool: value(samples, "tokensampler_admitted_calls", pool=pool)
            for pool in ("calls", "health_watchers", "uploads")}


async def wait_held(server: RunningServer, calls: int, watchers: int = 0, timeout: float = 20.0,
                    uploads: int = 0) -> None:
    """Polls the metrics until the server holds `calls` service calls, `watchers` Watch streams and `uploads`
    RegisterWeights uploads."""
    expected = {"calls": calls, "health_watchers": watchers, "uploads": uploads}
    deadline = time.monotonic() + timeout
    while (seen := await asyncio.to_thread(held, server)) != expected:
        assert time.monotonic() < deadline, f"held {seen}, expected {expected}"
        await asyncio.sleep(0.05)


def refusals(server: RunningServer, limit: str) -> float | None:
    return value(parse_samples(scrape_text(metrics_port(server))), "tokensampler_admission_refusals_total", limit=limit)


async def assert_refused(call: grpc.aio.Call, flag: str, limit: int) -> None:
    """The call ended at once with RESOURCE_EXHAUSTED naming the limit, marked retryable."""
    code = await asyncio.wait_for(call.code(), 10)
    details = await call.details()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert f"at most {limit} ({flag})" in details and "(request id " in details, details
    assert OVERLOAD in tuple(await call.trailing_metadata())


def open_stream(channel: grpc.aio.Channel, token: str | None,
                timeout: float | None = None) -> grpc.aio.StreamStreamCall:
    """A SampleStream that sends nothing: it holds its slot until it is cancelled or its deadline passes."""
    method = channel.stream_stream(SAMPLER + "SampleStream", request_serializer=pb.SampleRequest.SerializeToString,
                                   response_deserializer=pb.SampleStreamResponse.FromString)
    return method(metadata=metadata(token), timeout=timeout)


def open_watch(channel: grpc.aio.Channel, timeout: float | None = None) -> grpc.aio.UnaryStreamCall:
    method = channel.unary_stream(WATCH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                  response_deserializer=health_pb2.HealthCheckResponse.FromString)
    return method(health_pb2.HealthCheckRequest(service=""), timeout=timeout)


async def first_answer(call: grpc.aio.Call) -> object:
    """The call's first response, or its status code when it ended without one."""
    try:
        return await asyncio.wait_for(call.read(), 10)
    except grpc.aio.AioRpcError as err:
        return err.code()


async def sample_on(call: grpc.aio.StreamStreamCall) -> pb.SampleStreamResponse:
    await call.write(build_sample_request(torch.randn(1, 16), seed=1))
    return await asyncio.wait_for(call.read(), 30)


async def open_held(channel: grpc.aio.Channel, token: str | None) -> grpc.aio.StreamStreamCall:
    """A SampleStream that answered one message (so it was admitted) and stays open, holding its slot."""
    call = open_stream(channel, token)
    assert (await sample_on(call)).response.tokens.shape == [1, 1]
    return call


def test_limits_are_flags() -> None:
    config = parse_args(["--max-concurrent-rpcs", "9", "--max-health-watchers", "3", "--max-calls-per-client", "2",
                         "--reclaim-idle-calls-s", "2.5", "--max-uploads", "5"])
    assert (config.max_concurrent_rpcs, config.max_health_watchers, config.max_calls_per_client,
            config.reclaim_idle_calls_s, config.max_uploads) == (9, 3, 2, 2.5, 5)
    for flag in ("--max-health-watchers", "--max-calls-per-client", "--reclaim-idle-calls-s", "--max-uploads"):
        with pytest.raises(SystemExit):
            parse_args([flag, "-1"])
    for seconds in ("nan", "inf"):  # nan > 0 is false: it would have turned reclaiming off unsaid
        with pytest.raises(SystemExit):
            parse_args(["--reclaim-idle-calls-s", seconds])


def test_colocated_loops_are_never_reclaimed() -> None:
    """A colocated loop holds an engine's GPU hand-off and waits between its requests by design."""
    admission = Admission(4, 4, 4, reclaim_idle_s=1.0)
    assert admission.reclaims(SAMPLER.lstrip("/") + "SampleStream")
    assert admission.reclaims("grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not admission.reclaims(SAMPLER.lstrip("/") + "Colocate")
    assert not Admission(4, 4, 4).reclaims(SAMPLER.lstrip("/") + "SampleStream")  # 0: never



def test_unauthenticated_watchers_cannot_take_the_slots_of_the_service(tmp_path: Path) -> None:
    """12 Watch streams without a token against 8 service slots and 4 watcher slots: 4 are held, 8 refused, and
    an authenticated Sample and a health Check still get through."""
    running = start_capped(tmp_path, calls=8, watchers=4)

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            watches = [open_watch(channel) for _ in range(12)]
            firsts = await asyncio.gather(*(first_answer(call) for call in watches))
            serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            assert sum(first == serving for first in firsts) == 4, firsts
            for call, first in zip(watches, firsts):
                if first != serving:
                    await assert_refused(call, "--max-health-watchers", 4)
            async with AsyncSamplerClient(running.target, timeout=30, retries=0, auth_token=TOKENS[0]) as client:
                assert (await client.sample(torch.randn(2, 16), seed=[1, 2])).tokens.shape == (2, 1)
            async with AsyncSamplerClient(running.target, timeout=30, retries=0) as anonymous:
                assert await anonymous.health() == "SERVING"  # Check: not counted, probes get through
            await wait_held(running, calls=0, watchers=4)
            for call in watches:
                call.cancel()
        assert refusals(running, "health_watchers") == 8

    run_then_stop(running, run)


def test_uploads_that_trickle_cannot_take_the_slots_of_the_service(tmp_path: Path) -> None:
    """4 RegisterWeights uploads that send their header and then nothing, against 8 service slots and 2 upload
    slots: 2 are held, 2 refused naming --max-uploads, and a Sample still gets through with no service slot held
    by an upload (before: uploads kept every slot, each byte restarting their idle timer)."""
    running = start_capped(tmp_path, calls=8, args=("--max-uploads", "2"))
    upload = pb.RegisterWeightsChunk(name="head", dtype=pb.DTYPE_FLOAT32, shape=[4, 2])

    async def run() -> None:
        stalled = asyncio.Event()

        async def header_then_nothing() -> AsyncIterator[pb.RegisterWeightsChunk]:
            yield upload
            await stalled.wait()

        async with grpc.aio.insecure_channel(running.target) as channel:
            method = channel.stream_unary(SAMPLER + "RegisterWeights",
                                          request_serializer=pb.RegisterWeightsChunk.SerializeToString,
                                          response_deserializer=pb.WeightsInfo.FromString)
            calls = [method(header_then_nothing(), metadata=metadata(TOKENS[0])) for _ in range(4)]
            deadline = time.monotonic() + 20
            while sum(call.done() for call in calls) < 2:
                assert time.monotonic() < deadline, "the uploads past the cap were not refused"
                await asyncio.sleep(0.05)
            done = [call for call in calls if call.done()]
            assert len(done) == 2
            for call in done:
                await assert_refused(call, "--max-uploads", 2)
            async with AsyncSamplerClient(running.target, timeout=30, retries=0, auth_token=TOKENS[0]) as client:
                assert (await client.sample(torch.randn(2, 16), seed=[1, 2])).tokens.shape == (2, 1)
            await wait_held(running, calls=0, uploads=2)
            for call in calls:
                call.cancel()
        assert refusals(running, "uploads") == 2

    run_then_stop(running, run)


def test_one_client_at_its_cap_leaves_the_others_their_slots(tmp_path: Path) -> None:
    """Token A holds its 3 calls: its next stream and its next unary call are refused, its held streams still
    sample, and token B, from the same address, gets through."""
    running = start_capped(tmp_path, calls=16, per_client=3)

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            streams = [await open_held(channel, TOKENS[0]) for _ in range(3)]
            extra = open_stream(channel, TOKENS[0])
            await assert_refused(extra, "--max-calls-per-client", 3)
            async with AsyncSamplerClient(running.target, timeout=30, retries=0, auth_token=TOKENS[0]) as client_a:
                with pytest.raises(TokenSamplerError) as raised:
                    await client_a.sample(torch.randn(1, 16))
                assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "at most 3 (--max-calls-per-client)" in raised.value.details
            async with AsyncSamplerClient(running.target, timeout=30, retries=0, auth_token=TOKENS[1]) as client_b:
                assert (await client_b.sample(torch.randn(2, 16), seed=[1, 2])).tokens.shape == (2, 1)
            other = await open_held(channel, TOKENS[1])
            assert (await sample_on(streams[0])).response.tokens.shape == [1, 1]  # A's held calls go on
            for call in (*streams, other):
                call.cancel()
            await wait_held(running, calls=0)
        assert refusals(running, "calls_per_client") == 2

    run_then_stop(running, run)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_without_tokens_a_client_is_its_connection(tmp_path: Path, transport: str) -> None:
    """Colocated engines all come from 127.0.0.1: without tokens each TCP connection is a client of its own.
    Against a cap of 2 per client, a connection's third stream is refused while another connection's is admitted.
    grpc names every Unix-socket peer alike, so those are not counted per client at all (counted as one, an engine
    at its cap refused every other local client): each is bounded by its connection's stream limit instead."""
    socket = tmp_path / "ts.sock"
    running = start_capped(tmp_path, calls=16, per_client=2, tokens=False, args=["--uds", str(socket)])
    target = running.target if transport == "tcp" else f"unix://{socket}"

    async def run() -> None:
        # a subchannel pool of its own each: two connections, not one shared
        channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(2)]
        try:
            streams = [await open_held(channels[0], None) for _ in range(2)]
            if transport == "tcp":
                await assert_refused(open_stream(channels[0], None), "--max-calls-per-client", 2)
            else:
                streams.append(await open_held(channels[0], None))
            streams.append(await open_held(channels[1], None))
            for call in streams:
                call.cancel()
        finally:
            for channel in channels:
                await channel.close()

    run_then_stop(running, run)


async def open_every_kind(channel: grpc.aio.Channel, timeout: float | None) -> list[grpc.aio.Call]:
    """One held call of each kind: unary (a Sample waiting out the queue delay), client streaming
    (RegisterWeights sending no chunk), server streaming (health Watch), bidirectional (SampleStream)."""
    sample = channel.unary_unary(SAMPLER + "Sample", request_serializer=pb.SampleRequest.SerializeToString,
                                 response_deserializer=pb.SampleResponse.FromString)
    register = channel.stream_unary(SAMPLER + "RegisterWeights",
                                    request_serializer=pb.RegisterWeightsChunk.SerializeToString,
                                    response_deserializer=pb.WeightsInfo.FromString)
    return [sample(build_sample_request(torch.randn(1, 16), seed=1), metadata=metadata(TOKENS[0]), timeout=timeout),
            register(metadata=metadata(TOKENS[0]), timeout=timeout),
            open_watch(channel, timeout), open_stream(channel, TOKENS[0], timeout)]


def test_slots_come_back_after_cancel_and_deadline(tmp_path: Path) -> None:
    """2 service slots, 1 upload slot, 3 per client, 1 watcher slot, each full with one call of every kind:
    cancelled, then past their deadline, the calls give their slots back, and the same calls are admitted again."""
    running = start_capped(tmp_path, calls=2, watchers=1, per_client=3,
                           args=["--max-queue-delay-us", "600000000", "--max-uploads", "1"])

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            calls = await open_every_kind(channel, timeout=None)
            await wait_held(running, calls=2, watchers=1, uploads=1)
            for call in calls:
                call.cancel()
            await wait_held(running, calls=0, watchers=0)

            calls = await open_every_kind(channel, timeout=8.0)
            await wait_held(running, calls=2, watchers=1, uploads=1)
            codes = await asyncio.wait_for(asyncio.gather(*(call.code() for call in calls)), 30)
            assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
            await wait_held(running, calls=0, watchers=0)

            calls = await open_every_kind(channel, timeout=None)
            await wait_held(running, calls=2, watchers=1, uploads=1)
            await assert_refused(open_stream(channel, TOKENS[1]), "--max-concurrent-rpcs", 2)
            for call in calls:
                call.cancel()
            await wait_held(running, calls=0, watchers=0)

    # A graceful stop would wait out the queue delay of the cancelled Samples.
    run_then_stop(running, run, signal.SIGKILL)


def test_the_global_cap_refuses_at_once_and_spares_health(tmp_path: Path) -> None:
    """Tokens A and B hold 2 calls each of 4 service slots: A's third call is refused by the global cap (A is
    below its own), quickly; a Watch stream and a health Check still get through."""
    running = start_capped(tmp_path, calls=4, per_client=3)

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            streams = [await open_held(channel, token) for token in (*TOKENS, *TOKENS)]
            await assert_refused(open_stream(channel, TOKENS[0]), "--max-concurrent-rpcs", 4)
            info = channel.unary_unary(SAMPLER + "GetServerInfo",
                                       request_serializer=pb.GetServerInfoRequest.SerializeToString,
                                       response_deserializer=pb.ServerInfo.FromString)
            elapsed = []
            for _ in range(200):
                started = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await info(pb.GetServerInfoRequest(), metadata=metadata(TOKENS[1]), timeout=30)
                elapsed.append(time.perf_counter() - started)
                assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert OVERLOAD in tuple(raised.value.trailing_metadata())
            quantiles = statistics.quantiles(elapsed, n=100)
            print(f"\n200 refusals at the global cap: p50 {quantiles[49] * 1e3:.2f} ms, "
                  f"p99 {quantiles[98] * 1e3:.2f} ms")
            assert max(elapsed) < 5.0  # the deadline is 30 s: a refusal is no wait
            watch = open_watch(channel)
            assert (await first_answer(watch)).status == health_pb2.HealthCheckResponse.SERVING
            async with AsyncSamplerClient(running.target, timeout=30, retries=0) as anonymous:
                assert await anonymous.health() == "SERVING"
            for call in (*streams, watch):
                call.cancel()
            await wait_held(running, calls=0)
        assert refusals(running, "calls") == 201

    run_then_stop(running, run)


def test_a_connection_of_calls_that_never_send_their_request_leaves_health_and_others_served(tmp_path: Path) -> None:
    """Unary calls whose request never arrives are not admitted (admission runs in the handler) but count against
    grpc's backstop (2 × 16 + 4 here). A connection opens 60 of them: HTTP/2's per-connection stream limit (the
    per-client cap + 16) makes its client hold back the rest, so another connection's Sample and health check are
    still served."""
    running = start_capped(tmp_path, calls=16, watchers=4, per_client=4, tokens=False)

    async def run() -> None:
        hog = grpc.aio.insecure_channel(running.target, options=[("grpc.use_local_subchannel_pool", 1)])
        other = grpc.aio.insecure_channel(running.target, options=[("grpc.use_local_subchannel_pool", 1)])
        held = asyncio.Event()

        async def never():  # noqa: ANN202 - a request stream that sends nothing
            await held.wait()
            yield b""

        info = hog.stream_unary(SAMPLER + "GetServerInfo")
        calls = [info(never()) for _ in range(60)]
        try:
            await asyncio.sleep(1.0)
            sample = other.unary_unary(SAMPLER + "Sample", request_serializer=pb.SampleRequest.SerializeToString,
                                       response_deserializer=pb.SampleResponse.FromString)
            await sample(build_sample_request(torch.randn(1, 16), seed=1), timeout=10)
            check = other.unary_unary("/grpc.health.v1.Health/Check",
                                      request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                      response_deserializer=health_pb2.HealthCheckResponse.FromString)
            status = (await check(health_pb2.HealthCheckRequest(), timeout=10)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        finally:
            for call in calls:
                call.cancel()
            await hog.close()
            await other.close()

    run_then_stop(running, run)


async def assert_reclaimed(call: grpc.aio.StreamStreamCall) -> None:
    """The stream ended with RESOURCE_EXHAUSTED: a new call took its slot while it was idle; retryable."""
    code = await asyncio.wait_for(call.code(), 10)
    details = await call.details()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "idle" in details and "(--reclaim-idle-calls-s 2)" in details and "reopen the stream" in details, details
    assert OVERLOAD in tuple(await call.trailing_metadata())


def test_at_the_cap_a_new_call_takes_the_slot_of_the_stream_idle_longest(tmp_path: Path) -> None:
    """3 slots held by SampleStreams of two tokens. While none has been idle 2 s, a new call is refused; after, a new
    call ends the stream idle longest and is served: first the one that never sent a message, then, the slots full
    again, the one idle longest (not the one that sampled since, nor the newest). The others go on sampling, and
    the slots all come back."""
    running = start_capped(tmp_path, calls=3, reclaim_idle_s=2.0)

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            first = open_stream(channel, TOKENS[0])  # never sends: idle from its start
            await wait_held(running, calls=1)
            second, third = await open_held(channel, TOKENS[1]), await open_held(channel, TOKENS[0])
            await assert_refused(open_stream(channel, TOKENS[1]), "--max-concurrent-rpcs", 3)
            await asyncio.sleep(2.2)
            assert (await sample_on(second)).response.tokens.shape == [1, 1]  # idle again from now
            async with AsyncSamplerClient(running.target, timeout=30, retries=0, auth_token=TOKENS[1]) as client:
                assert (await client.sample(torch.randn(2, 16), seed=[1, 2])).tokens.shape == (2, 1)
                await assert_reclaimed(first)
                fourth = await open_held(channel, TOKENS[1])  # full again: second, third, fourth
                assert (await client.sample(torch.randn(1, 16), seed=3)).tokens.shape == (1, 1)
                await assert_reclaimed(third)
            for stream in (second, fourth):
                assert (await sample_on(stream)).response.tokens.shape == [1, 1]
            await wait_held(running, calls=2)
            for stream in (second, fourth):
                stream.cancel()
            await wait_held(running, calls=0)
        assert refusals(running, "calls") == 1

    run_then_stop(running, run)


def test_a_client_stream_whose_slot_was_reclaimed_opens_again_with_its_unanswered_requests(tmp_path: Path) -> None:
    """One slot. A client's SampleStream samples, then sits idle past --reclaim-idle-calls-s, and a new call takes
    its slot. The stream's next two requests, pipelined, are answered on the stream the client opens again, with the
    tokens they get as unary calls; the sync client's too. A client without retries sees the overload instead."""
    running = start_capped(tmp_path, calls=1, reclaim_idle_s=0.3, tokens=False)
    logits = [torch.randn(2, 16) for _ in range(3)]

    async def take_the_slot() -> None:
        await asyncio.sleep(0.6)  # the stream idle past the threshold
        async with AsyncSamplerClient(running.target, timeout=30, retries=0) as other:
            assert (await other.sample(torch.randn(1, 16), seed=9)).tokens.shape == (1, 1)

    async def run() -> None:
        async with AsyncSamplerClient(running.target, timeout=30, retries=3) as client:
            want = [(await client.sample(x, seed=[i, i + 1])).tokens for i, x in enumerate(logits)]
            async with client.stream() as stream:
                assert torch.equal((await stream.sample(logits[0], seed=[0, 1])).tokens, want[0])
                await take_the_slot()
                await stream.send(logits[1], seed=[1, 2])
                await stream.send(logits[2], seed=[2, 3])
                for expected in want[1:]:
                    assert torch.equal((await stream.receive()).tokens, expected)
                assert stream.reopens == 1
            await wait_held(running, calls=0)  # the closed stream's slot comes back once the server sees it end
            with SamplerClient(running.target, timeout=30, retries=3) as sync_client:
                with sync_client.stream() as stream:
                    assert torch.equal(stream.sample(logits[0], seed=[0, 1]).tokens, want[0])
                    await take_the_slot()
                    stream.send(logits[1], seed=[1, 2])
                    stream.send(logits[2], seed=[2, 3])
                    for expected in want[1:]:
                        assert torch.equal(stream.receive().tokens, expected)
                    assert stream.reopens == 1
        await wait_held(running, calls=0)
        async with AsyncSamplerClient(running.target, timeout=30, retries=0) as client:
            async with client.stream() as stream:
                await stream.sample(logits[0], seed=[0, 1])
                await take_the_slot()
                with pytest.raises(TokenSamplerError) as refused:
                    await stream.sample(logits[1], seed=[1, 2])
                assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and stream.reopens == 0
                assert "reopen the stream" in refused.value.details

    run_then_stop(running, run)


def test_a_client_stream_refused_at_the_cap_opens_once_a_slot_is_free_each_overload_with_its_retries(
        tmp_path: Path) -> None:
    """One slot, held. A client's stream is refused as it opens, with three requests of 1, 2 and 3 rows sent before
    the first receive (writes that race the refusal too); the slot is freed 0.3 s later, and each request gets its
    own answer, in order, on the streams the client opens again, asyncio and sync. With 2 retries, a stream whose
    idle slot is then reclaimed three times opens again every time: the retries count from the last answer."""
    running = start_capped(tmp_path, calls=1, reclaim_idle_s=0.3, tokens=False)
    logits = [torch.randn(rows, 16) for rows in (1, 2, 3)]
    seeds = [list(range(10 * i, 10 * i + rows)) for i, rows in enumerate((1, 2, 3))]

    async def free_later(holder: grpc.aio.StreamStreamCall) -> None:
        await asyncio.sleep(0.3)
        holder.cancel()

    def sync_answers() -> list[torch.Tensor]:
        with SamplerClient(running.target, timeout=30, retries=10) as client, client.stream() as stream:
            for x, seed in zip(logits, seeds):
                stream.send(x, seed=seed)
            answers = [stream.receive().tokens for _ in logits]
            assert stream.reopens >= 1
            return answers

    async def run() -> None:
        async with AsyncSamplerClient(running.target, timeout=30, retries=10) as client:
            want = [(await client.sample(x, seed=seed)).tokens for x, seed in zip(logits, seeds)]
            async with grpc.aio.insecure_channel(running.target) as channel:
                holder = await open_held(channel, None)
                async with client.stream() as stream:
                    for x, seed in zip(logits, seeds):
                        await stream.send(x, seed=seed)
                    freed = asyncio.ensure_future(free_later(holder))
                    for expected in want:
                        assert torch.equal((await stream.receive()).tokens, expected)
                    await freed
                    assert stream.reopens >= 1
                await wait_held(running, calls=0)  # the closed stream's slot comes back once the server sees it end
                holder = await open_held(channel, None)
                freed = asyncio.ensure_future(free_later(holder))
                got = await asyncio.to_thread(sync_answers)
                await freed
                assert all(torch.equal(g, w) for g, w in zip(got, want))
        await wait_held(running, calls=0)
        async with AsyncSamplerClient(running.target, timeout=30, retries=2) as client:
            async with client.stream() as stream:
                await stream.sample(logits[0], seed=seeds[0])
                for reclaim in range(3):
                    await asyncio.sleep(0.6)  # idle past the threshold, then a new call takes the slot
                    async with AsyncSamplerClient(running.target, timeout=30, retries=0) as other:
                        await other.sample(torch.randn(1, 16), seed=9)
                    assert torch.equal((await stream.sample(logits[0], seed=seeds[0])).tokens, want[0])
                    assert stream.reopens == reclaim + 1

    run_then_stop(running, run)


def test_a_client_stream_whose_reopening_is_cancelled_ends_there(tmp_path: Path) -> None:
    """One slot, held: a stream's receive() keeps opening the stream again, refused each time; its caller cancels it.
    The stream ends there: its later calls raise CANCELLED (a call opened without the pending requests would answer
    later ones in their place), and it holds no slot."""
    running = start_capped(tmp_path, calls=1, tokens=False)

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            holder = await open_held(channel, None)
            async with AsyncSamplerClient(running.target, timeout=30, retries=50) as client:
                stream = client.stream()
                await stream.send(torch.randn(1, 16), seed=1)
                receiving = asyncio.ensure_future(stream.receive())
                while stream.reopens < 2:
                    await asyncio.sleep(0.01)
                receiving.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await receiving
                for later in (stream.receive(), stream.sample(torch.randn(1, 16), seed=2)):
                    with pytest.raises(TokenSamplerError) as ended:
                        await later
                    assert ended.value.code == grpc.StatusCode.CANCELLED
                await stream.close()
            holder.cancel()
            await wait_held(running, calls=0)

    run_then_stop(running, run)


def test_a_stream_with_a_message_unanswered_keeps_its_slot(tmp_path: Path) -> None:
    """2 slots: a SampleStream whose message waits out a long queue delay, and a unary Sample doing the same. Idle
    past --reclaim-idle-calls-s? Neither: the stream has a message in flight and a unary call is never idle, so a
    new call is refused and both keep their slots."""
    running = start_capped(tmp_path, calls=2, reclaim_idle_s=0.2, args=["--max-queue-delay-us", "600000000"])

    async def run() -> None:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stream = open_stream(channel, TOKENS[0])
            await stream.write(build_sample_request(torch.randn(1, 16), seed=1))
            sample = channel.unary_unary(SAMPLER + "Sample", request_serializer=pb.SampleRequest.SerializeToString,
                                         response_deserializer=pb.SampleResponse.FromString)
            held_call = sample(build_sample_request(torch.randn(1, 16), seed=2), metadata=metadata(TOKENS[1]))
            await wait_held(running, calls=2)
            await asyncio.sleep(0.5)
            await assert_refused(open_stream(channel, TOKENS[1]), "--max-concurrent-rpcs", 2)
            assert not stream.done() and not held_call.done()
            for call in (stream, held_call):
                call.cancel()
            await wait_held(running, calls=0)

    # A graceful stop would wait out the queue delay of the cancelled calls.
    run_then_stop(running, run, signal.SIGKILL)


async def served_once_idle(client: AsyncSamplerClient, within_s: float = 30.0) -> Any:
    """A Sample served once a held call has waited out the threshold: refused (RESOURCE_EXHAUSTED) until then, which
    on a loaded host can come later than on an idle one, since the wait starts only once the held call's answer is
    made."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await client.sample(torch.randn(1, 16), seed=1)
        except TokenSamplerError as err:
            if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


@pytest.mark.parametrize("method", ["Sample", "SampleStream"])
def test_a_call_whose_answer_is_never_read_gives_its_slot_to_a_new_call(tmp_path: Path, method: str) -> None:
    """A client that grants no flow-control window holds both slots with two calls whose 3 MB answers the server
    cannot send. While they have waited less than --reclaim-idle-calls-s a new call is refused; after, a new call
    cancels one of them and is served, and the other holds its slot until its client goes."""
    running = start_capped(tmp_path, calls=2, tokens=False, reclaim_idle_s=1.5)
    request = build_sample_request(torch.zeros(4096, 2, dtype=torch.float16), seed=1, num_samples=64,
                                   return_logprobs=True).SerializeToString()

    async def run() -> None:
        host, port = running.target.rsplit(":", 1)
        unread = UnreadingConnection(host, int(port))
        try:
            for _ in range(2):
                unread.call(SAMPLER + method, request)
            await wait_held(running, calls=2)
            async with grpc.aio.insecure_channel(running.target) as channel:
                await assert_refused(open_stream(channel, None), "--max-concurrent-rpcs", 2)
            await asyncio.sleep(2.0)  # idle from when its answer is made: within 0.5 s of the call's start unloaded
            async with AsyncSamplerClient(running.target, timeout=30, retries=0) as client:
                assert (await served_once_idle(client)).tokens.shape == (1, 1)
            await wait_held(running, calls=1)  # the other unread call, until its client goes
            assert unread.data_bytes < 1 << 20  # the answers were never taken
        finally:
            unread.close()
        await wait_held(running, calls=0)

    run_then_stop(running, run)


@pytest.mark.parametrize("reclaim_s", ["1", "0"], ids=["reclaiming", "never_reclaiming"])
def test_streams_waiting_for_their_client_end_at_shutdown_without_the_grace_period(reclaim_s: str) -> None:
    """SIGTERM with three streams that answered their message and wait for the next, and one whose message is held in
    the backend: the waiting three end UNAVAILABLE at once, the fourth gets its answer, then ends the same way when
    it waits again; the server exits long before its 30 s grace period, with no traceback (before: every such
    stream held the shutdown for the whole grace period, then grpc cancelled it and printed a traceback)."""
    gate = ServerGate()
    server = start_server("--device", "cpu", "--grace-period-s", "30", "--reclaim-idle-calls-s", reclaim_s, gate=gate)
    sent: list[queue.Queue] = []
    try:
        stub = pb_grpc.SamplerStub(grpc.insecure_channel(server.target))

        def stream(seed: int):  # noqa: ANN202 - an open stream and its answers
            messages: queue.Queue = queue.Queue()
            sent.append(messages)
            answers = stub.SampleStream(iter(messages.get, None), timeout=60)
            messages.put(build_sample_request(logits=torch.zeros(1, 8), seed=[seed]))
            return answers

        waiting = [stream(seed) for seed in (1, 2, 3)]
        for answers in waiting:
            assert next(answers).WhichOneof("result") == "response"
        held = stream(GATE_SEED)
        gate.wait_held()
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for answers in waiting:
            with pytest.raises(grpc.RpcError) as ended:
                next(answers)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in ended.value.details()
        gate.release()
        assert next(held).WhichOneof("result") == "response"
        with pytest.raises(grpc.RpcError) as ended:
            next(held)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.process.wait(timeout=20) == 0
        assert time.monotonic() - signalled < 10
    finally:
        for messages in sent:
            messages.put(None)
        server.stop()
    assert not [line for line in server.log if "Traceback" in line or "ERROR" in line], server.log


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "asyncio"])
def test_a_stream_ended_by_a_shutdown_opens_again_on_the_next_replica(asynchronous: bool) -> None:
    """A client stream over two replicas: the first shuts down while the stream waits for its next request; that
    request is answered by the second replica, on the stream opened again."""
    first, second = start_server("--device", "cpu"), start_server("--device", "cpu")
    logits = torch.zeros(1, 8)
    try:
        targets = [first.target, second.target]
        if asynchronous:
            async def run() -> int:
                async with AsyncSamplerClient(targets, timeout=30) as client, client.stream() as stream:
                    assert (await stream.sample(logits, seed=1)).tokens.shape == (1, 1)
                    assert first.stop() == 0
                    assert (await stream.sample(logits, seed=2)).tokens.shape == (1, 1)
                    return stream.reopens

            reopens = asyncio.run(run())
        else:
            with SamplerClient(targets, timeout=30) as client, client.stream() as stream:
                assert stream.sample(logits, seed=1).tokens.shape == (1, 1)
                assert first.stop() == 0
                assert stream.sample(logits, seed=2).tokens.shape == (1, 1)
                reopens = stream.reopens
        assert reopens >= 1
    finally:
        first.stop()
        second.stop()
