"""The LM-head weight registry: weights registered once, used by hidden-state requests by name.

A weight is usable only once it is complete and verified (uploads are assembled aside and checked
against their SHA-256 first). Requests hold a reference while they use a weight; unregistering waits
until none does, then frees it. A weight registered from a region is a view of the producer's memory:
the region stays registered while the weight does, and a request fails cleanly once its producer exited.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import grpc
import torch

from tokensampler_server.core.errors import InvalidArgument, ServiceError
from tokensampler_server.resources.host_memory import host_memory_bytes
from tokensampler_server.resources.refcounted import RefCountedRegistry
from tokensampler_server.resources.regions import Region
from tokensampler_server.core.request_context import raise_if_abandoned

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# WeightsInfo carries V and D as uint32.
MAX_WEIGHT_SIZE = 2**32 - 1
# Rows of W upcast to fp32 at once when computing logits (32 MiB of fp32 at D = 4096).
_ROWS_PER_SLICE = 2048
DEFAULT_MAX_WEIGHTS = 64


@dataclass(frozen=True)
class LogitsFinish:
    """x = cap * tanh(((W h + bias) * scale) / cap), rows past vocab_size dropped."""

    vocab_size: int
    bias: torch.Tensor | None = None
    """float32 [padded V]."""
    soft_cap: float | None = None
    logit_scale: float = 1.0


@dataclass(eq=False)
class RegisteredWeight:
    """A registered LM head. Compared by identity: a name can come back as another weight."""

    name: str
    weight: torch.Tensor
    """[padded V, D] on the backend's device."""
    finish: LogitsFinish
    sha256: str
    """Empty for a weight in a region, whose bytes are the producer's."""
    region: Region | None = None
    """The region W lies in (RegisterWeightsFromRegion), else None."""

    @property
    def in_place(self) -> bool:
        """W is the region's memory itself (not a copy on another device): the server holds no bytes of it."""
        region = self.region
        return (region is not None and region.buffer is not None
                and self.weight.untyped_storage().data_ptr() == region.buffer.untyped_storage().data_ptr())

    @property
    def padded_vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, vocab_size] of hidden states [B, D] (any float dtype), on W's device.

        W·h with fp32 operands and accumulation (the semantics), W upcast one slice of rows at a time
        so that a bf16 head is never copied whole to fp32.
        """
        vocab = self.finish.vocab_size
        if self._exact_in_half(hidden):
            return self._finished(self._half_product(hidden, 0, vocab), 0, vocab)
        h = hidden.to(self.weight.device, torch.float32)
        x = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
        for start in range(0, vocab, _ROWS_PER_SLICE):
            raise_if_abandoned()  # minutes of CPU work at the largest sizes: stop once nobody waits
            stop = min(start + _ROWS_PER_SLICE, vocab)
            torch.mm(h, self.weight[start:stop].to(torch.float32).T, out=x[:, start:stop])
        return self._finished(x, 0, vocab)

    def logit_slice(self, hidden: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [B, stop - start] of the tokens start..stop-1 (stop <= vocab_size): the columns that
        logits() computes there, without the others (scoring walks the vocabulary a slice at a time). Written into
        `out` (contiguous, on W's device) when given, which is returned: the GPU scorer reuses its buffers."""
        if self._exact_in_half(hidden):
            return self._finished(self._half_product(hidden, start, stop, out), start, stop)
        h = hidden.to(self.weight.device, torch.float32)
        return self._finished(torch.mm(h, self.weight[start:stop].to(torch.float32).T, out=out), start, stop)

    def _exact_in_half(self, hidden: torch.Tensor) -> bool:
        # Products of two 16-bit floats are exact in fp32: tensor cores with fp32 accumulation and
        # output compute the same W·h as the fp32 form, at cuBLAS speed.
        weight = self.weight
        return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and hidden.dtype == weight.dtype

    def _half_product(self, hidden: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mm(hidden.to(self.weight.device), self.weight[start:stop].T, out_dtype=torch.float32, out=out)

    def _finished(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Bias, scale and soft cap applied in place to the logits x of tokens start..stop-1 (the same operations as
        cap * tanh(x / cap), so the same values)."""
        finish = self.finish
        if finish.bias is not None:
            x += finish.bias[start:stop].to(x.device)
        if finish.logit_scale != 1.0:
            x *= finish.logit_scale
        if finish.soft_cap is not None:
            x.div_(finish.soft_cap).tanh_().mul_(finish.soft_cap)
        return x


def check_weight_shape(shape: tuple[int, ...], field: str) -> None:
    """INVALID_ARGUMENT naming `field` unless both sizes of a [V, D] weight are in [1, MAX_WEIGHT_SIZE]
    (an empty head would register, then fail every request through it)."""
    for name, size in zip("VD", shape):
        if not 1 <= size <= MAX_WEIGHT_SIZE:
            raise InvalidArgument(field, f"got {list(shape)}: {name} = {size}, expected 1 <= V, D <= {MAX_WEIGHT_SIZE}")


def check_finite_weight(weight: torch.Tensor, field: str) -> None:
    """INVALID_ARGUMENT naming `field` and the first row holding a NaN or an infinity: such a head would register,
    then give that token a NaN or infinite logit in every request. Checked a slice of rows at a time, so that the
    check holds at most ~64 MiB of flags."""
    rows = max(1, (1 << 26) // weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        raise_if_abandoned()  # a registration whose caller has gone stops here (rpc/weights_rpc.py)
        finite = torch.isfinite(weight[start:start + rows]).all(dim=1)
        if not bool(finite.all()):
            row = start + int(torch.argmin(finite.to(torch.uint8)))
            raise InvalidArgument(field, f"got a NaN or infinite value in row {row}, expected finite numbers")


def sha256_hex(tensor: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's row-major bytes."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_finish(
    padded_vocab_size: int,
    bias: torch.Tensor | None,
    vocab_size: int | None,
    soft_cap: float | None,
    logit_scale: float | None,
    field_prefix: str = "options",
) -> LogitsFinish:
    """Validates the options of a weight [padded_vocab_size, D]."""
    if bias is not None and tuple(bias.shape) != (padded_vocab_size,):
        raise InvalidArgument(f"{field_prefix}.bias.shape", f"got {list(bias.shape)}, expected [{padded_vocab_size}]")
    if bias is not None and not bool(torch.isfinite(bias.float()).all()):
        raise InvalidArgument(f"{field_prefix}.bias.data", "got non-finite values, expected finite numbers")
    if vocab_size is not None and not 1 <= vocab_size <= padded_vocab_size:
        raise InvalidArgument(f"{field_prefix}.vocab_size", f"got {vocab_size}, expected 1 <= V <= {padded_vocab_size}")
    if soft_cap is not None and not (math.isfinite(soft_cap) and soft_cap > 0):
        raise InvalidArgument(f"{field_prefix}.soft_cap", f"got {soft_cap}, expected a finite cap > 0")
    if logit_scale is not None and not math.isfinite(logit_scale):
        raise InvalidArgument(f"{field_prefix}.logit_scale", f"got {logit_scale}, expected a finite number")
    return LogitsFinish(
        vocab_size=vocab_size if vocab_size is not None else padded_vocab_size,
        bias=None if bias is None else bias.to(torch.float32),
        soft_cap=soft_cap,
        logit_scale=1.0 if logit_scale is None else logit_scale,
    )


def device_memory_bytes(device: torch.device) -> int:
    """The memory of `device`: a GPU's, or the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


class WeightRegistry:
    """Registered LM heads by name, on one device (see refcounted.py for the reference counting), and the bytes
    they hold together: at most `max_bytes` (default half the device's memory), registrations in progress counted
    from before they allocate (`claim`), so that no client can make the server hold more, however many names the
    --max-weights cap leaves it."""

    def __init__(self, device: torch.device, *, max_weights: int = DEFAULT_MAX_WEIGHTS, max_bytes: int | None = None,
                 unregister_timeout_s: float = 60.0) -> None:
        self._device = device
        self._weights: RefCountedRegistry[RegisteredWeight] = RefCountedRegistry(
            "weight", max_items=max_weights, unregister_timeout_s=unregister_timeout_s)
        self.max_bytes = max_bytes if max_bytes is not None else device_memory_bytes(device) // 2
        self._claims: dict[str, int] = {}
        """Bytes claimed by the registrations in progress, by the name each reserved."""
        self._lock = threading.Lock()
        """Orders the claims and the additions of weights (taken before the registry's own lock)."""

    @property
    def device(self) -> torch.device:
        """Where registered weights live (a weight elsewhere is copied there)."""
        return self._device

    def register(
        self, name: str, weight: torch.Tensor, finish: LogitsFinish, sha256: str, region: Region | None = None, *,
        reserved: bool = False
    ) -> RegisteredWeight:
        """Makes a complete, verified weight usable under `name` (ALREADY_EXISTS if taken). A weight that
        lies in `region` on this registry's device is used in place, not copied. `reserved`: the caller holds the
        name's reservation (`reserve`)."""
        if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2:
            raise InvalidArgument("weight", f"got {weight.dtype} {list(weight.shape)}, expected a [V, D] float tensor")
        check_weight_shape(tuple(weight.shape), "weight.shape")
        placed = weight.to(self._device).contiguous()
        check_finite_weight(placed, "weight")
        bias = None if finish.bias is None else finish.bias.to(self._device)
        entry = RegisteredWeight(name=name, weight=placed, finish=replace(finish, bias=bias), sha256=sha256, region=region)
        raise_if_abandoned()  # the last moment a caller that has gone keeps the name free
        # The region first: an unregister of the name that lands right after `add` lets the entry leave the region,
        # and an entry added to it after that would keep the region from being unregistered for good.
        if region is not None:
            region.weights.add(entry)
        try:
            with self._lock:  # the bytes it holds now, in place of what its registration claimed
                claimed = self._claims.pop(name, 0)
                try:
                    self._check_room_locked(0 if entry.in_place else entry.nbytes, "weight")
                    self._weights.add(name, entry, reserved=reserved)
                except BaseException:
                    if claimed:
                        self._claims[name] = claimed  # `unreserve` gives it back
                    raise
        except BaseException:
            _leave_region(entry)
            raise
        return entry

    def claim(self, name: str, nbytes: int, field: str) -> None:
        """Counts `nbytes` for the registration that reserved `name`, before it allocates them: RESOURCE_EXHAUSTED
        naming `field` where the weights held and the registrations in progress would pass max_bytes. `register`
        or `unreserve` ends the claim."""
        with self._lock:
            self._check_room_locked(nbytes, field)
            self._claims[name] = nbytes

    def _check_room_locked(self, nbytes: int, field: str) -> None:
        held = self.total_bytes + sum(self._claims.values())
        if held + nbytes > self.max_bytes:
            raise ServiceError(f"{field}: {nbytes} bytes more than the weights may hold together: {held} of "
                               f"{self.max_bytes} are held or being registered (--max-weights-mb); unregister a "
                               "weight first", grpc.StatusCode.RESOURCE_EXHAUSTED)

    def check_free(self, name: str) -> None:
        """What `register` would refuse of `name` now (a bad name, ALREADY_EXISTS, RESOURCE_EXHAUSTED)."""
        self._weights.check_free(name)

    def reserve(self, name: str) -> None:
        """Takes `name` (and a --max-weights slot) for a registration's long work, refused as `register` would
        refuse it now; `register(..., reserved=True)` or `unreserve` ends it."""
        self._weights.reserve(name)

    def unreserve(self, name: str) -> None:
        with self._lock:
            self._claims.pop(name, None)
        self._weights.unreserve(name)

    def list(self) -> list[RegisteredWeight]:
        return self._weights.items()

    def in_flight(self, entry: RegisteredWeight) -> int:
        return self._weights.in_flight(entry)

    @property
    def total_bytes(self) -> int:
        """The bytes of the weights the server holds (weights used in place count among their regions' bytes)."""
        return sum(entry.nbytes for entry in self.list() if not entry.in_place)

    @contextmanager
    def use(self, name: str, field: str = "hidden.weights") -> Iterator[RegisteredWeight]:
        """Holds weight `name` for the duration of a request (NOT_FOUND naming `field` if unknown;
        FAILED_PRECONDITION if it lies in a region whose producer has exited)."""
        with self._weights.use(name, field) as entry:
            if entry.region is not None:
                entry.region.check_producer(field)
            yield entry

    async def unregister(self, name: str) -> RegisteredWeight:
        """Removes `name` at once for new requests, waits for the ones using it, then frees it (and lets its
        region go): atomic, and bounded by the registry's timeout (refcounted.py)."""
        return await self._weights.remove(name, finalize=_leave_region)


def _leave_region(entry: RegisteredWeight) -> None:
    if entry.region is not None:
        entry.region.weights.discard(entry)
