"""The workload kernels (workloads/cuda.py) against the torch references of workloads/.

Top-k probabilities: ids identical, probabilities to 1e-5 relative (the reference on the same GPU).
Diffusion steps and draft verification: tokens identical to the CPU reference for >= 99.9% of the
positions / rows, confidences to 1e-5 relative, the new mask identical where the tokens are.
"""

from __future__ import annotations

import pytest
import torch
from tokensampler_server.workloads.cuda import (
    WorkloadKernels,
    diffusion_step_cuda,
    topk_probs_cuda,
    verify_draft_cuda,
    workloads_of,
)
from tokensampler_server.workloads.diffusion import DiffusionStep, diffusion_step
from tokensampler_server.workloads.topk_probs import topk_probs
from tokensampler_server.workloads.verify import DraftVerification, verify_draft

from .conftest import case_generator, exact_gumbel_argmax, logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

V_QWEN = 151936


@pytest.fixture(scope="module")
def kernels() -> WorkloadKernels:
    return WorkloadKernels(0)


@pytest.fixture
def recomputed(monkeypatch) -> list[int]:
    """The rows each call of the kernels' torch reference recomputed (a spy on workloads.cuda's references), so
    that a kernel which flags its rows cannot turn "kernel vs reference" into "reference vs reference"."""
    import tokensampler_server.workloads.cuda as cuda_workloads

    rows: list[int] = []
    for name in ("topk_probs", "verify_draft"):
        reference = getattr(cuda_workloads, name)

        def spy(*args, _reference=reference, **kwargs):
            first = args[0]
            rows.append(int(first.draft_ids.shape[0] if isinstance(first, DraftVerification) else first.shape[0]))
            return _reference(*args, **kwargs)

        monkeypatch.setattr(cuda_workloads, name, spy)
    return rows


