"""Speculative-decoding verification (workloads/verify.py) against docs/semantics.md, choice 16.

Distribution tests are chi-square goodness-of-fit tests over many seeded rows (significance 0.001,
as in test_cpu_semantics.py); expectations are computed independently in float64 numpy. Draft tokens
are drawn from p_j with a fixed torch generator, so every test is deterministic.
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
import torch
from scipy import stats
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.philox import philox4x32
from tokensampler_server.workloads.verify import DraftVerification, acceptance_uniforms, verify_draft
from tokensampler_server.model.sampling import LogitProcessing, TokenEntries

from .batches import make_batch
from .test_cpu_semantics import ALPHA, assert_fits, exact_distribution

ROWS = 20_000
VOCAB = 12


def make_verification(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
    seed: torch.Tensor | None = None,
    position: int | torch.Tensor = 0,
    iteration: int | torch.Tensor = 0,
    processing: LogitProcessing | None = None,
) -> DraftVerification:
    """A verification of B = draft_ids.shape[0] rows; scalars are shared, tensors give one value per row."""
    num_rows = draft_ids.shape[0]

    def column(value: float | int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.as_tensor(value, dtype=dtype)
        return tensor.expand(num_rows).clone() if tensor.dim() == 0 else tensor.clone()

    return DraftVerification(
        draft_ids=draft_ids,
        draft_probs=draft_probs,
        target_logits=target_logits,
        temperature=column(temperature, torch.float32),
        top_k=column(top_k, torch.int32),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        seed=torch.arange(num_rows) if seed is None else seed,
        position=column(position, torch.int64),
        iteration=column(iteration, torch.int64),
        processing=processing,
    )


def random_pair(generator: torch.Generator, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft probabilities [n, V] (some zeros, so the residual matters) and target logits [n + 1, V].

    Both perturb shared logits, as a draft model approximates its target, so that long accepted runs
    are common enough to test.
    """
    shared = 1.5 * torch.randn(num_drafts + 1, VOCAB, generator=generator)
    draft_logits = shared[:num_drafts] + 0.6 * torch.randn(num_drafts, VOCAB, generator=generator)
    draft_logits[torch.rand(num_drafts, VOCAB, generator=generator) < 0.2] = float("-inf")
    target_logits = shared + 0.6 * torch.randn(num_drafts + 1, VOCAB, generator=generator)
    return torch.softmax(draft_logits, dim=1), target_logits


