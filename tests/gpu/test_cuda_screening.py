"""Exactness of the screening shortcuts and close-call paths in csrc/sampling.cuh (docs/design/logits-kernels.md).

- gumbel_kernel ranks by a fast proxy and re-scores close calls exactly. Its answer must equal, bit
  for bit, the argmax of the exact score z + gumbel_exact computed here in torch from the kernels'
  own exact noise, also on rows built so that the proxy's gap test is tight (many scores within
  rounding of each other, many just under the best); any future screening of the noise
  must keep passing this.
- filter_kernel rejects whole groups by the min-p test on an approximate z: tokens just above and
  just below exp(z) = m must be kept and dropped exactly as the CPU reference does.
- topk_kernel's merge prunes by a bound from the chunk lists' heads: top-k tokens crowded into one
  chunk, ties, and pools too large for the pruned path.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokensampler_server.backends.cuda_kernels import Outputs, RowParams

from .conftest import case_generator, exact_gumbel_argmax, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def _params(b: int, dev: torch.device, temperature: float, seeds: list[int], positions: list[int]) -> RowParams:
    full = lambda v, dt: torch.full((b,), v, dtype=dt, device=dev)  # noqa: E731
    return RowParams(full(temperature, torch.float32), full(0, torch.int32), full(1.0, torch.float32),
                     full(0.0, torch.float32), torch.tensor(seeds, dtype=torch.int64, device=dev),
                     torch.tensor(positions, dtype=torch.int64, device=dev), full(3, torch.int64))


def _gumbel_tokens(kernels, x: torch.Tensor, temperature: float, seeds: list[int], positions: list[int],
                   sample: int) -> torch.Tensor:
    """gumbel_kernel's tokens of sample `sample` (0 or 1) of rows x, on the CPU."""
    b, dev = x.shape[0], kernels.device
    out = Outputs(tokens=torch.full((b, 2), -7, dtype=torch.int64, device=dev),
                  flags=torch.empty(b, dtype=torch.uint8, device=dev))
    kernels.gumbel(x, _params(b, dev, temperature, seeds, positions), out, sample)
    return out.tokens[:, sample].cpu()


def _assert_gumbel_exact(kernels, x: torch.Tensor, temperature: float, seeds: list[int], positions: list[int],
                         name: str = "rows") -> list[torch.Tensor]:
    """Asserts that gumbel_kernel's tokens of samples 0 and 1 equal the exact argmax; returns them."""
    tokens = []
    for sample in (0, 1):
        got = _gumbel_tokens(kernels, x, temperature, seeds, positions, sample)
        want = exact_gumbel_argmax(kernels, x.float(), temperature, seeds, positions, sample)
        assert torch.equal(got, want), f"{name}: rows {(got != want).nonzero().flatten().tolist()} differ"
        tokens.append(got)
    return tokens


def _tight_rows(kernels, vocab: int, seeds, positions, gen: torch.Generator) -> torch.Tensor:
    """Rows whose perturbed scores x + g sit within rounding of one level, or just below it."""
    dev = kernels.device
    rows = []
    for r, (seed, pos) in enumerate(zip(seeds, positions)):
        _, g = kernels.noise(seed, pos, 3, 0, vocab)
        x = torch.randn(vocab, device=dev, generator=gen)
        idx = torch.randperm(vocab, device=dev, generator=gen)[:4000]
        if r % 3 == 0:  # x + g == 12 up to fp32 rounding: every one a close call
            x[idx] = 12.0 - g[idx]
        elif r % 3 == 1:  # a few at the level, many just under it (inside the screening margins)
            x[idx] = 12.0 - g[idx] - torch.rand(4000, device=dev, generator=gen) * 2e-3
            x[idx[:3]] = 12.0 - g[idx[:3]]
        else:  # a plateau of equal logits, the noise decides
            x[idx] = 9.5
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("vocab", [151936, 32003])
@pytest.mark.parametrize("temperature", [1.0, 0.05, 20.0])
def test_gumbel_screening_is_exact(sampling_kernels, vocab, temperature):
    dev = sampling_kernels.device
    gen = case_generator(dev, vocab, temperature, scale=100)
    b = 12
    seeds = [1000 + 17 * i for i in range(b)]
    positions = [i % 5 for i in range(b)]
    spiky = torch.randn(b, vocab, device=dev, generator=gen)
    spiky.scatter_(1, torch.randint(0, vocab, (b, 50), device=dev, generator=gen),
                   torch.rand(b, 50, device=dev, generator=gen) * 20 + 10)
    flat = torch.randn(b, vocab, device=dev, generator=gen)
    near_equal = 5.0 + 1e-6 * torch.randn(b, vocab, device=dev, generator=gen)
    tight = _tight_rows(sampling_kernels, vocab, seeds, positions, gen)
    for name, x in (("spiky", spiky), ("flat", flat), ("near_equal", near_equal), ("tight", tight)):
        if name == "tight" and temperature != 1.0:
            x = x * temperature  # keep x / T on the constructed level
        _assert_gumbel_exact(sampling_kernels, x.contiguous(), temperature, seeds, positions, name)


