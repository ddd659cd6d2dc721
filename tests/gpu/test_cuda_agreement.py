"""The CUDA backend against the CPU reference on the same requests (the agreement matrix).

Greedy must agree exactly. Sampled modes may differ only on a rounding edge of the reference's scores
(agreement.py), and the last test checks that over the whole matrix >= 99.9% of tokens are identical.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from .agreement import assert_tokens_agree
from .conftest import MODES, logits, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

SHAPES = [(2, 1000), (3, 64), (1000, 1000), (32000, 64), (151936, 3), (262144, 1)]  # (V, B)
SAMPLES = 4
_tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])


def _cases():
    for vocab, rows in SHAPES:
        for generator in ("spiky", "flat"):
            for mode in MODES:
                yield vocab, rows, generator, mode, torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        for vocab, rows in [(3, 64), (1000, 1000), (151936, 3)]:
            for mode in ("greedy", "gumbel", "top_k_top_p", "top_p", "min_p"):
                yield vocab, rows, "spiky", mode, dtype


@pytest.mark.parametrize("vocab,rows,generator,mode,dtype", list(_cases()))
def test_agrees_with_cpu_reference(cuda_backend, cpu_backend, vocab, rows, generator, mode, dtype):
    x = logits(generator, rows, vocab, seed=vocab * 31 + rows, dtype=dtype)
    batch = make_batch(x, num_samples=SAMPLES, seed=vocab + rows, **MODES[mode])
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert torch.equal(got.valid, want.valid)
    assert torch.equal(got.nan_detected, want.nan_detected)
    assert got.tokens.shape == want.tokens.shape == (rows, SAMPLES)
    assert ((got.tokens >= 0) & (got.tokens < vocab)).all()
    mismatches = assert_tokens_agree(x, batch, got, want)
    _tally[mode][0] += mismatches
    _tally[mode][1] += got.tokens.numel()


def test_agreement_rate_over_the_matrix():
    if not _tally:
        pytest.skip("the agreement cases did not run")
    for mode, (mismatches, total) in _tally.items():
        assert 1 - mismatches / total >= 0.999, f"{mode}: {mismatches} of {total} tokens differ"