def draw_drafts(draft_probs: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Draft tokens int64 [rows, n], token j drawn from draft_probs[j]."""
    return torch.stack([torch.multinomial(p, rows, replacement=True, generator=generator) for p in draft_probs], dim=1)


def run_rows(draft_probs: torch.Tensor, target_logits: torch.Tensor, generator: torch.Generator, **params):
    """verify_draft over ROWS rows that share (p, target) and differ in seed and drafts."""
    draft_ids = draw_drafts(draft_probs, ROWS, generator)
    v = make_verification(
        draft_ids,
        draft_probs.unsqueeze(0).expand(ROWS, -1, -1),
        target_logits.unsqueeze(0).expand(ROWS, -1, -1),
        **params,
    )
    return verify_draft(v)


TARGET_CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7": dict(temperature=0.7),
    "top_k 5": dict(temperature=1.0, top_k=5),
    "top_p 0.8": dict(temperature=1.0, top_p=0.8),
    "combined": dict(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("case", range(2), ids=lambda c: f"pair {c}")
@pytest.mark.parametrize("name", TARGET_CASES)
def test_emitted_tokens_follow_the_target(name: str, case: int) -> None:
    """Token k of the output (for rows that emit one) is distributed as q_k: k = 0 for every row, the
    later ones conditional on the draft prefix being accepted (q_j does not depend on the prefix here),
    k = n being the bonus."""
    num_drafts = 2
    params = TARGET_CASES[name]
    generator = torch.Generator().manual_seed(100 * case + list(TARGET_CASES).index(name))
    draft_probs, target_logits = random_pair(generator, num_drafts)
    accepted, tokens = run_rows(draft_probs, target_logits, generator, **params)
    for k in range(num_drafts + 1):
        emitted = tokens[accepted >= k, k].numpy()
        assert (emitted >= 0).all()
        expected = exact_distribution(target_logits[k].numpy(), **params)
        assert_fits(np.bincount(emitted, minlength=VOCAB), expected)


def _expected_lengths(draft_probs: np.ndarray, target: np.ndarray) -> np.ndarray:
    """P(accepted = k), k = 0..n: acceptance at j given the prefix has probability sum_i min(p_j, q_j)."""
    beta = np.minimum(draft_probs, target[: len(draft_probs)]).sum(axis=1)
    reach = np.concatenate([[1.0], np.cumprod(beta)])
    return reach * np.concatenate([1.0 - beta, [1.0]])


@pytest.mark.parametrize("name", TARGET_CASES)
def test_accepted_lengths_match_theory(name: str) -> None:
    num_drafts = 3
    params = TARGET_CASES[name]
    # A seed base under which every case accepts each position with probability in (0.15, 0.97).
    generator = torch.Generator().manual_seed(12 + list(TARGET_CASES).index(name))
    draft_probs, target_logits = random_pair(generator, num_drafts)
    accepted, _ = run_rows(draft_probs, target_logits, generator, **params)
    target = np.stack([exact_distribution(row.numpy(), **params) for row in target_logits])
    expected = _expected_lengths(draft_probs.numpy().astype(np.float64), target)
    assert_fits(np.bincount(accepted.numpy(), minlength=num_drafts + 1), expected)


def test_processing_applies_to_every_target_position() -> None:
    """Bias, a ban and penalties from the row's history shape q at every position."""
    num_drafts = 1
    generator = torch.Generator().manual_seed(3)
    draft_probs, target_logits = random_pair(generator, num_drafts)
    history, banned, biased = [0, 0, 4], 2, 6

    def entries(tokens: list[int]) -> TokenEntries:
        rows = torch.arange(ROWS).repeat_interleave(len(tokens))
        return TokenEntries(rows=rows, tokens=torch.tensor(tokens).repeat(ROWS))

    processing = LogitProcessing(
        banned=entries([banned]),
        bias=entries([biased]),
        bias_values=torch.full((ROWS,), 1.25),
        output_tokens=entries(history),
        repetition_penalty=torch.full((ROWS,), 1.4),
        frequency_penalty=torch.full((ROWS,), 0.3),
    )
    accepted, tokens = run_rows(draft_probs, target_logits, generator, processing=processing)
    for k in range(num_drafts + 1):
        x = target_logits[k].numpy().astype(np.float64).copy()
        x[banned] = -np.inf
        x[biased] += 1.25
        for token in set(history):
            x[token] = x[token] / 1.4 if x[token] > 0 else x[token] * 1.4
            x[token] -= 0.3 * history.count(token)
        emitted = tokens[accepted >= k, k].numpy()
        assert_fits(np.bincount(emitted, minlength=VOCAB), exact_distribution(x, 1.0))


def test_chi_square_detects_a_wrong_target() -> None:
    """The check has power: tokens verified against T = 1 are rejected as a sample of T = 1.3."""
    generator = torch.Generator().manual_seed(11)
    draft_probs, target_logits = random_pair(generator, 2)
    _, tokens = run_rows(draft_probs, target_logits, generator, temperature=1.0)
    wrong = exact_distribution(target_logits[0].numpy(), temperature=1.3)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_fits(np.bincount(tokens[:, 0].numpy(), minlength=VOCAB), wrong)


MIXED_ROWS = dict(
    temperature=torch.tensor([1.0, 0.7, 0.0, 1.2, 0.9, 1.0]),
    top_k=torch.tensor([0, 4, 0, 0, 6, 3]),
    top_p=torch.tensor([1.0, 1.0, 1.0, 0.75, 0.9, 1.0]),
    min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0]),
    seed=torch.tensor([5, -3, 2**40 + 9, 0, 77, 123456789]),
    position=torch.tensor([0, 17, 3, 2**32 - 2, 100, 9]),
    iteration=torch.tensor([0, 1, 0, 4, 2, 0]),
)


