"""The local samplers (docs/semantics.md, "Local samplers") through the request path on the CPU reference.

Each statistical test draws one token from each of DRAWS rows that differ only in their seed, and compares the
counts with the exact distribution, computed independently by tests/local_reference.py: first no draw may fall
where the exact probability is 0, then a chi-square test at significance ALPHA (fixed seeds, so each run draws
the same tokens). Cells whose expected count is below 5 are pooled into one cell, never dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokensampler_client.params import build_sample_request
from tokensampler_client.workloads import build_diffusion_request, build_verify_request
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.cuda_local_samplers import truncation_only
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.batching.batch_merge import merge_batches, split_result
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.workloads.diffusion import diffusion_step
from tokensampler_server.workloads.verify import verify_draft
from tokensampler_server.model.sampling import select_rows
from tokensampler_server.validation.sample import validate_sample_request
from tokensampler_server.validation.workloads import validate_diffusion_request, validate_verify_request

from . import local_reference as ref

ALPHA = 1e-3
DRAWS = 4000
LOGITS = np.array([2.05, 1.72, 1.43, 1.18, 0.83, 0.47, 0.12, -0.35, -0.86, -1.52])
# The row's sequence: prompt then output. Its last token, 3, follows "1 2" twice, so no-repeat-2-gram bans 4
# and 7, and DRY penalises 4 (the repeat "1 2 3" of length 3) and 7 ("2 3", 2).
PROMPT = [0, 5]
OUTPUT = [1, 2, 3, 4, 9, 2, 3, 7, 6, 1, 2, 3]
SEQUENCE = PROMPT + OUTPUT
BACKEND = CpuBackend()


def _validated(logits: torch.Tensor, **params: Any):
    return validate_sample_request(build_sample_request(logits, **params), Limits())[0]


def _draw(seed0: int = 1000, **params: Any) -> tuple[np.ndarray, list[int]]:
    seeds = [seed0 + 7919 * i for i in range(DRAWS)]
    x = torch.tensor(LOGITS, dtype=torch.float32).expand(DRAWS, -1).contiguous()
    return BACKEND.sample(_validated(x, seed=seeds, **params)).tokens[:, 0].numpy(), seeds


def _processed(*, banned: tuple[int, ...] = (), dry: dict[int, np.float32] | None = None, repetition: float = 1.0,
               presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """Steps 2-4 in float32, as the contract computes them."""
    x = LOGITS.astype(np.float32)
    x[list(banned)] = -np.inf
    seen = set(SEQUENCE)
    counts = np.bincount(OUTPUT, minlength=len(x)).astype(np.float32)
    for t in seen:
        x[t] = x[t] / np.float32(repetition) if x[t] > 0 else x[t] * np.float32(repetition)
    x = x - np.float32(presence) * (counts > 0) - np.float32(frequency) * counts
    for t, penalty in (dry or {}).items():
        x[t] -= penalty
    return x.astype(np.float64)


def _exact(x: np.ndarray, seeds: list[int], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, top_n_sigma: float = 0.0, typical_p: float = 1.0, xtc_threshold: float = 0.1,
           xtc_probability: float = 0.0) -> np.ndarray:
    """The distribution of the draws: L4-L6 then steps 7-10, averaged over the rows' XTC coins."""
    def given(acts: bool) -> np.ndarray:
        y = ref.typical(ref.top_n_sigma(x, top_n_sigma), typical_p)
        y = ref.xtc(y, xtc_threshold) if acts else y
        return ref.filtered_distribution(y, temperature, top_k, top_p, min_p)

    if xtc_probability == 0:
        return given(False)
    acting = sum(ref.xtc_acts(seed, 0, 0, xtc_probability) for seed in seeds)
    assert 0 < acting < len(seeds)  # both branches are exercised
    return (acting * given(True) + (len(seeds) - acting) * given(False)) / len(seeds)


def _assert_distributed(tokens: np.ndarray, probs: np.ndarray) -> None:
    outside = ~np.isin(tokens, np.nonzero(probs > 0)[0])
    assert not outside.any(), f"drew {sorted(set(tokens[outside].tolist()))}, whose probability is 0"
    observed = np.bincount(tokens, minlength=len(probs))[probs > 0]
    expected = probs[probs > 0] * len(tokens)
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(expected) == 1:
        return
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > ALPHA


