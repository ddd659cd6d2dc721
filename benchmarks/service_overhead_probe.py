"""The service's own per-call cost, without a backend: a tokensampler server whose backend answers at once,
beside the empty gRPC echo, on logits in a shared-memory region (no bytes on the wire).

  python benchmarks/service_overhead_probe.py [--iters 400] [--rows 1] [--vocab 1000]

Prints p50 / p99 of the empty unary and stream echoes and of Sample over unary and over SampleStream, twice
each, interleaved (single runs on a small machine swing by tens of percent). What separates the
tokensampler rows from the echo rows is the service's own Python on both sides (docs/design/service-path.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))


def serve_with_instant_backend(server_args: list[str]) -> int:
    """Runs the server with CpuBackend.sample replaced by an answer of zeros (tokens 0, every row valid)."""
    import torch
    from tokensampler_server.backends import cpu
    from tokensampler_server.app.cli import main
    from tokensampler_server.model.sampling import SamplingResult

    def instant(self, batch):
        rows = batch.num_rows
        return SamplingResult(tokens=torch.zeros(rows, batch.num_samples, dtype=torch.int64),
                              valid=torch.ones(rows, dtype=torch.bool),
                              nan_detected=torch.zeros(rows, dtype=torch.bool))

    cpu.CpuBackend.sample = instant
    sys.argv = [sys.argv[0], *server_args]
    return main()


def measure(args: argparse.Namespace) -> None:
    import torch
    from bench_service import Echo, latency, start
    from tokensampler_client import SamplerClient

    server, port = start([sys.executable, __file__, "--serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
                          "--no-metrics", "--allow-shm"], re.compile(r"tokensampler serving on .*:(\d+)"))
    echo, echo_port = start([sys.executable, str(ROOT / "benchmarks" / "echo_server.py"), "--port", "0"],
                            re.compile(r"echo serving on (\d+)"))
    try:
        client = SamplerClient(f"127.0.0.1:{port}", timeout=60)
        echo_stub = Echo(f"127.0.0.1:{echo_port}")
        echo_stream = echo_stub.stream_session()
        shape = (args.rows, args.vocab)
        region = client.register_shm_region("probe", args.rows * args.vocab * 4)
        region.tensor(torch.float32, shape).copy_(torch.randn(shape))
        view = region.view(torch.float32, shape)
        stream = client.stream()
        params = dict(seed=list(range(args.rows)), top_k=50, top_p=0.9)
        calls = (("echo_unary", lambda: echo_stub.unary(b"")), ("echo_stream", lambda: echo_stream(b"")),
                 ("shm_unary", lambda: client.sample(view, **params)),
                 ("shm_stream", lambda: stream.sample(view, **params)))
        for _ in range(2):
            for name, call in calls:
                p50, p99 = latency(call, args.iters, warmup=20)
                print(f"{name:12s} p50 {p50:8.1f} us  p99 {p99:8.1f} us", flush=True)
        stream.close()
        client.unregister_region(region)
    finally:
        server.terminate()
        echo.terminate()
        server.wait(30)
        echo.wait(30)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve_with_instant_backend(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1000)
    measure(parser.parse_args())


if __name__ == "__main__":
    main()
