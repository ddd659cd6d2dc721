"""Prometheus metrics: what the server exports on --metrics-port, and how the layers record them.

The same port answers the HTTP health probes of load balancers that do not speak gRPC: /healthz (live)
and /readyz (ready: what gRPC health says of the Sampler). Every other path is 404.

Each server owns a CollectorRegistry, so servers built in one process (tests) never share counts.
The one exception is the fallback counter (fallbacks.py): backends have no handle on a server, so it is
process-wide and every server's registry exports it.

Names follow Prometheus conventions: the `tokensampler_` prefix, base units (seconds, bytes),
`_total` on counters, and labels with a small fixed set of values. README.md, section "Metrics",
says what each one means.
"""

from __future__ import annotations

import gzip
import logging
import math
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from tokensampler_server import __version__
from tokensampler_server.backends.base import BackendInfo
from tokensampler_server.rpc.call_record import CallRecord
from tokensampler_server.core.fallbacks import FALLBACKS
from tokensampler_server.model.sampling import SamplingBatch

log = logging.getLogger(__name__)

# 25 µs (a small batch on the GPU) to 2 s (a large batch on the CPU reference).
LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.0,
)
ROW_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 to 4096, the default --max-batch-rows

ROW_MODES = ("greedy", "gumbel", "top_k", "top_p", "min_p", "fused")
"""Values of rows_total's `mode` label. "fused" is for rows sampled from hidden states with a
registered LM head, which a later API version adds: declared now so dashboards need no change."""
_GREEDY, _GUMBEL, _TOP_K, _TOP_P, _MIN_P = (ROW_MODES.index(m) for m in ("greedy", "gumbel", "top_k", "top_p", "min_p"))
_LOOP_ROWS = 16
_MAX_LATER = 4096  # calls observe_call_later keeps at most; past that, each new call records _FLUSH_CHUNK of them
_FLUSH_CHUNK = 8


def count_row_modes(batch: SamplingBatch) -> np.ndarray:
    """Rows of `batch` per mode, in ROW_MODES order.

    Each row counts once, under the first that applies: hidden-state input (fused), T == 0 greedy,
    top-k on, top-p on, min-p on, else plain Gumbel-max sampling over the whole vocabulary.
    """
    if batch.hidden is not None:
        counts = np.zeros(len(ROW_MODES), dtype=np.int64)
        counts[ROW_MODES.index("fused")] = batch.num_rows
        return counts
    if batch.num_rows <= _LOOP_ROWS:  # a loop over Python numbers beats numpy's per-call cost here
        counts = np.zeros(len(ROW_MODES), dtype=np.int64)
        params = (batch.temperature.tolist(), batch.top_k.tolist(), batch.top_p.tolist(), batch.min_p.tolist())
        for t, k, p, m in zip(*params):
            counts[_GREEDY if t == 0 else _TOP_K if k > 0 else _TOP_P if p < 1 else _MIN_P if m > 0 else _GUMBEL] += 1
        return counts
    mode = np.select(
        [batch.temperature.numpy() == 0, batch.top_k.numpy() > 0, batch.top_p.numpy() < 1, batch.min_p.numpy() > 0],
        [ROW_MODES.index("greedy"), ROW_MODES.index("top_k"), ROW_MODES.index("top_p"), ROW_MODES.index("min_p")],
        default=ROW_MODES.index("gumbel"),
    )
    return np.bincount(mode, minlength=len(ROW_MODES))


class _FlushFirst(Collector):
    """Yields no metric: collecting it records the calls kept by observe_call_later, before the rest is read."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self._metrics.flush()
        return iter(())


class _GpuMemory(Collector):
    """torch's CUDA caching-allocator counters, read at scrape time. No samples without a GPU."""

    def __init__(self, device_index: int | None) -> None:
        self._device_index = device_index

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(sample=self._device_index is not None)

    def _families(self, sample: bool = False) -> Iterator[GaugeMetricFamily]:
        for kind, read in (("allocated", torch.cuda.memory_allocated), ("reserved", torch.cuda.memory_reserved)):
            family = GaugeMetricFamily(
                f"tokensampler_gpu_memory_{kind}_bytes",
                f"GPU memory {kind} by torch's caching allocator in this process.",
                labels=["device"],
            )
            if sample:
                family.add_metric([f"cuda:{self._device_index}"], read(self._device_index))
            yield family


