"""Turns a SampleRequest into a SamplingBatch, checking every field before any work is done.

Every rejection is an InvalidArgument naming the field (as a path into the request) and what was
expected. Per-row columns hold 0 values (default), 1 (shared by every row) or B (one per row).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import TensorDecodeError, decode_tensor, dtype_name

from tokensampler_server.validation.columns import check as _check, checked_column as _checked_column, column as _column
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.validation.packed import decode_floats, decode_varints, packed_runs
from tokensampler_server.model.repetition import BREAKER_STARTS, MAX_BREAKERS, Sequences, SequenceSamplers
from tokensampler_server.model.sampling import (HiddenInput, LogitProcessing, LogprobsMode, RowSampling, SamplingBatch,
                                                TokenEntries)
from tokensampler_server.validation.samplers import (DecodedBreakers, check_breaker_ids, check_sequence_reads, decode_breakers, sequence_rules,
                                  stop_bans, truncation)
from tokensampler_server.resources.weights import RegisteredWeight

LOGITS_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16)

SeedSource = Callable[[int], np.ndarray]


def random_seeds(count: int) -> np.ndarray:
    """`count` fresh uint64 seeds from the OS's cryptographic generator."""
    return np.frombuffer(secrets.token_bytes(8 * count), dtype=np.uint64).copy()


class _EntryBudget:
    """The token entries one request's lists may expand to (Limits.max_token_entries), checked before
    each list is decoded or expanded; `positions` counts the copies a workload makes of each entry."""

    def __init__(self, limits: Limits, positions: int = 1) -> None:
        self.left = limits.max_token_entries
        self.limit = limits.max_token_entries
        self.positions = positions

    def take(self, field: str, entries: int, shared_rows: int) -> None:
        count = entries * self.positions
        if count <= self.left:
            self.left -= count
            return
        how = f"one list of {entries // shared_rows} ids for each of B={shared_rows} rows, " if shared_rows > 1 else ""
        copies = f" × {self.positions} positions" if self.positions > 1 else ""
        before = self.limit - self.left
        after = f" after {before} in the lists before it" if before else ""
        raise InvalidArgument(f"{field}.lengths", f"got {how}{entries}{copies} token entries{after}, expected at most "
                                                  f"{self.limit} in one request (max_token_entries)")


@dataclass(frozen=True)
class _Decoded:
    """One list field in coordinate form, with the smallest and largest id (checked against V later)."""

    entries: TokenEntries
    low: int
    high: int


def _decoded(lists: pb.TokenLists, field: str, num_rows: int, budget: _EntryBudget,
             serialized: memoryview | None = None) -> _Decoded | None:
    """Per-row token lists in coordinate form, or None when the message is empty. The counts are checked
    before anything is decoded, the entries against `budget` before a shared list is expanded.
    `serialized` is the message's serialization when the caller has it."""
    num_ids, num_lists = len(lists.ids), len(lists.lengths)
    if num_lists == 0:
        if num_ids:
            raise InvalidArgument(f"{field}.lengths", f"got 0 values for {num_ids} ids, expected 1 or B={num_rows}")
        return None
    if num_lists not in (1, num_rows):
        raise InvalidArgument(f"{field}.lengths", f"got {num_lists} values, expected 1 or B={num_rows}")
    runs = packed_runs(lists.SerializeToString() if serialized is None else serialized, (1, 2))
    lengths = decode_varints(runs.get(2), num_lists)
    total = int(lengths.sum())
    if total != num_ids:
        raise InvalidArgument(f"{field}.lengths", f"sum is {total}, expected len(ids)={num_ids}")
    shared_rows = num_rows if num_lists == 1 else 1
    budget.take(field, num_ids * shared_rows, shared_rows)
    ids = torch.from_numpy(decode_varints(runs.get(1), num_ids))
    low, high = (int(ids.min()), int(ids.max())) if num_ids else (0, 0)
    tokens = ids.repeat(shared_rows) if shared_rows > 1 else ids  # a shared list: given to every row
    return _Decoded(TokenEntries(rows=_row_indices(lengths, num_rows, num_ids), tokens=tokens), low, high)