DRY = {"dry_multiplier": 0.6, "dry_base": 1.5, "dry_allowed_length": 2}
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.2, "frequency_penalty": 0.1}

CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # name: (request parameters, processing of steps 2-4, step 5 and filters)
    "top_n_sigma": ({"top_n_sigma": 1.0}, {}, {"top_n_sigma": 1.0}),
    "typical_p": ({"typical_p": 0.6}, {}, {"typical_p": 0.6}),
    "xtc": ({"xtc_threshold": 0.1, "xtc_probability": 0.5}, {}, {"xtc_threshold": 0.1, "xtc_probability": 0.5}),
    "no_repeat_ngram": ({"no_repeat_ngram_size": 2}, {"banned": (4, 7)}, {}),
    "dry": (DRY, {"dry": "dry"}, {}),
    "min_tokens": ({"min_tokens": 20, "num_generated": 12, "stop_token_ids": [0, 1]}, {"banned": (0, 1)}, {}),
    "top_n_sigma_top_k": ({"top_n_sigma": 1.5, "top_k": 3}, {}, {"top_n_sigma": 1.5, "top_k": 3}),
    "typical_top_p": ({"typical_p": 0.8, "top_p": 0.7}, {}, {"typical_p": 0.8, "top_p": 0.7}),
    "xtc_min_p_temperature": ({"xtc_threshold": 0.12, "xtc_probability": 0.7, "min_p": 0.1, "temperature": 0.7}, {},
                              {"xtc_threshold": 0.12, "xtc_probability": 0.7, "min_p": 0.1, "temperature": 0.7}),
    "dry_penalties_top_k": ({**DRY, **PENALTIES, "top_k": 5}, {"dry": "dry", "repetition": 1.3, "presence": 0.2,
                                                               "frequency": 0.1}, {"top_k": 5}),
    "everything": ({**DRY, **PENALTIES, "no_repeat_ngram_size": 3, "min_tokens": 13, "num_generated": 12,
                    "stop_token_ids": [9], "top_n_sigma": 2.5, "typical_p": 0.95, "xtc_threshold": 0.1,
                    "xtc_probability": 0.5, "temperature": 0.8, "top_k": 6, "top_p": 0.95, "min_p": 0.02},
                   {"banned": (4, 9), "dry": "dry", "repetition": 1.3, "presence": 0.2, "frequency": 0.1},
                   {"top_n_sigma": 2.5, "typical_p": 0.95, "xtc_threshold": 0.1, "xtc_probability": 0.5,
                    "temperature": 0.8, "top_k": 6, "top_p": 0.95, "min_p": 0.02}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_exact_distribution(case: str) -> None:
    params, processing, later = CASES[case]
    if processing.get("dry"):
        processing = {**processing, "dry": ref.dry_penalties(SEQUENCE, DRY["dry_multiplier"], DRY["dry_base"],
                                                               DRY["dry_allowed_length"], -1, [])}
    tokens, seeds = _draw(prompt_token_ids=PROMPT, output_token_ids=OUTPUT, **params)
    probs = _exact(_processed(**processing), seeds, **later)
    assert (probs > 0).sum() >= 2  # a distribution, not one token
    _assert_distributed(tokens, probs)


def test_the_samplers_change_the_distribution() -> None:
    """The cases above test something: each sampler alone changes the exact distribution it is held to."""
    plain = _exact(_processed(), [0])
    for case in ("top_n_sigma", "typical_p", "no_repeat_ngram", "dry", "min_tokens"):
        params, processing, later = CASES[case]
        if processing.get("dry"):
            processing = {"dry": ref.dry_penalties(SEQUENCE, 0.6, 1.5, 2, -1, [])}
        assert not np.allclose(_exact(_processed(**processing), [0], **later), plain), case


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_never_emits_a_banned_token(n: int) -> None:
    rng = np.random.default_rng(n)
    history = rng.integers(0, 4, size=(64, 30))
    logits = torch.zeros(64, 6)
    logits[:, :4] = 20.0  # the repeatable tokens are by far the likeliest
    batch = _validated(logits, output_token_ids=history, no_repeat_ngram_size=n, seed=list(range(64)), temperature=0.0)
    tokens = BACKEND.sample(batch).tokens[:, 0].numpy()
    for row in range(64):
        assert tokens[row] not in ref.ngram_bans(history[row].tolist(), n)


def test_min_tokens_never_emits_a_stop_id_early() -> None:
    logits = torch.zeros(8, 5)
    logits[:, 2] = 50.0  # the stop id is all but certain
    generated = list(range(8))
    batch = _validated(logits, min_tokens=5, num_generated=generated, stop_token_ids=[2], seed=list(range(8)))
    tokens = BACKEND.sample(batch).tokens[:, 0].tolist()
    assert all(t != 2 for t in tokens[:5]) and tokens[5:] == [2, 2, 2]


def _processed_zeros(rows: int, vocab: int, **params: Any) -> torch.Tensor:
    """Zero logits after the processing of a request with `params`: -inf at the bans, minus the penalties."""
    x = torch.zeros(rows, vocab)
    processing = _validated(x, **params).processing
    return x if processing is None else apply_processing(x, processing)


@pytest.mark.parametrize("seed", range(6))
def test_derived_bans_and_penalties_match_the_reference(seed: int) -> None:
    """no-repeat-n-gram's bans and DRY's penalties of random sequences, windows and multi-token breakers."""
    rng = np.random.default_rng(seed)
    rows, vocab = 16, 6
    sequences = [rng.integers(0, 3 if row % 2 else vocab, size=int(rng.integers(0, 80))).tolist() for row in range(rows)]
    breakers = [[rng.integers(0, vocab, size=int(rng.integers(1, 3))).tolist() for _ in range(int(rng.integers(0, 3)))]
                for _ in range(rows)]
    last_n = rng.choice([-1, 5, 20, 200], size=rows).tolist()
    allowed = rng.integers(1, 4, size=rows).tolist()
    ngram = rng.integers(0, 4, size=rows).tolist()
    banned = _processed_zeros(rows, vocab, output_token_ids=sequences, no_repeat_ngram_size=ngram) == -np.inf
    penalised = -_processed_zeros(rows, vocab, output_token_ids=sequences, dry_multiplier=0.8, dry_base=1.75,
                                  dry_allowed_length=allowed, dry_penalty_last_n=last_n, dry_sequence_breakers=breakers)
    bans = {row: set(banned[row].nonzero().flatten().tolist()) for row in range(rows)}
    penalties = {row: {token: float(penalised[row, token]) for token in penalised[row].nonzero().flatten().tolist()}
                 for row in range(rows)}
    for row in range(rows):
        assert bans[row] == (ref.ngram_bans(sequences[row], ngram[row]) if ngram[row] else set()), row
        expected = ref.dry_penalties(sequences[row], 0.8, 1.75, allowed[row], last_n[row], breakers[row])
        assert penalties[row] == {t: float(v) for t, v in expected.items()}, row


def test_long_repeats_count_fifty_tokens() -> None:
    sequence = [1, 2] * 60  # the repeat "... 1 2" is as long as the sequence allows
    penalised = -_processed_zeros(1, 4, output_token_ids=sequence, dry_multiplier=1.0, dry_base=1.1,
                                  dry_allowed_length=2)[0]
    assert penalised.nonzero().flatten().tolist() == [1]
    # The base travels as float32: 1.1 is 1.10000002384...
    assert float(penalised[1]) == float(np.float32(np.float64(np.float32(1.1)) ** 48))


@pytest.mark.parametrize("position, iteration", [(0, 0), (17, 0), (3, 9)])
def test_xtc_coin_is_the_stated_philox_word(position: int, iteration: int) -> None:
    """Greedy rows reveal the coin: two top choices, so XTC (when it acts) leaves the second."""
    seeds = list(range(300))
    logits = torch.tensor([[5.0, 4.8] + [0.0] * 6]).expand(300, -1).contiguous()
    batch = _validated(logits, temperature=0.0, seed=seeds, position=position, iteration=iteration,
                       xtc_threshold=0.05, xtc_probability=0.4)
    tokens = BACKEND.sample(batch).tokens[:, 0].tolist()
    expected = [1 if ref.xtc_acts(seed, position, iteration, 0.4) else 0 for seed in seeds]
    assert tokens == expected and 0 < sum(expected) < 300


ALL = {"output_token_ids": OUTPUT, "prompt_token_ids": PROMPT, **DRY, "no_repeat_ngram_size": 2, "min_tokens": 20,
       "num_generated": 3, "stop_token_ids": [0], "top_n_sigma": 2.0, "typical_p": 0.9, "xtc_probability": 0.5,
       "dry_sequence_breakers": [[9], [6, 1]]}


def test_same_seed_same_token() -> None:
    first, _ = _draw(seed0=5, **ALL)
    second, _ = _draw(seed0=5, **ALL)
    assert np.array_equal(first, second)


def test_a_row_alone_and_inside_any_batch() -> None:
    rng = torch.Generator().manual_seed(3)
    requests = [
        ({**ALL}, 5),
        ({"typical_p": [0.5, 0.7, 0.9]}, 3),
        ({}, 4),
        ({"xtc_probability": 1.0, "xtc_threshold": 0.05, "top_k": 4, "position": 7}, 2),
        ({"output_token_ids": [[1, 2, 1, 2], [3, 3, 3]], "dry_multiplier": 1.0, "dry_allowed_length": 1,
          "dry_sequence_breakers": [[[3]], None]}, 2),
        ({"min_tokens": 4, "num_generated": 0, "stop_token_ids": [0, 1, 2], "no_repeat_ngram_size": 1,
          "output_token_ids": [5, 6]}, 3),
    ]
    batches = []
    for index, (params, rows) in enumerate(requests):
        logits = torch.randn(rows, 10, generator=rng) * 2
        batches.append(_validated(logits, seed=[100 * index + r for r in range(rows)], **params))
    alone = [BACKEND.sample(batch).tokens for batch in batches]
    merged = merge_batches(batches)
    together = split_result(BACKEND.sample(merged), [b.num_rows for b in batches])
    for single, part in zip(alone, together):
        assert torch.equal(single, part.tokens)
    every = torch.cat(alone)
    picked = torch.tensor([18, 0, 5, 12, 13, 2])
    assert torch.equal(BACKEND.sample(select_rows(merged, picked)).tokens, every[picked])


def test_diffusion_positions_draw_their_own_xtc_coins() -> None:

    logits = torch.tensor([5.0, 4.8, 0.0, 0.0]).expand(2, 6, -1).contiguous()
    request = build_diffusion_request(logits, torch.ones(2, 6, dtype=torch.uint8), seed=[11, 12], temperature=0.0,
                                      xtc_threshold=0.05, xtc_probability=0.5)
    workload, step, _ = validate_diffusion_request(request, Limits())
    tokens = diffusion_step(step(workload.compute()), BACKEND)[0]
    expected = [[1 if ref.xtc_acts(seed, position, 0, 0.5) else 0 for position in range(6)] for seed in (11, 12)]
    assert tokens.tolist() == expected


INVALID = {
    "params.typical_p": {"typical_p": 0.0},
    "params.top_n_sigma": {"top_n_sigma": float("nan")},
    "params.xtc_threshold": {"xtc_threshold": 1.5},
    "params.xtc_probability": {"xtc_probability": -0.1},
    "params.dry_multiplier": {"dry_multiplier": -1.0},
    "params.dry_base": {"dry_base": 0.5},
    "params.dry_allowed_length": {"dry_allowed_length": 0},
    "params.dry_penalty_last_n": {"dry_penalty_last_n": -2},
    "params.no_repeat_ngram_size": {"no_repeat_ngram_size": 33},
    "params.dry_sequence_breakers.lengths": {"dry_sequence_breakers": [list(range(17))]},
    "params.dry_sequence_breakers.ids": {"dry_sequence_breakers": [[3, 99]]},
    "params.dry_sequence_breakers.counts": {"dry_sequence_breakers": [[[1]] * 33, None]},
    "params.stop_token_ids.ids": {"stop_token_ids": [10]},
}


@pytest.mark.parametrize("field", list(INVALID))
def test_invalid_values_name_the_field(field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        _validated(torch.zeros(2, 10), **INVALID[field])
    assert err.value.field == field


def test_a_whole_sequence_longer_than_the_dry_window_is_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        _validated(torch.zeros(1, 10), output_token_ids=[1] * 8193, dry_multiplier=1.0)
    assert err.value.field == "params.dry_penalty_last_n" and "8192" in str(err.value)
    _validated(torch.zeros(1, 10), output_token_ids=[1] * 8193, dry_multiplier=1.0, dry_penalty_last_n=8192)


def test_defaults_change_nothing() -> None:
    x = torch.randn(4, 10)
    neutral = {"min_tokens": 0, "no_repeat_ngram_size": 0, "dry_multiplier": 0.0, "typical_p": 1.0,
               "top_n_sigma": 0.0, "xtc_probability": 0.0, "stop_token_ids": [1], "dry_sequence_breakers": [[2]]}
    assert _validated(x, seed=1, **neutral).processing is None
    assert torch.equal(BACKEND.sample(_validated(x, seed=1, **neutral)).tokens, BACKEND.sample(_validated(x, seed=1)).tokens)


@pytest.mark.parametrize("params", [{"typical_p": 0.5}, {"top_n_sigma": 1.0}, {"xtc_probability": 0.3},
                                    {"dry_multiplier": 1.0, "output_token_ids": [1, 1]},
                                    {"no_repeat_ngram_size": 1, "output_token_ids": [1]},
                                    {"min_tokens": 2, "stop_token_ids": [1]}])
def test_each_sampler_alone_makes_processing(params: dict[str, Any]) -> None:
    """The CUDA backend runs processing (on the GPU) exactly when a batch has some."""
    assert _validated(torch.zeros(1, 10), **params).processing is not None


def test_draft_positions_draw_the_coins_sample_draws_there() -> None:
    """Greedy target, XTC on: draft token j (the top choice) is accepted until XTC acts at position + j."""
    rows, n, position = 40, 4, 5
    target = torch.tensor([5.0, 4.8, 0.0, 0.0]).expand(rows, n + 1, -1).contiguous()
    request = build_verify_request(torch.zeros(rows, n, dtype=torch.int64), target,
                                   draft_probs=torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(rows, n, -1).contiguous(),
                                   seed=list(range(rows)), position=position, temperature=0.0, xtc_threshold=0.05,
                                   xtc_probability=0.3)
    accepted, tokens = verify_draft(validate_verify_request(request, Limits())[0])
    for seed in range(rows):
        acts = [ref.xtc_acts(seed, position + j, 0, 0.3) for j in range(n + 1)]
        first = acts.index(True) if True in acts else n + 1
        assert int(accepted[seed]) == min(first, n)
        assert int(tokens[seed, min(first, n)]) == (1 if first <= n else 0)


def test_what_the_sequence_samplers_read_is_bounded() -> None:
    history = [1, 2] * 4096
    with pytest.raises(InvalidArgument) as err:
        _validated(torch.zeros(129, 4), output_token_ids=history, dry_multiplier=1.0)
    assert err.value.field == "params.output_token_ids" and "1048576" in str(err.value)
    batch = _validated(torch.zeros(128, 4), output_token_ids=history, dry_multiplier=1.0)
    assert batch.processing.sequence_samplers is not None


@pytest.mark.parametrize("none", [[None, None], [[], []]])
def test_rows_that_all_have_no_breakers_are_no_breakers(none: list) -> None:
    """B entries each None or empty: no row has a breaker, as if none were given (not a refusal, and not one
    shared list of empty breakers)."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(5))
    params = dict(seed=[1, 2], output_token_ids=[[1, 2, 1, 2], [3, 3, 3]], dry_multiplier=1.0, dry_allowed_length=1)
    want = BACKEND.sample(_validated(logits, **params)).tokens
    assert torch.equal(BACKEND.sample(_validated(logits, dry_sequence_breakers=none, **params)).tokens, want)


@pytest.mark.parametrize("extra, alone", [
    ({}, True),
    ({"logit_bias": {3: 0.0}}, False),
    ({"banned_token_ids": [5]}, False),
    ({"repetition_penalty": 1.2, "output_token_ids": [1, 2]}, False),
    ({"no_repeat_ngram_size": 2, "output_token_ids": [1, 2, 1]}, False),
])
def test_the_local_samplers_alone_are_told_apart(extra: dict, alone: bool) -> None:
    """The CUDA backend reads float32 logits in place, with the samplers' kept tokens as a bitmask, only when the
    samplers are all of a call's processing (truncation_only): any other processing needs the copy they cut."""
    request = build_sample_request(torch.zeros(2, 64), seed=[1, 2], typical_p=0.9, **extra)
    processing = validate_sample_request(request, Limits())[0].processing
    assert truncation_only(processing) is alone
    assert processing.changes_beyond(frozenset()) is True  # the samplers themselves always change logits