def test_min_p_boundary_matches_reference(cuda_backend, cpu_backend):
    vocab, b, m = 32000, 16, 0.05
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(b, vocab, generator=gen) - 10.0
    x[:, 0] = 0.0  # the max: z = x
    log_m = math.log(m)
    offsets = torch.tensor([-3e-3, -3e-4, -1e-4, -4e-5, 4e-5, 1e-4, 3e-4, 3e-3])
    idx = torch.randperm(vocab - 1, generator=gen)[:8 * 1500] + 1
    x[:, idx] = (log_m + offsets.repeat_interleave(1500)).to(torch.float32)
    for params in ({"min_p": m}, {"min_p": m, "top_p": 0.7, "temperature": 1.0}):
        batch = make_batch(x, num_samples=4, **params)
        got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
        assert int((got.tokens != want.tokens).sum()) <= 1
        below = set(idx[: 4 * 1500].tolist())
        assert not below.intersection(got.tokens.flatten().tolist()), "a token below min-p was drawn"


def _crowded_rows(vocab: int, b: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, vocab, generator=gen)
    x[0::4, :80] += 20.0  # the whole top-k inside the first chunk
    x[1::4, -70:] += 20.0  # inside the last, partial chunk
    x[2::4, 100:180] = 25.0  # ties: the lowest ids first
    x[3::4, 8192 * 3: 8192 * 3 + 64] = 18.0 + torch.arange(64) * 1e-3  # one chunk, distinct
    return x


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (50, 0.9), (3, 1.0), (200, 0.95), (255, 1.0)])
def test_topk_merge_pruning_matches_reference(cuda_backend, cpu_backend, top_k, top_p):
    x = _crowded_rows(151936 - 5, 8, seed=top_k)
    batch = make_batch(x, num_samples=3, top_k=top_k, top_p=top_p)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert int((got.tokens != want.tokens).sum()) <= 1


def _pilot_stress_rows(vocab: int, b: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """Rows aimed at the gumbel block screen (docs/design/logits-kernels.md): each block's pilot is the first
    1024 tokens of its 8192-token chunk (every thread's first group of four)."""
    pilot = torch.zeros(vocab, dtype=torch.bool, device=dev)
    for c in range(0, vocab, 8192):
        pilot[c:c + 1024] = True
    rows = []
    for r in range(b):
        x = torch.randn(vocab, device=dev, generator=gen)
        kind = r % 6
        if kind == 0:  # pilot tokens all -inf: L = -inf, the screen is off, every token is scored
            x[pilot] = float("-inf")
        elif kind == 1:  # a very low pilot: nothing can be screened out
            x[pilot] = -40.0
        elif kind == 2:  # masked rows: a few allowed tokens
            keep = torch.rand(vocab, device=dev, generator=gen) < 0.003
            x = torch.where(keep, x, torch.full_like(x, float("-inf")))
        elif kind == 3:  # large magnitudes: wide margins
            x = x + 1.0e4
        elif kind == 4:  # a high pilot and outsiders just around it
            x[pilot] += 6.0
            idx = torch.nonzero(~pilot).flatten()
            pick = idx[torch.randperm(idx.numel(), device=dev, generator=gen)[:300]]
            x[pick] = 6.0 + 3.0 * torch.rand(300, device=dev, generator=gen)
        else:  # one far winner outside the pilot region, NaN and +inf entries elsewhere
            idx = torch.nonzero(~pilot).flatten()
            x[idx[-5]] = 25.0
            x[idx[7]] = float("nan")
            x[idx[11]] = float("inf")
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.3, 4.0])
@pytest.mark.parametrize("vocab", [151936, 20001])
def test_gumbel_block_screen_is_exact(sampling_kernels, vocab, temperature, dtype):
    dev = sampling_kernels.device
    gen = case_generator(dev, vocab, temperature)
    b = 12
    seeds = [77 + 31 * i for i in range(b)]
    positions = [i % 7 for i in range(b)]
    x = _pilot_stress_rows(vocab, b, gen, dev).to(dtype).contiguous()
    for sample, got in enumerate(_assert_gumbel_exact(sampling_kernels, x, temperature, seeds, positions)):
        # each row alone gives the same token (batch invariance through the screen)
        for r in (0, 4, 5):
            one = _gumbel_tokens(sampling_kernels, x[r:r + 1].contiguous(), temperature, seeds[r:r + 1],
                                 positions[r:r + 1], sample)
            assert int(one[0]) == int(got[r])


@pytest.mark.parametrize("vocab", [8192 + 4 * (224 + 8) - 1, 8192 + 4 * (224 + 8) + 3, 2 * 8192 + 37, 1500])
@pytest.mark.parametrize("top_k", [15, 50, 120, 200])
def test_topk_warp_threshold_matches_reference(cuda_backend, cpu_backend, vocab, top_k):
    """The chunk threshold (min over warps of each warp's (K/8)-th thread maximum, K <= 128):
    partial last chunks around the size where a warp holds fewer than K/8 tokens, the top-k inside
    the partial chunk, masked rows with fewer finite tokens than k, and ties."""
    gen = torch.Generator().manual_seed(vocab + top_k)
    b = 8
    x = torch.randn(b, vocab, generator=gen)
    tail = vocab - (vocab % 8192 or 8192)
    x[0, tail:] += 15.0  # the whole top-k in the partial chunk
    x[1] = float("-inf")
    x[1, torch.randperm(vocab, generator=gen)[:7]] = torch.randn(7, generator=gen)  # fewer than k finite
    x[2, ::3] = 4.0  # ties across every warp
    x[3, : min(vocab, 300)] += 12.0  # crowded into warp 0 of the first chunk
    batch = make_batch(x, num_samples=3, top_k=top_k, top_p=0.95)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.valid, want.valid)
    assert int((got.tokens != want.tokens).sum()) <= 1
