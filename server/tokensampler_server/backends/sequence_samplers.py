"""no-repeat-n-gram's bans and DRY's penalties (docs/semantics.md L2, L3) derived from the rows' tiles
(repetition.py) on the logits' device, in torch.

Device-agnostic like the rest of processing: the CPU reference runs it on the CPU and the CUDA backend on the GPU.
Every tile position's repeat comes from one comparison of the tiles with their sequences' ends; the bans and the
penalties are then one scatter each into the logits. No loop over rows, and nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokensampler_server.model.repetition import HALO, NGRAM_OFF, PAD_SUFFIX, SequenceSamplers, TileLayout

_CHUNK_POSITIONS = 1 << 20
"""Positions compared at once: a bool temporary of up to HALO bytes each (51 MiB)."""


@dataclass(frozen=True)
class Derived:
    """What the rows' sequences ban and penalise, position by position (P tile instances of `width` positions)."""

    index: torch.Tensor
    """int64 [P, width]: row · V + token of each position (padding reads token 0 of its row, and changes nothing)."""
    banned: torch.Tensor | None
    """bool [P, width]: the position's token is banned (L2); None when no row bans."""
    penalty: torch.Tensor | None
    """float32 [P, width]: DRY's penalty of the position's token, 0 where none (L3); None when no row penalises."""


def _repeats(tokens: torch.Tensor, suffix: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [U, width]: the repeat of every position, the first column of tokens[i+1 : i+1+C] that differs from
    the suffix of C <= HALO columns (its last, a sentinel, always does)."""
    windows = tokens.unfold(1, HALO, 1)[:, 1:width + 1, :suffix.shape[1]]  # [U, width, C], a view
    suffix = suffix.unsqueeze(1)
    per_chunk = max(1, _CHUNK_POSITIONS // width)
    if windows.shape[0] <= per_chunk:
        return (windows != suffix).view(torch.uint8).argmax(dim=2)
    out = torch.empty(windows.shape[:2], dtype=torch.int64, device=tokens.device)
    for start in range(0, windows.shape[0], per_chunk):
        stop = start + per_chunk
        torch.argmax((windows[start:stop] != suffix[start:stop]).view(torch.uint8), dim=2, out=out[start:stop])
    return out


def derive(samplers: SequenceSamplers, vocab_size: int, device: torch.device) -> Derived:
    """The bans and penalties of every row `samplers` serves, on `device`."""
    layout = samplers.layout
    tiles = samplers.tiles.to(device, non_blocking=True)
    width = layout.width
    tokens = tiles[:, layout.tokens:]
    current = tokens[:, :width]  # the token at each position
    suffix = tiles[:, TileLayout.SUFFIX:TileLayout.TABLE]
    if not samplers.penalties:
        suffix = _capped(suffix, _longest_need(samplers))
    repeat = _repeats(tokens, suffix, width)
    banned = penalty = None
    if samplers.bans:
        banned = (repeat >= tiles[:, TileLayout.NEED:TileLayout.NEED + 1]) & (current >= 0)
    if samplers.penalties:
        # The repeat ending before position i counts window tokens only (DRY_TOP - i of them), and at most CAP.
        positions = torch.arange(width, device=device, dtype=torch.int32)
        window = tiles[:, TileLayout.DRY_TOP:TileLayout.DRY_TOP + 1] - positions
        bound = window.clamp_(max=tiles[:, TileLayout.CAP:TileLayout.CAP + 1])
        length = torch.minimum(repeat, bound).clamp_(min=0)
        if layout.singles:
            single = (current.unsqueeze(2) == tiles[:, TileLayout.SINGLES:layout.tokens].unsqueeze(1)).any(dim=2)
            length.masked_fill_(single, 0)
        penalty = tiles[:, TileLayout.TABLE:TileLayout.SINGLES].view(torch.float32).gather(1, length)
    if samplers.instances is None:
        rows = tiles[:, TileLayout.ROW]
    else:
        instances = samplers.instances.to(device, non_blocking=True)
        rows, tile = instances[:, 0], instances[:, 1]
        current = current[tile]
        banned = None if banned is None else banned[tile]
        penalty = None if penalty is None else penalty[tile]
    index = current.clamp(min=0) + rows.long().mul_(vocab_size).unsqueeze(1)
    return Derived(index, banned, penalty)


def _longest_need(samplers: SequenceSamplers) -> int:
    """The largest n - 1 of the tiles that ban (no-repeat-n-gram)."""
    need = samplers.tiles[:, TileLayout.NEED]
    return int(need[need < NGRAM_OFF].max())


def _capped(suffix: torch.Tensor, columns: int) -> torch.Tensor:
    """The suffix's first `columns` entries and the sentinel: repeats stop counting at `columns`. no-repeat-n-gram
    alone asks only whether a repeat reaches n - 1, so it compares n columns of every window, not HALO (51); a tile
    that does not ban needs NGRAM_OFF, which no capped repeat reaches."""
    capped = suffix[:, :columns + 1].clone()
    capped[:, columns] = PAD_SUFFIX
    return capped


def apply_bans(x: torch.Tensor, derived: Derived) -> torch.Tensor:
    """Step 2: the banned tokens -> -inf in float32 logits x [B, V], in place (NaN and +inf as well: a banned token
    is never flagged). A token may be banned at one position and not at another of its row, so every write to a
    token carries the same value: -inf when any position bans it, else its own value."""
    flat = x.view(-1)
    index = derived.index.view(-1)
    hit = torch.zeros(flat.numel() + 1, dtype=torch.bool, device=x.device)  # the last: where the others write
    hit.scatter_(0, torch.where(derived.banned.view(-1), index, flat.numel()), True)
    flat.scatter_(0, index, torch.where(hit[index], float("-inf"), flat[index]))
    return x


def apply_penalties(x: torch.Tensor, derived: Derived) -> torch.Tensor:
    """Step 4's DRY: x_t -= the largest penalty of token t in its row, in place in float32 logits x [B, V].

    fp32(x - p) falls as p grows, so the smallest of x - p over a token's positions is x minus its largest penalty,
    rounded once, whatever the order the positions are taken in (penalties of 0 leave x as it is)."""
    flat = x.view(-1)
    index = derived.index.view(-1)
    flat.scatter_reduce_(0, index, flat[index] - derived.penalty.view(-1), "amin")
    return x
