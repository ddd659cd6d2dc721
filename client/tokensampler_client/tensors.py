"""Tensor codec shared by client and server: arrays <-> the `Tensor` message.

Arrays are torch tensors where torch is installed (the server; the client with its `torch` extra) and numpy
arrays otherwise: each function takes what numpy can view (and torch tensors, with torch) and gives back the
array type of the installation. Elements travel row-major and little-endian in one bytes field; decoding wraps
the bytes without copying them (the array is read-only memory owned by the message), but for bfloat16 without
torch: numpy has no such type, so those decode to float32 (exactly: bfloat16 is float32's upper half).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ._proto import sampler_pb2 as pb
from ._torch import TORCH_EXTRA, torch

if TYPE_CHECKING:
    import torch as _torch_types

Array = Union["_torch_types.Tensor", np.ndarray]
"""A torch tensor with torch, else a numpy array."""

ITEMSIZE: dict[int, int] = {
    pb.DTYPE_FLOAT32: 4, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT16: 2, pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8,
    pb.DTYPE_UINT8: 1,
}
DTYPE_TO_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_FLOAT16: np.dtype("<f2"), pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"), pb.DTYPE_UINT8: np.dtype("u1"),
}
_NUMPY_TO_DTYPE = {v: k for k, v in DTYPE_TO_NUMPY.items()}
DTYPE_TO_TORCH: dict[int, Any] = {} if torch is None else {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_INT64: torch.int64,
    pb.DTYPE_UINT8: torch.uint8,
}
TORCH_TO_DTYPE: dict[Any, int] = {v: k for k, v in DTYPE_TO_TORCH.items()}
ARRAY_TYPES: tuple[type, ...] = (np.ndarray,) if torch is None else (torch.Tensor, np.ndarray)

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
    """'float32' for DTYPE_FLOAT32, and so on ('unspecified' for a tensor whose dtype is not set; the number for a
    value that is no DType)."""
    try:
        return pb.DType.Name(dtype).removeprefix("DTYPE_").lower()
    except ValueError:
        return f"{dtype} (no such dtype)"


def wire_dtype(dtype: Any) -> int | None:
    """The DType of a torch dtype, or of a numpy dtype or anything naming one (np.float32, "int64"); None for
    a dtype the wire cannot carry."""
    if torch is not None and isinstance(dtype, torch.dtype):
        return TORCH_TO_DTYPE.get(dtype)
    try:
        return _NUMPY_TO_DTYPE.get(np.dtype(dtype))
    except TypeError:
        return None


def as_array(array: Any) -> Array:
    """A torch tensor as it is; anything numpy can view (numpy arrays, nested lists) as a torch tensor where
    torch is installed, else as a numpy array."""
    if torch is None:
        return np.asarray(array)
    if isinstance(array, torch.Tensor):
        return array
    return torch.from_numpy(np.ascontiguousarray(array))


def host_contiguous(array: Array) -> Array:
    """The array in contiguous host memory: itself where it already is, else a copy (from any device)."""
    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array)
    return array.detach().to("cpu").contiguous()


def cast(array: Array, dtype: Any) -> Array:
    """The array as `dtype` (a numpy dtype or a name of one): itself where it already is, else a copy."""
    if isinstance(array, np.ndarray):
        return array.astype(dtype, copy=False)
    return array.to(DTYPE_TO_TORCH[_NUMPY_TO_DTYPE[np.dtype(dtype)]])


def host_bytes(array: Array) -> np.ndarray:
    """The row-major little-endian bytes of a host array (bfloat16 tensors included) as a flat uint8 numpy array,
    sharing the array's memory where it is contiguous. Flattened first: torch views a dtype as bytes only where
    the last stride is 1, which a contiguous tensor need not have ([B, 1] ids from a transpose have stride (1, B))."""
    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return array.contiguous().reshape(-1).view(torch.uint8).numpy()


def bool_array(values: Sequence[bool]) -> Array:
    """A repeated bool field as a bool array the caller owns (one copy into a bytearray, no list)."""
    if torch is None:
        return np.frombuffer(bytearray(values), dtype=np.bool_)
    return torch.frombuffer(bytearray(values), dtype=torch.bool) if len(values) else torch.zeros(0, dtype=torch.bool)


def encode_tensor(array: Any, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encodes an array (a tensor on any device) into a Tensor message, filling `out` when given."""
    tensor = as_array(array)
    dtype = wire_dtype(tensor.dtype)
    if dtype is None:
        sendable = DTYPE_TO_TORCH if torch is not None else DTYPE_TO_NUMPY
        supported = ", ".join(dtype_name(d) for d in sendable)
        hint = "" if torch is not None else f" (bfloat16 with torch: {TORCH_EXTRA})"
        raise TypeError(f"dtype {tensor.dtype} cannot be sent; expected one of {supported}{hint}")
    tensor = host_contiguous(tensor)
    msg = out if out is not None else pb.Tensor()
    msg.dtype = dtype
    msg.shape[:] = tensor.shape
    msg.data = host_bytes(tensor).tobytes() if math.prod(tensor.shape) else b""
    return msg


