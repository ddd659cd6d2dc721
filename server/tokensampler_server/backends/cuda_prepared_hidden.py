"""A call planned once on hidden states through the fused LM-head kernel (docs/inprocess.md, "Prepared calls";
csrc/fused.h), launched many times on the caller's stream: W·h never written, no synchronisation, capturable in a
CUDA graph, as cuda_prepared.py's call on logits.

What takes the place of the host's decisions:
- The fused kernel samples every row. The rows it flags (a kept set reaching past the candidates it keeps) are
  sampled again on the device: their logits made in fp32 by ts_fused_head_rows into a buffer of the call's, then
  stats + filter over them (csrc/routes.h TS_ROUTES_FLAGGED), whose blocks leave at once for every other row. The
  backend's sample() takes such rows back to the host for cuBLAS and the logits path instead; both give the tokens
  of docs/semantics.md up to the fp32 rounding of W·h.
- The fused kernel reads the temperatures as given (0: greedy); the stage holds the planner's T_eff (1 in greedy
  rows) for stats + filter, so the call keeps both.
- Hidden states in another dtype than the weight's are W·h of another product: such a call goes through the head
  and a call on logits, made with this one (making it uploads a stage, which synchronises: never inside a step),
  with this call's counters copied to it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tokensampler_server.backends import cuda_fused
from tokensampler_server.backends.base import PreparedSampling, ThroughHead
from tokensampler_server.backends.cuda_kernels import Kernels
from tokensampler_server.backends.cuda_prepared import CudaPreparedSampling, PlannedCall
from tokensampler_server.model.sampling import SamplingBatch, SamplingResult
from tokensampler_server.resources.weights import RegisteredWeight

__all__ = ["CudaPreparedHidden", "unsupported_reason"]


def unsupported_reason(template: SamplingBatch, head: RegisteredWeight) -> str | None:
    """Why a prepared call of `template`'s rows cannot run the fused kernel through `head` (a metric label), or None.
    Beside what the fused kernel takes: no log-probs (the rows sampled again would need their own tables)."""
    if template.return_logprobs:
        return "fused_logprobs"
    return cuda_fused.head_unsupported_reason(template, head)


class CudaPreparedHidden(PreparedSampling):
    """The rows of `template` (per-row parameters, no processing, no log-probs; unsupported_reason None) planned on
    `kernels`' device for hidden states [B, D] through `head`."""

    def __init__(self, kernels: Kernels, template: SamplingBatch, head: RegisteredWeight) -> None:
        if template.processing is not None:
            raise ValueError("a prepared call takes per-row temperature, filters and counters only: no processing")
        device = kernels.device
        num_rows, num_samples, vocab = template.num_rows, template.num_samples, head.finish.vocab_size
        weight = head.weight
        self._kernels, self._head = kernels, head
        self._shape = (num_rows, weight.shape[1])
        self._num_samples = num_samples
        routes = kernels.module
        self._call = PlannedCall.of(kernels, template, vocab, routes.TOKENS, routes.ROUTES_FLAGGED)
        self.seed, self.position, self.iteration = self._call.stage.dev_counters()
        # the template's temperatures (0: greedy) and filters; the counters the caller writes
        self._params = replace(cuda_fused.row_params(template, device), seed=self.seed, position=self.position,
                               iteration=self.iteration)
        finish = head.finish
        self._head_args = cuda_fused.HeadArgs.of(weight, vocab, finish.bias, finish.logit_scale, finish.soft_cap)
        filtered = cuda_fused.has_filters(template)
        self._fused_plan = cuda_fused.plan(num_rows, weight.shape[1], vocab, device.index, filtered)
        self._scratch = torch.empty(self._fused_plan.scratch_bytes, dtype=torch.uint8, device=device)
        settles = self._call.plan.settle[1] > 0
        self._logits = torch.empty((num_rows, vocab), dtype=torch.float32, device=device) if settles else None
        self._other_dtype = ThroughHead(head, CudaPreparedSampling(kernels, template))

    def sample(self, x: torch.Tensor) -> SamplingResult:
        if tuple(x.shape) != self._shape:
            raise ValueError(f"hidden states: got shape {tuple(x.shape)}, expected {list(self._shape)} as prepared")
        weight = self._head.weight
        if x.dtype != weight.dtype:
            return self._in_other_dtype(x)
        if x.device != weight.device or not x.is_contiguous() or x.data_ptr() % 16:
            # the kernels read 16-byte units of contiguous rows: one copy into a new (aligned) tensor
            x = torch.empty(x.shape, dtype=x.dtype, device=weight.device).copy_(x)
        call, kernels, stream = self._call, self._kernels, self._kernels.current_stream()
        tokens, flags = call.out.main[0], call.out.main[1]
        head, num_rows = self._head_args.entries, self._shape[0]
        kernels.module.fused_sample(*head, x.data_ptr(), num_rows, self._params.pointers(),
                                    self._fused_plan.as_tuple(), tokens, self._num_samples, 0, flags,
                                    self._scratch.data_ptr(), stream)
        if self._logits is not None:  # the flagged rows' logits, then stats + filter over just those rows
            kernels.module.fused_head_rows(*head, x.data_ptr(), num_rows, flags, self._logits.data_ptr(), stream)
            call.launch_tokens(kernels, self._logits, stream)
        return call.tokens_result()

    def _in_other_dtype(self, x: torch.Tensor) -> SamplingResult:
        other = self._other_dtype
        for mine, theirs in ((self.seed, other.seed), (self.position, other.position),
                             (self.iteration, other.iteration)):
            theirs.copy_(mine)
        return other.sample(x)
