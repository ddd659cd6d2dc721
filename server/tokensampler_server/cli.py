"""`tokensampler-server`: command-line flags, each also settable by a TOKENSAMPLER_* variable."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from .config import Limits, ServerConfig

_MIB = 1024 * 1024


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TOKENSAMPLER_{name}", default)


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(
        prog="tokensampler-server",
        description="Serve tokensampler.v1.Sampler over gRPC: sampled token ids from logits.",
        epilog="Every flag can also be set by the environment variable shown in its help; the flag wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default=_env("HOST", defaults.host), help="address to listen on [TOKENSAMPLER_HOST]")
    parser.add_argument(
        "--port", type=int, default=int(_env("PORT", str(defaults.port))),
        help="TCP port; 0 lets the OS choose (the log line 'tokensampler serving on' names it) [TOKENSAMPLER_PORT]",
    )
    parser.add_argument(
        "--device", default=_env("DEVICE", defaults.device),
        help="auto (CUDA when a GPU is present, else CPU), cpu, cuda or cuda:N [TOKENSAMPLER_DEVICE]",
    )
    parser.add_argument(
        "--max-message-mb", type=int, default=int(_env("MAX_MESSAGE_MB", str(defaults.limits.max_message_bytes // _MIB))),
        help="largest request or response message, in MiB [TOKENSAMPLER_MAX_MESSAGE_MB]",
    )
    parser.add_argument(
        "--max-batch-rows", type=int, default=int(_env("MAX_BATCH_ROWS", str(defaults.limits.max_batch_rows))),
        help="most rows in one request [TOKENSAMPLER_MAX_BATCH_ROWS]",
    )
    parser.add_argument(
        "--grace-period-s", type=float, default=float(_env("GRACE_PERIOD_S", str(defaults.grace_period_s))),
        help="seconds in-flight requests may run on after SIGTERM/SIGINT [TOKENSAMPLER_GRACE_PERIOD_S]",
    )
    parser.add_argument(
        "--no-reflection", action="store_true", default=_env("NO_REFLECTION", "") not in ("", "0"),
        help="do not serve gRPC server reflection [TOKENSAMPLER_NO_REFLECTION]",
    )
    parser.add_argument(
        "--log-level", default=_env("LOG_LEVEL", defaults.log_level), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper, help="log verbosity [TOKENSAMPLER_LOG_LEVEL]",
    )
    args = parser.parse_args(argv)
    for name in ("max_message_mb", "max_batch_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return ServerConfig(
        host=args.host,
        port=args.port,
        device=args.device,
        limits=Limits(max_batch_rows=args.max_batch_rows, max_message_bytes=args.max_message_mb * _MIB),
        log_level=args.log_level,
        grace_period_s=args.grace_period_s,
        reflection=not args.no_reflection,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from .server import serve  # after logging is set up: importing torch and grpc can log

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
