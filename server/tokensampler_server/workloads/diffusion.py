"""Diffusion-LM denoising steps (docs/semantics.md, "Diffusion-LM steps" and choice 14) in torch.

One step over logits [B, L, V] and a mask of undecided positions:
  1. gather the masked positions only, in (b, l) order, into one SamplingBatch of M rows whose row for
     (b, l) carries request b's parameters, seed and iteration with `position` = l (several batches of
     consecutive rows when the token lists copied to the rows would pass _BATCH_COPIES);
  2. sample it with the given backend (so a CUDA backend runs its kernels), exactly as Sample would;
  3. confidence of each sampled token: its probability under softmax(z) over the whole vocabulary after
     processing (steps 2-5), z = x / T with T = 1 for greedy rows, in fp32 on the logits' device;
  4. the commit rule of every row at once on the logits' device (no host sync per row).

Decisions where the contract is silent:
  - A masked position with no finite logit after processing (token -1) gets confidence 0 and is never
    committed (not by threshold, count or the at-least-one rule): it stays masked. The at-least-one rule
    applies to rows with at least one masked position that has a token.
  - The count rule ranks positions by (confidence descending, index ascending); so does the
    at-least-one rule.
  - Outputs live on the logits' device; host syncs per step: the mask's copy to the host (to build the
    batch) and the backend's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokensampler_server.backends.base import Backend
from tokensampler_server.backends.processing import apply_processing, sanitize_non_finite
from tokensampler_server.model.sampling import LogitProcessing, SamplingBatch, TokenEntries

_BATCH_COPIES = 1 << 22
"""Token-list copies a batch of masked positions begins within (64 MiB), before sampling adds its own temporaries."""


@dataclass(frozen=True)
class DiffusionStep:
    """One denoising step of B requests of L positions each.

    `logits` may live on the CPU or a GPU and `mask` on any device; every per-request column is [B] on the
    CPU, as in SamplingBatch.
    """

    logits: torch.Tensor
    """float32/bfloat16/float16 [B, L, V]; only masked positions are read."""
    mask: torch.Tensor
    """bool [B, L]: True where the position is still undecided."""
    temperature: torch.Tensor
    """float32 [B]; 0 means greedy."""
    top_k: torch.Tensor
    """int32 [B]; 0 means off."""
    top_p: torch.Tensor
    """float32 [B]; 1 means off."""
    min_p: torch.Tensor
    """float32 [B]; 0 means off."""
    seed: torch.Tensor
    """int64 [B] holding the uint64 seed's bits."""
    iteration: torch.Tensor
    """int64 [B] holding a uint32: the denoising step."""
    threshold: torch.Tensor
    """float32 [B]: commit positions with confidence >= threshold; NaN = no threshold for that row."""
    count: torch.Tensor
    """int64 [B]: also commit the `count` most confident positions; 0 = no count for that row."""
    processing: LogitProcessing | None = None
    """Masks, bias and penalties; its TokenEntries rows and per-row tensors index the B requests."""


def _expand_entries(
    entries: TokenEntries | None, counts: torch.Tensor, starts: torch.Tensor, values: torch.Tensor | None = None
) -> tuple[TokenEntries | None, torch.Tensor | None]:
    """Copies each entry of request row r to the `counts[r]` sampled rows starting at `starts[r]`.

    Returns the new entries and `values` (aligned with the entries: bias values) copied alike. Per sampled row, the
    entries keep their original order (duplicate bias entries add up in the same order as for a lone Sample row).
    The entries of the requests that sample c rows are copied as one [entries, c] block, a group for each c (at most
    sqrt(2M) groups for M sampled rows): a list shared by every position makes up to 2^25 copies
    (Limits.max_token_entries), each pass over them a fraction of a second, and building an index of the entry each
    copy is for, its offset and a gather per field (80 bytes a copy) took 5 s of CPU for a 28 KB request.
    """
    if entries is None:
        return None, None
    repeats = counts[entries.rows]
    first_rows = starts[entries.rows]
    sizes = [size for size in torch.unique(repeats).tolist() if size > 0]
    rows, tokens, copied_values = [], [], []
    for size in sizes:
        group = None if len(sizes) == 1 and bool((repeats == size).all()) else (repeats == size).nonzero().squeeze(1)
        rows.append((_copies(first_rows, group, size) + torch.arange(size)).reshape(-1))  # copy j: the j-th row
        tokens.append(_copies(entries.tokens, group, size).reshape(-1))
        if values is not None:
            copied_values.append(_copies(values, group, size).reshape(-1))
    if not sizes:
        return TokenEntries(rows=entries.rows[:0], tokens=entries.tokens[:0]), None if values is None else values[:0]
    return (TokenEntries(rows=_joined(rows), tokens=_joined(tokens)),
            None if values is None else _joined(copied_values))


