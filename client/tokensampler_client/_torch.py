"""torch where it is installed: always beside the server, optional for the client (the `torch` extra).

With torch the client takes and returns torch tensors; without it, numpy arrays. The few features that need
torch itself (CUDA IPC regions, bfloat16 arrays, the CLI's random logits) call `require_torch`, which names
the extra that brings it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

TORCH_EXTRA = "pip install 'tokensampler-client[torch]'"


def _installed_torch() -> ModuleType | None:
    try:
        import torch
    except ModuleNotFoundError as error:
        if error.name != "torch":  # torch is there but broken: say so rather than fall back to numpy
            raise
        return None
    return torch


torch: Any = _installed_torch()
"""The torch module, or None without it."""


def require_torch(feature: str) -> Any:
    """The torch module; without it, ModuleNotFoundError naming `feature` and the extra that installs torch."""
    if torch is None:
        raise ModuleNotFoundError(f"{feature} needs torch, which is not installed: {TORCH_EXTRA}", name="torch")
    return torch
