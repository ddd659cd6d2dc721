"""The local samplers of docs/semantics.md written again, plainly, in numpy and Python: the tests' oracle.

Nothing here calls the code under test. Loops follow the contract's words (and llama.cpp's), not the
vectorised forms of tokensampler_server.backends (sequence_samplers.py, truncation.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MASK32 = 0xFFFFFFFF
DRY_MAX_REPEAT = 50


def philox4x32(counter: Sequence[int], key: Sequence[int]) -> list[int]:
    """Philox4x32-10 of one counter under one key (Salmon et al., 2011), in Python integers."""
    c = list(counter)
    k0, k1 = key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & MASK32, (p0 >> 32) ^ c[3] ^ k1, p0 & MASK32]
    return c


def xtc_acts(seed: int, position: int, iteration: int, probability: float) -> bool:
    """XTC's coin: counter (0xFFFFFFFE, position, iteration, 0xFFFFFFFF), word 0, u < probability."""
    word = philox4x32((0xFFFFFFFE, position, iteration, 0xFFFFFFFF), (seed & MASK32, seed >> 32))[0]
    u = ((word >> 8) + 0.5) / 2**24
    return u < float(np.float32(probability))


def ngram_bans(sequence: Sequence[int], n: int) -> set[int]:
    size = len(sequence)
    prefix = list(sequence[size - n + 1:]) if n > 1 else []
    return {sequence[p + n - 1] for p in range(size - n + 1) if list(sequence[p:p + n - 1]) == prefix}


def dry_penalties(sequence: Sequence[int], multiplier: float, base: float, allowed: int, last_n: int,
                  breakers: Sequence[Sequence[int]]) -> dict[int, np.float32]:
    """{token: penalty} of one row, as llama.cpp's DRY with repeats counted up to 50."""
    window = list(sequence[-last_n:]) if last_n > 0 else list(sequence)
    size = len(window)
    limit = size
    for start in range(size - 1, -1, -1):  # the latest start of a complete breaker
        fits = [b for b in breakers if start + len(b) <= size and window[start:start + len(b)] == list(b)]
        if fits:
            limit = size - (start + max(len(b) for b in fits))
            break
    cap = min(limit, DRY_MAX_REPEAT)
    longest: dict[int, int] = {}
    for j in range(size - 1):
        length = 0
        while length < cap and j - length >= 0 and window[j - length] == window[size - 1 - length]:
            length += 1
        if length >= allowed:
            token = window[j + 1]
            longest[token] = max(longest.get(token, 0), length)
    singles = {b[0] for b in breakers if len(b) == 1}
    return {t: np.float32(np.float64(np.float32(multiplier)) * np.float64(np.float32(base)) ** (length - allowed))
            for t, length in longest.items() if t not in singles}


def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    e = np.exp(x[finite] - x[finite].max())
    out[finite] = e / e.sum()
    return out


def top_n_sigma(x: np.ndarray, n: float) -> np.ndarray:
    if n <= 0:
        return x
    finite = x[np.isfinite(x)]
    return np.where(x < finite.max() - n * finite.std(), -np.inf, x)


def typical(x: np.ndarray, p: float) -> np.ndarray:
    if p >= 1:
        return x
    q = _softmax(x)
    finite = np.isfinite(x)
    log_q = np.where(finite, np.log(np.where(finite, q, 1.0)), -np.inf)
    entropy = -np.sum(q[finite] * log_q[finite])
    score = np.where(finite, np.abs(-log_q - entropy), np.inf)
    order = sorted(range(len(x)), key=lambda i: (score[i], i))
    total, keep = 0.0, []
    for i in order:
        keep.append(i)
        total += q[i]
        if total > p:
            break
    out = np.full_like(x, -np.inf)
    out[keep] = x[keep]
    return out


def xtc(x: np.ndarray, threshold: float) -> np.ndarray:
    q = _softmax(x)
    above = [i for i in range(len(x)) if np.isfinite(x[i]) and q[i] >= np.float32(threshold)]
    if len(above) < 2:
        return x
    kept = sorted(above, key=lambda i: (-q[i], i))[-1]
    out = x.copy()
    out[[i for i in above if i != kept]] = -np.inf
    return out


def filtered_distribution(x: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                          min_p: float = 0.0) -> np.ndarray:
    """Steps 7-10 of the contract: the probability of each token."""
    if temperature == 0:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    z = (x - x[np.isfinite(x)].max()) / temperature
    order = sorted((i for i in range(len(z)) if np.isfinite(z[i])), key=lambda i: (-z[i], i))
    limit = len(order) if top_k <= 0 else min(top_k, len(order))
    limit = min(limit, sum(1 for i in order if np.exp(z[i]) >= min_p))
    prefix = order[:limit]
    if top_p < 1:
        mass = np.exp(z[prefix])
        cumulative = np.cumsum(mass) / mass.sum()
        prefix = prefix[:int(np.argmax(cumulative >= top_p)) + 1]
    out = np.zeros_like(x)
    out[prefix] = np.exp(z[prefix])
    return out / out.sum()
