"""The weight RPCs' messages: uploads assembled and verified, options checked, WeightsInfo built."""

from __future__ import annotations

import asyncio
import hashlib
import math
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import DTYPE_TO_TORCH, TORCH_TO_DTYPE, TensorDecodeError, decode_tensor, dtype_name

from tokensampler_server.core.budget import ByteBudget
from tokensampler_server.core.errors import InvalidArgument, ServiceError, quoted
from tokensampler_server.core.request_context import current_abandoned
from tokensampler_server.core.threads import on_thread
from tokensampler_server.resources.weights import (LogitsFinish, RegisteredWeight, WeightRegistry, check_finish,
                                                  check_weight_shape)

WIRE_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16)
UPLOAD_IDLE_TIMEOUT_S = 60.0
"""An upload whose next message does not come within this ends (DEADLINE_EXCEEDED): the bytes it holds count
against every other upload's budget."""


@dataclass(frozen=True)
class VerifiedUpload:
    name: str
    weight: torch.Tensor
    finish: LogitsFinish
    sha256: str


def finish_from_options(options: pb.WeightOptions, padded_vocab_size: int) -> LogitsFinish:
    bias = None
    if options.HasField("bias"):
        try:
            bias = decode_tensor(options.bias, "options.bias")
        except TensorDecodeError as err:
            raise InvalidArgument(err.field, str(err).removeprefix(f"{err.field}: ")) from None
        if not bias.is_floating_point():
            raise InvalidArgument("options.bias.dtype",
                                  f"got {dtype_name(options.bias.dtype)}, expected float32 (or bfloat16, float16)")
    return check_finish(
        padded_vocab_size,
        bias,
        options.vocab_size if options.HasField("vocab_size") else None,
        options.soft_cap if options.HasField("soft_cap") else None,
        options.logit_scale if options.HasField("logit_scale") else None,
    )


def weights_info(entry: RegisteredWeight, in_flight: int = 0) -> pb.WeightsInfo:
    return pb.WeightsInfo(
        name=entry.name,
        vocab_size=entry.finish.vocab_size,
        padded_vocab_size=entry.padded_vocab_size,
        hidden_size=entry.hidden_size,
        dtype=TORCH_TO_DTYPE[entry.weight.dtype],
        bytes=entry.nbytes,
        sha256=entry.sha256,
        in_flight=in_flight,
        region=entry.region.name if entry.region is not None else "",
    )


def upload_budget(max_bytes: int) -> ByteBudget:
    """The bytes that uploads in progress hold together; a refusal names the field that carries them."""
    return ByteBudget(max_bytes, "data", "uploads", "--max-weight-mb")


