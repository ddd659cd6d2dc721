"""token_bitmask on the CUDA backend (docs/semantics.md, step 2 and choice 17).

The kernels read the mask as they load the logits, a disallowed token read as -inf. So every kernel family must
sample, bit for bit, what it samples from logits masked beforehand (the same kernels, the same values), and agree
with the CPU reference as the unmasked routes do (greedy exactly; sampled tokens up to a rare fp32 flip, at most one
a case). Covered: greedy, Gumbel, top-k of every bucket and above (the exact filter), a k per row, top-p on the
filter (< 32 rows) and the frontier (>= 32 rows), min-p, combinations, several samples, fp32 / bf16 / fp16 logits,
hidden states through the fused kernels (ring and streaming, with and without candidates), raw and processed
log-probs; masks allowing half the vocabulary, 100 tokens, a contiguous half, one token and none; rows with and
without a mask in one batch (all-ones rows, and rows a merged batch marks unmasked); a vocabulary not a multiple of
32 with garbage bits past it; a mask beside other processing (the in-place kernel); a mask already on the GPU. The
chi-square test (significance ALPHA, fixed seeds: a deterministic outcome) checks the distribution at a small
vocabulary after asserting that no draw falls outside the mask. The autouse fixture of conftest.py asserts that no
row went to the exact filter.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tokensampler_server.backends.processing import apply_processing
from tokensampler_server.batching.batch_merge import merge_batches
from tokensampler_server.model.sampling import HiddenInput, LogitProcessing, LogprobsMode, SamplingBatch, TokenEntries
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from ..test_cpu_semantics import LOGITS, assert_fits, exact_distribution
from ..test_token_bitmask import pack
from .agreement import assert_tokens_agree
from .conftest import MODES, logits, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ALPHA = 0.001  # the chi-square tests' significance (test_cpu_semantics.assert_fits)
VOCAB = 128256  # the benchmark's
ODD_VOCAB = 50001  # 50001 % 32 = 17: the last word holds 15 bits past the vocabulary
KINDS = ("half", "hundred", "contiguous", "one", "none", "all")
MASKED_MODES = {
    **MODES,
    "top_k_16": {"temperature": 1.0, "top_k": 15},
    "top_k_256": {"temperature": 0.9, "top_k": 200, "top_p": 0.95},
    "top_k_top_p_min_p": {"temperature": 0.7, "top_k": 40, "top_p": 0.8, "min_p": 0.01},
}


def allowed_tokens(kinds: list[str], vocab: int, seed: int) -> torch.Tensor:
    """bool [len(kinds), vocab]: each row's allowed tokens, by kind: half of them at random, 100 at random, a
    contiguous half (a range, as a grammar's token class can be), one, none, or all (a row without a grammar)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for kind in kinds:
        row = torch.zeros(vocab, dtype=torch.bool)
        if kind == "half":
            row = torch.rand(vocab, generator=gen) < 0.5
        elif kind == "hundred":
            row[torch.randperm(vocab, generator=gen)[:100]] = True
        elif kind == "contiguous":
            start = int(torch.randint(0, vocab // 2, (1,), generator=gen))
            row[start: start + vocab // 2] = True
        elif kind == "one":
            row[int(torch.randint(0, vocab, (1,), generator=gen))] = True
        elif kind == "all":
            row[:] = True
        rows.append(row)
    return torch.stack(rows)


def bitmask(allowed: torch.Tensor, garbage: bool = False) -> torch.Tensor:
    """int32 [B, W] words of `allowed`. garbage: every bit past the vocabulary set, and two more words of ones."""
    vocab = allowed.shape[1]
    words = -(-vocab // 32) + (2 if garbage else 0)
    mask = pack(allowed.numpy(), words=words)
    if garbage:
        tail = vocab % 32
        if tail:
            mask[:, vocab // 32] |= np.array(0xFFFFFFFF << tail & 0xFFFFFFFF, dtype=np.uint32).view(np.int32)
        mask[:, -(-vocab // 32):] = -1
    return torch.from_numpy(mask)


def masked_batch(x: torch.Tensor, allowed: torch.Tensor, *, garbage: bool = False, **params) -> SamplingBatch:
    return make_batch(x, processing=LogitProcessing(token_bitmask=bitmask(allowed, garbage)), **params)


def premasked_batch(x: torch.Tensor, allowed: torch.Tensor, **params) -> SamplingBatch:
    """The same rows with the disallowed logits at -inf and no processing: what the kernels must read."""
    return make_batch(x.masked_fill(~allowed.to(x.device), float("-inf")), **params)


def assert_same_result(got, want) -> None:
    assert torch.equal(got.valid, want.valid)
    assert torch.equal(got.nan_detected, want.nan_detected)
    assert torch.equal(got.tokens, want.tokens)
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), name


def assert_allowed(result, allowed: torch.Tensor) -> None:
    """Every sampled token is allowed; rows that allow nothing are not valid and sample -1."""
    empty = ~allowed.any(dim=1)
    assert torch.equal(result.valid, ~empty)
    assert bool((result.tokens[empty] == -1).all())
    rows = (~empty).nonzero().squeeze(1)
    assert bool(allowed[rows].gather(1, result.tokens[rows]).all()), "a token the mask disallows was drawn"


def assert_agrees(got, reference: SamplingBatch, cpu_backend, x: torch.Tensor, allowed: torch.Tensor):
    """The GPU's result against the reference's for `reference` (the masked batch on the CPU): the same flags, and
    a token that differs only on a rounding edge of the masked logits (agreement.py). Returns the reference's."""
    want = cpu_backend.sample(reference)
    assert torch.equal(got.valid, want.valid)
    assert torch.equal(got.nan_detected, want.nan_detected)
    masked = x.float().cpu().masked_fill(~allowed.cpu(), float("-inf"))
    assert_tokens_agree(masked, reference, got, want)
    return want


def _kinds(num_rows: int, offset: int = 0) -> list[str]:
    return [KINDS[(i + offset) % len(KINDS)] for i in range(num_rows)]


@pytest.mark.parametrize("mode", list(MASKED_MODES))
@pytest.mark.parametrize("num_rows", [3, 40])
def test_every_kernel_samples_the_masked_row(cuda_backend, cpu_backend, mode: str, num_rows: int) -> None:
    """Every mode, at a batch below and one above the frontier's 32 rows, each row of another kind of mask: the same
    tokens as the pre-masked logits (exactly) and as the reference."""
    x = logits("spiky", num_rows, VOCAB, seed=num_rows).cuda()
    allowed = allowed_tokens(_kinds(num_rows, offset=len(mode)), VOCAB, seed=num_rows)
    params = dict(MASKED_MODES[mode], num_samples=3)
    got = cuda_backend.sample(masked_batch(x, allowed, **params))
    assert_same_result(got, cuda_backend.sample(premasked_batch(x, allowed, **params)))
    assert_allowed(got, allowed)
    assert_agrees(got, masked_batch(x.cpu(), allowed, **params), cpu_backend, x, allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_p", "min_p", "large_k"])
def test_logits_of_every_dtype(cuda_backend, cpu_backend, dtype: torch.dtype, mode: str) -> None:
    x = logits("flat", 8, ODD_VOCAB, seed=11, dtype=dtype).cuda()
    allowed = allowed_tokens(_kinds(8), ODD_VOCAB, seed=12)
    got = cuda_backend.sample(masked_batch(x, allowed, **MODES[mode]))
    assert_same_result(got, cuda_backend.sample(premasked_batch(x, allowed, **MODES[mode])))
    assert_allowed(got, allowed)
    assert_agrees(got, masked_batch(x.cpu(), allowed, **MODES[mode]), cpu_backend, x, allowed)


def test_a_k_per_row_across_the_buckets_and_the_filter(cuda_backend, cpu_backend) -> None:
    num_rows = 12
    x = logits("spiky", num_rows, VOCAB, seed=5).cuda()
    allowed = allowed_tokens(_kinds(num_rows), VOCAB, seed=6)
    k = [1, 5, 15, 31, 50, 100, 200, 255, 256, 1000, 0, 40000]
    batch = masked_batch(x, allowed, top_k=0, top_p=0.9, num_samples=2)
    batch = dataclasses.replace(batch, top_k=torch.tensor(k, dtype=torch.int32))
    pre = dataclasses.replace(premasked_batch(x, allowed, top_p=0.9, num_samples=2), top_k=batch.top_k)
    got = cuda_backend.sample(batch)
    assert_same_result(got, cuda_backend.sample(pre))
    assert_allowed(got, allowed)
    assert_agrees(got, dataclasses.replace(batch, logits=x.cpu()), cpu_backend, x, allowed)


@pytest.mark.parametrize("logprobs_mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
@pytest.mark.parametrize("mode", ["greedy", "top_k_top_p", "top_p", "min_p", "large_k"])
def test_logprobs(cuda_backend, cpu_backend, logprobs_mode: LogprobsMode, mode: str) -> None:
    """Raw log-probs are of the input logits (step 1, before the mask); processed ones of the masked logits."""
    x = logits("spiky", 6, VOCAB, seed=21).cuda()
    allowed = allowed_tokens(_kinds(6), VOCAB, seed=22)
    params = dict(MODES[mode], num_samples=2, return_logprobs=True, logprobs_mode=logprobs_mode, top_logprobs=5)
    got = cuda_backend.sample(masked_batch(x, allowed, **params))
    assert_allowed(got, allowed)
    want = assert_agrees(got, masked_batch(x.cpu(), allowed, **params), cpu_backend, x, allowed)
    same = got.tokens == want.tokens
    torch.testing.assert_close(got.logprobs[same], want.logprobs[same], rtol=1e-4, atol=1e-4, equal_nan=True)
    assert torch.equal(got.top_logprob_ids, want.top_logprob_ids)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)
    if logprobs_mode is LogprobsMode.PROCESSED:  # the masked table is the pre-masked logits' table, bit for bit
        assert_same_result(got, cuda_backend.sample(premasked_batch(x, allowed, **params)))
    else:
        valid = got.valid
        raw = torch.log_softmax(x.float(), dim=1).cpu()
        torch.testing.assert_close(got.logprobs[valid], raw[valid].gather(1, got.tokens[valid]), rtol=1e-5, atol=1e-5)


def test_garbage_past_the_vocabulary_and_wider_rows_change_nothing(cuda_backend) -> None:
    x = logits("flat", 6, ODD_VOCAB, seed=31).cuda()
    allowed = allowed_tokens(_kinds(6), ODD_VOCAB, seed=32)
    for mode in ("greedy", "gumbel", "top_k_top_p", "top_p", "min_p", "large_k"):
        clean = cuda_backend.sample(masked_batch(x, allowed, **MODES[mode]))
        noisy = cuda_backend.sample(masked_batch(x, allowed, garbage=True, **MODES[mode]))
        assert_same_result(noisy, clean)
        assert_allowed(noisy, allowed)


def test_nan_where_the_mask_disallows_is_no_nan(cuda_backend, cpu_backend) -> None:
    """A masked token is -inf before step 5 looks for NaN (choice 1): its NaN neither flags the row nor counts."""
    x = logits("spiky", 4, ODD_VOCAB, seed=41).cuda()
    allowed = allowed_tokens(["half", "half", "hundred", "one"], ODD_VOCAB, seed=42)
    x[:3][~allowed[:3].cuda()] = float("nan")
    x[3, 7] = float("nan")
    allowed[3, 7] = True  # an allowed NaN does flag its row
    for mode in ("greedy", "gumbel", "top_k_top_p", "top_p"):
        got = cuda_backend.sample(masked_batch(x, allowed, **MODES[mode]))
        assert got.nan_detected.tolist() == [False, False, False, True]
        assert_agrees(got, masked_batch(x.cpu(), allowed, **MODES[mode]), cpu_backend, x, allowed)


def test_rows_without_a_mask_in_a_merged_batch(cuda_backend, cpu_backend) -> None:
    """Requests with and without a mask merged: the rows of the second are all ones and marked unmasked
    (token_bitmask_rows), so the kernels read no word for them; every row samples as it would alone."""
    x = logits("spiky", 7, VOCAB, seed=51).cuda()
    allowed = allowed_tokens(["half", "hundred", "one", "none"], VOCAB, seed=52)
    params = dict(MODES["top_k_top_p"], num_samples=2)
    parts = [masked_batch(x[:4], allowed, **params), make_batch(x[4:], **params)]
    merged = merge_batches(parts)
    assert merged.processing.token_bitmask_rows.tolist() == [0, 1, 2, 3]
    got = cuda_backend.sample(merged)
    alone = [cuda_backend.sample(part) for part in parts]
    assert torch.equal(got.tokens, torch.cat([part.tokens for part in alone]))
    assert got.valid.tolist() == [True, True, True, False, True, True, True]
    every_row = torch.cat([allowed, torch.ones(3, VOCAB, dtype=torch.bool)])  # the last three rows have no mask
    assert_agrees(got, dataclasses.replace(merged, logits=x.cpu()), cpu_backend, x, every_row)


def test_a_mask_beside_other_processing(cuda_backend, cpu_backend) -> None:
    """With bias, bans and a local sampler, the mask is written into the processed copy first (the in-place kernel):
    the same as masking the logits beforehand, and as the reference."""
    x = logits("flat", 5, ODD_VOCAB, seed=61).cuda()
    allowed = allowed_tokens(["half", "hundred", "contiguous", "one", "all"], ODD_VOCAB, seed=62)
    rows = torch.arange(5)
    banned = TokenEntries(rows=rows, tokens=allowed.float().argmax(dim=1))  # each row's first allowed token
    bias = TokenEntries(rows=rows, tokens=torch.full((5,), 3))
    rest = dict(banned=banned, bias=bias, bias_values=torch.full((5,), 4.0))
    params = dict(temperature=0.9, top_k=50, top_p=0.9, return_logprobs=True, logprobs_mode=LogprobsMode.PROCESSED)
    with_mask = make_batch(x, processing=LogitProcessing(token_bitmask=bitmask(allowed), **rest), **params)
    pre = make_batch(x.masked_fill(~allowed.cuda(), float("-inf")), processing=LogitProcessing(**rest), **params)
    got = cuda_backend.sample(with_mask)
    assert_same_result(got, cuda_backend.sample(pre))
    processed = apply_processing(x.float().cpu(), with_mask.processing)  # mask, bans and bias: what the cut sees
    assert_agrees(got, dataclasses.replace(with_mask, logits=x.cpu()), cpu_backend, processed,
                  torch.ones_like(allowed))


def test_a_mask_already_on_the_gpu(cuda_backend) -> None:
    x = logits("spiky", 9, VOCAB, seed=71).cuda()
    allowed = allowed_tokens(_kinds(9), VOCAB, seed=72)
    for mode in ("gumbel", "top_k_top_p", "min_p"):
        on_cpu = masked_batch(x, allowed, **MODES[mode])
        on_gpu = dataclasses.replace(on_cpu, processing=LogitProcessing(token_bitmask=bitmask(allowed).cuda()))
        assert_same_result(cuda_backend.sample(on_gpu), cuda_backend.sample(on_cpu))


def test_the_in_place_kernel_writes_minus_infinity_where_the_mask_disallows(cuda_backend) -> None:
    """apply_bitmask_kernel (the mask beside other processing): -inf exactly at the disallowed tokens of the rows with
    a mask (through a row map: rows 1 and 4 have none), garbage past the vocabulary ignored, nothing else written."""
    x = logits("flat", 5, ODD_VOCAB, seed=91).cuda()
    allowed = allowed_tokens(["half", "all", "hundred", "contiguous", "all"], ODD_VOCAB, seed=92)
    words = bitmask(allowed[[2, 0, 3]], garbage=True).cuda()
    row_map = torch.tensor([1, -1, 0, 2, -1], dtype=torch.int32, device="cuda")
    got = x.clone()
    cuda_backend._kernels.apply_bitmask(got, words, row_map)
    assert torch.equal(got, x.masked_fill(~allowed.cuda(), float("-inf")))


@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_p", "min_p"])
def test_no_row_by_vocabulary_tensor_is_allocated(cuda_backend, mode: str) -> None:
    """A batch whose only processing is the mask reads its logits once: the call's peak allocation grows by far less
    than the B x V bytes of a boolean mask (a float32 copy would take four times that)."""
    num_rows = 64
    x = logits("spiky", num_rows, VOCAB, seed=81).cuda()
    batch = masked_batch(x, allowed_tokens(_kinds(num_rows), VOCAB, seed=82), **MODES[mode])
    cuda_backend.sample(batch)  # buffers and workspace grown to this shape
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cuda_backend.sample(batch)
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < num_rows * VOCAB // 16, f"the call allocated {grown} bytes"


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.2), dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05),
], ids=["plain", "top_k", "top_p", "min_p", "combined"])
def test_distribution_over_the_allowed_tokens(cuda_backend, params: dict) -> None:
    draws = 20_000
    allowed = torch.zeros(LOGITS.numel(), dtype=torch.bool)
    allowed[[0, 2, 4, 7, 8, 9, 11]] = True
    x = LOGITS.unsqueeze(0).expand(draws, -1).contiguous().cuda()
    batch = make_batch(x, processing=LogitProcessing(token_bitmask=bitmask(allowed.unsqueeze(0).expand(draws, -1))),
                       seed=17, **params)  # a seed a row
    tokens = cuda_backend.sample(batch).tokens[:, 0].numpy()
    assert np.isin(tokens, allowed.nonzero().squeeze(1).numpy()).all(), "drew a token the bitmask disallows"
    masked = np.where(allowed.numpy(), LOGITS.numpy().astype(np.float64), -np.inf)
    assert_fits(np.bincount(tokens, minlength=LOGITS.numel()), exact_distribution(masked, **params))


# ---- hidden states through the fused kernels


def _head(vocab: int, dim: int, seed: int) -> RegisteredWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, dim, generator=gen) / dim ** 0.5).to(torch.bfloat16)
    return RegisteredWeight(name="w", weight=weight.cuda(), finish=LogitsFinish(vocab_size=vocab), sha256="")


def _hidden_batch(head: RegisteredWeight, hidden: torch.Tensor, allowed: torch.Tensor, **params) -> SamplingBatch:
    batch = make_batch(torch.empty(hidden.shape[0], 0), processing=LogitProcessing(token_bitmask=bitmask(allowed)),
                       **params)
    return dataclasses.replace(batch, logits=None, hidden=HiddenInput(hidden, head))


# (vocabulary, rows): 20011 spans 132 CTAs (the streaming kernel, with candidates for filtered rows), 5003 fewer
# than 64 (filtered rows on the register ring); 100 unfiltered rows take the streaming kernel's 128-row tile.
@pytest.mark.parametrize("vocab,num_rows", [(20011, 1), (20011, 17), (20011, 64), (5003, 16), (20011, 100)])
@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_k_min_p"])
def test_hidden_states_through_the_fused_kernels(cuda_backend, cpu_backend, vocab: int, num_rows: int,
                                                 mode: str) -> None:
    from tokensampler_server.backends import cuda_fused

    params = {"greedy": {"temperature": 0.0}, "gumbel": {"temperature": 0.8},
              "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
              "top_k_min_p": {"temperature": 1.2, "top_k": 20, "min_p": 0.05}}[mode]
    if not cuda_fused.fused_is_faster(num_rows, "top_k" in mode, torch.cuda.current_device()):
        pytest.skip("filtered batches of this size take cuBLAS and the logits kernels")
    head = _head(vocab, 896, seed=vocab)
    hidden = (torch.randn(num_rows, 896, generator=torch.Generator().manual_seed(num_rows)) * 4).to(torch.bfloat16)
    allowed = allowed_tokens(_kinds(num_rows, offset=1), vocab, seed=num_rows)
    batch = _hidden_batch(head, hidden, allowed, **params)
    assert cuda_fused.unsupported_reason(batch) is None
    fused, redo = cuda_fused.sample_hidden(batch)
    assert redo.numel() == 0, "the fused kernel handed rows to the logits path"
    assert_allowed(fused, allowed)
    got = cuda_backend.sample(batch)
    assert torch.equal(got.tokens, fused.tokens)
    logits_ = dataclasses.replace(head, weight=head.weight.cpu()).logits(hidden)
    reference = make_batch(logits_, processing=LogitProcessing(token_bitmask=bitmask(allowed)), **params)
    want = cpu_backend.sample(reference)
    assert torch.equal(got.valid, want.valid)
    if mode == "greedy":
        top2 = logits_.masked_fill(~allowed, float("-inf")).topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1] > 1e-3) & got.valid
        assert torch.equal(got.tokens[clear], want.tokens[clear])
    else:  # W·h's accumulation order differs between the devices: rounding of 1e-3 relative
        assert_tokens_agree(logits_.masked_fill(~allowed, float("-inf")), reference, got, want, rounding=1e-3)


def test_hidden_states_with_raw_logprobs_take_the_logits_path(cuda_backend, cpu_backend) -> None:
    """The fused kernel masks each logit as it makes it and never sees the whole input, of which raw log-probs are."""
    from tokensampler_server.backends import cuda_fused

    head = _head(20011, 896, seed=3)
    hidden = (torch.randn(4, 896, generator=torch.Generator().manual_seed(4)) * 4).to(torch.bfloat16)
    allowed = allowed_tokens(["half", "hundred", "one", "none"], 20011, seed=5)
    batch = _hidden_batch(head, hidden, allowed, temperature=1.0, top_k=50, return_logprobs=True)
    assert cuda_fused.unsupported_reason(batch) == "fused_logprobs"
    got = cuda_backend.sample(batch)
    assert_allowed(got, allowed)
    logits_ = dataclasses.replace(head, weight=head.weight.cpu()).logits(hidden)
    raw = torch.log_softmax(logits_, dim=1)
    valid = got.valid
    torch.testing.assert_close(got.logprobs[valid], raw[valid].gather(1, got.tokens[valid]), rtol=1e-4, atol=1e-4)
    assert bool(got.logprobs[~valid].isnan().all())
