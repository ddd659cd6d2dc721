"""Fixtures of the GPU tests: the CUDA backend, the CPU reference, the in-process API, and batch builders."""

from __future__ import annotations

import pytest
import torch

from tokensampler_server.inprocess import LocalSampler
from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch, SamplingResult

from .agreement import assert_tokens_agree

MODES: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0},
    "gumbel": {"temperature": 1.0},
    "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "top_k": {"temperature": 1.0, "top_k": 50},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
    "top_p_min_p": {"temperature": 0.7, "top_p": 0.8, "min_p": 0.02},
    "large_k": {"temperature": 1.0, "top_k": 1000, "top_p": 0.95},
    "top_k_min_p": {"temperature": 1.3, "top_k": 200, "min_p": 0.1},
}


def logits(generator: str, num_rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """spiky: randn + 50 spikes in U(10, 30) (fewer for small V); flat: randn. On the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g)
    if generator == "spiky":
        spikes = min(50, vocab)
        idx = torch.randint(0, vocab, (num_rows, spikes), generator=g)
        x.scatter_(1, idx, torch.rand(num_rows, spikes, generator=g) * 20 + 10)
    return x.to(dtype)


def make_batch(x: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               seed: int = 1234, num_samples: int = 1, return_logprobs: bool = False,
               logprobs_mode: LogprobsMode = LogprobsMode.RAW, top_logprobs: int = 0, processing=None,
               positions: torch.Tensor | None = None) -> SamplingBatch:
    b = x.shape[0]
    seeds = torch.arange(b, dtype=torch.int64) * 7919 + seed
    return SamplingBatch(
        logits=x, temperature=torch.full((b,), temperature, dtype=torch.float32),
        top_k=torch.full((b,), top_k, dtype=torch.int32), top_p=torch.full((b,), top_p, dtype=torch.float32),
        min_p=torch.full((b,), min_p, dtype=torch.float32), seed=seeds,
        position=positions if positions is not None else torch.arange(b, dtype=torch.int64) % 97,
        iteration=torch.full((b,), 3, dtype=torch.int64), num_samples=num_samples, processing=processing,
        return_logprobs=return_logprobs, logprobs_mode=logprobs_mode, top_logprobs=top_logprobs)


def assert_logprobs_match(batch: SamplingBatch, got: SamplingResult, want: SamplingResult) -> None:
    """The log-probs of a CUDA result against the CPU reference's for `batch` (no processing): tokens that differ
    only on a rounding edge of the reference's scores (agreement.py), the same log-probs where the tokens are the
    same, and the same top log-prob ids and log-probs in every row (1e-4)."""
    assert_tokens_agree(batch.logits, batch, got, want)
    same = (got.tokens == want.tokens).all(dim=1)
    torch.testing.assert_close(got.logprobs[same], want.logprobs[same], rtol=1e-4, atol=1e-4, equal_nan=True)
    assert torch.equal(got.top_logprob_ids, want.top_logprob_ids)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)


def rows_of_kind(kind: str, b: int, vocab: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """Rows that test the exact routes: spiky (randn + 50 spikes), flat (randn), tight (up to 3000 tokens
    within 1e-3 of each other at the top), plateau (every third logit 4.0), near_equal (5 + 1e-6 randn)."""
    x = torch.randn(b, vocab, device=dev, generator=gen)
    if kind == "spiky":  # ids drawn with replacement: any vocab
        x.scatter_(1, torch.randint(0, vocab, (b, 50), device=dev, generator=gen),
                   torch.rand(b, 50, device=dev, generator=gen) * 20 + 10)
    elif kind == "tight":  # many tokens within the screen's margins of each other
        x.scatter_(1, torch.randint(0, vocab, (b, 3000), device=dev, generator=gen),
                   6.0 + torch.rand(b, 3000, device=dev, generator=gen) * 1e-3)
    elif kind == "plateau":  # equal logits: the noise and the lowest ids decide
        x[:, ::3] = 4.0
    elif kind == "near_equal":
        x = 5.0 + 1e-6 * x
    return x


def case_generator(dev: torch.device, vocab: int, temperature: float, scale: int = 10) -> torch.Generator:
    """A generator on `dev` seeded by a case's vocabulary size and temperature (vocab + int(scale * T)): each case
    draws rows of its own."""
    return torch.Generator(device=dev).manual_seed(vocab + int(scale * temperature))


def rows_of_every_kind(b: int, vocab: int, temperature: float, dev: torch.device):
    """(kind, dtype, rows) for every kind of rows_of_kind, each in fp32 and in bf16 (contiguous), drawn from the
    case_generator of (vocab, temperature)."""
    gen = case_generator(dev, vocab, temperature)
    for kind in ("spiky", "flat", "tight", "plateau", "near_equal"):
        x = rows_of_kind(kind, b, vocab, gen, dev)
        for dtype in (torch.float32, torch.bfloat16):
            yield kind, dtype, x.to(dtype).contiguous()


def degenerate_rows(num_rows: int, vocab: int, device: torch.device,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """randn rows (num_rows >= 3, vocab > 12345) but for three: 0 has no finite logit, 1 a NaN every 7th
    token (read as -inf), 2 a single finite logit, at id 12345."""
    x = torch.randn(num_rows, vocab, device=device, generator=generator)
    x[0] = float("-inf")
    x[1, ::7] = float("nan")
    x[2, :] = float("-inf")
    x[2, 12345] = 1.0
    return x


def exact_gumbel_argmax(kernels, x: torch.Tensor, temperature: float, seeds, positions, sample: int,
                        iteration: int = 3, min_p=None) -> torch.Tensor:
    """Per row, the argmax of the exact score z + g (g from the kernels' own noise) over the tokens min-p keeps
    (expf(z) >= min_p[row], when given), lowest id on ties; -1 for a row without a finite logit."""
    out = []
    for r in range(x.shape[0]):
        row = x[r].float()
        row = torch.where(torch.isnan(row) | torch.isposinf(row), float("-inf"), row)
        if not bool(torch.isfinite(row).any()):
            out.append(-1)
            continue
        _, g = kernels.noise(seeds[r], positions[r], iteration, sample, x.shape[1])
        z = (row - row.max()) / torch.tensor(temperature, dtype=torch.float32, device=x.device)
        score = z + g
        if min_p is not None:
            score = torch.where(torch.exp(z) >= min_p[r], score, float("-inf"))
        out.append(int(torch.argmax(score)))  # first maximum: the lowest id on ties
    return torch.tensor(out)


@pytest.fixture(autouse=True)
def stays_on_its_route(request):
    """Every test that samples on the CUDA backend, unless marked exact_rows: no row a fast kernel should settle
    was handed to the exact filter. A kernel that flags its rows would otherwise pass its agreement tests on another
    kernel's answers."""
    if "cuda_backend" not in request.fixturenames or request.node.get_closest_marker("exact_rows") is not None:
        yield
        return
    backend = request.getfixturevalue("cuda_backend")
    before = backend.fallbacks()["exact_rows"]
    yield
    assert backend.fallbacks()["exact_rows"] == before, "a fast kernel handed rows to the exact filter"


@pytest.fixture(scope="session")
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tokensampler_server.backends.cuda import CudaBackend

    return CudaBackend(0)


@pytest.fixture(scope="session")
def sampling_kernels(cuda_backend):
    """The CUDA backend's sampling kernels, called directly."""
    return cuda_backend._kernels


@pytest.fixture(scope="session")
def cpu_backend():
    from tokensampler_server.backends.cpu import CpuBackend

    return CpuBackend()


@pytest.fixture(scope="session")
def sampler() -> LocalSampler:
    """The in-process API on the first GPU (prepared calls and the calls they are held equal to)."""
    return LocalSampler("cuda:0")


def row_seeds(rows: int) -> list[int]:
    """A distinct seed a row, for tests that sample the same rows two ways."""
    return [7919 * r + 11 for r in range(rows)]
