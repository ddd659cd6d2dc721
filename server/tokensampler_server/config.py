"""Server settings: what cli.py parses and server.py runs with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class StartupError(ValueError):
    """A setting the server cannot start with (an unreadable token or certificate file, ...)."""


@dataclass(frozen=True)
class Limits:
    """Per-request limits, enforced by validation.py and reported by GetServerInfo."""

    max_batch_rows: int = 4096
    max_batch_elements: int = 4096 * 262144
    """Most elements (B·V of the logits, given or computed from hidden states) in one request."""
    max_message_bytes: int = 256 * 1024 * 1024
    max_num_samples: int = 64
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
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
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
    """Calls (a stream counts as one) the server holds at once; past it grpc refuses new ones with
    RESOURCE_EXHAUSTED (0: no limit). This bounds what waits ahead of the native path, which with no queue
    delay answers each request as it arrives, ahead of any queue."""
    gpu_memory_fraction: float | None = None
    """Cap on the share of the GPU's memory this process's allocator may take (None: no cap)."""
    allow_shm: bool = False
    """Accept POSIX shared-memory regions from colocated clients."""
    allow_cuda_ipc: bool = False
    """Accept CUDA IPC regions (GPU buffers of colocated processes)."""
    native_request_path: bool = True
    """On the CUDA backend, answer plain Sample requests (logits in a CUDA region or carried, tokens alone)
    in C++ (native_path.py)."""
    auth_token_file: Path | None = None
    """File of accepted bearer tokens, one per line; None admits every caller."""
    tls_cert: Path | None = None
    """PEM certificate chain of the server; with tls_key, the TCP port speaks TLS only."""
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    """PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."""
