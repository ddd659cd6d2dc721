"""The interface every sampling backend implements."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from tokensampler_server.model.sampling import SamplingBatch, SamplingResult


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


class Backend(abc.ABC):
    """Samples a validated batch as docs/semantics.md defines.

    `sample` is called from one worker thread at a time; it takes CPU tensors and returns CPU tensors.
    """

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
