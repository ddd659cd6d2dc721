"""Service benchmark: the SERVICE workload of docs/performance.md.

  python benchmarks/bench_service.py --device cuda [--out benchmarks/results] [--iters 200]

Starts a tokensampler server (the given backend, shared memory and CUDA IPC allowed, a Unix socket)
and an empty gRPC echo server (benchmarks/echo_server.py) as subprocesses, then measures from this
process, all in one run:
  * latency p50/p99 per call at B = 1, 8, 64 (spiky fp32 logits [B, 151936], top-k 50, top-p 0.9)
    for echo_unary and echo_stream (empty messages: the floor), echo_unary_payload (the request's
    bytes echoed), inprocess (the backend called directly), tokensampler_tcp, tokensampler_uds,
    tokensampler_stream, tokensampler_ipc_unary and tokensampler_ipc_stream (logits in a region:
    CUDA IPC on a GPU, shared memory on the CPU), tokensampler_hidden_ipc (hidden states in a region
    through a registered LM head). Every tokensampler call's time includes reading the result's tokens
    (results decode fields as they are read, and a caller reads at least the tokens);
  * throughput with 1, 4 and 16 concurrent clients calling with B = 16: rows/s and calls/s for
    echo_unary, tokensampler_tcp and tokensampler_batching (client batching on, logits as bytes), and
    tokensampler_batching_ipc (client batching on, each client's rows a slice of one shared region: the
    slices that arrive together go out as one zero-copy call).
Writes service-<device>-<date>.json with those rows, the service's target ratios (docs/performance.md), and
a PNG plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for package in ("server", "client"):
    sys.path.insert(0, str(ROOT / package))

sys.path.insert(0, str(ROOT / "benchmarks"))
from generators import spiky_logits  # noqa: E402
from provenance import tree_commit  # noqa: E402
from wall import wall_us  # noqa: E402
import grpc  # noqa: E402
from tokensampler_client import BatchingClient, SamplerClient  # noqa: E402
from tokensampler_client.params import build_sample_request  # noqa: E402
from tokensampler_client.regions import CudaRegion, RegionView, SharedMemoryRegion  # noqa: E402
from tokensampler_server.backends import create_backend  # noqa: E402
from tokensampler_server.core.config import Limits  # noqa: E402
from tokensampler_server.validation.sample import validate_sample_request  # noqa: E402

V = 151936
LATENCY_BATCHES = (1, 8, 64)
THROUGHPUT_CLIENTS = (1, 4, 16)
THROUGHPUT_ROWS = 16
PARAMS = dict(top_k=50, top_p=0.9)



def start(command: list[str], ready: re.Pattern, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """Starts a server subprocess (in `env`, default this process's) and waits for the log line that names its
    port."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in process.stdout:
        match = ready.search(line)
        if match:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, int(match.group(1))
    raise RuntimeError(f"{command[2]} exited with {process.wait()}")


def latency(call: Callable[[], object], iters: int, warmup: int = 5) -> tuple[float, float]:
    """(p50, p99) wall time of call() in microseconds."""
    times = wall_us(call, iters, warmup)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def throughput(call: Callable[[int], object], clients: int, seconds: float) -> float:
    """Calls per second reached by `clients` threads calling `call(thread index)` in a loop for `seconds`."""
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def loop(index: int) -> None:
        while time.monotonic() < stop:
            call(index)
            counts[index] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


def share_tensor(
    client: SamplerClient, name: str, tensor: torch.Tensor
) -> tuple[CudaRegion | SharedMemoryRegion, RegionView]:
    """Registers `tensor` as region `name` (CUDA IPC for a GPU tensor, else a shared-memory copy) and returns
    the region with the view of the tensor in it, ready to be read by the server."""
    if tensor.is_cuda:
        region = client.register_cuda_region(name, tensor)
        torch.cuda.synchronize()
        return region, region.view_of(tensor)
    region = client.register_shm_region(name, tensor.numel() * tensor.element_size())
    region.tensor(tensor.dtype, tuple(tensor.shape)).copy_(tensor)
    return region, region.view(tensor.dtype, tuple(tensor.shape))


class Echo:
    """Sync stubs of the echo server."""

    def __init__(self, target: str) -> None:
        options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
        self.channel = grpc.insecure_channel(target, options=options)
        self.unary = self.channel.unary_unary("/bench.Echo/Unary")
        self._stream = self.channel.stream_stream("/bench.Echo/Stream")

    def stream_session(self) -> Callable[[bytes], bytes]:
        import queue

        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses = self._stream(iter(requests.get, None))

        def call(payload: bytes) -> bytes:
            requests.put(payload)
            return next(responses)

        return call


def run(args: argparse.Namespace) -> dict:
    device = args.device
    on_gpu = device == "cuda"
    hidden_size = 4096 if on_gpu else 256  # a CPU fp32 matmul with D = 4096 would dominate everything
    tmp = Path(tempfile.mkdtemp(prefix="tokensampler-bench-"))
    python = sys.executable
    env_path = os.pathsep.join([str(ROOT / "server"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_path
    server, port = start(
        [python, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0", "--device", device,
         "--no-metrics", "--allow-shm", "--allow-cuda-ipc", "--uds", str(tmp / "ts.sock")],
        re.compile(r"tokensampler serving on .*:(\d+)"),
    )
    echo, echo_port = start([python, str(ROOT / "benchmarks" / "echo_server.py"), "--port", "0"],
                            re.compile(r"echo serving on (\d+)"))
    rows: list[dict] = []
    try:
        client = SamplerClient(f"127.0.0.1:{port}", timeout=600)
        uds_client = SamplerClient(f"unix://{tmp / 'ts.sock'}", timeout=600)
        echo_stub = Echo(f"127.0.0.1:{echo_port}")
        echo_stream = echo_stub.stream_session()
        backend = create_backend(device)
        weight = torch.randn(V, hidden_size, dtype=torch.bfloat16, device=device) / hidden_size**0.5
        client.register_weights("bench-head", weight.cpu(), chunk_bytes=64 << 20)
        stream = client.stream()

        def record(method: str, batch: int, p50: float, p99: float, **extra: object) -> None:
            rows.append({"workload": "service", "method": method, "B": batch, "p50_us": p50, "p99_us": p99, **extra})
            print(f"{method:28s} B={batch:<4d} p50 {p50:10.1f} us  p99 {p99:10.1f} us", flush=True)

        record("echo_unary", 0, *latency(lambda: echo_stub.unary(b""), args.iters))
        record("echo_stream", 0, *latency(lambda: echo_stream(b""), args.iters))
        for batch in LATENCY_BATCHES:
            iters = args.iters if on_gpu or batch < 64 else max(5, args.iters // 20)
            logits = spiky_logits(batch, V, device)
            host_logits = logits.cpu()
            seeds = list(range(batch))
            request = build_sample_request(host_logits, seed=seeds, **PARAMS)
            payload = request.SerializeToString()
            record("echo_unary_payload", batch, *latency(lambda: echo_stub.unary(payload), iters), payload_bytes=len(payload))

            # The backend alone, on a batch validated beforehand (logits already on its device).
            prepared = replace(validate_sample_request(request, Limits())[0], logits=logits)
            record("inprocess", batch, *latency(lambda: backend.sample(prepared), iters))
            record("tokensampler_tcp", batch, *latency(lambda: client.sample(host_logits, seed=seeds, **PARAMS).tokens, iters))
            record("tokensampler_uds", batch, *latency(lambda: uds_client.sample(host_logits, seed=seeds, **PARAMS).tokens, iters))
            record("tokensampler_stream", batch, *latency(lambda: stream.sample(host_logits, seed=seeds, **PARAMS).tokens, iters))

            region, view = share_tensor(client, f"logits-{batch}", logits)
            record("tokensampler_ipc_unary", batch, *latency(lambda: client.sample(view, seed=seeds, **PARAMS).tokens, iters))
            record("tokensampler_ipc_stream", batch, *latency(lambda: stream.sample(view, seed=seeds, **PARAMS).tokens, iters))
            client.unregister_region(region)

            hidden = torch.randn(batch, hidden_size, dtype=torch.bfloat16, device=device)
            hidden_region, hidden_view = share_tensor(client, f"hidden-{batch}", hidden)
            record("tokensampler_hidden_ipc", batch,
                   *latency(lambda: client.sample_hidden(hidden_view, "bench-head", seed=seeds, **PARAMS).tokens, iters),
                   hidden_size=hidden_size)
            client.unregister_region(hidden_region)

        small = spiky_logits(THROUGHPUT_ROWS, V, device).cpu()
        batcher = BatchingClient(client, max_rows=256, max_delay_us=200, max_in_flight=2)
        # One region holding every client's rows, as an engine's logits buffer would.
        shared = spiky_logits(THROUGHPUT_ROWS * max(THROUGHPUT_CLIENTS), V, device)
        shared_region, _ = share_tensor(client, "throughput", shared)
        slices = [shared_region.view(torch.float32, (THROUGHPUT_ROWS, V), offset=i * THROUGHPUT_ROWS * V * 4)
                  for i in range(max(THROUGHPUT_CLIENTS))]
        for clients in THROUGHPUT_CLIENTS:
            for method, call, rows_per_call in (
                ("echo_unary", lambda i: echo_stub.unary(b""), 0),
                ("tokensampler_tcp", lambda i: client.sample(small, **PARAMS).tokens, THROUGHPUT_ROWS),
                ("tokensampler_batching", lambda i: batcher.sample(small, **PARAMS).tokens, THROUGHPUT_ROWS),
                ("tokensampler_batching_ipc", lambda i: batcher.sample(slices[i], **PARAMS).tokens, THROUGHPUT_ROWS),
            ):
                calls = throughput(call, clients, args.seconds)
                rows.append({"workload": "service", "method": method, "B": rows_per_call, "clients": clients,
                             "calls_per_s": calls, "rows_per_s": calls * rows_per_call})
                print(f"{method:28s} clients={clients:<3d} {calls:10.1f} calls/s {calls * rows_per_call:12.1f} rows/s", flush=True)
        batcher.close()
        client.unregister_region(shared_region)
        stream.close()
    finally:
        server.terminate()
        echo.terminate()
        server.wait(30)
        echo.wait(30)
    return {"rows": rows, "targets": targets(rows)}


def targets(rows: list[dict]) -> dict:
    """The service's target ratios (docs/performance.md), computed from this run's rows."""
    def p50(method: str, batch: int) -> float:
        return next(r["p50_us"] for r in rows if r["method"] == method and r["B"] == batch and "p50_us" in r)

    echo = p50("echo_unary", 0)
    out: dict[str, float] = {}
    for batch in (1, 64):
        inproc = p50("inprocess", batch)
        out[f"stream_ipc_overhead_over_echo_B{batch} (<= 0.6)"] = (p50("tokensampler_ipc_stream", batch) - inproc) / echo
        out[f"unary_ipc_overhead_over_echo_B{batch} (<= 1.2)"] = (p50("tokensampler_ipc_unary", batch) - inproc) / echo
        out[f"unary_bytes_overhead_over_payload_echo_B{batch} (<= 1.2)"] = (
            (p50("tokensampler_tcp", batch) - inproc) / p50("echo_unary_payload", batch)
        )
    echo16 = next(r["calls_per_s"] for r in rows if r["method"] == "echo_unary" and r.get("clients") == 16)
    for method in ("tokensampler_batching", "tokensampler_batching_ipc"):
        batching16 = next(r["rows_per_s"] for r in rows if r["method"] == method and r.get("clients") == 16)
        name = "batching" if method == "tokensampler_batching" else "batching_ipc"
        out[f"{name}_rows_per_s_over_16x_echo_calls_16_clients (>= 1)"] = batching16 / (16 * echo16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each throughput run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    result = run(args)
    gpu = torch.cuda.get_device_name().replace(" ", "_") if args.device == "cuda" else f"cpu{os.cpu_count()}"
    date = datetime.date.today().isoformat()
    result["meta"] = {"gpu": gpu, "device": args.device, "torch": torch.__version__, "grpc": grpc.__version__,
                      "commit": tree_commit(), "date": date, "cpus": os.cpu_count(), "iters": args.iters}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"service-{gpu}-{date}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {path}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "p50_us" in r and r["B"] in LATENCY_BATCHES]
    methods = sorted({r["method"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(LATENCY_BATCHES)
    for i, batch in enumerate(LATENCY_BATCHES):
        values = [next((r["p50_us"] for r in rows if r["method"] == m and r["B"] == batch), 0) for m in methods]
        ax.bar(np.arange(len(methods)) + i * width, values, width, label=f"B={batch}")
    for floor in ("echo_unary", "echo_stream"):
        value = next(r["p50_us"] for r in result["rows"] if r["method"] == floor)
        ax.axhline(value, linestyle="--", linewidth=1, color="gray")
        ax.text(len(methods) - 0.5, value, floor, fontsize=7, va="bottom", ha="right")
    ax.set_xticks(np.arange(len(methods)) + width)
    ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p50 latency per call (µs)")
    ax.set_title(f"tokensampler service, {result['meta']['gpu']}, {result['meta']['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
