"""Builds the grpc.aio server (sampler, health, reflection) and runs it until SIGTERM/SIGINT.

Shutdown: health turns NOT_SERVING at once (gRPC, and /readyz on the metrics port) and its Watch streams end,
new calls are refused, requests waiting out the queue delay start at once, in-flight calls get the grace period to
finish, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from functools import partial
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from tokensampler_client._proto import sampler_pb2 as pb

from tokensampler_server.rpc.admission import Admission
from tokensampler_server.rpc.auth import AuthInterceptor, BearerTokens
from tokensampler_server.backends import Backend, create_backend
from tokensampler_server.batching.batcher import DynamicBatcher
from tokensampler_server.core.budget import ByteBudget
from tokensampler_server.core.config import ServerConfig, StartupError, cpu_max_batch_elements
from tokensampler_server.rpc.call_guard import CallGuard
from tokensampler_server.rpc.health import NOT_SERVING, SERVING, HealthService
from tokensampler_server.resources.regions import RegionRegistry
from tokensampler_server.rpc.metrics import ServerMetrics, start_metrics_http
from tokensampler_server.rpc.native_path import create_native_path
from tokensampler_server.rpc.service import SamplerService, add_sampler_to_server
from tokensampler_server.app.tls import server_credentials
from tokensampler_server.resources.host_memory import host_memory_bytes
from tokensampler_server.resources.weights import WeightRegistry

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Sampler"].full_name


async def follow_backend_health(backend: Backend, health_servicer: HealthService,
                                period_s: float = 1.0) -> None:
    """gRPC health follows backend.serving(), asked every period_s on a worker thread: NOT_SERVING while the
    backend's devices cannot serve (a vocabulary-parallel exchange failed; the backend rebuilds its communicators
    there), SERVING again once they can. Runs until cancelled."""
    serving = True
    while True:
        try:
            now = await asyncio.to_thread(backend.serving)
        except Exception:  # noqa: BLE001 - a device that cannot even be asked does not serve; keep following it
            log.exception("backend %s: asking whether it serves failed", backend.info().device)
            now = False
        if now != serving:
            status = SERVING if now else NOT_SERVING
            for service in ("", SERVICE_NAME):
                await health_servicer.set(service, status)
            log.warning("backend %s: health %s", backend.info().device, "SERVING" if now else "NOT_SERVING")
            serving = now
        await asyncio.sleep(period_s)


def sampler_serving(health_servicer: HealthService) -> bool:
    """Whether gRPC health says SERVING for the Sampler: /readyz on the metrics port. Called on that port's
    threads, where the servicer's Check (a coroutine of the event loop) cannot run: a read of its statuses."""
    return health_servicer.status(SERVICE_NAME) == SERVING


PER_CONNECTION_MARGIN = 16
"""Streams a connection may open beyond --max-calls-per-client: health checks and calls being refused."""


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    options = [
        ("grpc.max_receive_message_length", config.limits.max_message_bytes),
        ("grpc.max_send_message_length", config.limits.max_message_bytes),
    ]
    if config.max_calls_per_client:
        # Calls a connection may open at once (HTTP/2's own limit; the client queues the rest). Admission counts a
        # call only from its handler's start, and a unary call reaches it only once its request has arrived:
        # without this, one connection opening calls that never send their request held every slot of the
        # backstop below, health checks included. A little above the per-client cap, for health and refusals.
        options.append(("grpc.max_concurrent_streams", config.max_calls_per_client + PER_CONNECTION_MARGIN))
    if config.max_connection_age_s > 0:
        # Clients that balance over DNS results re-resolve when a connection closes: closing each one
        # after a while lets them find replicas that started since. Calls in flight get the grace period.
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.grace_period_s * 1000)),
        ]
    return options


def _listen(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, flags: str) -> int:
    """The port bound at `address`; a StartupError naming `flags` when it cannot be (grpc raises for an address in
    use, or returns 0, depending on its version)."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as err:
        raise StartupError(f"{flags}: cannot listen on {address} ({err})") from None
    if port == 0:
        raise StartupError(f"{flags}: cannot listen on {address} (in use, or not an address of this machine)")
    return port


def grpc_call_backstop(config: ServerConfig) -> int | None:
    """grpc's own cap on calls (None: none), a backstop far above admission's caps (admission.py), which count
    only the calls they admit, from their handler's start. grpc counts every call from its arrival: also health
    checks, calls being refused (for their token or at a cap) and unary calls whose request is still arriving.
    Those get as much room again as the service's calls: only a flood of them reaches it."""
    if not config.max_concurrent_rpcs or not config.max_health_watchers or not config.max_uploads:
        return None
    return 2 * config.max_concurrent_rpcs + config.max_health_watchers + config.max_uploads


