"""The count of work the CUDA backend hands to a slower path, by reason.

Backends record it and have no handle on a server, so this counter alone is process-wide: every server's metrics
registry exports it (metrics.py). It sits below both, so that neither backends nor metrics import the other for it.
"""

from __future__ import annotations

from prometheus_client import Counter

FALLBACKS = Counter(
    "tokensampler_fallbacks_total",
    "Work the CUDA backend handed to a slower path, by reason.",
    ["reason"],
    registry=None,
)


def record_fallback(reason: str) -> None:
    """Counts one fallback of the CUDA backend to a slower path (docs/metrics.md lists the reasons).

    Call it once per batch that falls back. `reason` is a label value: a short fixed name such as
    "fused_dtype", never text that varies per request (that would explode the series count).
    """
    FALLBACKS.labels(reason).inc()
