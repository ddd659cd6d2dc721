"""`tokensampler-server`: command-line flags, each also settable by a TOKENSAMPLER_* variable."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from tokensampler_server.core.config import Limits, ServerConfig, StartupError
from tokensampler_server.core.logs import LOG_FORMATS, configure_logging

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
        "--port-file", type=Path, default=_env("PORT_FILE", "") or None,
        help="write the TCP port here once it is bound, for health checks that cannot see the flags "
        "(the container image's) [TOKENSAMPLER_PORT_FILE]",
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
        "--max-batch-elements", type=int,
        default=int(_env("MAX_BATCH_ELEMENTS", "0")) or None,
        help=f"most logits elements (B·V, also for hidden states through a head) in one request and one merged batch; "
        f"default {defaults.limits.max_batch_elements} on the CUDA backend, on the CPU backend at most 2^26 and "
        "1/64 of the memory in bytes [TOKENSAMPLER_MAX_BATCH_ELEMENTS]",
    )
    parser.add_argument(
        "--max-regions", type=int, default=int(_env("MAX_REGIONS", str(defaults.max_regions))),
        help="regions registered at once; past it RegisterRegion gets RESOURCE_EXHAUSTED [TOKENSAMPLER_MAX_REGIONS]",
    )
    parser.add_argument(
        "--max-weights", type=int, default=int(_env("MAX_WEIGHTS", str(defaults.max_weights))),
        help="weights registered at once; past it registering gets RESOURCE_EXHAUSTED [TOKENSAMPLER_MAX_WEIGHTS]",
    )
    parser.add_argument(
        "--unregister-timeout-s", type=float,
        default=float(_env("UNREGISTER_TIMEOUT_S", str(defaults.unregister_timeout_s))),
        help="how long an unregister waits for the requests using the weight or region; then it stays registered "
        "and the call gets FAILED_PRECONDITION [TOKENSAMPLER_UNREGISTER_TIMEOUT_S]",
    )
    parser.add_argument(
        "--max-queue-delay-us", type=int, default=int(_env("MAX_QUEUE_DELAY_US", str(defaults.max_queue_delay_us))),
        help="how long a request may wait for others to share a backend call while the backend is idle; "
        "requests arriving while it is busy are merged anyway; the native path's requests are merged only "
        "with a delay [TOKENSAMPLER_MAX_QUEUE_DELAY_US]",
    )
    parser.add_argument(
        "--max-queue-rows", type=int, default=int(_env("MAX_QUEUE_ROWS", str(defaults.max_queue_rows))),
        help="rows waiting for the backend beyond which requests get RESOURCE_EXHAUSTED [TOKENSAMPLER_MAX_QUEUE_ROWS]",
    )
    parser.add_argument(
        "--max-queue-mb", type=int, default=int(_env("MAX_QUEUE_MB", str(defaults.max_queue_bytes // _MIB))),
        help="MiB of request tensors waiting for the backend beyond which requests get RESOURCE_EXHAUSTED "
        "[TOKENSAMPLER_MAX_QUEUE_MB]",
    )
    parser.add_argument(
        "--max-concurrent-rpcs", type=int,
        default=int(_env("MAX_CONCURRENT_RPCS", str(defaults.max_concurrent_rpcs))),
        help="calls of the Sampler and reflection held at once (a stream counts as one until it ends), counted "
        "after authentication; past it new calls get RESOURCE_EXHAUSTED, which the client retries; 0: no limit "
        "[TOKENSAMPLER_MAX_CONCURRENT_RPCS]",
    )
    parser.add_argument(
        "--max-health-watchers", type=int,
        default=int(_env("MAX_HEALTH_WATCHERS", str(defaults.max_health_watchers))),
        help="health Watch streams held at once, in a pool of their own (health is open to every caller); "
        "health Check is not counted; 0: no limit [TOKENSAMPLER_MAX_HEALTH_WATCHERS]",
    )
    parser.add_argument(
        "--max-calls-per-client", type=int,
        default=int(_env("MAX_CALLS_PER_CLIENT", str(defaults.max_calls_per_client))),
        help="calls one client holds at once; a client is its bearer token, else its connection; 0: no limit "
        "[TOKENSAMPLER_MAX_CALLS_PER_CLIENT]",
    )
    parser.add_argument(
        "--gpu-memory-fraction", type=float, default=float(_env("GPU_MEMORY_FRACTION", "0")) or None,
        help="cap on the share of the GPU's memory the server's allocator may take, 0 < f <= 1; a batch "
        "that needs more gets RESOURCE_EXHAUSTED [TOKENSAMPLER_GPU_MEMORY_FRACTION]",
    )
    parser.add_argument(
        "--uds", default=_env("UDS", "") or None,
        help="also listen on this Unix domain socket path (clients use unix://PATH) [TOKENSAMPLER_UDS]",
    )
    parser.add_argument(
        "--allow-shm", action="store_true", default=_env("ALLOW_SHM", "") not in ("", "0"),
        help="accept POSIX shared-memory regions from colocated clients [TOKENSAMPLER_ALLOW_SHM]",
    )
    parser.add_argument(
        "--allow-cuda-ipc", action="store_true", default=_env("ALLOW_CUDA_IPC", "") not in ("", "0"),
        help="accept CUDA IPC regions (GPU buffers of colocated processes) [TOKENSAMPLER_ALLOW_CUDA_IPC]",
    )
    parser.add_argument(
        "--no-native-path", action="store_true", default=_env("NO_NATIVE_PATH", "") not in ("", "0"),
        help="answer every request on the Python path, also the plain ones (logits in a CUDA region or carried, "
        "tokens alone) the CUDA backend otherwise answers in C++ [TOKENSAMPLER_NO_NATIVE_PATH]",
    )
    parser.add_argument(
        "--weights-dir", type=Path, default=_env("WEIGHTS_DIR", "") or None,
        help="folder whose safetensors files RegisterWeightsFromFile may read; off when unset [TOKENSAMPLER_WEIGHTS_DIR]",
    )
    parser.add_argument(
        "--max-weight-mb", type=int, default=int(_env("MAX_WEIGHT_MB", str(defaults.limits.max_weight_bytes // _MIB))),
        help="largest LM-head weight one registration may hold, in MiB [TOKENSAMPLER_MAX_WEIGHT_MB]",
    )
    parser.add_argument(
        "--auth-token-file", type=Path, default=_env("AUTH_TOKEN_FILE", "") or None,
        help="accept only calls with metadata 'authorization: Bearer TOKEN', TOKEN one of this file's lines; "
        "health checks stay open [TOKENSAMPLER_AUTH_TOKEN_FILE]",
    )
    parser.add_argument(
        "--tls-cert", type=Path, default=_env("TLS_CERT", "") or None,
        help="PEM certificate chain: serve TLS on the TCP port (needs --tls-key) [TOKENSAMPLER_TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key", type=Path, default=_env("TLS_KEY", "") or None,
        help="PEM private key of --tls-cert [TOKENSAMPLER_TLS_KEY]",
    )
    parser.add_argument(
        "--tls-client-ca", type=Path, default=_env("TLS_CLIENT_CA", "") or None,
        help="PEM CA bundle: require client certificates it signed (mutual TLS) [TOKENSAMPLER_TLS_CLIENT_CA]",
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
        "--max-connection-age-s", type=float,
        default=float(_env("MAX_CONNECTION_AGE_S", str(defaults.max_connection_age_s))),
        help="close each client connection after this many seconds, 0 never: clients balancing over DNS "
        "(round_robin) then reconnect and find new replicas [TOKENSAMPLER_MAX_CONNECTION_AGE_S]",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=int(_env("METRICS_PORT", str(defaults.metrics_port))),
        help="port of the Prometheus endpoint http://HOST:PORT/metrics; 0 lets the OS choose "
        "(the log line 'metrics on' names it) [TOKENSAMPLER_METRICS_PORT]",
    )
    parser.add_argument(
        "--no-metrics", action="store_true", default=_env("NO_METRICS", "") not in ("", "0"),
        help="do not serve Prometheus metrics [TOKENSAMPLER_NO_METRICS]",
    )
    parser.add_argument(
        "--otlp-endpoint", default=_env("OTLP_ENDPOINT", "") or None,
        help="OpenTelemetry collector (OTLP over gRPC) that gets a span per call, e.g. http://collector:4317 "
        "(https:// for TLS); needs the tracing extra; off when unset [TOKENSAMPLER_OTLP_ENDPOINT]",
    )
    parser.add_argument(
        "--log-level", default=_env("LOG_LEVEL", defaults.log_level), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper, help="log verbosity; DEBUG adds one line per request [TOKENSAMPLER_LOG_LEVEL]",
    )
    parser.add_argument(
        "--log-format", default=_env("LOG_FORMAT", defaults.log_format), choices=LOG_FORMATS, type=str.lower,
        help="text, or json for one JSON object per line [TOKENSAMPLER_LOG_FORMAT]",
    )
    args = parser.parse_args(argv)
    for name in ("max_message_mb", "max_batch_rows", "max_queue_rows", "max_queue_mb", "max_weight_mb", "max_regions",
                 "max_weights"):
        if getattr(args, name) < 1:
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
    for name in ("max_concurrent_rpcs", "max_health_watchers", "max_calls_per_client"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0")
    if args.max_connection_age_s < 0:
        parser.error("--max-connection-age-s must be at least 0")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.otlp_endpoint is not None and not args.otlp_endpoint.startswith(("http://", "https://")):
        parser.error("--otlp-endpoint must be an http:// or https:// URL, e.g. http://collector:4317")
    return ServerConfig(
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        device=args.device,
        limits=Limits(
            max_batch_rows=args.max_batch_rows,
            max_batch_elements=args.max_batch_elements or defaults.limits.max_batch_elements,
            max_message_bytes=args.max_message_mb * _MIB,
            max_weight_bytes=args.max_weight_mb * _MIB,
        ),
        max_elements_given=args.max_batch_elements is not None,
        max_regions=args.max_regions,
        max_weights=args.max_weights,
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
        max_calls_per_client=args.max_calls_per_client,
        gpu_memory_fraction=args.gpu_memory_fraction,
        allow_shm=args.allow_shm,
        allow_cuda_ipc=args.allow_cuda_ipc,
        native_request_path=not args.no_native_path,
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
