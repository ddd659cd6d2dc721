"""The scoring kernel (csrc/score.cuh through workloads/score_cuda.py) against the torch reference of
workloads/score.py on the same GPU (docs/semantics.md, choice 18).

From logits both rank the same x and take z = (x - max) / T, so the top ids are identical (ties go to the lower id
in both) and log-probs, entropies and top values agree to 1e-4 (relative, and absolute near 0). From hidden states the kernel's
logits come from other matmul shapes than the reference's, so a listed id may differ where the reference's
log-probs of the two tokens agree to 1e-4. The extra memory from hidden states stays O(N).
"""

from __future__ import annotations

import pytest
import torch
from tokensampler_server.backends.cuda_build import load_kernels
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight
from tokensampler_server.workloads.cuda import workloads_of
from tokensampler_server.workloads.score import LogitSource, Scores, TokenScoring, score_tokens
from tokensampler_server.workloads.score_cuda import ScoreKernels, score_tokens_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

V_QWEN = 151936
TOLERANCE = dict(rtol=1e-4, atol=1e-4, equal_nan=True)
TEMPERATURES = [0.0, 0.5, 1.0, 1.7, 0.05]  # 0: a greedy row, scored at T = 1 (choice 6)


@pytest.fixture(scope="module")
def scorer() -> ScoreKernels:
    return ScoreKernels(torch.device("cuda", 0), load_kernels(0))


@pytest.fixture(scope="module")
def slice_scorer() -> ScoreKernels:
    """A scorer whose matmul blocks hold one 8192-token chunk of one row: rows of hidden states in several slices."""
    return ScoreKernels(torch.device("cuda", 0), load_kernels(0), chunk_bytes=4 * 8192)


