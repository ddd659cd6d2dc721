"""Weight files of --weights-dir: opened without following links, and one safetensors tensor read from the open file.

The file is opened once, one path component at a time from the directory's descriptor with O_NOFOLLOW, and every
later read goes through that descriptor: a name checked and then opened again could be swapped for a link to a file
outside the directory, or for a FIFO whose open blocks the process, in between. The tensor is read into the server's
own memory, not mapped: a mapped file truncated while the server copies it faults the process (SIGBUS), a read only
comes up short. The safetensors library opens files by name and maps them, so the header (8 bytes of length, then
JSON) is read here; the format holds no code.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from tokensampler_server.core.errors import InvalidArgument, ServiceError, quoted
from tokensampler_server.resources.host_memory import host_bytes
from tokensampler_server.resources.weights import check_weight_shape

__all__ = ["MAX_HEADER_BYTES", "open_weights_file", "read_safetensor"]

MAX_HEADER_BYTES = 16 << 20
"""A safetensors header of 16 MiB lists ~200,000 tensors (a model shard's lists a few hundred, in ~100 KiB); parsing
one costs ~0.2 s, holding Python's interpreter lock."""
_PATH_MAX = 4096  # Linux's, for a whole path
_READ_BYTES = 64 << 20  # one read call at most: the interpreter lock is free while it runs
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _file_error(err: OSError, relative: str) -> ServiceError:
    """The status of a file-system error on the weight file `relative` (what the server may say of it: never a path
    of its own)."""
    if err.errno == errno.ENAMETOOLONG:
        return InvalidArgument("path", f"got a path of {len(relative)} characters that the file system finds too long, "
                                       "expected shorter names")
    if err.errno == errno.ELOOP:
        return ServiceError(f"path: {quoted(relative)} goes through a symbolic link, which is refused",
                            grpc.StatusCode.PERMISSION_DENIED)
    if err.errno in (errno.EACCES, errno.EPERM):
        return ServiceError(f"path: the server may not read {quoted(relative)}", grpc.StatusCode.PERMISSION_DENIED)
    if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENODEV, errno.ENXIO):
        return ServiceError(f"path: {quoted(relative)} is not a file inside --weights-dir", grpc.StatusCode.NOT_FOUND)
    return ServiceError(f"path: the server could not read {quoted(relative)}: {os.strerror(err.errno or 0)}",
                        grpc.StatusCode.FAILED_PRECONDITION)


