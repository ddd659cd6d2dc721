"""Per-row token lists in coordinate form: the one shape of a request's token lists (allowed, banned, histories,
stop ids) inside the server, shared by the sampled batch and the sequence samplers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenEntries"]


@dataclass(frozen=True)
class TokenEntries:
    """Per-row token lists in coordinate form: entry j is token `tokens[j]` of row `rows[j]`.

    Both are int64 [n] on the CPU. Duplicates are kept (a history counts each occurrence).
    """

    rows: torch.Tensor
    tokens: torch.Tensor

    def __len__(self) -> int:
        return int(self.rows.numel())
