"""The device buffers of one sampling call on the CUDA backend: the stage that carries the rows' parameters and
the plan's row lists up (csrc/routes.h ts_stage_layout), and the kernels' outputs, both laid out on reused buffers."""

from __future__ import annotations

import torch

from tokensampler_server.model.sampling import RowSampling

__all__ = ["FLAG_UNSETTLED", "FLAG_INVALID", "FLAG_NAN", "CallOutputs", "Stage", "grown", "row_states"]

# The kernels' per-row flags (csrc/sampling.h TS_ROW_*): FLAG_UNSETTLED, a fast kernel could not settle the row
# exactly, and a slower route samples it (the exact filter after the logits kernels, the logits path after the fused one).
FLAG_NAN, FLAG_INVALID, FLAG_UNSETTLED = 1, 2, 4

_ALIGN = 16  # device-buffer offsets


def row_states(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, nan_detected) of each row, from the flags its kernels wrote."""
    return (flags & FLAG_INVALID) == 0, (flags & FLAG_NAN) != 0


def grown(t: torch.Tensor, numel: int, *, zeroed: bool = False, double: bool = True,
          pinned: bool = False) -> torch.Tensor:
    """`t` while it holds `numel` elements, else a new buffer of its dtype and device, zeroed when asked (for the
    kernels' counters and histograms, which they leave zeroed), in pinned host memory when `pinned` (a buffer that
    uploads run from): grown on demand, never shrunk, and to twice the old size where `double`, so that a need that
    creeps up reallocates rarely."""
    if t.numel() >= numel:
        return t
    size = max(numel, 2 * t.numel()) if double else numel
    return (torch.zeros if zeroed else torch.empty)(size, dtype=t.dtype, device=t.device, pin_memory=pinned)


def _align(offset: int, alignment: int = _ALIGN) -> int:
    return (offset + alignment - 1) // alignment * alignment


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class Stage:
    """Typed views of the upload buffers (pinned host, device) of B rows, laid out as csrc/routes.h's
    ts_stage_layout says: the parameters (int64 seed, position, iteration; float32 temperature, top_p, min_p;
    int32 top_k), three bool row masks, the row lists of the plan, the rows' token-bitmask rows and the bitmask
    words."""

    def __init__(self, host: torch.Tensor, dev: torch.Tensor, num_rows: int, layout: dict[str, int]) -> None:
        b = num_rows
        self.num_rows = b
        self.layout = layout
        # The layout puts seed, position, iteration back to back, then temperature (T_eff once planned), top_p, min_p:
        # each group fills with one copy.
        self.h_i64 = host[layout["seed"]: layout["temperature"]].view(torch.int64)
        self.h_f32 = host[layout["temperature"]: layout["top_k"]].view(torch.float32)
        self.h_topk = host[layout["top_k"]: layout["top_k"] + 4 * b].view(torch.int32)
        self.lists = layout["lists"]
        self.bitmask_row, self.bitmask_words = layout["bitmask_row"], layout["bitmask_words"]
        self.h_bitmask_row = host[self.bitmask_row: self.bitmask_row + 4 * b].view(torch.int32)
        self.host, self.dev = host, dev
        self.host_base, self.dev_base = host.data_ptr(), dev.data_ptr()
        self._t_eff: torch.Tensor | None = None
        self._masks: torch.Tensor | None = None

    def fill(self, row: RowSampling) -> None:
        """The rows' parameters into the host stage, one copy per element type."""
        i64, f32 = torch.int64, torch.float32
        torch.cat([_as(row.seed, i64), _as(row.position, i64), _as(row.iteration, i64)], out=self.h_i64)
        torch.cat([_as(row.temperature, f32), _as(row.top_p, f32), _as(row.min_p, f32)], out=self.h_f32)
        self.h_topk.copy_(row.top_k)

    def host_words(self, num_mask_rows: int, width: int) -> torch.Tensor:
        """int32 [num_mask_rows, width]: the bitmask words' place in the host stage (sized by the caller)."""
        at = self.bitmask_words
        return self.host[at: at + 4 * num_mask_rows * width].view(torch.int32).view(num_mask_rows, width)

    def dev_counters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """seed, position, iteration: int64 [B] on the device, where the kernels read them."""
        at = self.layout["seed"]
        return self.dev[at: at + 24 * self.num_rows].view(torch.int64).view(3, self.num_rows).unbind(0)

    def dev_t_eff(self) -> torch.Tensor:
        if self._t_eff is None:
            at = self.layout["temperature"]
            self._t_eff = self.dev[at: at + 4 * self.num_rows].view(torch.float32)
        return self._t_eff

    def dev_masks(self) -> torch.Tensor:
        """use_filt, through, need_raw: bool [3, B] on the device (written by the plan of a log-prob call)."""
        if self._masks is None:
            at = self.layout["masks"]
            self._masks = self.dev[at: at + 3 * self.num_rows].view(torch.bool).view(3, self.num_rows)
        return self._masks


