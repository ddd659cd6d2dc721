"""The fused LM-head matmul + sampling kernel (csrc/fused.cuh) against the CPU reference on W·h.

Agreement with the reference over the benchmark's shapes, exactness where it holds (greedy away from
near-ties, seeded reproducibility, batch invariance), chi-square against distributions known
exactly (W and h built so that W·h is exact in bf16 arithmetic), NaN rows, padded vocabularies,
bias / scale / soft cap, and the rows the kernel hands to the logits path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare
from tokensampler_server.backends.cpu import CpuBackend, kept_token_mask
from tokensampler_server.model.sampling import HiddenInput
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from ..batches import make_batch as make_batch_of_columns
from .conftest import make_batch

pytestmark = pytest.mark.gpu

ALPHA = 0.001  # significance of every chi-square test here (fixed seeds: the outcome is deterministic)


def _fused():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tokensampler_server.backends import cuda_fused

    return cuda_fused


def _head(vocab: int, dim: int, *, padded: int | None = None, seed: int = 0, finish: LogitsFinish | None = None,
          dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> RegisteredWeight:
    gen = torch.Generator().manual_seed(seed)
    rows = padded or vocab
    weight = (torch.randn(rows, dim, generator=gen) / dim ** 0.5).to(dtype)
    return RegisteredWeight(name="w", weight=weight.to(device), finish=finish or LogitsFinish(vocab_size=vocab),
                            sha256="")


def _hidden(num_rows: int, dim: int, seed: int, scale: float = 4.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(num_rows, dim, generator=gen) * scale).to(dtype)


def _hidden_batch(head: RegisteredWeight, hidden: torch.Tensor, **params):
    batch = make_batch(torch.empty(hidden.shape[0], 0), **params)
    return dataclasses.replace(batch, logits=None, hidden=HiddenInput(hidden, head))


def _reference(head: RegisteredWeight, hidden: torch.Tensor, **params):
    """The CPU reference on x = W·h computed in fp32 on the CPU."""
    cpu_head = dataclasses.replace(head, weight=head.weight.cpu(),
                                   finish=dataclasses.replace(head.finish, bias=None if head.finish.bias is None
                                                              else head.finish.bias.cpu()))
    logits = cpu_head.logits(hidden)
    return CpuBackend().sample(make_batch(logits, **params)), logits


MODES = {
    "greedy": {"temperature": 0.0},
    "gumbel": {"temperature": 0.8},
    "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "top_k_min_p": {"temperature": 1.2, "top_k": 20, "min_p": 0.05},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.1},
}


def _near_tie_rows(logits: torch.Tensor, gap: float = 1e-3) -> torch.Tensor:
    top2 = logits.topk(2, dim=1).values
    return (top2[:, 0] - top2[:, 1]) < gap


def test_the_route_planner_sends_batches_of_one_tile_to_the_fused_kernel() -> None:
    """csrc/fused.h ts_fused_preferred: the fused kernel up to one 128-row tile, 64 rows when a row has a filter
    (cuBLAS + the logits kernels beyond, docs/design/fused-lm-head.md), and top-k up to its 63."""
    cuda_fused = _fused()
    device = torch.cuda.current_device()
    unfiltered = [cuda_fused.fused_is_faster(b, False, device) for b in (1, 64, 65, 128, 129, 256)]
    filtered = [cuda_fused.fused_is_faster(b, True, device) for b in (1, 63, 64, 65, 128)]
    assert unfiltered == [True] * 4 + [False] * 2 and filtered == [True] * 3 + [False] * 2
    assert cuda_fused.max_top_k(device) == 63


@pytest.mark.parametrize("dim", [64, 896, 4096, 8192])
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_matches_the_reference(cuda_backend, dim: int, mode: str) -> None:
    """Hidden states through the backend (the fused kernel where cuda_fused.fused_is_faster) vs the reference."""
    vocab = 5003  # not a multiple of any tile
    head = _head(vocab, dim, seed=dim)
    agree = total = 0
    for num_rows in (1, 16, 17, 64):
        hidden = _hidden(num_rows, dim, seed=num_rows)
        params = dict(MODES[mode], return_logprobs=True)
        got = cuda_backend.sample(_hidden_batch(head, hidden, **params))
        want, logits = _reference(head, hidden, **params)
        same = got.tokens == want.tokens
        if mode == "greedy":
            assert bool(same[~_near_tie_rows(logits)].all()), "greedy differs away from near-ties"
        agree += int(same.sum())
        total += same.numel()
        close = same.squeeze(1)
        torch.testing.assert_close(got.logprobs[close], want.logprobs[close], atol=2e-4, rtol=1e-4)
        assert bool(got.valid.all())
    assert agree / total >= 0.999 or total - agree <= 1, f"{mode}: {agree}/{total} identical tokens"


def _columns(modes: list[str]) -> dict[str, torch.Tensor]:
    """Per-row parameters (CPU) of rows of the given MODES, with conftest.make_batch's seeds, positions and
    iteration."""
    num_rows = len(modes)

    def column(name: str, default: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([MODES[mode].get(name, default) for mode in modes], dtype=dtype)

    return dict(temperature=column("temperature", 1.0, torch.float32), top_k=column("top_k", 0, torch.int32),
                top_p=column("top_p", 1.0, torch.float32), min_p=column("min_p", 0.0, torch.float32),
                seed=torch.arange(num_rows, dtype=torch.int64) * 7919 + 1234,
                position=torch.arange(num_rows, dtype=torch.int64) % 97,
                iteration=torch.full((num_rows,), 3, dtype=torch.int64))


def _sample_streaming(fused, head: RegisteredWeight, hidden: torch.Tensor, columns: dict[str, torch.Tensor],
                      filtered: bool, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The streaming kernel on the batch; each of `rows` sampled alone must give the same token and log-prob."""
    from tokensampler_server.backends.cuda_kernels import RowParams

    vocab = head.finish.vocab_size
    params = RowParams(**{name: column.cuda() for name, column in columns.items()})
    tokens, logprobs, flags = fused.fused_sample(head.weight, hidden.cuda(), params, vocab=vocab, logprobs=True,
                                                 filtered=filtered)
    for row in rows:
        alone = RowParams(**{name: column[row:row + 1].cuda() for name, column in columns.items()})
        t1, l1, _ = fused.fused_sample(head.weight, hidden[row:row + 1].cuda(), alone, vocab=vocab, logprobs=True,
                                       filtered=filtered)
        assert int(t1) == int(tokens[row]) and torch.equal(l1[0], logprobs[row]), f"row {row} differs alone"
    return tokens.cpu(), logprobs.cpu(), flags.cpu()