def _copies(column: torch.Tensor, group: torch.Tensor | None, size: int) -> torch.Tensor:
    """[entries, size]: each value of `column` (those at `group`, or all) `size` times, not yet copied."""
    return (column if group is None else column[group]).unsqueeze(1).expand(-1, size)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts end to end, without a copy for a single part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def expand_processing(
    processing: LogitProcessing | None, request_rows: torch.Tensor, positions: torch.Tensor, num_requests: int
) -> LogitProcessing | None:
    """`processing` of B requests turned into that of the sampled rows, whose request is `request_rows` and
    position `positions` (int64 [M] each, CPU; request_rows non-decreasing since rows are in (b, l) order)."""
    if processing is None:
        return None
    counts = torch.bincount(request_rows, minlength=num_requests)
    starts = torch.cumsum(counts, 0) - counts
    bias, bias_values = _expand_entries(processing.bias, counts, starts, processing.bias_values)
    sequences = processing.sequence_samplers

    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[request_rows]

    return LogitProcessing(
        allowed=_expand_entries(processing.allowed, counts, starts)[0],
        banned=_expand_entries(processing.banned, counts, starts)[0],
        bias=bias,
        bias_values=bias_values,
        output_tokens=_expand_entries(processing.output_tokens, counts, starts)[0],
        prompt_tokens=_expand_entries(processing.prompt_tokens, counts, starts)[0],
        repetition_penalty=per_row(processing.repetition_penalty),
        presence_penalty=per_row(processing.presence_penalty),
        frequency_penalty=per_row(processing.frequency_penalty),
        sequence_samplers=None if sequences is None else sequences.rows(request_rows),
        truncation=None if processing.truncation is None else processing.truncation.rows(request_rows).at_positions(positions),
    )