def test_draft_equal_to_target_accepts_everything_and_the_bonus_is_sample() -> None:
    num_drafts, num_rows = 3, 6
    generator = torch.Generator().manual_seed(21)
    target_logits = 1.5 * torch.randn(num_rows, num_drafts + 1, VOCAB, generator=generator)
    filters = {name: MIXED_ROWS[name].tolist() for name in ("temperature", "top_k", "top_p", "min_p")}
    draft_probs = torch.zeros(num_rows, num_drafts, VOCAB)
    for i in range(num_rows):
        params = {name: values[i] for name, values in filters.items()}
        if params["temperature"] == 0:  # greedy target: q is one-hot at the argmax
            draft_probs[i].scatter_(1, target_logits[i, :num_drafts].argmax(dim=1, keepdim=True), 1.0)
            continue
        for j in range(num_drafts):
            draft_probs[i, j] = torch.from_numpy(exact_distribution(target_logits[i, j].numpy(), **params))
    # Draft tokens from p = q: every one of them has q > 0.
    draft_ids = torch.stack([torch.multinomial(row, 1, generator=generator).squeeze(1) for row in draft_probs])
    accepted, tokens = verify_draft(make_verification(draft_ids, draft_probs, target_logits, **MIXED_ROWS))
    assert (accepted == num_drafts).all()
    assert torch.equal(tokens[:, :num_drafts], draft_ids)
    bonus = CpuBackend().sample(
        make_batch(
            target_logits[:, num_drafts],
            **{**MIXED_ROWS, "position": MIXED_ROWS["position"] + num_drafts},
        )
    )
    assert torch.equal(tokens[:, num_drafts], bonus.tokens[:, 0])


def test_greedy_target_accepts_the_matching_prefix_and_corrects_with_the_argmax() -> None:
    num_drafts, num_rows = 4, 400
    generator = torch.Generator().manual_seed(5)
    target_logits = torch.randn(num_rows, num_drafts + 1, VOCAB, generator=generator)
    argmax = target_logits.argmax(dim=2)
    # Drafts that follow the argmax for a random number of steps, then differ.
    draft_ids = argmax[:, :num_drafts].clone()
    diverge = torch.randint(0, num_drafts + 1, (num_rows,), generator=generator)
    for j in range(num_drafts):
        wrong = (argmax[:, j] + torch.randint(1, VOCAB, (num_rows,), generator=generator)) % VOCAB
        draft_ids[:, j] = torch.where(diverge <= j, wrong, draft_ids[:, j])
    draft_probs = torch.softmax(torch.randn(num_rows, num_drafts, VOCAB, generator=generator), dim=2)
    accepted, tokens = verify_draft(make_verification(draft_ids, draft_probs, target_logits, temperature=0.0))
    assert torch.equal(accepted, diverge)
    expected = torch.where(torch.arange(num_drafts + 1) <= diverge.unsqueeze(1), argmax, torch.full_like(argmax, -1))
    assert torch.equal(tokens, expected)


def test_a_draft_token_outside_the_kept_set_is_always_rejected() -> None:
    generator = torch.Generator().manual_seed(9)
    target_logits = torch.randn(VOCAB, generator=generator).expand(2000, 2, -1).contiguous()
    kept = set(target_logits[0, 0].argsort(descending=True)[:3].tolist())
    outside = next(t for t in range(VOCAB) if t not in kept)
    draft_probs = torch.full((2000, 1, VOCAB), 1e-3)
    draft_probs[:, 0, outside] = 1.0  # the draft is sure of a token the target cannot emit
    draft_ids = torch.full((2000, 1), outside)
    accepted, tokens = verify_draft(make_verification(draft_ids, draft_probs, target_logits, top_k=3))
    assert (accepted == 0).all()
    assert set(tokens[:, 0].tolist()) <= kept
    assert (tokens[:, 1] == -1).all()


def _mixed_batch(num_rows: int = 6, num_drafts: int = 3) -> DraftVerification:
    generator = torch.Generator().manual_seed(31)
    draft_probs = torch.softmax(torch.randn(num_rows, num_drafts, VOCAB, generator=generator), dim=2)
    target_logits = draft_probs[:, :1].log().expand(-1, num_drafts + 1, -1) + 0.7 * torch.randn(
        num_rows, num_drafts + 1, VOCAB, generator=generator
    )
    draft_ids = torch.stack([torch.multinomial(row, 1, generator=generator).squeeze(1) for row in draft_probs])
    return make_verification(draft_ids, draft_probs, target_logits, **MIXED_ROWS)


