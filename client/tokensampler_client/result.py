"""The client-side result of a Sample call, decoded from `SampleResponse`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._proto import sampler_pb2 as pb
from .tensors import decode_owned


@dataclass(frozen=True)
class Timings:
    """Server-side time spent on the request, in nanoseconds."""

    queue_ns: int
    compute_ns: int
    total_ns: int


def _flags(values: Sequence[bool]) -> torch.Tensor:
    """A repeated bool field as a bool tensor the caller owns (one copy into a bytearray, no list)."""
    return torch.frombuffer(bytearray(values), dtype=torch.bool) if len(values) else torch.zeros(0, dtype=torch.bool)


@dataclass
class SampleResult:
    """Sampled tokens of a [B, V] batch, with n = num_samples and N = top_logprobs.

    Attributes:
        tokens: int64 [B, n]; -1 in rows that are not valid. None when they went to an output region.
        seeds: the Philox seed each row used (B Python ints, uint64): pass them back as `seed` to
            reproduce the sample.
        logprobs: float32 [B, n], the log-prob of each sampled token (None unless return_logprobs).
        top_logprob_ids: int64 [B, N], best first (None unless top_logprobs > 0).
        top_logprobs: float32 [B, N], matching top_logprob_ids (None unless top_logprobs > 0).
        valid: bool [B]; False where no finite logit remained after processing.
        nan_detected: bool [B]; True where the row's logits held NaN or +inf.
        timings: the server's queue, compute and total time.
        request_id: the request id the server logged the call under.
    """

    tokens: torch.Tensor | None
    seeds: list[int]
    logprobs: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    valid: torch.Tensor
    nan_detected: torch.Tensor
    timings: Timings
    request_id: str

    @classmethod
    def from_response(cls, response: pb.SampleResponse) -> SampleResult:
        """Decodes a SampleResponse; raises tensors.TensorDecodeError on a malformed tensor."""
        has = response.HasField
        timings = response.timings
        return cls(
            tokens=decode_owned(response.tokens, "tokens", torch.int64) if has("tokens") else None,
            seeds=list(response.seeds),
            logprobs=decode_owned(response.logprobs, "logprobs", torch.float32) if has("logprobs") else None,
            top_logprob_ids=(decode_owned(response.top_logprob_ids, "top_logprob_ids", torch.int64)
                             if has("top_logprob_ids") else None),
            top_logprobs=decode_owned(response.top_logprobs, "top_logprobs", torch.float32) if has("top_logprobs") else None,
            valid=_flags(response.valid),
            nan_detected=_flags(response.nan_detected),
            timings=Timings(timings.queue_ns, timings.compute_ns, timings.total_ns),
            request_id=response.request_id,
        )

    def rows(self, start: int, stop: int) -> SampleResult:
        """The result of rows start..stop-1 alone (batch invariance makes it their own result)."""
        def part(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[start:stop]

        return SampleResult(
            tokens=part(self.tokens),
            seeds=self.seeds[start:stop],
            logprobs=part(self.logprobs),
            top_logprob_ids=part(self.top_logprob_ids),
            top_logprobs=part(self.top_logprobs),
            valid=self.valid[start:stop],
            nan_detected=self.nan_detected[start:stop],
            timings=self.timings,
            request_id=self.request_id,
        )