def _row_indices(lengths: np.ndarray, num_rows: int, num_ids: int) -> torch.Tensor:
    """int64: the row of each entry, for one list per row (`lengths`) or one list given to every row.

    Written in place by torch, which lets go of the interpreter meanwhile (np.repeat holds it), with no
    temporary of the entries' size (repeat_interleave builds one)."""
    if len(lengths) == 1:
        rows = torch.empty(num_rows, num_ids, dtype=torch.int64)
        rows.copy_(torch.arange(num_rows).unsqueeze(1).expand(num_rows, num_ids))
        return rows.view(-1)
    rows = torch.zeros(num_ids, dtype=torch.int64)
    firsts = torch.from_numpy(np.cumsum(lengths[:-1]))  # where rows 1..B-1 begin
    firsts = firsts[firsts < num_ids]  # trailing empty rows begin past the end
    rows.index_add_(0, firsts, torch.ones_like(firsts))
    return rows.cumsum_(0)


def _checked_ids(decoded: _Decoded | None, field: str, vocab_size: int) -> TokenEntries | None:
    """The entries, once every id is in [0, V) (the first one outside named otherwise)."""
    if decoded is None:
        return None
    if decoded.low < 0 or decoded.high >= vocab_size:
        tokens = decoded.entries.tokens.numpy()
        _check(tokens, (tokens >= 0) & (tokens < vocab_size), f"{field}.ids", f"token ids in [0, V={vocab_size})")
    return decoded.entries


LIST_FIELDS = ("allowed_token_ids", "banned_token_ids", "logit_bias.tokens", "output_token_ids", "prompt_token_ids",
               "stop_token_ids")


@dataclass(frozen=True)
class DecodedLists:
    """The token lists of a request's SamplingParams decoded for B = num_rows rows (decode_token_lists);
    their ids are checked against V by validation."""

    num_rows: int
    lists: dict[str, _Decoded | None]
    """By LIST_FIELDS name."""
    bias_values: torch.Tensor | None
    breakers: DecodedBreakers | None = None
    sequence_samplers: SequenceSamplers | None = None
    """The rows' sequences laid out for no-repeat-n-gram and DRY (repetition.py), once per request."""


def _decode_lists(params: pb.SamplingParams, num_rows: int, limits: Limits, positions: int = 1) -> DecodedLists:
    budget = _EntryBudget(limits, positions)
    bias = params.logit_bias
    num_values, num_bias_ids = len(bias.values), len(bias.tokens.ids)
    if num_values != num_bias_ids:
        raise InvalidArgument("params.logit_bias.values", f"got {num_values} values, expected one per id ({num_bias_ids})")
    bias_runs = packed_runs(bias.SerializeToString(), (1, 2)) if num_values or len(bias.tokens.lengths) else {}
    lists: dict[str, _Decoded | None] = {}
    for name in LIST_FIELDS:
        if name == "logit_bias.tokens":
            lists[name] = _decoded(bias.tokens, "params.logit_bias.tokens", num_rows, budget, bias_runs.get(1, memoryview(b"")))
        else:
            lists[name] = _decoded(getattr(params, name), f"params.{name}", num_rows, budget)
    bias_values = None
    if lists["logit_bias.tokens"] is not None:
        values = decode_floats(bias_runs.get(2), num_values)
        _check(values, np.isfinite(values), "params.logit_bias.values", "finite numbers")
        if len(bias.tokens.lengths) == 1:
            values = np.tile(values, num_rows)
        bias_values = torch.from_numpy(values)
    breakers = decode_breakers(params.dry_sequence_breakers, num_rows)
    rules = sequence_rules(params, num_rows, breakers)
    if rules is None:
        return DecodedLists(num_rows, lists, bias_values, breakers)
    sequences = Sequences(*(None if lists[name] is None else lists[name].entries
                            for name in ("prompt_token_ids", "output_token_ids")), num_rows)
    check_sequence_reads(rules, sequences.lengths(), positions)
    return DecodedLists(num_rows, lists, bias_values, breakers, rules.samplers(sequences))