def _select_rows(v: DraftVerification, rows: torch.Tensor) -> DraftVerification:
    """The same rows of `v` (no processing), in the order of `rows`."""
    assert v.processing is None
    return DraftVerification(**{f.name: getattr(v, f.name)[rows] for f in fields(v) if f.name != "processing"})


def test_reproducible_and_batch_invariant() -> None:
    v = _mixed_batch()
    accepted, tokens = verify_draft(v)
    again = verify_draft(v)
    assert torch.equal(again[0], accepted) and torch.equal(again[1], tokens)
    for row in range(v.draft_ids.shape[0]):
        row_accepted, row_tokens = verify_draft(_select_rows(v, torch.tensor([row])))
        assert row_accepted.item() == accepted[row].item()
        assert torch.equal(row_tokens[0], tokens[row])
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    shuffled_accepted, shuffled_tokens = verify_draft(_select_rows(v, order))
    assert torch.equal(shuffled_accepted, accepted[order]) and torch.equal(shuffled_tokens, tokens[order])


def test_draft_probabilities_are_renormalised() -> None:
    """Scaling p by a power of two renormalises to the same floats, so nothing changes."""
    generator = torch.Generator().manual_seed(51)
    draft_probs, target_logits = random_pair(generator, 3)
    draft_ids = draw_drafts(draft_probs, 2000, generator)
    target = target_logits.expand(2000, -1, -1)
    results = [
        verify_draft(make_verification(draft_ids, scale * draft_probs.expand(2000, -1, -1), target))
        for scale in (1.0, 8.0, 2.0**-5)
    ]
    for accepted, tokens in results[1:]:
        assert torch.equal(accepted, results[0][0]) and torch.equal(tokens, results[0][1])


def test_seed_iteration_and_position_change_the_outcome() -> None:
    """Over many rows, changing any Philox input changes some outcomes."""
    generator = torch.Generator().manual_seed(41)
    draft_probs, target_logits = random_pair(generator, 3)
    draft_ids = draw_drafts(draft_probs, 500, generator)
    base = dict(
        draft_ids=draft_ids,
        draft_probs=draft_probs.expand(500, -1, -1),
        target_logits=target_logits.expand(500, -1, -1),
    )
    _, tokens = verify_draft(make_verification(**base))
    for change in (dict(seed=torch.arange(500) + 1), dict(position=1), dict(iteration=1)):
        _, changed = verify_draft(make_verification(**base, **change))
        assert not torch.equal(changed, tokens), change


def test_target_dtypes_are_read_as_float32() -> None:
    v = _mixed_batch()
    for dtype in (torch.bfloat16, torch.float16):
        low = v.target_logits.to(dtype)
        as_low = verify_draft(replace(v, target_logits=low))
        as_float = verify_draft(replace(v, target_logits=low.to(torch.float32)))
        assert torch.equal(as_low[0], as_float[0]) and torch.equal(as_low[1], as_float[1])


def test_rows_without_a_finite_target_logit_are_invalid_and_isolated() -> None:
    v = _mixed_batch()
    accepted, tokens = verify_draft(v)
    target = v.target_logits.clone()
    target[1, 2] = float("nan")  # one position of row 1
    target[4] = float("-inf")  # all of row 4
    broken_accepted, broken_tokens = verify_draft(replace(v, target_logits=target))
    for row in (1, 4):
        assert broken_accepted[row] == 0 and (broken_tokens[row] == -1).all()
    others = torch.tensor([0, 2, 3, 5])
    assert torch.equal(broken_accepted[others], accepted[others])
    assert torch.equal(broken_tokens[others], tokens[others])


