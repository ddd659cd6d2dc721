"""The `cuda` backend: docs/semantics.md on the GPU with the compiled kernels of csrc/.

Rows are routed by their parameters (known on the host, so routing costs no synchronisation):
  greedy (T == 0)               -> stats_kernel: argmax, with the raw log-sum-exp in the same pass
  T > 0, no filter              -> gumbel_kernel: one read, exact up to an in-kernel re-score
  0 < k, k + 1 <= 256           -> topk_kernel<bucket>: one read, min-p and top-p on the candidates
  top-p / min-p without k, k > 255 -> stats_kernel then filter_kernel: exact binned cut
Processing (masks, bias, penalties) runs first, in torch on the GPU (processing.apply_processing).
Rows a kernel cannot settle exactly (flag 4, rare by construction) are re-sampled by the CPU
reference after the one synchronisation that returns the results; `fallbacks()` counts both kinds.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from ..sampling import LogitProcessing, LogprobsMode, SamplingBatch, SamplingResult, TokenEntries
from .base import Backend, BackendInfo
from .cuda_build import CudaBackendUnavailable
from .cuda_kernels import Kernels, Outputs, RowParams
from .processing import apply_processing

_FLAG_NAN, _FLAG_INVALID, _FLAG_CPU = 1, 2, 4

__all__ = ["CudaBackend", "CudaBackendUnavailable"]


def _device_rows(mask: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """int32 row ids of a host mask on the device; None when every row is selected."""
    if bool(mask.all()):
        return None
    return mask.nonzero().squeeze(1).to(torch.int32).to(device, non_blocking=True)


_MAX_MERGED_CANDIDATES = 16384  # the top-k merge sorts chunks x bucket keys in shared memory


def _topk_buckets(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """The smallest topk_kernel bucket holding k + 1 candidates per row; 0: none (k off, or too large)."""
    chunks = -(-vocab // 8192)
    buckets = torch.zeros(top_k.shape, dtype=torch.int64)
    for bucket in (256, 128, 64, 32, 16):
        fits = (top_k > 0) & (top_k + 1 <= bucket) & (chunks * bucket <= _MAX_MERGED_CANDIDATES)
        buckets = torch.where(fits, bucket, buckets)
    return buckets


def _decode_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank key (int64 bits of (order_key(z) << 32) | ~id) back to (z, id)."""
    high = (key >> 32) & 0xFFFFFFFF
    bits = torch.where(high >= 0x80000000, high & 0x7FFFFFFF, (~high) & 0xFFFFFFFF)
    z = bits.to(torch.int32).view(torch.float32)
    return z, 0xFFFFFFFF - (key & 0xFFFFFFFF)


def _select(entries: TokenEntries | None, mapping: torch.Tensor) -> tuple[TokenEntries | None, torch.Tensor | None]:
    if entries is None:
        return None, None
    new_rows = mapping[entries.rows]
    keep = new_rows >= 0
    return TokenEntries(new_rows[keep], entries.tokens[keep]), keep


