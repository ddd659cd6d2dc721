"""Distribution, invariance and edge cases of the CUDA backend, against the CPU reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokensampler_server.backends.cpu import kept_token_mask
from tokensampler_server.backends.cuda import select_rows
from tokensampler_server.model.sampling import LogitProcessing, LogprobsMode, TokenEntries

from tokensampler_server.backends.cuda_kernels import Outputs, RowParams

from .conftest import MODES, assert_logprobs_match, logits, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

SAMPLED = [m for m in MODES if m != "greedy"]


def _expected_probs(x: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The target distribution of docs/semantics.md for one row, in float64."""
    z = (x - x.max()) / temperature
    kept = kept_token_mask(z.unsqueeze(0), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    w = np.where(kept.numpy(), np.exp(z.double().numpy()), 0.0)
    return w / w.sum()


@pytest.mark.parametrize("mode", SAMPLED)
@pytest.mark.parametrize("vocab", [16, 1000])
def test_chi_square_goodness_of_fit(cuda_backend, mode, vocab):
    """20000 draws from one row (distinct seeds), chi-square against the semantic distribution, alpha = 1e-3."""
    from scipy.stats import chisquare

    params = dict(MODES[mode])
    if vocab == 16 and params.get("top_k", 0) >= 16:
        params["top_k"] = 7
    row = logits("flat", 1, vocab, seed=vocab) [0] * 1.5
    draws = 20_000
    batch = make_batch(row.expand(draws, vocab).contiguous(), seed=99, positions=torch.zeros(draws, dtype=torch.int64),
                       **params)
    tokens = cuda_backend.sample(batch).tokens[:, 0].numpy()
    expected = _expected_probs(row, float(params["temperature"]), int(params.get("top_k", 0)),
                               float(params.get("top_p", 1.0)), float(params.get("min_p", 0.0)))
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[expected == 0].sum() == 0, "a token outside the kept set was drawn"
    support = expected * draws >= 5  # pool rare tokens so that every cell expects >= 5
    obs = np.append(counts[support], counts[~support].sum())
    exp = np.append(expected[support], expected[~support].sum()) * draws
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("mode", list(MODES))
def test_batch_invariance_and_reproducibility(cuda_backend, mode):
    x = logits("flat", 64, 32000, seed=5)
    batch = make_batch(x, num_samples=2, **MODES[mode])
    full = cuda_backend.sample(batch)
    assert torch.equal(cuda_backend.sample(batch).tokens, full.tokens)
    for rows in ([0], [17, 3], list(range(40, 64))):
        part = cuda_backend.sample(select_rows(batch, torch.tensor(rows)))
        assert torch.equal(part.tokens, full.tokens[rows])


def _edge_batches():
    v = 1000
    base = logits("flat", 8, v, seed=11)
    nan_rows = base.clone()
    nan_rows[0, 5] = float("nan")
    nan_rows[1] = float("nan")
    nan_rows[2, 7] = float("inf")
    nan_rows[3] = float("-inf")
    nan_rows[4, :990] = float("-inf")
    yield "nan_and_masked", nan_rows, {}
    ties = torch.zeros(8, v)
    ties[:, 500:] = 1.0
    yield "ties", ties, {}
    yield "k_is_v_minus_1", base, {"top_k": v - 1}
    yield "k_is_1", base, {"top_k": 1, "top_p": 0.5}
    yield "p_is_1", base, {"top_k": 20, "top_p": 1.0}
    yield "min_p_near_1", base, {"min_p": 0.999}
    yield "t_tiny", base, {"temperature": 1e-6}
    yield "t_tiny_ties", ties, {"temperature": 1e-6, "top_p": 0.9}
    yield "t_huge", base, {"temperature": 1e6}
    yield "t_huge_top_k", base, {"temperature": 1e6, "top_k": 10}
    yield "vocab_1", logits("flat", 4, 1, seed=1), {}
    yield "misaligned_bf16", logits("spiky", 5, 1001, seed=2, dtype=torch.bfloat16), {"top_p": 0.5}
    yield "misaligned_fp16_topk", logits("spiky", 5, 1003, seed=3, dtype=torch.float16), {"top_k": 5}


@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_p", "min_p", "large_k"])
@pytest.mark.parametrize("name,x,overrides", list(_edge_batches()), ids=lambda v: v if isinstance(v, str) else "")
def test_edge_cases_match_reference(cuda_backend, cpu_backend, mode, name, x, overrides):
    params = {**MODES[mode], **overrides}
    if mode == "greedy":
        params["temperature"] = 0.0
    if params.get("top_k", 0) >= x.shape[1]:
        params["top_k"] = 0  # the validator maps k >= V to off
    batch = make_batch(x, num_samples=3, **params)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.valid, want.valid)
    assert torch.equal(got.nan_detected, want.nan_detected)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("logprobs_mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
def test_logprobs_match_reference(cuda_backend, cpu_backend, mode, logprobs_mode):
    x = logits("spiky", 32, 1000, seed=8)
    x[3] = float("-inf")  # an invalid row
    batch = make_batch(x, num_samples=2, return_logprobs=True, logprobs_mode=logprobs_mode, top_logprobs=5,
                       **MODES[mode])
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert_logprobs_match(batch, got, want)


@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_p", "min_p"])
def test_processing_matches_reference(cuda_backend, cpu_backend, mode):
    x = logits("spiky", 6, 500, seed=4)
    e = lambda rows, toks: TokenEntries(torch.tensor(rows), torch.tensor(toks))  # noqa: E731
    processing = LogitProcessing(
        allowed=e([1] * 20, list(range(20))), banned=e([0, 0, 2], [int(x[0].argmax()), 3, int(x[2].argmax())]),
        bias=e([3, 3, 4], [10, 10, 11]), bias_values=torch.tensor([5.0, 20.0, -3.0]),
        output_tokens=e([4, 4, 5], [int(x[4].argmax()), 2, int(x[5].argmax())]),
        prompt_tokens=e([5], [7]), repetition_penalty=torch.full((6,), 1.3),
        presence_penalty=torch.full((6,), 0.5), frequency_penalty=torch.full((6,), 0.25))
    batch = make_batch(x, num_samples=2, processing=processing, return_logprobs=True, top_logprobs=3, **MODES[mode])
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert torch.equal(got.top_logprob_ids, want.top_logprob_ids)


@pytest.mark.parametrize("rows", [2, 40])
@pytest.mark.parametrize("route", ["gumbel", "min_p"])
def test_every_sample_in_one_launch_is_the_sample_drawn_alone(cuda_backend, sampling_kernels, route, rows):
    """The Gumbel-max routes draw a call's samples in one launch (a grid layer each, csrc/sampling.h): sample s of
    each row is the token a launch of sample s alone gives, bit for bit, rows without a finite logit included."""
    num_samples = 64
    x = logits("flat", rows, 32000, seed=rows).cuda()
    x[0, :] = float("-inf")  # every sample -1, not valid
    batch = make_batch(x, temperature=0.7, min_p=0.05 if route == "min_p" else 0.0, num_samples=num_samples)
    got = cuda_backend.sample(batch)
    params = RowParams(*(t.cuda() for t in (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seed,
                                            batch.position, batch.iteration)))
    alone = Outputs(tokens=torch.empty(rows, num_samples, dtype=torch.int64, device="cuda"),
                    flags=torch.empty(rows, dtype=torch.uint8, device="cuda"))
    pre = Outputs.row_stats(rows, "cuda")
    sampling_kernels.stats(x, params, pre)
    for s in range(num_samples):
        if route == "gumbel":
            sampling_kernels.gumbel(x, params, alone, s)
        else:
            sampling_kernels.min_p(x, params, pre, alone, s)
    assert not got.valid[0] and (got.tokens[0] == -1).all() and got.valid[1:].all()
    assert torch.equal(got.tokens, alone.tokens.cpu())


def test_large_batch_runs(cuda_backend, cpu_backend):
    x = logits("flat", 4096, 64, seed=3)
    batch = make_batch(x, top_k=10, top_p=0.8)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert (got.tokens == want.tokens).float().mean() >= 0.999


def test_info_and_fallback_counters(cuda_backend):
    info = cuda_backend.info()
    assert info.name == "cuda" and info.device.startswith("cuda:0 (") and info.kernels
    counts = cuda_backend.fallbacks()
    assert set(counts) == {"in_kernel", "exact_rows"} and all(v >= 0 for v in counts.values())
