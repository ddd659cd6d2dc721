"""`tokensampler-server`: command-line flags, each also settable by a TOKENSAMPLER_* variable."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokensampler_server.core.config import Limits, ServerConfig, StartupError
from tokensampler_server.core.logs import LOG_FORMATS, configure_logging

_MIB = 1024 * 1024


class _Flags:
    """Adds flags whose default a TOKENSAMPLER_* variable may set; each flag's help names its variable. A variable
    is read as the flag's value would be (argparse parses a string default with the flag's type), so a bad one gets
    the flag's own error."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    @staticmethod
    def variable(flag: str) -> str:
        return "TOKENSAMPLER_" + flag.removeprefix("--").replace("-", "_").upper()

    def value(self, flag: str, kind: Callable[[str], Any], default: Any, help: str, **more: Any) -> None:
        variable = self.variable(flag)
        self.parser.add_argument(flag, type=kind, default=os.environ.get(variable) or default,
                                 help=f"{help} [{variable}]", **more)

    def switch(self, flag: str, help: str) -> None:
        variable = self.variable(flag)
        self.parser.add_argument(flag, action="store_true", default=os.environ.get(variable, "") not in ("", "0"),
                                 help=f"{help} [{variable}]")


def _device_indices(parser: argparse.ArgumentParser, text: str | None) -> tuple[int, ...]:
    """--vocab-parallel-devices as indices: at least two, distinct, each >= 0; () when unset."""
    if not text:
        return ()
    try:
        indices = tuple(int(part) for part in text.split(","))
    except ValueError:
        parser.error(f"--vocab-parallel-devices: got {text!r}, expected comma-separated CUDA device indices, e.g. 0,1")
    if len(indices) < 2 or len(set(indices)) != len(indices) or min(indices) < 0:
        parser.error(f"--vocab-parallel-devices: got {text!r}, expected two or more distinct device indices")
    return indices


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(
        prog="tokensampler-server",
        description="Serve tokensampler.v1.Sampler over gRPC: sampled token ids from logits.",
        epilog="Every flag can also be set by the environment variable shown in its help; the flag wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    flags = _Flags(parser)
    flags.value("--host", str, defaults.host, "address to listen on")
    flags.value("--port", int, defaults.port,
                "TCP port; 0 lets the OS choose (the log line 'tokensampler serving on' names it)")
    flags.value("--port-file", Path, None, "write the TCP port here once it is bound, for health checks that cannot "
                "see the flags (the container image's)")
    flags.value("--device", str, defaults.device, "auto (CUDA when a GPU is present, else CPU), cpu, cuda or cuda:N")
    flags.value("--vocab-parallel-devices", str, None,
                "comma-separated CUDA device indices, the backend's --device first (e.g. 0,1): hidden states through "
                "a registered head are sampled with the head split by vocabulary rows over these GPUs "
                "(docs/design/vocab-parallel.md)")
    flags.value("--max-message-mb", int, defaults.limits.max_message_bytes // _MIB,
                "largest request or response message, in MiB")
    flags.value("--max-batch-rows", int, defaults.limits.max_batch_rows, "most rows in one request")
    flags.value("--max-batch-elements", int, None,
                "most logits elements (B·V, also for hidden states through a head) in one request and one merged "
                f"batch; default {defaults.limits.max_batch_elements} on the CUDA backend, on the CPU backend at most "
                "2^26 and 1/64 of the memory in bytes")
    flags.value("--max-regions", int, defaults.max_regions,
                "regions registered at once; past it RegisterRegion gets RESOURCE_EXHAUSTED")
    flags.value("--max-weights", int, defaults.max_weights,
                "weights registered at once; past it registering gets RESOURCE_EXHAUSTED")
    flags.value("--max-weights-mb", int, None,
                "MiB the registered weights may hold together, registrations in progress included; past it registering "
                "gets RESOURCE_EXHAUSTED; default half the memory of the backend's device")
    flags.value("--unregister-timeout-s", float, defaults.unregister_timeout_s,
                "how long an unregister waits for the requests using the weight or region; then it stays registered "
                "and the call gets FAILED_PRECONDITION")
    flags.value("--max-queue-delay-us", int, defaults.max_queue_delay_us,
                "how long a request may wait for others to share a backend call while the backend is idle; requests "
                "arriving while it is busy are merged anyway; the native path's requests are merged only with a delay")
    flags.value("--max-queue-rows", int, defaults.max_queue_rows,
                "rows waiting for the backend (the Python and the native path share one queue) beyond which requests get "
                "RESOURCE_EXHAUSTED")
    flags.value("--max-queue-mb", int, defaults.max_queue_bytes // _MIB,
                "MiB of request tensors waiting for the backend beyond which requests get RESOURCE_EXHAUSTED")
    flags.value("--max-concurrent-rpcs", int, defaults.max_concurrent_rpcs,
                "calls of the Sampler and reflection held at once (a stream counts as one until it ends), counted "
                "after authentication; past it new calls get RESOURCE_EXHAUSTED, which the client retries; 0: no limit")
    flags.value("--max-health-watchers", int, defaults.max_health_watchers,
                "health Watch streams held at once, in a pool of their own (health is open to every caller); health "
                "Check is not counted; 0: no limit")
    flags.value("--max-uploads", int, defaults.max_uploads,
                "RegisterWeights uploads held at once, in a pool of their own (an upload that trickles its chunks "
                "never takes the Sampler's slots); 0: no limit")
    flags.value("--max-calls-per-client", int, defaults.max_calls_per_client,
                "calls one client holds at once; a client is its bearer token, else its connection; 0: no limit")
    flags.value("--reclaim-idle-calls-s", float, defaults.reclaim_idle_calls_s,
                "at the --max-concurrent-rpcs cap, a new call takes the slot of a call that has waited this many "
                "seconds on its client: a stream for its next message (it ends with RESOURCE_EXHAUSTED, which a "
                "client may retry by reopening it), or any call for its client to read an answer (it is cancelled); "
                "0: never")
    flags.value("--gpu-memory-fraction", float, None,
                "cap on the share of the GPU's memory the server's allocator may take, 0 < f <= 1; a batch that needs "
                "more gets RESOURCE_EXHAUSTED")
    flags.value("--uds", str, None, "also listen on this Unix domain socket path (clients use unix://PATH)")
    flags.switch("--allow-shm", "accept POSIX shared-memory regions from colocated clients")
    flags.switch("--allow-cuda-ipc", "accept CUDA IPC regions (GPU buffers of colocated processes)")
    flags.switch("--no-native-path", "answer every request on the Python path, also the plain ones (logits in a CUDA "
                 "region or carried, tokens alone) the CUDA backend otherwise answers in C++")
    flags.value("--weights-dir", Path, None, "folder whose safetensors files RegisterWeightsFromFile may read; off when "
                "unset")
    flags.value("--max-weight-mb", int, defaults.limits.max_weight_bytes // _MIB,
                "largest LM-head weight one registration may hold, in MiB")
    flags.value("--auth-token-file", Path, None, "accept only calls with metadata 'authorization: Bearer TOKEN', TOKEN "
                "one of this file's lines; health checks stay open")
    flags.value("--tls-cert", Path, None, "PEM certificate chain: serve TLS on the TCP port (needs --tls-key)")
    flags.value("--tls-key", Path, None, "PEM private key of --tls-cert")
    flags.value("--tls-client-ca", Path, None, "PEM CA bundle: require client certificates it signed (mutual TLS)")
    flags.value("--grace-period-s", float, defaults.grace_period_s,
                "seconds in-flight requests may run on after SIGTERM/SIGINT")
    flags.switch("--no-reflection", "do not serve gRPC server reflection")
    flags.value("--max-connection-age-s", float, defaults.max_connection_age_s,
                "close each client connection after this many seconds, 0 never: clients balancing over DNS "
                "(round_robin) then reconnect and find new replicas")
    flags.value("--metrics-port", int, defaults.metrics_port, "port of the Prometheus endpoint "
                "http://HOST:PORT/metrics; 0 lets the OS choose (the log line 'metrics on' names it)")
    flags.switch("--no-metrics", "do not serve Prometheus metrics")
    flags.value("--otlp-endpoint", str, None, "OpenTelemetry collector (OTLP over gRPC) that gets a span per call, "
                "e.g. http://collector:4317 (https:// for TLS); needs the tracing extra; off when unset")
    flags.value("--log-level", str.upper, defaults.log_level, "log verbosity; DEBUG adds one line per request",
                choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    flags.value("--log-format", str.lower, defaults.log_format, "text, or json for one JSON object per line",
                choices=LOG_FORMATS)
    args = parser.parse_args(argv)
    for name in ("max_message_mb", "max_batch_rows", "max_queue_rows", "max_queue_mb", "max_weight_mb", "max_regions",
                 "max_weights", "max_weights_mb"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be in 0..65535")
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction <= 1:
        parser.error("--gpu-memory-fraction must be in (0, 1]")
    if args.max_batch_elements is not None and args.max_batch_elements < 1:
        parser.error("--max-batch-elements must be at least 1")
    if not args.unregister_timeout_s > 0:
        parser.error("--unregister-timeout-s must be greater than 0")
    if args.max_queue_delay_us < 0:
        parser.error("--max-queue-delay-us must be at least 0")
    for name in ("max_concurrent_rpcs", "max_health_watchers", "max_uploads", "max_calls_per_client"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0")
    if not (math.isfinite(args.reclaim_idle_calls_s) and args.reclaim_idle_calls_s >= 0):
        parser.error("--reclaim-idle-calls-s must be finite and at least 0")
    if args.max_connection_age_s < 0:
        parser.error("--max-connection-age-s must be at least 0")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    vocab_parallel_devices = _device_indices(parser, args.vocab_parallel_devices)
    if vocab_parallel_devices:
        first = vocab_parallel_devices[0]
        if args.device not in {f"cuda:{first}", *(("auto", "cuda") if first == 0 else ())}:
            parser.error(f"--vocab-parallel-devices must start with the backend's CUDA device (--device "
                         f"{args.device}); expected --device cuda:{first}")
    if args.otlp_endpoint is not None and not args.otlp_endpoint.startswith(("http://", "https://")):
        parser.error("--otlp-endpoint must be an http:// or https:// URL, e.g. http://collector:4317")
    return ServerConfig(
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        device=args.device,
        vocab_parallel_devices=vocab_parallel_devices,
        limits=Limits(
            max_batch_rows=args.max_batch_rows,
            max_batch_elements=args.max_batch_elements or defaults.limits.max_batch_elements,
            max_message_bytes=args.max_message_mb * _MIB,
            max_weight_bytes=args.max_weight_mb * _MIB,
        ),
        max_elements_given=args.max_batch_elements is not None,
        max_regions=args.max_regions,
        max_weights=args.max_weights,
        max_weights_bytes=None if args.max_weights_mb is None else args.max_weights_mb * _MIB,
        unregister_timeout_s=args.unregister_timeout_s,
        log_level=args.log_level,
        grace_period_s=args.grace_period_s,
        reflection=not args.no_reflection,
        max_connection_age_s=args.max_connection_age_s,
        metrics_port=None if args.no_metrics else args.metrics_port,
        log_format=args.log_format,
        uds=args.uds,
        weights_dir=args.weights_dir,
        max_queue_delay_us=args.max_queue_delay_us,
        max_queue_rows=args.max_queue_rows,
        max_queue_bytes=args.max_queue_mb * _MIB,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_health_watchers=args.max_health_watchers,
        max_uploads=args.max_uploads,
        max_calls_per_client=args.max_calls_per_client,
        reclaim_idle_calls_s=args.reclaim_idle_calls_s,
        gpu_memory_fraction=args.gpu_memory_fraction,
        allow_shm=args.allow_shm,
        allow_cuda_ipc=args.allow_cuda_ipc,
        native_path=not args.no_native_path,
        auth_token_file=args.auth_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        otlp_endpoint=args.otlp_endpoint,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    from tokensampler_server.app.server import serve  # after logging is set up: importing torch and grpc can log

    try:
        asyncio.run(serve(config))
    except StartupError as err:
        print(f"tokensampler-server: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
