"""filter_kernel's cut-range resolution against the CPU reference.

Where the cut bin's winner beats the bins above it (often on spiky rows under top-p), or a top-k above the largest
bucket cuts inside a bin, the row's last block re-reads the row and collects the tokens of the cut range, testing
the exact z only for logits inside an interval derived from the bins (sampling.cuh, logits_of_bins). These rows put
that interval's ends far from the origin, near the bins' ends, and at extreme temperatures: a token the interval
missed would change the kept set and the token drawn.
"""

from __future__ import annotations

import pytest
import torch

from .agreement import assert_tokens_agree
from .conftest import logits, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ROWS, SAMPLES = 16, 4  # below 32 rows, top-p without k takes stats + filter (backends/cuda.py)


@pytest.mark.parametrize("shift,scale,temperature", [
    (0.0, 1.0, 1.0),
    (1e4, 1.0, 1.0),        # |max| dwarfs the bins' width: the ends' rounding
    (-3e4, 1.0, 0.05),
    (0.0, 1e-3, 1.0),       # every logit within a few hundredths: bins ~2e-5 wide in x
    (50.0, 3.0, 40.0),      # T far above the spread
])
@pytest.mark.parametrize("params", [{"top_k": 1000}, {"top_p": 0.9}, {"top_k": 300, "top_p": 0.8},
                                    {"top_p": 0.995, "min_p": 1e-4}])
def test_cut_range_resolution_matches_reference(cuda_backend, cpu_backend, shift, scale, temperature, params):
    x = logits("spiky", ROWS, 151936, seed=17) * scale + shift
    batch = make_batch(x, num_samples=SAMPLES, seed=23, temperature=temperature, **params)
    resolved_before = cuda_backend.fallbacks()["in_kernel"]
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert_tokens_agree(x, batch, got, want)
    if "top_k" in params:  # a top-k above the largest bucket always resolves its cut range
        assert cuda_backend.fallbacks()["in_kernel"] > resolved_before


@pytest.mark.parametrize("rows", [8, 272])  # several blocks a row (cut_collect_kernel), and one (the filter's re-read)
@pytest.mark.parametrize("samples", [1, 8])  # the filter, and the cut route
@pytest.mark.parametrize("params", [{"top_k": 151936 // 2, "top_p": 0.5}, {"top_k": 100000, "top_p": 0.2},
                                    {"top_k": 40000, "top_p": 0.7, "min_p": 1e-4}])
def test_a_cut_range_in_two_pieces_matches_reference(cuda_backend, cpu_backend, rows, samples, params):
    """On flat rows top-p's cut lies tens of thousands of tokens above the k cut's bin: the range between is
    collected as two pieces (top-p's bins and the k cut's bin, the bins between kept whole), not by crowded radix
    passes. Every token agrees with the reference, and no row leaves the kernels."""
    x = logits("flat", rows, 151936, seed=29)
    batch = make_batch(x, num_samples=samples, seed=41, **params)
    before = cuda_backend.fallbacks()["exact_rows"]
    got, want = cuda_backend.sample(batch), cpu_backend.sample(batch)
    assert cuda_backend.fallbacks()["exact_rows"] == before
    assert got.valid.all()
    assert_tokens_agree(x, batch, got, want)
