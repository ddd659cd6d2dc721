"""The frontier route for top-p / min-p without k (csrc/nucleus.cuh) against the binned exact filter.

Both are exact implementations of docs/semantics.md in the same fixed-point arithmetic, so their
tokens must agree bit for bit on every row: spiky and flat rows, rows built so that scores sit within
the screen's margins (tight), plateaus of equal logits, near-equal logits, bf16 input, vocabularies
that end inside a chunk or fill the 32 chunks the frontier merges, several temperatures and
per-row parameters. The frontier must also settle nearly every ordinary row itself (otherwise the
route would silently be the filter), and hand on the rows it cannot bound (large logits, tiny
temperatures) so that the filter still samples them right.
"""

from __future__ import annotations

import pytest
import torch

from tokensampler_server.backends.cuda_kernels import Outputs, RowParams

from .conftest import degenerate_rows, rows_of_every_kind, rows_of_kind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ROW_DECIDED = 8  # csrc/sampling.cuh kRowDecided


def _params(b: int, dev: torch.device, temperature: float, top_p: list[float], min_p: list[float]) -> RowParams:
    return RowParams(torch.full((b,), temperature, dtype=torch.float32, device=dev),
                     torch.zeros(b, dtype=torch.int32, device=dev),
                     torch.tensor(top_p, dtype=torch.float32, device=dev),
                     torch.tensor(min_p, dtype=torch.float32, device=dev),
                     torch.arange(b, dtype=torch.int64, device=dev) * 7919 + 5,
                     torch.arange(b, dtype=torch.int64, device=dev) % 13,
                     torch.full((b,), 2, dtype=torch.int64, device=dev))


def _outputs(b: int, dev: torch.device, samples: int) -> tuple[Outputs, Outputs]:
    pre = Outputs.row_stats(b, dev)
    out = Outputs(tokens=torch.full((b, samples), -7, dtype=torch.int64, device=dev),
                  flags=torch.empty(b, dtype=torch.uint8, device=dev))
    return pre, out


def _both_routes(kernels, x: torch.Tensor, params: RowParams, samples: int = 2):
    """(frontier tokens, filter tokens, the rows the frontier route settled in the last sample)."""
    b, dev = x.shape[0], x.device
    pre_f, out_f = _outputs(b, dev, samples)
    pre_s, out_s = _outputs(b, dev, samples)
    for sample in range(samples):
        kernels.nucleus(x, params, pre_f, out_f, sample)
        kernels.stats(x, params, pre_s)
        kernels.filter(x, params, pre_s, out_s, sample)
    assert torch.equal(pre_f.row_max, pre_s.row_max) and torch.equal(pre_f.tokens, pre_s.tokens)
    assert torch.equal(out_f.flags, out_s.flags)
    return out_f.tokens.cpu(), out_s.tokens.cpu(), (pre_f.flags & ROW_DECIDED).cpu() != 0


@pytest.mark.parametrize("vocab", [151936, 32003, 262144, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.4, 2.5])
def test_frontier_matches_filter(sampling_kernels, vocab, temperature):
    dev = sampling_kernels.device
    b = 24
    top_p = [(0.9, 0.5, 0.99, 1.0)[i % 4] for i in range(b)]
    min_p = [(0.0, 0.0, 0.02, 0.05, 0.3, 0.0)[i % 6] for i in range(b)]
    top_p = [p if (p < 1 or m > 0) else 0.7 for p, m in zip(top_p, min_p)]
    params = _params(b, dev, temperature, top_p, min_p)
    for kind, dtype, x in rows_of_every_kind(b, vocab, temperature, dev):
        got, want, settled = _both_routes(sampling_kernels, x, params)
        assert torch.equal(got, want), f"{kind} {dtype}: rows {(got != want).any(1).nonzero().flatten().tolist()}"
        if kind in ("spiky", "flat") and dtype == torch.float32:
            share = settled.float().mean().item()
            assert share >= 0.95, f"{kind}: the frontier settled only {share:.0%} of the rows"


def test_rows_beyond_the_bounds_go_to_the_filter(sampling_kernels):
    dev = sampling_kernels.device
    gen = torch.Generator(device=dev).manual_seed(3)
    b, vocab = 8, 50000
    x = torch.randn(b, vocab, device=dev, generator=gen)
    x[:4] *= 3000.0  # |max| above kFrontierBound
    params = _params(b, dev, 1.0, [0.9] * b, [0.0] * 4 + [0.05] * 4)
    got, want, settled = _both_routes(sampling_kernels, x, params)
    assert torch.equal(got, want)
    assert settled.tolist() == [False] * 4 + [True] * 4
    tiny_t = _params(b, dev, 1e-4, [0.9] * b, [0.0] * b)  # below the temperatures the proxies cover
    got, want, settled = _both_routes(sampling_kernels, x[4:].repeat(2, 1).contiguous(), tiny_t)
    assert torch.equal(got, want) and not settled.any()


def test_invalid_and_nan_rows(sampling_kernels):
    """Rows with NaN or +inf (read as -inf) that need the mass pass go to the filter: the mass pass reads
    logits unsanitized. Rows 4 and 5 are such rows, with +inf and with NaN, with and without min-p. A row whose
    frontier is the argmax alone needs no mass pass and is settled whatever its NaNs (8 of 300 random draws of
    these rows, each time with the filter's tokens), so the rows are drawn from a fixed seed where none is."""
    dev = sampling_kernels.device
    b, vocab = 6, 20000
    x = degenerate_rows(b, vocab, dev, torch.Generator(device=dev).manual_seed(0))
    x[4, 5::11] = float("inf")
    x[5, 3::5] = float("nan")
    params = _params(b, dev, 1.0, [0.9, 0.9, 0.5, 1.0, 0.9, 0.5], [0.0, 0.1, 0.0, 0.1, 0.05, 0.0])
    got, want, settled = _both_routes(sampling_kernels, x, params)
    assert torch.equal(got, want)
    assert got[0].tolist() == [-1, -1] and got[2].tolist() == [12345, 12345]
    assert not settled[[1, 4, 5]].any()