def _assert_agreement(tokens: torch.Tensor, want: torch.Tensor) -> None:
    agreement = (tokens == want).float().mean().item()
    assert agreement >= 0.999 or (tokens != want).sum() <= 1, f"{agreement:.4f} of tokens agree with the reference"


@pytest.mark.parametrize("num_rows", [1, 17, 64, 256, 512])
@pytest.mark.parametrize("mode", ["top_k_top_p", "top_k_min_p", "gumbel", "greedy"])
def test_kernel_shapes_and_batch_invariance(num_rows: int, mode: str) -> None:
    """The streaming kernel itself at every B of the benchmark (batch tiles of 8, 16, 32, 64 or 128 rows; the backend
    sends B > 128, and filtered B > 64, to cuBLAS), collecting candidates for top-k/top-p rows, each row identical
    to the same row sampled alone."""
    fused = _fused()
    vocab, dim = 32000 + 7, 896
    head = _head(vocab, dim, padded=32064, seed=5)
    hidden = _hidden(num_rows, dim, seed=11)
    tokens, _, flags = _sample_streaming(fused, head, hidden, _columns([mode] * num_rows), mode.startswith("top_k"),
                                         rows=[0, num_rows // 2, num_rows - 1])
    want, _ = _reference(head, hidden, **MODES[mode], return_logprobs=True)  # make_batch: the same seeds, positions
    _assert_agreement(tokens, want.tokens)
    assert int(flags.max()) == 0 and bool((tokens < vocab).all())


def _split_last_round_vocab(tail: int) -> int:
    """A vocabulary of one round of tiles a CTA, then a last round of about a quarter of them, its last tile `tail`
    rows: the streaming kernel splits that round into half tiles, one a CTA (csrc/fused_stream.cuh, stream_unit)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return (sms + sms // 4) * 128 + tail


@pytest.mark.parametrize("tail", [37, 100, 128])
@pytest.mark.parametrize("num_rows", [64, 128])  # 128 rows, greedy without log-probs: the lane-row epilogue
def test_every_token_of_a_last_round_split_in_halves_can_win(tail: int, num_rows: int) -> None:
    """Greedy rows whose hidden state is a W row scaled: that row's token wins by a margin of more than 3 (so each
    row's token is known exactly), while the rest of the vocabulary holds most of the row's mass, so that any half
    read twice moves every row's log-prob by 1.4e-3 or more (H200's 132 SMs; 7e-4 is allowed). The tokens are spread
    over the split round's halves, both ends of each and the vocabulary's last token, so that a half never read, or
    read at the wrong rows, shows in the tokens. 128 rows take the lane-row epilogue, which has no sums."""
    fused = _fused()
    from tokensampler_server.backends.cuda_kernels import RowParams

    vocab, dim = _split_last_round_vocab(tail), 256
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    head = _head(vocab, dim, seed=tail)
    picks = [t for half in range(sms * 128, vocab, 64) for t in (half, min(half + 63, vocab - 1))]
    targets = torch.tensor([picks[i * len(picks) // num_rows] for i in range(num_rows - 1)] + [vocab - 1])
    hidden = (head.weight.cpu()[targets].float() * 6).to(torch.bfloat16)
    columns = {name: column.cuda() for name, column in _columns(["greedy"] * num_rows).items()}
    logprobs = num_rows != 128
    tokens, got, flags = fused.fused_sample(head.weight, hidden.cuda(), RowParams(**columns), vocab=vocab,
                                            logprobs=logprobs, filtered=False)
    assert int(flags.max()) == 0
    assert torch.equal(tokens.cpu().view(-1), targets)
    if logprobs:
        want, _ = _reference(head, hidden, **MODES["greedy"], return_logprobs=True)
        torch.testing.assert_close(got.cpu(), want.logprobs, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("tail", [37, 100])
@pytest.mark.parametrize("mode", ["gumbel", "top_k_top_p", "top_k_min_p"])
def test_a_last_round_split_in_halves_agrees_with_the_reference(tail: int, mode: str) -> None:
    """Sampled rows over a vocabulary whose last round is split in halves: tokens agree with the reference, and so do
    the raw log-probs (whose sums a half read twice would move), and each row comes out as it does alone."""
    fused = _fused()
    vocab, dim, num_rows = _split_last_round_vocab(tail), 256, 33
    head = _head(vocab, dim, seed=tail + 1)
    hidden = _hidden(num_rows, dim, seed=tail)
    tokens, logprobs, flags = _sample_streaming(fused, head, hidden, _columns([mode] * num_rows), mode != "gumbel",
                                                rows=[0, num_rows - 1])
    want, _ = _reference(head, hidden, **MODES[mode], return_logprobs=True)
    _assert_agreement(tokens, want.tokens)
    assert int(flags.max()) == 0
    same = (tokens == want.tokens).view(-1)
    torch.testing.assert_close(logprobs.view(-1, 1)[same], want.logprobs[same], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("num_rows", [7, 17, 64])
def test_mixed_modes_in_one_batch_match_each_row_alone(num_rows: int) -> None:
    """Greedy, Gumbel and filtered rows in one batch: each row takes its own path through the streaming kernel's
    epilogue (a filtered row's best keys, a Gumbel row's screened noise, a greedy row's argmax) wherever the mix
    places it, and must come out bit for bit as it does alone, and agree with the reference."""
    fused = _fused()
    vocab, dim = 32000 + 7, 896
    head = _head(vocab, dim, padded=32064, seed=5)
    hidden = _hidden(num_rows, dim, seed=13)
    pattern = ("greedy", "top_k_top_p", "gumbel", "gumbel", "top_k_min_p", "greedy", "gumbel")
    columns = _columns([pattern[(row * 3) % len(pattern)] for row in range(num_rows)])
    tokens, _, flags = _sample_streaming(fused, head, hidden, columns, True, rows=list(range(num_rows)))
    cpu_head = dataclasses.replace(head, weight=head.weight.cpu())
    want = CpuBackend().sample(make_batch_of_columns(cpu_head.logits(hidden), **columns, return_logprobs=True))
    _assert_agreement(tokens, want.tokens)
    assert int(flags.max()) == 0


@pytest.mark.parametrize("with_bias_and_cap", [True, False])  # False: the plain head's branch-free finish
def test_lane_row_epilogue_matches_the_warp_per_row_epilogue(with_bias_and_cap: bool) -> None:
    """More than 64 rows with neither filters nor log-probs take the 128-row tile's lane-row epilogue (each row's
    share of a tile split between two threads, merged after the last tile). Greedy rows, Gumbel rows at T = 1 and
    T = 0.8, a NaN row, a filtered row (flagged), a partial last batch tile and a vocabulary that ends in the first
    half of a tile: every row's token and flags must equal those of the same rows sampled 64 at a time and alone
    (the warp-per-row epilogue), and agree with the reference."""
    fused = _fused()
    from tokensampler_server.backends.cuda_kernels import RowParams

    vocab, padded, dim, num_rows = 32000 + 7, 32064, 896, 300
    bias = torch.randn(padded, generator=torch.Generator().manual_seed(21)) * 2 if with_bias_and_cap else None
    finish = LogitsFinish(vocab_size=vocab, bias=None if bias is None else bias.cuda(),
                          soft_cap=15.0 if with_bias_and_cap else None, logit_scale=0.7)
    head = _head(vocab, dim, padded=padded, seed=6, finish=finish)
    hidden = _hidden(num_rows, dim, seed=17)
    hidden[5, 3] = float("nan")
    modes = [("gumbel", "greedy", "gumbel", "gumbel")[row % 4] for row in range(num_rows)]
    modes[77] = "top_k_top_p"
    columns = _columns(modes)
    columns["temperature"][2::4] = 1.0  # T = 1: the screen without a division
    kwargs = dict(vocab=vocab, bias=finish.bias, logit_scale=finish.logit_scale, soft_cap=finish.soft_cap,
                  filtered=False)

    def sample(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        params = RowParams(**{name: column[rows].cuda() for name, column in columns.items()})
        tokens, logprobs, flags = fused.fused_sample(head.weight, hidden[rows].cuda(), params, **kwargs)
        assert logprobs is None
        return tokens.cpu(), flags.cpu()

    tokens, flags = sample(slice(0, num_rows))
    assert ((flags & 4) != 0).nonzero().flatten().tolist() == [77]
    assert ((flags & 1) != 0).nonzero().flatten().tolist() == [5]
    by_64 = [sample(slice(start, start + 64)) for start in range(0, num_rows, 64)]
    assert torch.equal(torch.cat([t for t, _ in by_64]), tokens)
    assert torch.equal(torch.cat([f for _, f in by_64]), flags)
    for row in (0, 1, 2, 127, 128, 255, 299):
        alone_tokens, alone_flags = sample(slice(row, row + 1))
        assert torch.equal(alone_tokens, tokens[row:row + 1]) and torch.equal(alone_flags, flags[row:row + 1]), row
    cpu_head = dataclasses.replace(head, weight=head.weight.cpu(), finish=dataclasses.replace(finish, bias=bias))
    want = CpuBackend().sample(make_batch_of_columns(cpu_head.logits(hidden), **columns))
    sampled = flags == 0
    _assert_agreement(tokens[sampled], want.tokens[sampled])


def test_streaming_kernel_flags_filtered_rows() -> None:
    """Rows with top-k/top-p/min-p sent to the streaming kernel come back flagged for the logits path;
    the other rows of the batch are sampled as if alone."""
    fused = _fused()
    from tokensampler_server.backends.cuda_kernels import RowParams

    head = _head(5003, 256, seed=9)
    hidden = _hidden(6, 256, seed=9)
    columns = [torch.tensor(v) for v in ([1.0, 1.0, 0.0, 1.0, 1.0, 0.7], [0, 40, 0, 0, 0, 0],
                                         [1.0, 1.0, 1.0, 0.9, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.2, 0.0])]
    columns[1] = columns[1].to(torch.int32)
    columns += [torch.arange(6, dtype=torch.int64) + 5] + [torch.zeros(6, dtype=torch.int64)] * 2
    params = RowParams(*(c.cuda() for c in columns))
    tokens, _, flags = fused.fused_sample(head.weight, hidden.cuda(), params, vocab=5003, filtered=False)
    assert ((flags.cpu() & 4) != 0).tolist() == [False, True, False, True, True, False]
    for row in (0, 2, 5):
        alone = RowParams(*(c[row:row + 1].cuda() for c in columns))
        t1, _, _ = fused.fused_sample(head.weight, hidden[row:row + 1].cuda(), alone, vocab=5003, filtered=False)
        assert int(t1) == int(tokens[row])


def test_crowded_candidates_are_trusted_only_above_a_full_list(cuda_backend) -> None:
    """A row whose 64 best tokens all sit in one vocabulary tile (one CTA's list of 16 keys): the kernel
    samples it when the kept set lies inside the 16 keys it can trust (top-k 10) and flags it for the
    logits path otherwise (top-k 50); the backend's tokens agree with the reference either way."""
    fused = _fused()
    from tokensampler_server.backends.cuda_kernels import RowParams

    vocab, dim, rows = 32768, 256, 8
    bias = torch.zeros(vocab)
    bias[:64] = 12.0  # tile 0 of the streaming kernel's 256 tiles over 132 CTAs
    finish = LogitsFinish(vocab_size=vocab, bias=bias.cuda())
    head = _head(vocab, dim, seed=12, finish=finish)
    hidden = _hidden(rows, dim, seed=12, scale=1.0)
    assert fused.plan(rows, dim, vocab, torch.cuda.current_device(), True).vocab_ctas >= 64
    for top_k, flagged in ((10, False), (50, True)):
        params = RowParams.make(rows, torch.device("cuda"), top_k=top_k, seed=3)
        _, _, flags = fused.fused_sample(head.weight, hidden.cuda(), params, bias=finish.bias)
        assert ((flags.cpu() & 4) != 0).tolist() == [flagged] * rows
        got = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, top_k=top_k))
        want, _ = _reference(head, hidden, temperature=1.0, top_k=top_k)
        assert (got.tokens == want.tokens).float().mean().item() >= (rows - 1) / rows


