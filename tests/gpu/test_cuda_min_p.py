"""The min-p route (min-p alone: stats_kernel, then gumbel_kernel over the tokens min-p keeps, MinPMask in
csrc/sampling.cuh) against the binned exact filter and against Gumbel-max computed here.

Every route is exact, so tokens must agree bit for bit: on spiky, flat, tight, plateau and near-equal
rows, bf16 input, vocabularies that end inside a chunk, temperatures from tiny to huge, logits far from 0,
and rows with tokens placed a few ulps either side of the min-p floor, where the mask's two floors leave
the decision to the exact test expf(z) >= m.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokensampler_server.backends.cuda_kernels import Outputs, RowParams

from .conftest import degenerate_rows, exact_gumbel_argmax, make_batch, rows_of_every_kind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

MIN_PS = (0.05, 0.02, 0.3, 0.9, 1.0, 1e-30)


def _params(b: int, dev: torch.device, temperature: float, min_p: list[float]) -> RowParams:
    return RowParams(torch.full((b,), temperature, dtype=torch.float32, device=dev),
                     torch.zeros(b, dtype=torch.int32, device=dev), torch.ones(b, dtype=torch.float32, device=dev),
                     torch.tensor(min_p, dtype=torch.float32, device=dev),
                     torch.arange(b, dtype=torch.int64, device=dev) * 7919 + 5,
                     torch.arange(b, dtype=torch.int64, device=dev) % 13,
                     torch.full((b,), 2, dtype=torch.int64, device=dev))


def _both_routes(kernels, x: torch.Tensor, params: RowParams, samples: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens of the min-p route, tokens of stats + filter), [B, samples] each; flags must agree."""
    b, dev = x.shape[0], x.device
    outs = []
    for use_mask in (True, False):
        pre = Outputs.row_stats(b, dev)
        out = Outputs(tokens=torch.full((b, samples), -7, dtype=torch.int64, device=dev),
                      flags=torch.empty(b, dtype=torch.uint8, device=dev))
        for sample in range(samples):
            kernels.stats(x, params, pre)
            if use_mask:
                kernels.min_p(x, params, pre, out, sample)
            else:
                kernels.filter(x, params, pre, out, sample)
        outs.append(out)
    assert torch.equal(outs[0].flags, outs[1].flags)
    return outs[0].tokens.cpu(), outs[1].tokens.cpu()


def _exact_min_p_sample(kernels, x: torch.Tensor, params: RowParams, sample: int) -> torch.Tensor:
    """The min-p sample of every row from the kernels' noise (_params: one temperature and iteration)."""
    return exact_gumbel_argmax(kernels, x, float(params.temperature[0]), params.seed.tolist(),
                               params.position.tolist(), sample, iteration=int(params.iteration[0]),
                               min_p=params.min_p.tolist())


@pytest.mark.parametrize("vocab", [151936, 32003, 262144, 1000, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.4, 2.5])
def test_min_p_route_matches_filter(sampling_kernels, vocab, temperature):
    dev = sampling_kernels.device
    b = 24
    params = _params(b, dev, temperature, [MIN_PS[i % len(MIN_PS)] for i in range(b)])
    for kind, dtype, x in rows_of_every_kind(b, vocab, temperature, dev):
        got, want = _both_routes(sampling_kernels, x, params)
        assert torch.equal(got, want), f"{kind} {dtype}: rows {(got != want).any(1).nonzero().flatten().tolist()}"


def test_tokens_at_the_floor(sampling_kernels):
    """Tokens a few ulps either side of x = M + T log m (and of the floors the mask derives from it, a
    delta away in z), at several temperatures and magnitudes of M: the exact test decides them, and the
    token drawn is the exact Gumbel-max over the kept set."""
    dev = sampling_kernels.device
    gen = torch.Generator(device=dev).manual_seed(5)
    b, vocab, m = 16, 40000, 0.05
    for temperature, scale in ((1.0, 1.0), (0.05, 1.0), (3.0, 100.0), (1.0, 1000.0)):
        x = torch.randn(b, vocab, device=dev, generator=gen) * scale - 20.0 * scale
        row_max = torch.linspace(-5.0, 5.0, b, device=dev) * scale
        x[:, 7] = row_max
        floor = row_max + temperature * math.log(m)
        idx = torch.randperm(vocab - 8, device=dev, generator=gen)[:4000] + 8
        steps = torch.arange(-2000, 2000, device=dev, dtype=torch.int32)  # ulps either side of the floor
        x[:, idx] = (floor.unsqueeze(1).view(torch.int32) + steps).view(torch.float32)
        # and tokens about the mask's own floors, delta (in z) either side (MinPMask)
        delta = 1e-3 + 2.0 ** -16 * (row_max.abs() / temperature + abs(math.log(m)))
        offsets = torch.linspace(-2, 2, 200, device=dev)
        x[:, idx[:200]] = floor.unsqueeze(1) + (temperature * delta).unsqueeze(1) * offsets
        params = _params(b, dev, temperature, [m] * b)
        got, want = _both_routes(sampling_kernels, x, params, samples=2)
        assert torch.equal(got, want), f"T={temperature}: rows {(got != want).any(1).nonzero().flatten().tolist()}"
        for sample in range(2):
            exact = _exact_min_p_sample(sampling_kernels, x, params, sample)
            assert torch.equal(got[:, sample], exact), f"T={temperature} sample {sample}"


def test_extreme_rows(sampling_kernels):
    """No finite logit, NaN and +inf (treated as -inf), one finite logit, |M| huge, T tiny and huge."""
    dev = sampling_kernels.device
    b, vocab = 8, 20000
    x = degenerate_rows(b, vocab, dev)
    x[3, ::5] = float("inf")
    x[4] *= 3e4
    x[5] = x[5] * 1e-30
    params = _params(b, dev, 1.0, [0.1] * b)
    got, want = _both_routes(sampling_kernels, x, params)
    assert torch.equal(got, want)
    assert got[0].tolist() == [-1, -1] and got[2].tolist() == [12345, 12345]
    for temperature in (1e-6, 1e-4, 1e4, 1e20):
        params = _params(b, dev, temperature, [0.1, 0.5, 1e-20, 0.99, 0.05, 0.2, 1.0, 1e-3])
        got, want = _both_routes(sampling_kernels, x, params)
        assert torch.equal(got, want), f"T={temperature}: rows {(got != want).any(1).nonzero().flatten().tolist()}"
        assert torch.equal(got[:, 1], _exact_min_p_sample(sampling_kernels, x, params, 1)), f"T={temperature}"


def test_backend_routes_min_p_alone_through_the_mask(cuda_backend, cpu_backend, monkeypatch):
    """A batch of min-p rows without k or top-p takes the mask route (the route planner sends its rows to min_p, not
    to filter_kernel) and agrees with the CPU reference on nearly every token."""
    kernels = cuda_backend._kernels
    plans: list = []
    original = kernels.plan
    monkeypatch.setattr(kernels, "plan", lambda *a, **k: plans.append(original(*a, **k)) or plans[-1])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32000, generator=gen)
    batch = make_batch(x, min_p=0.05, num_samples=2)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert [(p.exact, p.exact_route) for p in plans] == [((-1, 64), kernels.module.EXACT_MIN_P)]
    assert float((got.tokens == want.tokens).float().mean()) >= 0.999
