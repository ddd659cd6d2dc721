"""Messages of the weight RPCs: chunked uploads of an LM head and its options."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import numpy as np

from ._proto import sampler_pb2 as pb
from .params import _set_scalar
from .regions import RegionView
from .tensors import as_array, cast, encode_tensor

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

Progress = Callable[[int, int], None]
"""Called as progress(bytes_sent, total_bytes) after each chunk."""


class HeadOptions(TypedDict, total=False):
    """The keywords of weight_options, which every call that registers an LM head takes."""

    vocab_size: int | None
    bias: Any
    soft_cap: float | None
    logit_scale: float | None


def weight_options(
    *, vocab_size: int | None = None, bias: Any = None, soft_cap: float | None = None, logit_scale: float | None = None
) -> pb.WeightOptions:
    """How the server finishes the logits: x = cap·tanh(((W·h + bias)·logit_scale)/cap), rows >= vocab_size dropped."""
    options = pb.WeightOptions()
    for name, value in (("vocab_size", vocab_size), ("soft_cap", soft_cap), ("logit_scale", logit_scale)):
        if value is not None:
            _set_scalar(options, name, value)
    if bias is not None:
        encode_tensor(cast(as_array(bias), np.float32), out=options.bias)
    return options


def region_weights_request(name: str, weight: RegionView, options: pb.WeightOptions) -> pb.RegisterWeightsFromRegionRequest:
    """The request that registers the LM head W [V, D] lying at `weight` in a registered region."""
    if not isinstance(weight, RegionView) or len(weight.shape) != 2:
        raise ValueError(f"weight: expected the RegionView of W [V, D] (region.view_of(lm_head_weight)), got {weight!r}")
    return pb.RegisterWeightsFromRegionRequest(name=name, weight=weight.ref(), options=options)


class WeightUpload:
    """The chunks of one upload; iterable again for each retry. The SHA-256 rides in the last chunk."""

    def __init__(
        self,
        name: str,
        weight: Any,
        options: pb.WeightOptions,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> None:
        tensor = as_array(weight)
        if tensor.ndim != 2:
            raise ValueError(f"weight: expected shape [V, D], got {list(tensor.shape)}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
        self._header = pb.RegisterWeightsChunk(name=name, options=options)
        encoded = encode_tensor(tensor)  # dtype checked here; one CPU copy of the bytes
        self._header.dtype = encoded.dtype
        self._header.shape[:] = encoded.shape
        self._data = encoded.data
        self._chunk_bytes = chunk_bytes
        self._progress = progress

    def __iter__(self) -> Iterator[pb.RegisterWeightsChunk]:
        total = len(self._data)
        digest = hashlib.sha256()
        view = memoryview(self._data)
        offset = 0
        first = True
        while first or offset < total:
            chunk = pb.RegisterWeightsChunk()
            if first:
                chunk.CopyFrom(self._header)
                first = False
            piece = view[offset : offset + self._chunk_bytes]
            digest.update(piece)
            chunk.data = bytes(piece)
            offset += len(piece)
            if offset >= total:
                chunk.sha256 = digest.hexdigest()
            yield chunk
            if self._progress is not None:
                self._progress(offset, total)