def _cuda_device_index(info: BackendInfo) -> int | None:
    """N of a CUDA backend's device "cuda:N (GPU name)"; None for the CPU backend."""
    match = re.match(r"cuda:(\d+)", info.device) if info.name == "cuda" else None
    return int(match[1]) if match else None


class ServerMetrics:
    """The metrics of one server, in their own registry."""

    def __init__(self, backend: BackendInfo | None = None) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        # Calls (call, code, duration) and response serialisations (seconds) recorded at the next scrape.
        self._later: deque[tuple[CallRecord, grpc.StatusCode, int] | float] = deque()
        self.calls_in_flight = 0
        """Calls being served; counted by the call guard on the event loop (plain integer updates, read at scrape
        time), where the gauge's track_inprogress took a lock twice a call."""
        registry.register(_FlushFirst(self))  # first: a scrape sees every call answered before it
        self.requests = Counter(
            "tokensampler_requests_total", "Finished calls by method and gRPC status code.",
            ["method", "code"], registry=registry,
        )
        self.request_duration = Histogram(
            "tokensampler_request_duration_seconds",
            "Server time of a call: from parsing the request to its status, the response's serialisation excluded.",
            ["method"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.queue_duration = Histogram(
            "tokensampler_queue_duration_seconds", "Time a validated batch waited for the backend.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.compute_duration = Histogram(
            "tokensampler_compute_duration_seconds", "Time the backend took to sample a batch.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        serialization = Histogram(
            "tokensampler_serialization_duration_seconds",
            "Time spent between wire bytes and tensors: deserialize (parse, validate, decode the request) "
            "or serialize (encode and serialise the response).",
            ["direction"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.deserialize_duration = serialization.labels("deserialize")
        self.serialize_duration = serialization.labels("serialize")
        self.batch_rows = Histogram(
            "tokensampler_batch_rows", "Rows per backend call (concurrent requests merged by the batcher).", buckets=ROW_BUCKETS, registry=registry,
        )
        rows = Counter("tokensampler_rows_total", "Rows sampled, by sampling mode.", ["mode"], registry=registry)
        self._rows_by_mode = [rows.labels(mode) for mode in ROW_MODES]  # every mode exported from the start
        self.in_flight = Gauge(
            "tokensampler_in_flight_requests", "Calls being served now.", registry=registry,
        )
        self.in_flight.set_function(lambda: self.calls_in_flight)
        # Set by admission.py, which owns the counts.
        self.admitted_calls = Gauge(
            "tokensampler_admitted_calls", "Calls holding a slot of an admission cap now, by pool.", ["pool"],
            registry=registry,
        )
        self.admission_refusals = Counter(
            "tokensampler_admission_refusals_total",
            "Calls refused at once (RESOURCE_EXHAUSTED) because a cap on calls held was reached, by limit.",
            ["limit"], registry=registry,
        )
        self.queue_depth = Gauge(
            "tokensampler_queue_depth", "Validated batches waiting for the backend now (read at scrape time).",
            registry=registry,
        )
        # Set by the registration API of a later version; exported now so dashboards and alerts can rely on them.
        self.registered_weights = Gauge(
            "tokensampler_registered_weights", "LM-head weights registered for hidden-state sampling.",
            registry=registry,
        )
        self.registered_weights_bytes = Gauge(
            "tokensampler_registered_weights_bytes",
            "Bytes the server holds of the registered LM-head weights (those used in place in a region hold none).",
            registry=registry,
        )
        self.registered_regions = Gauge(
            "tokensampler_registered_regions", "Shared-memory regions registered by clients.", registry=registry,
        )
        self.registered_regions_bytes = Gauge(
            "tokensampler_registered_regions_bytes", "Bytes of the registered shared-memory regions.",
            registry=registry,
        )
        self._children: dict[tuple[str, grpc.StatusCode], tuple[Counter, Histogram]] = {}
        registry.register(FALLBACKS)
        registry.register(ProcessCollector(registry=None))
        device_index = _cuda_device_index(backend) if backend is not None else None
        registry.register(_GpuMemory(device_index))
        if backend is not None:
            self._set_build_info(backend, device_index)

    def _set_build_info(self, backend: BackendInfo, device_index: int | None) -> None:
        build_info = Gauge(
            "tokensampler_build_info", "Always 1; the labels say what is running.",
            ["version", "backend", "gpu", "torch", "cuda"], registry=self.registry,
        )
        gpu = torch.cuda.get_device_name(device_index) if device_index is not None else "none"
        build_info.labels(__version__, backend.name, gpu, torch.__version__, torch.version.cuda or "none").set(1)

    def observe_call(self, call: CallRecord, code: grpc.StatusCode, elapsed_ns: int) -> None:
        """Records a finished call; a Sample call that succeeded also records its stages and rows."""
        key = (call.method, code)
        children = self._children.get(key)
        if children is None:  # labels() takes a lock and checks its arguments: once per (method, code)
            children = self._children[key] = (self.requests.labels(call.method, code.name),
                                              self.request_duration.labels(call.method))
        children[0].inc()
        children[1].observe(elapsed_ns / 1e9)
        if code != grpc.StatusCode.OK or (call.batch is None and call.row_modes is None):
            return
        counts = call.row_modes if call.row_modes is not None else count_row_modes(call.batch).tolist()
        for counter, count in zip(self._rows_by_mode, counts):
            if count:
                counter.inc(count)
        self.queue_duration.observe(call.queue_ns / 1e9)
        self.compute_duration.observe(call.compute_ns / 1e9)
        self.deserialize_duration.observe(call.deserialize_ns() / 1e9)

    def observe_call_later(self, call: CallRecord, code: grpc.StatusCode, elapsed_ns: int) -> None:
        """observe_call at the next scrape (or after _MAX_LATER calls): an append on the hot path instead of
        a dozen lock-taking metric updates."""
        if call.batch is not None:  # keep its row counts, not the batch and its tensors, until then
            call.row_modes = tuple(count_row_modes(call.batch).tolist())
            call.batch = None
        self._keep_for_later((call, code, elapsed_ns))

    def observe_serialized_later(self, call: CallRecord, serialize_ns: int) -> None:
        """Records a Sample response's encoding and serialisation, which happen after the call's status is known, at
        the next scrape."""
        if call.batch is not None or call.row_modes is not None:
            self._keep_for_later((call.encode_ns + serialize_ns) / 1e9)

    def _keep_for_later(self, item: tuple[CallRecord, grpc.StatusCode, int] | float) -> None:
        self._later.append(item)
        if len(self._later) >= _MAX_LATER:  # no scrape for a while: a few at a time, never a long pause
            self.flush(_FLUSH_CHUNK)

    def flush(self, most: int | None = None) -> None:
        """Records what observe_call_later and observe_serialized_later kept (all, or the `most` oldest;
        thread-safe: deque pops)."""
        later = self._later
        for _ in range(len(later) if most is None else most):
            try:
                item = later.popleft()
            except IndexError:
                return
            if isinstance(item, float):
                self.serialize_duration.observe(item)
            else:
                self.observe_call(*item)


_TEXT = ("Content-Type", "text/plain; charset=utf-8")
WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def _always() -> bool:
    return True


SCRAPE_INTERVAL_S = 0.1
"""The least time between two collections of /metrics. A render takes 1.5-2.4 ms of the process (2 cores, the CPU
backend) under the GIL that the event loop needs: four clients scraping in a loop (the port has no authentication)
took a Sample's median from 2 ms to 33-35 ms. A scrape waits for the next collection instead, at most this long, and
shares it with the scrapes that arrived before it began: it is never older than the scrape, so a scrape after a call
shows the call."""
_KEPT_BODIES = 16
"""Bodies kept for the scrapes of one collection, by format (text or OpenMetrics, gzipped or not) and the metrics
named (?name[]=): a client that varies them gets its own body made, not an unbounded store."""


def _render(registry: _Collected, encoder: Callable[[_Collected], bytes]) -> bytes:
    """One scrape's body, formatted from a collection."""
    return encoder(registry)


class _Collected:
    """The metric families of one collection, given to prometheus_client's encoders as a registry: all of them, or
    those with samples named (?name[]=, matched as prometheus_client's restricted registry matches them)."""

    def __init__(self, began: float, families: list[Metric], names: frozenset[str] | None = None) -> None:
        self.began = began
        self._families = families
        self._names = names

    def restricted(self, names: frozenset[str]) -> _Collected:
        return _Collected(self.began, self._families, names)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            if self._names is None:
                yield family
                continue
            samples = [sample for sample in family.samples if sample.name in self._names]
            if samples:
                restricted = Metric(family.name, family.documentation, family.type)
                restricted.samples = samples
                yield restricted


class _PacedScrape:
    """The /metrics WSGI app: prometheus_client's, except that a GET is answered from a collection begun after it
    arrived, one collection at a time and SCRAPE_INTERVAL_S apart: the scrapes waiting meanwhile share the next, and
    its bodies, whatever their format or the metrics they name (no scrape waits behind another's collection)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._uncached = make_wsgi_app(registry)  # OPTIONS and other methods: nothing to render
        self._changed = threading.Condition()
        self._latest: _Collected | None = None
        self._collecting = False
        self._formatting = threading.Lock()
        self._bodies: dict[tuple[float, str, bool, frozenset[str] | None], bytes] = {}

    def _collection(self, arrived: float) -> _Collected:
        """The first collection begun at or after `arrived`: the one in progress or the next, or made here."""
        with self._changed:
            while self._latest is None or self._latest.began < arrived:
                if not self._collecting:
                    self._collecting = True
                    break
                self._changed.wait()
            else:
                return self._latest
        latest = None
        try:
            previous = self._latest.began if self._latest is not None else -math.inf
            time.sleep(max(0.0, previous + SCRAPE_INTERVAL_S - time.monotonic()))
            began = time.monotonic()  # the collection's age counts from before it is read
            latest = _Collected(began, list(self._registry.collect()))
            return latest
        finally:  # a collection that failed leaves the next waiter to collect
            with self._changed:
                self._collecting = False
                if latest is not None:
                    self._latest = latest
                self._changed.notify_all()

    def _body(self, encoder: Callable[[_Collected], bytes], content_type: str, gzipped: bool,
              names: frozenset[str] | None) -> bytes:
        collected = self._collection(time.monotonic())
        key = (collected.began, content_type, gzipped, names)
        with self._formatting:
            body = self._bodies.get(key)
            if body is None:
                body = _render(collected if names is None else collected.restricted(names), encoder)
                if gzipped:
                    body = gzip.compress(body)
                if any(kept[0] != collected.began for kept in self._bodies):  # bodies of an older collection
                    self._bodies = {kept: b for kept, b in self._bodies.items() if kept[0] == collected.began}
                if len(self._bodies) < _KEPT_BODIES:
                    self._bodies[key] = body
            return body

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "GET":
            return self._uncached(environ, start_response)
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        gzipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING"))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        body = self._body(encoder, content_type, gzipped, frozenset(names) if names is not None else None)
        headers = [("Content-Type", content_type)] + ([("Content-Encoding", "gzip")] if gzipped else [])
        start_response("200 OK", headers)
        return [body]


def _http_app(registry: CollectorRegistry, ready: Callable[[], bool]) -> WsgiApp:
    """The metrics port's WSGI app: /metrics (_PacedScrape), /healthz (200 while the process answers), /readyz
    (200 while `ready()`, else 503), and 404 for every other path (prometheus_client alone answers every path with
    the metrics, so a probe of any path would pass)."""
    scrape = _PacedScrape(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return scrape(environ, start_response)
        if path == "/healthz":
            status, body = "200 OK", b"ok\n"
        elif path == "/readyz":
            status, body = ("200 OK", b"ready\n") if ready() else ("503 Service Unavailable", b"not ready\n")
        else:
            status, body = "404 Not Found", b"not found: this port serves /metrics, /healthz and /readyz\n"
        start_response(status, [_TEXT, ("Content-Length", str(len(body)))])
        return [body]

    return app


HTTP_TIMEOUT_S = 5.0
"""A connection whose request has not arrived within this is closed: a client that sends its headers slowly
(or never) held a thread and a descriptor for good, and about a thousand of them took every descriptor."""
MAX_HTTP_CONNECTIONS = 64
"""Connections served at once; one more is closed at once (Prometheus and probes need a few)."""


class _RequestDeadlines:
    """Cuts the connections whose request has not arrived by its deadline, from one thread for all of them (a timer
    thread each would double the threads that the connection limit bounds)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: dict[socket.socket, float] = {}
        self._stopped = False
        threading.Thread(target=self._run, name="metrics-http-deadlines", daemon=True).start()

    def add(self, connection: socket.socket, seconds: float) -> None:
        with self._changed:
            self._due[connection] = time.monotonic() + seconds
            self._changed.notify()

    def discard(self, connection: socket.socket) -> None:
        with self._changed:
            self._due.pop(connection, None)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                now = time.monotonic()
                expired = [connection for connection, due in self._due.items() if due <= now]
                for connection in expired:
                    del self._due[connection]
                if not expired:
                    self._changed.wait(min(self._due.values(), default=now + 60.0) - now)
                    continue
            for connection in expired:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns: it ends
                except OSError:
                    pass  # the connection is already gone


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a client that never finishes its request does not hold the process at exit
    request_queue_size = 64  # the listen backlog: socketserver's 5 made connections under load wait for SYN retries

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.deadlines = _RequestDeadlines()  # first: a bind that fails calls server_close
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)

    def server_close(self) -> None:
        self.deadlines.stop()
        super().server_close()

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: socket.socket, client_address: object) -> None:
        """A client that timed out or went away is no error of the server's (socketserver prints a traceback)."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _QuietHandler(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # each read and write of the connection's socket (StreamRequestHandler)
    request_deadline_s = HTTP_TIMEOUT_S
    """The request line and headers arrive within this, or the connection is cut: a client sending a byte every few
    seconds passes every read's timeout, and 64 such clients would hold every slot for good."""

    def setup(self) -> None:
        super().setup()
        self.server.deadlines.add(self.connection, self.request_deadline_s)

    def parse_request(self) -> bool:
        try:
            return super().parse_request()  # reads the headers
        finally:
            self.server.deadlines.discard(self.connection)

    def finish(self) -> None:
        self.server.deadlines.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """No line per request: Prometheus and probes call every few seconds."""


def start_metrics_http(metrics: ServerMetrics, host: str, port: int,
                       ready: Callable[[], bool] = _always) -> WSGIServer | None:
    """Serves /metrics, /healthz and /readyz (_http_app) on daemon threads (port 0: the OS picks; the log
    names it). `ready` is called on the server's threads, once per /readyz request.

    A port that cannot be bound disables metrics with a warning instead of stopping the server:
    sampling matters more than its metrics, and Prometheus shows the target as down.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})  # IPv6 hosts too
        httpd = make_server(address[0], port, _http_app(metrics.registry, ready), server_class,
                            handler_class=_QuietHandler)
    except OSError as err:
        log.warning("metrics disabled: cannot listen on %s:%d (%s)", host, port, err)
        return None
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    bound = httpd.server_address[1]
    log.info("metrics on http://%s:%d/metrics, health on /healthz and /readyz", host, bound,
             extra={"metrics_port": bound})
    return httpd
