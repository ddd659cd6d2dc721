"""Philox4x32-10 and the per-token Gumbel noise of docs/semantics.md, vectorised in torch.

The noise of token i in a row is a pure function of (seed, position, iteration, sample, i): key =
(seed low 32 bits, seed high 32 bits), counter = (i div 4, position, iteration, sample), word
output[i mod 4]. csrc/philox.cuh computes the same numbers on the GPU.

torch has no unsigned 32-bit arithmetic that covers multiplication, so the words are held in int64
tensors with values in [0, 2^32) and the 32x32 -> 64-bit products are split into 16-bit halves.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_ROUNDS = 10


def _mul_hi_lo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * m for a in [0, 2^32) and a 32-bit constant m."""
    p_lo = a * (m & 0xFFFF)  # < 2^48
    p_hi = a * (m >> 16)  # < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # a * m == (p_hi >> 16) * 2^32 + t
    return (p_hi >> 16) + (t >> 32), t & _MASK32


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Salmon et al., 2011) on broadcastable int64 tensors holding uint32 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(_ROUNDS):
        if round_index:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mul_hi_lo(c0, _PHILOX_M0)
        hi1, lo1 = _mul_hi_lo(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def seed_key(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits int64 seeds (uint64 bits) into the Philox key words (low, high)."""
    return seed & _MASK32, (seed >> 32) & _MASK32


def random_words(
    seed: torch.Tensor, position: torch.Tensor, iteration: torch.Tensor, sample: int, vocab_size: int,
    vocab_offset: int = 0,
) -> torch.Tensor:
    """The Philox word of tokens vocab_offset .. vocab_offset + vocab_size - 1: int64 [B, vocab_size] with values
    in [0, 2^32). A vocabulary shard passes its first token's global id, so that it draws the words of its tokens.

    seed, position, iteration: int64 [B].
    """
    first_block = vocab_offset // 4
    num_blocks = (vocab_offset + vocab_size + 3) // 4 - first_block
    block = torch.arange(first_block, first_block + num_blocks, dtype=torch.int64, device=seed.device).unsqueeze(0)
    k0, k1 = seed_key(seed.unsqueeze(1))
    words = philox4x32(
        (
            block,
            (position & _MASK32).unsqueeze(1),
            (iteration & _MASK32).unsqueeze(1),
            torch.full_like(block, sample & _MASK32),
        ),
        (k0, k1),
    )
    # Word i mod 4 of block i div 4: interleave the four outputs along the vocabulary.
    skip = vocab_offset - 4 * first_block
    return torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(1)[:, skip:skip + vocab_size]


def gumbel_from_words(words: torch.Tensor) -> torch.Tensor:
    """g = -log(-log(u)), u = ((word >> 8) + 0.5) * 2^-24, as float32.

    u's top half (u >= 1/2) is not representable in fp32 (25 significant bits): rounding there can
    give u == 1 and g == +inf. So -log(u) is computed from the exact fp32 value of 1 - u on that half
    (-log1p(-(1 - u))) and from u itself on the lower half, where u is exact.
    """
    bits24 = words >> 8
    upper = bits24 >= (1 << 23)
    u = (bits24.to(torch.float32) + 0.5) * 2.0**-24  # exact where not upper
    one_minus_u = ((1 << 24) - bits24).to(torch.float32).sub_(0.5).mul_(2.0**-24)  # exact where upper
    neg_log_u = torch.where(upper, -torch.log1p(-one_minus_u), -torch.log(u))
    return -torch.log(neg_log_u)


def gumbel_noise(
    seed: torch.Tensor, position: torch.Tensor, iteration: torch.Tensor, sample: int, vocab_size: int,
    vocab_offset: int = 0,
) -> torch.Tensor:
    """Gumbel(0, 1) noise of tokens vocab_offset .. vocab_offset + vocab_size - 1 of every row: float32
    [B, vocab_size]."""
    return gumbel_from_words(random_words(seed, position, iteration, sample, vocab_size, vocab_offset))


def gumbel_noise_at(
    seed: torch.Tensor, position: torch.Tensor, iteration: torch.Tensor, sample: int, tokens: torch.Tensor
) -> torch.Tensor:
    """The same noise as gumbel_noise, only at the given token ids: float32 [R, K] for tokens int64 [R, K]
    (seed, position, iteration: int64 [R]). Lets a row draw only where its kept set is."""
    k0, k1 = seed_key(seed.unsqueeze(1))
    words = philox4x32(
        (
            tokens >> 2,
            (position & _MASK32).unsqueeze(1),
            (iteration & _MASK32).unsqueeze(1),
            torch.full_like(tokens, sample & _MASK32),
        ),
        (k0, k1),
    )
    # Word i mod 4 of block i div 4, as in random_words.
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    return gumbel_from_words(stacked.gather(-1, (tokens & 3).unsqueeze(-1)).squeeze(-1))


def counter_uniforms(
    seed: torch.Tensor, block: int, position: torch.Tensor, iteration: torch.Tensor, sample: int
) -> torch.Tensor:
    """u = ((word >> 8) + 0.5) * 2^-24 of word 0 of counter (block, position, iteration, sample), kept exact in
    float64 (its 25 significant bits, where float32 would round the upper half and could give u = 1).

    seed, position, iteration: int64, broadcastable; block and sample: constant counter words that no token's
    noise uses (docs/semantics.md gives each stream's). Returns the broadcast shape of the inputs.
    """
    seed, position, iteration = torch.broadcast_tensors(seed, position, iteration)
    word = philox4x32(
        (torch.full_like(position, block & _MASK32), position & _MASK32, iteration & _MASK32,
         torch.full_like(position, sample & _MASK32)),
        seed_key(seed),
    )[0]
    return ((word >> 8).to(torch.float64) + 0.5) * 2.0**-24
