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
    pre = Outputs(tokens=torch.empty(b, 1, dtype=torch.int64, device=dev),
                  flags=torch.empty(b, dtype=torch.uint8, device=dev),
                  row_max=torch.empty(b, dtype=torch.float32, device=dev),
                  row_min=torch.empty(b, dtype=torch.float32, device=dev))
    out = Outputs(tokens=torch.full((b, samples), -7, dtype=torch.int64, device=dev),
                  flags=torch.empty(b, dtype=torch.uint8, device=dev))
    return pre, out


def _both_routes(kernels, x: torch.Tensor, params: RowParams, samples: int = 2):
    """(frontier tokens, filter tokens, fraction of rows the frontier settled in the last sample)."""
    b, dev = x.shape[0], x.device
    pre_f, out_f = _outputs(b, dev, samples)
    pre_s, out_s = _outputs(b, dev, samples)
    for sample in range(samples):
        kernels.nucleus(x, params, pre_f, out_f, sample)
        kernels.stats(x, params, pre_s)
        kernels.filter(x, params, pre_s, out_s, sample)
    assert torch.equal(pre_f.row_max, pre_s.row_max) and torch.equal(pre_f.tokens, pre_s.tokens)
    assert torch.equal(out_f.flags, out_s.flags)
    settled = ((pre_f.flags & ROW_DECIDED) != 0).float().mean().item()
    return out_f.tokens.cpu(), out_s.tokens.cpu(), settled


def _rows(kind: str, b: int, vocab: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    x = torch.randn(b, vocab, device=dev, generator=gen)
    if kind == "spiky":
        x.scatter_(1, torch.randint(0, vocab, (b, 50), device=dev, generator=gen),
                   torch.rand(b, 50, device=dev, generator=gen) * 20 + 10)
    elif kind == "tight":  # many tokens within the screen's margins of the best one
        idx = torch.randint(0, vocab, (b, 3000), device=dev, generator=gen)
        x.scatter_(1, idx, 6.0 + torch.rand(b, 3000, device=dev, generator=gen) * 1e-3)
    elif kind == "plateau":  # equal logits: the noise and the lowest ids decide
        x[:, ::3] = 4.0
    elif kind == "near_equal":
        x = 5.0 + 1e-6 * x
    return x


@pytest.mark.parametrize("vocab", [151936, 32003, 262144, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.4, 2.5])
def test_frontier_matches_filter(cuda_backend, vocab, temperature):
    kernels = cuda_backend._kernels
    dev = kernels.device
    gen = torch.Generator(device=dev).manual_seed(vocab + int(10 * temperature))
    b = 24
    top_p = [(0.9, 0.5, 0.99, 1.0)[i % 4] for i in range(b)]
    min_p = [(0.0, 0.0, 0.02, 0.05, 0.3, 0.0)[i % 6] for i in range(b)]
    top_p = [p if (p < 1 or m > 0) else 0.7 for p, m in zip(top_p, min_p)]
    params = _params(b, dev, temperature, top_p, min_p)
    for kind in ("spiky", "flat", "tight", "plateau", "near_equal"):
        x = _rows(kind, b, vocab, gen, dev)
        for dtype in (torch.float32, torch.bfloat16):
            got, want, settled = _both_routes(kernels, x.to(dtype).contiguous(), params)
            assert torch.equal(got, want), f"{kind} {dtype}: rows {(got != want).any(1).nonzero().flatten().tolist()}"
            if kind in ("spiky", "flat") and dtype == torch.float32:
                assert settled >= 0.95, f"{kind}: the frontier settled only {settled:.0%} of the rows"


def test_rows_beyond_the_bounds_go_to_the_filter(cuda_backend):
    kernels = cuda_backend._kernels
    dev = kernels.device
    gen = torch.Generator(device=dev).manual_seed(3)
    b, vocab = 8, 50000
    x = torch.randn(b, vocab, device=dev, generator=gen)
    x[:4] *= 3000.0  # |max| above kFrontierBound
    params = _params(b, dev, 1.0, [0.9] * b, [0.0] * 4 + [0.05] * 4)
    got, want, settled = _both_routes(kernels, x, params)
    assert torch.equal(got, want)
    assert settled == 0.5
    tiny_t = _params(b, dev, 1e-4, [0.9] * b, [0.0] * b)  # below the temperatures the proxies cover
    got, want, settled = _both_routes(kernels, x[4:].repeat(2, 1).contiguous(), tiny_t)
    assert torch.equal(got, want) and settled == 0.0


def test_invalid_and_nan_rows(cuda_backend):
    kernels = cuda_backend._kernels
    dev = kernels.device
    b, vocab = 4, 20000
    x = torch.randn(b, vocab, device=dev)
    x[0] = float("-inf")
    x[1, ::7] = float("nan")
    x[2, :] = float("-inf")
    x[2, 12345] = 1.0  # one finite logit
    params = _params(b, dev, 1.0, [0.9, 0.9, 0.5, 1.0], [0.0, 0.1, 0.0, 0.1])
    got, want, _ = _both_routes(kernels, x, params)
    assert torch.equal(got, want)
    assert got[0].tolist() == [-1, -1] and got[2].tolist() == [12345, 12345]


def test_frontier_matches_filter_on_the_agreement_matrix_case(cuda_backend):
    """The case of test_cuda_agreement.py that found a race in the block's best pilot (threads outside
    warp 0 left warp 0 out of it): V = 1000, B = 1000 flat rows, T = 0.7, four samples; a few tokens
    of 4000 differed from the filter."""
    kernels = cuda_backend._kernels
    dev = kernels.device
    gen = torch.Generator(device=dev).manual_seed(31)
    b = 1000
    x = torch.randn(b, 1000, device=dev, generator=gen)
    for top_p, min_p in ((0.8, 0.02), (1.0, 0.05), (0.9, 0.0)):
        params = _params(b, dev, 0.7, [top_p] * b, [min_p] * b)
        got, want, _ = _both_routes(kernels, x, params, samples=4)
        assert torch.equal(got, want), f"p={top_p} m={min_p}: {(got != want).nonzero().tolist()[:8]}"
