"""Turns a SampleRequest into a SamplingBatch, checking every field before any work is done.

Every rejection is an InvalidArgument naming the field (as a path into the request) and what was
expected. Per-row columns hold 0 values (default), 1 (shared by every row) or B (one per row).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import TensorDecodeError, decode_tensor, dtype_name

from .config import Limits
from .errors import InvalidArgument
from .sampling import HiddenInput, LogitProcessing, LogprobsMode, SamplingBatch, TokenEntries
from .weights import RegisteredWeight

LOGITS_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16)

SeedSource = Callable[[int], np.ndarray]


def random_seeds(count: int) -> np.ndarray:
    """`count` fresh uint64 seeds from the OS's cryptographic generator."""
    return np.frombuffer(secrets.token_bytes(8 * count), dtype=np.uint64).copy()


def _column(values: Sequence, field: str, num_rows: int, default: float | int, dtype: np.dtype) -> np.ndarray:
    """Expands a 0/1/B-valued column to B values."""
    count = len(values)
    if count == 0:
        return np.full(num_rows, default, dtype=dtype)
    if count == 1:
        return np.full(num_rows, values[0], dtype=dtype)
    if count == num_rows:
        return np.asarray(values, dtype=dtype)
    raise InvalidArgument(field, f"got {count} values, expected 0, 1 or B={num_rows}")


def _check(values: np.ndarray, ok: np.ndarray, field: str, expected: str) -> None:
    """Rejects the first value where `ok` is false."""
    if not bool(ok.all()):
        raise InvalidArgument(field, f"got {values[int(np.argmin(ok))].item()}, expected {expected}")


def _checked_column(
    values: Sequence, field: str, num_rows: int, default: float | int, dtype: type[np.generic],
    ok: Callable[[np.ndarray], np.ndarray], expected: str,
) -> np.ndarray:
    """_column, then _check of every value against `ok`. The common 0- and 1-valued columns are checked
    as one scalar (numpy calls on arrays cost microseconds each, which add up on the hot path)."""
    count = len(values)
    if count == 0:
        return np.full(num_rows, default, dtype=dtype)  # the defaults are valid
    if count == 1:
        value = dtype(values[0])  # the same conversion np.full does
        if not ok(value):
            raise InvalidArgument(field, f"got {value.item()}, expected {expected}")
        return np.full(num_rows, value, dtype=dtype)
    column = _column(values, field, num_rows, default, dtype)
    _check(column, ok(column), field, expected)
    return column


def _token_entries(lists: pb.TokenLists, field: str, num_rows: int, vocab_size: int) -> TokenEntries | None:
    """Per-row token lists in coordinate form, or None when the message is empty."""
    if len(lists.lengths) == 0:
        if len(lists.ids):
            raise InvalidArgument(f"{field}.lengths", f"got 0 values for {len(lists.ids)} ids, expected 1 or B={num_rows}")
        return None
    ids = np.asarray(lists.ids, dtype=np.int64)
    lengths = np.asarray(lists.lengths, dtype=np.int64)
    if len(lengths) not in (1, num_rows):
        raise InvalidArgument(f"{field}.lengths", f"got {len(lengths)} values, expected 1 or B={num_rows}")
    if int(lengths.sum()) != len(ids):
        raise InvalidArgument(f"{field}.lengths", f"sum is {int(lengths.sum())}, expected len(ids)={len(ids)}")
    _check(ids, (ids >= 0) & (ids < vocab_size), f"{field}.ids", f"token ids in [0, V={vocab_size})")
    if len(lengths) == 1:  # one list shared by every row
        rows = np.repeat(np.arange(num_rows, dtype=np.int64), len(ids))
        ids = np.tile(ids, num_rows)
    else:
        rows = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
    return TokenEntries(rows=torch.from_numpy(rows), tokens=torch.from_numpy(ids))


