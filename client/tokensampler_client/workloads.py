"""Requests and results of the workloads beyond Sample: diffusion steps, top-k probabilities, draft
verification and scoring (docs/semantics.md, choices 14-16 and 18)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._proto import sampler_pb2 as pb
from .params import LOGITS_DTYPES, Column, _column, _extend, _set_scalar, fill_sampling_params, logprobs_mode_value
from .result import ReadableRepr, Timings
from .tensors import Array, as_array, cast, decode_owned, decode_tensor, encode_tensor, wire_dtype


def _float_tensor(name: str, value: Any, rank: int | tuple[int, ...], out: pb.Tensor) -> Array:
    tensor = as_array(value)
    ranks = (rank,) if isinstance(rank, int) else rank
    if tensor.ndim not in ranks:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ranks))} dimensions, got shape {list(tensor.shape)}")
    if wire_dtype(tensor.dtype) not in LOGITS_DTYPES:
        raise TypeError(f"{name}: dtype {tensor.dtype} cannot be sent; expected float32, bfloat16 or float16")
    encode_tensor(tensor, out=out)
    return tensor


def _set_input(
    request: pb.DiffusionStepRequest | pb.TopKProbsRequest | pb.ScoreTokensRequest, logits: Any, hidden: Any, weights: str | None,
    rank: int | tuple[int, ...],
) -> Array:
    """Encodes the request's input, `logits` or `hidden` states through the registered LM head named
    `weights` (exactly one of them), and returns it as an array."""
    if (logits is None) == (hidden is None):
        raise ValueError("logits, hidden: expected exactly one of them")
    if logits is not None:
        return _float_tensor("logits", logits, rank, request.logits)
    if not weights:
        raise ValueError("weights: expected the name of a registered LM head with hidden states")
    request.hidden.weights = weights
    return _float_tensor("hidden", hidden, rank, request.hidden.states)


def _decoded(response: Any, tensors: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every workload result shares, decoded from its response: the tensors named in `tensors`, each as
    its dtype, those in `optional` as well where the response holds them (else None), the timings and request id."""
    fields = {name: decode_owned(getattr(response, name), name, dtype) for name, dtype in tensors.items()}
    for name, dtype in (optional or {}).items():
        fields[name] = decode_owned(getattr(response, name), name, dtype) if response.HasField(name) else None
    return {**fields, "timings": Timings.from_message(response.timings), "request_id": response.request_id}


@dataclass(repr=False)
class DiffusionStepResult(ReadableRepr):
    """tokens int64 [B, L] (-1 where the position was not masked), confidences float32 [B, L],
    mask bool [B, L] after the step (True: still undecided), and the seed of each row."""

    tokens: Array
    confidences: Array
    mask: Array
    seeds: list[int]
    timings: Timings
    request_id: str

    @classmethod
    def from_response(cls, response: pb.DiffusionStepResponse) -> DiffusionStepResult:
        fields = _decoded(response, {"tokens": np.int64, "confidences": np.float32})
        return cls(**fields, mask=decode_tensor(response.mask, "mask") != 0, seeds=list(response.seeds))


def _values(name: str, value: Any) -> list[Any]:
    """One value, or a sequence of them (a list, a numpy array, a tensor), as the list a repeated field takes."""
    if isinstance(value, (int, float)):
        return [value]
    try:
        return as_array(value).reshape(-1).tolist()
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: expected a number or a sequence of numbers, got {value!r}") from err


def _integers(name: str, ids: Array) -> Array:
    """Token ids as given, refused when they are not integers (a cast would truncate 1.7 to 1)."""
    floating = np.issubdtype(ids.dtype, np.floating) if isinstance(ids, np.ndarray) else ids.is_floating_point()
    if floating:
        raise TypeError(f"{name}: got {ids.dtype}, expected integer token ids")
    return ids


def build_diffusion_request(
    logits: Any, mask: Any, *, hidden: Any = None, weights: str | None = None, confidence_threshold: Any = None,
    commit_count: Any = None, **params: Any,
) -> pb.DiffusionStepRequest:
    """logits [B, L, V], or (logits None) hidden states [B, L, D] through the registered LM head named
    `weights`; mask [B, L] (bool or integers, nonzero = undecided); threshold and count: None, one value
    or B values; params: the per-row sampling keywords of sample() (no position)."""
    request = pb.DiffusionStepRequest()
    tensor = _set_input(request, logits, hidden, weights, 3)
    encode_tensor(cast(as_array(mask) != 0, np.uint8), out=request.mask)  # not a cast: 256 would read 0
    batch = tensor.shape[0]
    fill_sampling_params(request.params, batch, **params)
    for name, value in (("confidence_threshold", confidence_threshold), ("commit_count", commit_count)):
        if value is not None:
            _extend(name, getattr(request, name), _values(name, value))
    return request


@dataclass(repr=False)
class TopKProbsResult(ReadableRepr):
    """probs float32 and ids int64, [B, S, k] (or [B, k]): probability descending, id ascending on ties."""

    probs: Array
    ids: Array
    timings: Timings
    request_id: str

    @classmethod
    def from_response(cls, response: pb.TopKProbsResponse) -> TopKProbsResult:
        return cls(**_decoded(response, {"probs": np.float32, "ids": np.int64}))


