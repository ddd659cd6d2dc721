"""transformers' `generate` sampling through tokensampler, in process or remote.

    processor = TokenSamplerProcessor(SamplerClient("localhost:50051"), seed=[7, 8], top_k=50, top_p=0.9)
    # or TokenSamplerProcessor(LocalSampler("cuda"), ...) to sample in this process
    model.generate(input_ids, do_sample=False, logits_processor=LogitsProcessorList([processor]), ...)

Each step the processor sends the step's scores to tokensampler with the row's seed and, as the Philox position,
the length of the row so far, and hands generate scores whose only finite entry is the sampled token: greedy
search (do_sample=False) then takes it. So the continuation is a pure function of the seeds and the prompt, the
same through generate as through any other loop that samples each step with the same position. Leave generate's
own processors off (temperature, top-k, penalties): give those to the processor, where tokensampler applies them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class _Sampler(Protocol):
    def sample(self, logits: Any, **params: Any) -> Any: ...


class TokenSamplerProcessor:
    """A transformers logits processor that samples each step with `sampler` (a SamplerClient, or an in-process
    LocalSampler) and forces its token.

    `params`: the keywords of SamplerClient.sample (temperature, top_k, top_p, min_p, seed, penalties, ...), the
    same every step; `position` is set per step to the row's length so far. A row the sampler reports invalid
    (no finite logit) keeps generate's own choice of its scores.
    """

    def __init__(self, sampler: _Sampler, **params: Any) -> None:
        if "position" in params or "num_samples" in params:
            raise ValueError("position and num_samples are set by the processor: one sample a step at the row's length")
        self._sampler = sampler
        self._params = params

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        result = self._sampler.sample(scores.detach(), position=input_ids.shape[1], **self._params)
        tokens = result.tokens[:, 0].to(scores.device)
        valid = result.valid.to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, tokens.clamp(min=0).unsqueeze(1), 0.0)
        return torch.where(valid.unsqueeze(1), forced, scores)
