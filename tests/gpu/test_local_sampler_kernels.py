"""The CUDA backend's kernels for top-n-sigma, typical-p and XTC (csrc/local_samplers.cuh) against the torch reference
(backends/truncation.py) run on the same GPU tensors: the same tokens removed and every other logit's bits kept.

The kernels sum the reference's float64 statistics in another order (and typical-p's masses in fixed point), so a
kept set may differ only where the reference itself sits on a rounding edge: a logit within ~1e-15 of top-n-sigma's
cut, two typical-p scores or a cumulative mass and p within ~1e-13 of each other, an XTC probability within ~1e-15
of the threshold (docs/design/kernel-routing.md, "Local samplers"). Rows of equal logits (near_equal and tight rows
in bf16) put typical-p's cumulative mass on p itself (16000 of 32000 equal tokens at p = 0.5), where the two sums
round either way: there, and only there, a kept set may differ, by the one token at the cut (`_typical_edge`);
every other comparison is exact. The backend's tokens are compared with the CPU backend's, and a chi-square test (significance
ALPHA, fixed seeds) holds the draws to the distribution the reference leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace
from itertools import cycle, islice

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends.cpu import kept_token_mask
from tokensampler_server.backends.cuda_local_samplers import sigma_alone
from tokensampler_server.backends.processing import apply_processing, unpack_bitmask
from tokensampler_server.backends.truncation import apply_truncation
from tokensampler_server.core.config import Limits
from tokensampler_server.model.sampling import Truncation
from tokensampler_server.validation.sample import validate_sample_request

from .conftest import degenerate_rows, logits, rows_of_kind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ALPHA = 0.001  # significance of the chi-square tests (fixed seeds: the outcome is deterministic)

# Per-row values, cycled over the rows: each sampler's off value among them.
SAMPLERS: dict[str, dict[str, list[float]]] = {
    "top_n_sigma": {"n": [1.0, 0.5, 2.0, 3.0, 0.0]},
    "typical_p": {"p": [0.9, 0.2, 0.5, 0.99, 1.0]},
    "xtc": {"t": [0.1, 0.05, 0.3, 0.01], "q": [1.0, 0.5, 1.0, 1.0, 0.0]},
    "combined": {"n": [2.0, 3.0, 1.0, 0.0], "p": [0.9, 0.95, 0.5, 0.7, 1.0], "t": [0.1, 0.2, 0.05],
                 "q": [1.0, 0.5, 0.0]},
}


def _column(values: list[float] | float, rows: int) -> torch.Tensor:
    values = values if isinstance(values, list) else [values]
    return torch.tensor(list(islice(cycle(values), rows)), dtype=torch.float32)


def _truncation(rows: int, *, n: list[float] | float = 0.0, p: list[float] | float = 1.0,
                t: list[float] | float = 0.1, q: list[float] | float = 0.0, seed: int = 1234) -> Truncation:
    """The columns of `rows` rows; the coins are left to each implementation to draw (xtc_acts None)."""
    return Truncation(top_n_sigma=_column(n, rows), typical_p=_column(p, rows), xtc_threshold=_column(t, rows),
                      xtc_probability=_column(q, rows), seed=torch.arange(rows, dtype=torch.int64) * 7919 + seed,
                      position=torch.arange(rows, dtype=torch.int64) % 97,
                      iteration=torch.full((rows,), 3, dtype=torch.int64))


@pytest.fixture(scope="module")
def kernels(cuda_backend):
    return cuda_backend._local_samplers


MASS_EDGE = 1e-12  # a cumulative mass this close to p is decided by the rounding of its sum


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str,
                 edge: Callable[[int, list[int]], bool] | None = None) -> None:
    """The same bits everywhere: removed tokens -inf in both, kept ones untouched, NaN and +inf left as they were;
    with `edge`, a row may differ where edge(row, its differing tokens) finds the reference on a rounding edge."""
    differ = got.view(torch.int32) != want.view(torch.int32)
    rows = differ.any(dim=1).nonzero().flatten().tolist()
    rows = [r for r in rows if edge is None or not edge(r, differ[r].nonzero().flatten().tolist())]
    assert not rows, f"{what}: {int(differ[rows].sum())} logits differ, rows {rows[:8]}"


def _row(truncation: Truncation, row: int, **columns: torch.Tensor) -> Truncation:
    """Row `row` of `truncation` alone, with `columns` replaced."""
    one = {f.name: getattr(truncation, f.name)[row: row + 1] for f in fields(truncation)
           if getattr(truncation, f.name) is not None}
    return replace(truncation, **{**one, **columns})


def _typical_edge(x: torch.Tensor, truncation: Truncation, row: int, tokens: list[int]) -> bool:
    """Whether a row differs by one token that is typical-p's first token past the cut, whose place is decided by a
    cumulative mass within MASS_EDGE of p: the reference's mass before it or through it."""
    p = float(truncation.typical_p[row])
    if p >= 1 or len(tokens) != 1:
        return False
    # typical-p reads what top-n-sigma left (L4 before L5); XTC (L6) comes after it
    before = apply_truncation(x[row: row + 1].clone(), _row(truncation, row, typical_p=torch.ones(1),
                                                             xtc_probability=torch.zeros(1)))
    log_q = torch.log_softmax(torch.where(torch.isfinite(before), before, float("-inf")), dim=1, dtype=torch.float64)
    q = log_q.exp()
    score = (log_q - (q * log_q).nan_to_num(nan=0.0).sum(dim=1, keepdim=True)).abs()
    order = torch.sort(score, dim=1, stable=True).indices[0]
    cumulative = q[0, order].cumsum(dim=0)
    place = int((order == tokens[0]).nonzero())
    masses = cumulative[max(place - 1, 0): place + 1]
    first_past = int((cumulative <= p).sum())  # the reference's place of the first token past the cut
    return abs(place - first_past) <= 1 and bool(((masses - p).abs() <= MASS_EDGE).any())