def test_frontier_matches_filter_on_the_agreement_matrix_case(sampling_kernels):
    """The case of test_cuda_agreement.py that found a race in the block's best pilot (threads outside
    warp 0 left warp 0 out of it): V = 1000, B = 1000 flat rows, T = 0.7, four samples; a few tokens
    of 4000 differed from the filter."""
    dev = sampling_kernels.device
    gen = torch.Generator(device=dev).manual_seed(31)
    b = 1000
    x = torch.randn(b, 1000, device=dev, generator=gen)
    for top_p, min_p in ((0.8, 0.02), (1.0, 0.05), (0.9, 0.0)):
        params = _params(b, dev, 0.7, [top_p] * b, [min_p] * b)
        got, want, _ = _both_routes(sampling_kernels, x, params, samples=4)
        assert torch.equal(got, want), f"p={top_p} m={min_p}: {(got != want).nonzero().tolist()[:8]}"


@pytest.mark.parametrize("kind", ["flat", "spiky"])
def test_frontier_matches_filter_on_a_large_batch(sampling_kernels, kind):
    """B = 512 rows of V = 151936: the frontier grid runs in several waves while the mass pass's blocks wait on
    each row's merge, so rows merge and are summed in every order; p from 0.02 to 0.995 (cuts before, among and
    after the summed frontier tokens) and three temperatures, against the filter's tokens."""
    dev = sampling_kernels.device
    gen = torch.Generator(device=dev).manual_seed(29 if kind == "flat" else 37)
    b, vocab = 512, 151936
    x = rows_of_kind(kind, b, vocab, gen, dev)
    top_p = (0.02, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99, 0.995)
    for temperature in (1.0, 0.5, 3.0):
        params = _params(b, dev, temperature, [top_p[i % len(top_p)] for i in range(b)], [0.0] * b)
        got, want, _ = _both_routes(sampling_kernels, x, params, samples=1)
        assert torch.equal(got, want), f"T={temperature}: rows {(got != want).any(1).nonzero().flatten().tolist()}"


def _frontier_masses(kernels, x: torch.Tensor, params: RowParams, row: int) -> list[tuple[float, float]]:
    """(mass ahead, total) of each frontier token of one row and sample 0, on the CPU in float64: the
    tokens of z-order (z desc, id asc) whose exact score z + g beats every token ahead of them."""
    t = float(params.temperature[row])
    _, noise = kernels.noise(int(params.seed[row]), int(params.position[row]), int(params.iteration[row]), 0,
                             x.shape[1])
    xr = x[row].float().cpu()
    z = (xr - xr.max()) / t
    scores, masses = (z + noise.cpu()).tolist(), torch.exp(z).double().tolist()
    zs = z.tolist()
    total = sum(masses)
    ahead, best, frontier = 0.0, float("-inf"), []
    for i in sorted(range(len(zs)), key=lambda i: (-zs[i], i)):
        if scores[i] > best:
            best = scores[i]
            frontier.append((ahead, total))
        ahead += masses[i]
    return frontier


@pytest.mark.parametrize("b,vocab", [(16, 20000), (128, 151936)])
def test_cuts_the_approximate_mass_pass_cannot_place(sampling_kernels, b, vocab):
    """Two kinds of rows the approximate mass pass must not decide. p x total within a part in 10^7 of
    the mass ahead of one of the last two frontier tokens, closer than its sums can tell
    (kMassTolerance): the exact mass pass decides them (a wrong approximate decision would show as a
    token different from the filter's about half the time). p between the masses ahead of the sixth and
    fifth last frontier tokens, before the last four whose masses the passes sum (kMassFrontier): the
    filter's exact fixed point samples them. In the first 16 rows; at B = 128, V = 151936 the mass pass
    takes two chunks a block (mass_blocks_per_row) and the other rows keep p = 0.9."""
    dev = sampling_kernels.device
    gen = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn(b, vocab, device=dev, generator=gen)
    base = _params(b, dev, 2.0, [0.9] * b, [0.0] * b)
    top_p, near_cut, early_cut = [], [], []
    for row in range(b):
        if row >= 16:
            top_p.append(0.9)
            continue
        frontier = _frontier_masses(sampling_kernels, x, base, row)
        total = frontier[0][1]
        if row % 2 == 0 and len(frontier) >= 3:
            ahead = frontier[-1 - row % 4 // 2][0]
            top_p.append(ahead / total * (1 + (1e-7 if row % 8 < 4 else -1e-7)))
            near_cut.append(row)
        elif row % 2 == 1 and len(frontier) >= 6:
            top_p.append((frontier[-6][0] + frontier[-5][0]) / 2 / total)
            early_cut.append(row)
        else:
            top_p.append(0.9)
    assert len(near_cut) >= 6 and len(early_cut) >= 3, f"frontiers too short: {near_cut}, {early_cut}"
    got, want, settled = _both_routes(sampling_kernels, x, _params(b, dev, 2.0, top_p, [0.0] * b), samples=1)
    assert torch.equal(got, want), f"rows {(got != want).any(1).nonzero().flatten().tolist()}"
    assert settled[near_cut].all() and not settled[early_cut].any(), f"settled {settled.tolist()}"
