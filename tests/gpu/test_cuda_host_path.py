"""The CUDA backend's host path (one packed upload, row groups decided on the host, reused buffers, one
download): mixed batches, buffer reuse across shapes, logits on either side, and recovery after an error.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokensampler_server.backends.cuda import select_rows
from tokensampler_server.model.sampling import LogprobsMode, SamplingBatch

from .conftest import MODES, assert_logprobs_match, logits, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

NAMES = list(MODES)


def mixed_batch(x: torch.Tensor, *, num_samples: int = 1, offset: int = 0, **extra) -> SamplingBatch:
    """Rows cycling through every mode of MODES (greedy, unfiltered, top-k buckets, exact filter)."""
    b = x.shape[0]
    modes = [NAMES[(i + offset) % len(NAMES)] for i in range(b)]

    def per_row(key: str, default: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([MODES[m].get(key, default) for m in modes], dtype=dtype)

    base = make_batch(x, num_samples=num_samples, **extra)
    return replace(base, temperature=per_row("temperature", 1.0, torch.float32), top_k=per_row("top_k", 0, torch.int32),
                   top_p=per_row("top_p", 1.0, torch.float32), min_p=per_row("min_p", 0.0, torch.float32))


@pytest.mark.parametrize("rows", [7, 150])  # the Python-loop grouping and the torch grouping
@pytest.mark.parametrize("num_samples", [1, 3])
def test_mixed_batch_matches_reference_and_rows_alone(cuda_backend, cpu_backend, rows, num_samples):
    x = logits("spiky", rows, 1000, seed=rows)
    x[1] = float("-inf")
    x[2, 3] = float("nan")
    batch = mixed_batch(x, num_samples=num_samples)
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.valid, want.valid)
    assert torch.equal(got.nan_detected, want.nan_detected)
    assert int((got.tokens != want.tokens).sum()) <= 1
    for part in ([0], [4, 1, 2], list(range(rows - 5, rows))):
        alone = cuda_backend.sample(select_rows(batch, torch.tensor(part)))
        assert torch.equal(alone.tokens, got.tokens[part])


@pytest.mark.parametrize("logprobs_mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
def test_mixed_batch_logprobs_match_reference(cuda_backend, cpu_backend, logprobs_mode):
    """Greedy rows with filters go through the filter kernels too in PROCESSED mode (choice 6)."""
    x = logits("spiky", 24, 1000, seed=9)
    x[5] = float("-inf")
    batch = mixed_batch(x, num_samples=2, return_logprobs=True, top_logprobs=4, logprobs_mode=logprobs_mode)
    batch = replace(batch, top_k=torch.where(batch.temperature == 0, 20, batch.top_k).to(torch.int32))
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert_logprobs_match(batch, got, want)


def test_buffers_reused_across_shapes(cuda_backend):
    """Growing and shrinking B and the sample count between calls gives the same results as before."""
    big = logits("spiky", 300, 2000, seed=1)
    first = {}
    for rows, ns in ((300, 2), (1, 1), (64, 4), (300, 2), (8, 1), (1, 1), (64, 4), (8, 1)):
        batch = mixed_batch(big[:rows].contiguous(), num_samples=ns, offset=rows)
        tokens = cuda_backend.sample(batch).tokens
        if (rows, ns) in first:
            assert torch.equal(tokens, first[(rows, ns)])
        first[(rows, ns)] = tokens


@pytest.mark.parametrize("mode", ["greedy", "gumbel", "top_k_top_p", "top_p"])
def test_logits_on_the_gpu_equal_logits_on_the_cpu(cuda_backend, mode):
    x = logits("spiky", 8, 151936, seed=4)
    batch = make_batch(x, num_samples=2, **MODES[mode])
    on_cpu = cuda_backend.sample(batch)
    on_gpu = cuda_backend.sample(replace(batch, logits=x.cuda()))
    strided = cuda_backend.sample(replace(batch, logits=x.cuda().t().contiguous().t()))
    assert torch.equal(on_cpu.tokens, on_gpu.tokens) and torch.equal(on_cpu.tokens, strided.tokens)
    assert torch.equal(on_cpu.valid, on_gpu.valid) and torch.equal(on_cpu.nan_detected, on_gpu.nan_detected)


def test_result_tensors_are_not_reused(cuda_backend):
    """Returned tensors must not alias the reused pinned buffers."""
    x = logits("spiky", 4, 1000, seed=2)
    first = cuda_backend.sample(make_batch(x, **MODES["gumbel"]))
    kept = first.tokens.clone()
    cuda_backend.sample(make_batch(x, seed=99, **MODES["gumbel"]))
    assert torch.equal(first.tokens, kept)


def test_a_failed_call_leaves_the_backend_usable(cuda_backend):
    x = logits("spiky", 4, 1000, seed=3)
    with pytest.raises(ValueError):
        cuda_backend.sample(make_batch(x.to(torch.float64), **MODES["top_k_top_p"]))
    batch = make_batch(x, **MODES["top_k_top_p"])
    assert torch.equal(cuda_backend.sample(batch).tokens, cuda_backend.sample(batch).tokens)
