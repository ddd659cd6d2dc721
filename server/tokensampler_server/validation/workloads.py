"""Validation of the requests beyond Sample: diffusion steps, top-k probabilities, draft verification, scoring.

Same rules as validation/sample.py: every field is checked before any work, and a rejection names the field
and what was expected. Diffusion steps, top-k probabilities and scoring take logits, or hidden states with a
registered LM head whose logits the service computes on the backend's worker (WorkloadLogits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import TensorDecodeError, decode_tensor, dtype_name

from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.workloads.diffusion import DiffusionStep
from tokensampler_server.workloads.score import LogitSource, TokenScoring
from tokensampler_server.workloads.verify import DraftVerification
from tokensampler_server.validation.sample import (LOGITS_DTYPES, SeedSource, _column, _check, check_in_place_dtype,
                                                   check_lm_head, filter_columns, random_seeds, validate_row_params)
from tokensampler_server.resources.weights import RegisteredWeight

MASK_DTYPES = (pb.DTYPE_UINT8, pb.DTYPE_INT32, pb.DTYPE_INT64)
ID_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)
TOPK_ENTRY_BYTES = 8
"""An answer's bytes per TopKProbs entry: a float32 probability and an int32 id."""
ANSWER_SLACK_BYTES = 4096
"""What a TopKProbs answer holds besides its entries (shapes, timings, request id), at most."""


def _tensor(message: pb.Tensor, field: str, dtypes: tuple[int, ...], rank: int | tuple[int, ...]) -> torch.Tensor:
    """Decodes a tensor of one of `dtypes` and rank(s) `rank`, with every size >= 1."""
    if message.dtype not in dtypes:
        raise InvalidArgument(f"{field}.dtype", f"got {dtype_name(message.dtype)}, expected one of {', '.join(dtype_name(d) for d in dtypes)}")
    ranks = (rank,) if isinstance(rank, int) else rank
    if len(message.shape) not in ranks or min(message.shape, default=0) < 1:
        raise InvalidArgument(f"{field}.shape", f"got {list(message.shape)}, expected {' or '.join(map(str, ranks))} sizes >= 1")
    try:
        return decode_tensor(message, field)
    except TensorDecodeError as err:
        raise InvalidArgument(err.field, str(err).removeprefix(f"{err.field}: ")) from None


def _check_size(field: str, rows: int, vocab: int, limits: Limits, what: str = "elements") -> None:
    if rows > limits.max_batch_rows:
        raise InvalidArgument(f"{field}.shape", f"got {rows} rows in all, expected at most {limits.max_batch_rows} (--max-batch-rows)")
    if rows * vocab > limits.max_batch_elements:
        raise InvalidArgument(f"{field}.shape", f"got {rows * vocab} {what}, expected at most {limits.max_batch_elements}")


@dataclass(frozen=True)
class WorkloadLogits:
    """The logits [..., V] of a diffusion or top-k request: carried in it, or W·h of hidden states [..., D]
    through a registered LM head (its bias, scale and soft cap applied, as for Sample)."""

    tensor: torch.Tensor
    """The logits, or the hidden states when `lm_head` is set."""
    lm_head: RegisteredWeight | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logits' shape."""
        if self.lm_head is None:
            return tuple(self.tensor.shape)
        return (*self.tensor.shape[:-1], self.lm_head.finish.vocab_size)

    def compute(self) -> torch.Tensor:
        """The logits: as carried, or float32 on the LM head's device (run it on the backend's worker)."""
        if self.lm_head is None:
            return self.tensor
        return self.lm_head.logits(self.tensor.reshape(-1, self.tensor.shape[-1])).reshape(self.shape)


def _in_place(tensor: torch.Tensor, field: str, rank: int | tuple[int, ...]) -> torch.Tensor:
    """An in-process caller's tensor standing for the request's carried one (inprocess.py): the checks a decoded
    tensor gets."""
    check_in_place_dtype(tensor, field)
    ranks = (rank,) if isinstance(rank, int) else rank
    if tensor.dim() not in ranks or min(tensor.shape, default=0) < 1:
        raise InvalidArgument(f"{field}.shape", f"got {list(tensor.shape)}, expected {' or '.join(map(str, ranks))} "
                                                "sizes >= 1")
    return tensor