def _assert_top_k_top_p_sampled_by_stage_2(cuda_backend, head: RegisteredWeight, hidden: torch.Tensor) -> None:
    """Top-k 50 + top-p 0.9 rows through the fused kernel: none flagged for the logits path, and the backend's
    tokens agree with the reference (one row of the batch may differ)."""
    from tokensampler_server.backends import cuda_fused
    from tokensampler_server.backends.cuda_kernels import RowParams

    rows = hidden.shape[0]
    params = RowParams.make(rows, torch.device("cuda"), top_k=50, top_p=0.9, seed=3)
    _, _, flags = cuda_fused.fused_sample(head.weight, hidden.cuda(), params, bias=head.finish.bias)
    assert int(flags.max()) == 0
    got = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, top_k=50, top_p=0.9))
    want, _ = _reference(head, hidden, temperature=1.0, top_k=50, top_p=0.9)
    assert (got.tokens == want.tokens).float().mean().item() >= (rows - 1) / rows


def test_one_leading_token_per_cta_keeps_exactly_the_best_64(cuda_backend) -> None:
    """One large logit in each of the 132 CTAs' first tiles: the CTAs' 64th best head is then the row's 64th
    best key, and the keys just below it share its leading digits; stage 2 must still take exactly the best
    64 (rows agree with the reference; none flagged)."""
    _fused()
    vocab, dim, rows = 32768, 256, 8
    bias = torch.zeros(vocab)
    bias[torch.arange(132) * 128] = 10.0 + torch.arange(132) * 0.01
    finish = LogitsFinish(vocab_size=vocab, bias=bias.cuda())
    head = _head(vocab, dim, seed=13, finish=finish)
    hidden = _hidden(rows, dim, seed=13, scale=0.2)
    _assert_top_k_top_p_sampled_by_stage_2(cuda_backend, head, hidden)


