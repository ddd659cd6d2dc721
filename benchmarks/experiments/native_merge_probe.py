"""Server-side merging of the native path's requests, measured: 16 client processes (a GIL each, so that the
clients' Python does not set the rate), each calling Sample in a loop on B = 16 rows of its own CUDA region
(spiky fp32 logits, V = 151936, top-k 50 + top-p 0.9), against one server per configuration: the native path
with --max-queue-delay-us 0 (each request sampled at once), 100, 300 and 1000, and the Python path
(--no-native-path). Reports calls/s, rows/s, the server's batches/s and rows per batch (its batch-rows metric
over the timed window) and the clients' p50 call time.

  python benchmarks/experiments/native_merge_probe.py [--seconds 3] [--clients 16]

Findings: benchmarks/SERVICE_NOTES.md ("Forty-eighth session").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))

V, ROWS = 151936, 16
PARAMS = dict(top_k=50, top_p=0.9)
CONFIGS = {
    "native, no delay": [],
    "native, delay 100 us": ["--max-queue-delay-us", "100"],
    "native, delay 300 us": ["--max-queue-delay-us", "300"],
    "native, delay 1000 us": ["--max-queue-delay-us", "1000"],
    "python path, no delay": ["--no-native-path"],
}


def start_server(flags: list[str]) -> tuple[subprocess.Popen, int, int]:
    """A server with metrics on; (process, port, metrics port) once it serves."""
    command = [sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0", "--device", "cuda",
               "--metrics-port", "0", "--allow-cuda-ipc", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics_port = None
    for line in process.stdout:
        if found := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line):
            metrics_port = int(found.group(1))
        if (found := re.search(r"tokensampler serving on .*:(\d+)", line)) and metrics_port is not None:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, int(found.group(1)), metrics_port
    raise RuntimeError(f"the server exited with {process.wait()}")


def batch_metrics(metrics_port: int) -> tuple[float, float]:
    """(batches, rows) the server's batch-rows histogram has counted."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = [float(re.search(rf"^tokensampler_batch_rows_{name} (\S+)$", text, re.MULTILINE).group(1))
              for name in ("count", "sum")]
    return values[0], values[1]


def client_process(port: int, index: int, seconds: float, barrier, results) -> None:
    import numpy as np
    import torch
    from generators import spiky_logits
    from tokensampler_client import SamplerClient

    client = SamplerClient(f"127.0.0.1:{port}", timeout=600)
    x = spiky_logits(ROWS, V, "cuda")
    torch.cuda.synchronize()
    region = client.register_cuda_region(f"merge-{index}", x)
    view = region.view_of(x)
    for _ in range(20):
        client.sample(view, **PARAMS).tokens
    barrier.wait()
    times, stop = [], time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter_ns()
        client.sample(view, **PARAMS).tokens
        times.append(time.perf_counter_ns() - started)
    results.put((len(times), float(np.percentile(times, 50)) / 1e3))
    barrier.wait()  # the parent reads the metrics before any region goes
    client.unregister_region(region)
    client.close()


def run(name: str, flags: list[str], clients: int, seconds: float) -> None:
    server, port, metrics_port = start_server(flags)
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(clients + 1), context.Queue()
    processes = [context.Process(target=client_process, args=(port, i, seconds, barrier, results))
                 for i in range(clients)]
    try:
        for process in processes:
            process.start()
        barrier.wait()
        batches, rows = batch_metrics(metrics_port)
        outcomes = [results.get(timeout=600) for _ in range(clients)]
        batches, rows = (after - before for after, before in zip(batch_metrics(metrics_port), (batches, rows)))
        barrier.wait()
        for process in processes:
            process.join(timeout=60)
    finally:
        server.terminate()
        server.wait(timeout=60)
    calls = sum(count for count, _ in outcomes)
    p50 = sorted(p for _, p in outcomes)[len(outcomes) // 2]
    print(f"{name:24s} {calls / seconds:7.0f} calls/s {calls * ROWS / seconds:9.0f} rows/s  "
          f"{batches / seconds:6.0f} batches/s of {rows / max(batches, 1):6.1f} rows  "
          f"call p50 {p50:6.0f} us (median client)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    for name, flags in CONFIGS.items():
        run(name, flags, args.clients, args.seconds)


if __name__ == "__main__":
    main()
