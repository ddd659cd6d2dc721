"""The fused LM-head matmul + sampling path of the CUDA backend (csrc/fused.h).

Hidden states [B, D] go through the registered head W [V, D] inside the kernel: logits are made tile
by tile on chip and consumed there, never written. What the kernel covers is checked here
(`unsupported_reason`); everything else, and rows the kernel flags because their kept set reaches past
its candidates, takes the logits path (W·h by cuBLAS into fp32, then the logits kernels), counted
in the fallback metric. Both paths give the same tokens up to fp32 rounding of W·h (docs/semantics.md).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch

from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch, SamplingResult
from tokensampler_server.backends.cuda_buffers import FLAG_UNSETTLED, row_states
from tokensampler_server.backends.cuda_build import load_kernels
from tokensampler_server.backends.cuda_kernels import DTYPE_CODES, RowParams, stream_address
from tokensampler_server.resources.weights import RegisteredWeight

def fused_is_faster(num_rows: int, filtered: bool, device_index: int) -> bool:
    """Which path the backend takes for a hidden-state batch (`filtered`: some sampled row has top-k/top-p/min-p):
    the fused kernel, or cuBLAS into fp32 logits + the logits kernels. The route planner decides it, by
    measurement (csrc/fused.h ts_fused_preferred, docs/design/fused-lm-head.md)."""
    return bool(load_kernels(device_index).fused_preferred(num_rows, filtered))


def max_top_k(device_index: int) -> int:
    """The largest top-k the fused kernel takes: k + 1 within the candidates it keeps a row (csrc/fused.h)."""
    return load_kernels(device_index).FUSED_MAX_TOP_K


_DTYPES = {dtype: code for dtype, code in DTYPE_CODES.items() if dtype != torch.float32}  # the head's dtypes


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    kernel: int
    rows_per_tile: int
    vocab_ctas: int
    batch_tiles: int
    smem_bytes: int
    scratch_bytes: int

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return dataclasses.astuple(self)


@lru_cache(maxsize=256)
def plan(num_rows: int, dim: int, vocab: int, device_index: int, filtered: bool = True) -> FusedPlan | None:
    """The launch plan for this shape on this GPU (`filtered`: some row has top-k/top-p/min-p); None
    when the kernel cannot take D."""
    props = torch.cuda.get_device_properties(device_index)
    raw = load_kernels(device_index).fused_plan(num_rows, dim, vocab, props.multi_processor_count,
                                                props.shared_memory_per_block_optin, filtered)
    return FusedPlan(*raw) if raw[1] else None


def fused_sample(weight: torch.Tensor, states: torch.Tensor, params: RowParams, *, vocab: int | None = None,
                 bias: torch.Tensor | None = None, logit_scale: float = 1.0, soft_cap: float | None = None,
                 num_samples: int = 1, logprobs: bool = False, filtered: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Samples hidden states [B, D] through W [V_padded, D] on the current stream, without a sync.

    weight and states: same dtype (bf16 or fp16), contiguous, on one GPU. `filtered=False` says that no
    row has top-k/top-p/min-p, so no candidates are collected (rows with filters would come back flagged
    for the logits path); the default collects them. params.token_bitmask (when set) masks each logit as it is made;
    the raw log-probs are then of the masked logits, which is why the backend sends no such batch with log-probs.
    Returns tokens int64 [B, num_samples], raw log-probs float32 [B, num_samples] (or None) and flags
    uint8 [B] (1 nan_detected, 2 not valid, 4 take the logits path).
    """
    num_rows, dim = states.shape
    vocab = weight.shape[0] if vocab is None else vocab
    device = weight.device
    if weight.dtype not in _DTYPES or states.dtype != weight.dtype:
        raise ValueError(f"fused sampling takes bf16/fp16 weight and states of one dtype, got {weight.dtype}/{states.dtype}")
    if not (weight.is_contiguous() and states.is_contiguous()) or weight.data_ptr() % 16 or states.data_ptr() % 16:
        raise ValueError("fused sampling needs contiguous, 16-byte aligned weight and states")
    the_plan = plan(num_rows, dim, vocab, device.index, filtered)
    if the_plan is None:
        raise ValueError(f"fused sampling does not take hidden size {dim} (a multiple of 64 that fits shared memory)")
    tokens, out_logprobs, flags = _outputs(num_rows, num_samples, logprobs, device)
    scratch = torch.empty(the_plan.scratch_bytes, dtype=torch.uint8, device=device)
    head = HeadArgs.of(weight, vocab, bias, logit_scale, soft_cap)
    load_kernels(device.index).fused_sample(
        *head.entries, states.data_ptr(), num_rows, params.pointers(), the_plan.as_tuple(), tokens.data_ptr(),
        num_samples, 0 if out_logprobs is None else out_logprobs.data_ptr(), flags.data_ptr(), scratch.data_ptr(),
        stream_address(device))
    return tokens, out_logprobs, flags


