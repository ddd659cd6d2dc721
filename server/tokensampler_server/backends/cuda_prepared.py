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
Each call's tokens, validity and NaN flags are new tensors computed on the device from the kernels' outputs.
"""

from __future__ import annotations

import torch

from tokensampler_server.backends.base import PreparedSampling
from tokensampler_server.backends.cuda_buffers import FLAG_INVALID, FLAG_NAN, CallOutputs, Stage
from tokensampler_server.backends.cuda_kernels import NO_BITMASK, Kernels
from tokensampler_server.model.sampling import SamplingBatch, SamplingResult

__all__ = ["CudaPreparedSampling"]


class CudaPreparedSampling(PreparedSampling):
    """The rows of `template` (per-row parameters, no processing, tokens only) planned on `kernels`' device."""

    def __init__(self, kernels: Kernels, template: SamplingBatch) -> None:
        if template.processing is not None or template.return_logprobs or template.top_logprobs:
            raise ValueError("a prepared call takes per-row temperature, filters and counters only: no processing, "
                             "no log-probs")
        device = kernels.device
        num_rows, num_samples = template.num_rows, template.num_samples
        self._kernels = kernels
        self._shape = (num_rows, template.vocab_size)
        layout = kernels.stage_layout(num_rows)
        host = torch.empty(layout["bitmask_words"], dtype=torch.uint8, pin_memory=True)
        self._stage = Stage(host, torch.empty_like(host, device=device), num_rows, layout)
        self._stage.fill(template)
        routes = kernels.module
        self._plan = kernels.plan(self._stage.host_base, num_rows, template.vocab_size, routes.TOKENS, False,
                                  routes.ROUTES_SETTLED)
        self._stage.dev.copy_(host)
        _, out_bytes = CallOutputs.offsets(num_rows, num_samples)
        self._out = CallOutputs(None, torch.empty(out_bytes, dtype=torch.uint8, device=device), num_rows, num_samples)
        self._ws, self._ws_buffers = kernels.plan_workspace(self._plan)
        self.seed, self.position, self.iteration = self._stage.dev_counters()

    def sample(self, logits: torch.Tensor) -> SamplingResult:
        if tuple(logits.shape) != self._shape:
            raise ValueError(f"logits: got shape {tuple(logits.shape)}, expected {list(self._shape)} as prepared")
        out, kernels = self._out, self._kernels
        kernels.launch_plan(self._plan, logits, NO_BITMASK, 0, None, 0, self._stage.dev_base, out.num_samples,
                            out.main, out.filt_shared, out.pre, out.raw, out.exact_bits, kernels.current_stream(),
                            ws=self._ws)
        flags = out.view("main_flags")
        valid = (flags & FLAG_INVALID) == 0
        tokens = torch.where(valid.unsqueeze(1), out.view("main_tokens"), -1)
        return SamplingResult(tokens=tokens, valid=valid, nan_detected=(flags & FLAG_NAN) != 0)
