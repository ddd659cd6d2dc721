"""csrc/philox.cuh against the torch reference (backends/philox.py): words bit-identical in both product forms, noise
close."""

from __future__ import annotations

import pytest
import torch

from tokensampler_server.backends.philox import gumbel_noise, random_words

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


@pytest.mark.parametrize("split_products", [False, True], ids=["wide_products", "split_products"])
@pytest.mark.parametrize("seed,position,iteration,sample", [(0, 0, 0, 0), (2**64 - 1, 7, 3, 1), (123456789012345, 2**32 - 1, 11, 5)])
def test_words_and_noise_match_reference(cuda_backend, seed, position, iteration, sample, split_products):
    vocab = 100_003  # not a multiple of 4: the last Philox group is partial
    seed_bits = seed - 2**64 if seed >= 2**63 else seed
    words, noise = cuda_backend._kernels.noise(seed_bits, position, iteration, sample, vocab, split_products)
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    ref_words = random_words(t(seed_bits), t(position), t(iteration), sample, vocab)[0]
    ref_noise = gumbel_noise(t(seed_bits), t(position), t(iteration), sample, vocab)[0]
    assert torch.equal(words.cpu(), ref_words)
    noise = noise.cpu()
    assert torch.isfinite(noise).all()
    # logf/log1pf on the GPU and torch's on the CPU differ in the last bit now and then, never more.
    assert torch.allclose(noise, ref_noise, rtol=4e-7, atol=4e-7)
