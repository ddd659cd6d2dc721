"""Tensor-level entry points of the logits-path CUDA kernels (csrc/sampling.h).

Each function launches one kernel on the current torch stream and returns without synchronising.
Per-row tensors are indexed by logits row; `rows` (int32, on the device) restricts a launch to a
subset of rows, and outputs are written only at those rows. Used by the GPU tests and the kernel
benchmark. The CUDA backend (cuda.py) calls the `launch_*` forms underneath them, which take device
addresses it has already laid out (no tensor checks per launch), and the two copy helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tokensampler_server.backends.cuda_buffers import grown
from tokensampler_server.backends.cuda_build import load_kernels
from tokensampler_server.model.sampling import ROW_FIELDS

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The kernels' dtype codes of logits (csrc/sampling.h TsLogits.dtype)."""
# The route planner's plan of one call (csrc/routes.h TsPlan, bound as the module's Plan): its groups of rows,
# (first, n) each, the exact group's route, the filter's blocks a row and the row ids it wrote.
Plan = Any


NO_BITMASK = [0, 0, 0, 0]
"""The token-bitmask entries of a launch's params when no row has a mask or a floor."""


def bitmask_entries(token_bitmask: torch.Tensor | None, bitmask_row: torch.Tensor | None = None) -> list[int]:
    """The last four entries of a launch's params (csrc/sampling.h, TsBitmask): the words of int32 [M, W] masks on
    the device (docs/semantics.md, choice 17), the address of int32 [B] mask rows (row r's mask is row
    bitmask_row[r], -1: none; None: row r), W, and no floor."""
    if token_bitmask is None:
        return NO_BITMASK
    if token_bitmask.dtype != torch.int32 or token_bitmask.dim() != 2 or not token_bitmask.is_contiguous():
        raise ValueError("token_bitmask: a contiguous int32 [M, W] tensor expected")
    if bitmask_row is not None and (bitmask_row.dtype != torch.int32 or not bitmask_row.is_contiguous()):
        raise ValueError("bitmask_row: contiguous int32 expected")
    return [token_bitmask.data_ptr(), bitmask_row.data_ptr() if bitmask_row is not None else 0,
            token_bitmask.shape[1], 0]