def open_weights_file(weights_dir: Path | None, relative: str) -> int:
    """A read-only descriptor of the regular file `relative` inside weights_dir, which the caller closes.
    PERMISSION_DENIED for a path that leaves the directory or goes through a link, NOT_FOUND for what is not a
    regular file there (a directory, a FIFO, a device), FAILED_PRECONDITION when the server has no --weights-dir."""
    if weights_dir is None:
        raise ServiceError("path: loading weights from server files is off (start the server with --weights-dir)",
                           grpc.StatusCode.FAILED_PRECONDITION)
    if "\0" in relative:
        raise InvalidArgument("path", f"got {quoted(relative)}, expected a path without NUL characters")
    if len(os.fsencode(relative)) >= _PATH_MAX:  # opened a component at a time, no call would say ENAMETOOLONG
        raise _file_error(OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG)), relative)
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:  # "" and "." have no parts
        raise ServiceError(f"path: got {quoted(relative)}, expected a relative path inside --weights-dir without '..'",
                           grpc.StatusCode.PERMISSION_DENIED)
    try:
        directory = os.open(weights_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's: may be a link
    except OSError as err:
        raise ServiceError(f"path: the server's --weights-dir cannot be opened ({os.strerror(err.errno or 0)})",
                           grpc.StatusCode.FAILED_PRECONDITION) from None
    try:
        for part in parts[:-1]:
            inner = _open_directory(part, directory)
            os.close(directory)
            directory = inner
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer (and with it the process).
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    except OSError as err:
        raise _file_error(err, relative) from None
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ServiceError(f"path: {quoted(relative)} is not a regular file inside --weights-dir",
                           grpc.StatusCode.NOT_FOUND)
    return fd


def _open_directory(name: str, parent: int) -> int:
    """Directory `name` of `parent`, not through a link (O_DIRECTORY with O_NOFOLLOW says ENOTDIR for a link to a
    directory: told apart here, so that a link is refused as a link)."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except NotADirectoryError:
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP)) from None
        raise


def read_safetensor(fd: int, relative: str, tensor: str, max_bytes: int,
                    claim: Callable[[int], None] = lambda nbytes: None) -> torch.Tensor:
    """Tensor `tensor` of the safetensors file open at `fd` (named `relative` in messages), read into memory: a
    float32, bfloat16 or float16 tensor [V, D] of at most max_bytes. INVALID_ARGUMENT for a file that is not
    safetensors or a tensor of another dtype, rank or size, NOT_FOUND for a tensor it does not hold,
    FAILED_PRECONDITION for a file that changed while it was read. `claim` is given the tensor's bytes before they
    are allocated (and may refuse them)."""
    try:
        size = os.fstat(fd).st_size
        header_bytes = _header_length(fd, relative, size)
        header = _header(os.pread(fd, header_bytes, 8), relative)
        entry = header.get(tensor)
        if tensor == "__metadata__" or entry is None:
            names = sorted(name for name in header if name != "__metadata__")
            raise ServiceError(f"tensor: {quoted(tensor)} is not in {relative} (it has {names[:8]})",
                               grpc.StatusCode.NOT_FOUND)
        if not isinstance(entry, dict):
            raise InvalidArgument("path",
                                  f"could not read {relative} as safetensors: a malformed entry for {quoted(tensor)}")
        dtype, shape, begin, end = _entry(entry, relative, tensor)
        data_end = _check_layout(header, relative)
        trailing = size - 8 - header_bytes - data_end
        if trailing > 0:
            raise InvalidArgument("path", f"could not read {relative} as safetensors: {trailing} bytes past its "
                                          "tensors' data (data_offsets must cover the data)")
        nbytes = end - begin
        if nbytes > max_bytes:
            raise InvalidArgument("tensor", f"{quoted(tensor)} is larger than {max_bytes} bytes")
        if 8 + header_bytes + end > size:
            raise InvalidArgument("path", f"could not read {relative} as safetensors: {quoted(tensor)} ends past "
                                          "the file")
        claim(nbytes)
        data = host_bytes(nbytes, f"tensor: {quoted(tensor)} of {relative}")
        _read_into(fd, memoryview(data.numpy()), 8 + header_bytes + begin, relative)
    except MemoryError:  # the header's reads (host_bytes answers for the tensor's own bytes)
        raise ServiceError(f"tensor: the server has no memory to read {quoted(tensor)} of {relative}",
                           grpc.StatusCode.RESOURCE_EXHAUSTED) from None
    except OSError as err:
        raise _file_error(err, relative) from None
    return data.view(dtype).reshape(shape)


def _header_length(fd: int, relative: str, size: int) -> int:
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise InvalidArgument("path", f"could not read {relative} as safetensors: {len(prefix)} bytes, no header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:  # the length is not quoted: of a file that is not safetensors, it is its first bytes
        raise InvalidArgument("path", f"could not read {relative} as safetensors: its header length is past "
                                      f"{MAX_HEADER_BYTES} bytes (or it is not a safetensors file)")
    if 8 + length > size:
        raise InvalidArgument("path", f"could not read {relative} as safetensors: its header runs past the file")
    return length


def _header(raw: bytes, relative: str) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))  # the format's encoding (json.loads would take UTF-16 too)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise InvalidArgument("path", f"could not read {relative} as safetensors: a header that is not JSON "
                                      f"({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise InvalidArgument("path", f"could not read {relative} as safetensors: a header that is not an object")
    return header


def _check_layout(header: dict, relative: str) -> int:
    """The format's own rule, as its library holds files to it: the tensors' data_offsets tile the data from byte 0,
    in order, with no overlap and no hole (a file whose tensors share bytes is not safetensors, whichever is read).
    Returns where the data ends, which is the file's end."""
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise InvalidArgument("path", f"could not read {relative} as safetensors: a malformed entry for "
                                          f"{quoted(name)}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort(key=lambda span: span[:2])
    end, previous = 0, None
    for begin, stop, name in spans:
        if begin != end:
            what = (f"overlaps {quoted(previous)}" if begin < end
                    else f"begins {begin - end} bytes past the data before it")
            raise InvalidArgument("path", f"could not read {relative} as safetensors: the data of {quoted(name)} "
                                          f"{what} (data_offsets must tile the data)")
        end, previous = stop, name
    return end


def _entry(entry: dict, relative: str, tensor: str) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of a header entry, checked against each other."""
    shape, offsets, name = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
    if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] or not isinstance(name, str)):
        raise InvalidArgument("path", f"could not read {relative} as safetensors: a malformed entry for "
                                      f"{quoted(tensor)}")
    dtype = _DTYPES.get(name)
    # Two dimensions before any reshape: torch refuses a shape whose sizes overflow int64 however few bytes it holds.
    if dtype is None or len(shape) != 2:
        raise InvalidArgument("tensor", f"{quoted(tensor)} is {name} {shape}, expected a [V, D] float tensor")
    check_weight_shape(tuple(shape), "weight.shape")  # before a tensor of that shape is made (0 x 2^63 is not)
    if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
        raise InvalidArgument("path", f"could not read {relative} as safetensors: {quoted(tensor)} is {name} {shape}, "
                                      f"but its data takes {offsets[1] - offsets[0]} bytes")
    return dtype, shape, offsets[0], offsets[1]


def _read_into(fd: int, out: memoryview, offset: int, relative: str) -> None:
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:done + _READ_BYTES]], offset + done)
        if got == 0:
            raise ServiceError(f"path: {quoted(relative)} ended while it was read (changed under the server); "
                               "try again once it is written", grpc.StatusCode.FAILED_PRECONDITION)
        done += got
