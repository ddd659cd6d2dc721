"""The CPU reference backend against docs/semantics.md.

Distribution tests are chi-square goodness-of-fit tests of many seeded draws against the exact
distribution, computed here independently in float64 numpy. Every draw uses a fixed seed, so each
test is deterministic; a test fails when p < ALPHA (significance 0.001), or when a token outside the
distribution's support is ever drawn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.model.sampling import LogitProcessing, LogprobsMode, SamplingBatch, TokenEntries

from .batches import make_batch, select_rows

ALPHA = 1e-3
DRAWS = 20_000
BACKEND = CpuBackend()


def exact_distribution(x: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Probability of each token under steps 7-10 of the semantics, in float64."""
    z = x.astype(np.float64) / temperature
    q = np.exp(z - z.max())
    q /= q.sum()
    order = np.lexsort((np.arange(len(z)), -z))  # z descending, index ascending
    limit = len(z) if top_k <= 0 else min(top_k, len(z))
    limit = min(limit, int((q >= min_p * q.max()).sum()))
    prefix = q[order[:limit]]
    cumulative = np.cumsum(prefix) / prefix.sum()
    kept = limit if top_p >= 1 else min(limit, int(np.searchsorted(cumulative, top_p)) + 1)
    p = np.zeros_like(q)
    p[order[:kept]] = q[order[:kept]]
    return p / p.sum()


def draw(logits_row: torch.Tensor, draws: int = DRAWS, **params) -> np.ndarray:
    """Counts of each token over `draws` rows that repeat `logits_row` with seeds 0..draws-1."""
    logits = logits_row.unsqueeze(0).expand(draws, -1).contiguous()
    result = BACKEND.sample(make_batch(logits, seed=torch.arange(draws), **params))
    return np.bincount(result.tokens[:, 0].numpy(), minlength=logits_row.numel())


def assert_fits(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {np.nonzero(counts * ~support)}"
    if support.sum() == 1:
        return
    _, p_value = stats.chisquare(counts[support], expected[support] * counts.sum())
    assert p_value >= ALPHA, f"chi-square p = {p_value:.2e} < {ALPHA}"


LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -2.0, 1.0, 0.7, -3.0, 0.2])

DISTRIBUTION_CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.5": dict(temperature=0.5),
    "temperature 2.5": dict(temperature=2.5),
    "top_k 4": dict(temperature=1.0, top_k=4),
    "top_p 0.7": dict(temperature=1.0, top_p=0.7),
    "min_p 0.2": dict(temperature=1.0, min_p=0.2),
    "combined": dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05),
    "top_k 1": dict(temperature=1.0, top_k=1),
}


@pytest.mark.parametrize("params", DISTRIBUTION_CASES.values(), ids=DISTRIBUTION_CASES.keys())
def test_distribution_matches_exact(params: dict) -> None:
    expected = exact_distribution(LOGITS.numpy(), **params)
    assert_fits(draw(LOGITS, **params), expected)


def test_chi_square_detects_a_wrong_distribution() -> None:
    """The statistical check has power: draws at T = 1 are rejected as a sample of T = 1.3."""
    counts = draw(LOGITS, temperature=1.0)
    expected = exact_distribution(LOGITS.numpy(), temperature=1.3)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_fits(counts, expected)


def _row_processing(**fields) -> LogitProcessing:
    """Processing for every row of a batch of DRAWS rows that share the same lists."""
    def entries(tokens: list[int]) -> TokenEntries:
        rows = torch.arange(DRAWS).repeat_interleave(len(tokens))
        return TokenEntries(rows=rows, tokens=torch.tensor(tokens).repeat(DRAWS))

    converted = {}
    for name, value in fields.items():
        if name in ("allowed", "banned", "bias", "output_tokens", "prompt_tokens"):
            converted[name] = entries(value)
        elif name == "bias_values":
            converted[name] = torch.tensor(value, dtype=torch.float32).repeat(DRAWS)
        else:
            converted[name] = torch.full((DRAWS,), value, dtype=torch.float32)
    return LogitProcessing(**converted)


def test_penalties_distribution() -> None:
    output, prompt = [0, 0, 3, 5], [1]
    processing = _row_processing(
        output_tokens=output, prompt_tokens=prompt, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25
    )
    x = LOGITS.numpy().astype(np.float64).copy()
    for token in {0, 3, 5, 1}:
        x[token] = x[token] / 1.3 if x[token] > 0 else x[token] * 1.3
    for token in set(output):
        x[token] -= 0.4 + 0.25 * output.count(token)
    assert_fits(draw(LOGITS, processing=processing), exact_distribution(x, 1.0))


def test_bias_and_masks_distribution() -> None:
    processing = _row_processing(
        allowed=[0, 1, 2, 4, 7, 9], banned=[1], bias=[7, 7, 4], bias_values=[1.0, 0.5, -0.25]
    )
    x = LOGITS.numpy().astype(np.float64).copy()
    x[7] += 1.5
    x[4] -= 0.25
    x[[1, 3, 5, 6, 8, 10, 11]] = -np.inf
    expected = exact_distribution(x, 1.0, top_k=3)
    assert (expected > 0).sum() == 3 and expected[1] == 0
    assert_fits(draw(LOGITS, processing=processing, top_k=3), expected)