def _kept_as_logits(kernels, x: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """The kernels' kept bits over x (read only: checked) as logits, the tokens they clear -inf; bits past the
    vocabulary must be set."""
    before = x.clone()
    kept = kernels.kept(x, truncation)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32)), "the kept bits' route wrote the logits"
    if kept is None:
        return x.clone()
    vocab = x.shape[1]
    assert kept.shape == (x.shape[0], (vocab + 31) // 32)
    if vocab % 32:
        tail = kept[:, -1] >> (vocab % 32)  # arithmetic shift: all ones (-1) when every bit past V is set
        assert bool((tail == -1).all()), "a bit past the vocabulary was cleared"
    return x.masked_fill(~unpack_bitmask(kept, vocab), float("-inf"))


def _floor_as_logits(kernels, x: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """The kernels' floors over x (read only: checked) as logits, the tokens below a row's floor -inf; a row whose
    top-n-sigma is off must have the floor -inf."""
    before = x.clone()
    floor = kernels.floor(x, truncation)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32)), "the floor's route wrote the logits"
    if floor is None:
        return x.clone()
    assert floor.shape == (x.shape[0],) and floor.dtype == torch.float32
    off = (truncation.top_n_sigma <= 0).cuda()
    assert bool((floor[off] == float("-inf")).all()), "a row without top-n-sigma has a floor"
    return x.masked_fill(x < floor.unsqueeze(1), float("-inf"))


def _check(kernels, x: torch.Tensor, truncation: Truncation, what: str) -> torch.Tensor:
    """Kernels and reference on copies of x, the kernels every way (-inf written in place, kept bits over x left as
    it is, and for top-n-sigma alone the rows' floors); returns the reference's result."""
    want = apply_truncation(x.clone(), truncation)
    edge = lambda row, tokens: _typical_edge(x, truncation, row, tokens)  # noqa: E731
    _assert_same(kernels.apply(x.clone(), truncation), want, what, edge)
    _assert_same(_kept_as_logits(kernels, x, truncation), want, f"{what}, kept bits", edge)
    if sigma_alone(truncation):
        _assert_same(_floor_as_logits(kernels, x, truncation), want, f"{what}, floor")
    return want


