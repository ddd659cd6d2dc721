"""Where a SampleStream message's time goes: server variants that each keep less of the service's own work,
beside the empty gRPC echo, on logits in a region (CUDA IPC on a GPU, shared memory on the CPU).

  python benchmarks/experiments/service_stage_probe.py --device cuda [--variants base,floor,floorbackend,floorsync]
      [--rounds 4] [--iters 300] [--batches 1 64] [--stages] [--idle]

Variants (each its own server process, monkeypatched in that process only):
  base          the server as it is (on CUDA, plain region requests take the native path);
  python        the server with --no-native-path: every message on the Python path;
  novalid       validation done once and its batch reused (what validation costs);
  floorbackend  SampleStream answers every message with the first one's answer after backend.sample of its
                batch: the backend's host path without parsing, validation or encoding;
  floorsync     the same, one tiny kernel and a device synchronisation instead of the backend (CUDA only):
                about what a native data plane would leave;
  floor         the first answer at once, nothing else.
  passthrough   base plus a grpc interceptor that returns the handler unchanged (grpc's interceptor cost);
  inline        base's native answers from a stream loop without the reader task and queue (every message
                must be one the native path answers): what the stream plumbing costs.
  bare          unary Sample without the call guard (no contextvars, trailing metadata or metrics): each request
                answered by SamplePath.unary (natively on CUDA, in Python on the CPU).
  unaryfloor    unary Sample without the guard answering the first answer again at once: our server's unary
                floor for these messages.
  unaryfloorsync  the same after one tiny kernel and a device synchronisation.
  guardfloor    unary Sample answering the first answer again at once, under the call guard (any backend): with
                unaryfloor, what the guard alone costs a unary call.
Each variant is timed with prebuilt request bytes (`raw`: no client-side protobuf work) and through the client
library (`client`), base and python also as unary calls (base also raw with the client's deadline and request id
metadata: `unary raw md`), the unary variants as raw unary calls only, in rounds interleaved with the echo (single
runs on these machines swing by tens of percent).
--stages also prints the Python path's per-stage spans (variant python, else base) inside the server (parse, start with the backend, finish, yield);
--idle times the backend call and the client's build + decode in this process, hot in a loop and after an
idle wait, as a server and a waiting client run them. Findings: benchmarks/SERVICE_NOTES.md.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))

V = 151936
PARAMS = dict(top_k=50, top_p=0.9)
STAGES = (("parse", "p0", "p1"), ("to start", "p1", "s0"), ("start (validation, backend)", "s0", "s1"),
          ("to finish", "s1", "f0"), ("finish (encode)", "f0", "f1"), ("to serialise", "f1", "w0"))


def _repeat_first_answer(variant: str) -> None:
    """SampleStream answers each message with the first message's answer, after the variant's work."""
    import torch
    from tokensampler_client._proto import sampler_pb2 as pb
    from tokensampler_server import service
    from tokensampler_server.call_record import CallRecord
    from tokensampler_server.sample_rpc import as_request

    tiny = torch.zeros(1, device="cuda") if variant == "floorsync" else None  # CUDA servers only

    async def sample_stream(self, requests, context):
        first = None
        async for request in requests:
            if first is None:  # the real path once: the batch and the answer to repeat
                started = self._sample_path.start(as_request(request), CallRecord(method="probe", request_id="probe"))
                with started.held:
                    result, times = await started.future
                    answer = pb.SampleStreamResponse(response=self._sample_path.finish(started, result, times))
                first = (started.call.batch, answer)
            if variant == "floorbackend":
                self._backend.sample(first[0])
            elif tiny is not None:
                tiny.add_(1)
                torch.cuda.synchronize()
            yield first[1]

    service.SamplerService.SampleStream = sample_stream


def _answer_inline() -> None:
    """SampleStream as one loop over the native path's answers, no reader task, no queue."""
    from tokensampler_server import service
    from tokensampler_server.call_record import CallRecord
    from tokensampler_server.sample_rpc import STREAM_METHOD

    async def sample_stream(self, requests, context):
        index = 0
        async for message in requests:
            record = CallRecord(method=STREAM_METHOD, request_id=f"inline.{index}")
            index += 1
            answer = await self._native.sample(message, record.request_id, stream_message=True)
            if answer is None:
                raise RuntimeError("the inline variant needs requests the native path answers")
            yield answer.response

    service.SamplerService.SampleStream = sample_stream


def _cache_validation() -> None:
    from tokensampler_server import sample_rpc

    validate, cached = sample_rpc.validate_sample_request, []

    def once(request, limits, **kwargs):
        if not cached:
            cached.append(validate(request, limits, **kwargs))
        return cached[0]

    sample_rpc.validate_sample_request = once


