"""Admission control's figures against a CPU server on loopback: the time to refuse past each cap, and the
server's memory per held stream.

  python benchmarks/admission_probe.py [--refusals 200] [--watchers 1000] [--streams 1000]

Prints p50 / p99 of refused calls (unary GetServerInfo past --max-concurrent-rpcs and past
--max-calls-per-client, Watch past --max-health-watchers), then the server's resident memory (VmRSS) per
held Watch stream and per held SampleStream, from the growth over that many streams.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))

import grpc  # noqa: E402
from bench_service import start  # noqa: E402
from grpc_health.v1 import health_pb2  # noqa: E402
from tokensampler_client._channel import call_metadata  # noqa: E402
from tokensampler_client._proto import sampler_pb2 as pb  # noqa: E402

WATCH = "/grpc.health.v1.Health/Watch"
INFO = "/tokensampler.v1.Sampler/GetServerInfo"
STREAM = "/tokensampler.v1.Sampler/SampleStream"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def call_times(call, count: int,
                        expected: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> tuple[float, float]:
    """p50, p99 in ms of `count` calls of `call`, each of which must end with `expected`."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        code = await call()
        times.append((time.perf_counter() - started) * 1e3)
        assert code == expected, code
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


async def status_of(call: grpc.aio.Call) -> grpc.StatusCode:
    return await call.code()


async def first_message(call: grpc.aio.Call) -> None:
    await asyncio.wait_for(call.read(), 60)


async def info_code(info: grpc.aio.UnaryUnaryMultiCallable, caller: str) -> grpc.StatusCode:
    """The status of one GetServerInfo call with `caller`'s bearer token."""
    try:
        await info(pb.GetServerInfoRequest(), metadata=call_metadata("p", caller), timeout=30)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def probe(target: str, pid: int, tokens: list[str], args: argparse.Namespace) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        info = channel.unary_unary(INFO, request_serializer=pb.GetServerInfoRequest.SerializeToString,
                                   response_deserializer=pb.ServerInfo.FromString)
        watch = channel.unary_stream(WATCH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
        stream = channel.stream_stream(STREAM, request_serializer=pb.SampleRequest.SerializeToString,
                                       response_deserializer=pb.SampleStreamResponse.FromString)


        before = rss_kib(pid)
        watches = [watch(health_pb2.HealthCheckRequest(service=""), timeout=600) for _ in range(args.watchers)]
        await asyncio.gather(*(first_message(w) for w in watches))
        after_watches = rss_kib(pid)
        # The global cap full, no client at its own: args.streams spread over all tokens but the last.
        holders = tokens[:-1]  # the last token holds nothing: its calls meet the full global cap, not their own
        streams = [stream(metadata=call_metadata("p", holders[i % len(holders)]), timeout=600)
                   for i in range(args.streams)]
        for held in streams:  # one answer each: every stream is admitted and its handler running
            await held.write(pb.SampleRequest())
        await asyncio.gather(*(first_message(s) for s in streams))
        after_streams = rss_kib(pid)
        print(f"VmRSS {before} KiB; {args.watchers} Watch streams held: +{after_watches - before} KiB "
              f"({(after_watches - before) / args.watchers:.1f} KiB each); {args.streams} SampleStreams held: "
              f"+{after_streams - after_watches} KiB ({(after_streams - after_watches) / args.streams:.1f} KiB each)")

        p50, p99 = await call_times(lambda: info_code(info, tokens[-1]), args.refusals)
        print(f"{args.refusals} refusals past --max-concurrent-rpcs (unary): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        p50, p99 = await call_times(
            lambda: status_of(watch(health_pb2.HealthCheckRequest(service=""), timeout=30)), args.refusals)
        print(f"{args.refusals} refusals past --max-health-watchers (Watch): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        for call in (*watches, *streams):
            call.cancel()


async def probe_per_client(target: str, token: str, other: str, args: argparse.Namespace) -> None:
    """A server whose per-client cap is 1: one held stream, then unary calls of the same token and of another."""
    async with grpc.aio.insecure_channel(target) as channel:
        stream = channel.stream_stream(STREAM, request_serializer=pb.SampleRequest.SerializeToString,
                                       response_deserializer=pb.SampleStreamResponse.FromString)
        info = channel.unary_unary(INFO, request_serializer=pb.GetServerInfoRequest.SerializeToString,
                                   response_deserializer=pb.ServerInfo.FromString)
        held = stream(metadata=call_metadata("p", token), timeout=600)
        await held.write(pb.SampleRequest())
        await first_message(held)


        p50, p99 = await call_times(lambda: info_code(info, token), args.refusals)
        print(f"{args.refusals} refusals past --max-calls-per-client (unary): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        p50, p99 = await call_times(lambda: info_code(info, other), args.refusals, grpc.StatusCode.OK)
        print(f"{args.refusals} admitted calls of another client, for scale: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        held.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refusals", type=int, default=200)
    parser.add_argument("--watchers", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=1000)
    args = parser.parse_args()
    tokens = [secrets.token_urlsafe(32) for _ in range(8)]
    with tempfile.TemporaryDirectory() as folder:
        token_file = Path(folder) / "tokens"
        token_file.write_text("\n".join(tokens) + "\n")
        common = [sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
                  "--no-metrics", "--auth-token-file", str(token_file)]
        ready = re.compile(r"tokensampler serving on .*:(\d+)")
        server, port = start([*common, "--max-concurrent-rpcs", str(args.streams),
                              "--max-health-watchers", str(args.watchers),
                              "--max-calls-per-client", str(args.streams)], ready)
        try:
            asyncio.run(probe(f"127.0.0.1:{port}", server.pid, tokens, args))
        finally:
            server.terminate()
            server.wait(60)
        server, port = start([*common, "--max-calls-per-client", "1"], ready)
        try:
            asyncio.run(probe_per_client(f"127.0.0.1:{port}", tokens[0], tokens[1], args))
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