@pytest.mark.parametrize("num_rows", [1, 8, 64])
@pytest.mark.parametrize("vocab", [111, 32000, 151936])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_kept_sets_are_the_references(kernels, sampler: str, vocab: int, num_rows: int) -> None:
    """Spiky, flat, tight, plateau and near-equal rows, fp32 and bf16 values, per-row parameters."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(vocab + num_rows)
    truncation = _truncation(num_rows, **SAMPLERS[sampler])
    removed_any = False
    for kind in ("spiky", "flat", "tight", "plateau", "near_equal"):
        x = rows_of_kind(kind, num_rows, vocab, gen, dev)
        for dtype in (torch.float32, torch.bfloat16):
            want = _check(kernels, x.to(dtype).float(), truncation, f"{kind} {dtype}")
            removed_any |= bool(torch.isinf(want).any())
    assert removed_any  # the cases cut something


def test_other_processing_before_them(kernels) -> None:
    """Bans, bias, penalties, no-repeat-n-gram and DRY before the local samplers: the whole processing with the
    kernels gives the bits of the whole processing in torch."""
    rows, vocab = 32, 32000
    g = torch.Generator().manual_seed(7)
    x = logits("spiky", rows, vocab, seed=3)
    request = build_sample_request(
        x, seed=list(range(rows)), position=5,
        banned_token_ids=[torch.randint(0, vocab, (20,), generator=g).tolist()] * rows,
        logit_bias={11: 30.0, 12: -5.0, 13: 2.5}, repetition_penalty=1.3, presence_penalty=0.5,
        output_token_ids=torch.randint(0, 60, (rows, 200), generator=g).tolist(), no_repeat_ngram_size=2,
        dry_multiplier=0.8, top_n_sigma=[3.0, 0.0] * (rows // 2), typical_p=[0.8, 0.95, 1.0, 0.6] * (rows // 4),
        xtc_threshold=0.05, xtc_probability=0.5)
    processing = validate_sample_request(request, Limits())[0].processing
    x = x.cuda()
    want = apply_processing(x.clone(), processing)
    got = apply_processing(x.clone(), processing, truncate=kernels.apply)
    _assert_same(got, want, "processing")


def test_rows_without_a_finite_logit_one_finite_logit_and_nan(kernels) -> None:
    """Row 0 has no finite logit, row 1 a NaN every 7th token, row 2 one finite logit; +inf in row 3. NaN and +inf
    stay as they are; every sampler keeps a row's only token."""
    vocab = 32000
    x = degenerate_rows(8, vocab, torch.device("cuda"), torch.Generator(device="cuda").manual_seed(1))
    x[3, 100] = float("inf")
    for sampler, columns in SAMPLERS.items():
        want = _check(kernels, x, _truncation(8, **columns), sampler)
        assert torch.isnan(want[1, ::7]).all() and want[3, 100] == float("inf")
        assert want[2, 12345] == 1.0


def test_off_values_change_nothing(kernels) -> None:
    """n = 0 (and below), p = 1, xtc_probability = 0: not a bit changes, and no kept bits are made."""
    x = logits("spiky", 16, 32000, seed=2).cuda()
    truncation = _truncation(16, n=[0.0, -1.0], p=1.0, t=0.1, q=0.0)
    _assert_same(kernels.apply(x.clone(), truncation), x, "off")
    assert kernels.kept(x, truncation) is None
    assert kernels.floor(x, truncation) is None


