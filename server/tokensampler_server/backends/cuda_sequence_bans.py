"""no-repeat-n-gram's bans (docs/semantics.md L2) as token-bitmask words on the GPU: csrc/sequence_bans.h's kernel.

A call whose only processing is these bans (no DRY, no other list or penalty) then takes the route of a
structured-output mask: one kernel clears the banned tokens' bits in a mask of all ones, and the sampling kernels
read the raw logits once with it. Without it the bans ran as torch comparisons, scatters and a float32 copy of the
logits: about 20 launches and 0.6-1.1 ms a call on an H200, whatever B (docs/performance.md, "Local samplers").
The bans are those of backends/sequence_samplers.py, the CPU reference's, from the same tiles.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokensampler_server.backends.cuda_buffers import grown
from tokensampler_server.backends.cuda_kernels import stream_address
from tokensampler_server.backends.entry_masks import words_of
from tokensampler_server.model.repetition import NGRAM_OFF, SequenceSamplers, TileLayout
from tokensampler_server.model.sampling import LogitProcessing

BANS_ONLY = frozenset({"sequence_bans"})


def bans_only(processing: LogitProcessing) -> bool:
    """Whether no-repeat-n-gram's bans are all of this processing."""
    return processing.sequence_samplers is not None and not processing.changes_beyond(BANS_ONLY)


class SequenceBanKernels:
    """Builds the bans' mask words on the current torch stream of one device, in one reused buffer: the words of a
    call are read by that call's kernels before the call's synchronisation, and calls do not overlap."""

    kernel_names = ("sequence_bans_kernel",)

    def __init__(self, module: ModuleType, device: torch.device) -> None:
        self._module = module
        self._device = device
        self._words = torch.empty(0, dtype=torch.int32, device=device)
        if NGRAM_OFF > module.SEQUENCE_MAX_NEED + 1:
            raise ValueError(f"the kernel compares at most {module.SEQUENCE_MAX_NEED} tokens; NGRAM_OFF is {NGRAM_OFF}")

    def words(self, samplers: SequenceSamplers, num_rows: int, vocab: int) -> torch.Tensor:
        """int32 [num_rows, ceil(V / 32)] on the device: every token allowed, less each row's bans."""
        width = words_of(vocab)
        self._words = grown(self._words, num_rows * width)
        words = self._words[:num_rows * width].view(num_rows, width)
        words.fill_(-1)
        layout = samplers.layout
        tiles = samplers.tiles.to(self._device, non_blocking=True)
        instances = None if samplers.instances is None else samplers.instances.to(self._device, non_blocking=True)
        self._module.sequence_bans(
            tiles.data_ptr(), tiles.shape[0], layout.columns, layout.width, TileLayout.ROW, TileLayout.NEED,
            TileLayout.SUFFIX, layout.tokens, NGRAM_OFF, 0 if instances is None else instances.data_ptr(),
            0 if instances is None else instances.shape[0], words.data_ptr(), width, stream_address(self._device))
        return words
