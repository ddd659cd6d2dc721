"""Demo traffic for the compose stack: a mix of batch sizes and sampling modes, and now and then a
request the server rejects, so that every panel of the dashboard has something to show.

    python docker/demo_load.py --target localhost:50051 [--rate 20] [--requests N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from tokensampler_client import SamplerClient, TokenSamplerError

VOCAB_SIZE = 32000
BATCH_ROWS = (1, 4, 16, 64)
PARAMS = (  # one of each sampling mode, and a combination
    {"temperature": 0.0},
    {},
    {"top_k": 50},
    {"top_p": 0.9},
    {"min_p": 0.05},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
)
INVALID_EVERY = 50  # every 50th request is sent with top_p = 0, which the server answers INVALID_ARGUMENT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="server address (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second at most (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=0, help="stop after this many (default: run until stopped)")
    args = parser.parse_args()
    rng = random.Random(0)
    with SamplerClient(args.target, timeout=60) as client:
        sent = 0
        while args.requests == 0 or sent < args.requests:
            logits = torch.randn(rng.choice(BATCH_ROWS), VOCAB_SIZE)
            # The modes in turn, so that any run of len(PARAMS) requests reaches every one of them.
            params = {"top_p": 0.0} if sent % INVALID_EVERY == INVALID_EVERY - 1 else PARAMS[sent % len(PARAMS)]
            try:
                client.sample(logits, **params)
            except TokenSamplerError as err:
                print(f"demo-load: {err}", flush=True)
            sent += 1
            time.sleep(1 / args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
