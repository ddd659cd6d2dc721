"""Diffusion-LM steps (workloads/diffusion.py) against docs/semantics.md, choice 14, on the CPU reference.

Tokens are checked two ways: by chi-square against the exact distribution over many seeds (significance
ALPHA, fixed seeds, so deterministic), and for equality with CpuBackend.sample of the same row with
`position` = the position index. Confidences are checked against an independent float64 computation; the
commit rule with greedy rows whose confidences are set by construction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tokensampler_server.backends.base import Backend, BackendInfo
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.workloads.diffusion import DiffusionStep, diffusion_step
from tokensampler_server.model.sampling import LogitProcessing, SamplingBatch, SamplingResult, TokenEntries

from .batches import Column, make_batch, per_row, row_columns
from .test_cpu_semantics import LOGITS, assert_fits, exact_distribution

BACKEND = CpuBackend()
NAN = float("nan")


class RecordingBackend(Backend):
    """CpuBackend that keeps every batch it samples and every result it returns."""

    def __init__(self) -> None:
        self.calls: list[tuple[SamplingBatch, SamplingResult]] = []

    def info(self) -> BackendInfo:
        return BACKEND.info()

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        result = BACKEND.sample(batch)
        self.calls.append((batch, result))
        return result


# A step's rows take every column but position: each token's position is its index.
STEP_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed", "iteration")


def make_step(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    threshold: Column = NAN,
    count: Column = 0,
    processing: LogitProcessing | None = None,
    **columns: Column,
) -> DiffusionStep:
    """A step over `logits` [B, L, V] (every position masked by default) with the given STEP_COLUMNS; scalars
    are shared by all rows."""
    num_rows, length, _ = logits.shape
    return DiffusionStep(
        logits=logits,
        mask=torch.ones(num_rows, length, dtype=torch.bool) if mask is None else mask,
        **row_columns(num_rows, columns, STEP_COLUMNS),
        threshold=per_row(threshold, num_rows, torch.float32),
        count=per_row(count, num_rows, torch.int64),
        processing=processing,
    )


DRAWS = 20_000
CASES = {
    "temperature 1": dict(temperature=1.0),
    "combined": dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_masked_positions_follow_the_exact_distribution(params: dict) -> None:
    """Rows repeat the same logits at every position with seeds 0..DRAWS-1; positions 0 and 2 are masked."""
    logits = LOGITS.expand(DRAWS, 3, -1).contiguous()
    mask = torch.tensor([True, False, True]).expand(DRAWS, -1).contiguous()
    tokens, _, _ = diffusion_step(make_step(logits, mask, seed=torch.arange(DRAWS), **params), BACKEND)
    assert (tokens[:, 1] == -1).all()
    expected = exact_distribution(LOGITS.numpy(), **params)
    for position in (0, 2):
        assert_fits(np.bincount(tokens[:, position].numpy(), minlength=LOGITS.numel()), expected)
    # Different positions draw different noise (the Philox position is the index).
    assert not torch.equal(tokens[:, 0], tokens[:, 2])


def _mixed_step(num_rows: int = 5, length: int = 7, vocab_size: int = 501, dtype: torch.dtype = torch.float32) -> DiffusionStep:
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(num_rows, length, vocab_size, generator=gen) * 2.5).to(dtype)
    mask = torch.rand(num_rows, length, generator=gen) < 0.6
    mask[:, 0] = True
    return make_step(
        logits,
        mask,
        temperature=[1.0, 0.0, 0.6, 1.7, 1.0][:num_rows],
        top_k=[0, 0, 20, 0, 5][:num_rows],
        top_p=[1.0, 1.0, 0.9, 0.8, 1.0][:num_rows],
        min_p=[0.0, 0.0, 0.0, 0.02, 0.1][:num_rows],
        seed=torch.randint(-(2**62), 2**62, (num_rows,), generator=gen),
        iteration=[0, 3, 17, 2**32 - 1, 5][:num_rows],
        threshold=[0.3, NAN, 0.05, NAN, 0.5][:num_rows],
        count=[0, 2, 1, 0, 3][:num_rows],
    )


def _params(step: DiffusionStep) -> dict:
    names = (*STEP_COLUMNS, "threshold", "count", "processing")
    return {name: getattr(step, name) for name in names}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_equal_sample_rows_with_position_l(dtype: torch.dtype) -> None:
    step = _mixed_step(dtype=dtype)
    num_rows, length, vocab_size = step.logits.shape
    tokens, _, _ = diffusion_step(step, BACKEND)

    def per_position(column: torch.Tensor) -> torch.Tensor:
        return column.repeat_interleave(length)

    # Every (b, l) as its own Sample row: request b's parameters, position = l.
    reference = BACKEND.sample(
        make_batch(
            step.logits.reshape(num_rows * length, vocab_size),
            temperature=per_position(step.temperature),
            top_k=per_position(step.top_k),
            top_p=per_position(step.top_p),
            min_p=per_position(step.min_p),
            seed=per_position(step.seed),
            iteration=per_position(step.iteration),
            position=torch.arange(length).repeat(num_rows),
        )
    ).tokens[:, 0].view(num_rows, length)
    assert torch.equal(tokens, torch.where(step.mask, reference, -1))


def _float64_confidence(x: np.ndarray, temperature: float, token: int) -> float:
    """softmax(x / T)[token] over the whole vocabulary in float64 (T = 1 for greedy rows)."""
    z = x.astype(np.float64) / (temperature or 1.0)
    q = np.exp(z - z.max())
    return float(q[token] / q.sum())


def test_confidences_are_full_vocabulary_probabilities() -> None:
    """Over the whole vocabulary after temperature, not renormalised over the top-k/top-p kept set."""
    step = _mixed_step()
    tokens, confidences, _ = diffusion_step(step, BACKEND)
    assert (confidences[~step.mask] == 0).all()
    for b, l in step.mask.nonzero().tolist():
        x = step.logits[b, l].numpy()
        expected = _float64_confidence(x, float(step.temperature[b]), int(tokens[b, l]))
        assert confidences[b, l].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    greedy_row = 1
    assert step.temperature[greedy_row] == 0
    for l in step.mask[greedy_row].nonzero().squeeze(1).tolist():
        assert tokens[greedy_row, l] == step.logits[greedy_row, l].argmax()


# Greedy rows over V = 4 with logits [a, 0, 0, 0]: token 0 with confidence e^a / (e^a + 3) = c.
def _logits_with_confidences(confidences: list[float]) -> torch.Tensor:
    logits = torch.zeros(len(confidences), 4)
    logits[:, 0] = torch.tensor([math.log(3 * c / (1 - c)) for c in confidences])
    return logits


CONFIDENCES = [0.5, 0.9, 0.3, 0.95, 0.6, 0.9]
ALL = [True] * 6
# (mask, threshold, count, committed positions)
COMMIT_CASES = {
    "threshold only": (ALL, 0.85, 0, {1, 3, 5}),
    "threshold is inclusive": (ALL, None, 0, {3}),  # threshold = the exact confidence of position 3
    "count only, tie to the lower index": (ALL, NAN, 2, {1, 3}),
    "count over the masked positions only": ([True, False, True, False, True, True], NAN, 2, {4, 5}),
    "count beyond the masked ones commits them all": ([True, False, True, False, False, False], NAN, 5, {0, 2}),
    "both: threshold wider": (ALL, 0.55, 1, {1, 3, 4, 5}),
    "both: count wider": (ALL, 0.99, 3, {1, 3, 5}),
    "at least one: threshold too high": (ALL, 0.99, 0, {3}),
    "at least one: neither rule": (ALL, NAN, 0, {3}),
    "at least one among the masked": ([True, False, True, False, False, True], 0.99, 0, {5}),
    "nothing masked": ([False] * 6, 0.0, 3, set()),
}


def test_commit_rule() -> None:
    """Every case is a row of one batch: the rule runs on all rows at once."""
    cases = list(COMMIT_CASES.values())
    logits = _logits_with_confidences(CONFIDENCES).expand(len(cases), -1, -1).contiguous()
    mask = torch.tensor([case[0] for case in cases])
    _, exact, _ = diffusion_step(make_step(logits, temperature=0.0), BACKEND)  # the confidences as computed
    thresholds = [exact[0, 3].item() if case[1] is None else case[1] for case in cases]
    step = make_step(logits, mask, temperature=0.0, threshold=thresholds, count=[case[2] for case in cases])
    tokens, confidences, new_mask = diffusion_step(step, BACKEND)
    assert torch.equal(tokens, torch.where(mask, 0, -1))
    np.testing.assert_allclose(confidences[0].numpy(), CONFIDENCES, rtol=1e-5)
    for row, (name, (_, _, _, committed)) in enumerate(COMMIT_CASES.items()):
        assert set((mask[row] & ~new_mask[row]).nonzero().squeeze(1).tolist()) == committed, name
        assert not (new_mask[row] & ~mask[row]).any(), name


def test_commit_ties_go_to_the_lower_index() -> None:
    logits = _logits_with_confidences([0.7] * 5).expand(3, -1, -1).contiguous()
    mask = torch.tensor([[True] * 5, [False, True, True, False, True], [True] * 5])
    step = make_step(logits, mask, temperature=0.0, threshold=NAN, count=[0, 0, 3])
    _, confidences, new_mask = diffusion_step(step, BACKEND)
    assert (confidences[mask] == confidences[0, 0]).all()  # exactly equal
    assert new_mask.tolist() == [
        [False, True, True, True, True],
        [False, False, True, False, True],
        [False, False, False, True, True],
    ]


def test_positions_without_a_finite_logit_stay_masked() -> None:
    """Token -1 and confidence 0; never committed, by threshold, count or the at-least-one rule."""
    logits = torch.randn(3, 3, 20, generator=torch.Generator().manual_seed(5))
    logits[0, 0] = float("-inf")
    logits[0, 1] = NAN
    logits[1] = float("-inf")
    logits[2, :, :] = float("-inf")
    logits[2, 1, 7] = 2.0
    step = make_step(logits, threshold=[NAN, 0.0, 0.0], count=[0, 3, 3])
    tokens, confidences, new_mask = diffusion_step(step, BACKEND)
    assert tokens[0, :2].eq(-1).all() and tokens[0, 2] >= 0
    assert tokens[1].eq(-1).all() and tokens[2].tolist() == [-1, 7, -1]
    assert (confidences[tokens < 0] == 0).all() and confidences[2, 1] == 1.0
    assert new_mask.tolist() == [[True, True, False], [True, True, True], [True, False, True]]


def test_unmasked_positions_are_never_read() -> None:
    step = _mixed_step()
    poisoned = step.logits.clone()
    poisoned[~step.mask] = NAN
    recorder = RecordingBackend()
    poisoned_out = diffusion_step(make_step(poisoned, step.mask, **_params(step)), recorder)
    clean_out = diffusion_step(step, BACKEND)
    for poisoned_part, clean_part in zip(poisoned_out, clean_out):
        assert torch.equal(poisoned_part, clean_part)
    ((batch, result),) = recorder.calls
    assert batch.num_rows == int(step.mask.sum()) and torch.isfinite(batch.logits).all()
    assert not result.nan_detected.any()


def test_no_masked_position_samples_nothing() -> None:
    logits = torch.full((2, 4, 10), NAN)
    recorder = RecordingBackend()
    tokens, confidences, new_mask = diffusion_step(make_step(logits, torch.zeros(2, 4, dtype=torch.bool), count=2), recorder)
    assert not recorder.calls
    assert tokens.eq(-1).all() and confidences.eq(0).all() and not new_mask.any()


def test_a_row_alone_equals_the_row_in_a_batch() -> None:
    step = _mixed_step()
    whole = diffusion_step(step, BACKEND)
    for row in range(step.logits.shape[0]):
        params = {name: value[row : row + 1] for name, value in _params(step).items() if value is not None}
        alone = diffusion_step(make_step(step.logits[row : row + 1], step.mask[row : row + 1], **params), BACKEND)
        for alone_part, whole_part in zip(alone, whole):
            assert torch.equal(alone_part[0], whole_part[row])


def _entries(per_row: list[list[int]]) -> TokenEntries:
    rows = [row for row, tokens in enumerate(per_row) for _ in tokens]
    return TokenEntries(rows=torch.tensor(rows, dtype=torch.int64), tokens=torch.tensor(sum(per_row, []), dtype=torch.int64))


def test_processing_is_applied_per_request_row() -> None:
    """Banned/allowed lists, duplicate bias entries and penalties of request b reach all of b's positions."""
    gen = torch.Generator().manual_seed(8)
    num_rows, length, vocab_size = 3, 4, 30
    logits = torch.randn(num_rows, length, vocab_size, generator=gen) * 2
    mask = torch.tensor([[True, True, False, True], [True, False, True, True], [False, True, True, False]])
    banned = [list(range(10)), [], [5]]
    allowed = [[], [], [5, 6, 7, 8]]
    bias = [[], [3, 3], [8]]
    row_bias_values = [[], [1.5, 1.0], [-0.5]]
    output_tokens = [[], [4, 4, 12], []]
    processing = LogitProcessing(
        allowed=_entries(allowed),
        banned=_entries(banned),
        bias=_entries(bias),
        bias_values=torch.tensor(sum(row_bias_values, [])),
        output_tokens=_entries(output_tokens),
        repetition_penalty=torch.tensor([1.0, 1.5, 1.0]),
        frequency_penalty=torch.tensor([0.0, 0.3, 0.0]),
    )
    step = make_step(logits, mask, temperature=[1.0, 0.7, 0.0], seed=[1, 2, 3], processing=processing)
    tokens, confidences, _ = diffusion_step(step, BACKEND)

    # The processed logits of each request, by hand in float64.
    processed = logits.double().clone()
    processed[0, :, :10] = float("-inf")
    processed[1, :, 3] += 2.5
    for token, times in ((4, 2), (12, 1)):
        x = processed[1, :, token]
        processed[1, :, token] = torch.where(x > 0, x / 1.5, x * 1.5) - 0.3 * times
    processed[2, :, 8] -= 0.5
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[[6, 7, 8]] = True
    processed[2, :, ~keep] = float("-inf")

    for b, l in mask.nonzero().tolist():
        token = int(tokens[b, l])
        assert torch.isfinite(processed[b, l, token]), (b, l, token)
        expected = _float64_confidence(processed[b, l].numpy(), float(step.temperature[b]), token)
        assert confidences[b, l].item() == pytest.approx(expected, rel=1e-5)
        # The same token as a lone Sample row with the request's lists, position = l.
        alone = BACKEND.sample(
            make_batch(
                logits[b, l].unsqueeze(0),
                temperature=step.temperature[b : b + 1],
                seed=step.seed[b : b + 1],
                position=l,
                processing=LogitProcessing(
                    allowed=_entries([allowed[b]]),
                    banned=_entries([banned[b]]),
                    bias=_entries([bias[b]]),
                    bias_values=torch.tensor(row_bias_values[b]),
                    output_tokens=_entries([output_tokens[b]]),
                    repetition_penalty=processing.repetition_penalty[b : b + 1],
                    frequency_penalty=processing.frequency_penalty[b : b + 1],
                ),
            )
        )
        assert alone.tokens[0, 0] == token, (b, l)