class CallOutputs:
    """Kernel outputs of B rows and S samples in one device buffer. The main tokens [B, S] (int64) and
    flags [B] come first and back-to-back: they are what returns to the host, in one copy."""

    _FIELDS = (  # name, element size, dtype, per-row elements (0: S)
        ("filt_tokens", 8, torch.int64, 0), ("pre_tokens", 8, torch.int64, 1), ("kept_min_key", 8, torch.int64, 1),
        ("main_row_max", 4, torch.float32, 1), ("main_row_min", 4, torch.float32, 1),
        ("main_row_logz", 4, torch.float32, 1), ("filt_row_max", 4, torch.float32, 1),
        ("kept_mass", 4, torch.float32, 1), ("pre_row_min", 4, torch.float32, 1),
        ("raw_row_max", 4, torch.float32, 1), ("raw_row_min", 4, torch.float32, 1),
        ("raw_row_logz", 4, torch.float32, 1), ("filt_flags", 1, torch.uint8, 1), ("pre_flags", 1, torch.uint8, 1),
        ("raw_flags", 1, torch.uint8, 1), ("exact_bits", 1, torch.uint8, 1),
    )

    @staticmethod
    def offsets(num_rows: int, num_samples: int) -> tuple[dict[str, int], int]:
        b, s = num_rows, num_samples
        offsets = {"main_tokens": 0, "main_flags": 8 * b * s}
        end = 8 * b * s + b
        for name, size, _, per_row in CallOutputs._FIELDS:
            offsets[name] = _align(end)
            end = offsets[name] + size * b * (per_row or s)
        return offsets, end

    def __init__(self, host: torch.Tensor | None, dev: torch.Tensor, num_rows: int, num_samples: int) -> None:
        """host: the pinned buffer the main tokens and flags come back to (None: they stay on the device)."""
        b, s = num_rows, num_samples
        self.num_rows, self.num_samples, self.dev = b, s, dev
        self.off, _ = CallOutputs.offsets(b, s)
        self.d2h_bytes = 8 * b * s + b
        if host is not None:
            self.h_tokens = host[: 8 * b * s].view(torch.int64).view(b, s)
            self.h_flags = host[8 * b * s: 8 * b * s + b]
            self.host_base = host.data_ptr()
        self.dev_base = d = dev.data_ptr()
        a = {name: d + off for name, off in self.off.items()}
        # Outputs.pointers() order: tokens, flags, row_max, row_min, row_logz, kept_mass, kept_min_key.
        self.main = [a["main_tokens"], a["main_flags"], a["main_row_max"], a["main_row_min"], a["main_row_logz"], 0, 0]
        self.filt = [a["filt_tokens"], a["filt_flags"], a["filt_row_max"], 0, 0, a["kept_mass"], a["kept_min_key"]]
        # Without log-probs every row is written by exactly one group: filtered rows share the main arrays.
        self.filt_shared = [a["main_tokens"], a["main_flags"], a["filt_row_max"], 0, 0, a["kept_mass"], a["kept_min_key"]]
        self.pre = [a["pre_tokens"], a["pre_flags"], a["filt_row_max"], a["pre_row_min"], 0, 0, 0]
        self.raw = [0, a["raw_flags"], a["raw_row_max"], a["raw_row_min"], a["raw_row_logz"], 0, 0]
        self.exact_bits = a["exact_bits"]
        self._views: dict[str, torch.Tensor] = {}

    def view(self, name: str) -> torch.Tensor:
        """A field as a device tensor: main/filt tokens [B, S], pre_tokens [B, 1], the others [B]."""
        t = self._views.get(name)
        if t is None:
            b, s = self.num_rows, self.num_samples
            if name in ("main_tokens", "filt_tokens"):
                size, dtype, shape = 8, torch.int64, (b, s)
            elif name == "main_flags":
                size, dtype, shape = 1, torch.uint8, (b,)
            else:
                size, dtype = next((f[1], f[2]) for f in CallOutputs._FIELDS if f[0] == name)
                shape = (b, 1) if name == "pre_tokens" else (b,)
            count = shape[0] * (shape[1] if len(shape) == 2 else 1)
            off = self.off[name]
            t = self.dev[off: off + size * count].view(dtype).view(shape)
            self._views[name] = t
        return t
