"""The local samplers of step 5 (docs/semantics.md L4-L6) on the GPU: csrc/local_samplers.h's kernels.

The CUDA backend's implementation of truncation.apply_truncation, which stays the CPU reference and the oracle of
the tests: the same kept sets, from per-row statistics instead of torch operations over [B, V] (typical-p's cut
without a sort of the row), either written as -inf into float32 logits in place (`apply`, after other processing
on a copy) or returned as a token bitmask while the logits are only read (`kept`, when the samplers are all of a
call's processing: the sampling kernels then read the caller's logits with it, and no copy is made), or, for
top-n-sigma alone, as a floor a row that the sampling kernels apply as they read the logits (`floor`: one read of
the logits instead of two). `entries` picks between the last two. Rows at the
off values are left as they are; XTC's coin is drawn in the kernels from the row's seed, position and iteration,
as xtc_coins draws it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokensampler_server.model.sampling import LogitProcessing, Truncation
from tokensampler_server.backends.cuda_buffers import grown
from tokensampler_server.backends.entry_masks import words_of
from tokensampler_server.backends.cuda_kernels import NO_BITMASK, stream_address

TRUNCATION_ONLY = frozenset({"truncation"})


def truncation_only(processing: LogitProcessing) -> bool:
    """Whether the local samplers are all of this processing."""
    return processing.truncation is not None and not processing.changes_beyond(TRUNCATION_ONLY)


def sigma_alone(truncation: Truncation) -> bool:
    """Whether top-n-sigma is the only local sampler any row may use (typical-p and XTC off in every row)."""
    return bool(_host_column(truncation.typical_p, torch.float32).min() >= 1) and bool(
        _host_column(truncation.xtc_probability, torch.float32).max() <= 0)


class LocalSamplerKernels:
    """Launches the local samplers' kernels on the current torch stream of one device, with their reused workspace
    (grown on demand, never shrunk). Not for concurrent use from several threads or streams, and the host must wait
    for a call's launches before the next call: that call packs the rows into the same page-locked buffer, which the
    earlier copy may still be reading (the CUDA backend synchronises every call before its next)."""

    kernel_names = ("local::stats_kernel", "local::sigma_kernel", "local::sigma_floor_kernel",
                    "local::typical_hist_kernel", "local::typical_cut_kernel")

    def __init__(self, module: ModuleType, device: torch.device) -> None:
        self._module = module
        self._device = device
        self._scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self._zeroed = torch.zeros(0, dtype=torch.uint8, device=device)
        self._host_rows = torch.empty(0, dtype=torch.uint8)  # pinned once grown (grown(pinned=True))
        self._dev_rows = torch.empty(0, dtype=torch.uint8, device=device)
        self._keep = torch.empty(0, dtype=torch.int32, device=device)
        self._floor = torch.empty(0, dtype=torch.float32, device=device)

    def _workspace(self, num_rows: int, vocab: int) -> tuple[int, int]:
        scratch, zeroed = self._module.local_samplers_workspace(num_rows, vocab)
        self._scratch = grown(self._scratch, scratch)
        self._zeroed = grown(self._zeroed, zeroed, zeroed=True)  # the kernels leave it zeroed
        return self._scratch.data_ptr(), self._zeroed.data_ptr()

    def apply(self, x: torch.Tensor, truncation: Truncation) -> torch.Tensor:
        """L4-L6 on float32 logits x [B, V] on the device, in place (contiguous x; otherwise a contiguous copy):
        use the returned tensor."""
        x = _float_rows(x, self._device).contiguous()
        self._launch(x, truncation, keep=0)
        return x

    def entries(self, x: torch.Tensor, truncation: Truncation) -> list[int]:
        """L4-L6 on contiguous float32 logits x [B, V] on the device, which are only read, as the token-bitmask entries
        of the sampling kernels' launches (cuda_kernels.bitmask_entries' form): the rows' floors where top-n-sigma is
        the only sampler some row uses (`floor`), else their kept bits (`kept`); NO_BITMASK when no row uses a
        sampler. They point into reused buffers, valid until the next call."""
        x = _contiguous_float_rows(x, self._device)
        keep = self._kept_bits(*x.shape)
        self._floor = grown(self._floor, x.shape[0])
        used = self._launch(x, truncation, keep=keep.data_ptr(), floor=self._floor.data_ptr())
        if not used:
            return NO_BITMASK
        if used & self._module.LOCAL_FLOOR:
            return [0, 0, 0, self._floor.data_ptr()]
        return [keep.data_ptr(), 0, keep.shape[1], 0]

    def floor(self, x: torch.Tensor, truncation: Truncation) -> torch.Tensor | None:
        """L4 alone (sigma_alone) on contiguous float32 logits x [B, V] on the device, which are only read once: each
        row's floor, float32 [B], the least float32 at or above M - n·σ (-inf where n <= 0), so that the tokens
        top-n-sigma removes are exactly those below it. None when no row uses it. A reused buffer, valid until the
        next call."""
        if not sigma_alone(truncation):
            raise ValueError("truncation: top-n-sigma alone expected (typical-p and XTC off in every row)")
        x = _contiguous_float_rows(x, self._device)
        self._floor = grown(self._floor, x.shape[0])
        floor = self._floor[:x.shape[0]]
        return floor if self._launch(x, truncation, floor=floor.data_ptr()) else None

    def kept(self, x: torch.Tensor, truncation: Truncation) -> torch.Tensor | None:
        """L4-L6 on contiguous float32 logits x [B, V] on the device, which are only read: the tokens the samplers
        keep, as a token bitmask int32 [B, ceil(V / 32)] (bits set: kept, and NaN and +inf entries, which step 5
        flags; bits past V set), for the sampling kernels to read with x. None when no row uses a sampler. The
        bitmask is a reused buffer, valid until the next call."""
        x = _contiguous_float_rows(x, self._device)
        keep = self._kept_bits(*x.shape)
        return keep if self._launch(x, truncation, keep=keep.data_ptr()) else None

    def _kept_bits(self, num_rows: int, vocab: int) -> torch.Tensor:
        """The reused kept bits of num_rows rows, int32 [num_rows, ceil(vocab / 32)]."""
        words = words_of(vocab)
        self._keep = grown(self._keep, num_rows * words)
        return self._keep[:num_rows * words].view(num_rows, words)

    def _launch(self, x: torch.Tensor, truncation: Truncation, *, keep: int = 0, floor: int = 0) -> int:
        """Packs the rows' columns and launches the kernels on x (contiguous): L4-L6 with `keep` (0 or the kept bits'
        address), or top-n-sigma's floors into `floor` (0 or an address) where it is the only sampler. Returns the
        module's bits of the samplers launched (0: none) and of the floors (LOCAL_FLOOR)."""
        num_rows, vocab = x.shape
        if num_rows == 0:
            return 0
        columns = [_host_column(getattr(truncation, name), dtype) for name, dtype in _COLUMNS]
        if any(column.numel() != num_rows for column in columns):
            raise ValueError(f"truncation: {num_rows} values a column expected, one per row of x")
        nbytes = self._module.local_rows_bytes(num_rows)
        self._host_rows = grown(self._host_rows, nbytes, pinned=True)
        self._dev_rows = grown(self._dev_rows, nbytes)
        scratch, zeroed = self._workspace(num_rows, vocab)
        return self._module.local_samplers(x.data_ptr(), keep, floor, num_rows, vocab, [c.data_ptr() for c in columns],
                                           self._host_rows.data_ptr(), self._dev_rows.data_ptr(), scratch, zeroed,
                                           stream_address(self._device))


def _float_rows(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x itself, once checked to be float32 [B, V] on the kernels' device."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.device != device:
        raise ValueError("x: float32 [B, V] logits on the kernels' device expected")
    return x


def _contiguous_float_rows(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """_float_rows, contiguous."""
    if not _float_rows(x, device).is_contiguous():
        raise ValueError("x: contiguous logits expected")
    return x


# The rows' columns in the order and dtypes of csrc/local_samplers.h's TsLocalRows.
_COLUMNS = (("top_n_sigma", torch.float32), ("typical_p", torch.float32), ("xtc_threshold", torch.float32),
            ("xtc_probability", torch.float32), ("seed", torch.int64), ("position", torch.int64),
            ("iteration", torch.int64))


def _host_column(column: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of dtype (the column itself when it is one)."""
    if column.dtype == dtype and column.is_contiguous() and not column.is_cuda:
        return column
    return column.to("cpu", dtype).contiguous()