def _workload_logits(
    request: pb.DiffusionStepRequest | pb.TopKProbsRequest | pb.ScoreTokensRequest, rank: int | tuple[int, ...], limits: Limits,
    lm_head: RegisteredWeight | None, in_place: torch.Tensor | None = None,
) -> WorkloadLogits:
    """The request's `logits`, or its `hidden` states through `lm_head` (the weight hidden.weights names),
    of rank(s) `rank`, within the row and element limits. `in_place`: the input itself, from a caller in this
    process (the request then carries none)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input", "not set; expected logits, or hidden (hidden states and a registered weight)")
    if kind == "logits":
        logits = (_tensor(request.logits, "logits", LOGITS_DTYPES, rank) if in_place is None
                  else _in_place(in_place, "logits", rank))
        _check_size("logits", math.prod(logits.shape[:-1]), logits.shape[-1], limits)
        return WorkloadLogits(logits)
    if request.hidden.HasField("states_ref"):
        raise InvalidArgument("hidden.states_ref", "regions are not taken by this RPC; expected hidden.states")
    states = (_tensor(request.hidden.states, "hidden.states", LOGITS_DTYPES, rank) if in_place is None
              else _in_place(in_place, "hidden.states", rank))
    lm_head = check_lm_head(lm_head, states.shape[-1])
    # The server computes the logits: bound them as if they had been sent.
    vocab = lm_head.finish.vocab_size
    _check_size("hidden.states", math.prod(states.shape[:-1]), vocab, limits,
                f"logit elements (V={vocab} of weight {lm_head.name!r})")
    return WorkloadLogits(states, lm_head)


def validate_diffusion_request(
    request: pb.DiffusionStepRequest, limits: Limits, seed_source: SeedSource = random_seeds,
    lm_head: RegisteredWeight | None = None,
) -> tuple[WorkloadLogits, Callable[[torch.Tensor], DiffusionStep], np.ndarray]:
    """(the logits [B, L, V], the step given its logits, the uint64 seed of each row).

    `lm_head` is the registered weight that `request.hidden.weights` names (hidden-state input).
    """
    logits = _workload_logits(request, 3, limits, lm_head)
    num_rows, length, vocab = logits.shape
    mask = _tensor(request.mask, "mask", MASK_DTYPES, 2)
    if tuple(mask.shape) != (num_rows, length):
        raise InvalidArgument("mask.shape", f"got {list(mask.shape)}, expected [B, L] = {[num_rows, length]}")
    # A diffusion step copies each token-list entry to every position it samples (up to L).
    rows = validate_row_params(request.params, num_rows, vocab, limits, seed_source, positions=length)
    threshold = _column(request.confidence_threshold, "confidence_threshold", num_rows, np.nan, np.float32)
    _check(threshold, np.isnan(threshold) | ((threshold >= 0) & (threshold <= 1)), "confidence_threshold",
           "0 <= threshold <= 1 (NaN: none)")
    count = _column(request.commit_count, "commit_count", num_rows, 0, np.int64)
    step = partial(
        DiffusionStep, mask=mask != 0, temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p,
        min_p=rows.min_p, seed=rows.seed, iteration=rows.iteration, threshold=torch.from_numpy(threshold),
        count=torch.from_numpy(count), processing=rows.processing,
    )
    return logits, step, rows.seeds


def validate_topk_request(
    request: pb.TopKProbsRequest, limits: Limits, lm_head: RegisteredWeight | None = None,
    in_place: torch.Tensor | None = None,
) -> tuple[WorkloadLogits, torch.Tensor, int]:
    """(logits [B, S, V] or [B, V], temperature [N] of the N = B·S rows, k); `lm_head` as for
    validate_diffusion_request, `in_place` as for _workload_logits."""
    logits = _workload_logits(request, (2, 3), limits, lm_head, in_place)
    num_rows, vocab = logits.shape[0], logits.shape[-1]
    if not 1 <= request.k <= vocab:
        raise InvalidArgument("k", f"got {request.k}, expected 1 <= k <= V = {vocab}")
    rows = math.prod(logits.shape[:-1])
    most = (limits.max_message_bytes - ANSWER_SLACK_BYTES) // (TOPK_ENTRY_BYTES * rows)
    if most < 1:
        raise InvalidArgument("k", f"no k fits: the answer, {TOPK_ENTRY_BYTES} bytes for each of {rows} rows × k, would "
                                   "pass the largest message (--max-message-mb) even at k = 1; send fewer rows")
    if request.k > most:
        raise InvalidArgument("k", f"got {request.k}: the answer, {TOPK_ENTRY_BYTES} bytes for each of {rows} rows × k, "
                                   f"would pass the largest message (--max-message-mb); expected k <= {most}")
    temperature = _column(request.temperature, "temperature", num_rows, 1.0, np.float32)
    _check(temperature, np.isfinite(temperature) & (temperature > 0), "temperature", "T > 0 and finite")
    per_position = torch.from_numpy(temperature).repeat_interleave(math.prod(logits.shape[1:-1]))
    return logits, per_position, request.k


def validate_verify_request(
    request: pb.VerifyDraftRequest, limits: Limits, seed_source: SeedSource = random_seeds
) -> tuple[DraftVerification, np.ndarray]:
    draft_ids = _tensor(request.draft_ids, "draft_ids", ID_DTYPES, 2).to(torch.int64)
    num_rows, n = draft_ids.shape
    target = _tensor(request.target_logits, "target_logits", LOGITS_DTYPES, 3)
    vocab = target.shape[2]
    if tuple(target.shape[:2]) != (num_rows, n + 1):
        raise InvalidArgument("target_logits.shape", f"got {list(target.shape)}, expected [B, n + 1, V] = {[num_rows, n + 1, vocab]}")
    _check_size("target_logits", num_rows * (n + 1), vocab, limits)
    kind = request.WhichOneof("draft")
    if kind is None:
        raise InvalidArgument("draft", "not set; expected draft_probs or draft_logits")
    draft = _tensor(getattr(request, kind), kind, LOGITS_DTYPES, 3).to(torch.float32)
    if tuple(draft.shape) != (num_rows, n, vocab):
        raise InvalidArgument(f"{kind}.shape", f"got {list(draft.shape)}, expected [B, n, V] = {[num_rows, n, vocab]}")
    ids = draft_ids.numpy()
    _check(ids.reshape(-1), ((ids >= 0) & (ids < vocab)).reshape(-1), "draft_ids", f"token ids in [0, V={vocab})")
    if kind == "draft_logits":
        if not bool(torch.isfinite(draft).any(dim=-1).all()):
            raise InvalidArgument("draft_logits", "got a position without a finite logit, expected a distribution")
        probs = torch.softmax(torch.nan_to_num(draft, nan=float("-inf"), posinf=float("-inf")), dim=-1)
    else:
        bad = ~torch.isfinite(draft) | (draft < 0)
        if bool(bad.any()):
            raise InvalidArgument("draft_probs", "got negative or non-finite values, expected probabilities >= 0")
        largest = draft.amax(dim=-1, keepdim=True)
        if bool((largest <= 0).any()):
            raise InvalidArgument("draft_probs", "got a position whose probabilities sum to 0, expected a distribution")
        # Scaled to a largest value of 1 (the same distribution once renormalised), so that no fp32 sum overflows.
        probs = draft / largest
    # Token lists and sequences are applied at each of the n + 1 positions (workloads/verify.py).
    rows = validate_row_params(request.params, num_rows, vocab, limits, seed_source, positions=n + 1)
    verification = DraftVerification(
        draft_ids=draft_ids, draft_probs=probs.nan_to_num(0.0), target_logits=target, **rows.row_sampling(),
        processing=rows.processing,
    )
    return verification, rows.seeds


def validate_score_request(
    request: pb.ScoreTokensRequest, limits: Limits, lm_head: RegisteredWeight | None = None,
    in_place: torch.Tensor | None = None,
) -> tuple[WorkloadLogits, LogitSource, TokenScoring]:
    """(the input [B, T, V or D], its N = B·T positions as a LogitSource, what to score at each); `lm_head` as for
    validate_diffusion_request, `in_place` as for _workload_logits. The logits of hidden states are never computed
    whole (workloads/score.py)."""
    logits = _workload_logits(request, 3, limits, lm_head, in_place)
    num_rows, length, vocab = logits.shape
    ids = _tensor(request.token_ids, "token_ids", ID_DTYPES, 2).to(torch.int64)
    if tuple(ids.shape) != (num_rows, length):
        raise InvalidArgument("token_ids.shape", f"got {list(ids.shape)}, expected [B, T] = {[num_rows, length]}")
    flat = ids.reshape(-1).numpy()
    _check(flat, (flat >= 0) & (flat < vocab), "token_ids", f"token ids in [0, V={vocab})")
    if request.mode not in (pb.LOGPROBS_MODE_UNSPECIFIED, pb.LOGPROBS_MODE_RAW, pb.LOGPROBS_MODE_PROCESSED):
        raise InvalidArgument("mode", f"got {request.mode}, expected RAW or PROCESSED")
    if request.top_logprobs > limits.max_top_logprobs:
        raise InvalidArgument("top_logprobs", f"got {request.top_logprobs}, expected at most {limits.max_top_logprobs}")
    top_logprobs = min(request.top_logprobs, vocab)  # the min(N, V) best, as Sample returns (step 11)
    columns = filter_columns(request, num_rows, vocab, prefix="")
    temperature, top_k, top_p, min_p = (column.repeat_interleave(length) for column in columns)
    tensor = logits.tensor.reshape(num_rows * length, -1)
    source = LogitSource(logits=tensor) if logits.lm_head is None else LogitSource(hidden=tensor, lm_head=logits.lm_head)
    scoring = TokenScoring(token_ids=ids.reshape(-1), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           processed=request.mode == pb.LOGPROBS_MODE_PROCESSED, top_logprobs=top_logprobs,
                           entropy=request.return_entropy)
    return logits, source, scoring
