"""The sequence samplers on the GPU (docs/semantics.md L2, L3): csrc/sequence_samplers.h's kernels.

- no-repeat-n-gram's bans as token-bitmask words. A call whose only processing is these bans takes the route of a
  structured-output mask: one kernel clears the banned tokens' bits in a mask of all ones, and the sampling kernels
  read the raw logits once with it.
- DRY's penalties subtracted from the float32 copy of the logits in place, by two kernels over the rows' tiles (the
  largest penalty of each token, then its subtraction), for a call whose only processing is DRY.

Both replace about 20 torch launches each (comparisons, gathers, scatters), which bounded those calls at any B
(docs/performance.md, "Local samplers"). backends/sequence_samplers.py stays the CPU reference and the tests' oracle:
the same tiles, the same bans and penalties, bit for bit.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokensampler_server.backends.cuda_buffers import grown
from tokensampler_server.backends.cuda_kernels import stream_address
from tokensampler_server.backends.entry_masks import words_of
from tokensampler_server.model.repetition import HALO, NGRAM_OFF, SequenceSamplers, TileLayout
from tokensampler_server.model.sampling import LogitProcessing

BANS_ONLY = frozenset({"sequence_bans"})
PENALTIES_ONLY = frozenset({"sequence_penalties"})


def bans_only(processing: LogitProcessing) -> bool:
    """Whether no-repeat-n-gram's bans are all of this processing."""
    return processing.sequence_samplers is not None and not processing.changes_beyond(BANS_ONLY)


def penalties_only(processing: LogitProcessing) -> bool:
    """Whether DRY's penalties are all of this processing."""
    return processing.sequence_samplers is not None and not processing.changes_beyond(PENALTIES_ONLY)


class SequenceSamplerKernels:
    """Launches the sequence samplers' kernels on the current torch stream of one device, with reused buffers: the
    mask words of a call are read by that call's kernels before its synchronisation, calls do not overlap, and the
    penalty scratch is left zeroed by every launch."""

    kernel_names = ("sequence_bans_kernel", "dry_max_kernel", "dry_apply_kernel")

    def __init__(self, module: ModuleType, device: torch.device) -> None:
        self._module = module
        self._device = device
        self._words = torch.empty(0, dtype=torch.int32, device=device)
        self._penalty = torch.zeros(0, dtype=torch.float32, device=device)
        if HALO > module.SEQUENCE_MAX_HALO:
            raise ValueError(f"the kernels stage at most {module.SEQUENCE_MAX_HALO} suffix entries; HALO is {HALO}")

    def words(self, samplers: SequenceSamplers, num_rows: int, vocab: int) -> torch.Tensor:
        """int32 [num_rows, ceil(V / 32)] on the device: every token allowed, less each row's bans."""
        width = words_of(vocab)
        self._words = grown(self._words, num_rows * width)
        words = self._words[:num_rows * width].view(num_rows, width)
        words.fill_(-1)
        tiles, held = self._tiles(samplers)
        self._module.sequence_bans(tiles, words.data_ptr(), width, stream_address(self._device))
        del held  # the uploads stay allocated until the launch is queued; torch's allocator orders their reuse
        return words

    def penalise(self, x: torch.Tensor, samplers: SequenceSamplers) -> torch.Tensor:
        """Step 4's DRY on float32 logits x [B, V] (contiguous, on the device) in place."""
        num_rows, vocab = x.shape
        self._penalty = grown(self._penalty, num_rows * vocab, zeroed=True)
        tiles, held = self._tiles(samplers)
        try:
            self._module.sequence_penalties(tiles, x.data_ptr(), vocab, self._penalty.data_ptr(),
                                            stream_address(self._device))
        except BaseException:
            self._penalty.zero_()  # a launch that failed between the two kernels may leave entries set
            raise
        del held
        return x

    def _tiles(self, samplers: SequenceSamplers) -> tuple[list[int], tuple[torch.Tensor, ...]]:
        """The launchers' tile fields (csrc/sequence_samplers.h TsSequenceTiles, in order) and the device tensors
        they point into."""
        layout = samplers.layout
        if layout.singles > self._module.SEQUENCE_MAX_SINGLES:
            raise ValueError(f"{layout.singles} single breakers a tile; the kernels stage at most "
                             f"{self._module.SEQUENCE_MAX_SINGLES}")
        tiles = samplers.tiles.to(self._device, non_blocking=True)
        instances = None if samplers.instances is None else samplers.instances.to(self._device, non_blocking=True)
        fields = [tiles.data_ptr(), tiles.shape[0], layout.columns, layout.width, HALO, TileLayout.ROW, TileLayout.NEED,
                  TileLayout.DRY_TOP, TileLayout.CAP, TileLayout.SUFFIX, TileLayout.TABLE, TileLayout.SINGLES,
                  layout.singles, layout.tokens, NGRAM_OFF, 0 if instances is None else instances.data_ptr(),
                  0 if instances is None else instances.shape[0]]
        return fields, (tiles,) if instances is None else (tiles, instances)
