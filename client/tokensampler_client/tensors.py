"""Tensor codec shared by client and server: torch/numpy arrays <-> the `Tensor` message.

Elements travel row-major and little-endian in one bytes field; decoding wraps the bytes without
copying them (the tensor is read-only memory owned by the message).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import torch

from ._proto import sampler_pb2 as pb

DTYPE_TO_TORCH: dict[int, torch.dtype] = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_INT64: torch.int64,
    pb.DTYPE_UINT8: torch.uint8,
}
TORCH_TO_DTYPE: dict[torch.dtype, int] = {v: k for k, v in DTYPE_TO_TORCH.items()}
_NUMPY: dict[torch.dtype, type[np.generic]] = {
    torch.float32: np.float32, torch.float16: np.float16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8,
}

# Decoded tensors are read-only views of the message; torch warns about that on every frombuffer call.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("tokensampler's tensor codec assumes a little-endian host")


class TensorDecodeError(ValueError):
    """A Tensor message that does not describe a valid tensor; `field` names the offending part."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def dtype_name(dtype: int) -> str:
    """'float32' for DTYPE_FLOAT32, and so on."""
    return pb.DType.Name(dtype).removeprefix("DTYPE_").lower()


def as_torch(array: Any) -> torch.Tensor:
    """Accepts a torch tensor or anything numpy can view (numpy arrays, nested lists)."""
    if isinstance(array, torch.Tensor):
        return array
    return torch.from_numpy(np.ascontiguousarray(array))


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The row-major little-endian bytes of a CPU tensor (bfloat16 included) as a flat uint8 tensor, sharing the
    tensor's memory where it is contiguous. Flattened first: torch views a dtype as bytes only where the last
    stride is 1, which a contiguous tensor need not have ([B, 1] ids from a transpose have stride (1, B))."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def encode_tensor(array: Any, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encodes a tensor (any device) into a Tensor message, filling `out` when given."""
    tensor = as_torch(array)
    if tensor.dtype not in TORCH_TO_DTYPE:
        supported = ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_DTYPE)
        raise TypeError(f"dtype {tensor.dtype} cannot be sent; expected one of {supported}")
    tensor = tensor.detach().to("cpu").contiguous()
    msg = out if out is not None else pb.Tensor()
    msg.dtype = TORCH_TO_DTYPE[tensor.dtype]
    msg.shape[:] = tensor.shape
    msg.data = raw_bytes(tensor).numpy().tobytes() if tensor.numel() else b""
    return msg


def _checked(msg: pb.Tensor, field: str) -> tuple[torch.dtype, tuple[int, ...], bytes, int]:
    """(dtype, shape, bytes, element count) of a Tensor message, or TensorDecodeError naming `field`."""
    torch_dtype = DTYPE_TO_TORCH.get(msg.dtype)
    if torch_dtype is None:
        names = ", ".join(dtype_name(d) for d in DTYPE_TO_TORCH)
        raise TensorDecodeError(f"{field}.dtype", f"got {msg.dtype}, expected one of {names}")
    shape = tuple(msg.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"{field}.shape", f"got {list(shape)}, expected non-negative sizes")
    itemsize = torch_dtype.itemsize
    count = 1
    for dim in shape:
        count *= dim
    # torch sizes the storage of even an empty tensor from its sizes, zeros aside, in int64.
    if not count and math.prod(dim or 1 for dim in shape) * itemsize >= 2**63:
        raise TensorDecodeError(f"{field}.shape", f"got {list(shape)}, expected sizes whose product (zeros aside) "
                                                  f"times {itemsize} bytes is below 2^63")
    expected = count * itemsize
    data = msg.data  # each read of a bytes field builds a new bytes object: read it once
    if len(data) != expected:
        raise TensorDecodeError(
            f"{field}.data",
            f"got {len(data)} bytes, expected prod(shape {list(shape)}) * {itemsize} = {expected}",
        )
    return torch_dtype, shape, data, count


def check_tensor(msg: pb.Tensor, field: str) -> None:
    """Raises TensorDecodeError naming `field` when the dtype, shape or byte length is invalid (no torch call)."""
    _checked(msg, field)


def decode_tensor(msg: pb.Tensor, field: str = "tensor") -> torch.Tensor:
    """Decodes a Tensor message into a read-only CPU tensor that shares the message's bytes.

    Raises TensorDecodeError naming `field` when the dtype, shape or byte length is invalid.
    """
    torch_dtype, shape, data, count = _checked(msg, field)
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # Few torch calls: a client decodes every response right after waiting idle for it, when each call
    # costs several times what it does in a loop (docs/design/service-path.md).
    return torch.frombuffer(data, dtype=torch_dtype).view(shape)


def decode_owned(msg: pb.Tensor, field: str, dtype: torch.dtype) -> torch.Tensor:
    """decode_tensor converted to `dtype` in memory the caller owns (and may write): one numpy conversion
    where numpy knows both dtypes (not bfloat16), which costs a third of torch's frombuffer + to()."""
    torch_dtype, shape, data, count = _checked(msg, field)
    wire, target = _NUMPY.get(torch_dtype), _NUMPY.get(dtype)
    if wire is None or target is None or count == 0:
        return decode_tensor(msg, field).to(dtype, copy=True)
    return torch.from_numpy(np.frombuffer(data, dtype=wire).astype(target).reshape(shape))