def test_many_keys_above_the_floors_take_the_radix_select(cuda_backend) -> None:
    """Seven large logits in each of the two tiles of 30 CTAs: 14 a list, so no list is full of them (the
    highest last key is small) and the CTAs' 64th best head is a small one, which leaves 420 keys above both
    floors, more than stage 2 ranks by counting; its radix select must still take exactly the best 64."""
    fused = _fused()
    vocab, dim, rows = 32768, 256, 8
    tiles = [c + 132 * half for c in range(30) for half in range(2)]  # CTA c's tiles of the 256 over 132 CTAs
    large = torch.tensor([128 * tile + 9 * j for tile in tiles for j in range(7)])
    bias = torch.zeros(vocab)
    bias[large] = 10.0 + 0.002 * torch.randperm(len(large), generator=torch.Generator().manual_seed(5)).float()
    finish = LogitsFinish(vocab_size=vocab, bias=bias.cuda())
    head = _head(vocab, dim, seed=14, finish=finish)
    hidden = _hidden(rows, dim, seed=14, scale=0.2)
    assert fused.plan(rows, dim, vocab, torch.cuda.current_device(), True).vocab_ctas >= 64
    _assert_top_k_top_p_sampled_by_stage_2(cuda_backend, head, hidden)


def test_reproducible_and_seed_sensitive(cuda_backend) -> None:
    head = _head(32000, 4096, seed=3)
    hidden = _hidden(8, 4096, seed=3, scale=1.0)
    first = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, seed=99))
    again = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, seed=99))
    other = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, seed=100))
    assert torch.equal(first.tokens, again.tokens)
    assert not torch.equal(first.tokens, other.tokens)