def _penalty(values: Sequence[float], field: str, num_rows: int, default: float) -> torch.Tensor | None:
    if len(values) == 0:
        return None
    column = _column(values, field, num_rows, default, np.float32)
    _check(column, np.isfinite(column), field, "a finite number")
    return torch.from_numpy(column)


def _processing(params: pb.SamplingParams, num_rows: int, vocab_size: int) -> LogitProcessing | None:
    allowed = _token_entries(params.allowed_token_ids, "params.allowed_token_ids", num_rows, vocab_size)
    banned = _token_entries(params.banned_token_ids, "params.banned_token_ids", num_rows, vocab_size)
    bias = _token_entries(params.logit_bias.tokens, "params.logit_bias.tokens", num_rows, vocab_size)
    bias_values = None
    num_bias_ids = len(params.logit_bias.tokens.ids)
    if len(params.logit_bias.values) != num_bias_ids:
        raise InvalidArgument(
            "params.logit_bias.values", f"got {len(params.logit_bias.values)} values, expected one per id ({num_bias_ids})"
        )
    if bias is not None:
        values = np.asarray(params.logit_bias.values, dtype=np.float32)
        _check(values, np.isfinite(values), "params.logit_bias.values", "finite numbers")
        if len(params.logit_bias.tokens.lengths) == 1:
            values = np.tile(values, num_rows)
        bias_values = torch.from_numpy(values)
    output_tokens = _token_entries(params.output_token_ids, "params.output_token_ids", num_rows, vocab_size)
    prompt_tokens = _token_entries(params.prompt_token_ids, "params.prompt_token_ids", num_rows, vocab_size)
    repetition = _penalty(params.repetition_penalty, "params.repetition_penalty", num_rows, 1.0)
    if repetition is not None:
        _check(repetition.numpy(), repetition.numpy() > 0, "params.repetition_penalty", "r > 0")
    presence = _penalty(params.presence_penalty, "params.presence_penalty", num_rows, 0.0)
    frequency = _penalty(params.frequency_penalty, "params.frequency_penalty", num_rows, 0.0)
    if allowed is None and banned is None and bias is None and output_tokens is None and prompt_tokens is None:
        return None  # penalties without a history change nothing
    return LogitProcessing(
        allowed=allowed,
        banned=banned,
        bias=bias,
        bias_values=bias_values,
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )


def _seeds(params: pb.SamplingParams, num_rows: int, seed_source: SeedSource) -> np.ndarray:
    """uint64 seed per row: given ones, and fresh ones where the request gave none."""
    if len(params.seed) == 0:
        if len(params.has_seed):
            raise InvalidArgument("params.has_seed", "given without params.seed; expected seeds alongside")
        return seed_source(num_rows)
    seeds = _column(params.seed, "params.seed", num_rows, 0, np.uint64)
    if len(params.has_seed) == 0:
        return seeds
    if len(params.has_seed) != num_rows:
        raise InvalidArgument("params.has_seed", f"got {len(params.has_seed)} values, expected 0 or B={num_rows}")
    has_seed = np.asarray(params.has_seed, dtype=bool)
    missing = ~has_seed
    if missing.any():
        seeds[missing] = seed_source(int(missing.sum()))
    return seeds


def _check_elements(field: str, num_rows: int, width: int, limits: Limits, what: str = "B·V") -> None:
    """Bounds the memory one request's logits take, whatever the row count."""
    if num_rows * width > limits.max_batch_elements:
        raise InvalidArgument(
            f"{field}.shape",
            f"got {what} = {num_rows}·{width} = {num_rows * width} elements, "
            f"expected at most {limits.max_batch_elements} (--max-batch-elements)",
        )