def test_typical_cut_among_equal_logits_goes_by_id(kernels) -> None:
    """The cut falls among tokens of one logit: 3200 of them (sorted in one block), and 50646 (more than a block
    sorts: walked in id order); the reference keeps a prefix of them by id."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(4)
    for vocab, step in ((32000, 10), (151936, 3)):
        x = torch.randn(2, vocab, device=dev, generator=gen)
        x[:, ::step] = 4.0
        want = _check(kernels, x, _truncation(2, p=[0.5, 0.3]), f"equal logits every {step}th")
        kept = torch.isfinite(want[:, ::step]).sum(dim=1)
        assert ((kept > 0) & (kept < x[:, ::step].shape[1])).all()  # the cut lies inside the plateau


def test_typical_cut_in_a_crowded_bin_of_distinct_scores(kernels) -> None:
    """6000 distinct logits within 6e-6 of 0.001 (one score bin, more tokens than a block sorts, all scores
    different) and 6000 near -5: the cut falls inside the first cluster, found by radix passes over the scores."""
    vocab = 151936
    steps = 1.0 + torch.arange(6000, dtype=torch.float32) * 2.0**-20
    x = torch.full((1, vocab), float("-inf"))
    x[0, 1000:7000] = 0.001 * steps
    x[0, 80000:86000] = -5.0 * steps
    want = _check(kernels, x.cuda(), _truncation(1, p=0.5), "crowded bin")
    kept = int(torch.isfinite(want[0, 1000:7000]).sum())
    assert 0 < kept < 6000


def test_xtc_with_more_top_choices_than_a_chunk_lists(kernels) -> None:
    """200 tokens at q = 1/200 >= t = 0.004 in one chunk (more than its list of candidates): all but the last id
    removed; with t above their q, nothing; a row of one top choice keeps it."""
    vocab = 32000
    x = torch.full((3, vocab), float("-inf"), device="cuda")
    x[:, 500:700] = 0.0
    x[2, 500:700] = -30.0
    x[2, 9000] = 0.0
    want = _check(kernels, x, _truncation(3, t=[0.004, 0.006, 0.5], q=1.0), "xtc overflow")
    assert int(torch.isfinite(want[0]).sum()) == 1 and bool(torch.isfinite(want[0, 699]))
    assert int(torch.isfinite(want[1]).sum()) == 200
    assert int(torch.isfinite(want[2]).sum()) == 201


def test_xtc_with_more_top_choices_than_the_finishing_block_gathers(kernels) -> None:
    """60 tokens at the top of each of 40 chunks (each chunk's list holds them, the row's 2400 do not fit the
    finishing block's gather): all but the last id removed at t = 4e-4 <= q = 1/2400, none at t = 5e-4; on one
    chunk's worth fewer chunks the gather holds them all."""
    chunk, chunks = 8192, 40
    vocab = chunk * chunks
    x = torch.full((3, vocab), -40.0, device="cuda")
    tops = (torch.arange(chunks, device="cuda") * chunk).unsqueeze(1) + torch.arange(60, device="cuda") * 7
    x[:, tops.flatten()] = 0.0
    x[2, tops[30:].flatten()] = -40.0  # 30 chunks of 60: 1800 gathered
    want = _check(kernels, x, _truncation(3, t=[4e-4, 5e-4, 5e-4], q=1.0), "xtc gather spill")
    assert int(torch.isfinite(want[0]).sum()) == vocab - 2399
    assert int(torch.isfinite(want[1]).sum()) == vocab
    assert int(torch.isfinite(want[2]).sum()) == vocab - 1799


def test_xtc_with_top_choices_where_float32_sums_decide_wrongly(kernels) -> None:
    """The first token each thread of a chunk sums (4864 of them) at logit 0, every other at -26 ln 2 (e^x = 2^-26,
    which vanishes beside 1 in float32): the kernels' float32 sums come to 4864, the float64 sum is 4.5e-7 larger.
    With t the next float32 above the float64 q of a top token, the float32 sum puts every top token in A (XTC would
    remove 4863 of them), the float64 one none; with t just below it, both remove all but the last. The kernels
    find q within their sums' error of t and sum the row again in float64, as the reference decides."""
    vocab = 151936
    x = torch.full((vocab,), -26 * math.log(2)).float()
    tops = [8192 * chunk + 4 * thread for chunk in range((vocab + 8191) // 8192) for thread in range(256)
            if 8192 * chunk + 4 * thread < vocab]
    x[tops] = 0.0
    q = float(torch.softmax(x.double(), dim=0)[tops[0]])
    near = np.float32(q)
    above = near if float(near) > q else np.nextafter(near, np.float32(1))
    below = near if float(near) <= q else np.nextafter(near, np.float32(0))
    assert q < float(above) < 1 / len(tops)  # between the float64 q and the float32 sums' q
    rows = x.expand(2, vocab).contiguous().cuda()
    want = _check(kernels, rows, _truncation(2, t=[float(above), float(below)], q=1.0), "xtc against float32 sums")
    assert bool(torch.isfinite(want[0]).all())
    assert int(torch.isfinite(want[1, tops]).sum()) == 1 and bool(torch.isfinite(want[1, tops[-1]]))


def test_a_floor_without_kept_bits_is_refused_beside_typical_p_or_xtc(kernels) -> None:
    """Asking for floors says the logits are only read: with no kept bits to cut into and a row using XTC or
    typical-p, the binding refuses instead of writing their removals into the logits."""
    x = logits("spiky", 4, 1000, seed=3).cuda()
    before = x.clone()
    floor = torch.empty(4, device="cuda")
    for truncation in (_truncation(4, n=1.0, t=0.1, q=1.0), _truncation(4, p=0.9)):
        with pytest.raises(ValueError, match="floor given without keep"):
            kernels._launch(x, truncation, floor=floor.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(x, before)


def test_xtc_coins_are_the_references(kernels) -> None:
    """Probability 0.5 over 4096 rows: the kernels' coins (drawn on the GPU) act on the rows where the reference's
    do, and on about half of them."""
    rows, vocab = 4096, 111
    x = logits("spiky", rows, vocab, seed=9).cuda()
    want = _check(kernels, x, _truncation(rows, t=0.01, q=0.5, seed=77), "coins")
    acted = (torch.isinf(want).any(dim=1)).sum().item()
    assert 1800 < acted < 2300


def test_alone_or_in_any_batch_the_same_bits(kernels) -> None:
    """A row's result does not depend on the rows beside it, and two calls give the same bits."""
    rows, vocab = 24, 151936
    x = logits("flat", rows, vocab, seed=11).cuda()
    truncation = _truncation(rows, **SAMPLERS["combined"])
    full = kernels.apply(x.clone(), truncation)
    torch.cuda.synchronize()  # the next call reuses the pinned buffer of this one's rows
    _assert_same(kernels.apply(x.clone(), truncation), full, "repeated")
    for part in ([5], [0, 17], list(range(8, 24))):
        index = torch.tensor(part)
        _assert_same(kernels.apply(x[index.cuda()].clone(), truncation.rows(index)), full[index.cuda()], f"rows {part}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_samples_through_the_kernels(cuda_backend, monkeypatch: pytest.MonkeyPatch,
                                                 dtype: torch.dtype) -> None:
    """CudaBackend.sample takes the kernels for the local samplers (not the torch reference): over float32 logits
    that nothing else processes, no copy made, their kept bits, or the rows' floors for top-n-sigma alone; -inf
    written into a float32 copy otherwise (bf16 logits, or other processing before them)."""
    calls: list[str] = []
    samplers = cuda_backend._local_samplers
    apply, entries = samplers.apply, samplers.entries

    def spy_entries(x: torch.Tensor, truncation: Truncation) -> list[int]:
        got = entries(x, truncation)
        calls.append("floor" if got[3] else "kept")
        return got

    monkeypatch.setattr(samplers, "apply", lambda x, t: calls.append("apply") or apply(x, t))
    monkeypatch.setattr(samplers, "entries", spy_entries)
    fp32 = dtype == torch.float32
    bias, with_xtc = {"logit_bias": {3: 1.0}}, {"top_n_sigma": 1.0, "xtc_probability": [0.0, 0.5] * 2}
    for sampler, extra, route in (({"typical_p": 0.9}, {}, "kept" if fp32 else "apply"),
                                  ({"typical_p": 0.9}, bias, "apply"),
                                  ({"top_n_sigma": [1.0, 0.0] * 2}, {}, "floor" if fp32 else "apply"),
                                  (with_xtc, {}, "kept" if fp32 else "apply"),
                                  ({"top_n_sigma": 1.0}, bias, "apply")):
        calls.clear()
        request = build_sample_request(logits("spiky", 4, 1000, seed=1).to(dtype), seed=[1, 2, 3, 4], **sampler,
                                       **extra)
        cuda_backend.sample(validate_sample_request(request, Limits())[0])
        assert calls == [route], (sampler, extra, calls)


ROUTE_SAMPLERS = {
    "kept bits": {"top_n_sigma": [1.0, 0.0, 2.0, 3.0], "typical_p": [0.9, 1.0, 0.5, 0.95],
                  "xtc_threshold": [0.05, 0.1], "xtc_probability": [1.0, 0.5, 0.0]},
    "floor": {"top_n_sigma": [1.0, 0.0, 2.0, 3.0, 0.5], "min_p": [0.0, 0.0, 0.05]},
}


@pytest.mark.parametrize("route", list(ROUTE_SAMPLERS))
def test_kept_bits_or_floor_and_the_copy_give_the_same_results(cuda_backend, route: str) -> None:
    """The same request through the route that only reads the logits (kept bits, or the rows' floors for
    top-n-sigma alone) and through the copy (a bias of 0 on token 0 sends it there): the same tokens, flags,
    processed log-probs and top log-probs bit for bit, NaN and +inf rows and greedy rows among them, under top-k
    (one-pass and large), top-p and min-p; the kernels settle the same rows again in both, and none is handed to the
    exact filter."""
    rows, vocab = 32, 151936
    x = logits("flat", rows, vocab, seed=5)
    x[1, ::7] = float("nan")
    x[3, 100] = float("inf")
    x[4] = float("-inf")
    x[4, 999] = 0.5
    params = {**ROUTE_SAMPLERS[route], "top_k": [0, 50, 1000, 0], "top_p": [1.0, 0.9],
              "temperature": [0.8, 0.0, 1.0, 0.5]}
    params = {key: list(islice(cycle(value), rows)) for key, value in params.items()}
    results, settled = [], []
    for extra in ({}, {"logit_bias": {0: 0.0}}):
        request = build_sample_request(x, seed=list(range(rows)), position=11, num_samples=3, logprobs_mode="processed",
                                       return_logprobs=True, top_logprobs=5, **params, **extra)
        batch = validate_sample_request(request, Limits())[0]
        before = cuda_backend.fallbacks()
        results.append(cuda_backend.sample(batch))
        after = cuda_backend.fallbacks()
        assert after["exact_rows"] == before["exact_rows"]
        settled.append(after["in_kernel"] - before["in_kernel"])
    assert settled[0] == settled[1]
    kept, copied = results
    for name in ("tokens", "valid", "nan_detected", "logprobs", "top_logprob_ids", "top_logprobs"):
        assert torch.equal(getattr(kept, name), getattr(copied, name)), name
    assert bool(kept.nan_detected[1]) and bool(kept.nan_detected[3]) and not bool(kept.nan_detected[0])
    assert bool((kept.tokens[4] == 999).all())


def _batch(params: dict, rows: int, vocab: int, generator: str, temperature: float, samples: int):
    x = logits(generator, rows, vocab, seed=rows + vocab)
    request = build_sample_request(x, seed=list(range(100, 100 + rows)), position=7, temperature=temperature,
                                   num_samples=samples, **params)
    return validate_sample_request(request, Limits())[0]


REQUESTS = {
    "top_n_sigma": {"top_n_sigma": [1.0, 2.0]},
    "typical_p": {"typical_p": [0.9, 0.5]},
    "xtc": {"xtc_threshold": [0.1, 0.05], "xtc_probability": [1.0, 0.5]},
    "combined": {"top_n_sigma": 3.0, "typical_p": 0.9, "xtc_threshold": 0.1, "xtc_probability": 0.5, "top_k": 50,
                 "top_p": 0.9},
}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("generator", ["spiky", "flat"])
@pytest.mark.parametrize("name", list(REQUESTS))
def test_tokens_agree_with_the_cpu_backend(cuda_backend, cpu_backend, name: str, generator: str,
                                           temperature: float) -> None:
    """V = 151936, 64 rows, 2 samples a row: greedy rows the same, sampled ones at least 99.9% the same."""
    params = {key: value * 32 if isinstance(value, list) else value for key, value in REQUESTS[name].items()}
    batch = _batch(params, 64, 151936, generator, temperature, 2)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.valid, want.valid)
    mismatches = int((got.tokens != want.tokens).sum())
    if temperature == 0:
        assert mismatches == 0
    else:
        assert mismatches <= max(1, got.tokens.numel() // 1000), f"{mismatches} of {got.tokens.numel()} tokens differ"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(REQUESTS))
def test_chi_square_of_the_draws(cuda_backend, name: str, temperature: float) -> None:
    """20000 draws of one 16-token row (distinct seeds) against the distribution the reference leaves, pooled over
    the rows' coins (XTC acts on some rows only): no draw outside a row's kept set, chi-square p-value above ALPHA."""
    vocab, draws = 16, 20_000
    row = logits("flat", 1, vocab, seed=vocab)[0] * 1.5
    params = {key: value[0] if isinstance(value, list) else value for key, value in REQUESTS[name].items()}
    request = build_sample_request(row.expand(draws, vocab).contiguous(), seed=list(range(draws)),
                                   temperature=temperature, **params)
    batch = validate_sample_request(request, Limits(max_batch_rows=draws))[0]
    tokens = cuda_backend.sample(batch).tokens[:, 0]
    processed = apply_processing(batch.logits.float(), batch.processing)  # the CPU reference
    probs = torch.softmax(processed.double() / temperature, dim=1)
    if "top_k" in params:  # the filters of steps 8-9 on what the local samplers left
        z = (processed - processed.max(dim=1, keepdim=True).values) / temperature
        kept = kept_token_mask(z, batch.top_k, batch.top_p, batch.min_p)
        probs = torch.where(kept, probs, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all()), "a token outside its row's kept set was drawn"
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    expected = probs.sum(dim=0).numpy()
    support = expected >= 5  # pool rare tokens so that every cell expects >= 5
    obs = np.append(counts[support], counts[~support].sum())
    exp = np.append(expected[support], expected[~support].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA
