"""Encodes Python arguments into a `SampleRequest` (columnar `SamplingParams`, see the proto).

Each scalar sampling parameter may be
  * None: 0 values are sent and every row gets the server's default;
  * a scalar (Python/numpy number, 0-d tensor or array): 1 value, shared by every row;
  * a 1-D sequence, numpy array or torch tensor of length B: one value per row.
A scalar `seed` is the seed of every row, as v1 defines it (stored seeds keep reproducing): the rows then draw
the same noise, so their tokens are correlated. For independent rows pass B seeds, or None (the server draws
one per row).
Token-list parameters take one list (shared by every row) or B lists (None entries are empty lists);
`logit_bias` takes one dict {token_id: bias} or B dicts (or None entries); `dry_sequence_breakers` takes one
list of token-id sequences (the tokenization of each breaker string) or B such lists (or None entries).
`token_bitmask` takes a grammar engine's packed mask of allowed tokens, int32 [B, W] (W >= ceil(V / 32)), a torch
tensor or a numpy array (uint32 arrays are sent as their int32 bits); a row of all ones is unrestricted.
The local samplers (min_tokens, no_repeat_ngram_size, dry_*, typical_p, top_n_sigma, xtc_*) are defined in
docs/semantics.md ("Local samplers"); each is off at the server's default.

Only shape/length/type mistakes are caught here (ValueError/TypeError naming the argument); value
ranges are checked by the server, which is authoritative and answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeGuard, Union

import numpy as np

from ._proto import sampler_pb2 as pb
from ._torch import torch
from .regions import RegionRows, RegionView
from .tensors import ARRAY_TYPES, Array, as_array, encode_tensor, host_contiguous, wire_dtype
from .wire import serialize_with_logits

if TYPE_CHECKING:
    import torch as _torch_types
    from typing_extensions import Unpack

# What a caller may pass for a per-row numeric parameter.
Column = Union[float, int, Sequence[Any], np.ndarray, "_torch_types.Tensor", None]
TokenIds = Union[Sequence[int], np.ndarray, "_torch_types.Tensor"]
TokenListsArg = Union[TokenIds, Sequence[Union[TokenIds, None]], None]
LogitBiasArg = Union[Mapping[int, float], Sequence[Union[Mapping[int, float], None]], None]
# A packed allowed-token bitmask [B, W] (docs/semantics.md, choice 17).
BitmaskArg = Union[np.ndarray, "_torch_types.Tensor", None]
# DRY's sequence breakers: one list of token-id sequences shared by every row, or B lists (None: none).
BreakersArg = Union[Sequence[TokenIds], Sequence[Union[Sequence[TokenIds], None]], None]



class RowOptions(TypedDict, total=False):
    """The per-row parameters every sampling kernel reads: the filters and the Philox counter of each row."""

    temperature: Column
    top_k: Column
    top_p: Column
    min_p: Column
    seed: Column
    position: Column
    iteration: Column


class SamplingOptions(RowOptions, total=False):
    """The per-row sampling parameters of a request, the one list every call that samples takes (see the module doc
    for what each accepts; docs/semantics.md for what each does). None, or left out: the default."""

    allowed_token_ids: TokenListsArg
    banned_token_ids: TokenListsArg
    logit_bias: LogitBiasArg
    repetition_penalty: Column
    presence_penalty: Column
    frequency_penalty: Column
    output_token_ids: TokenListsArg
    prompt_token_ids: TokenListsArg
    min_tokens: Column
    num_generated: Column
    stop_token_ids: TokenListsArg
    no_repeat_ngram_size: Column
    dry_multiplier: Column
    dry_base: Column
    dry_allowed_length: Column
    dry_penalty_last_n: Column
    dry_sequence_breakers: BreakersArg
    typical_p: Column
    top_n_sigma: Column
    xtc_threshold: Column
    xtc_probability: Column
    token_bitmask: BitmaskArg


class SampleOptions(SamplingOptions, total=False):
    """SamplingOptions, and what a Sample request adds: samples per row, log-probs, output regions."""

    num_samples: int | None
    return_logprobs: bool
    logprobs_mode: str | int
    top_logprobs: int
    output_tokens: RegionView | None
    output_logprobs: RegionView | None


# SamplingOptions by how they are filled in: numeric columns (seeds have their own form), token lists, then the rest
# one by one.
_COLUMNS = (*(name for name in RowOptions.__annotations__ if name != "seed"), "repetition_penalty",
            "presence_penalty", "frequency_penalty", "min_tokens", "num_generated", "no_repeat_ngram_size",
            "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "typical_p", "top_n_sigma",
            "xtc_threshold", "xtc_probability")
_TOKEN_LISTS = ("allowed_token_ids", "banned_token_ids", "output_token_ids", "prompt_token_ids", "stop_token_ids")


_SAMPLING_KEYWORDS = frozenset(SamplingOptions.__annotations__)
_SAMPLE_KEYWORDS = frozenset(SampleOptions.__annotations__) | _SAMPLING_KEYWORDS


def _check_keywords(options: Mapping[str, Any], known: frozenset[str]) -> None:
    """TypeError naming any keyword that is not a known option, as a misspelled keyword argument would."""
    unknown = options.keys() - known
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")


LOGITS_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16)
LOGPROBS_MODES = {"raw": pb.LOGPROBS_MODE_RAW, "processed": pb.LOGPROBS_MODE_PROCESSED}
# What a call planned once takes per row (LocalSampler.prepare, a colocated loop): the kernels' parameters and
# Philox counters; the processing of steps 2-5 needs the host between calls.
PREPARED_KEYWORDS = tuple(RowOptions.__annotations__)


def _is_array(value: Any) -> TypeGuard[Array]:
    return isinstance(value, ARRAY_TYPES)


def _extend(name: str, field: Any, values: Any) -> None:
    """field.extend(values), re-raising protobuf's type/range errors with the argument's name."""
    try:
        field.extend(values)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: {err}") from None


def _column(name: str, value: Column, batch: int) -> Sequence[Any]:
    """The values to send for a numeric parameter: [value] for a scalar, B values for a sequence."""
    kind = type(value)
    if kind is list or kind is tuple:  # the common cases first: no ABC checks (a client call's hot path)
        if len(value) != batch:
            raise ValueError(f"{name}: expected a scalar or {batch} values (one per row), got {len(value)}")
        return value
    if kind is float or kind is int:
        return [value]
    if _is_array(value):
        if value.ndim == 0:
            return [value.item()]
        if value.ndim != 1:
            raise ValueError(
                f"{name}: expected a scalar or {batch} values (one per row), got shape {tuple(value.shape)}"
            )
        # One bulk conversion to Python numbers; protobuf extends fastest from a list.
        values: Sequence[Any] = value.tolist()
    elif isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a number or a sequence of numbers, got {type(value).__name__}")
    elif isinstance(value, Sequence):
        values = value
    else:
        return [value]
    if len(values) != batch:
        raise ValueError(f"{name}: expected a scalar or {batch} values (one per row), got {len(values)}")
    return values


def _set_scalar(message: Any, name: str, value: Any) -> None:
    """message.name = value, re-raising protobuf's type/range errors with the argument's name."""
    try:
        setattr(message, name, value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: {err}") from None


def _set_seed(params: pb.SamplingParams, seed: Column, batch: int) -> None:
    """`seed`: one shared seed, or B seeds where None entries ask the server to draw one."""
    if seed is None:
        return
    if torch is not None and isinstance(seed, torch.Tensor) and seed.dtype == torch.int64:
        # torch has no general uint64: an int64 tensor holds the seeds' bits in two's complement.
        seed = seed.detach().cpu().numpy().view(np.uint64)
    values = _column("seed", seed, batch)
    if not _is_array(seed) and None in values:
        _extend("seed", params.has_seed, [v is not None for v in values])
        values = [0 if v is None else v for v in values]
    _extend("seed", params.seed, values)


def _ids(name: str, row: Any) -> Sequence[int]:
    """One row's token ids as a sequence protobuf can extend from."""
    if row is None:
        return []
    if _is_array(row):
        if row.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D list of token ids per row, got shape {tuple(row.shape)}")
        return row.tolist()
    if isinstance(row, Sequence) and not isinstance(row, (str, bytes)):
        return row
    raise TypeError(f"{name}: expected a list of token ids per row, got {type(row).__name__}")


def _is_row_list(value: Any) -> bool:
    """True when `value` is a list of per-row lists (rather than one flat list of ids)."""
    if not value:
        return False
    first = value[0]
    return first is None or _is_array(first) or (isinstance(first, Sequence) and not isinstance(first, (str, bytes)))


def _set_token_lists(out: pb.TokenLists, name: str, value: TokenListsArg, batch: int) -> None:
    """One list shared by every row (lengths = [n]), or B lists (lengths = B entries)."""
    if _is_array(value) and value.ndim == 2:
        # A [B, L] array: B lists of equal length, converted in one call.
        if value.shape[0] != batch:
            raise ValueError(f"{name}: expected {batch} rows, got shape {tuple(value.shape)}")
        _extend(name, out.ids, value.reshape(-1).tolist())
        out.lengths.extend([value.shape[1]] * batch)
        return
    if not _is_array(value) and _is_row_list(value):
        if len(value) != batch:
            raise ValueError(f"{name}: expected one list or {batch} lists (one per row), got {len(value)} lists")
        rows = [_ids(name, row) for row in value]
        _extend(name, out.ids, itertools.chain.from_iterable(rows))
        out.lengths.extend([len(row) for row in rows])
        return
    ids = _ids(name, value)
    if len(ids):  # an empty shared list is the same as no list: send nothing
        _extend(name, out.ids, ids)
        out.lengths.append(len(ids))


