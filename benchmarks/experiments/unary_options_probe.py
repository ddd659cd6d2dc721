"""What a unary call's options cost on the wire path alone: the empty echo called plainly, with a deadline, with
one metadata pair (a request id), and with both, interleaved in rounds (p50 µs).

  python benchmarks/experiments/unary_options_probe.py [--rounds 5] [--iters 400]

Findings: benchmarks/SERVICE_NOTES.md ("Twenty-fifth session").
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_service import Echo, start  # noqa: E402

REQUEST_ID = (("x-request-id", "0123456789abcdef0123456789abcdef"),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    echo, port = start([sys.executable, str(ROOT / "benchmarks" / "echo_server.py"), "--port", "0"],
                       re.compile(r"echo serving on (\d+)"))
    try:
        unary = Echo(f"127.0.0.1:{port}").unary
        variants = {
            "plain": lambda: unary(b""),
            "deadline": lambda: unary(b"", timeout=60),
            "request id": lambda: unary(b"", metadata=REQUEST_ID),
            "both": lambda: unary(b"", timeout=60, metadata=REQUEST_ID),
        }
        p50s: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, call in variants.items():
                for _ in range(50):
                    call()
                times = []
                for _ in range(args.iters):
                    started = time.perf_counter_ns()
                    call()
                    times.append((time.perf_counter_ns() - started) / 1e3)
                p50s[name].append(statistics.median(times))
        for name, values in p50s.items():
            print(f"{name:12s} p50 {statistics.median(values):7.1f} us  (rounds: {' '.join(f'{v:.0f}' for v in values)})")
    finally:
        echo.terminate()


if __name__ == "__main__":
    main()
