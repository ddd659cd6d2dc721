"""The interface every sampling backend implements."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from tokensampler_server.model.sampling import SamplingBatch, SamplingResult
from tokensampler_server.resources.weights import RegisteredWeight


@dataclass(frozen=True)
class Route:
    """How a backend samples one kind of row, for GetServerInfo (docs/design/kernel-routing.md)."""

    rows: str
    """The rows that take it."""
    kernels: tuple[str, ...]
    """The kernels it launches, in order (none on the CPU backend)."""
    cost: str
    """The passes over the logits and the measured time (docs/performance.md)."""


@dataclass(frozen=True)
class BackendInfo:
    """What GetServerInfo reports about a backend."""

    name: str
    """"cpu" or "cuda"."""
    device: str
    """"cpu", or "cuda:N (GPU name)"."""
    kernels: list[str] = field(default_factory=list)
    """Compiled kernels in use, empty for the CPU backend."""
    routes: list[Route] = field(default_factory=list)
    """How each kind of row is sampled."""
    mps: str = ""
    """"active" when the GPU is shared through an MPS daemon, "inactive" when not, "" on the CPU
    (docs/colocated.md)."""


class Backend(abc.ABC):
    """Samples a validated batch as docs/semantics.md defines.

    `sample` is called from one worker thread at a time, or from two when `concurrent_calls`; it takes CPU tensors
    and returns CPU tensors.
    """

    concurrent_calls: ClassVar[bool] = False
    """Whether `sample` may run on two threads at once: the batcher then runs long batches on a worker of their own,
    so that short ones do not wait behind them."""

    @property
    def device(self) -> torch.device:
        """Where registered LM-head weights live and hidden-state logits are computed: the device
        that info() names ("cpu", or "cuda:N (GPU name)")."""
        return torch.device(self.info().device.split(" ")[0])

    @abc.abstractmethod
    def info(self) -> BackendInfo:
        """Describes the backend for GetServerInfo and the logs."""

    @abc.abstractmethod
    def sample(self, batch: SamplingBatch) -> SamplingResult:
        """Samples every row of `batch`; rows are independent of each other (batch invariance)."""

    def may_stall(self, batch: SamplingBatch) -> bool:
        """Whether sampling `batch` may wait on devices that fail apart from this process (an exchange between
        GPUs, up to its timeout): the batcher then never runs it on the event loop."""
        return False

    def serving(self) -> bool:
        """Whether the backend can serve now (gRPC health): a backend whose devices failed tries to recover here."""
        return True

    def prepare(self, template: SamplingBatch, head: RegisteredWeight | None = None) -> PreparedSampling:
        """A call whose rows' parameters are those of `template` (its logits unused), made once and then run many
        times on new logits [B, V], or on new hidden states [B, D] through `head` when given (docs/inprocess.md).
        This one samples through `sample`; a GPU backend runs it on the caller's stream without a
        synchronisation."""
        prepared = EagerPreparedSampling(self, template)
        return prepared if head is None else ThroughHead(head, prepared)


class PreparedSampling(abc.ABC):
    """One call's rows made once: their temperature, filters and sample count fixed, their seed, position and
    iteration kept in [B] int64 tensors on the backend's device that the caller writes in place between calls
    (the Philox counters of docs/semantics.md, read at each call)."""

    seed: torch.Tensor
    position: torch.Tensor
    iteration: torch.Tensor

    @abc.abstractmethod
    def sample(self, x: torch.Tensor) -> SamplingResult:
        """Samples x, the logits [B, V] (or the hidden states [B, D] of a call prepared with a head), on the
        backend's device: tokens, valid and nan_detected, where x lies."""


class ThroughHead(PreparedSampling):
    """A prepared call on logits given hidden states [B, D]: their logits through `head` first
    (RegisteredWeight.logits: cuBLAS on the caller's stream on a GPU), then the call on them."""

    def __init__(self, head: RegisteredWeight, on_logits: PreparedSampling) -> None:
        self._head = head
        self._on_logits = on_logits
        self.seed, self.position, self.iteration = on_logits.seed, on_logits.position, on_logits.iteration

    def sample(self, x: torch.Tensor) -> SamplingResult:
        return self._on_logits.sample(self._head.logits(x))


class EagerPreparedSampling(PreparedSampling):
    """A prepared call that runs the backend's `sample` on the template with the counters as they are."""

    def __init__(self, backend: Backend, template: SamplingBatch) -> None:
        self._backend = backend
        self._template = template
        device = backend.device
        self.seed, self.position, self.iteration = (t.to(device, copy=True) for t in (
            template.seed, template.position, template.iteration))

    def sample(self, logits: torch.Tensor) -> SamplingResult:
        batch = replace(self._template, logits=logits, seed=self.seed.cpu(), position=self.position.cpu(),
                        iteration=self.iteration.cpu())
        return self._backend.sample(batch)