@dataclasses.dataclass(frozen=True)
class HeadArgs:
    """A head as the fused launchers take it (csrc/fused.h TsLmHead, whole vocabulary): the weight, the rows that
    can be sampled, and the finish, with the bias as float32 on the weight's device (kept here: its address is
    passed)."""

    weight: torch.Tensor
    vocab: int
    bias: torch.Tensor | None
    logit_scale: float
    soft_cap: float

    @staticmethod
    def of(weight: torch.Tensor, vocab: int, bias: torch.Tensor | None, logit_scale: float,
           soft_cap: float | None) -> HeadArgs:
        if bias is not None:
            bias = bias.to(device=weight.device, dtype=torch.float32).contiguous()
        return HeadArgs(weight, vocab, bias, float(logit_scale), float(soft_cap or 0.0))

    @property
    def entries(self) -> tuple[int, int, int, int, int, float, float]:
        """weight, vocab, dim, dtype code, bias (0: none), logit scale, soft cap (0: none)."""
        weight = self.weight
        return (weight.data_ptr(), self.vocab, weight.shape[1], _DTYPES[weight.dtype],
                0 if self.bias is None else self.bias.data_ptr(), self.logit_scale, self.soft_cap)


def _outputs(num_rows: int, num_samples: int, logprobs: bool,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stage 2's outputs: tokens int64 [B, samples], raw log-probs float32 [B, samples] (or None), flags uint8 [B]."""
    tokens = torch.empty((num_rows, num_samples), dtype=torch.int64, device=device)
    out_logprobs = torch.empty((num_rows, num_samples), dtype=torch.float32, device=device) if logprobs else None
    return tokens, out_logprobs, torch.empty(num_rows, dtype=torch.uint8, device=device)


def host_result(tokens: torch.Tensor, logprobs: torch.Tensor | None,
                flags: torch.Tensor) -> tuple[SamplingResult, torch.Tensor]:
    """Stage 2's outputs on the host: the result, and the rows (int64) that must be sampled again on the logits path
    (their entries here are placeholders)."""
    flags = flags.cpu()
    valid, nan = row_states(flags)
    result = SamplingResult(tokens=tokens.cpu(), valid=valid, nan_detected=nan,
                            logprobs=logprobs.cpu() if logprobs is not None else None)
    return result, ((flags & FLAG_UNSETTLED) != 0).nonzero().squeeze(1)


def fused_partials(weight: torch.Tensor, states: torch.Tensor, params: RowParams, the_plan: FusedPlan,
                   scratch: torch.Tensor, *, first_token: int, bias: torch.Tensor | None, logit_scale: float,
                   soft_cap: float | None, want_sum1: bool) -> None:
    """Stage 1 alone on a shard of a head (csrc/fused.h): W [rows, D] holds the tokens first_token.. (a multiple of
    128) of a larger vocabulary; its partial results go to `scratch` (the_plan.scratch_bytes, uint8), on the current
    stream of W's device. Shapes, dtypes and alignment as fused_sample's."""
    device = weight.device
    head = HeadArgs.of(weight, weight.shape[0], bias, logit_scale, soft_cap)
    load_kernels(device.index).fused_partials(
        *head.entries, first_token, states.data_ptr(), states.shape[0], params.pointers(), the_plan.as_tuple(),
        want_sum1, scratch.data_ptr(), stream_address(device))


def candidates_per_part(the_plan: FusedPlan, device_index: int) -> int:
    """The candidate keys stage 1 keeps per (row, CTA) under this plan (0: none)."""
    return load_kernels(device_index).fused_candidates(the_plan.kernel)


def fused_finish(params: RowParams, shards: torch.Tensor, num_rows: int, the_plan: FusedPlan, num_samples: int,
                 logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stage 2 over the shards' stage 1 outputs side by side: uint8 [N, the_plan.scratch_bytes], shard s's
    fused_partials scratch in row s (as an all-gather of them leaves them), every shard planned with the_plan; on
    the current stream of their device. Returns what fused_sample returns."""
    device = shards.device
    tokens, out_logprobs, flags = _outputs(num_rows, num_samples, logprobs, device)
    load_kernels(device.index).fused_finish(
        num_rows, params.pointers(), shards.shape[0], the_plan.vocab_ctas, shards.data_ptr(), shards.stride(0),
        candidates_per_part(the_plan, device.index), tokens.data_ptr(), num_samples,
        0 if out_logprobs is None else out_logprobs.data_ptr(), flags.data_ptr(), stream_address(device))
    return tokens, out_logprobs, flags


def unsupported_reason(batch: SamplingBatch) -> str | None:
    """Why the fused kernel cannot sample this hidden-state batch (a metric label), or None if it can."""
    hidden = batch.hidden
    if hidden.states.dtype != hidden.lm_head.weight.dtype:
        return "fused_dtype"
    return head_unsupported_reason(batch, hidden.lm_head)


def head_unsupported_reason(batch: SamplingBatch, head: RegisteredWeight) -> str | None:
    """Why the fused kernel cannot sample the rows of `batch` from hidden states in the dtype of `head`'s weight
    through that head (a metric label), or None if it can."""
    weight = head.weight
    if not weight.is_cuda or weight.dtype not in _DTYPES:
        return "fused_dtype"
    if weight.data_ptr() % 16:  # a weight at an odd offset of a region: the copy engine reads 16-byte units
        return "fused_alignment"
    if not weight.is_contiguous():  # a view of another layout (a transposed [D, V] head): rows D elements apart
        return "fused_layout"
    filtered = has_filters(batch)
    if not fused_is_faster(batch.num_rows, filtered, weight.device.index):
        return "fused_slower"
    reason = request_unsupported_reason(batch, weight.device.index)
    if reason is not None:
        return reason
    if plan(batch.num_rows, weight.shape[1], head.finish.vocab_size, weight.device.index, filtered) is None:
        return "fused_hidden_size"
    return None


def request_unsupported_reason(batch: SamplingBatch, device_index: int) -> str | None:
    """What of the request itself (not its head or batch size) the fused kernel of GPU `device_index` does not
    take, or None."""
    processing = batch.processing
    if processing is not None and processing.without_bitmask() is not None:
        return "fused_processing"  # the kernel applies a token bitmask, no other processing
    masked = processing is not None and processing.token_bitmask is not None
    # Raw log-probs are of the input (step 1), which the kernel, masking each logit as it makes it, never sees whole.
    if batch.top_logprobs > 0 or (batch.return_logprobs and (batch.logprobs_mode is not LogprobsMode.RAW or masked)):
        return "fused_logprobs"
    sampled = batch.temperature > 0
    if bool((sampled & (batch.top_k > max_top_k(device_index))).any()):
        return "fused_top_k"
    unfiltered = sampled & (batch.top_k == 0) & (batch.top_p >= 1) & (batch.min_p <= 0)
    if batch.num_samples > 1 and bool(unfiltered.any()):
        return "fused_num_samples"
    return None


def has_filters(batch: SamplingBatch) -> bool:
    """Whether a sampled row has top-k, top-p or min-p (the batch's columns are CPU tensors: no sync)."""
    sampled = batch.temperature > 0
    return bool((sampled & ((batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0))).any())


def row_params(batch: SamplingBatch, device: torch.device) -> RowParams:
    """The batch's columns and token bitmask (the rows without one, from token_bitmask_rows, read none) on device."""
    columns = {name: column.to(device) for name, column in batch.row_sampling().items()}
    processing = batch.processing
    bitmask = processing.token_bitmask if processing is not None else None
    if bitmask is None:
        return RowParams(**columns)
    bitmask_row = None
    if processing.token_bitmask_rows is not None:
        bitmask_row = torch.full((batch.num_rows,), -1, dtype=torch.int32)
        bitmask_row[processing.token_bitmask_rows] = processing.token_bitmask_rows.to(torch.int32)
        bitmask_row = bitmask_row.to(device)
    return RowParams(**columns, token_bitmask=bitmask.to(device).contiguous(), bitmask_row=bitmask_row)


def sample_hidden(batch: SamplingBatch) -> tuple[SamplingResult, torch.Tensor]:
    """Samples a batch that `unsupported_reason` accepted. Returns the result on the CPU and the rows
    (int64, CPU) that must be sampled again on the logits path (their entries here are placeholders)."""
    lm_head = batch.hidden.lm_head
    weight = lm_head.weight
    states = batch.hidden.states.to(weight.device, non_blocking=True).contiguous()
    finish = lm_head.finish
    tokens, logprobs, flags = fused_sample(
        weight, states, row_params(batch, weight.device), vocab=finish.vocab_size, bias=finish.bias,
        logit_scale=finish.logit_scale, soft_cap=finish.soft_cap, num_samples=batch.num_samples,
        logprobs=batch.return_logprobs, filtered=has_filters(batch))
    return host_result(tokens, logprobs, flags)