def _trace_stages(path: str) -> None:
    """Appends the median span of each stage of every 300 stream messages to `path`."""
    import grpc
    from tokensampler_server import call_guard, sample_rpc

    now, marks, spans = time.perf_counter_ns, {}, []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            marks[name + "0"] = now()
            out = fn(*args, **kwargs)
            marks[name + "1"] = now()
            return out
        return wrapper

    call_guard._parse = timed("p", call_guard._parse)
    sample_rpc.SamplePath.start = timed("s", sample_rpc.SamplePath.start)
    sample_rpc.SamplePath.finish = staticmethod(timed("f", sample_rpc.SamplePath.finish))
    stream_handler = grpc.stream_stream_rpc_method_handler

    def handler(behaviour, request_deserializer=None, response_serializer=None):
        if response_serializer is None:
            return stream_handler(behaviour, request_deserializer, response_serializer)

        def serialise(message):
            marks["w0"] = now()
            if "p0" in marks and "f1" in marks:
                spans.append({name: (marks[b] - marks[a]) / 1e3 for name, a, b in STAGES})
            marks.clear()
            if len(spans) == 300:
                with open(path, "a") as out:
                    out.write(" | ".join(f"{name} {statistics.median(s[name] for s in spans):.1f}"
                                         for name, _, _ in STAGES) + "\n")
                spans.clear()
            return response_serializer(message)

        return stream_handler(behaviour, request_deserializer, serialise)

    grpc.stream_stream_rpc_method_handler = handler


UNARY_VARIANTS = ("bare", "unaryfloor", "unaryfloorsync", "guardfloor")


def _unary_variant(variant: str) -> None:
    """Sample answered per the variant: without the call guard (bare, unaryfloor, unaryfloorsync), or with it
    (guardfloor); every answer after the first one repeated (the floors) or answered anew (bare)."""
    from tokensampler_server import call_guard, service
    from tokensampler_server.call_record import CallRecord, current_call

    if variant != "guardfloor":
        guard = call_guard.CallGuard.guard
        call_guard.CallGuard.guard = lambda self, handler, method: (
            handler if method.endswith("/Sample") else guard(self, handler, method))
    tiny = None
    if variant == "unaryfloorsync":
        import torch

        tiny = torch.zeros(1, device="cuda")
    first: list[object] = []  # the first answer: bytes (native) or a SampleResponse (Python path)

    async def sample(self, request, context):
        if variant == "bare" or not first:
            record = current_call.get(None) or CallRecord(method="probe", request_id="probe")
            first.append(await self._sample_path.unary(request, record))
            return first[-1]
        if tiny is not None:
            tiny.add_(1)
            torch.cuda.synchronize()
        return first[0]

    service.SamplerService.Sample = sample