def _set_logit_bias(out: pb.LogitBias, bias: LogitBiasArg, batch: int) -> None:
    """One {token: bias} dict shared by every row, or B dicts (None entries are empty)."""
    if isinstance(bias, Mapping):
        rows: Sequence[Mapping[int, float]] = [bias] if bias else []
    elif isinstance(bias, Sequence) and not isinstance(bias, (str, bytes)):
        if len(bias) != batch:
            raise ValueError(f"logit_bias: expected one dict or {batch} dicts (one per row), got {len(bias)}")
        rows = [{} if row is None else row for row in bias]
        for row in rows:
            if not isinstance(row, Mapping):
                raise TypeError(f"logit_bias: expected a dict {{token_id: bias}} per row, got {type(row).__name__}")
    else:
        raise TypeError(f"logit_bias: expected a dict {{token_id: bias}} or a list of them, got {type(bias).__name__}")
    if not rows:
        return
    _extend("logit_bias", out.tokens.ids, itertools.chain.from_iterable(row.keys() for row in rows))
    _extend("logit_bias", out.values, itertools.chain.from_iterable(row.values() for row in rows))
    out.tokens.lengths.extend([len(row) for row in rows])


def _is_sequence(value: Any) -> bool:
    return _is_array(value) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def _set_breakers(out: pb.TokenSequences, breakers: BreakersArg, batch: int) -> None:
    """One list of breakers shared by every row (no counts), or B lists (counts = B entries)."""
    name = "dry_sequence_breakers"
    if not _is_sequence(breakers):
        raise TypeError(f"{name}: expected a list of token-id sequences or B such lists, got {type(breakers).__name__}")
    # B lists where an entry is None, empty (an empty breaker is never valid) or a list of sequences
    per_row = any(row is None or (_is_sequence(row) and (not len(row) or _is_sequence(row[0]))) for row in breakers)
    if per_row:
        if len(breakers) != batch:
            raise ValueError(f"{name}: expected one list of breakers or {batch} lists (one per row), got {len(breakers)}")
        rows = [[] if row is None else row for row in breakers]
        out.counts.extend([len(row) for row in rows])
    else:
        rows = [breakers]
    for row in rows:
        for sequence in row:
            ids = _ids(name, sequence)
            _extend(name, out.ids, ids)
            out.lengths.append(len(ids))


def _set_bitmask(out: pb.Tensor, bitmask: Array, batch: int) -> None:
    """int32 [B, W] (or [W] for one row) packed words, a torch tensor or a numpy array; uint32 words go as their
    int32 bits."""
    if isinstance(bitmask, np.ndarray) and bitmask.dtype == np.uint32:
        bitmask = bitmask.view(np.int32)
    if not _is_array(bitmask):
        raise TypeError(f"token_bitmask: expected a torch tensor or numpy array, got {type(bitmask).__name__}")
    words = as_array(bitmask)
    if wire_dtype(words.dtype) != pb.DTYPE_INT32:
        raise TypeError(f"token_bitmask: expected int32 words, got {words.dtype}")
    if words.ndim == 1:
        words = words[None]
    if words.ndim != 2 or words.shape[0] != batch:
        raise ValueError(f"token_bitmask: expected shape [{batch}, W] (one row of words per row), got {list(bitmask.shape)}")
    encode_tensor(words, out)


def carried_rows(logits: Any, name: str = "logits") -> Array:
    """[B, N] (or [N], one row) float32/bfloat16/float16 rows as the contiguous host array a request carries.

    Accepts a torch tensor on any device (copied to the CPU) or a numpy array (float32/float16;
    numpy has no bfloat16, use torch for it). `name` is the argument named in errors.
    """
    tensor = as_array(logits)
    if tensor.ndim == 1:
        tensor = tensor[None]
    elif tensor.ndim != 2:
        raise ValueError(f"{name}: expected shape [B, N] or [N], got {list(tensor.shape)}")
    if wire_dtype(tensor.dtype) not in LOGITS_DTYPES:
        raise TypeError(f"{name}: dtype {tensor.dtype} cannot be sent; expected float32, bfloat16 or float16")
    return host_contiguous(tensor)


def encode_logits(logits: Any, out: pb.Tensor, name: str = "logits") -> int:
    """Encodes rows (see carried_rows) into `out`; returns B."""
    rows = carried_rows(logits, name)
    encode_tensor(rows, out)
    return int(rows.shape[0])