def _joined(*parts: TokenEntries | None) -> TokenEntries | None:
    """The entries of every part, in order; None when there are none."""
    present = [part for part in parts if part is not None]
    if len(present) < 2:
        return present[0] if present else None
    return TokenEntries(rows=torch.cat([part.rows for part in present]), tokens=torch.cat([part.tokens for part in present]))


def _penalty(values: Sequence[float], field: str, num_rows: int, default: float) -> torch.Tensor | None:
    if len(values) == 0:
        return None
    column = _column(values, field, num_rows, default, np.float32)
    _check(column, np.isfinite(column), field, "a finite number")
    return torch.from_numpy(column)


_BITMASK = "params.token_bitmask"


def _token_bitmask(params: pb.SamplingParams, num_rows: int, vocab_size: int, limits: Limits,
                   takes_bitmask: bool) -> torch.Tensor | None:
    """int32 [B, ceil(V / 32)]: the request's packed allowed-token mask cut to the words that hold bits of
    tokens < V (choice 17), or None without one."""
    if not params.HasField("token_bitmask"):
        return None
    if not takes_bitmask:
        raise InvalidArgument(_BITMASK, "not taken by this RPC (a grammar's mask is for one position); "
                                        "expected it in Sample requests only")
    message = params.token_bitmask
    if message.dtype != pb.DTYPE_INT32:
        raise InvalidArgument(f"{_BITMASK}.dtype", f"got {dtype_name(message.dtype)}, expected int32")
    words = -(-vocab_size // 32)
    shape = list(message.shape)
    if len(shape) != 2 or shape[0] != num_rows:
        raise InvalidArgument(f"{_BITMASK}.shape", f"got {shape}, expected [B, W] = [{num_rows}, W] with "
                                                   f"W >= ceil(V / 32) = {words}")
    if shape[1] < words:
        raise InvalidArgument(f"{_BITMASK}.shape", f"got {shape[1]} words per row, expected at least "
                                                   f"ceil(V / 32) = {words} for V={vocab_size}")
    _check_elements(_BITMASK, num_rows, shape[1], limits, "B·W")
    try:
        bitmask = decode_tensor(message, _BITMASK)
    except TensorDecodeError as err:
        raise InvalidArgument(err.field, str(err).removeprefix(f"{err.field}: ")) from None
    return bitmask[:, :words].contiguous()  # later words hold no token's bit: equal widths merge


def _processing(params: pb.SamplingParams, num_rows: int, vocab_size: int, decoded: DecodedLists,
                counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                bitmask: torch.Tensor | None = None) -> LogitProcessing | None:
    """Steps 2-5 of every row; `counter` is the rows' (seed, position, iteration), for XTC's coin; `bitmask` the
    checked token_bitmask."""
    entries = {name: _checked_ids(decoded.lists[name], f"params.{name}", vocab_size) for name in LIST_FIELDS}
    check_breaker_ids(decoded.breakers, vocab_size)
    repetition = _penalty(params.repetition_penalty, "params.repetition_penalty", num_rows, 1.0)
    if repetition is not None:
        _check(repetition.numpy(), repetition.numpy() > 0, "params.repetition_penalty", "r > 0")
    presence = _penalty(params.presence_penalty, "params.presence_penalty", num_rows, 0.0)
    frequency = _penalty(params.frequency_penalty, "params.frequency_penalty", num_rows, 0.0)
    banned = _joined(entries["banned_token_ids"], stop_bans(params, entries["stop_token_ids"], num_rows))
    truncated = truncation(params, num_rows, *counter)
    lists = (entries["allowed_token_ids"], banned, entries["logit_bias.tokens"], entries["output_token_ids"],
             entries["prompt_token_ids"], decoded.sequence_samplers, truncated, bitmask)
    if all(value is None for value in lists):
        return None  # penalties without a history change nothing
    return LogitProcessing(
        allowed=entries["allowed_token_ids"],
        banned=banned,
        bias=entries["logit_bias.tokens"],
        bias_values=decoded.bias_values,
        output_tokens=entries["output_token_ids"],
        prompt_tokens=entries["prompt_token_ids"],
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        sequence_samplers=decoded.sequence_samplers,
        truncation=truncated,
        token_bitmask=bitmask,
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


def check_lm_head(lm_head: RegisteredWeight | None, hidden_size: int,
                  states_field: str = "hidden.states") -> RegisteredWeight:
    """The weight that hidden.weights names, for hidden states (in `states_field`) whose last size is
    `hidden_size`."""
    if lm_head is None:
        raise InvalidArgument("hidden.weights", "not set; expected the name of a registered weight")
    if hidden_size != lm_head.hidden_size:
        raise InvalidArgument(
            f"{states_field}.shape", f"got D={hidden_size}, expected D={lm_head.hidden_size} of weight {lm_head.name!r}"
        )
    return lm_head


def _decode(tensor: pb.Tensor, field: str, limits: Limits, dims: str) -> torch.Tensor:
    """A [B, N] float32/bfloat16/float16 tensor carried in the message (checked before decoding)."""
    if tensor.dtype not in LOGITS_DTYPES:
        names = ", ".join(dtype_name(d) for d in LOGITS_DTYPES)
        raise InvalidArgument(f"{field}.dtype", f"got {dtype_name(tensor.dtype)}, expected one of {names}")
    _check_shape(tensor.shape, field, limits, dims)
    try:
        return decode_tensor(tensor, field)
    except TensorDecodeError as err:
        raise InvalidArgument(err.field, str(err).removeprefix(f"{err.field}: ")) from None


def check_rows_shape(ref: pb.RowsRef, limits: Limits) -> None:
    """Bounds logits_rows' [B, V] = [number of row_offsets, row_size] within the request limits."""
    _check_shape((len(ref.row_offsets), ref.row_size), "logits_rows", limits, "[B, V]")


IN_PLACE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What a tensor given in place (read from a region, or passed to the in-process API) may be: LOGITS_DTYPES."""


def check_in_place_dtype(tensor: torch.Tensor, field: str) -> None:
    if tensor.dtype not in IN_PLACE_DTYPES:
        raise InvalidArgument(f"{field}.dtype", f"got {tensor.dtype}, expected float32, bfloat16 or float16")


def _referenced(tensor: torch.Tensor, field: str, limits: Limits, dims: str) -> torch.Tensor:
    """A tensor given in place, checked as a carried one."""
    check_in_place_dtype(tensor, field)
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
        if request.hidden.HasField("states"):  # which one would be sampled is not for the server to guess
            raise InvalidArgument("hidden.states", "set beside hidden.states_ref; expected one of the two")
        return "hidden", _referenced(referenced, "hidden.states_ref", limits, "[B, D]")
    if kind == "hidden":
        return "hidden", _decode(request.hidden.states, "hidden.states", limits, "[B, D]")
    raise InvalidArgument("input", "not set; expected logits, logits_ref, logits_rows or hidden")


@dataclass(frozen=True, kw_only=True)
class ValidatedRows(RowSampling):
    """The per-row parameters of SamplingParams, checked and expanded to B values (torch, CPU), with the seeds as the
    response states them. (cuda_kernels.RowParams is the same columns on a device, for the kernels.)"""

    seeds: np.ndarray
    """The same seeds as uint64, for the response."""


class FilterFields(Protocol):
    """A message with the columns temperature, top_k, top_p and min_p (SamplingParams, ScoreTokensRequest)."""

    temperature: Sequence[float]
    top_k: Sequence[int]
    top_p: Sequence[float]
    min_p: Sequence[float]


def filter_columns(params: FilterFields, num_rows: int, vocab_size: int,
                   prefix: str = "params.") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p, min_p), each [B] on the CPU, checked; `prefix` is the fields' path in the
    request. top_k -1 and k >= V read as 0 (off)."""
    temperature = _checked_column(params.temperature, f"{prefix}temperature", num_rows, 1.0, np.float32,
                                  lambda t: np.isfinite(t) & (t >= 0), "T >= 0 and finite")
    top_k = _checked_column(params.top_k, f"{prefix}top_k", num_rows, 0, np.int64, lambda k: k >= -1,
                            "k >= -1 (0 or -1 disables)")
    top_k = np.where((top_k < 0) | (top_k >= vocab_size), 0, top_k).astype(np.int32)
    top_p = _checked_column(params.top_p, f"{prefix}top_p", num_rows, 1.0, np.float32, lambda p: (p > 0) & (p <= 1),
                            "0 < p <= 1")
    min_p = _checked_column(params.min_p, f"{prefix}min_p", num_rows, 0.0, np.float32, lambda m: (m >= 0) & (m <= 1),
                            "0 <= min_p <= 1")
    return tuple(torch.from_numpy(column) for column in (temperature, top_k, top_p, min_p))


def validate_row_params(
    params: pb.SamplingParams, num_rows: int, vocab_size: int, limits: Limits, seed_source: SeedSource = random_seeds,
    positions: int = 1, token_lists: DecodedLists | None = None, takes_bitmask: bool = False,
) -> ValidatedRows:
    """Checks every column of `params` for B = num_rows rows over a vocabulary of vocab_size.

    `positions`: the copies of each token-list entry the workload makes (one per position it samples);
    `token_lists`: the lists already decoded off the event loop (decode_token_lists), used when decoded
    for num_rows rows; `takes_bitmask`: whether the workload takes token_bitmask (Sample), else it is refused."""
    temperature, top_k, top_p, min_p = filter_columns(params, num_rows, vocab_size)
    position = _column(params.position, "params.position", num_rows, 0, np.int64)
    iteration = _column(params.iteration, "params.iteration", num_rows, 0, np.int64)
    if token_lists is None or token_lists.num_rows != num_rows:
        token_lists = _decode_lists(params, num_rows, limits, positions)
    seeds = _seeds(params, num_rows, seed_source)
    counter = torch.from_numpy(seeds.view(np.int64)), torch.from_numpy(position), torch.from_numpy(iteration)
    bitmask = _token_bitmask(params, num_rows, vocab_size, limits, takes_bitmask)
    processing = _processing(params, num_rows, vocab_size, token_lists, counter, bitmask)
    return ValidatedRows(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=counter[0],
        position=counter[1],
        iteration=counter[2],
        processing=processing,
        seeds=seeds,
    )


def validate_sample_request(
    request: pb.SampleRequest,
    limits: Limits,
    seed_source: SeedSource = random_seeds,
    lm_head: RegisteredWeight | None = None,
    referenced: torch.Tensor | None = None,
    token_lists: DecodedLists | None = None,
) -> tuple[SamplingBatch, np.ndarray]:
    """Checks a SampleRequest and returns the batch to sample with the uint64 seed of each row.

    `lm_head` is the registered weight that `request.hidden.weights` names (hidden-state input);
    `referenced` is the tensor a logits_ref, logits_rows or hidden.states_ref points to, already resolved;
    `token_lists` is decode_token_lists(request, limits) when the caller ran it off the event loop.
    """
    logits = hidden = None
    kind, tensor = _input(request, referenced, limits)
    if kind == "logits":
        logits = tensor
        num_rows, vocab_size = logits.shape
    else:
        states_field = "hidden.states_ref" if request.hidden.HasField("states_ref") else "hidden.states"
        hidden = HiddenInput(states=tensor, lm_head=check_lm_head(lm_head, tensor.shape[1], states_field))
        num_rows, vocab_size = tensor.shape[0], lm_head.finish.vocab_size
        # The server computes B·V logits from B·D hidden states: bound those too.
        _check_elements("hidden.states", num_rows, vocab_size, limits, f"B·V of weight {lm_head.name!r}")

    rows = validate_row_params(request.params, num_rows, vocab_size, limits, seed_source, token_lists=token_lists,
                               takes_bitmask=True)

    num_samples = request.num_samples if request.HasField("num_samples") else 1
    if not 1 <= num_samples <= limits.max_num_samples:
        raise InvalidArgument("num_samples", f"got {num_samples}, expected 1 <= n <= {limits.max_num_samples}")
    if limits.samples_are_elements and num_rows * vocab_size * num_samples > limits.max_batch_elements:
        raise InvalidArgument("num_samples", f"got {num_samples}: B·V·num_samples = {num_rows}·{vocab_size}·"
                              f"{num_samples} on this server's CPU backend, expected at most "
                              f"{limits.max_batch_elements} (--max-batch-elements)")
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
        **rows.row_sampling(),
        processing=rows.processing,
        num_samples=num_samples,
        return_logprobs=request.return_logprobs,
        logprobs_mode=mode,
        top_logprobs=request.top_logprobs,
    )
    return batch, rows.seeds


# Token-list entries above which decoding them is worth a thread hop: ~40 ns each on one core, so 2^18 of
# them hold the event loop ~10 ms.
OFF_LOOP_ENTRIES = 1 << 18


def declared_rows(request: pb.SampleRequest) -> int:
    """B as the request's input declares it (its shape, or its row offsets); 0 without an input or for a negative B,
    which validation refuses: what a message is counted to hold (the streams' windows) never goes below 0."""
    kind = request.WhichOneof("input")
    if kind == "logits_rows":
        return len(request.logits_rows.row_offsets)
    shape = {"logits": request.logits.shape, "logits_ref": request.logits_ref.shape}.get(kind)
    if kind == "hidden":
        hidden = request.hidden
        shape = hidden.states_ref.shape if hidden.HasField("states_ref") else hidden.states.shape
    return max(int(shape[0]), 0) if shape is not None and len(shape) == 2 else 0


def heavy_token_lists(request: pb.SampleRequest) -> bool:
    """Whether the request's token lists and DRY sequence breakers expand to more than OFF_LOOP_ENTRIES entries,
    counting each start at which DRY's restart search compares a row's breaker as one (from their counts alone: no
    element is read)."""
    params = request.params
    rows = declared_rows(request)
    entries = 0
    for lists in (params.allowed_token_ids, params.banned_token_ids, params.logit_bias.tokens,
                  params.output_token_ids, params.prompt_token_ids, params.stop_token_ids):
        entries += len(lists.ids) * (rows if len(lists.lengths) == 1 else 1)
    breakers = params.dry_sequence_breakers  # laid out per row, as the lists are expanded
    entries += len(breakers.ids) * (1 if len(breakers.counts) else rows)
    return entries + _breaker_starts(breakers, rows) > OFF_LOOP_ENTRIES


def _breaker_starts(breakers: pb.TokenSequences, rows: int) -> int:
    """(row, breaker, start) triples DRY's restart search compares (repetition.BREAKER_STARTS per breaker of a row),
    up to the breakers validation accepts; each counts as an entry, though it costs 1 to 16 ns (one byte per id
    compared). 2048 rows of 32 shared one-id breakers, 4 KB, compared 4.3M of them on the event loop."""
    given = len(breakers.lengths)
    searched = min(given, MAX_BREAKERS * rows) if len(breakers.counts) else min(given, MAX_BREAKERS) * rows
    return searched * BREAKER_STARTS


def decode_token_lists(request: pb.SampleRequest, limits: Limits) -> DecodedLists:
    """The request's token lists decoded and expanded for the rows its input declares (INVALID_ARGUMENT as
    validate_sample_request would raise it), to run off the event loop (asyncio.to_thread) when
    heavy_token_lists(request): pass the result to validate_sample_request."""
    rows = declared_rows(request)
    if not 1 <= rows <= limits.max_batch_rows:
        return DecodedLists(0, {}, None)  # validation refuses the input's shape first
    return _decode_lists(request.params, rows, limits)
