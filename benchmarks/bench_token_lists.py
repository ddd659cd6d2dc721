"""What one request with large token lists costs the other clients of a CPU server.

  python benchmarks/bench_token_lists.py [--ids 20000000] [--rows 8] [--vocab 128000] [--shared]

Starts a CPU server (a subprocess), then from this process: a second client sends tiny Samples
(logits [1, 8]) back to back on its own channel and a third ListWeights (the event loop alone), while the first client sends one Sample whose
`params.output_token_ids` hold `--ids` ids (one list per row, or with --shared one list given once for
every row). Prints the request's size, status and time, the tiny Samples' and ListWeights' latency p50/p99/max
before and while it was processed, and the server's peak resident memory (VmHWM) over its memory before the request,
relative to the request's size.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT / "server", ROOT / "client", ROOT):
    sys.path.insert(0, str(entry))

from tests.conftest import start_server  # noqa: E402
from tokensampler_client._proto import sampler_pb2 as pb  # noqa: E402

SAMPLE = "/tokensampler.v1.Sampler/Sample"
LIST = "/tokensampler.v1.Sampler/ListWeights"


def _memory(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def big_request(ids: int, rows: int, vocab: int, shared: bool) -> bytes:
    request = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[rows, vocab], data=bytes(2 * rows * vocab)))
    request.params.seed.append(1)
    history = np.random.default_rng(0).integers(0, vocab, ids, dtype=np.int32)
    request.params.output_token_ids.ids.extend(history.tolist())
    request.params.output_token_ids.lengths.extend([ids] if shared else [ids // rows] * (rows - 1) + [ids - ids // rows * (rows - 1)])
    request.params.frequency_penalty.append(0.5)
    return request.SerializeToString()


def _percentiles(latencies: list[float]) -> str:
    if not latencies:
        return "none"
    values = np.array(latencies) * 1e3
    return f"n={len(values)} p50 {np.percentile(values, 50):.1f} ms, p99 {np.percentile(values, 99):.1f} ms, max {values.max():.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", type=int, default=20_000_000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128_000)
    parser.add_argument("--shared", action="store_true")
    args = parser.parse_args()
    raw = big_request(args.ids, args.rows, args.vocab, args.shared)
    tiny = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 8], data=bytes(32))).SerializeToString()
    paths = os.pathsep.join(str(ROOT / package) for package in ("server", "client"))  # this tree's packages
    server = start_server("--device", "cpu", "--max-message-mb", "512", env={"PYTHONPATH": paths})
    try:
        timings: list[tuple[float, float]] = []  # (start, end) of each tiny Sample
        listings: list[tuple[float, float]] = []  # of each ListWeights: the event loop alone, no backend
        stop = threading.Event()

        def client(method: str, message: bytes, out: list[tuple[float, float]]) -> None:
            with grpc.insecure_channel(server.target) as channel:
                call = channel.unary_unary(method)
                while not stop.is_set():
                    started = time.perf_counter()
                    call(message, timeout=60)
                    out.append((started, time.perf_counter()))

        with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 1 << 30),
                                                          ("grpc.max_receive_message_length", 1 << 30)]) as channel:
            big = channel.unary_unary(SAMPLE)
            big(tiny, timeout=60)  # connected and warm
            threads = [threading.Thread(target=client, args=(SAMPLE, tiny, timings)),
                       threading.Thread(target=client, args=(LIST, b"", listings))]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while len(timings) < 200 and time.monotonic() < deadline:
                time.sleep(0.01)
            rss_before = _memory(server.process.pid, "VmRSS:")
            sent = time.perf_counter()
            try:
                big(raw, timeout=600)
                status = "OK"
            except grpc.RpcError as err:
                status = f"{err.code().name}: {(err.details() or '')[:160]}"
            answered = time.perf_counter()
            peak = _memory(server.process.pid, "VmHWM:")
            stop.set()
            for thread in threads:
                thread.join()
        def split(calls: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
            return ([end - start for start, end in calls if end < sent],
                    [end - start for start, end in calls if end > sent and start < answered])

        before, during = split(timings)
        listed_before, listed_during = split(listings)
        print(f"request {len(raw) / 2**20:.1f} MiB ({args.ids} ids, {args.rows} rows, "
              f"{'one shared list' if args.shared else 'one list per row'}): {status} in {answered - sent:.2f} s")
        print(f"tiny Samples before: {_percentiles(before)}")
        print(f"tiny Samples while it was processed: {_percentiles(during)}")
        print(f"ListWeights before: {_percentiles(listed_before)}; while it was processed: {_percentiles(listed_during)}")
        print(f"server RSS before {rss_before / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB: "
              f"+{(peak - rss_before) / 2**20:.0f} MiB = {(peak - rss_before) / len(raw):.1f}x the request")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
