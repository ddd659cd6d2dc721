"""Log-probs that are the same for a row wherever it is computed (docs/semantics.md: batch invariance, and choice
18: ScoreTokens gives a sampled token Sample's own log-prob). On the CPU torch splits a float32 reduction over
[B, V] by B, and ScoreTokens sums a vocabulary slice at a time, its slices' width set by the rows scored together:
in float32 a row's log-probs moved with its batch (by 1e-6 at V = 2^20 with top-p) and the two calls disagreed on
19 of 20 tokens (by up to 7e-5). model/log_probs.py sums in float64 and rounds the log once, as the streamed sums
end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokensampler_server.inprocess import LocalSampler

V = 1 << 20


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).standard_normal((4, V)).astype(np.float32))


@pytest.mark.parametrize("mode, params", [("raw", {}), ("processed", {"top_p": 0.9}),
                                          ("processed", {"temperature": 0.7})])
def test_a_rows_log_probs_do_not_depend_on_the_rows_beside_it(rows: torch.Tensor, mode: str, params: dict) -> None:
    sampler = LocalSampler("cpu")
    alone = sampler.sample(rows[:1], seed=3, return_logprobs=True, top_logprobs=4, logprobs_mode=mode, **params)
    merged = sampler.sample(rows, seed=3, return_logprobs=True, top_logprobs=4, logprobs_mode=mode, **params)
    assert torch.equal(alone.tokens[0], merged.tokens[0])
    assert torch.equal(alone.logprobs[0], merged.logprobs[0]), (alone.logprobs[0], merged.logprobs[0])
    assert torch.equal(alone.top_logprobs[0], merged.top_logprobs[0])


@pytest.mark.parametrize("mode, temperature", [("raw", 1.0), ("processed", 0.7)])
def test_scoring_a_sampled_token_gives_its_sampled_log_prob(rows: torch.Tensor, mode: str, temperature: float) -> None:
    sampler = LocalSampler("cpu")
    for seed in range(3):
        sampled = sampler.sample(rows, seed=seed, temperature=temperature, return_logprobs=True, logprobs_mode=mode)
        scored = sampler.score(rows[:, None, :], sampled.tokens[:, :1].to(torch.int32), mode=mode,
                               **({"temperature": temperature} if mode == "processed" else {}))
        assert torch.equal(scored.logprobs[:, 0], sampled.logprobs[:, 0]), (seed, scored.logprobs, sampled.logprobs)
