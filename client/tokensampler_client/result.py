"""The client-side result of a Sample call, decoded from `SampleResponse`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ._proto import sampler_pb2 as pb
from .tensors import ARRAY_TYPES, Array, bool_array, check_tensor, decode_owned


@dataclass(frozen=True)
class Timings:
    """Server-side time spent on the request, in nanoseconds."""

    queue_ns: int
    compute_ns: int
    total_ns: int

    @classmethod
    def from_message(cls, message: pb.Timings) -> Timings:
        return cls(message.queue_ns, message.compute_ns, message.total_ns)


def _summary(value: Any) -> str:
    """A field as repr shows it: an array by dtype and shape (a [B, V]-sized print helps no one), a list by
    its length."""
    if isinstance(value, ARRAY_TYPES):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, list):
        return f"list[{len(value)}]"
    return repr(value)


class ReadableRepr:
    """repr of a result dataclass (declared with repr=False): the public class's name and each field, arrays
    by dtype and shape."""

    def __repr__(self) -> str:
        public = next(cls for cls in type(self).__mro__ if not cls.__name__.startswith("_"))
        shown = ", ".join(f"{field.name}={_summary(getattr(self, field.name))}" for field in fields(self))
        return f"{public.__name__}({shown})"


@dataclass(repr=False)
class SampleResult(ReadableRepr):
    """Sampled tokens of a [B, V] batch, with n = num_samples and N = top_logprobs. Arrays are torch tensors where
    torch is installed, else numpy arrays.

    Attributes:
        tokens: int64 [B, n]; -1 in rows that are not valid. None when they went to an output region.
        seeds: the Philox seed each row used (B Python ints, uint64): pass them back as `seed` to
            reproduce the sample.
        logprobs: float32 [B, n], the log-prob of each sampled token (None unless return_logprobs).
        top_logprob_ids: int64 [B, N], best first (None unless top_logprobs > 0).
        top_logprobs: float32 [B, N], matching top_logprob_ids (None unless top_logprobs > 0).
        valid: bool [B]; False where no finite logit remained after processing.
        nan_detected: bool [B]; True where a NaN or +inf logit remained after the masks, bias and penalties.
        timings: the server's queue, compute and total time.
        request_id: the request id the server logged the call under.
    """

    tokens: Array | None
    seeds: list[int]
    logprobs: Array | None
    top_logprob_ids: Array | None
    top_logprobs: Array | None
    valid: Array
    nan_detected: Array
    timings: Timings
    request_id: str

    @classmethod
    def from_response(cls, response: pb.SampleResponse) -> SampleResult:
        """The result a SampleResponse holds, each field decoded when first read; a malformed tensor raises
        tensors.TensorDecodeError here."""
        return _DecodedOnRead(response)

    def rows(self, start: int, stop: int) -> SampleResult:
        """The result of rows start..stop-1 alone (batch invariance makes it their own result)."""
        def part(tensor: Array | None) -> Array | None:
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


def _tensor(field: str, dtype: type[np.generic]) -> Callable[[pb.SampleResponse], Array | None]:
    def decode(response: pb.SampleResponse) -> Array | None:
        return decode_owned(getattr(response, field), field, dtype) if response.HasField(field) else None

    return decode


_TENSOR_DTYPES = {"tokens": np.int64, "logprobs": np.float32, "top_logprob_ids": np.int64,
                  "top_logprobs": np.float32}
_DECODERS: dict[str, Callable[[pb.SampleResponse], Any]] = {
    **{field: _tensor(field, dtype) for field, dtype in _TENSOR_DTYPES.items()},
    "seeds": lambda response: list(response.seeds),
    "valid": lambda response: bool_array(response.valid),
    "nan_detected": lambda response: bool_array(response.nan_detected),
    "timings": lambda response: Timings.from_message(response.timings),
    "request_id": lambda response: response.request_id,
}


class _DecodedOnRead(SampleResult):
    """A SampleResult that decodes each field from its response when the field is first read. A decode loop
    reads the tokens and seldom the rest, and right after a client has waited idle for the answer each torch
    call costs 40-70 µs (docs/design/service-path.md): decoding every field took ~130 µs a call at B = 64."""

    def __init__(self, response: pb.SampleResponse) -> None:
        # Not the dataclass __init__: no field is set until it is read.
        for field in _TENSOR_DTYPES:
            if response.HasField(field):
                check_tensor(getattr(response, field), field)
        self._response = response

    def __getattr__(self, name: str) -> Any:
        """Called for a field not read yet (Python looks here only when the instance lacks the attribute)."""
        decode = _DECODERS.get(name)
        if decode is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = decode(self._response)
        setattr(self, name, value)
        return value