def _confidences(
    logits: torch.Tensor, processing: LogitProcessing | None, temperature: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Probability of each sampled token under softmax(z) over the whole vocabulary after processing.

    logits: [M, V] (any float dtype, any device); processing indexes the M rows; temperature: float32 [M]
    (0 = greedy, read as T = 1); tokens: int64 [M] on the logits' device, -1 where the row is not valid.
    Returns float32 [M] on the logits' device, 0 where the token is -1.
    """
    x = apply_processing(logits.to(torch.float32, copy=True), processing)
    x, _ = sanitize_non_finite(x)
    valid = tokens >= 0
    x_max = x.amax(dim=1, keepdim=True)
    x_max = torch.where(valid.unsqueeze(1), x_max, torch.zeros_like(x_max))  # keep invalid rows -inf, not NaN
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature).to(x.device).unsqueeze(1)
    z = x.sub_(x_max).div_(t)  # (x - max x) / T, choice 2
    log_prob = z.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=1)
    return torch.where(valid, log_prob.exp(), torch.zeros_like(log_prob))


def commit_mask(
    mask: torch.Tensor, confidences: torch.Tensor, committable: torch.Tensor, threshold: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """The commit rule of choice 14 for every row at once; returns the new mask, bool [B, L].

    mask, committable: bool [B, L] (committable: masked positions that sampled a token); confidences:
    float32 [B, L]; threshold: float32 [B] (NaN = none); count: int64 [B] (0 = none). All on one device.
    """
    eligible = mask & committable
    # NaN compares false, so rows without a threshold commit nothing here.
    by_threshold = eligible & (confidences >= threshold.unsqueeze(1))
    # Rank of each position by (confidence desc, index asc); ineligible ones (key -1) rank after all others.
    key = torch.where(eligible, confidences, torch.full_like(confidences, -1.0))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    by_count = eligible & (rank < count.unsqueeze(1))
    commit = by_threshold | by_count
    # At least one per row while a committable position remains: the top-ranked one.
    nothing = eligible.any(dim=1) & ~commit.any(dim=1)
    commit |= nothing.unsqueeze(1) & (rank == 0)
    return mask & ~commit


def entries_per_request(processing: LogitProcessing, num_requests: int) -> torch.Tensor:
    """int64 [B]: the token-list entries of each request's processing, which each of its sampled rows gets a copy of."""
    per_request = torch.zeros(num_requests, dtype=torch.int64)
    for entries in (processing.allowed, processing.banned, processing.bias, processing.output_tokens,
                    processing.prompt_tokens):
        if entries is not None:
            per_request += torch.bincount(entries.rows, minlength=num_requests)
    return per_request


def _batch_sizes(processing: LogitProcessing | None, request_rows: torch.Tensor, num_requests: int) -> list[int]:
    """How many of the masked positions (request_rows, in (b, l) order) each batch samples: one batch, or consecutive
    ones of about _BATCH_COPIES token-list copies each, the positions whose copies before them fall in one multiple
    of it (each position holds a copy of its request's lists: up to 2^25 entries, 512 MiB, for a request of a few KB
    whose one list is shared by every position)."""
    if processing is None:
        return [request_rows.numel()] if request_rows.numel() else []
    copies = entries_per_request(processing, num_requests)[request_rows]
    before = torch.cumsum(copies, 0) - copies
    return torch.unique_consecutive(before // _BATCH_COPIES, return_counts=True)[1].tolist()


def _sample_rows(step: DiffusionStep, backend: Backend, request_rows: torch.Tensor, positions: torch.Tensor,
                 tokens: torch.Tensor, confidences: torch.Tensor) -> None:
    """Samples the masked positions (request_rows, positions) (int64 [M] each, CPU, in (b, l) order) with `backend`,
    writing their tokens and confidences."""
    device = step.logits.device
    rows_d, positions_d = request_rows.to(device), positions.to(device)
    gathered = step.logits[rows_d, positions_d]  # [M, V]: reads only the masked positions
    processing = expand_processing(step.processing, request_rows, positions, step.logits.shape[0])
    temperature = step.temperature[request_rows]
    batch = SamplingBatch(
        logits=gathered.to(backend.device),
        temperature=temperature,
        top_k=step.top_k[request_rows],
        top_p=step.top_p[request_rows],
        min_p=step.min_p[request_rows],
        seed=step.seed[request_rows],
        position=positions,
        iteration=step.iteration[request_rows],
        processing=processing,
    )
    sampled = backend.sample(batch).tokens[:, 0].to(device)
    tokens[rows_d, positions_d] = sampled
    confidences[rows_d, positions_d] = _confidences(gathered, processing, temperature, sampled)


def diffusion_step(step: DiffusionStep, backend: Backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples every masked position of `step` with `backend` and applies the commit rule.

    Returns, on the logits' device: tokens int64 [B, L] (-1 at unmasked positions and at masked ones with
    no finite logit), confidences float32 [B, L] (0 at those positions), the new mask bool [B, L].
    """
    logits = step.logits
    device = logits.device
    num_requests, length, _ = logits.shape
    mask = step.mask.to(device)
    tokens = torch.full((num_requests, length), -1, dtype=torch.int64, device=device)
    confidences = torch.zeros((num_requests, length), dtype=torch.float32, device=device)

    # Masked positions in (b, l) order; the batch's per-row columns must be on the host.
    request_rows, positions = step.mask.cpu().nonzero(as_tuple=True)
    sizes = _batch_sizes(step.processing, request_rows, num_requests)
    for rows, where in zip(request_rows.split(sizes), positions.split(sizes), strict=True):
        _sample_rows(step, backend, rows, where, tokens, confidences)

    threshold = step.threshold.to(device=device, dtype=torch.float32)
    count = step.count.to(device=device, dtype=torch.int64)
    new_mask = commit_mask(mask, confidences, tokens >= 0, threshold, count)
    return tokens, confidences, new_mask