def select_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The sub-batch of `rows` (int64, CPU), processing entries remapped to the new row numbers."""
    processing = batch.processing
    if processing is not None:
        mapping = torch.full((batch.num_rows,), -1, dtype=torch.int64)
        mapping[rows] = torch.arange(rows.numel())
        bias, keep = _select(processing.bias, mapping)
        per_row = {name: getattr(processing, name)[rows] if getattr(processing, name) is not None else None
                   for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")}
        processing = LogitProcessing(
            allowed=_select(processing.allowed, mapping)[0], banned=_select(processing.banned, mapping)[0],
            bias=bias, bias_values=processing.bias_values[keep] if keep is not None else None,
            output_tokens=_select(processing.output_tokens, mapping)[0],
            prompt_tokens=_select(processing.prompt_tokens, mapping)[0], **per_row)
    return dataclasses.replace(
        batch, logits=batch.logits[rows.to(batch.logits.device)].cpu(), temperature=batch.temperature[rows], top_k=batch.top_k[rows],
        top_p=batch.top_p[rows], min_p=batch.min_p[rows], seed=batch.seed[rows], position=batch.position[rows],
        iteration=batch.iteration[rows], processing=processing)


class CudaBackend(Backend):
    """Samples on one GPU with the kernels of csrc/ (built on first use)."""

    def __init__(self, device_index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise CudaBackendUnavailable("torch sees no CUDA GPU")
        if not 0 <= device_index < torch.cuda.device_count():
            raise CudaBackendUnavailable(f"no CUDA device {device_index} ({torch.cuda.device_count()} visible)")
        self._device = torch.device("cuda", device_index)
        with torch.cuda.device(self._device):
            self._kernels = Kernels(device_index)
        self._gpu_name = torch.cuda.get_device_name(device_index)
        self._cpu_rows = 0
        self._lock = threading.Lock()
        self._cpu_backend: Backend | None = None

    def info(self) -> BackendInfo:
        return BackendInfo(name="cuda", device=f"cuda:{self._device.index} ({self._gpu_name})",
                           kernels=list(Kernels.kernel_names))

    def fallbacks(self) -> dict[str, int]:
        """Exact re-evaluations inside kernels, and rows re-sampled by the CPU reference (synchronises)."""
        return {"in_kernel": int(self._kernels.fallback_count.item()), "cpu_rows": self._cpu_rows}

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        batch = batch.with_logits()  # hidden states through their LM head (a no-op for logits)
        with self._lock, torch.cuda.device(self._device):
            result, cpu_rows = self._sample_on_gpu(batch)
        if cpu_rows.numel():
            from ..metrics import record_fallback

            record_fallback("cuda_rows_to_cpu_reference")
            result = self._resample_on_cpu(batch, result, cpu_rows)
        return result

    # ---------------------------------------------------------------------------------------------
    def _sample_on_gpu(self, batch: SamplingBatch) -> tuple[SamplingResult, torch.Tensor]:
        dev, k = self._device, self._kernels
        num_rows, vocab, num_samples = batch.num_rows, batch.vocab_size, batch.num_samples
        if batch.logits.is_cuda:
            raw_x = batch.logits.to(dev).contiguous()
        else:
            raw_x = batch.logits.contiguous().pin_memory().to(dev, non_blocking=True)
        x = raw_x if batch.processing is None else apply_processing(raw_x.to(torch.float32, copy=True), batch.processing).contiguous()
        wants_logprobs = batch.return_logprobs or batch.top_logprobs > 0
        raw_mode = batch.logprobs_mode is LogprobsMode.RAW
        processed = wants_logprobs and not raw_mode

        greedy = batch.temperature == 0
        filtered = (batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0)
        # Greedy rows with filters still need the kept set for processed log-probs (T = 1, choice 6).
        through_filters = filtered & (~greedy | processed)
        t_eff = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)

        def to_dev(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(dtype).pin_memory().to(dev, non_blocking=True)

        params = RowParams(to_dev(t_eff, torch.float32), to_dev(batch.top_k, torch.int32), to_dev(batch.top_p, torch.float32),
                           to_dev(batch.min_p, torch.float32), to_dev(batch.seed, torch.int64),
                           to_dev(batch.position, torch.int64), to_dev(batch.iteration, torch.int64))

        def empty(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.empty(shape or (num_rows,), dtype=dtype, device=dev)

        main = Outputs(tokens=empty(torch.int64, num_rows, num_samples), flags=empty(torch.uint8),
                       row_max=empty(torch.float32), row_min=empty(torch.float32), row_logz=empty(torch.float32))
        ones = torch.ones(num_rows, dtype=torch.float32, device=dev)
        lse_unfiltered = None
        if processed:
            lse_unfiltered = 1.0 / params.temperature  # greedy rows have T_eff = 1
        elif wants_logprobs and batch.processing is None:
            lse_unfiltered = ones  # raw log-sum-exp for free in the same pass

        if bool(greedy.any()):
            k.stats(x, params, main, rows=_device_rows(greedy, dev), lse_scale=lse_unfiltered)
        unfiltered = ~greedy & ~filtered
        if bool(unfiltered.any()):
            rows = _device_rows(unfiltered, dev)
            for s in range(num_samples):
                k.gumbel(x, params, main, s, rows=rows, lse_scale=lse_unfiltered)

        filt = Outputs(tokens=empty(torch.int64, num_rows, num_samples), flags=empty(torch.uint8),
                       row_max=empty(torch.float32), kept_mass=empty(torch.float32), kept_min_key=empty(torch.int64))
        if bool(through_filters.any()):
            buckets = _topk_buckets(batch.top_k, vocab)
            for bucket in (16, 32, 64, 128, 256):
                chosen = through_filters & (buckets == bucket)
                if bool(chosen.any()):
                    k.topk(x, params, filt, bucket, rows=_device_rows(chosen, dev))
            exact = through_filters & (buckets == 0)
            if bool(exact.any()):
                rows = _device_rows(exact, dev)
                pre = Outputs(tokens=empty(torch.int64, num_rows, 1), flags=empty(torch.uint8), row_max=filt.row_max,
                              row_min=empty(torch.float32))
                k.stats(x, params, pre, rows=rows)
                needs_cpu = torch.zeros(num_rows, dtype=torch.uint8, device=dev)
                for s in range(num_samples):
                    k.filter(x, params, pre, filt, s, rows=rows, need_exact_mass=processed)
                    needs_cpu |= filt.flags & _FLAG_CPU  # each sample's launch rewrites the flags
                filt.flags |= needs_cpu

        # Combine: sampled filtered rows take the filter outputs; greedy rows keep the argmax.
        use_filt = (through_filters & ~greedy).to(dev, non_blocking=True)
        through_dev = through_filters.to(dev, non_blocking=True)
        tokens = torch.where(use_filt.unsqueeze(1), filt.tokens, main.tokens)
        flags = torch.where(use_filt, filt.flags, main.flags)
        flags = flags | torch.where(through_dev, filt.flags & _FLAG_CPU, torch.zeros_like(flags))
        row_max = torch.where(use_filt, filt.row_max, main.row_max)
        valid = (flags & _FLAG_INVALID) == 0

        logprobs = top_ids = top_values = None
        if wants_logprobs:
            if raw_mode:
                raw_max, raw_logz = main.row_max, main.row_logz
                need_raw = torch.ones(num_rows, dtype=torch.bool) if batch.processing is not None else ~(greedy | unfiltered)
                if bool(need_raw.any()):
                    raw_out = Outputs(flags=empty(torch.uint8), row_max=empty(torch.float32), row_min=empty(torch.float32),
                                      row_logz=empty(torch.float32))
                    k.stats(raw_x, params, raw_out, rows=_device_rows(need_raw, dev), lse_scale=ones)
                    need_dev = need_raw.to(dev, non_blocking=True)
                    raw_max = torch.where(need_dev, raw_out.row_max, raw_max)
                    raw_logz = torch.where(need_dev, raw_out.row_logz, raw_logz)
                raw_f = raw_x.to(torch.float32)
                raw_f = torch.where(torch.isnan(raw_f) | torch.isposinf(raw_f), float("-inf"), raw_f)
                table_norm = (raw_max + raw_logz).unsqueeze(1)
                source = raw_f
            else:
                xs = x.to(torch.float32)
                xs = torch.where(torch.isnan(xs) | torch.isposinf(xs), float("-inf"), xs)
                z = (xs - row_max.unsqueeze(1)) / params.temperature.unsqueeze(1)
                kept_z, kept_id = _decode_key(filt.kept_min_key)
                ids = torch.arange(vocab, device=dev).unsqueeze(0)
                in_kept = (z > kept_z.unsqueeze(1)) | ((z == kept_z.unsqueeze(1)) & (ids <= kept_id.unsqueeze(1)))
                kept = torch.where(through_dev.unsqueeze(1), in_kept, torch.isfinite(z)) & torch.isfinite(z)
                log_norm = torch.where(through_dev, torch.log(filt.kept_mass), main.row_logz)
                table_norm = log_norm.unsqueeze(1)
                source = torch.where(kept, z, float("-inf"))
            if batch.return_logprobs:
                picked = source.gather(1, tokens.clamp(min=0))
                logprobs = torch.where(valid.unsqueeze(1), picked - table_norm, float("nan"))
            if batch.top_logprobs > 0:
                n = min(batch.top_logprobs, vocab)
                table = source - table_norm
                top_values, top_ids = torch.sort(table, dim=1, descending=True, stable=True)
                top_values, top_ids = top_values[:, :n], top_ids[:, :n]
                top_ids = torch.where(valid.unsqueeze(1), top_ids, -1)
                top_values = torch.where(valid.unsqueeze(1), top_values, float("nan"))

        tokens = torch.where(valid.unsqueeze(1), tokens, -1)
        # The one synchronisation: everything back to the host.
        flags_cpu = flags.cpu()
        result = SamplingResult(
            tokens=tokens.cpu(), valid=(flags_cpu & _FLAG_INVALID) == 0, nan_detected=(flags_cpu & _FLAG_NAN) != 0,
            logprobs=logprobs.cpu() if logprobs is not None else None,
            top_logprob_ids=top_ids.cpu() if top_ids is not None else None,
            top_logprobs=top_values.cpu() if top_values is not None else None)
        return result, ((flags_cpu & _FLAG_CPU) != 0).nonzero().squeeze(1)

    def _resample_on_cpu(self, batch: SamplingBatch, result: SamplingResult, rows: torch.Tensor) -> SamplingResult:
        """Rows a kernel flagged (ties it cannot order, overflowing candidate buffers): the CPU reference."""
        if self._cpu_backend is None:
            from .cpu import CpuBackend

            self._cpu_backend = CpuBackend()
        self._cpu_rows += int(rows.numel())
        sub = self._cpu_backend.sample(select_rows(batch, rows))

        def put(full: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
            if full is None or part is None:
                return full
            full = full.clone()
            full[rows] = part
            return full

        return SamplingResult(tokens=put(result.tokens, sub.tokens), valid=put(result.valid, sub.valid),
                              nan_detected=put(result.nan_detected, sub.nan_detected),
                              logprobs=put(result.logprobs, sub.logprobs),
                              top_logprob_ids=put(result.top_logprob_ids, sub.top_logprob_ids),
                              top_logprobs=put(result.top_logprobs, sub.top_logprobs))
