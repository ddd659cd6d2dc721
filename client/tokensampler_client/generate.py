"""transformers' `generate` sampling through tokensampler, in process or remote.

    processor = TokenSamplerProcessor(SamplerClient("localhost:50051"), seed=[7, 8], top_k=50, top_p=0.9,
                                      pad_token_id=tokenizer.pad_token_id)
    # or TokenSamplerProcessor(LocalSampler("cuda"), ...) to sample in this process
    model.generate(input_ids, do_sample=False, logits_processor=LogitsProcessorList([processor]), ...)

Each step the processor sends the step's scores to tokensampler with the row's seed and, as the Philox position,
the length of the row so far, and hands generate scores whose only finite entry is the sampled token: greedy
search (do_sample=False) then takes it. So the continuation is a pure function of the seeds and the prompt, the
same through generate as through any other loop that samples each step with the same position. Leave generate's
own processors off (temperature, top-k, penalties): give those to the processor, where tokensampler applies them,
with the row's prompt and generated tokens as their history.

With left padding, give `pad_token_id`: a row's length (its position) and its prompt then leave out the pads in
front of it, so that its tokens do not depend on the rows it is batched with. Without it, the pads count.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

_SET_HERE = ("position", "num_samples", "prompt_token_ids", "output_token_ids", "num_generated")
_READ_HISTORY = ("repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size",
                 "dry_multiplier", "min_tokens")
"""Parameters that read the row's tokens: the processor sends the history only where one of them is given."""


class _Sampler(Protocol):
    def sample(self, logits: Any, **params: Any) -> Any: ...


class TokenSamplerProcessor:
    """A transformers logits processor that samples each step with `sampler` (a SamplerClient, or an in-process
    LocalSampler) and forces its token.

    `params`: the keywords of SamplerClient.sample (temperature, top_k, top_p, min_p, seed, penalties, ...), the
    same every step. Set per step: `position` (the row's length so far), and for penalties, no-repeat-n-gram, DRY
    and min_tokens the row's history (`prompt_token_ids`, `output_token_ids`, `num_generated`). A row the sampler
    reports invalid (no finite logit) keeps generate's own choice of its scores. One processor follows one
    generation at a time; a call whose tokens do not continue the last call's starts a new one. A generate() whose
    prompt is the last one's output looks like its next step (the same tokens plus the one sampled): call reset()
    between generate() calls, or give each its own processor.
    """

    def __init__(self, sampler: _Sampler, *, pad_token_id: int | None = None, **params: Any) -> None:
        given = [name for name in _SET_HERE if name in params]
        if given:
            raise ValueError(f"{', '.join(given)}: set by the processor each step (one sample at the row's length, "
                             "its own tokens as history)")
        self._sampler = sampler
        self._pad = pad_token_id
        self._params = params
        self._history = any(name in params for name in _READ_HISTORY)
        self._last: torch.Tensor | None = None  # the last call's input_ids
        self._prompt_width = 0

    def reset(self) -> None:
        """The next call starts a new generation: its tokens are the prompt."""
        self._last = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        last = self._last
        if last is None or last.shape[0] != input_ids.shape[0] or last.shape[1] + 1 != input_ids.shape[1] \
                or not torch.equal(input_ids[:, :last.shape[1]], last):
            self._prompt_width = input_ids.shape[1]  # a new generation: this call's tokens are its prompt
        self._last = input_ids
        pads = self._leading_pads(input_ids[:, :self._prompt_width])
        params = dict(self._params, position=(input_ids.shape[1] - pads).tolist())
        if self._history:
            rows = input_ids.tolist()
            params.update(prompt_token_ids=[row[pad:self._prompt_width] for row, pad in zip(rows, pads.tolist())],
                          output_token_ids=[row[self._prompt_width:] for row in rows],
                          num_generated=input_ids.shape[1] - self._prompt_width)
        result = self._sampler.sample(scores.detach(), **params)
        tokens = result.tokens[:, 0].to(scores.device)
        valid = result.valid.to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, tokens.clamp(min=0).unsqueeze(1), 0.0)
        return torch.where(valid.unsqueeze(1), forced, scores)

    def _leading_pads(self, prompt: torch.Tensor) -> torch.Tensor:
        """The pad tokens in front of each row (left padding), on the CPU; 0 without a pad_token_id."""
        if self._pad is None:
            return torch.zeros(prompt.shape[0], dtype=torch.long)
        return (prompt == self._pad).long().cumprod(dim=1).sum(dim=1).cpu()
