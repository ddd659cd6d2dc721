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
        self._tiles_up = torch.empty(0, dtype=torch.int32, device=device)
        self._instances_up = torch.empty(0, dtype=torch.int32, device=device)
        if HALO > module.SEQUENCE_MAX_HALO:
            raise ValueError(f"the kernels stage at most {module.SEQUENCE_MAX_HALO} suffix entries; HALO is {HALO}")

    def words(self, samplers: SequenceSamplers, num_rows: int, vocab: int) -> torch.Tensor:
        """int32 [num_rows, ceil(V / 32)] on the device: every token allowed, less each row's bans."""
        width = words_of(vocab)
        self._words = grown(self._words, num_rows * width)
        words = self._words[:num_rows * width].view(num_rows, width)
        stream = stream_address(self._device)
        self._module.fill_bytes(words.data_ptr(), 0xFF, 4 * words.numel(), stream)
        self._module.sequence_bans(self._tiles(samplers, stream), words.data_ptr(), width, stream)
        return words

    def penalise(self, x: torch.Tensor, samplers: SequenceSamplers) -> torch.Tensor:
        """Step 4's DRY on float32 logits x [B, V] (contiguous, on the device) in place."""
        num_rows, vocab = x.shape
        self._penalty = grown(self._penalty, num_rows * vocab, zeroed=True)
        stream = stream_address(self._device)
        tiles = self._tiles(samplers, stream)
        try:
            self._module.sequence_penalties(tiles, x.data_ptr(), vocab, self._penalty.data_ptr(), stream)
        except BaseException:
            self._penalty.zero_()  # a launch that failed between the two kernels may leave entries set
            raise
        return x

    def _tiles(self, samplers: SequenceSamplers, stream: int) -> list[int]:
        """The launchers' tile fields (csrc/sequence_samplers.h TsSequenceTiles, in order), the tiles and instances
        copied on `stream` into reused device buffers (the next call's copies queue behind this call's kernels)."""
        layout = samplers.layout
        if layout.singles > self._module.SEQUENCE_MAX_SINGLES:
            raise ValueError(f"{layout.singles} single breakers a tile; the kernels stage at most "
                             f"{self._module.SEQUENCE_MAX_SINGLES}")
        self._tiles_up = grown(self._tiles_up, samplers.tiles.numel())
        tiles = self._upload(samplers.tiles, self._tiles_up, stream)
        instances, num_instances = 0, 0
        if samplers.instances is not None:
            self._instances_up = grown(self._instances_up, samplers.instances.numel())
            instances = self._upload(samplers.instances, self._instances_up, stream)
            num_instances = samplers.instances.shape[0]
        return [tiles, samplers.tiles.shape[0], layout.columns, layout.width, HALO, TileLayout.ROW, TileLayout.NEED,
                TileLayout.DRY_TOP, TileLayout.CAP, TileLayout.SUFFIX, TileLayout.TABLE, TileLayout.SINGLES,
                layout.singles, layout.tokens, NGRAM_OFF, instances, num_instances]

    def _upload(self, host: torch.Tensor, device: torch.Tensor, stream: int) -> int:
        """int32 host tensor `host` into the start of `device`; returns its device address. A page-locked `host` is
        read when the copy runs, so it must outlive it: the backend's calls hold their batch until they synchronise
        (and wait for the stream when they fail)."""
        host = host.contiguous()
        if host.dtype != torch.int32:
            raise ValueError(f"tiles: int32 expected, got {host.dtype}")
        self._module.copy_h2d(device.data_ptr(), host.data_ptr(), 4 * host.numel(), stream)
        return device.data_ptr()