def _check_shape(shape: Sequence[int], field: str, limits: Limits, dims: str) -> None:
    """Accepts [B, N] with 1 <= B <= max_batch_rows, N >= 1 and B·N <= max_batch_elements."""
    if len(shape) != 2:
        raise InvalidArgument(f"{field}.shape", f"got {list(shape)}, expected {dims}")
    num_rows, width = shape
    if num_rows < 1 or width < 1:
        raise InvalidArgument(f"{field}.shape", f"got {[num_rows, width]}, expected {dims} with both sizes >= 1")
    if num_rows > limits.max_batch_rows:
        raise InvalidArgument(
            f"{field}.shape", f"got B={num_rows} rows, expected at most {limits.max_batch_rows} (--max-batch-rows)"
        )
    _check_elements(field, num_rows, width, limits, dims.strip("[]").replace(", ", "·"))


def check_lm_head(lm_head: RegisteredWeight | None, hidden_size: int) -> RegisteredWeight:
    """The weight that hidden.weights names, for hidden states whose last size is `hidden_size`."""
    if lm_head is None:
        raise InvalidArgument("hidden.weights", "not set; expected the name of a registered weight")
    if hidden_size != lm_head.hidden_size:
        raise InvalidArgument(
            "hidden.states.shape", f"got D={hidden_size}, expected D={lm_head.hidden_size} of weight {lm_head.name!r}"
        )
    return lm_head


def _decode(tensor: pb.Tensor, field: str, limits: Limits, dims: str) -> torch.Tensor:
    """A [B, N] float32/bfloat16/float16 tensor carried in the message (checked before decoding)."""
    if tensor.dtype not in LOGITS_DTYPES:
        names = ", ".join(dtype_name(d) for d in LOGITS_DTYPES)
        raise InvalidArgument(f"{field}.dtype", f"got {tensor.dtype}, expected one of {names}")
    _check_shape(tensor.shape, field, limits, dims)
    try:
        return decode_tensor(tensor, field)
    except TensorDecodeError as err:
        raise InvalidArgument(err.field, str(err).removeprefix(f"{err.field}: ")) from None


def check_rows_shape(ref: pb.RowsRef, limits: Limits) -> None:
    """Bounds logits_rows' [B, V] = [number of row_offsets, row_size] within the request limits."""
    _check_shape((len(ref.row_offsets), ref.row_size), "logits_rows", limits, "[B, V]")


def _referenced(tensor: torch.Tensor, field: str, limits: Limits, dims: str) -> torch.Tensor:
    _check_shape(tensor.shape, field, limits, dims)
    return tensor


def _input(request: pb.SampleRequest, referenced: torch.Tensor | None, limits: Limits) -> tuple[str, torch.Tensor]:
    """(kind, tensor) of the request's input: "logits" or "hidden", carried or referenced."""
    kind = request.WhichOneof("input")
    if kind in ("logits_ref", "logits_rows"):
        return "logits", _referenced(referenced, kind, limits, "[B, V]")
    if kind == "logits":
        return "logits", _decode(request.logits, "logits", limits, "[B, V]")
    if kind == "hidden" and request.hidden.HasField("states_ref"):
        return "hidden", _referenced(referenced, "hidden.states_ref", limits, "[B, D]")
    if kind == "hidden":
        return "hidden", _decode(request.hidden.states, "hidden.states", limits, "[B, D]")
    raise InvalidArgument("input", "not set; expected logits, logits_ref, logits_rows or hidden")


