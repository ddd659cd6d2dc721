"""What the layers serving one call learn about it, gathered for its metrics and its log line.

call_guard.py opens a record per call, times the protobuf parse and serialisation, and makes the
record visible through `current_call`; the servicer fills in the sampling stages. The guard then
reports the call once, when its status is known.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import grpc

from tokensampler_server.model.sampling import SamplingBatch


@dataclass
class CallRecord:
    method: str
    """The full method name without the leading slash, e.g. tokensampler.v1.Sampler/Sample."""
    request_id: str
    started_ns: int = 0
    """When the server started on the call: the start of the first request message's parse; 0 until then."""
    parse_ns: int = 0
    """Request bytes to request messages (protobuf), the wait for a parse thread included (parse_wait_ns)."""
    parse_wait_ns: int = 0
    """Of parse_ns, the wait for one of the server's parse threads (rpc/parsing.py, Parses.parse's `timed`): time
    the call queued behind other large parses, not time spent parsing."""
    batch: SamplingBatch | None = None
    """The validated batch of a Sample call; None for other methods and rejected requests."""
    row_modes: tuple[int, ...] | None = None
    """Rows per mode (metrics.ROW_MODES order) of a Sample call without a batch: answered natively, or
    recorded later (metrics.observe_call_later keeps the counts, not the batch)."""
    decode_ns: int = 0
    """Request message to validated batch: validation and tensor decoding."""
    queue_ns: int = 0
    compute_ns: int = 0
    encode_ns: int = 0
    """Sampling result to response message."""

    def start(self) -> None:
        """Marks the call started, unless it already is."""
        if not self.started_ns:
            self.started_ns = time.perf_counter_ns()

    def elapsed_ns(self) -> int:
        return time.perf_counter_ns() - self.started_ns

    def deserialize_ns(self) -> int:
        """The deserialize stage: the parse and the decoding, without the wait for a parse thread."""
        return self.parse_ns - self.parse_wait_ns + self.decode_ns

    @property
    def num_rows(self) -> int | None:
        """Rows the call sampled; None when it sampled none."""
        if self.batch is not None:
            return self.batch.num_rows
        return sum(self.row_modes) if self.row_modes is not None else None


# Set by the call guard for every call it wraps, read by the servicer (and by the guard's serialiser).
current_call: ContextVar[CallRecord] = ContextVar("current_call")

MessageTracer = Callable[[CallRecord, grpc.StatusCode, int], None]
# With tracing on, set by the call guard for a call with streamed responses: gives one of its messages, answered
# with (code, elapsed ns), a span of its own under the stream's caller (each message is a request of its own).
current_message_tracer: ContextVar[MessageTracer | None] = ContextVar("current_message_tracer", default=None)
