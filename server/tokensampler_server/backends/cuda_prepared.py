"""A sampling call planned once and launched many times on the caller's stream (docs/inprocess.md, "Prepared calls").

What makes it run without a synchronisation, and so inside a captured CUDA graph:
- The rows are planned once (csrc/routes.h ts_plan), and the stage (parameters, T_eff, row lists) goes up once; the
  seed, position and iteration arrays of that device stage are what the caller writes between calls.
- The routes are those of the backend's calls, with one difference (csrc/routes.h TS_ROUTES_SETTLED): the rare rows
  the one-pass top-k kernel flags (z-ties at its cut, an overflowing candidate list) are sampled again by stats +
  filter on the device, in two launches whose blocks leave at once for every other row; the backend's calls bring
  those rows back to the host instead. So nothing has to come back to the host to decide anything.
- The call owns its stage, outputs and workspace, so their addresses never change (the backend's shared buffers
  grow and move) and a call may overlap the backend's other calls on another stream.
- A call with log-probs plans its filtered rows onto the exact routes (ts_plan's TS_ROUTES_EXACT): the tables need
  the filter's outputs of each of them, which the top-k kernel does not write, and nothing is left to re-sample.
Each call's tokens, flags and log-probs are new tensors computed on the device from the kernels' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokensampler_server.backends.base import PreparedSampling
from tokensampler_server.backends.cuda_buffers import CallOutputs, Stage, row_states
from tokensampler_server.backends.cuda_kernels import NO_BITMASK, Kernels, Plan
from tokensampler_server.backends.cuda_logprobs import LogprobCall, sample_with_logprobs
from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch, SamplingResult

__all__ = ["CudaPreparedSampling"]


@dataclass(frozen=True)
class PlannedCall:
    """What a call planned once owns on its device, at addresses that never change: its stage (the rows' parameters
    and the plan's row lists, uploaded once), the plan, its outputs and a workspace of its own."""

    stage: Stage
    plan: Plan
    out: CallOutputs
    ws: list[int]
    ws_buffers: tuple[torch.Tensor, ...]

    @staticmethod
    def of(kernels: Kernels, template: SamplingBatch, vocab: int, kind: int, routing: int) -> PlannedCall:
        """The rows of `template` planned over `vocab` tokens for a call of `kind` routed as `routing` (the kernels'
        module constants); the stage's upload waits for the copy (it happens once, at planning)."""
        device, num_rows, num_samples = kernels.device, template.num_rows, template.num_samples
        layout = kernels.stage_layout(num_rows)
        host = torch.empty(layout["bitmask_words"], dtype=torch.uint8, pin_memory=True)
        stage = Stage(host, torch.empty_like(host, device=device), num_rows, layout)
        stage.fill(template)
        plan = kernels.plan(stage.host_base, num_rows, vocab, num_samples, kind, False, routing)
        stage.dev.copy_(host)
        _, out_bytes = CallOutputs.offsets(num_rows, num_samples)
        out = CallOutputs(None, torch.empty(out_bytes, dtype=torch.uint8, device=device), num_rows, num_samples)
        ws, ws_buffers = kernels.plan_workspace(plan)
        return PlannedCall(stage, plan, out, ws, ws_buffers)

    def launch_tokens(self, kernels: Kernels, x: torch.Tensor, stream: int) -> None:
        """Every launch of a TOKENS plan over x [B, vocab] (no bitmask) on `stream`, into the main outputs."""
        out = self.out
        kernels.launch_plan(self.plan, x, NO_BITMASK, 0, None, 0, self.stage.dev_base, out.main, out.filt_shared,
                            out.pre, out.raw, out.exact_bits, stream, ws=self.ws)

    def tokens_result(self) -> SamplingResult:
        """The main outputs as a result on the device: tokens (-1 in rows that are not valid), valid, nan_detected."""
        valid, nan = row_states(self.out.view("main_flags"))
        return SamplingResult(tokens=torch.where(valid.unsqueeze(1), self.out.view("main_tokens"), -1), valid=valid,
                              nan_detected=nan)


class CudaPreparedSampling(PreparedSampling):
    """The rows of `template` (per-row parameters and log-prob options, no processing) planned on `kernels`'
    device."""

    def __init__(self, kernels: Kernels, template: SamplingBatch) -> None:
        if template.processing is not None:
            raise ValueError("a prepared call takes per-row temperature, filters and counters only: no processing")
        num_rows = template.num_rows
        self._kernels = kernels
        self._shape = (num_rows, template.vocab_size)
        self._logprobs = LogprobCall.of(template) if template.return_logprobs or template.top_logprobs else None
        routes = kernels.module
        if self._logprobs is None:
            kind, routing = routes.TOKENS, routes.ROUTES_SETTLED
        else:  # the log-prob tables read the filter's outputs of every filtered row: each takes the exact route
            raw = self._logprobs.mode is LogprobsMode.RAW
            kind, routing = (routes.LOGPROBS_RAW if raw else routes.LOGPROBS_PROCESSED), routes.ROUTES_EXACT
        self._call = PlannedCall.of(kernels, template, template.vocab_size, kind, routing)
        self._ones = torch.ones(num_rows, dtype=torch.float32, device=kernels.device)
        self.seed, self.position, self.iteration = self._call.stage.dev_counters()

    def sample(self, logits: torch.Tensor) -> SamplingResult:
        if tuple(logits.shape) != self._shape:
            raise ValueError(f"logits: got shape {tuple(logits.shape)}, expected {list(self._shape)} as prepared")
        call, kernels, stream = self._call, self._kernels, self._kernels.current_stream()
        if self._logprobs is not None:
            got = sample_with_logprobs(kernels, call.plan, call.stage, call.out, self._ones, logits, logits, NO_BITMASK,
                                       self._logprobs, stream, ws=call.ws)
            valid, nan = row_states(got.flags)
            return SamplingResult(tokens=got.tokens, valid=valid, nan_detected=nan, logprobs=got.logprobs,
                                  top_logprob_ids=got.top_ids, top_logprobs=got.top_values)
        call.launch_tokens(kernels, logits, stream)
        return call.tokens_result()