def _logits(num_rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """randn · 2 with spikes in U(10, 30), every 13th logit -inf and every 17th NaN; from 7 rows on, rows of every
    kind: 1 no finite logit, 2 a single one, 3 all equal (ties), 4 every other logit +inf (read as -inf)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_rows, vocab, device="cuda", generator=g) * 2
    spikes = min(50, vocab)
    x.scatter_(1, torch.randint(0, vocab, (num_rows, spikes), device="cuda", generator=g),
               torch.rand(num_rows, spikes, device="cuda", generator=g) * 20 + 10)
    if vocab > 1:
        x[:, ::13] = float("-inf")
        x[:, 5::17] = float("nan")
    if num_rows >= 7:
        x[1] = float("-inf")
        x[2] = float("-inf")
        x[2, vocab // 2] = 1.0
        x[3] = 4.0
        x[4, ::2] = float("inf")
    return x.to(dtype)


def _scoring(num_rows: int, vocab: int, mode: str, top_n: int, seed: int) -> TokenScoring:
    """raw; temperature (PROCESSED, every row without filters); mixed (PROCESSED, every third row with top-k or top-p,
    which the reference scores: the kernel takes the others as a subset of the rows)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    tokens[0] = 0  # a token at -inf where the row has any (every 13th logit)
    temperature = torch.tensor([TEMPERATURES[i % len(TEMPERATURES)] for i in range(num_rows)], dtype=torch.float32)
    top_k = torch.zeros(num_rows, dtype=torch.int32)
    top_p = torch.ones(num_rows)
    if mode == "mixed":
        top_k[2::3] = 5
        top_p[1::6] = 0.9
    return TokenScoring(token_ids=tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=torch.zeros(num_rows), processed=mode != "raw", top_logprobs=top_n, entropy=True)


def _assert_scores_close(got: Scores, want: Scores) -> None:
    torch.testing.assert_close(got.logprobs, want.logprobs, **TOLERANCE)
    torch.testing.assert_close(got.entropy, want.entropy, **TOLERANCE)
    if want.top_values is not None:
        torch.testing.assert_close(got.top_values, want.top_values, **TOLERANCE)


# -- from logits --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raw", "temperature", "mixed"])
@pytest.mark.parametrize("num_rows", [1, 7, 300])
@pytest.mark.parametrize("vocab", [1, 111, 32000, V_QWEN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_logits_match_the_reference(scorer, dtype, vocab, num_rows, mode):
    seed = vocab + num_rows
    source = LogitSource(logits=_logits(num_rows, vocab, dtype, seed))
    scoring = _scoring(num_rows, vocab, mode, min(vocab, 20), seed)
    got = score_tokens_cuda(source, scoring, scorer)
    want = score_tokens(source, scoring, torch.device("cuda"))
    _assert_scores_close(got, want)
    assert torch.equal(got.top_ids, want.top_ids)
    if num_rows >= 7:  # the rows of no finite logit read as choice 8 says
        assert got.logprobs[1].isnan() and got.entropy[1].isnan() and got.top_ids[1].eq(-1).all()


@pytest.mark.parametrize("top_n", [1, 64])
def test_top_logprobs_up_to_the_limit(scorer, top_n):
    source = LogitSource(logits=_logits(64, V_QWEN, torch.float32, seed=top_n))
    scoring = _scoring(64, V_QWEN, "temperature", top_n, seed=top_n)
    got = score_tokens_cuda(source, scoring, scorer)
    want = score_tokens(source, scoring, torch.device("cuda"))
    _assert_scores_close(got, want)
    assert torch.equal(got.top_ids, want.top_ids)


@pytest.mark.parametrize("mode", ["raw", "temperature"])
def test_rows_of_many_candidates(scorer, mode):
    """Even rows: half their logits exactly 5.0, the rest just below (the top 64 are ties, listed by id). Odd rows: the
    largest logits, 10 + (id mod 1024) / 1000, in the first 256 tokens of every 1024, which 64 threads of each block
    hold: ~2000 candidates reach a block's threshold and ~1000 the merge's, ranked by sorting."""
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(300, V_QWEN, device="cuda", generator=g)
    x[0::2] = torch.clamp(5.0 + 1e-3 * x[0::2], max=5.0)
    within = torch.arange(V_QWEN, device="cuda") % 1024
    x[1::2] = torch.where(within < 256, 10.0 + within * 1e-3, x[1::2])
    source = LogitSource(logits=x)
    scoring = _scoring(300, V_QWEN, mode, 64, seed=9)
    got = score_tokens_cuda(source, scoring, scorer)
    want = score_tokens(source, scoring, torch.device("cuda"))
    _assert_scores_close(got, want)
    assert torch.equal(got.top_ids, want.top_ids)


def test_the_cuda_workloads_score_through_the_kernel(cuda_backend, monkeypatch):
    """The service's workloads of a CUDA backend take the kernel up to its top-N limit, the reference above it; the
    results come back on the CPU, equal to the kernel's."""
    calls: list[int] = []
    original = ScoreKernels.streamed
    monkeypatch.setattr(ScoreKernels, "streamed",
                        lambda self, source, scoring, rows, *rest: calls.append(rows.numel()) or original(
                            self, source, scoring, rows, *rest))
    workloads = workloads_of(cuda_backend)
    x = _logits(7, 32000, torch.float32, seed=5)
    source = LogitSource(logits=x.cpu())
    scoring = _scoring(7, 32000, "mixed", 20, seed=5)
    scores = workloads.score_tokens(source, scoring)
    assert calls == [4]  # rows 2, 5 (top-k) and 1 (top-p) take the reference
    assert scores.logprobs.device.type == "cpu"
    want = score_tokens(LogitSource(logits=x), scoring, torch.device("cuda")).cpu()
    _assert_scores_close(scores, want)
    assert torch.equal(scores.top_ids, want.top_ids)
    beyond = _scoring(7, 32000, "raw", workloads.scorer.module.score_max_top + 1, seed=5)
    workloads.score_tokens(source, beyond)
    assert len(calls) == 1


@pytest.mark.parametrize("source_kind", ["logits", "hidden states, a slice a chunk"])
@pytest.mark.parametrize("scale,temperature,max_last", [
    (1e8, None, False),  # max(z) + log 2 rounds to max(z) in float32
    (3e4, None, False),
    (3.0, 1e-10, False),
    (3.0, 1e-45, False),  # x / T overflows; (x - max) / T does not
    (1e8, 1e-3, True),  # the tied maximum in the last chunk: the earlier chunks' sums rescale to nothing
], ids=["raw 1e8", "raw 3e4", "T 1e-10", "T 1e-45", "T 1e-3 max last"])
def test_two_tied_maxima_score_log_one_half_at_any_scale(scorer, slice_scorer, source_kind, scale, temperature,
                                                        max_last):
    """The kernel's sums are kept about the largest x, as the reference's: two tied maxima among logits of -5 score
    exactly log 1/2 and list both, and the entropy is log 2, however large |x / T| (rows of four 8192-token chunks,
    merged across blocks; from hidden states across slices too)."""
    vocab = 3 * 8192 + 5
    tied = [vocab - 3, vocab - 1] if max_last else [100, vocab - 1]
    x = torch.full((1, vocab), -5.0, device="cuda")
    x[0, tied] = scale
    if source_kind == "logits":
        source = LogitSource(logits=x)
    else:  # h = e_0 picks column 0 of the head: its logits are x exactly
        weight = torch.zeros(vocab, 8, device="cuda")
        weight[:, 0] = x[0]
        head = RegisteredWeight("head", weight, LogitsFinish(vocab_size=vocab), "")
        hidden = torch.zeros(1, 8, device="cuda")
        hidden[0, 0] = 1.0
        source = LogitSource(hidden=hidden, lm_head=head)
        scorer = slice_scorer
    scoring = TokenScoring(token_ids=torch.tensor([tied[0]]), temperature=torch.tensor([temperature or 1.0]),
                           top_k=torch.zeros(1, dtype=torch.int32), top_p=torch.ones(1), min_p=torch.zeros(1),
                           processed=temperature is not None, top_logprobs=2, entropy=True)
    got = score_tokens_cuda(source, scoring, scorer)
    half = torch.tensor([float(torch.tensor(0.5).log())])
    torch.testing.assert_close(got.logprobs.cpu(), half, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.top_values.cpu(), half.expand(1, 2), rtol=0, atol=1e-6)
    assert got.top_ids.cpu().tolist() == [tied]
    torch.testing.assert_close(got.entropy.cpu(), -half, rtol=0, atol=1e-6)


# -- from hidden states -------------------------------------------------------------------------------
def _head(vocab: int, hidden: int, dtype: torch.dtype, finish: bool, seed: int) -> RegisteredWeight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    padded = vocab + 16
    weight = (torch.randn(padded, hidden, device="cuda", generator=g) / hidden ** 0.5 * 4).to(dtype)
    bias = torch.randn(padded, device="cuda", generator=g) if finish else None
    rule = LogitsFinish(vocab_size=vocab, bias=bias, soft_cap=15.0 if finish else None, logit_scale=0.8 if finish else 1.0)
    return RegisteredWeight("head", weight, rule, "")


def _assert_top_agree(got: Scores, want: Scores, table: torch.Tensor, filtered: torch.Tensor) -> None:
    """Identical lists on filtered rows (the reference scores them in both); elsewhere each listed token's reference
    log-prob is the reference's value at that rank (two tokens may swap only where their log-probs agree)."""
    assert torch.equal(got.top_ids[filtered], want.top_ids[filtered])
    free = ~filtered
    listed = table[free].gather(1, got.top_ids[free])
    torch.testing.assert_close(listed, want.top_values[free], **TOLERANCE)
    ids = got.top_ids[free].sort(dim=1).values
    assert bool((ids[:, 1:] != ids[:, :-1]).all()), "a token listed twice"


@pytest.mark.parametrize("chunk_bytes", [4 * 8192 * 64, None], ids=["row blocks and chunks", "default chunks"])
@pytest.mark.parametrize("mode", ["raw", "temperature", "mixed"])
@pytest.mark.parametrize("num_rows", [1, 7, 300])
@pytest.mark.parametrize("head", ["bf16", "fp32 with bias, scale and soft cap"])
def test_hidden_states_match_their_logits(head, num_rows, mode, chunk_bytes):
    vocab, hidden = 32000, 256
    dtype = torch.bfloat16 if head == "bf16" else torch.float32
    lm_head = _head(vocab, hidden, dtype, head != "bf16", seed=num_rows)
    states = torch.randn(num_rows, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    states = states.to(dtype)
    scorer = ScoreKernels(torch.device("cuda", 0), load_kernels(0), **({"chunk_bytes": chunk_bytes} if chunk_bytes else {}))
    scoring = _scoring(num_rows, vocab, mode, 20, seed=num_rows)
    source = LogitSource(hidden=states, lm_head=lm_head)
    got = score_tokens_cuda(source, scoring, scorer)
    want = score_tokens(source, scoring, torch.device("cuda"))
    _assert_scores_close(got, want)
    t = torch.tensor([TEMPERATURES[i % len(TEMPERATURES)] or 1.0 for i in range(num_rows)], device="cuda")
    z = lm_head.logits(states) / (t.unsqueeze(1) if scoring.processed else 1.0)
    filtered = ((scoring.top_k > 0) | (scoring.top_p < 1)).cuda() & scoring.processed
    _assert_top_agree(got, want, torch.log_softmax(z, dim=1), filtered)


def test_hidden_states_extra_memory_is_bounded():
    """N = 4096 positions of a Qwen-sized bf16 head (V = 151936, D = 4096): the [N, V] fp32 logits would take
    2.3 GiB; the scorer takes its two chunk buffers (2 x 16 MiB) and O(N) beside the inputs."""
    vocab, hidden, num_rows = V_QWEN, 4096, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
    states = torch.randn(num_rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    source = LogitSource(hidden=states, lm_head=RegisteredWeight("head", weight, LogitsFinish(vocab_size=vocab), ""))
    scoring = _scoring(num_rows, vocab, "raw", 0, seed=0)
    scorer = ScoreKernels(torch.device("cuda", 0), load_kernels(0))
    torch.mm(states[:8], weight[:8].T, out_dtype=torch.float32)  # cuBLAS's workspace of this stream: not the scorer's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    scores = score_tokens_cuda(source, scoring, scorer)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 64 << 20, f"{extra / 2**20:.1f} MiB beyond the inputs"
    # and the scores are those of the logits, here 64 rows of them
    rows = slice(0, 64)
    logits = torch.mm(states[rows], weight.T, out_dtype=torch.float32)
    expected = torch.log_softmax(logits, dim=1).gather(1, scoring.token_ids[rows].cuda().unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(scores.logprobs[rows], expected, **TOLERANCE)