def _checked(msg: pb.Tensor, field: str) -> tuple[int, tuple[int, ...], bytes, int]:
    """(DType, shape, bytes, element count) of a Tensor message, or TensorDecodeError naming `field`."""
    itemsize = ITEMSIZE.get(msg.dtype)
    if itemsize is None:
        names = ", ".join(dtype_name(d) for d in ITEMSIZE)
        raise TensorDecodeError(f"{field}.dtype", f"got {msg.dtype}, expected one of {names}")
    shape = tuple(msg.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"{field}.shape", f"got {list(shape)}, expected non-negative sizes")
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
    return msg.dtype, shape, data, count


def check_tensor(msg: pb.Tensor, field: str) -> None:
    """Raises TensorDecodeError naming `field` when the dtype, shape or byte length is invalid (no torch call)."""
    _checked(msg, field)


def _numpy_view(dtype: int, data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The message's bytes as a numpy array; bfloat16, which numpy lacks, widened exactly to float32."""
    if dtype == pb.DTYPE_BFLOAT16:
        return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view(np.float32).reshape(shape)
    return np.frombuffer(data, dtype=DTYPE_TO_NUMPY[dtype]).reshape(shape)


def decode_tensor(msg: pb.Tensor, field: str = "tensor") -> Array:
    """Decodes a Tensor message into a read-only host array that shares the message's bytes.

    Raises TensorDecodeError naming `field` when the dtype, shape or byte length is invalid.
    """
    dtype, shape, data, count = _checked(msg, field)
    if torch is None:
        return _numpy_view(dtype, data, shape)
    torch_dtype = DTYPE_TO_TORCH[dtype]
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # Few torch calls: a client decodes every response right after waiting idle for it, when each call
    # costs several times what it does in a loop (docs/design/service-path.md).
    return torch.frombuffer(data, dtype=torch_dtype).view(shape)


def decode_owned(msg: pb.Tensor, field: str, dtype: Any) -> Array:
    """decode_tensor converted to `dtype` (torch or numpy) in memory the caller owns (and may write): one numpy
    conversion where numpy knows both dtypes (not bfloat16), which costs a third of torch's frombuffer + to()."""
    wire, shape, data, count = _checked(msg, field)
    target = wire_dtype(dtype)
    if torch is None:
        return _numpy_view(wire, data, shape).astype(DTYPE_TO_NUMPY[target])
    source_numpy, target_numpy = DTYPE_TO_NUMPY.get(wire), DTYPE_TO_NUMPY.get(target)
    if source_numpy is None or target_numpy is None or count == 0:
        return decode_tensor(msg, field).to(DTYPE_TO_TORCH[target], copy=True)
    return torch.from_numpy(np.frombuffer(data, dtype=source_numpy).astype(target_numpy).reshape(shape))
