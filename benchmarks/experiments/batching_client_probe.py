"""The client side alone of the throughput target: 16 threads calling BatchingClient.sample with B = 16 slices of
one region, against a stand-in for SamplerClient that answers at once (no RPC, no server). Its calls/s bound
what bench_service's batching + IPC throughput can reach on this machine, whatever the server does.

  python benchmarks/experiments/batching_client_probe.py [--seconds 3]

Findings: benchmarks/SERVICE_NOTES.md ("Twenty-fifth session").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))

import torch  # noqa: E402
from bench_service import throughput  # noqa: E402
from tokensampler_client import BatchingClient  # noqa: E402
from tokensampler_client._proto import sampler_pb2 as pb  # noqa: E402
from tokensampler_client.regions import RegionView  # noqa: E402
from tokensampler_client.result import SampleResult  # noqa: E402

V, ROWS, CLIENTS = 151936, 16, 16
PARAMS = dict(top_k=50, top_p=0.9)


class InstantClient:
    """Answers every request at once with token 0 per row, as a server listing "region_rows" would shape it."""

    def __init__(self) -> None:
        self.calls = 0

    def server_info(self) -> pb.ServerInfo:
        return pb.ServerInfo(features=["regions", "region_rows"])

    def sample_request(self, request: pb.SampleRequest) -> SampleResult:
        self.calls += 1
        kind = request.WhichOneof("input")
        rows = len(request.logits_rows.row_offsets) if kind == "logits_rows" else request.logits_ref.shape[0]
        return SampleResult.from_response(pb.SampleResponse(
            tokens=pb.Tensor(dtype=pb.DTYPE_INT32, shape=[rows, 1], data=bytes(4 * rows)),
            seeds=[0] * rows, valid=[True] * rows, nan_detected=[False] * rows))


def run(in_flight: int, delay_us: int, seconds: float) -> None:
    client = InstantClient()
    views = [RegionView("buffer", i * ROWS * V * 4, torch.float32, (ROWS, V)) for i in range(CLIENTS)]
    batcher = BatchingClient(client, max_rows=ROWS * CLIENTS, max_delay_us=delay_us, max_in_flight=in_flight)
    calls = throughput(lambda i: batcher.sample(views[i], **PARAMS), CLIENTS, seconds)
    batcher.close()
    print(f"in_flight={in_flight} delay={delay_us}us: {calls:7.0f} calls/s, "
          f"{client.calls / seconds:5.0f} RPCs/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    for in_flight in (1, 4):
        for delay_us in (0, 200):
            run(in_flight, delay_us, args.seconds)


if __name__ == "__main__":
    main()
