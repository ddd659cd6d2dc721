"""The cut route (ts_cut once, then ts_sample_kept a sample) against the exact filter it replaces: for rows with a k
and no top-p, and, in calls of several samples a row, for rows with top-p too.

Both take the kept set of docs/semantics.md: the filter draws each sample inside its histogram pass, the cut route
finds the set's last key once and draws every sample by Gumbel-max with the set as a mask. The same noise on the
same kept set gives the same token, so the two must agree bit for bit on every row, ties and crowded bins included.
A call with processed log-probs still takes the filter (it needs the kept mass): the same batch sampled both ways
compares the routes on the same kernels' inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokensampler_server.model.sampling import LogprobsMode

from .conftest import make_batch, rows_of_every_kind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

B, V, SAMPLES = 8, 32000, 8
PARAMS = [  # the rows the cut route takes: a k above the buckets; with SAMPLES samples a row, top-p rows too
    {"top_k": 256},
    {"top_k": 1000},
    {"top_k": 300, "min_p": 0.05},
    {"top_k": V // 2, "min_p": 0.01},
    {"top_k": V - 1},
    {"top_k": "per-row"},
    {"top_k": "per-row", "min_p": 0.05},
    {"top_k": 1000, "top_p": 0.9},
    {"top_k": V // 2, "top_p": 0.5, "min_p": 0.01},
    {"top_k": "per-row", "top_p": 0.9},
    {"top_p": 0.99},
    {"top_p": 0.5, "min_p": 0.05},
]


def _batch(x: torch.Tensor, temperature: float, params: dict, **extra):
    k = params.get("top_k", 0)
    batch = make_batch(x, temperature=temperature, num_samples=SAMPLES, seed=31,
                       **{**{n: v for n, v in params.items() if n != "top_k"}, **extra})
    if k == "per-row":
        gen = torch.Generator().manual_seed(x.shape[1])
        return dataclasses.replace(batch, top_k=torch.randint(1, V + 1, (x.shape[0],), generator=gen,
                                                               dtype=torch.int32))
    return dataclasses.replace(batch, top_k=torch.full((x.shape[0],), k, dtype=torch.int32))


@pytest.mark.parametrize("temperature", [1.0, 0.3])
@pytest.mark.parametrize("params", PARAMS, ids=[str(p) for p in PARAMS])
def test_the_cut_route_draws_the_filters_tokens(cuda_backend, sampling_kernels, params: dict,
                                                temperature: float) -> None:
    module = sampling_kernels.module  # these rows take the cut, and top-p without k not the frontier
    assert SAMPLES >= max(module.CUT_MIN_SAMPLES_WITH_K, module.CUT_MIN_SAMPLES_TOP_P) and B < module.FRONTIER_MIN_ROWS
    dev = torch.device("cuda")
    for kind, dtype, x in rows_of_every_kind(B, V, temperature, dev):
        x = x.clone()
        x[0] = float("-inf")  # no finite logit: token -1, not valid
        x[1, ::7] = float("nan")  # NaN reads as -inf, and is reported
        x[2] = float("-inf")
        x[2, 12345] = 1.0  # one finite logit: every k keeps it alone
        cut = cuda_backend.sample(_batch(x, temperature, params))
        filtered = cuda_backend.sample(_batch(x, temperature, params, return_logprobs=True,
                                              logprobs_mode=LogprobsMode.PROCESSED))
        assert torch.equal(cut.valid, filtered.valid), (kind, dtype)
        assert torch.equal(cut.nan_detected, filtered.nan_detected), (kind, dtype)
        assert not cut.valid[0] and (cut.tokens[0] == -1).all() and (cut.tokens[2] == 12345).all()
        assert torch.equal(cut.tokens, filtered.tokens), (kind, dtype, (cut.tokens != filtered.tokens).nonzero())