async def read_upload(chunks: AsyncIterator[pb.RegisterWeightsChunk], max_bytes: int,
                      check_name: Callable[[str], None], budget: ByteBudget,
                      idle_timeout_s: float = UPLOAD_IDLE_TIMEOUT_S) -> VerifiedUpload:
    """Assembles a chunked upload aside; returns it only when complete and its SHA-256 matches. The header (name,
    dtype, shape, options) is checked as it arrives, `check_name` with it. The bytes received are taken from `budget`
    as they come (a header alone holds nothing) and held until the upload ends."""
    header: pb.RegisterWeightsChunk | None = None
    finish: LogitsFinish | None = None
    buffer = bytearray()
    expected_bytes = 0
    digest = hashlib.sha256()
    sha256 = ""
    try:
        async for chunk in _within(chunks, idle_timeout_s):
            if header is None:
                header = chunk
                check_name(header.name)
                if header.dtype not in WIRE_DTYPES:
                    raise InvalidArgument("dtype", f"got {dtype_name(header.dtype)}, expected float32, bfloat16 or float16")
                if len(header.shape) != 2 or min(header.shape) < 1:
                    raise InvalidArgument("shape", f"got {list(header.shape)}, expected [V, D] with V, D >= 1")
                check_weight_shape(tuple(header.shape), "shape")
                itemsize = torch.empty((), dtype=DTYPE_TO_TORCH[header.dtype]).element_size()
                expected_bytes = math.prod(header.shape) * itemsize
                if expected_bytes > max_bytes:
                    raise InvalidArgument("shape", f"{list(header.shape)} needs {expected_bytes} bytes, expected at "
                                          f"most {max_bytes}")
                finish = finish_from_options(header.options, int(header.shape[0]))
            else:
                header_fields = (("name", chunk.name), ("dtype", chunk.dtype), ("shape", len(chunk.shape)),
                                 ("options", chunk.HasField("options")))
                resent = [field for field, given in header_fields if given]
                if resent:
                    raise InvalidArgument(resent[0], "header fields sent again after the first message; expected "
                                          "data only (and sha256 with the last)")
            if len(buffer) + len(chunk.data) > expected_bytes:
                raise InvalidArgument("data", f"got more than the {expected_bytes} bytes that shape "
                                      f"{list(header.shape)} holds")
            budget.take(len(chunk.data))
            buffer += chunk.data
            digest.update(chunk.data)
            sha256 = chunk.sha256 or sha256
    finally:
        budget.give_back(len(buffer))  # the upload's bytes are the registry's from here, or gone
    if header is None:
        raise InvalidArgument("name", "the upload had no messages; expected a header with name, dtype and shape")
    if len(buffer) != expected_bytes:
        raise InvalidArgument("data", f"got {len(buffer)} bytes, expected {expected_bytes} for shape {list(header.shape)}")
    if not sha256:
        raise InvalidArgument("sha256", "missing; expected the hex SHA-256 of the weight's bytes")
    if digest.hexdigest() != sha256.lower():
        raise InvalidArgument("sha256", f"got {quoted(sha256)}, but the bytes received hash to {digest.hexdigest()}")
    weight = torch.frombuffer(buffer, dtype=DTYPE_TO_TORCH[header.dtype]).view(*header.shape)
    return VerifiedUpload(name=header.name, weight=weight, finish=finish, sha256=digest.hexdigest())


async def _within(chunks: AsyncIterator[pb.RegisterWeightsChunk],
                  timeout_s: float) -> AsyncIterator[pb.RegisterWeightsChunk]:
    """The upload's messages, each within `timeout_s` of the one before."""
    iterator = aiter(chunks)
    while True:
        try:
            chunk = await asyncio.wait_for(anext(iterator), timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ServiceError(f"data: no message for {timeout_s:g} s; the upload ended "
                               f"(uploads in progress hold their bytes)", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        yield chunk


async def registered_off_loop(registry: WeightRegistry, name: str, work: Callable[[], RegisteredWeight],
                              on_unrun: Callable[[], None] | None = None) -> RegisteredWeight:
    """Runs a registration's work on a thread (reading and checking a weight, seconds a GiB on a CPU, then
    `registry.register(name, ..., reserved=True)`) with `name` reserved from before it starts to its end: a second
    registration of the name, or one past --max-weights, is refused at once rather than doing the same work. A
    caller that goes away (deadline, cancel) registers nothing: the registry's checks call raise_if_abandoned,
    which sees the call gone, and a caller gone before a thread took the work gives the name back at once.
    `on_unrun` runs when the work does not (the name refused, or the caller gone first)."""
    try:
        registry.reserve(name)
    except BaseException:
        if on_unrun is not None:
            on_unrun()
        raise
    gone = threading.Event()

    def run() -> RegisteredWeight:
        token = current_abandoned.set(gone.is_set)
        try:
            # Once registered, the name is not this registration's to give back: it may already be unregistered
            # and reserved by another registration.
            return work()
        except BaseException:
            registry.unreserve(name)
            raise
        finally:
            current_abandoned.reset(token)

    def unrun() -> None:
        registry.unreserve(name)
        if on_unrun is not None:
            on_unrun()

    try:
        return await on_thread(run, unrun)
    except asyncio.CancelledError:
        gone.set()
        raise