@pytest.mark.parametrize("with_bias_and_cap", [True, False])  # False: the epilogue's branch-free plain head
def test_padded_rows_bias_scale_and_soft_cap(cuda_backend, with_bias_and_cap: bool) -> None:
    vocab, padded, dim = 990, 1024, 128
    if with_bias_and_cap:
        bias = torch.randn(padded, generator=torch.Generator().manual_seed(8)) * 2
        finish = LogitsFinish(vocab_size=vocab, bias=bias.cuda(), soft_cap=15.0, logit_scale=0.7)
    else:
        finish = LogitsFinish(vocab_size=vocab, logit_scale=0.7)
    head = _head(vocab, dim, padded=padded, seed=8, finish=finish)
    hidden = _hidden(64, dim, seed=8, scale=8.0)
    for mode in ("greedy", "gumbel", "top_k_top_p"):
        got = cuda_backend.sample(_hidden_batch(head, hidden, **MODES[mode], return_logprobs=True))
        want, _ = _reference(head, hidden, **MODES[mode], return_logprobs=True)
        assert (got.tokens == want.tokens).float().mean().item() >= 63 / 64, mode
        assert bool((got.tokens < vocab).all())


def test_nan_rows_are_flagged_and_others_unaffected(cuda_backend) -> None:
    head = _head(3000, 256, seed=4)
    hidden = _hidden(5, 256, seed=4)
    hidden[2, 7] = float("nan")
    got = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, return_logprobs=True))
    assert got.nan_detected.tolist() == [False, False, True, False, False]
    assert not bool(got.valid[2]) and int(got.tokens[2, 0]) == -1 and torch.isnan(got.logprobs[2, 0])
    others = torch.tensor([0, 1, 3, 4])
    from tokensampler_server.backends.cuda import select_rows

    alone = select_rows(_hidden_batch(head, hidden, temperature=1.0), others)
    assert torch.equal(cuda_backend.sample(alone).tokens, got.tokens[others])