def build_topk_request(
    logits: Any, k: int, temperature: Any = None, *, hidden: Any = None, weights: str | None = None
) -> pb.TopKProbsRequest:
    """logits [B, S, V] or [B, V], or (logits None) hidden states [B, S, D] or [B, D] through the
    registered LM head named `weights`; temperature: None (1), one value or B values (> 0)."""
    request = pb.TopKProbsRequest()
    _set_input(request, logits, hidden, weights, (2, 3))
    fill_topk_options(request, k, temperature)
    return request


def fill_topk_options(request: pb.TopKProbsRequest, k: int, temperature: Any = None) -> None:
    """Everything of a TopKProbsRequest but its input: build_topk_request's k and temperature."""
    _set_scalar(request, "k", k)
    if temperature is not None:
        _extend("temperature", request.temperature, _values("temperature", temperature))


@dataclass(repr=False)
class VerifyDraftResult(ReadableRepr):
    """accepted int64 [B] (0..n) and tokens int64 [B, n + 1]: the accepted draft tokens, then the
    correction or bonus token, then -1."""

    accepted: Array
    tokens: Array
    seeds: list[int]
    timings: Timings
    request_id: str

    @classmethod
    def from_response(cls, response: pb.VerifyDraftResponse) -> VerifyDraftResult:
        return cls(**_decoded(response, {"accepted": np.int64, "tokens": np.int64}), seeds=list(response.seeds))


def build_verify_request(
    draft_ids: Any, target_logits: Any, *, draft_probs: Any = None, draft_logits: Any = None, **params: Any
) -> pb.VerifyDraftRequest:
    """draft_ids [B, n]; target_logits [B, n + 1, V]; exactly one of draft_probs / draft_logits [B, n, V];
    params: the target's per-row sampling keywords of sample() (`position` = that of draft token 0)."""
    if (draft_probs is None) == (draft_logits is None):
        raise ValueError("draft_probs, draft_logits: expected exactly one of them")
    request = pb.VerifyDraftRequest()
    ids = as_array(draft_ids)
    if ids.ndim != 2:
        raise ValueError(f"draft_ids: expected shape [B, n], got {list(ids.shape)}")
    encode_tensor(cast(_integers("draft_ids", ids), np.int64), out=request.draft_ids)
    _float_tensor("target_logits", target_logits, 3, request.target_logits)
    if draft_probs is not None:
        _float_tensor("draft_probs", draft_probs, 3, request.draft_probs)
    else:
        _float_tensor("draft_logits", draft_logits, 3, request.draft_logits)
    fill_sampling_params(request.params, ids.shape[0], **params)
    return request


@dataclass(repr=False)
class ScoreTokensResult(ReadableRepr):
    """logprobs float32 [B, T]: each given token's log-prob (NaN where no logit was finite); when asked,
    top_logprob_ids int64 / top_logprobs float32 [B, T, min(N, V)] (best first) and entropy float32 [B, T] in nats."""

    logprobs: Array
    top_logprob_ids: Array | None
    top_logprobs: Array | None
    entropy: Array | None
    timings: Timings
    request_id: str

    @classmethod
    def from_response(cls, response: pb.ScoreTokensResponse) -> ScoreTokensResult:
        optional = {"top_logprob_ids": np.int64, "top_logprobs": np.float32, "entropy": np.float32}
        return cls(**_decoded(response, {"logprobs": np.float32}, optional))


def build_score_request(
    logits: Any, token_ids: Any, *, hidden: Any = None, weights: str | None = None, mode: str | int = "raw",
    temperature: Column = None, top_k: Column = None, top_p: Column = None, min_p: Column = None,
    top_logprobs: int = 0, return_entropy: bool = False,
) -> pb.ScoreTokensRequest:
    """logits [B, T, V], or (logits None) hidden states [B, T, D] through the registered LM head named `weights`;
    token_ids [B, T]; mode "raw" or "processed"; temperature, top_k, top_p, min_p (PROCESSED): None, one value
    or B values, as for sample()."""
    request = pb.ScoreTokensRequest()
    rows = _set_input(request, logits, hidden, weights, 3).shape[0]
    fill_score_options(request, rows, token_ids, mode=mode, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, top_logprobs=top_logprobs, return_entropy=return_entropy)
    return request


def fill_score_options(
    request: pb.ScoreTokensRequest, rows: int, token_ids: Any, *, mode: str | int = "raw", temperature: Column = None,
    top_k: Column = None, top_p: Column = None, min_p: Column = None, top_logprobs: int = 0,
    return_entropy: bool = False,
) -> None:
    """Everything of a ScoreTokensRequest but its input, for B = `rows`: build_score_request's keywords."""
    try:
        request.mode = logprobs_mode_value(mode)
    except ValueError as err:
        raise ValueError(str(err).replace("logprobs_mode:", "mode:", 1)) from None
    _set_scalar(request, "top_logprobs", top_logprobs)
    _set_scalar(request, "return_entropy", return_entropy)
    ids = as_array(token_ids)
    if ids.ndim != 2:
        raise ValueError(f"token_ids: expected shape [B, T], got {list(ids.shape)}")
    encode_tensor(cast(_integers("token_ids", ids), np.int64), out=request.token_ids)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if value is not None:
            _extend(name, getattr(request, name), _column(name, value, rows))
