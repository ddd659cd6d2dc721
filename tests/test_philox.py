"""Philox4x32-10 against the published known-answer vectors, and the Gumbel noise built on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from tokensampler_server.backends.philox import gumbel_from_words, philox4x32, random_words

# Random123's known-answer vectors for philox4x32-10: (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_known_answer_vectors(counter, key, expected) -> None:
    words = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
    assert tuple(int(w) for w in words) == expected


def test_word_layout_follows_the_contract() -> None:
    """Token i uses word i mod 4 of counter (i div 4, position, iteration, sample), key = seed halves."""
    seed = 0x0123456789ABCDEF
    words = random_words(torch.tensor([seed]), torch.tensor([7]), torch.tensor([3]), 2, 10)
    key = (torch.tensor([seed & 0xFFFFFFFF]), torch.tensor([seed >> 32]))
    for token in range(10):
        counter = tuple(torch.tensor([v]) for v in (token // 4, 7, 3, 2))
        assert int(words[0, token]) == int(philox4x32(counter, key)[token % 4])


def test_negative_int64_seeds_are_the_same_uint64_bits() -> None:
    unsigned = 2**64 - 5
    a = random_words(torch.tensor([unsigned - 2**64]), torch.tensor([0]), torch.tensor([0]), 0, 8)
    key = (torch.tensor([unsigned & 0xFFFFFFFF]), torch.tensor([unsigned >> 32]))
    b = torch.stack(philox4x32(tuple(torch.tensor([v]) for v in (1, 0, 0, 0)), key)).flatten()
    assert a[0, 4:].tolist() == b.tolist()


def test_gumbel_is_finite_at_both_ends_of_u() -> None:
    """The extreme words give finite noise: u never rounds to 0 or 1."""
    words = torch.tensor([0, 255, (1 << 31) - 1, 1 << 31, 0xFFFFFF00, 0xFFFFFFFF], dtype=torch.int64)
    g = gumbel_from_words(words)
    assert torch.isfinite(g).all()
    u = ((words >> 8).double() + 0.5) * 2.0**-24
    torch.testing.assert_close(g.double(), -torch.log(-torch.log(u)), rtol=1e-6, atol=1e-6)


def test_gumbel_noise_is_gumbel_distributed() -> None:
    words = random_words(torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 0, 25_000)
    g = gumbel_from_words(words).flatten().double().numpy()
    _, p_value = stats.kstest(g, stats.gumbel_r.cdf)
    assert p_value >= 1e-3
    assert np.isfinite(g).all()