def test_greedy_takes_the_argmax_and_breaks_ties_to_the_lowest_index() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -7.0]])
    result = BACKEND.sample(make_batch(logits, temperature=0.0, seed=[1, 2, 3], num_samples=3))
    assert result.tokens.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]


def test_gumbel_ties_in_the_sorted_order_go_to_the_lower_index() -> None:
    """top_k = 1 among equal logits keeps the lowest index, whatever the noise."""
    logits = torch.zeros(50, 6)
    logits[:, 2] = logits[:, 4] = 1.0
    result = BACKEND.sample(make_batch(logits, top_k=1, seed=torch.arange(50)))
    assert (result.tokens == 2).all()


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(0))
    batch = make_batch(logits, top_k=50, top_p=0.9, seed=torch.arange(16), num_samples=4)
    first, second = BACKEND.sample(batch), BACKEND.sample(batch)
    assert torch.equal(first.tokens, second.tokens)
    other = BACKEND.sample(make_batch(logits, top_k=50, top_p=0.9, seed=torch.arange(16) + 1000, num_samples=4))
    assert not torch.equal(first.tokens, other.tokens)
    # The samples of one row differ from each other (counter word 3 is the sample index).
    assert any(len(set(row)) > 1 for row in first.tokens.tolist())


def test_position_and_iteration_change_the_noise() -> None:
    logits = torch.zeros(64, 1000)
    base = BACKEND.sample(make_batch(logits, seed=7)).tokens
    assert (base == base[0]).all()  # same seed and counter in every row: same token
    by_position = BACKEND.sample(make_batch(logits, seed=7, position=torch.arange(64))).tokens
    by_iteration = BACKEND.sample(make_batch(logits, seed=7, iteration=torch.arange(64))).tokens
    assert len(set(by_position[:, 0].tolist())) > 32
    assert len(set(by_iteration[:, 0].tolist())) > 32


def _mixed_batch(num_rows: int = 64, vocab_size: int = 3001) -> SamplingBatch:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
    return make_batch(
        logits,
        temperature=torch.rand(num_rows, generator=gen) * 2 * (torch.arange(num_rows) % 5 != 0),
        top_k=(torch.arange(num_rows) * 7) % 120,
        top_p=torch.where(torch.arange(num_rows) % 3 == 0, 1.0, 0.5 + 0.5 * torch.rand(num_rows, generator=gen)),
        min_p=torch.where(torch.arange(num_rows) % 4 == 0, 0.1, 0.0),
        seed=torch.randint(-(2**62), 2**62, (num_rows,), generator=gen),
        position=torch.arange(num_rows) * 11,
        num_samples=2,
        return_logprobs=True,
        top_logprobs=5,
    )


def test_batch_invariance_alone_and_in_a_shuffled_batch() -> None:
    batch = _mixed_batch()
    whole = BACKEND.sample(batch)
    permutation = torch.randperm(batch.num_rows, generator=torch.Generator().manual_seed(2))
    shuffled = BACKEND.sample(select_rows(batch, permutation))
    assert torch.equal(shuffled.tokens, whole.tokens[permutation])
    assert torch.equal(shuffled.logprobs, whole.logprobs[permutation])
    for row in range(0, batch.num_rows, 9):
        alone = BACKEND.sample(select_rows(batch, torch.tensor([row])))
        assert torch.equal(alone.tokens[0], whole.tokens[row])
        assert torch.equal(alone.top_logprob_ids[0], whole.top_logprob_ids[row])


def test_raw_logprobs_match_log_softmax() -> None:
    batch = _mixed_batch()
    result = BACKEND.sample(batch)
    reference = torch.log_softmax(batch.logits.double(), dim=1)
    torch.testing.assert_close(result.logprobs.double(), reference.gather(1, result.tokens), rtol=0, atol=1e-4)
    top_values, top_ids = reference.topk(5, dim=1)
    assert torch.equal(result.top_logprob_ids, top_ids)
    torch.testing.assert_close(result.top_logprobs.double(), top_values, rtol=0, atol=1e-4)


def test_processed_logprobs_renormalise_over_the_kept_set() -> None:
    logits = LOGITS.unsqueeze(0)
    result = BACKEND.sample(
        make_batch(logits, temperature=0.5, top_k=3, return_logprobs=True, logprobs_mode=LogprobsMode.PROCESSED, top_logprobs=4)
    )
    expected = exact_distribution(LOGITS.numpy(), temperature=0.5, top_k=3)
    token = int(result.tokens[0, 0])
    assert result.logprobs[0, 0].item() == pytest.approx(np.log(expected[token]), abs=1e-5)
    assert result.top_logprob_ids[0].tolist() == [0, 1, 2, 3]  # -inf outside K, ties to the lower id
    assert np.exp(result.top_logprobs[0, :3].double().numpy()).sum() == pytest.approx(1.0, abs=1e-5)
    assert result.top_logprobs[0, 3].item() == float("-inf")