def _with_passthrough_interceptor() -> None:
    """The server with one grpc interceptor that hands grpc the handler unchanged: what grpc's interceptor
    machinery alone costs a call (the call guard used to be such an interceptor)."""
    import grpc

    class Passthrough(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            return await continuation(details)

    original_server = grpc.aio.server
    grpc.aio.server = lambda interceptors=None, **kwargs: original_server(
        interceptors=[*(interceptors or ()), Passthrough()], **kwargs)


def serve(variant: str, server_args: list[str]) -> int:
    from tokensampler_server.cli import main

    if variant.startswith("floor"):
        _repeat_first_answer(variant)
    if variant == "novalid":
        _cache_validation()
    if variant == "inline":
        _answer_inline()
    if variant == "passthrough":
        _with_passthrough_interceptor()
    if variant in UNARY_VARIANTS:
        _unary_variant(variant)
    if os.environ.get("PROBE_STAGES"):
        _trace_stages(os.environ["PROBE_STAGES"])
    sys.argv = [sys.argv[0], *server_args, *(["--no-native-path"] if variant == "python" else [])]
    return main()


def idle_costs(device: str) -> None:
    """The backend call and the client's build + decode, hot and after an idle wait (p50 µs)."""
    import torch
    from generators import spiky_logits
    from tokensampler_client._proto import sampler_pb2 as pb
    from tokensampler_client.params import build_sample_request
    from tokensampler_client.regions import RegionView
    from tokensampler_client.stream import result_or_error
    from tokensampler_server.backends import create_backend
    from tokensampler_server.config import Limits
    from tokensampler_server.sample_rpc import encode_result
    from tokensampler_server.validation import validate_sample_request

    backend = create_backend(device)
    logits = spiky_logits(1, V, device)
    view = RegionView("probe", 0, torch.float32, (1, V))
    request = build_sample_request(view, seed=[0], **PARAMS)
    batch, seeds = validate_sample_request(request, Limits(), referenced=logits)
    answer = pb.SampleStreamResponse(response=encode_result(backend.sample(batch), seeds)).SerializeToString()

    def client_side() -> None:
        build_sample_request(view, seed=[0], **PARAMS).SerializeToString()
        result_or_error(pb.SampleStreamResponse.FromString(answer))

    def p50(work, idle_s: float, count: int = 300) -> float:
        times = []
        for _ in range(count):
            if idle_s:
                time.sleep(idle_s)
            started = time.perf_counter_ns()
            work()
            times.append((time.perf_counter_ns() - started) / 1e3)
        return statistics.median(times)

    for name, work in (("backend.sample", lambda: backend.sample(batch)), ("client build + decode", client_side)):
        for _ in range(2):
            print(f"{name:22s} hot {p50(work, 0):7.1f}  after 0.5 ms idle {p50(work, 5e-4):7.1f}  "
                  f"after 2 ms idle {p50(work, 2e-3, 150):7.1f}", flush=True)


def measure(args: argparse.Namespace) -> None:
    import grpc
    from bench_service import Echo, latency, share_tensor, start
    from generators import spiky_logits
    from tokensampler_client import SamplerClient
    from tokensampler_client._channel import call_metadata, new_request_id
    from tokensampler_client.params import build_sample_request

    stages = Path(tempfile.mkdtemp(prefix="probe-")) / "stages.txt"
    servers, ports = [], {}
    variants = args.variants.split(",")
    traced = "python" if "python" in variants else "base"
    for variant in variants:
        os.environ.pop("PROBE_STAGES", None)
        if args.stages and variant == traced:
            os.environ["PROBE_STAGES"] = str(stages)
        process, ports[variant] = start(
            [sys.executable, __file__, "--serve", variant, "--host", "127.0.0.1", "--port", "0", "--device",
             args.device, "--no-metrics", "--allow-shm", "--allow-cuda-ipc"],
            re.compile(r"tokensampler serving on .*:(\d+)"))
        servers.append(process)
    echo, echo_port = start([sys.executable, str(ROOT / "benchmarks" / "echo_server.py"), "--port", "0"],
                            re.compile(r"echo serving on (\d+)"))
    servers.append(echo)
    try:
        echo_stub = Echo(f"127.0.0.1:{echo_port}")
        echo_stream = echo_stub.stream_session()
        calls = {"echo_stream": lambda: echo_stream(b""), "echo_unary": lambda: echo_stub.unary(b"")}
        held = []
        for batch in args.batches:
            logits = spiky_logits(batch, V, args.device)
            params = dict(seed=list(range(batch)), **PARAMS)
            for variant, port in ports.items():
                client = SamplerClient(f"127.0.0.1:{port}", timeout=60)
                region, view = share_tensor(client, f"logits-{batch}", logits)
                raw = build_sample_request(view, **params).SerializeToString()
                requests: queue.SimpleQueue = queue.SimpleQueue()
                channel = grpc.insecure_channel(f"127.0.0.1:{port}")
                answers = channel.stream_stream("/tokensampler.v1.Sampler/SampleStream")(iter(requests.get, None))
                stream = client.stream()
                held.append((client, region, channel, stream))

                def raw_call(requests=requests, answers=answers, raw=raw):
                    requests.put(raw)
                    return next(answers)

                unary = channel.unary_unary("/tokensampler.v1.Sampler/Sample", _registered_method=True)
                if variant in UNARY_VARIANTS:
                    calls[f"{variant} unary raw B={batch}"] = lambda u=unary, raw=raw: u(raw)
                    continue
                calls[f"{variant} raw B={batch}"] = raw_call
                if variant != "floor":  # its repeated answer is not this batch's
                    calls[f"{variant} client B={batch}"] = lambda s=stream, v=view, p=params: s.sample(v, **p)
                if variant in ("base", "python", "passthrough"):  # their unary Sample is the server's own
                    calls[f"{variant} unary raw B={batch}"] = lambda u=unary, raw=raw: u(raw)
                    if variant == "base":
                        calls[f"base unary raw md B={batch}"] = lambda u=unary, raw=raw: u(
                            raw, timeout=60, metadata=call_metadata(new_request_id()))
                    calls[f"{variant} unary client B={batch}"] = lambda c=client, v=view, p=params: c.sample(v, **p)
        runs: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                runs[name].append(latency(call, args.iters, warmup=20)[0])
        for name, p50s in runs.items():
            print(f"{name:26s} p50 {statistics.median(p50s):8.1f} us  (rounds: {' '.join(f'{x:.0f}' for x in p50s)})",
                  flush=True)
        if args.stages and stages.exists():
            print(f"{traced}, per-stage medians inside the server (µs, 300 messages a line):")
            print(stages.read_text(), end="")
    finally:
        for process in servers:
            process.terminate()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--variants", default="base,python,floorsync")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--idle", action="store_true")
    args = parser.parse_args()
    if args.idle:
        idle_costs(args.device)
    measure(args)


if __name__ == "__main__":
    main()