def test_kept_sets_past_the_candidates_take_the_logits_path(cuda_backend) -> None:
    """Flat logits with top-p 0.99 and no k keep thousands of tokens: the kernel flags every row, and
    the backend samples them from logits; tokens still agree with the reference."""
    fused = _fused()
    from tokensampler_server.backends.cuda_kernels import RowParams

    head = _head(20000, 256, seed=6)
    hidden = _hidden(16, 256, seed=6, scale=0.5)
    params = RowParams.make(16, torch.device("cuda"), top_p=0.99, seed=5)
    _, _, flags = fused.fused_sample(head.weight, hidden.cuda(), params)
    assert bool(((flags & 4) != 0).all())
    got = cuda_backend.sample(_hidden_batch(head, hidden, temperature=1.0, top_p=0.99))
    want, _ = _reference(head, hidden, temperature=1.0, top_p=0.99)
    assert (got.tokens == want.tokens).float().mean().item() >= 15 / 16


def _identity_head(vocab: int, dim: int) -> RegisteredWeight:
    """W[v] = e_{v mod dim}: x_v = h_{v mod dim}, exact in bf16 arithmetic."""
    weight = torch.zeros(vocab, dim, dtype=torch.bfloat16)
    weight[torch.arange(vocab), torch.arange(vocab) % dim] = 1.0
    return RegisteredWeight(name="eye", weight=weight.cuda(), finish=LogitsFinish(vocab_size=vocab), sha256="")


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the token counts against probs, tokens with expected count < 5 pooled."""
    n = tokens.numel()
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("vocab", [100, 256, 512, 32768])
@pytest.mark.parametrize("num_rows", [1, 2, 7])
@pytest.mark.parametrize("mode", ["gumbel", "top_k_top_p"])
def test_chi_square_against_known_logits(vocab: int, num_rows: int, mode: str) -> None:
    fused = _fused()
    from tokensampler_server.backends.cuda_kernels import RowParams

    dim = min(vocab, 4096) if vocab % 64 == 0 else 128
    head = _identity_head(vocab, dim)
    gen = torch.Generator().manual_seed(vocab + num_rows)
    h = (torch.randn(dim, generator=gen) * 2.0).to(torch.bfloat16)
    x = h.double()[torch.arange(vocab) % dim]
    params = MODES[mode]
    z = (x - x.max()) / params["temperature"]
    if mode == "gumbel":
        probs = torch.softmax(z, 0)
    else:
        kept = kept_token_mask(z.float().unsqueeze(0), torch.tensor([params["top_k"]], dtype=torch.int32),
                               torch.tensor([params["top_p"]]), torch.tensor([0.0]))[0]
        probs = torch.softmax(torch.where(kept, z, torch.tensor(float("-inf"), dtype=torch.float64)), 0)
    draws = 8000
    calls = -(-draws // num_rows)
    n = calls * num_rows
    hidden = h.unsqueeze(0).repeat(num_rows, 1).cuda()
    columns = [t.cuda() for t in (
        torch.full((n,), params["temperature"]), torch.full((n,), params.get("top_k", 0), dtype=torch.int32),
        torch.full((n,), params.get("top_p", 1.0)), torch.zeros(n), torch.arange(n, dtype=torch.int64) + 1,
        torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))]
    tokens, flags = [], []
    for call in range(calls):
        rows = slice(call * num_rows, (call + 1) * num_rows)
        drawn, _, flagged = fused.fused_sample(head.weight, hidden, RowParams(*(c[rows] for c in columns)),
                                               filtered=mode != "gumbel")
        tokens.append(drawn)
        flags.append(flagged)
    tokens = torch.cat(tokens).cpu()
    # First what the pooled chi-square cannot see: rows left to another path, and draws outside the kept set.
    assert int(torch.cat(flags).count_nonzero()) == 0, "the kernel flagged rows"
    assert int((probs[tokens.flatten()] == 0).sum()) == 0, "draws outside the kept set"
    assert _chi_square(tokens, probs) > ALPHA