def test_nan_and_fully_masked_rows_are_flagged_and_do_not_affect_others() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    logits[1, 10] = float("nan")
    logits[2] = float("nan")
    logits[3] = float("-inf")
    batch = make_batch(logits, seed=torch.arange(4), return_logprobs=True, top_logprobs=2)
    result = BACKEND.sample(batch)
    assert result.valid.tolist() == [True, True, False, False]
    assert result.nan_detected.tolist() == [False, True, True, False]
    assert result.tokens[2:].eq(-1).all() and result.tokens[1, 0] != 10
    assert result.logprobs[2:].isnan().all() and result.top_logprob_ids[2:].eq(-1).all()
    alone = BACKEND.sample(select_rows(batch, torch.tensor([0])))
    assert torch.equal(alone.tokens[0], result.tokens[0])


def test_min_p_near_one_keeps_only_the_maximum() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.999, -1.0]]).expand(200, -1).contiguous()
    result = BACKEND.sample(make_batch(logits, min_p=0.9999, seed=torch.arange(200)))
    assert (result.tokens == 1).all()


def test_min_p_one_keeps_exactly_the_tokens_tied_at_the_maximum() -> None:
    """m = 1: the tokens whose logit equals the row's maximum, each as likely (chi-square); the next float below the
    maximum is dropped."""
    below = float(np.nextafter(np.float32(2.0), np.float32(0.0)))
    row = torch.tensor([0.5, 2.0, below, 2.0, -1.0, 2.0, 1.9])
    counts = draw(row, min_p=1.0)
    expected = exact_distribution(row.numpy(), temperature=1.0, min_p=1.0)
    assert np.flatnonzero(expected).tolist() == [1, 3, 5]
    assert_fits(counts, expected)


@pytest.mark.parametrize("temperature", [1e-6, 1e6])
def test_extreme_temperatures(temperature: float) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 1.9]]).expand(2000, -1).contiguous()
    tokens = BACKEND.sample(make_batch(logits, temperature=temperature, seed=torch.arange(2000))).tokens[:, 0]
    if temperature < 1:
        assert (tokens == 1).all()
    else:
        assert_fits(np.bincount(tokens.numpy(), minlength=4), np.full(4, 0.25))


@pytest.mark.parametrize("vocab_size", [2, 3, 17, 1000, 32001, 151936, 262144])
def test_any_vocabulary_size(vocab_size: int) -> None:
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(vocab_size)).to(torch.bfloat16)
    result = BACKEND.sample(make_batch(logits, top_k=[0, 5], top_p=[0.9, 1.0], seed=[4, 5], num_samples=2))
    assert result.tokens.shape == (2, 2)
    assert ((result.tokens >= 0) & (result.tokens < vocab_size)).all()
    assert result.valid.all()


def test_noise_drawn_at_kept_ids_only_gives_the_same_tokens(monkeypatch) -> None:
    """The sparse draw (small kept sets) and the full-vocabulary draw pick the same tokens."""
    import tokensampler_server.backends.cpu as cpu

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(48, 3000, generator=gen) * 2
    logits[:, 7] = logits[:, 9] = 6.0  # ties inside the kept set go to the lower id either way
    batch = make_batch(
        logits, top_k=[0, 1, 5, 50] * 12, top_p=[1.0, 0.9, 0.5] * 16, min_p=[0.0] * 40 + [0.2] * 8,
        temperature=[0.0, 0.7, 1.0, 3.0] * 12, seed=torch.arange(48) * 977, num_samples=3,
    )
    monkeypatch.setattr(cpu, "_SPARSE_NOISE_COST", 0)  # sparse whatever the share of the row kept
    sparse = BACKEND.sample(batch).tokens
    monkeypatch.setattr(cpu, "_SPARSE_NOISE_MAX_KEPT", 0)
    dense = BACKEND.sample(batch).tokens
    assert torch.equal(sparse, dense)


def test_top_k_rows_sort_only_their_candidates_with_the_same_kept_sets(monkeypatch) -> None:
    """Sorting only the tokens at or above the k-th largest gives the kept sets of the full sort,
    ties at the cut and -inf tokens included."""
    import tokensampler_server.backends.cpu as cpu

    gen = torch.Generator().manual_seed(8)
    z = torch.round(torch.randn(300, 500, generator=gen) * 4) / 4  # many ties
    z[::7, 250:] = float("-inf")
    z[::11, 3:] = float("-inf")  # rows with fewer finite tokens than k
    z = z - z.max(dim=1, keepdim=True).values
    top_k = torch.randint(1, 300, (300,), generator=gen, dtype=torch.int32)
    top_p = torch.where(torch.rand(300, generator=gen) < 0.5, 1.0, torch.rand(300, generator=gen) * 0.9 + 0.05)
    min_p = torch.where(torch.rand(300, generator=gen) < 0.3, 0.1, 0.0)
    fast = cpu.kept_token_mask(z, top_k, top_p, min_p)
    monkeypatch.setattr(cpu, "top_k_candidates", cpu.sorted_row)
    assert torch.equal(fast, cpu.kept_token_mask(z, top_k, top_p, min_p))
