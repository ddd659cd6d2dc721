"""When a GPU token may differ from the CPU reference's: only on a rounding edge of the reference's own scores.

The GPU's logf and the CPU's differ in the last bit now and then, and the accumulation order of a sum of
exponentials differs between devices, so a draw whose two best perturbed scores tie within rounding, or whose
token sits right at a cut whose mass (top-p) or ratio (min-p) ties with the threshold within rounding, may go
either way. Any other difference is a bug, however rare.
"""

from __future__ import annotations

import torch
from tokensampler_server.backends.cpu import kept_token_mask
from tokensampler_server.backends.philox import gumbel_noise
from tokensampler_server.model.sampling import SamplingBatch, SamplingResult


def rounding_edge(x: torch.Tensor, batch: SamplingBatch, row: int, sample: int, got: int, want: int,
                  rounding: float = 1e-5) -> bool:
    """Whether the GPU's token `got` differs from the reference's `want` only by rounding (relative `rounding`:
    fp32 for logits, the accumulation order of W·h for hidden states). x: the fp32 logits the reference sampled
    from, unprocessed. Greedy rows never differ."""
    temperature = float(batch.temperature[row])
    if temperature == 0:
        return False
    z = (x[row] - x[row].max()) / temperature
    kept = kept_token_mask(z.unsqueeze(0), batch.top_k[row:row + 1], batch.top_p[row:row + 1],
                           batch.min_p[row:row + 1])[0]
    g = gumbel_noise(batch.seed[row:row + 1], batch.position[row:row + 1], batch.iteration[row:row + 1], sample,
                     x.shape[1])[0]
    score = z + g
    if kept[got]:
        return abs(float(score[got] - score[want])) <= rounding * (1 + abs(float(score[want])))
    order = torch.sort(z, descending=True, stable=True).indices
    position = int((order == got).nonzero())
    if position != int(kept.sum()):  # only the token right past the cut can be a rounding edge
        return False
    min_p = float(batch.min_p[row])
    if min_p > 0 and abs(float(torch.exp(z[got].double())) - min_p) <= rounding * min_p:
        return True  # its probability over the top one's ties with min_p
    k = int(batch.top_k[row]) or x.shape[1]
    probs = torch.exp(z[order[:k]].double())
    mass_before = float(probs[:position].sum() / probs.sum())
    return abs(mass_before - float(batch.top_p[row])) <= rounding


def assert_tokens_agree(x: torch.Tensor, batch: SamplingBatch, got: SamplingResult, want: SamplingResult,
                        rounding: float = 1e-5) -> int:
    """Asserts that every token of `got` (the GPU's) that differs from `want` (the reference's) is a rounding edge;
    returns how many differ. x: the logits of `batch` (any float dtype, any device)."""
    x = x.float().cpu()
    differing = (got.tokens.cpu() != want.tokens).nonzero().tolist()
    for row, sample in differing:
        g, w = int(got.tokens[row, sample]), int(want.tokens[row, sample])
        assert rounding_edge(x, batch, row, sample, g, w, rounding), f"row {row} sample {sample}: {g}, not {w}"
    return len(differing)