def logprobs_mode_value(mode: str | int) -> int:
    """The LogprobsMode of "raw" / "processed" (any case) or of its enum value; ValueError naming the field else."""
    if isinstance(mode, str):
        try:
            return LOGPROBS_MODES[mode.lower()]
        except KeyError:
            raise ValueError(f"logprobs_mode: expected 'raw' or 'processed', got {mode!r}") from None
    if mode not in pb.LogprobsMode.values():
        raise ValueError(f"logprobs_mode: expected 'raw' or 'processed', got {mode!r}")
    return int(mode)


def fill_sampling_params(params: pb.SamplingParams, batch: int, **options: Unpack[SamplingOptions]) -> None:
    """Fills the columns of `params` for `batch` rows (see the module doc for what each accepts)."""
    _check_keywords(options, _SAMPLING_KEYWORDS)
    for name in _COLUMNS:
        value = options.get(name)
        if value is not None:  # 0, 1 or B values; a field is touched only when set (getattr builds it)
            _extend(name, getattr(params, name), _column(name, value, batch))
    _set_seed(params, options.get("seed"), batch)
    for name in _TOKEN_LISTS:
        lists = options.get(name)
        if lists is not None:
            _set_token_lists(getattr(params, name), name, lists, batch)
    if (bias := options.get("logit_bias")) is not None:
        _set_logit_bias(params.logit_bias, bias, batch)
    if (breakers := options.get("dry_sequence_breakers")) is not None:
        _set_breakers(params.dry_sequence_breakers, breakers, batch)
    if (bitmask := options.get("token_bitmask")) is not None:
        _set_bitmask(params.token_bitmask, bitmask, batch)


def build_sample_request(logits: Any = None, *, hidden: Any = None, weights: str | None = None,
                         **options: Unpack[SampleOptions]) -> pb.SampleRequest:
    """A SampleRequest for `logits` ([B, V] or [V]), or for `hidden` states ([B, D] or [D]) through the
    registered LM head named `weights`, with the given parameters (see module doc). Either input may
    be a RegionView (zero copy), logits also RegionRows (rows anywhere in a region); output_tokens /
    output_logprobs name where the server writes those."""
    request = pb.SampleRequest()
    if (logits is None) == (hidden is None):
        raise ValueError("logits, hidden: expected exactly one of them")
    if hidden is not None:
        if not weights:
            raise ValueError("weights: expected the name of a registered LM head with hidden states")
        request.hidden.weights = weights
        if isinstance(hidden, RegionView):
            request.hidden.states_ref.CopyFrom(hidden.ref())
            batch = hidden.shape[0]
        else:
            batch = encode_logits(hidden, request.hidden.states, "hidden")
    elif isinstance(logits, RegionView):
        request.logits_ref.CopyFrom(logits.ref())
        batch = logits.shape[0]
    elif isinstance(logits, RegionRows):
        request.logits_rows.CopyFrom(logits.ref())
        batch = len(logits.row_offsets)
    else:
        batch = encode_logits(logits, request.logits)
    _check_keywords(options, _SAMPLE_KEYWORDS)
    sampling = {name: value for name, value in options.items() if name in _SAMPLING_KEYWORDS}
    if (output_tokens := options.get("output_tokens")) is not None:
        request.output.tokens.CopyFrom(output_tokens.ref())
    if (output_logprobs := options.get("output_logprobs")) is not None:
        request.output.logprobs.CopyFrom(output_logprobs.ref())
    fill_sampling_params(request.params, batch, **sampling)
    fill_request_options(request, options.get("num_samples"), options.get("return_logprobs", False),
                         options.get("top_logprobs", 0), options.get("logprobs_mode", "raw"))
    return request


def fill_request_options(request: pb.SampleRequest, num_samples: int | None, return_logprobs: bool,
                         top_logprobs: int, logprobs_mode: str | int) -> None:
    """A Sample request's own options (num_samples None: the server's default of 1), each refused by its name."""
    if num_samples is not None:
        _set_scalar(request, "num_samples", num_samples)
    _set_scalar(request, "return_logprobs", return_logprobs)
    _set_scalar(request, "top_logprobs", top_logprobs)
    request.logprobs_mode = logprobs_mode_value(logprobs_mode)


def serialize_sample_request(logits: Any = None, **params: Unpack[SampleOptions]) -> bytes:
    """build_sample_request(logits, **params).SerializeToString(), the same bytes, with logits carried in the
    request copied once rather than three times (wire.py)."""
    if logits is None or isinstance(logits, (RegionView, RegionRows)):
        return build_sample_request(logits, **params).SerializeToString()
    rows = carried_rows(logits)
    if 0 in rows.shape:
        return build_sample_request(rows, **params).SerializeToString()
    # The request is built on a [B, 0] view of the rows (no bytes), which sizes and checks every column;
    # the rows themselves go in as it is serialized.
    request = build_sample_request(rows[:, :0], **params)
    request.ClearField("logits")
    return serialize_with_logits(request, rows)
