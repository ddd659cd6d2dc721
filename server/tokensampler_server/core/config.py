"""Server settings: what cli.py parses and server.py runs with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class StartupError(ValueError):
    """A setting the server cannot start with (an unreadable token or certificate file, ...)."""


@dataclass(frozen=True)
class Limits:
    """Per-request limits, enforced by validation/sample.py and reported by GetServerInfo."""

    max_batch_rows: int = 4096
    max_batch_elements: int = 4096 * 262144
    """Most elements (B·V of the logits, given or computed from hidden states) in one request, and in one merged
    batch (cpu_max_batch_elements lowers it on the CPU backend when not given)."""
    max_message_bytes: int = 256 * 1024 * 1024
    max_num_samples: int = 64
    samples_are_elements: bool = False
    """Whether each sample of a request counts as a pass over its logits against max_batch_elements (B·V·samples):
    set for the CPU backend, whose cost grows with every sample; the CUDA kernels draw all samples in one pass."""
    max_top_logprobs: int = 64
    max_weight_bytes: int = 16 * 1024**3
    max_token_entries: int = 1 << 25
    """Most token-list entries (id, row) in one request, a list given once for every row counting once per
    row: 2^25 holds 128k-token histories for 256 rows, or a 128k-id allowed list shared by 256 rows (16 bytes
    an entry: 512 MiB). GetServerInfo does not report it: the contract's Limits has no field for it."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    port_file: Path | None = None
    """Where the server writes the port it listens on, once bound: for a health check that cannot see the flags."""
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    vocab_parallel_devices: tuple[int, ...] = ()
    """CUDA devices (the backend's first) that registered heads are split over by vocabulary rows; () for none."""
    limits: Limits = field(default_factory=Limits)
    log_level: str = "INFO"
    grace_period_s: float = 10.0
    """How long in-flight requests may run on after SIGTERM/SIGINT."""
    reflection: bool = True
    max_connection_age_s: float = 0.0
    """Connections close after this long (0: never), so that DNS round-robin clients see new replicas."""
    metrics_port: int | None = 9400
    """Port of the Prometheus /metrics endpoint on `host`: 0 lets the OS choose, None turns metrics off."""
    log_format: str = "text"
    """"text" or "json" (one JSON object per line)."""
    uds: str | None = None
    """Also listen on this Unix domain socket path."""
    weights_dir: Path | None = None
    """Where RegisterWeightsFromFile may read safetensors files; None turns that RPC off."""
    max_queue_delay_us: int = 0
    """How long a request may wait for others to batch with while the backend is idle."""
    max_queue_rows: int = 32768
    """Rows waiting for the backend beyond which requests get RESOURCE_EXHAUSTED (in each queue: the dynamic
    batcher's and the native path's)."""
    max_queue_bytes: int = 2 << 30
    """Bytes of request tensors waiting for the backend beyond which requests get RESOURCE_EXHAUSTED."""
    max_concurrent_rpcs: int = 1024
    """Calls of the Sampler service and reflection (a stream counts as one until it ends) the server holds at
    once; past it new ones get RESOURCE_EXHAUSTED, marked retryable (0: no limit). Counted after authentication
    (admission.py). This bounds what waits ahead of the native path, which with no queue delay answers each
    request as it arrives, ahead of any queue."""
    max_health_watchers: int = 64
    """Health Watch streams held at once, in a pool of their own (0: no limit). One per watching load balancer
    or client channel: a replica has a few dozen watchers at most, and the pool keeps the open health
    service from taking the slots of the Sampler's calls."""
    max_uploads: int = 8
    """RegisterWeights uploads held at once, in a pool of their own (0: no limit). An upload waits on its client
    between chunks for as long as it keeps sending (each chunk restarts its idle timer), so uploads that trickle a
    byte now and then held --max-concurrent-rpcs' every slot; in their own pool they can hold only each other's.
    Weights are registered rarely, and uploads are bounded in bytes together by --max-weight-mb."""
    max_calls_per_client: int = 256
    """Calls one client (its accepted bearer token, else its connection) holds at once (0: no limit): a quarter of
    max_concurrent_rpcs, so that one client alone cannot take every slot from the others."""
    reclaim_idle_calls_s: float = 1.0
    """How long a call must have waited on its client (a stream for its next message, every earlier one answered; any
    call for its client to take an answer sent to it) before a new call may take its slot at the max_concurrent_rpcs
    cap, ending it (0: never; admission.py). An engine's stream between two steps waits far less; a call left waiting
    for a second while others are refused gives way."""
    max_elements_given: bool = True
    """limits.max_batch_elements was set by the operator; when not, the CPU backend sizes it (cpu_max_batch_elements)."""
    max_regions: int = 256
    """Regions registered at once (each shared-memory region holds a file descriptor); past it RESOURCE_EXHAUSTED."""
    max_weights: int = 64
    """Weights registered at once; past it RESOURCE_EXHAUSTED."""
    max_weights_bytes: int | None = None
    """Bytes the registered weights may hold together, registrations in progress included (weights used in place in
    a CUDA region hold none); past it RESOURCE_EXHAUSTED. None: half the backend device's memory."""
    unregister_timeout_s: float = 60.0
    """How long an unregister waits for the requests using the weight or region before it gives up and leaves
    it registered (FAILED_PRECONDITION)."""
    gpu_memory_fraction: float | None = None
    """Cap on the share of the GPU's memory this process's allocator may take (None: no cap)."""
    allow_shm: bool = False
    """Accept POSIX shared-memory regions from colocated clients."""
    allow_cuda_ipc: bool = False
    """Accept CUDA IPC regions (GPU buffers of colocated processes)."""
    native_path: bool = True
    """On the CUDA backend, answer plain Sample requests (logits in a CUDA region or carried, tokens alone)
    in C++ (native_path.py)."""
    auth_token_file: Path | None = None
    """File of accepted bearer tokens, one per line; None admits every caller."""
    tls_cert: Path | None = None
    """PEM certificate chain of the server; with tls_key, the TCP port speaks TLS only."""
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    """PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector URL (http:// plaintext, https:// TLS) that gets a span per call; None: no tracing."""


# The CPU reference spends ~30 bytes of working memory per logits element (top-k + top-p, 64 x 151936 on 2 cores:
# 1.24 s, peak RSS +300 MiB) and 31-181 ns (1024 x 65536 fp16 on 2 cores: top-k 2.1 s, plain 5.8 s, top-p 9.9 s,
# top-p with processed log-probs 12.2 s): 2^26 elements is at most ~12 s of work.
_CPU_MAX_BATCH_ELEMENTS = 1 << 26
_CPU_BYTES_PER_ELEMENT = 64


def cpu_max_batch_elements(memory_bytes: int) -> int:
    """The CPU backend's element limit: bounded in time, and in memory to 1/64 of the machine's per element."""
    return max(1, min(_CPU_MAX_BATCH_ELEMENTS, memory_bytes // _CPU_BYTES_PER_ELEMENT))