def _write_port_file(path: Path, port: int) -> None:
    """Replaces `path` whole with the port, so that a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(f"{port}\n")
        partial.replace(path)
    except OSError as err:
        raise StartupError(f"--port-file: cannot write {path}: {err.strerror}") from err


async def serve(config: ServerConfig) -> None:
    # Access settings first: a bad token or certificate file stops the server before any work.
    tokens = None if config.auth_token_file is None else BearerTokens.from_file(config.auth_token_file)
    credentials = None
    if config.tls_cert is not None and config.tls_key is not None:
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    if config.allow_cuda_ipc:
        # Colocated loops: a loop's stream waits on its engine's GPU, and a kernel loaded on its first launch waits
        # for every stream of the context, so a call's first kernel would wait for another process's engine
        # (docs/design/colocated-handoff.md). Loaded up front instead; before the backend makes the context.
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    backend = create_backend(config.device, config.vocab_parallel_devices)
    if config.allow_cuda_ipc and backend.device.type == "cuda":
        from tokensampler_server.backends.cuda_handoff import load_libraries

        load_libraries(backend.device)
    info = backend.info()
    tracer = None
    if config.otlp_endpoint is not None:
        from tokensampler_server.rpc.tracing import otlp_tracer  # only here: a server without tracing loads no opentelemetry module

        tracer = otlp_tracer(config.otlp_endpoint, info.name)
        log.info("tracing: spans to %s", config.otlp_endpoint)
    log.info("backend %s on %s", info.name, info.device)

    if config.gpu_memory_fraction is not None and backend.device.type == "cuda":
        import torch

        torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, backend.device)
    if backend.device.type == "cpu":
        limits = replace(config.limits, samples_are_elements=True)
        if not config.max_elements_given:
            limits = replace(limits, max_batch_elements=cpu_max_batch_elements(host_memory_bytes()))
        config = replace(config, limits=limits)
        log.info("CPU backend: at most %d elements (B·V·samples) in a request or batch (--max-batch-elements)",
                 limits.max_batch_elements)
    metrics = ServerMetrics(info)
    # The only interceptor: a refused call reaches nothing else. Every handler is guarded as it registers, and
    # the guard admits each call (admission.py): after authentication, so outsiders take no slot of the service.
    interceptors = [AuthInterceptor(tokens, metrics)] if tokens is not None else None
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(config),
                             maximum_concurrent_rpcs=grpc_call_backstop(config))
    admission = Admission(config.max_concurrent_rpcs, config.max_health_watchers, config.max_calls_per_client,
                          tokens, metrics, config.reclaim_idle_calls_s, max_uploads=config.max_uploads)
    requests_in_progress = ByteBudget(config.max_queue_bytes, "request", "requests", "--max-queue-mb")
    registration = CallGuard(metrics, admission, tracer, requests_in_progress, config.limits).registration(server)
    batcher = DynamicBatcher(
        backend,
        max_batch_rows=config.limits.max_batch_rows,
        max_batch_elements=config.limits.max_batch_elements,
        max_queue_delay_us=config.max_queue_delay_us,
        max_queue_rows=config.max_queue_rows,
        max_queue_bytes=config.max_queue_bytes,
        observe_batch_rows=metrics.batch_rows.observe,
    )
    native = create_native_path(backend, config.limits, config.native_path, batcher)
    regions = RegionRegistry(allow_shm=config.allow_shm, allow_cuda_ipc=config.allow_cuda_ipc, mirror=native,
                             max_regions=config.max_regions, unregister_timeout_s=config.unregister_timeout_s)
    weights = WeightRegistry(backend.device, max_weights=config.max_weights, max_bytes=config.max_weights_bytes,
                             unregister_timeout_s=config.unregister_timeout_s)
    sampler = SamplerService(
        backend, config.limits, batcher=batcher, registry=weights, weights_dir=config.weights_dir, regions=regions,
        metrics=metrics, native=native,
    )
    metrics.queue_depth.set_function(lambda: sampler.queue_depth)
    metrics.registered_weights.set_function(lambda: len(sampler.registry.list()))
    metrics.registered_weights_bytes.set_function(lambda: sampler.registry.total_bytes)
    metrics.registered_regions.set_function(lambda: len(regions.list()))
    metrics.registered_regions_bytes.set_function(lambda: regions.total_bytes)
    add_sampler_to_server(sampler, registration)
    health_servicer = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registration)
    if config.reflection:
        # reflection.enable_server_reflection, with the asyncio servicer named (it picks by the server's type)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)),
            registration)
    port = _listen(server, f"{config.host}:{config.port}", credentials, "--host/--port")
    if config.port_file is not None:
        _write_port_file(config.port_file, port)
    # The socket file's permissions guard it; bearer tokens still apply there.
    if config.uds is not None:
        _listen(server, f"unix:{config.uds}", None, "--uds")
    metrics_http = None
    if config.metrics_port is not None:  # before the serving line: whoever waits for it finds the metrics port too
        metrics_http = start_metrics_http(metrics, config.host, config.metrics_port,
                                          ready=partial(sampler_serving, health_servicer))
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, SERVING)
    # Tests and scripts wait for this line to learn the port (with --port 0 the OS picks it).
    log.info("access: %s, %s", "bearer tokens required" if tokens is not None else "open to every caller",
             "plaintext" if credentials is None else "TLS" + (" with client certificates" if config.tls_client_ca else ""))
    log.info("tokensampler serving on %s:%d", config.host, port, extra={"host": config.host, "port": port})
    if config.uds is not None:
        log.info("also serving on unix:%s", config.uds)

    # Only a backend whose devices can fail apart from the process (vocabulary-parallel GPUs) changes its health.
    follower = asyncio.create_task(follow_backend_health(backend, health_servicer)) \
        if config.vocab_parallel_devices else None
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()

    log.info("shutting down: NOT_SERVING, %.1f s grace for in-flight requests", config.grace_period_s)
    if follower is not None:
        follower.cancel()
    await health_servicer.enter_graceful_shutdown()  # and its Watch streams end
    admission.end_waiting_streams()  # streams with nothing in flight need no grace period
    batcher.drain()  # nothing more will come to merge with: what waits out --max-queue-delay-us starts now
    await server.stop(config.grace_period_s)
    await sampler.close()
    if tracer is not None:
        tracer.shutdown()  # exports the spans of the last calls
    if metrics_http is not None:  # last: Prometheus can scrape the drain
        metrics_http.shutdown()
        metrics_http.server_close()
    log.info("stopped")