def test_acceptance_uniforms_use_their_own_counter_and_are_uniform() -> None:
    seed = torch.tensor([0, 1, -1, 2**33 + 5])
    position, iteration = torch.tensor([0, 7, 2**32 - 1, 3]), torch.tensor([0, 0, 9, 2])
    u = acceptance_uniforms(seed, position, iteration)
    assert u.dtype == torch.float64
    marker = torch.full_like(seed, 0xFFFFFFFF)
    key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    word = philox4x32((marker, position, iteration, marker), key)[0]
    assert torch.equal(u, ((word >> 8).to(torch.float64) + 0.5) / 2**24)
    zero = torch.zeros(1, dtype=torch.int64)
    many = acceptance_uniforms(torch.arange(50_000), zero, zero)
    assert ((many > 0) & (many < 1)).all()
    assert stats.kstest(many.numpy(), "uniform").pvalue >= ALPHA


def _verify_request(draft: np.ndarray, kind: str = "draft_probs", rows: int = 1000):
    """A VerifyDraftRequest of `rows` rows of one draft position over V = 2: draft token 0, flat target logits."""
    from tokensampler_client._proto import sampler_pb2 as pb
    from tokensampler_client.tensors import encode_tensor

    request = pb.VerifyDraftRequest(draft_ids=encode_tensor(np.zeros((rows, 1), np.int32)),
                                    target_logits=encode_tensor(np.zeros((rows, 2, 2), np.float32)),
                                    params=pb.SamplingParams(seed=list(range(1, rows + 1))))
    getattr(request, kind).CopyFrom(encode_tensor(np.tile(draft.astype(np.float32), (rows, 1, 1))))
    return request


def test_huge_draft_probabilities_are_the_distribution_they_scale_to() -> None:
    """[3e38, 1e38] is [0.75, 0.25] once renormalised; its fp32 sum overflows, which must not make p = 0 (every draft
    token accepted): the same tokens as the small form, for the same seeds."""
    from tokensampler_server.core.config import Limits
    from tokensampler_server.validation.workloads import validate_verify_request

    results = []
    for draft in (np.array([3e38, 1e38]), np.array([0.75, 0.25])):
        verification, _ = validate_verify_request(_verify_request(draft), Limits())
        results.append(verify_draft(verification))
    (accepted, tokens), (want_accepted, want_tokens) = results
    assert torch.equal(accepted, want_accepted) and torch.equal(tokens, want_tokens)
    assert 0.6 < float(want_accepted.float().mean()) < 0.73  # P(accept) = q/p = 0.5/0.75


@pytest.mark.parametrize("value", [float("-inf"), float("nan")])
def test_draft_logits_without_a_finite_value_are_refused_by_field(value: float) -> None:
    from tokensampler_server.core.config import Limits
    from tokensampler_server.core.errors import InvalidArgument
    from tokensampler_server.validation.workloads import validate_verify_request

    with pytest.raises(InvalidArgument) as refused:
        validate_verify_request(_verify_request(np.array([value, value]), "draft_logits", rows=2), Limits())
    assert "draft_logits" in str(refused.value)


def test_token_lists_are_counted_once_for_each_position_they_are_applied_at() -> None:
    """The lists apply at each of the n + 1 positions (workloads/verify.py): a request whose entries fit the limit
    once but not n + 1 times is refused by field, before any work; the same lists over one draft fit."""
    from tokensampler_client._proto import sampler_pb2 as pb
    from tokensampler_client.tensors import encode_tensor
    from tokensampler_server.core.config import Limits
    from tokensampler_server.core.errors import InvalidArgument
    from tokensampler_server.validation.workloads import validate_verify_request

    def request(n: int) -> pb.VerifyDraftRequest:
        return pb.VerifyDraftRequest(
            draft_ids=encode_tensor(np.zeros((1, n), np.int32)),
            target_logits=encode_tensor(np.zeros((1, n + 1, 2), np.float32)),
            draft_probs=encode_tensor(np.full((1, n, 2), 0.5, np.float32)),
            params=pb.SamplingParams(seed=[1], repetition_penalty=[1.5],
                                     output_token_ids=pb.TokenLists(ids=[0, 1] * 50, lengths=[100])))

    limits = Limits(max_token_entries=1000)
    validate_verify_request(request(8), limits)  # 100 entries x 9 positions
    with pytest.raises(InvalidArgument) as refused:
        validate_verify_request(request(10), limits)  # x 11
    assert refused.value.field == "params.output_token_ids.lengths" and "× 11 positions" in refused.value.message
