"""Top-k probabilities (workloads/topk_probs.py) against docs/semantics.md, choice 15.

The reference is torch.softmax in float64, rounded to float32 (the contract's probabilities are fp32,
and so are their ties), then a stable descending sort (ties to the lower id), with NaN and +inf read as
-inf. Ids are compared exactly where logits lie on a grid coarse enough that fp32 rounding cannot swap two
distinct probabilities (or, for bf16/fp16, are naturally so); probabilities to fp32 accuracy.
"""

from __future__ import annotations

import pytest
import torch
from tokensampler_server.workloads.topk_probs import topk_probs

NAN, INF = float("nan"), float("inf")


def reference(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax(x / T), then the first k of a stable descending sort; all-masked rows: 0 and -1."""
    x = logits.double()
    x = torch.where(torch.isnan(x) | torch.isposinf(x), -INF, x)
    valid = torch.isfinite(x).any(dim=1, keepdim=True)
    probs = torch.softmax(torch.where(valid, x, 0.0) / temperature.double().unsqueeze(1), dim=1)
    probs = torch.where(valid, probs, 0.0)
    ids = torch.sort(probs.float(), dim=1, descending=True, stable=True).indices[:, :k]
    return probs.gather(1, ids), torch.where(valid, ids, -1)


def on_grid(logits: torch.Tensor) -> torch.Tensor:
    """Logits rounded to multiples of 1/64: distinct values are far apart, equal ones tie exactly."""
    return (logits * 64).round() / 64


def assert_matches(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ids = topk_probs(logits, temperature, k)
    expected_probs, expected_ids = reference(logits, temperature, k)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64
    assert probs.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(probs.double(), expected_probs, rtol=2e-6, atol=1e-9)
    return probs, ids


TEMPERATURES = torch.tensor([1.0, 0.5, 2.0, 0.05, 10.0, 1e-3, 1e3, 0.7] * 2)


def test_per_row_temperature() -> None:
    logits = on_grid(torch.randn(16, 3001, generator=torch.Generator().manual_seed(0)) * 3)
    assert_matches(logits, TEMPERATURES, 20)


def test_continuous_logits_up_to_fp32_rounding() -> None:
    """Off the grid, near-equal probabilities may swap: the k probabilities still match, in order."""
    logits = torch.randn(16, 3001, generator=torch.Generator().manual_seed(6)) * 3
    probs, ids = topk_probs(logits, TEMPERATURES, 50)
    expected, _ = reference(logits, TEMPERATURES, 50)
    torch.testing.assert_close(probs.double(), expected, rtol=2e-6, atol=1e-12)
    assert (probs[:, :-1] >= probs[:, 1:]).all()
    tied = probs[:, :-1] == probs[:, 1:]
    assert (ids[:, :-1][tied] < ids[:, 1:][tied]).all()


def test_ties_go_to_the_lower_id_inside_and_at_the_cut() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0, 2.0, 5.0]])
    probs, ids = topk_probs(logits, torch.ones(1), 3)
    assert ids.tolist() == [[1, 3, 4]]
    assert probs[0, 0] == probs[0, 1] == probs[0, 2]


def test_many_ties_against_the_stable_sort() -> None:
    """Few distinct values over a large vocabulary: the k-th value is tied across thousands of ids."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (6, 20000), generator=gen).float()
    logits[0] = 0.0  # one value everywhere: ids 0..k-1
    for k in (1, 7, 100, 5000):
        assert_matches(logits, torch.full((6,), 0.8), k)
    assert topk_probs(logits, torch.ones(6), 7)[1][0].tolist() == list(range(7))


def test_non_finite_logits() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    logits[0, [3, 9]] = NAN
    logits[1, 4] = INF  # read as -inf, not as the certain token
    logits[2] = NAN
    logits[3] = -INF
    logits[4] = INF
    probs, ids = assert_matches(logits, torch.ones(5), 50)
    assert ids[2:].eq(-1).all() and probs[2:].eq(0).all()
    assert set(ids[0, -2:].tolist()) == {3, 9} and probs[0, -2:].eq(0).all()
    assert ids[1, -1] == 4


def test_k_equal_to_the_vocabulary_is_a_full_sorted_permutation() -> None:
    logits = on_grid(torch.randn(3, 257, generator=torch.Generator().manual_seed(3)))
    probs, ids = assert_matches(logits, torch.tensor([1.0, 0.3, 4.0]), 257)
    assert all(sorted(row) == list(range(257)) for row in ids.tolist())
    torch.testing.assert_close(probs.double().sum(dim=1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    """bf16 has 8 significant bits: many exact ties among the logits."""
    logits = (torch.randn(8, 32000, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    assert_matches(logits, torch.full((8,), 0.9), 64)


def test_large_vocabulary() -> None:
    logits = on_grid(torch.randn(2, 151936, generator=torch.Generator().manual_seed(5)) * 2)
    assert_matches(logits, torch.tensor([1.0, 0.6]), 1024)


@pytest.mark.parametrize("k", [0, 11])
def test_k_out_of_range(k: int) -> None:
    with pytest.raises(ValueError):
        topk_probs(torch.zeros(1, 10), torch.ones(1), k)


@pytest.mark.parametrize("k", [1024, 1025, 3000, 4096])
def test_either_side_of_the_sort_threshold_ranks_alike(k: int) -> None:
    """k up to V / SORT_FRACTION takes the top-k cut, past it one stable sort: the same ids, ties to the lower id (a coarse
    grid: thousands of exact ties), and rows with nothing finite."""
    logits = (torch.randn(3, 4096, generator=torch.Generator().manual_seed(k)) * 4).round() / 4
    logits[2] = float("-inf")
    assert_matches(logits, torch.tensor([1.0, 0.5, 1.0]), k)