def stream_address(device: torch.device) -> int:
    """The current torch stream of `device` (a tensor's device: indexed) as a cudaStream_t address. torch's raw
    getter takes 0.15-0.2 µs a call where torch.cuda.current_stream() takes 4-7 (H200 hosts)."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters on the device, each [B] (docs/semantics.md), and the rows' token bitmasks."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int32, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    min_p: torch.Tensor  # float32, 0 = off
    seed: torch.Tensor  # int64 (uint64 bits)
    position: torch.Tensor  # int64
    iteration: torch.Tensor  # int64
    token_bitmask: torch.Tensor | None = None  # int32 [M, W]: the kernels read disallowed tokens as -inf
    bitmask_row: torch.Tensor | None = None  # int32 [B]: row r's mask row, -1 = none; None: row r

    @staticmethod
    def make(num_rows: int, device: torch.device, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, seed: int = 0, position: int = 0, iteration: int = 0) -> "RowParams":
        """The same values in every row (the benchmark's per-row tensors)."""
        def full(value: float | int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((num_rows,), value, dtype=dtype, device=device)

        return RowParams(full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
                         full(min_p, torch.float32), full(seed, torch.int64), full(position, torch.int64),
                         full(iteration, torch.int64))

    @cached_property
    def _addresses(self) -> list[int]:
        return [getattr(self, name).data_ptr() for name in ROW_FIELDS] + bitmask_entries(self.token_bitmask,
                                                                                          self.bitmask_row)

    def pointers(self) -> list[int]:
        """The 7 device addresses and the 4 bitmask entries (bitmask_entries), in the launchers' order (the fields
        never change: computed once)."""
        return self._addresses


@dataclass
class Outputs:
    """What the kernels write, indexed by logits row; None = not asked for."""

    tokens: torch.Tensor | None = None  # int64 [B, num_samples]
    flags: torch.Tensor | None = None  # uint8 [B]: 1 nan_detected, 2 not valid, 4 needs the CPU path
    row_max: torch.Tensor | None = None  # float32 [B]
    row_min: torch.Tensor | None = None
    row_logz: torch.Tensor | None = None
    kept_mass: torch.Tensor | None = None
    kept_min_key: torch.Tensor | None = None  # int64 [B]

    @classmethod
    def row_stats(cls, rows: int, device: torch.device | str) -> Outputs:
        """Buffers for what stats_kernel (and the frontier kernel) write for `rows` rows: the argmax as tokens
        [rows, 1], flags, row max and min; the two-launch routes pass them to their second kernel."""
        return cls(tokens=torch.empty(rows, 1, dtype=torch.int64, device=device),
                   flags=torch.empty(rows, dtype=torch.uint8, device=device),
                   row_max=torch.empty(rows, dtype=torch.float32, device=device),
                   row_min=torch.empty(rows, dtype=torch.float32, device=device))

    def pointers(self) -> list[int]:
        return [t.data_ptr() if t is not None else 0 for t in (self.tokens, self.flags, self.row_max, self.row_min,
                                                               self.row_logz, self.kept_mass, self.kept_min_key)]


class Kernels:
    """The compiled kernels of one device with their reusable workspace.

    Launches go on torch's current stream; workspace buffers are reused by consecutive launches, which
    that stream orders. Not for concurrent use from several threads or streams.
    """

    def __init__(self, device_index: int = 0) -> None:
        self.device = torch.device("cuda", device_index)
        self.module = load_kernels(device_index)
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._hist = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self._scratch = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.fallback_count = torch.zeros(1, dtype=torch.int64, device=self.device)
        """Exact re-evaluations made inside the kernels (close calls, cut-bin resolutions)."""
        self._ws: list[int] | None = None  # the workspace addresses, rebuilt when a buffer grows
        self._scratch_need: dict[tuple[str, int, int, int], int] = {}

    kernel_names = ("stats_kernel", "gumbel_kernel", "gumbel_kernel<min-p>", "topk_kernel<16..256>",
                    "frontier_kernel", "nucleus_mass_kernel", "nucleus_exact_mass_kernel", "filter_kernel",
                    "apply_bitmask_kernel")

    # -- workspace ---------------------------------------------------------------------------------
    def _workspace(self, num_work: int, scratch_bytes: int, hist_bytes: int = 0) -> list[int]:
        """Counters for num_work rows, scratch and zeroed histograms of at least these sizes (grown, never shrunk)."""
        counters, scratch, hist = self._counters, self._scratch, self._hist
        self._counters = grown(counters, num_work, zeroed=True)
        self._scratch = grown(scratch, scratch_bytes)
        self._hist = grown(hist, hist_bytes, zeroed=True, double=False)
        if self._ws is None or self._counters is not counters or self._scratch is not scratch or self._hist is not hist:
            self._ws = [self._counters.data_ptr(), self._hist.data_ptr(), self._scratch.data_ptr(),
                        self.fallback_count.data_ptr()]
        return self._ws

    def _scratch_bytes(self, kind: str, num_work: int, vocab: int, bucket: int = 0) -> int:
        """The launcher's scratch size (sampling.h), remembered per shape."""
        key = (kind, num_work, vocab, bucket)
        size = self._scratch_need.get(key)
        if size is None:
            if kind == "stats":
                size = self.module.stats_scratch_bytes(num_work, vocab)
            elif kind == "gumbel":
                size = self.module.gumbel_scratch_bytes(num_work, vocab)
            elif kind == "nucleus":
                size = self.module.nucleus_scratch_bytes(num_work, vocab)
            else:
                size = self.module.topk_scratch_bytes(num_work, vocab, bucket)
            if len(self._scratch_need) >= 4096:
                self._scratch_need.clear()
            self._scratch_need[key] = size
        return size

    def _logits(self, logits: torch.Tensor) -> tuple[int, int, int, int]:
        if logits.device != self.device or logits.dim() != 2 or not logits.is_contiguous():
            raise ValueError("logits: a contiguous [B, V] tensor on the kernels' device expected")
        if logits.dtype not in DTYPE_CODES:
            raise ValueError(f"logits: float32, float16 or bfloat16 expected, got {logits.dtype}")
        return logits.data_ptr(), logits.shape[0], logits.shape[1], DTYPE_CODES[logits.dtype]

    @staticmethod
    def _rows(rows: torch.Tensor | None, num_rows: int) -> tuple[int, int]:
        if rows is None:
            return 0, num_rows
        if rows.dtype != torch.int32 or not rows.is_contiguous():
            raise ValueError("rows: contiguous int32 expected")
        return rows.data_ptr(), rows.numel()

    def current_stream(self) -> int:
        """The current torch stream of the kernels' device, as a cudaStream_t address."""
        return stream_address(self.device)

    # -- launches on device addresses (the backend's path: no tensor checks) --------------------------
    # params: the 10 entries of RowParams.pointers(); out: the 7 of Outputs.pointers(); rows: the
    # address of int32 row ids (0: rows 0 .. num_work - 1). Logits: (address, rows, vocab, dtype code).
    def launch_stats(self, data: int, b: int, v: int, dt: int, rows: int, num_work: int, params: list[int],
                     lse_scale: int, out: list[int], num_samples: int, stream: int) -> None:
        ws = self._workspace(num_work, self._scratch_bytes("stats", num_work, v))
        self.module.stats(data, b, v, dt, rows, num_work, params, lse_scale, out, num_samples, ws, stream)

    def launch_gumbel(self, data: int, b: int, v: int, dt: int, rows: int, num_work: int, params: list[int],
                      lse_scale: int, out: list[int], num_samples: int, sample: int, stream: int) -> None:
        ws = self._workspace(num_work, self._scratch_bytes("gumbel", num_work, v))
        self.module.gumbel(data, b, v, dt, rows, num_work, params, lse_scale, out, num_samples, sample, ws, stream)

    def launch_min_p(self, data: int, b: int, v: int, dt: int, rows: int, num_work: int, params: list[int],
                     row_max: int, out: list[int], num_samples: int, sample: int, stream: int) -> None:
        """min-p alone: Gumbel-max over the tokens min-p keeps, after launch_stats on the same rows (row_max:
        the address of its row max)."""
        ws = self._workspace(num_work, self._scratch_bytes("gumbel", num_work, v))
        self.module.min_p(data, b, v, dt, rows, num_work, params, row_max, out, num_samples, sample, ws, stream)

    def launch_topk(self, data: int, b: int, v: int, dt: int, rows: int, num_work: int, params: list[int],
                    bucket: int, out: list[int], num_samples: int, stream: int) -> None:
        ws = self._workspace(num_work, self._scratch_bytes("topk", num_work, v, bucket))
        self.module.topk(data, b, v, dt, rows, num_work, params, bucket, out, num_samples, ws, stream)

    def launch_nucleus(self, data: int, b: int, v: int, dt: int, rows: int, num_work: int, params: list[int],
                       pre: list[int], out: list[int], num_samples: int, sample: int, stream: int) -> None:
        """Top-p/min-p without k from a frontier of candidates (csrc/nucleus.cuh). pre: what stats() writes
        (tokens [B, 1], flags, row_max, row_min), for launch_filter on the same rows, which must follow:
        it samples the rows this left undecided."""
        ws = self._workspace(num_work, self._scratch_bytes("nucleus", num_work, v))
        self.module.nucleus(data, b, v, dt, rows, num_work, params, pre, out, num_samples, sample, ws, stream)

    def launch_filter(self, data: int, b: int, v: int, dt: int, rows: int, num_work: int, params: list[int],
                      stats: list[int], need_exact_mass: bool, out: list[int], num_samples: int, sample: int,
                      stream: int, after_frontier: bool = False) -> None:
        """stats: row_max, row_min, argmax ([B, 1] int64) and flags of stats() on the same rows, or of the frontier
        (after_frontier: the grid the route planner gives that route)."""
        splits = self.module.filter_splits(num_work, after_frontier)
        ws = self._workspace(num_work, 0, self.module.hist_bytes(num_work) if splits > 1 else 0)
        self.module.filter(data, b, v, dt, rows, num_work, params, stats, int(need_exact_mass), splits, out,
                           num_samples, sample, ws, stream)

    def launch_apply_bitmask(self, data: int, b: int, v: int, bitmask: list[int], stream: int) -> None:
        """Writes -inf into fp32 logits (address, rows, vocab) wherever bitmask (bitmask_entries) disallows a token:
        for logits that other processing changes afterwards."""
        self.module.apply_bitmask(data, b, v, *bitmask, stream)

    # -- the routes of a call (csrc/routes.h): the backend's path ------------------------------------
    def stage_layout(self, num_rows: int) -> dict[str, int]:
        """Byte offsets of the per-row arrays in the upload of num_rows rows (TsStageLayout)."""
        return self.module.stage_layout(num_rows)

    def plan(self, host_stage: int, num_rows: int, vocab: int, num_samples: int, kind: int, processing: bool,
             routing: int) -> Plan:
        """Groups the rows whose parameters lie in the pinned stage at `host_stage` for a call of num_samples samples
        a row (ts_plan): kind is the module's TOKENS, LOGPROBS_RAW or LOGPROBS_PROCESSED, routing its ROUTES_FAST,
        ROUTES_EXACT (every filtered row to the exact filter), ROUTES_SETTLED (flagged rows sampled again on the
        device; TOKENS only) or ROUTES_FLAGGED (only that second pass, over every filtered row, for the rows the fused
        kernel flagged; TOKENS only)."""
        return self.module.plan(host_stage, num_rows, vocab, num_samples, kind, processing, routing)

    def launch_plan(self, plan: Plan, x: torch.Tensor, bitmask: list[int], lse_scale: int, raw_x: torch.Tensor | None,
                    raw_lse_scale: int, dev_stage: int, main: list[int], filt: list[int], pre: list[int],
                    raw: list[int], exact_bits: int, stream: int, ws: list[int] | None = None) -> None:
        """Every launch of `plan` (ts_launch_plan, the plan's samples a row) on x, whose rows the device copy of the
        stage at dev_stage describes. main, filt, pre, raw: the 7 output addresses of each (Outputs.pointers() order);
        raw_x: the input logits of the need_raw pass; exact_bits: uint8 [B] scratch; ws: a workspace of the plan's own
        (plan_workspace), else the shared one."""
        if ws is None:
            counters, hist, scratch = plan.workspace()
            ws = self._workspace(counters // 4, scratch, hist)
        data, _, _, dt = self._logits(x)
        raw_data, raw_dt = (raw_x.data_ptr(), DTYPE_CODES[raw_x.dtype]) if raw_x is not None and plan.need_raw[1] else (0, 0)
        self.module.launch_plan(plan, data, dt, bitmask, lse_scale, raw_data, raw_dt, raw_lse_scale, dev_stage, main,
                                filt, pre, raw, exact_bits, ws, stream)

    def plan_workspace(self, plan: Plan) -> tuple[list[int], tuple[torch.Tensor, ...]]:
        """A workspace of the plan's own (ts_plan_workspace's sizes), for launches that must find it at the same
        addresses every time (a captured CUDA graph): its four addresses and the buffers behind them."""
        counters, hist, scratch = plan.workspace()
        buffers = (torch.zeros(max(counters, 1), dtype=torch.uint8, device=self.device),
                   torch.zeros(max(hist, 1), dtype=torch.uint8, device=self.device),
                   torch.empty(max(scratch, 1), dtype=torch.uint8, device=self.device))
        return [b.data_ptr() for b in buffers] + [self.fallback_count.data_ptr()], buffers

    def copy_to_device(self, device_address: int, host_address: int, nbytes: int, stream: int) -> None:
        """Asynchronous copy from pinned host memory, ordered on `stream`."""
        self.module.copy_h2d(device_address, host_address, nbytes, stream)

    def copy_to_host_and_wait(self, host_address: int, device_address: int, nbytes: int, stream: int) -> None:
        """Copies into pinned host memory after everything queued on `stream`, and waits for it (the GIL
        is released while waiting)."""
        self.module.copy_d2h_sync(host_address, device_address, nbytes, stream)

    # -- launches on tensors -------------------------------------------------------------------------
    def apply_bitmask(self, logits: torch.Tensor, token_bitmask: torch.Tensor,
                      bitmask_row: torch.Tensor | None = None) -> None:
        """Disallowed tokens of float32 logits [B, V] become -inf, in place (bitmask_entries' arguments)."""
        if logits.dtype != torch.float32:
            raise ValueError(f"logits: float32 expected, got {logits.dtype}")
        data, b, v, _ = self._logits(logits)
        self.launch_apply_bitmask(data, b, v, bitmask_entries(token_bitmask, bitmask_row), self.current_stream())

    def stats(self, logits: torch.Tensor, params: RowParams, out: Outputs, *, rows: torch.Tensor | None = None,
              lse_scale: torch.Tensor | None = None) -> None:
        """Row max/min/argmax/nan (+ log-sum-exp with lse_scale); out.tokens gets the argmax: greedy."""
        data, b, v, dt = self._logits(logits)
        rptr, n = self._rows(rows, b)
        ns = out.tokens.shape[1] if out.tokens is not None else 1
        self.launch_stats(data, b, v, dt, rptr, n, params.pointers(),
                          lse_scale.data_ptr() if lse_scale is not None else 0, out.pointers(), ns, self.current_stream())

    def gumbel(self, logits: torch.Tensor, params: RowParams, out: Outputs, sample: int, *,
               rows: torch.Tensor | None = None, lse_scale: torch.Tensor | None = None) -> None:
        """Gumbel-max over the whole vocabulary: column `sample` of out.tokens."""
        data, b, v, dt = self._logits(logits)
        rptr, n = self._rows(rows, b)
        self.launch_gumbel(data, b, v, dt, rptr, n, params.pointers(),
                           lse_scale.data_ptr() if lse_scale is not None else 0, out.pointers(),
                           out.tokens.shape[1], sample, self.current_stream())

    def min_p(self, logits: torch.Tensor, params: RowParams, stats: Outputs, out: Outputs, sample: int, *,
              rows: torch.Tensor | None = None) -> None:
        """min-p alone (no k, no top-p) of column `sample`, after stats() on the same rows (stats.row_max)."""
        data, b, v, dt = self._logits(logits)
        rptr, n = self._rows(rows, b)
        self.launch_min_p(data, b, v, dt, rptr, n, params.pointers(), stats.row_max.data_ptr(), out.pointers(),
                          out.tokens.shape[1], sample, self.current_stream())

    def topk(self, logits: torch.Tensor, params: RowParams, out: Outputs, bucket: int, *,
             rows: torch.Tensor | None = None) -> None:
        """top-k (k + 1 <= bucket) with top-p/min-p: every column of out.tokens."""
        data, b, v, dt = self._logits(logits)
        rptr, n = self._rows(rows, b)
        self.launch_topk(data, b, v, dt, rptr, n, params.pointers(), bucket, out.pointers(), out.tokens.shape[1],
                         self.current_stream())

    def filter(self, logits: torch.Tensor, params: RowParams, stats: Outputs, out: Outputs, sample: int, *,
               rows: torch.Tensor | None = None, need_exact_mass: bool = False, after_frontier: bool = False) -> None:
        """Exact top-p/min-p/large-k sampling of column `sample`, after stats() on the same rows.

        `stats` is what stats() wrote: row_max, row_min, flags, and tokens [B, 1] (the argmax).
        """
        if stats.tokens is None or stats.tokens.shape[1] != 1:
            raise ValueError("stats.tokens: the [B, 1] argmax of stats() expected")
        data, b, v, dt = self._logits(logits)
        rptr, n = self._rows(rows, b)
        self.launch_filter(data, b, v, dt, rptr, n, params.pointers(),
                           [stats.row_max.data_ptr(), stats.row_min.data_ptr(), stats.tokens.data_ptr(),
                            stats.flags.data_ptr()],
                           need_exact_mass, out.pointers(), out.tokens.shape[1], sample, self.current_stream(),
                           after_frontier)

    def nucleus(self, logits: torch.Tensor, params: RowParams, pre: Outputs, out: Outputs, sample: int, *,
                rows: torch.Tensor | None = None) -> None:
        """Top-p/min-p without k, then filter() for the rows the frontier leaves: column `sample` of
        out.tokens. pre gets stats()' outputs (tokens [B, 1], flags, row_max, row_min)."""
        data, b, v, dt = self._logits(logits)
        rptr, n = self._rows(rows, b)
        self.launch_nucleus(data, b, v, dt, rptr, n, params.pointers(), pre.pointers(), out.pointers(),
                            out.tokens.shape[1], sample, self.current_stream())
        self.filter(logits, params, pre, out, sample, rows=rows, after_frontier=True)

    def noise(
        self, seed: int, position: int, iteration: int, sample: int, vocab: int, split_products: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Philox words (int64 holding uint32) and exact Gumbel noise of one row: for tests. split_products: the
        words computed with the product form of the kernels that take PhiloxProducts::kSplit (csrc/philox.cuh)."""
        words = torch.empty(vocab, dtype=torch.int32, device=self.device)
        noise = torch.empty(vocab, dtype=torch.float32, device=self.device)
        self.module.noise(seed, position, iteration, sample, vocab, split_products, words.data_ptr(), noise.data_ptr(),
                          self.current_stream())
        return words.to(torch.int64) & 0xFFFFFFFF, noise

    def topk_bucket(self, k: int) -> int:
        return self.module.topk_bucket(k)