@dataclass(frozen=True)
class RowParams:
    """The per-row parameters of SamplingParams, checked and expanded to B values (torch, CPU)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    iteration: torch.Tensor
    processing: LogitProcessing | None
    seeds: np.ndarray
    """The same seeds as uint64, for the response."""


def validate_row_params(
    params: pb.SamplingParams, num_rows: int, vocab_size: int, seed_source: SeedSource = random_seeds
) -> RowParams:
    """Checks every column of `params` for B = num_rows rows over a vocabulary of vocab_size."""
    temperature = _checked_column(params.temperature, "params.temperature", num_rows, 1.0, np.float32,
                                  lambda t: np.isfinite(t) & (t >= 0), "T >= 0 and finite")
    top_k = _checked_column(params.top_k, "params.top_k", num_rows, 0, np.int64, lambda k: k >= -1,
                            "k >= -1 (0 or -1 disables)")
    top_k = np.where((top_k < 0) | (top_k >= vocab_size), 0, top_k).astype(np.int32)
    top_p = _checked_column(params.top_p, "params.top_p", num_rows, 1.0, np.float32, lambda p: (p > 0) & (p <= 1),
                            "0 < p <= 1")
    min_p = _checked_column(params.min_p, "params.min_p", num_rows, 0.0, np.float32, lambda m: (m >= 0) & (m < 1),
                            "0 <= min_p < 1")
    position = _column(params.position, "params.position", num_rows, 0, np.int64)
    iteration = _column(params.iteration, "params.iteration", num_rows, 0, np.int64)
    processing = _processing(params, num_rows, vocab_size)
    seeds = _seeds(params, num_rows, seed_source)
    return RowParams(
        temperature=torch.from_numpy(temperature),
        top_k=torch.from_numpy(top_k),
        top_p=torch.from_numpy(top_p),
        min_p=torch.from_numpy(min_p),
        seed=torch.from_numpy(seeds.view(np.int64)),
        position=torch.from_numpy(position),
        iteration=torch.from_numpy(iteration),
        processing=processing,
        seeds=seeds,
    )


def validate_sample_request(
    request: pb.SampleRequest,
    limits: Limits,
    seed_source: SeedSource = random_seeds,
    lm_head: RegisteredWeight | None = None,
    referenced: torch.Tensor | None = None,
) -> tuple[SamplingBatch, np.ndarray]:
    """Checks a SampleRequest and returns the batch to sample with the uint64 seed of each row.

    `lm_head` is the registered weight that `request.hidden.weights` names (hidden-state input);
    `referenced` is the tensor a logits_ref, logits_rows or hidden.states_ref points to, already resolved.
    """
    logits = hidden = None
    kind, tensor = _input(request, referenced, limits)
    if kind == "logits":
        logits = tensor
        num_rows, vocab_size = logits.shape
    else:
        hidden = HiddenInput(states=tensor, lm_head=check_lm_head(lm_head, tensor.shape[1]))
        num_rows, vocab_size = tensor.shape[0], lm_head.finish.vocab_size
        # The server computes B·V logits from B·D hidden states: bound those too.
        _check_elements("hidden.states", num_rows, vocab_size, limits, f"B·V of weight {lm_head.name!r}")

    rows = validate_row_params(request.params, num_rows, vocab_size, seed_source)

    num_samples = request.num_samples if request.HasField("num_samples") else 1
    if not 1 <= num_samples <= limits.max_num_samples:
        raise InvalidArgument("num_samples", f"got {num_samples}, expected 1 <= n <= {limits.max_num_samples}")
    if request.top_logprobs > limits.max_top_logprobs:
        raise InvalidArgument(
            "top_logprobs", f"got {request.top_logprobs}, expected at most {limits.max_top_logprobs}"
        )
    if request.logprobs_mode not in (
        pb.LOGPROBS_MODE_UNSPECIFIED,
        pb.LOGPROBS_MODE_RAW,
        pb.LOGPROBS_MODE_PROCESSED,
    ):
        raise InvalidArgument("logprobs_mode", f"got {request.logprobs_mode}, expected RAW or PROCESSED")
    mode = LogprobsMode.PROCESSED if request.logprobs_mode == pb.LOGPROBS_MODE_PROCESSED else LogprobsMode.RAW

    batch = SamplingBatch(
        logits=logits,
        hidden=hidden,
        temperature=rows.temperature,
        top_k=rows.top_k,
        top_p=rows.top_p,
        min_p=rows.min_p,
        seed=rows.seed,
        position=rows.position,
        iteration=rows.iteration,
        num_samples=num_samples,
        processing=rows.processing,
        return_logprobs=request.return_logprobs,
        logprobs_mode=mode,
        top_logprobs=request.top_logprobs,
    )
    return batch, rows.seeds