def _per_row(values: list[float], rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([values[i % len(values)] for i in range(rows)], dtype=dtype)


# -- top-k probabilities ------------------------------------------------------------------------------
@pytest.mark.parametrize("generator", ["spiky", "flat"])
@pytest.mark.parametrize("k", [1, 20, 50, 255])
@pytest.mark.parametrize("vocab", [1000, V_QWEN])
def test_topk_probs_matches_the_reference(kernels, generator, k, vocab, recomputed):
    x = logits(generator, 24, vocab, seed=k + vocab).cuda()
    t = _per_row([1.0, 0.7, 1.6, 0.05], 24, torch.float32).cuda()
    probs, ids = topk_probs_cuda(x, t, k, kernels)
    # Only rows whose k-th probability ties with the next (zeros underflowed at T = 0.05) may be recomputed, and, for
    # k above 128 over a large vocabulary, rows whose chunk held more than the kernel's 2048 candidates (measured:
    # 10 to 12 of these 24 rows at k = 255, V = 151936; docs/performance.md lists it among the gaps).
    ordered = torch.softmax(x.float() / t.unsqueeze(1), dim=1).sort(dim=1, descending=True).values
    ties = int((ordered[:, k - 1] == ordered[:, k]).sum()) if k < vocab else 0
    overflow = 12 if k > 128 and vocab > 100_000 else 0
    assert sum(recomputed) <= ties + overflow, f"{sum(recomputed)} rows recomputed, {ties} with a tie at the cut"
    ref_probs, ref_ids = topk_probs(x, t, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_probs_half_precision(kernels, dtype, recomputed):
    x = logits("spiky", 8, 32000, seed=3, dtype=dtype).cuda()
    t = torch.full((8,), 0.8).cuda()
    probs, ids = topk_probs_cuda(x, t, 40, kernels)
    assert sum(recomputed) <= 4, f"{sum(recomputed)} of 8 rows recomputed by the reference"
    ref_probs, ref_ids = topk_probs(x, t, 40)
    assert torch.equal(ids, ref_ids)  # bf16 ties are frequent: the flagged rows are recomputed
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-9)


def test_topk_probs_edge_rows(kernels):
    x = logits("flat", 6, 5000, seed=1)
    x[0] = float("-inf")  # nothing finite: probabilities 0, ids -1
    x[1, ::7] = float("nan")  # NaN and +inf read as -inf
    x[1, 3] = float("inf")
    x[2, :] = float("-inf")
    x[2, [10, 4000, 17]] = torch.tensor([1.0, 1.0, 0.5])  # fewer finite tokens than k, a tie
    x[3] = 0.0  # every probability equal: ids in order
    x[4, 100:] = -200.0  # probabilities underflowing to 0 at the cut
    t = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    x, t = x.cuda(), t.cuda()
    probs, ids = topk_probs_cuda(x, t, 120, kernels)
    ref_probs, ref_ids = topk_probs(x, t, 120)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(("k", "vocab"), [(20, 600_000), (127, V_QWEN), (254, 100_000)])
def test_topk_probs_merges_many_chunk_lists(kernels, k, vocab):
    # More chunk lists than the merge ranks at once: merged batch by batch.
    x = logits("spiky", 4, vocab, seed=k).cuda()
    t = torch.tensor([1.0, 0.5, 2.0, 1.0]).cuda()
    probs, ids = topk_probs_cuda(x, t, k, kernels)
    ref_probs, ref_ids = topk_probs(x, t, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("k", [1024, 2048, 20000])
def test_topk_probs_large_k_uses_the_reference_on_the_gpu(kernels, k):
    x = logits("spiky", 4, 20000, seed=9).cuda()
    t = torch.ones(4).cuda()
    probs, ids = topk_probs_cuda(x, t, k, kernels)
    ref_probs, ref_ids = topk_probs(x, t, k)
    assert torch.equal(ids, ref_ids) and torch.equal(probs, ref_probs)


# -- diffusion steps ----------------------------------------------------------------------------------
def _step(num_requests: int, length: int, vocab: int, *, seed: int, temperature: list[float], dtype=torch.float32,
          top_k: int = 0, threshold: list[float] | None = None, count: list[int] | None = None) -> DiffusionStep:
    g = torch.Generator().manual_seed(seed)
    x = logits("spiky", num_requests * length, vocab, seed=seed, dtype=dtype).view(num_requests, length, vocab)
    mask = torch.rand(num_requests, length, generator=g) < 0.7
    mask[0] = True
    if num_requests > 2:
        mask[2] = False  # nothing to decide in this request
    b = num_requests
    return DiffusionStep(
        logits=x, mask=mask, temperature=_per_row(temperature, b, torch.float32),
        top_k=torch.full((b,), top_k, dtype=torch.int32), top_p=torch.ones(b), min_p=torch.zeros(b),
        seed=torch.arange(b, dtype=torch.int64) * 1_000_003 + seed, iteration=torch.full((b,), 5, dtype=torch.int64),
        threshold=_per_row(threshold or [0.5, float("nan"), 0.99, 0.0], b, torch.float32),
        count=_per_row(count or [0, 3, 1, 0, 8], b, torch.int64),
    )


def _assert_step_agrees(got, ref, mask: torch.Tensor) -> None:
    tokens, conf, new_mask = (t.cpu() for t in got)
    ref_tokens, ref_conf, ref_mask = ref
    masked = mask.sum().item()
    agree = ((tokens == ref_tokens) & mask).sum().item()
    assert agree >= 0.999 * masked, f"{agree} of {masked} masked positions agree"
    assert torch.equal(tokens[~mask], ref_tokens[~mask])
    same = tokens == ref_tokens
    torch.testing.assert_close(conf[same], ref_conf[same], rtol=1e-5, atol=1e-9)
    if agree == masked:
        assert torch.equal(new_mask, ref_mask)


@pytest.mark.parametrize("vocab", [1000, V_QWEN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diffusion_step_matches_the_reference(kernels, cuda_backend, cpu_backend, vocab, dtype):
    step = _step(5, 40, vocab, seed=vocab % 97, temperature=[1.0, 0.0, 0.7, 1.3, 0.0], dtype=dtype)
    got = diffusion_step_cuda(step, kernels, cuda_backend)
    _assert_step_agrees(got, diffusion_step(step, cpu_backend), step.mask)


@pytest.mark.parametrize("length", [1024, 1025])
def test_diffusion_step_commits_in_the_row_pass_or_after_it(kernels, cuda_backend, cpu_backend, length):
    """Up to 1024 positions a request, the block that finishes a request's last row commits it; longer
    steps take the commit kernel after the row pass. Both agree with the reference, and a second call
    gives the same step (the requests' row counters are left zeroed)."""
    step = _step(3, length, 1000, seed=length, temperature=[1.0, 0.0, 0.5], count=[40, 3, 0])
    got = diffusion_step_cuda(step, kernels, cuda_backend)
    _assert_step_agrees(got, diffusion_step(step, cpu_backend), step.mask)
    again = diffusion_step_cuda(step, kernels, cuda_backend)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


def test_diffusion_step_flat_logits_many_positions(kernels, cuda_backend, cpu_backend):
    step = _step(8, 64, 32000, seed=11, temperature=[1.0], count=[4], threshold=[0.2])
    step = DiffusionStep(**{**step.__dict__, "logits": logits("flat", 8 * 64, 32000, seed=12).view(8, 64, 32000)})
    got = diffusion_step_cuda(step, kernels, cuda_backend)
    _assert_step_agrees(got, diffusion_step(step, cpu_backend), step.mask)


def _draw_stress_rows(rows: int, vocab: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """Rows aimed at the row pass's Gumbel screen and its gap test (csrc/workloads.cuh), by r % 6."""
    x = torch.randn(rows, vocab, device=dev, generator=gen)
    for r in range(rows):
        kind = r % 6
        if kind == 0:  # spiky: the screen rules out nearly every group
            x[r, torch.randint(0, vocab, (50,), device=dev, generator=gen)] = 10 + 20 * torch.rand(50, device=dev,
                                                                                                   generator=gen)
        elif kind == 2:  # a few finite tokens: most groups are all -inf
            keep = torch.rand(vocab, device=dev, generator=gen) < 0.003
            x[r] = torch.where(keep, x[r], torch.full_like(x[r], float("-inf")))
        elif kind == 3:  # large magnitudes: wide margins
            x[r] += 1.0e4
        elif kind == 4:  # one far winner in the last, partial chunk; NaN and +inf elsewhere
            x[r, -2] = 30.0
            x[r, 7] = float("nan")
            x[r, 11] = float("inf")
        elif kind == 5:  # a plateau of equal logits: the noise decides, close calls for the gap test
            x[r, torch.randperm(vocab, device=dev, generator=gen)[:4000]] = 9.5
        # kind 1: flat, every group needs its noise
    return x


@pytest.mark.parametrize("vocab", [V_QWEN, 300001])
@pytest.mark.parametrize("temperature", [1.0, 0.25, 8.0])
def test_diffusion_draw_is_exact(kernels, cuda_backend, vocab, temperature):
    """Every position's token is the argmax of the exact z + g, bit for bit: the row pass's screen (a
    pilot per block, or the bound the row's earlier blocks posted) may only skip tokens that cannot win,
    and close calls go to the exact re-score. 300001: rows not aligned to a group, a partial last chunk."""
    _assert_diffusion_draw_is_exact(kernels, cuda_backend, vocab, temperature, b=2, length=6)


@pytest.mark.parametrize("temperature", [1.0, 0.25])
def test_diffusion_draw_is_exact_when_blocks_screen_by_the_posted_bound(kernels, cuda_backend, temperature):
    """512 positions: more blocks than the GPU holds at once, so a row's later blocks start after its
    earlier ones posted their best proxy and screen by it alone (no pilot: gumbel_screened_by_bound)."""
    _assert_diffusion_draw_is_exact(kernels, cuda_backend, V_QWEN, temperature, b=64, length=8)


def _assert_diffusion_draw_is_exact(kernels, cuda_backend, vocab: int, temperature: float, b: int, length: int):
    sampling_kernels = cuda_backend._kernels
    dev = sampling_kernels.device
    gen = case_generator(dev, vocab, temperature, scale=100)
    x = _draw_stress_rows(b * length, vocab, gen, dev)
    seeds = [4242 + 55 * i for i in range(b)]
    step = DiffusionStep(
        logits=x.view(b, length, vocab), mask=torch.ones(b, length, dtype=torch.bool),
        temperature=torch.full((b,), temperature), top_k=torch.zeros(b, dtype=torch.int32), top_p=torch.ones(b),
        min_p=torch.zeros(b), seed=torch.tensor(seeds), iteration=torch.full((b,), 3, dtype=torch.int64),
        threshold=torch.full((b,), float("nan")), count=torch.zeros(b, dtype=torch.int64))
    tokens = kernels.diffusion(step)[0].flatten().cpu()
    row_seeds = [seeds[r // length] for r in range(b * length)]
    want = exact_gumbel_argmax(sampling_kernels, x, temperature, row_seeds, [r % length for r in range(b * length)], 0)
    assert torch.equal(tokens, want), f"rows {(tokens != want).nonzero().flatten().tolist()} differ"


def test_diffusion_screen_bound_does_not_leak_into_the_next_call(kernels, cuda_backend, cpu_backend):
    # The row pass shares each row's best Gumbel bound through the workspace. A bound left behind by a
    # call on logits 1000 higher would screen out every token of the next call's rows: the gap test
    # would still catch it (exact re-scores, same tokens), so the re-score count is what tells.
    step = _step(4, 16, V_QWEN, seed=21, temperature=[1.0, 0.6])
    high = DiffusionStep(**{**step.__dict__, "logits": step.logits + 1000.0})
    diffusion_step_cuda(high, kernels, cuda_backend)
    before = int(kernels.fallback_count.item())
    got = diffusion_step_cuda(step, kernels, cuda_backend)
    rescored = int(kernels.fallback_count.item()) - before
    _assert_step_agrees(got, diffusion_step(step, cpu_backend), step.mask)
    fresh_kernels = WorkloadKernels(0)
    fresh = diffusion_step_cuda(step, fresh_kernels, cuda_backend)
    assert all(torch.equal(a, b) for a, b in zip(got, fresh, strict=True))
    assert rescored == int(fresh_kernels.fallback_count.item()) < step.mask.sum().item() // 10


def test_diffusion_steps_of_changing_shapes_share_the_mailbox(cuda_backend, monkeypatch):
    """A row's blocks pass partials and bounds through the mailbox, each word tagged with its step. Steps
    of other shapes (rows and chunks land on other words), the two-launch commit (above 1024 positions)
    and the mailbox zeroed between steps must each give what a fresh mailbox gives; the epoch advances
    once a step, in either commit path."""
    import tokensampler_server.workloads.cuda as cuda_workloads

    monkeypatch.setattr(cuda_workloads, "_MAILBOX_STEPS_BEFORE_ZEROING", 4)
    shared = WorkloadKernels(0)
    # the largest mailbox first: a mailbox that grows is a new, zeroed one
    steps = [_step(3, 1025, 1000, seed=33, temperature=[1.0, 0.0, 0.5], count=[40, 3, 0]),
             _step(4, 16, V_QWEN, seed=31, temperature=[1.0, 0.6]), _step(2, 8, 50000, seed=32, temperature=[0.8]),
             _step(4, 16, V_QWEN, seed=34, temperature=[1.0, 0.6]), _step(5, 12, 70001, seed=35, temperature=[1.2]),
             _step(4, 16, V_QWEN, seed=36, temperature=[0.0, 1.0])]
    for i, step in enumerate(steps):
        got = shared.diffusion(step)
        fresh = WorkloadKernels(0).diffusion(step)
        assert all(torch.equal(a, b) for a, b in zip(got, fresh, strict=True)), f"step {i}"
        # zeroed before the fifth step: epochs 1, 2, 3, 4, then 1, 2
        assert int(shared._mailbox[0].item()) & 0xFFFFFFFF == i % 4 + 1, f"step {i}"


def test_diffusion_positions_without_a_finite_logit(kernels, cuda_backend, cpu_backend):
    step = _step(2, 16, 500, seed=4, temperature=[1.0, 0.0])
    step.logits[0, 3] = float("-inf")
    step.logits[1, 5] = float("nan")
    step.mask[:, :] = True
    got = diffusion_step_cuda(step, kernels, cuda_backend)
    assert got[0][0, 3].item() == -1 and got[1][0, 3].item() == 0.0 and bool(got[2][0, 3])
    _assert_step_agrees(got, diffusion_step(step, cpu_backend), step.mask)


def test_diffusion_with_filters_samples_on_the_backend(kernels, cuda_backend, cpu_backend):
    step = _step(3, 24, 4000, seed=8, temperature=[1.0], top_k=20)
    got = workloads_of(cuda_backend).diffusion_step(step)
    _assert_step_agrees(got, diffusion_step(step, cpu_backend), step.mask)


# -- speculative verification -------------------------------------------------------------------------
def _verification(num_requests: int, n: int, vocab: int, *, seed: int, temperature: list[float],
                  dtype=torch.float32, top_k: int = 0) -> DraftVerification:
    g = torch.Generator().manual_seed(seed)
    target = logits("flat", num_requests * (n + 1), vocab, seed=seed).view(num_requests, n + 1, vocab) * 2.5
    # A draft close to the target: some tokens accepted, some rejected.
    draft_logits = target[:, :n] + torch.randn(num_requests, n, vocab, generator=g) * 1.5
    draft_probs = torch.softmax(draft_logits, dim=-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=g).view(num_requests, n)
    b = num_requests
    return DraftVerification(
        draft_ids=draft_ids, draft_probs=draft_probs * 3.0,  # unnormalised: renormalised by both
        target_logits=target.to(dtype), temperature=_per_row(temperature, b, torch.float32),
        top_k=torch.full((b,), top_k, dtype=torch.int32), top_p=torch.ones(b), min_p=torch.zeros(b),
        seed=torch.arange(b, dtype=torch.int64) * 7919 + seed,
        position=_per_row([0, 17, 2**32 - 2], b, torch.int64), iteration=torch.full((b,), 2, dtype=torch.int64),
    )


def _assert_verdicts_agree(got, ref) -> None:
    accepted, tokens = (t.cpu() for t in got)
    ref_accepted, ref_tokens = ref
    rows = accepted.numel()
    same = (accepted == ref_accepted) & (tokens == ref_tokens).all(dim=1)
    assert same.sum().item() >= 0.999 * rows, f"{same.sum().item()} of {rows} rows agree"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 32000])
def test_verify_matches_the_reference(kernels, dtype, vocab, recomputed):
    v = _verification(96, 4, vocab, seed=vocab % 101, temperature=[1.0, 0.7, 0.0, 1.2], dtype=dtype)
    got = verify_draft_cuda(v, kernels)
    assert recomputed == [], "unfiltered targets went to the reference"
    ref = verify_draft(v)
    _assert_verdicts_agree(got, ref)
    accepted = ref[0]
    assert 0 < accepted.float().mean().item() < 4, "the case should mix acceptances and rejections"


def test_verify_large_vocabulary_and_invalid_rows(kernels):
    v = _verification(8, 3, V_QWEN, seed=5, temperature=[1.0])
    v.target_logits[2, 1] = float("-inf")  # no finite target logit at one position: the row is invalid
    v.target_logits[3, 0, :50] = float("nan")
    got = verify_draft_cuda(v, kernels)
    assert got[0][2].item() == 0 and bool((got[1][2] == -1).all())
    _assert_verdicts_agree(got, verify_draft(v))


@pytest.mark.parametrize("scale", [0.3, 8.0])
def test_verify_residual_at_extreme_temperatures(kernels, scale):
    # Large and tiny |z| (logits scaled, T from 0.05 to 3): the residual's screen stays exact.
    v = _verification(48, 2, V_QWEN, seed=13, temperature=[0.05, 0.4, 1.0, 3.0])
    v = DraftVerification(**{**v.__dict__, "target_logits": v.target_logits * scale})
    ref = verify_draft(v)
    _assert_verdicts_agree(verify_draft_cuda(v, kernels), ref)
    assert (ref[0] < 2).sum().item() >= 12, "the case should draw many corrections"


def test_verify_draft_equal_to_target_accepts_everything(kernels):
    v = _verification(16, 4, 2000, seed=6, temperature=[1.0])
    same = DraftVerification(**{**v.__dict__, "draft_probs": torch.softmax(v.target_logits[:, :4].float(), dim=-1)})
    accepted, tokens = (t.cpu() for t in verify_draft_cuda(same, kernels))
    # p = q: u·p(d) < q(d) for every u < 1, so each of the 4 draft tokens is accepted and emitted as drafted.
    assert accepted.tolist() == [4] * 16
    assert torch.equal(tokens[:, :4], same.draft_ids)
    _assert_verdicts_agree((accepted, tokens), verify_draft(same))


@pytest.mark.parametrize("filters", [{"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.02}])
def test_verify_filtered_target_stays_on_the_gpu(kernels, filters, monkeypatch):
    """A filtered target goes through the torch reference on the GPU (no row to the CPU) and agrees with the CPU's."""
    import tokensampler_server.workloads.cuda as cuda_workloads

    v = _verification(64, 3, 32000, seed=8, temperature=[1.0, 0.6, 0.0])
    v = DraftVerification(**{**v.__dict__, **{name: torch.full((64,), value, dtype=getattr(v, name).dtype)
                                               for name, value in filters.items()}})
    devices = []

    def spy(verification):
        devices.append(verification.target_logits.device.type)
        return verify_draft(verification)

    monkeypatch.setattr(cuda_workloads, "verify_draft", spy)
    got = verify_draft_cuda(v, kernels)
    assert devices == ["cuda"] and got[0].is_cuda
    _assert_verdicts_agree(got, verify_draft(v))


def test_dispatch_uses_the_kernels_on_a_cuda_backend(cuda_backend):
    v = _verification(8, 2, 3000, seed=2, temperature=[1.0, 0.0])
    _assert_verdicts_agree(workloads_of(cuda_backend).verify_draft(v), verify_draft(v))
    filtered = DraftVerification(**{**v.__dict__, "top_k": torch.full((8,), 5, dtype=torch.int32)})
    _assert_verdicts_agree(workloads_of(cuda_backend).verify_draft(filtered), verify_draft(filtered))
    x = logits("spiky", 6, 3000, seed=1)
    t = torch.ones(6)
    probs, ids = workloads_of(cuda_backend).topk_probs(x, t, 7)
    ref_probs, ref_ids = topk_probs(x, t, 7)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-9)
