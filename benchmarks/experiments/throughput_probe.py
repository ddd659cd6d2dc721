"""What bounds the service's throughput target: 16 threads calling with B = 16 logits in a CUDA region,
through BatchingClient at several max_in_flight / max_delay_us and without client batching, beside the empty
unary echo reached by 16 threads (the target: rows/s >= 16 x echo calls/s). For the batching runs it also
reports the RPCs the batcher sent: how many per second, their mean rows and their mean latency.

  python benchmarks/experiments/throughput_probe.py [server flags, e.g. --no-native-path]

Findings: benchmarks/SERVICE_NOTES.md ("Twenty-fourth session").
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))

import torch  # noqa: E402
from bench_service import Echo, share_tensor, start, throughput  # noqa: E402
from generators import spiky_logits  # noqa: E402
from tokensampler_client import BatchingClient, SamplerClient  # noqa: E402

V, ROWS, CLIENTS, SECONDS = 151936, 16, 16, 3.0
PARAMS = dict(top_k=50, top_p=0.9)


class RecordingClient:
    """The SamplerClient a BatchingClient wraps, counting the RPCs it sends: rows and latency of each."""

    def __init__(self, client: SamplerClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.calls = self.rows = self.latency_ns = self.server_ns = 0

    def server_info(self):
        return self._client.server_info()

    def sample_request(self, request):
        started = time.perf_counter_ns()
        result = self._client.sample_request(request)
        with self._lock:
            self.calls += 1
            self.rows += result.tokens.shape[0]
            self.latency_ns += time.perf_counter_ns() - started
            self.server_ns += result.timings.total_ns
        return result

    def summary(self, seconds: float) -> str:
        calls = max(self.calls, 1)
        return (f"{self.calls / seconds:6.0f} RPCs/s of {self.rows / calls:5.1f} rows, "
                f"{self.latency_ns / calls / 1e3:6.0f} us each ({self.server_ns / calls / 1e3:4.0f} in the server's timings)")


def main() -> None:
    server, port = start([sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0",
                          "--device", "cuda", "--no-metrics", "--allow-cuda-ipc", *sys.argv[1:]],
                         re.compile(r"tokensampler serving on .*:(\d+)"))
    echo, echo_port = start([sys.executable, str(ROOT / "benchmarks" / "echo_server.py"), "--port", "0"],
                            re.compile(r"echo serving on (\d+)"))
    try:
        client = SamplerClient(f"127.0.0.1:{port}", timeout=600)
        echo_stub = Echo(f"127.0.0.1:{echo_port}")
        region, _ = share_tensor(client, "throughput", spiky_logits(ROWS * CLIENTS, V, "cuda"))
        slices = [region.view(torch.float32, (ROWS, V), offset=i * ROWS * V * 4) for i in range(CLIENTS)]
        for round_ in range(2):
            echo_rate = throughput(lambda i: echo_stub.unary(b""), CLIENTS, SECONDS)
            target = CLIENTS * echo_rate
            print(f"round {round_}: echo {echo_rate:.0f} calls/s with {CLIENTS} threads, target {target:.0f} rows/s")

            def report(name: str, calls: float) -> None:
                print(f"  {name:32s} {calls:8.0f} calls/s {calls * ROWS:9.0f} rows/s  ratio {calls * ROWS / target:.3f}",
                      flush=True)

            for in_flight in (1, 2, 4):
                for delay_us in (0, 200, 500):
                    recording = RecordingClient(client)
                    batcher = BatchingClient(recording, max_rows=256, max_delay_us=delay_us, max_in_flight=in_flight)
                    report(f"batching in_flight={in_flight} delay={delay_us}us",
                           throughput(lambda i: batcher.sample(slices[i], **PARAMS), CLIENTS, SECONDS))
                    batcher.close()
                    print(f"    {recording.summary(SECONDS)}", flush=True)
            report("no client batching", throughput(lambda i: client.sample(slices[i], **PARAMS), CLIENTS, SECONDS))
    finally:
        server.terminate()
        echo.terminate()


if __name__ == "__main__":
    main()
