"""The `cuda` backend: docs/semantics.md on the GPU with the compiled kernels of csrc/.

Rows are routed by their parameters (known on the host, so routing costs no synchronisation) in one place,
csrc/routes.cpp, which the native path (csrc/native_path.cpp) calls too:
  greedy (T == 0)               -> stats_kernel: argmax, with the raw log-sum-exp in the same pass
  T > 0, no filter              -> gumbel_kernel: one read, exact up to an in-kernel re-score
  0 < k, k + 1 <= 256           -> topk_kernel<bucket>: one read, min-p and top-p on the candidates
  top-p without k (+ min-p)     -> frontier_kernel + nucleus_mass_kernel, then filter_kernel for the rows
                                   the frontier cannot settle (32 rows or more; below, stats + filter)
  min-p alone                   -> stats_kernel, then gumbel_kernel over the tokens min-p keeps (a mask
                                   from the row max)
  k > 255 without top-p         -> stats_kernel, filter_kernel's cut form once (the kept set's last key, from
                                   counts alone; cut_collect_kernel reads the cut range where a row has several
                                   blocks), then gumbel_kernel with that set as a mask, a sample
  k > 255 with top-p, processed log-probs
                                -> stats_kernel then filter_kernel: exact binned cut, any k, p and min-p (with
                                   cut_collect_kernel, as above, where a row has several blocks)
A token bitmask (structured output) is read by every kernel above as it loads the logits, a disallowed token
read as -inf: a batch whose only processing is a bitmask reads its logits once, as without one. So does a batch
whose only processing is allowed and banned token lists (min_tokens' bans among them), made into bitmask rows on
the host when few rows have them (entry_masks.py), and one whose only processing is no-repeat-n-gram's bans, made
into a mask on the GPU from the rows' sequences (cuda_sequence_samplers.py), and one of float32 logits whose only
processing is the local samplers (top-n-sigma, typical-p, XTC), whose kernels leave the tokens they keep as a mask
(top-n-sigma alone: a floor a row; cuda_local_samplers.py). DRY alone is subtracted from a float32 copy by kernels
of its own, from the same tiles. Other processing (bias, penalties, those lists beside a request's own bitmask or on
many rows, several kinds together) runs first, in torch on the GPU (processing.apply_processing), on a float32 copy
into which the bitmask is written first by a small in-place kernel; then the local samplers (top-n-sigma,
typical-p, XTC) by their own kernels on the same copy (cuda_local_samplers.py, csrc/local_samplers.cuh).
Hidden states through a registered head go through the fused LM-head kernel (cuda_fused.py), or, with
--vocab-parallel-devices, through the head split by vocabulary rows over several GPUs (cuda_vocab_parallel.py).
Rows a fast kernel cannot settle exactly (flag 4: z-order ties at the top-k cut, an overflowing candidate
buffer; rare by construction) are sampled again through stats + filter, which settles every row, after
the one synchronisation that returns the results: no request leaves the GPU (out of device memory is
RESOURCE_EXHAUSTED). `fallbacks()` counts both kinds of re-evaluation.

Host path of one call (docs/design/host-path.md): the per-row parameters are packed into one reused pinned
buffer, where the route planner writes the row lists of its groups (a group of every row needs no list) and, with
log-probs, the row masks; with a token bitmask beside them, the buffer goes up in ONE copy; the kernels are
launched on device addresses laid out once per (B, samples) in one reused device buffer; without log-probs every
kernel writes its rows' tokens and flags into the same two arrays, which come back in ONE copy that is also the
call's one synchronisation. Reusing the pinned
buffers across calls is safe because every call ends with that synchronisation and calls hold a lock.
With log-probs the torch post-processing below runs on views of the same buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import torch

from tokensampler_server.core.fallbacks import record_fallback
from tokensampler_server.model.sampling import (LogitProcessing, LogprobsMode, SamplingBatch, SamplingResult,
                                                 merge_rows, select_rows)
from tokensampler_server.backends import cuda_fused, cuda_prepared_hidden
from tokensampler_server.backends.base import Backend, BackendInfo, PreparedSampling, Route, ThroughHead
from tokensampler_server.backends.cuda_buffers import FLAG_UNSETTLED, FLAG_NAN, CallOutputs, Stage, grown, row_states
from tokensampler_server.backends.cuda_build import CudaBackendUnavailable
from tokensampler_server.backends.cuda_kernels import NO_BITMASK, Kernels, Plan
from tokensampler_server.backends.mps import mps_state
from tokensampler_server.backends.cuda_local_samplers import LocalSamplerKernels, truncation_only
from tokensampler_server.backends.cuda_sequence_samplers import SequenceSamplerKernels, bans_only, penalties_only
from tokensampler_server.backends.cuda_logprobs import LogprobCall, sample_with_logprobs
from tokensampler_server.backends.cuda_prepared import CudaPreparedSampling
from tokensampler_server.backends.cuda_prepared_hidden import CudaPreparedHidden
from tokensampler_server.backends.cuda_vocab_parallel import DeviceGroup, SplitHeads
from tokensampler_server.backends.entry_masks import EntryMask, entry_mask, fill_mask_words, words_of
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.resources.weights import RegisteredWeight

__all__ = ["CudaBackend", "CudaBackendUnavailable"]

# What GetServerInfo reports of the routes above; the figures are H200 measurements at V = 151936, B = 1-256
# (docs/performance.md, benchmarks/results/).
ROUTES = [
    Route("greedy (T = 0)", ("stats_kernel",), "one read: 0.61-0.70x torch argmax (7-49 us)"),
    Route("T > 0, no filter", ("gumbel_kernel",),
          "one read (every sample in one launch): 0.83-1.21x torch argmax (11-84 us)"),
    Route("0 < k, k + 1 <= 256, with or without top-p / min-p", ("topk_kernel",),
          "one read: 1.15-1.38x torch argmax (16-91 us)"),
    Route("top-p without k (and min-p), 32 rows or more",
          ("frontier_kernel", "nucleus_mass_kernel", "filter_kernel"), "two reads: 37-151 us at B = 32-256"),
    Route("top-p without k (and min-p), fewer than 32 rows, fewer than 8 samples a row",
          ("stats_kernel", "filter_kernel", "cut_collect_kernel"),
          "two reads a sample, and the cut bin re-read by the row's blocks: 29-38 us at B = 1-8"),
    Route("min-p alone", ("stats_kernel", "gumbel_kernel"), "two reads (every sample in one launch): 14-137 us"),
    Route("k > 255 (any k up to V, per row) without top-p, with or without min-p; with top-p from 2 samples a row; "
          "top-p without k below 32 rows from 8 samples",
          ("stats_kernel", "filter_kernel", "cut_collect_kernel", "gumbel_kernel"),
          "three reads, and each row's cut bin re-read by the row's blocks, once for every sample; then one read a "
          "sample, every sample in one launch: 1.5-3.6x the top-k 50 call, 76-545 us a call at B = 1-256 (one "
          "sample, without top-p); 64 samples: 0.1-0.4 ms at B = 1-8, 3.9-6.1 ms at B = 256"),
    Route("k > 255 with top-p (and min-p), one sample; processed log-probs",
          ("stats_kernel", "filter_kernel", "cut_collect_kernel"),
          "two reads a sample, and each row's cut range re-read by the row's blocks (top-p's bins and the k cut's "
          "bin; radix passes by one block when those hold more than 4096 tokens): 1.6-4.1x the top-k 50 call, "
          "82-584 us a call at B = 1-256"),
    Route("rows with a token bitmask (structured output), or with allowed or banned lists (min_tokens' bans) as "
          "their only processing",
          ("the route of the rows' parameters", "apply_bitmask_kernel beside other processing"),
          "without other processing, the same kernels, each reading the mask with the logits (1/32 more bytes at "
          "fp32): 0.92-1.07x the unmasked call at B = 1-256 (benchmarks/bench_structured.py); lists become mask "
          "rows on the host (one for all when every row's lists are the same)"),
    Route("rows whose only processing is no-repeat-n-gram (or DRY), before the route of their parameters",
          SequenceSamplerKernels.kernel_names,
          "no-repeat-n-gram: one block a tile of the rows' sequences clears the banned tokens' bits in a mask of all "
          "ones (B x V / 8 bytes), and the masked kernels read the raw logits once; DRY: two passes over the tiles "
          "subtract each token's largest penalty from the float32 copy (docs/performance.md, \"Local samplers\")"),
    Route("rows with top-n-sigma, typical-p or XTC (the local samplers), before the route of their parameters",
          LocalSamplerKernels.kernel_names,
          "from per-row statistics (float64; XTC's sums float32 under a bound, decided in float64): top-n-sigma two "
          "reads, XTC one, typical-p three (no sort of the row); alone on float32 logits they leave a bitmask of "
          "the kept tokens that the route reads with the raw logits (top-n-sigma alone: one read, a floor a row), "
          "otherwise they cut the processing copy in place; a whole call 1.1-1.3x (top-n-sigma), 1.4-1.5x (XTC), "
          "2.4-3.8x (typical-p) the top-k 50 + top-p 0.9 call at B = 1-256"),
    Route("rows a fast kernel cannot settle (z-ties past the top-k list, overflowing candidates)",
          ("stats_kernel", "filter_kernel"),
          "the exact filter again after the call's synchronisation (a prepared call: on the device, right after "
          "the top-k kernel)"),
    Route("hidden states with a registered head, up to 128 rows (64 with filters)", ("fused_stream_kernel",),
          "one read of W: 0.96-1.01x its HBM roofline up to B = 64"),
    Route("hidden states with a registered head, more rows", ("cuBLAS", "then the route of the rows' parameters"),
          "cuBLAS's matmul into fp32 logits, then the routes above: 1.24x cuBLAS alone at B = 256"),
]
SPLIT_HEAD_ROUTE = Route(
    "hidden states with a registered head, with --vocab-parallel-devices: the head split by vocabulary rows",
    ("fused_stream_kernel on each GPU's shard", "ncclAllGather", "fused_finish_kernel on the first GPU"),
    "each GPU reads its shard of W once; on two H200s, up to B = 64, 0.54-0.67x the one-GPU call without filters "
    "(188-204 us at V = 151936, D = 4096; 520-552 us at V = 262144, D = 8192), 0.55-0.78x with top-k + top-p; rows "
    "the kernel flags, and requests it does not take, through the shards' logits gathered on the first GPU")


class CudaBackend(Backend):
    """Samples on one GPU with the kernels of csrc/ (built on first use)."""

    def __init__(self, device_index: int = 0, vocab_parallel_devices: Sequence[int] = ()) -> None:
        """vocab_parallel_devices: the GPUs (this one first) that hidden states through a registered head are
        sampled on, each head split by vocabulary rows (cuda_vocab_parallel.py); none: the head stays here."""
        if not torch.cuda.is_available():
            raise CudaBackendUnavailable("torch sees no CUDA GPU")
        if not 0 <= device_index < torch.cuda.device_count():
            raise CudaBackendUnavailable(f"no CUDA device {device_index} ({torch.cuda.device_count()} visible)")
        self._device = torch.device("cuda", device_index)
        with torch.cuda.device(self._device):
            self._kernels = Kernels(device_index)
            self._local_samplers = LocalSamplerKernels(self._kernels.module, self._device)
            self._sequence_samplers = SequenceSamplerKernels(self._kernels.module, self._device)
        self._gpu_name = torch.cuda.get_device_name(device_index)
        self._mps = mps_state()  # the context is made: whether it connected to a daemon is settled
        self._exact_rows = 0  # rows sampled again through stats + filter
        self._lock = threading.Lock()
        self._init_buffers()
        self._split_heads: SplitHeads | None = None
        if vocab_parallel_devices:
            if vocab_parallel_devices[0] != device_index:
                raise CudaBackendUnavailable(f"the vocabulary-parallel devices {list(vocab_parallel_devices)} must "
                                             f"start with the backend's device, cuda:{device_index}")
            self._split_heads = SplitHeads(DeviceGroup(vocab_parallel_devices))

    def _init_buffers(self) -> None:
        """The reused per-call buffers (grown on demand, never shrunk) and the views laid out on them."""
        self._host_stage: torch.Tensor | None = None
        self._dev_stage: torch.Tensor | None = None
        self._host_out: torch.Tensor | None = None
        self._dev_out: torch.Tensor | None = None
        self._ones = torch.ones(0, dtype=torch.float32, device=self._device)
        self._processed_x = torch.empty(0, dtype=torch.float32, device=self._device)
        self._stages: dict[int, Stage] = {}
        self._outs: dict[tuple[int, int], CallOutputs] = {}

    def info(self) -> BackendInfo:
        routes = ROUTES if self._split_heads is None else [SPLIT_HEAD_ROUTE, *ROUTES]
        kernels = [*Kernels.kernel_names, *LocalSamplerKernels.kernel_names, *SequenceSamplerKernels.kernel_names]
        return BackendInfo(name="cuda", device=f"cuda:{self._device.index} ({self._gpu_name})", kernels=kernels,
                           routes=routes, mps=self._mps)

    @property
    def fallback_counter_address(self) -> int:
        """Device address of the in-kernel fallback counter (uint64), for launchers outside this class."""
        return self._kernels.fallback_count.data_ptr()

    def fallbacks(self) -> dict[str, int]:
        """Exact re-evaluations inside kernels, and rows a fast kernel left to the exact filter (synchronises)."""
        return {"in_kernel": int(self._kernels.fallback_count.item()), "exact_rows": self._exact_rows}

    def may_stall(self, batch: SamplingBatch) -> bool:
        return self._split_heads is not None and self._split_heads.takes(batch)

    def serving(self) -> bool:
        """Whether the vocabulary-parallel devices can exchange (their communicators rebuilt after an abort)."""
        return self._split_heads is None or self._split_heads.group.recover()

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        if self.may_stall(batch):  # hidden states through a split head
            return self._split_heads.sample(batch, self.sample)
        if batch.hidden is not None:
            reason = cuda_fused.unsupported_reason(batch)
            if reason is None:
                return self._sample_fused(batch)
            record_fallback(reason)
        batch = batch.with_logits()  # hidden states through their LM head (a no-op for logits)
        result, flagged = self._locked_sample(batch, use_buckets=True)
        if flagged is not None and flagged.numel():
            # The exact filter settles every row: what it would leave undecided is a kernel bug.
            record_fallback("cuda_rows_to_exact_filter")
            self._exact_rows += int(flagged.numel())
            again, undecided = self._locked_sample(select_rows(batch, flagged), use_buckets=False)
            if undecided is not None and undecided.numel():
                raise RuntimeError(f"the exact filter left {undecided.numel()} rows undecided")
            result = merge_rows(result, flagged, again)
        return result

    def prepare(self, template: SamplingBatch, head: RegisteredWeight | None = None) -> PreparedSampling:
        """A call on the caller's stream with no synchronisation, capturable in a CUDA graph: on logits
        (cuda_prepared.py), on hidden states through the fused kernel where it takes the call
        (cuda_prepared_hidden.py), else through the head's cuBLAS product and a call on logits."""
        with torch.cuda.device(self._device):
            if head is not None and cuda_prepared_hidden.unsupported_reason(template, head) is None:
                return CudaPreparedHidden(self._kernels, template, head)
            prepared = CudaPreparedSampling(self._kernels, template)
        return prepared if head is None else ThroughHead(head, prepared)

    def _locked_sample(self, batch: SamplingBatch, use_buckets: bool) -> tuple[SamplingResult, torch.Tensor | None]:
        with self._lock, torch.cuda.device(self._device):
            try:
                return self._sample_on_gpu(batch, use_buckets)
            except BaseException:
                self._after_failure()
                raise

    def _sample_fused(self, batch: SamplingBatch) -> SamplingResult:
        """Hidden states through the fused kernel; rows whose kept set it cannot decide, through logits."""
        with self._lock, torch.cuda.device(self._device):
            result, redo = cuda_fused.sample_hidden(batch)
        if not redo.numel():
            return result
        record_fallback("fused_kept_set")
        return merge_rows(result, redo, self.sample(select_rows(batch, redo).with_logits()))

    def _after_failure(self) -> None:
        """A call that raised may have left copies in flight from the reused pinned buffers: wait for them,
        or, if the stream cannot be waited for, stop using those buffers."""
        try:
            torch.cuda.current_stream(self._device).synchronize()
        except Exception:  # noqa: BLE001 - the original error is what the caller must see
            self._init_buffers()

    # -- reused buffers ------------------------------------------------------------------------------
    def _alloc(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._device.type == "cuda")
        return torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def _stage(self, num_rows: int, bitmask_bytes: int) -> Stage:
        stage = self._stages.get(num_rows)
        layout = stage.layout if stage is not None else self._kernels.stage_layout(num_rows)
        need = layout["bitmask_words"] + bitmask_bytes
        if self._host_stage is None or self._host_stage.numel() < need:
            size = max(need, 2 * (0 if self._host_stage is None else self._host_stage.numel()), 4096)
            self._host_stage, self._dev_stage = self._alloc(size, True), self._alloc(size, False)
            self._stages.clear()
            stage = None
        if stage is None:
            if len(self._stages) >= 64:
                self._stages.clear()
            stage = self._stages[num_rows] = Stage(self._host_stage, self._dev_stage, num_rows, layout)
        return stage

    def _out(self, num_rows: int, num_samples: int) -> CallOutputs:
        key = (num_rows, num_samples)
        out = self._outs.get(key)
        if out is None:
            _, need = CallOutputs.offsets(num_rows, num_samples)
            host_need = 8 * num_rows * num_samples + num_rows
            if self._dev_out is None or self._dev_out.numel() < need or self._host_out.numel() < host_need:
                old = 0 if self._dev_out is None else self._dev_out.numel()
                self._dev_out = self._alloc(max(need, 2 * old, 16384), False)
                old = 0 if self._host_out is None else self._host_out.numel()
                self._host_out = self._alloc(max(host_need, 2 * old, 4096), True)
                self._outs.clear()
            if len(self._outs) >= 64:
                self._outs.clear()
            out = self._outs[key] = CallOutputs(self._host_out, self._dev_out, num_rows, num_samples)
        return out

    def _ones_on_device(self, num_rows: int) -> torch.Tensor:
        if self._ones.numel() < num_rows:
            self._ones = torch.ones(max(num_rows, 2 * self._ones.numel()), dtype=torch.float32, device=self._device)
        return self._ones[:num_rows]

    def _upload(self, batch: SamplingBatch, kind: int, use_buckets: bool,
                stream: int) -> tuple[Stage, Plan, list[int], bool]:
        """Packs the per-row parameters into the pinned buffer, plans the call there (csrc/routes.h: the row lists,
        T_eff and, for log-prob calls, the row masks), adds the token bitmask (the request's, or its allowed and
        banned lists as one: entry_masks.py), and copies it all to the device in one copy. Returns the stage, the
        plan, the bitmask's entries of the launches' params (NO_BITMASK without one) and whether that bitmask is all
        of the call's processing."""
        num_rows, vocab = batch.num_rows, batch.vocab_size
        processing = batch.processing
        bitmask = processing.token_bitmask if processing is not None else None
        masked = processing.token_bitmask_rows if bitmask is not None else None
        lists = entry_mask(processing, num_rows, vocab) if processing is not None and bitmask is None else None
        bans = lists is None and bitmask is None and processing is not None and bans_only(processing)
        if lists is not None:
            words_up, width = lists.num_masks, words_of(vocab)
        elif bitmask is not None:
            # Only the rows whose mask came with their request go up (filled rows of all ones would cost a read).
            words_up = 0 if bitmask.is_cuda else (num_rows if masked is None else masked.numel())
            width = bitmask.shape[1]
        else:
            words_up = width = 0
        stage = self._stage(num_rows, 4 * words_up * width)
        stage.fill(batch)
        routes = self._kernels.module
        plan = self._kernels.plan(stage.host_base, num_rows, vocab, batch.num_samples, kind,
                                  processing is not None, routes.ROUTES_FAST if use_buckets else routes.ROUTES_EXACT)
        end, entries = stage.lists + 4 * plan.lists_used, NO_BITMASK
        if lists is not None:
            end, entries = self._place_entry_mask(stage, lists, width)
        elif bitmask is not None:
            end, entries = self._place_bitmask(stage, bitmask, masked, words_up)
        elif bans:
            words = self._sequence_samplers.words(processing.sequence_samplers, num_rows, vocab)
            entries = [words.data_ptr(), 0, words.shape[1], 0]
        self._kernels.copy_to_device(stage.dev_base, stage.host_base, end, stream)
        masks_all = lists is not None or bans or (bitmask is not None and processing.without_bitmask() is None)
        return stage, plan, entries, masks_all

    def _place_bitmask(self, stage: Stage, bitmask: torch.Tensor, masked: torch.Tensor | None,
                       words_up: int) -> tuple[int, list[int]]:
        """Lays a token bitmask out in the stage: its words (a CPU mask's rows `masked`, or all; a mask on the
        device, contiguous, stays there) and, with `masked`, each row's mask row (-1: none). Returns where the upload
        ends and the launches' bitmask entries."""
        width = bitmask.shape[1]
        row_map = 0
        end = stage.bitmask_row
        if masked is not None:
            stage.h_bitmask_row.fill_(-1)
            stage.h_bitmask_row[masked] = (torch.arange(masked.numel(), dtype=torch.int32) if words_up
                                           else masked.to(torch.int32))
            row_map, end = stage.dev_base + stage.bitmask_row, stage.bitmask_row + 4 * stage.num_rows
        if not words_up:
            return end, [bitmask.data_ptr(), row_map, width, 0]
        host_words = stage.host_words(words_up, width)
        if masked is None:
            host_words.copy_(bitmask)
        else:
            torch.index_select(bitmask, 0, masked, out=host_words)
        return stage.bitmask_words + 4 * words_up * width, [stage.dev_base + stage.bitmask_words, row_map, width, 0]

    @staticmethod
    def _place_entry_mask(stage: Stage, lists: EntryMask, width: int) -> tuple[int, list[int]]:
        """Lays allowed and banned lists out in the stage as mask rows, the rows without lists unmasked. Returns
        where the upload ends and the launches' bitmask entries."""
        row_map = stage.h_bitmask_row.numpy()  # numpy: a few us less than torch's indexing, on every such call
        row_map.fill(-1)
        row_map[lists.rows] = lists.mask_rows
        fill_mask_words(stage.host_words(lists.num_masks, width).numpy(), lists)
        return stage.bitmask_words + 4 * lists.num_masks * width, [stage.dev_base + stage.bitmask_words,
                                                                   stage.dev_base + stage.bitmask_row, width, 0]

    def _processed(self, raw_x: torch.Tensor, processing: LogitProcessing | None, bitmask: list[int],
                   masks_all: bool, stream: int) -> tuple[torch.Tensor, list[int]]:
        """The logits the kernels read and the token-bitmask entries they take. A bitmask that is all of the
        processing (masks_all) stays with the kernels, which read the raw logits once; so do the local samplers
        alone on float32 logits, whose kernels leave the kept tokens as a bitmask (top-n-sigma alone: a floor a
        row); DRY alone is subtracted from a float32 copy by its own kernels; other processing runs in torch on a
        float32 copy, with the bitmask written into the copy first (step 2 precedes bias, penalties and the local
        samplers) by the in-place kernel, which reads 1/32 of the logits' bytes and allocates nothing."""
        if processing is None:
            return raw_x, NO_BITMASK
        if masks_all:
            return raw_x, bitmask
        if raw_x.dtype == torch.float32 and truncation_only(processing):
            return raw_x, self._local_samplers.entries(raw_x, processing.truncation)
        x = self._processing_copy(raw_x, stream)
        if penalties_only(processing):
            return self._sequence_samplers.penalise(x, processing.sequence_samplers), NO_BITMASK
        if processing.token_bitmask is not None:
            self._kernels.launch_apply_bitmask(x.data_ptr(), x.shape[0], x.shape[1], bitmask, stream)
            processing = processing.without_bitmask()
        return apply_processing(x, processing, truncate=self._local_samplers.apply).contiguous(), NO_BITMASK

    def _processing_copy(self, raw_x: torch.Tensor, stream: int) -> torch.Tensor:
        """A float32 copy of the logits that processing changes in place. float32 logits go by one runtime copy into
        a reused buffer (each call synchronises before the next one starts), with no torch allocation or dispatch;
        other dtypes convert through torch."""
        if raw_x.dtype != torch.float32:
            return raw_x.to(torch.float32)
        self._processed_x = grown(self._processed_x, raw_x.numel(), double=False)
        x = self._processed_x[:raw_x.numel()].view(raw_x.shape)
        self._kernels.module.copy_d2d(x.data_ptr(), raw_x.data_ptr(), 4 * raw_x.numel(), stream)
        return x

    def _sample_on_gpu(self, batch: SamplingBatch, use_buckets: bool) -> tuple[SamplingResult, torch.Tensor | None]:
        dev = self._device
        num_rows, vocab, num_samples = batch.num_rows, batch.vocab_size, batch.num_samples
        logits = batch.logits
        if logits.is_cuda:
            if logits.get_device() == dev.index and logits.is_contiguous():
                raw_x = logits
            else:
                raw_x = logits.to(dev).contiguous()
        else:
            raw_x = logits.contiguous().pin_memory().to(dev, non_blocking=True)
        mask = batch.processing.token_bitmask if batch.processing is not None else None
        if mask is not None and mask.is_cuda and (mask.get_device() != dev.index or not mask.is_contiguous()):
            # A mask already on a GPU (an in-process caller's) is read where it is, from this device.
            batch = replace(batch, processing=replace(batch.processing, token_bitmask=mask.to(dev).contiguous()))
        wants_logprobs = batch.return_logprobs or batch.top_logprobs > 0
        if num_rows == 0:
            return self._empty_result(batch, vocab, wants_logprobs), None
        stream = self._kernels.current_stream()
        routes = self._kernels.module  # what a call wants beside tokens: csrc/routes.h TsCallKind
        kind = routes.TOKENS
        if wants_logprobs:
            kind = routes.LOGPROBS_RAW if batch.logprobs_mode is LogprobsMode.RAW else routes.LOGPROBS_PROCESSED
        stage, plan, bitmask, masks_all = self._upload(batch, kind, use_buckets, stream)
        x, bitmask = self._processed(raw_x, batch.processing, bitmask, masks_all, stream)
        if wants_logprobs:
            return self._sample_with_logprobs(batch, plan, stage, raw_x, x, bitmask, stream)

        out = self._out(num_rows, num_samples)
        # Without log-probs every row is written by one group: the filtered rows write the main tokens and flags too.
        self._kernels.launch_plan(plan, x, bitmask, 0, None, 0, stage.dev_base, out.main, out.filt_shared, out.pre,
                                  out.raw, out.exact_bits, stream)
        # The one synchronisation: tokens and flags back to the host in one copy.
        self._kernels.copy_to_host_and_wait(out.host_base, out.dev_base, out.d2h_bytes, stream)
        flags = out.h_flags
        top = max(flags.tolist()) if num_rows <= 256 else int(flags.max())
        tokens = out.h_tokens.clone()
        if top <= FLAG_NAN:
            valid = torch.ones(num_rows, dtype=torch.bool)
            nan = flags != 0 if top else torch.zeros(num_rows, dtype=torch.bool)
            return SamplingResult(tokens=tokens, valid=valid, nan_detected=nan), None
        valid, nan = row_states(flags)
        tokens.masked_fill_(~valid.unsqueeze(1), -1)
        flagged = ((flags & FLAG_UNSETTLED) != 0).nonzero().squeeze(1) if top >= FLAG_UNSETTLED else None
        return SamplingResult(tokens=tokens, valid=valid, nan_detected=nan), flagged

    @staticmethod
    def _empty_result(batch: SamplingBatch, vocab: int, wants_logprobs: bool) -> SamplingResult:
        """A batch of no rows: empty tensors of the usual shapes."""
        ns, n = batch.num_samples, min(batch.top_logprobs, vocab)
        empty_bool = torch.zeros(0, dtype=torch.bool)
        return SamplingResult(
            tokens=torch.zeros((0, ns), dtype=torch.int64), valid=empty_bool, nan_detected=empty_bool.clone(),
            logprobs=torch.zeros((0, ns), dtype=torch.float32) if wants_logprobs and batch.return_logprobs else None,
            top_logprob_ids=torch.zeros((0, n), dtype=torch.int64) if batch.top_logprobs > 0 else None,
            top_logprobs=torch.zeros((0, n), dtype=torch.float32) if batch.top_logprobs > 0 else None)

    def _sample_with_logprobs(self, batch: SamplingBatch, plan: Plan, stage: Stage, raw_x: torch.Tensor,
                              x: torch.Tensor, bitmask: list[int], stream: int) -> tuple[SamplingResult, torch.Tensor]:
        """Log-probs calls: the same upload, the launches and tables of cuda_logprobs.py (x and bitmask: what the
        kernels read, _processed), and the call's one synchronisation."""
        num_rows = batch.num_rows
        got = sample_with_logprobs(self._kernels, plan, stage, self._out(num_rows, batch.num_samples),
                                   self._ones_on_device(num_rows), raw_x, x, bitmask, LogprobCall.of(batch), stream)
        # The one synchronisation: everything back to the host.
        flags = got.flags.cpu()
        valid, nan = row_states(flags)
        result = SamplingResult(
            tokens=got.tokens.cpu(), valid=valid, nan_detected=nan,
            logprobs=got.logprobs.cpu() if got.logprobs is not None else None,
            top_logprob_ids=got.top_ids.cpu() if got.top_ids is not None else None,
            top_logprobs=got.top_values.cpu() if got.top_values is not None else None)
        return result, ((flags & FLAG_UNSETTLED) != 0).nonzero().squeeze(1)
