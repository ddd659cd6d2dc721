"""Sampling calls with log-probs on the CUDA backend, on the device: the plan's launches with the main and filter
outputs kept apart, then the torch post-processing that takes each row's outputs and builds its log-prob tables
(docs/semantics.md, steps 1 and 11). Nothing here synchronises: the backend brings the result to the host, a
prepared call (cuda_prepared.py) leaves it on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokensampler_server.backends.cuda_buffers import FLAG_UNSETTLED, FLAG_INVALID, CallOutputs, Stage
from tokensampler_server.backends.cuda_kernels import Kernels, Outputs, Plan
from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch

__all__ = ["DeviceLogprobs", "LogprobCall", "sample_with_logprobs"]


@dataclass(frozen=True)
class LogprobCall:
    """What a call asks beside its tokens."""

    mode: LogprobsMode
    return_logprobs: bool
    top_logprobs: int
    processed_input: bool
    """The kernels read processed logits (x is not the input): raw log-probs need the input's own pass."""

    @staticmethod
    def of(batch: SamplingBatch) -> LogprobCall:
        return LogprobCall(batch.logprobs_mode, batch.return_logprobs, batch.top_logprobs, batch.processing is not None)


@dataclass(frozen=True)
class DeviceLogprobs:
    """A log-prob call's result on the device: tokens int64 [B, S] (-1 in rows that are not valid), flags uint8 [B]
    (FLAG_UNSETTLED: the row needs the exact filter), log-probs float32 [B, S] and the top log-prob table [B, N]."""

    tokens: torch.Tensor
    flags: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None


def _decode_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank key (int64 bits of (order_key(z) << 32) | ~id) back to (z, id)."""
    high = (key >> 32) & 0xFFFFFFFF
    bits = torch.where(high >= 0x80000000, high & 0x7FFFFFFF, (~high) & 0xFFFFFFFF)
    z = bits.to(torch.int32).view(torch.float32)
    return z, 0xFFFFFFFF - (key & 0xFFFFFFFF)


def sample_with_logprobs(kernels: Kernels, plan: Plan, stage: Stage, out: CallOutputs, ones: torch.Tensor,
                         raw_x: torch.Tensor, x: torch.Tensor, bitmask: list[int], call: LogprobCall, stream: int,
                         ws: list[int] | None = None) -> DeviceLogprobs:
    """Every launch of `plan` (planned for a log-prob kind) over x, whose rows the device stage describes, and the
    tables: raw_x the input logits, x what the kernels read (x is raw_x without processing), bitmask their
    token-bitmask entries, ones float32 [B] of ones on the device, ws the plan's own workspace (None: the shared
    one)."""
    num_rows, vocab = x.shape
    raw_mode = call.mode is LogprobsMode.RAW
    t_eff = stage.dev_t_eff()
    lse_unfiltered = None
    if not raw_mode:
        lse_unfiltered = 1.0 / t_eff  # greedy rows have T_eff = 1
    elif not call.processed_input:
        lse_unfiltered = ones  # raw log-sum-exp for free in the same pass
    kernels.launch_plan(plan, x, bitmask, lse_unfiltered.data_ptr() if lse_unfiltered is not None else 0, raw_x,
                        ones.data_ptr(), stage.dev_base, out.main, out.filt, out.pre, out.raw, out.exact_bits, stream,
                        ws=ws)
    main = Outputs(tokens=out.view("main_tokens"), flags=out.view("main_flags"), row_max=out.view("main_row_max"),
                   row_min=out.view("main_row_min"), row_logz=out.view("main_row_logz"))
    filt = Outputs(tokens=out.view("filt_tokens"), flags=out.view("filt_flags"), row_max=out.view("filt_row_max"),
                   kept_mass=out.view("kept_mass"), kept_min_key=out.view("kept_min_key"))

    # Combine: sampled filtered rows take the filter outputs; greedy rows keep the argmax.
    use_filt, through_dev, need_dev = stage.dev_masks().unbind(0)
    tokens = torch.where(use_filt.unsqueeze(1), filt.tokens, main.tokens)
    flags = torch.where(use_filt, filt.flags, main.flags)
    flags = flags | torch.where(through_dev, filt.flags & FLAG_UNSETTLED, torch.zeros_like(flags))
    row_max = torch.where(use_filt, filt.row_max, main.row_max)
    valid = (flags & FLAG_INVALID) == 0

    logprobs = top_ids = top_values = None
    if raw_mode:
        raw_max, raw_logz = main.row_max, main.row_logz
        if plan.need_raw[1]:  # the input's own pass wrote its log-sum-exp (no mask: step 1 precedes step 2)
            raw_max = torch.where(need_dev, out.view("raw_row_max"), raw_max)
            raw_logz = torch.where(need_dev, out.view("raw_row_logz"), raw_logz)
        raw_f = raw_x.to(torch.float32)
        raw_f = torch.where(torch.isnan(raw_f) | torch.isposinf(raw_f), float("-inf"), raw_f)
        table_norm = (raw_max + raw_logz).unsqueeze(1)
        source = raw_f
    else:
        # the kernels masked x as they read it (words, or a floor a row): so does the table
        in_kernels = bitmask[0] != 0 or bitmask[3] != 0
        xs = x.to(torch.float32, copy=in_kernels)
        if in_kernels:
            kernels.launch_apply_bitmask(xs.data_ptr(), num_rows, vocab, bitmask, stream)
        xs = torch.where(torch.isnan(xs) | torch.isposinf(xs), float("-inf"), xs)
        z = (xs - row_max.unsqueeze(1)) / t_eff.unsqueeze(1)
        kept_z, kept_id = _decode_key(filt.kept_min_key)
        ids = torch.arange(vocab, device=x.device).unsqueeze(0)
        in_kept = (z > kept_z.unsqueeze(1)) | ((z == kept_z.unsqueeze(1)) & (ids <= kept_id.unsqueeze(1)))
        kept = torch.where(through_dev.unsqueeze(1), in_kept, torch.isfinite(z)) & torch.isfinite(z)
        log_norm = torch.where(through_dev, torch.log(filt.kept_mass), main.row_logz)
        table_norm = log_norm.unsqueeze(1)
        source = torch.where(kept, z, float("-inf"))
    if call.return_logprobs:
        picked = source.gather(1, tokens.clamp(min=0))
        logprobs = torch.where(valid.unsqueeze(1), picked - table_norm, float("nan"))
    if call.top_logprobs > 0:
        n = min(call.top_logprobs, vocab)
        table = source - table_norm
        top_values, top_ids = torch.sort(table, dim=1, descending=True, stable=True)
        top_values, top_ids = top_values[:, :n], top_ids[:, :n]
        top_ids = torch.where(valid.unsqueeze(1), top_ids, -1)
        top_values = torch.where(valid.unsqueeze(1), top_values, float("nan"))

    tokens = torch.where(valid.unsqueeze(1), tokens, -1)
    return DeviceLogprobs(tokens=tokens, flags=flags, logprobs=logprobs, top_ids=top_ids, top_values=top_values)
