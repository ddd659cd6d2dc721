"""Python client of tokensampler, the GPU token-sampling gRPC service.

    from tokensampler_client import SamplerClient
    with SamplerClient("localhost:50051") as client:
        result = client.sample(logits, temperature=0.8, top_k=50)   # logits: [B, V] tensor or numpy array
        result.tokens                                                # int64 [B, 1], a tensor with torch
"""

from importlib import metadata as _metadata

from ._retry import Backoff, RetryThrottle
from .aio import AsyncSamplerClient
from .batching import AsyncBatchingClient, BatchingClient
from .client import SamplerClient
from .errors import TokenSamplerError
from .result import SampleResult, Timings

try:
    __version__ = _metadata.version("tokensampler-client")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncBatchingClient",
    "AsyncSamplerClient",
    "BatchingClient",
    "Backoff",
    "RetryThrottle",
    "SampleResult",
    "SamplerClient",
    "Timings",
    "TokenSamplerError",
    "__version__",
]
