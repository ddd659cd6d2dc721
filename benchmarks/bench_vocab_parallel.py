"""The exchanges of vocabulary-parallel sampling (docs/design/vocab-parallel.md) between GPUs over NCCL.

  python benchmarks/bench_vocab_parallel.py            # two GPUs: writes vocab-parallel-exchange-<gpu>-<date>.json

One process a GPU. For each exchange of a call and each B, with the payload the design doc gives per row and
shard, p50 and p99 of REPS after WARMUP:
- "nccl, device time": the collective alone (all_gather_into_tensor or all_reduce on device tensors) between CUDA
  events on its stream: what it adds to a chain of kernels on the GPU;
- "nccl, back to back": REPS of them enqueued in a row between two CUDA events, divided by REPS: the collective's
  own latency, without the two processes' skew in reaching it;
- "nccl": the same collective as the host sees it (time.perf_counter around the call and a synchronisation);
- "exchange": `Exchange.gather` / `reduce` as `sample_sharded` runs it today, blocks on the CPU: the payload up to
  the GPU, torch.distributed's all_gather into a list (or all_reduce), the result back, the failure flags checked.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import write_results  # noqa: E402
from provenance import tree_commit  # noqa: E402
from tokensampler_server.backends.vocab_parallel import CANDIDATES, Exchange  # noqa: E402

WARMUP, REPS = 20, 200
BATCHES = (1, 8, 32, 64, 128)
F64, I64 = torch.float64, torch.int64


def payloads(rows: int, ranks: int) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """Each exchange of a call: (gather or reduce, a shard's block shape, dtype), as sample_sharded sends them."""
    return {
        "1 stats (gather)": ("gather", (8 + 4 * rows,), F64),
        "2 partials, top-k 64 candidates (gather)": ("gather", (rows, 3 + 3 * CANDIDATES), F64),
        "3 search round: quantiles (gather)": ("gather", (rows, 32), I64),
        "3 search round: counts (reduce)": ("reduce", (2, rows, ranks * 32 + 2), F64),
        "3 search finish (gather)": ("gather", (2, rows, 160), I64),
    }


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return 1e6 * ordered[len(ordered) // 2], 1e6 * ordered[int(len(ordered) * 0.99) - 1]


def timed(call) -> tuple[float, float]:
    for _ in range(WARMUP):
        call()
    seconds = []
    for _ in range(REPS):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return percentiles(seconds)


def back_to_back(collective) -> float:
    """µs a collective, REPS enqueued in a row on the stream (each rank's stream paces the other's)."""
    for _ in range(WARMUP):
        collective()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(REPS):
        collective()
    end.record()
    end.synchronize()
    return 1e3 * begin.elapsed_time(end) / REPS


def device_timed(collective) -> tuple[float, float]:
    """The collective between CUDA events, each call after the stream has drained."""
    for _ in range(WARMUP):
        collective()
    seconds = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        collective()
        end.record()
        end.synchronize()
        seconds.append(begin.elapsed_time(end) * 1e-3)
    return percentiles(seconds)


def _worker(rank: int, ranks: int, port: int, out: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    exchange = Exchange(None)
    rows_out = []
    for b in BATCHES:
        for stage, (kind, shape, dtype) in payloads(b, ranks).items():
            block = torch.zeros(shape, dtype=dtype)
            on_device = torch.zeros(block.numel() + ranks, dtype=dtype, device=device)
            gathered = torch.empty((ranks, on_device.numel()), dtype=dtype, device=device)

            def collective() -> None:
                if kind == "gather":
                    dist.all_gather_into_tensor(gathered, on_device)
                else:
                    dist.all_reduce(on_device)

            def bare() -> None:
                collective()
                torch.cuda.synchronize()

            def through_exchange() -> None:
                if kind == "gather":
                    exchange.gather(stage, shape, dtype, lambda: block)
                else:
                    exchange.reduce(stage, shape, lambda: block)

            in_a_row = back_to_back(collective)
            timings = (("nccl, back to back", (in_a_row, in_a_row)), ("nccl, device time", device_timed(collective)),
                       ("nccl", timed(bare)),
                       ("exchange", timed(through_exchange)))
            for method, (p50, p99) in timings:
                rows_out.append({"workload": "vocab-parallel-exchange", "method": method, "mode": stage, "B": b,
                                 "ranks": ranks, "bytes_per_rank": on_device.numel() * on_device.element_size(),
                                 "median_us": round(p50, 1), "p99_us": round(p99, 1)})
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows_out))


def main() -> None:
    ranks = torch.cuda.device_count()
    if ranks < 2:
        raise SystemExit(f"needs two CUDA GPUs or more, found {ranks}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = ROOT / "benchmarks" / "results" / ".vocab_parallel_rank0.json"
    mp.start_processes(_worker, args=(ranks, port, str(out)), nprocs=ranks, start_method="spawn")
    rows = json.loads(out.read_text())
    os.remove(out)
    for row in rows:
        print(f"{row['mode']:42s} B={row['B']:4d} {row['method']:17s} {row['bytes_per_rank']:7d} B "
              f"p50 {row['median_us']:8.1f} us  p99 {row['p99_us']:8.1f} us", flush=True)
    meta = {"gpu": f"{ranks}x {torch.cuda.get_device_name(0)}", "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "commit": tree_commit(),
            "date": datetime.date.today().isoformat(),
            "timing": f"p50 and p99 of {REPS} after {WARMUP}: CUDA events (device time) or the host's clock"}
    write_results(ROOT / "benchmarks" / "results", f"vocab-parallel-exchange-{ranks}gpu", meta, rows)


if __name__ == "__main__":
    main()
