"""Merges several SampleRequests into one, row blocks in order, for client-side batching.

Batch invariance (docs/semantics.md) makes each row's answer independent of the rows around it, so
the merged call gives every original request exactly the rows it would have got alone. Requests can
merge when their `merge_key`s are equal (same logits dtype and V, same per-request options). Logits
carried as bytes are concatenated. Logits in one region merge into one zero-copy call: into a reference
spanning them when they lie back to back (`follows`), else, where the server takes it (`gather`), into
`logits_rows`, which names each row's place in the region: rows written into one shared buffer by several
threads go out together wherever they lie.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from ._proto import sampler_pb2 as pb
from .tensors import ITEMSIZE

# Per-row columns and the value a row gets when its request sent none (the server's defaults).
COLUMN_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "position": 0,
    "iteration": 0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "num_generated": 0,
    "no_repeat_ngram_size": 0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "typical_p": 1.0,
    "top_n_sigma": 0.0,
    "xtc_threshold": 0.1,
    "xtc_probability": 0.0,
}
TOKEN_LIST_FIELDS = ("allowed_token_ids", "banned_token_ids", "output_token_ids", "prompt_token_ids", "stop_token_ids")


def _logits(request: pb.SampleRequest) -> pb.Tensor | pb.TensorRef:
    return request.logits_ref if request.WhichOneof("input") == "logits_ref" else request.logits


def num_rows(request: pb.SampleRequest) -> int:
    if request.WhichOneof("input") == "logits_rows":
        return len(request.logits_rows.row_offsets)
    return int(_logits(request).shape[0])


def follows(first: pb.SampleRequest, second: pb.SampleRequest) -> bool:
    """Whether `second`'s logits begin where `first`'s end, in the same region."""
    a, b = first.logits_ref, second.logits_ref
    row_bytes = ITEMSIZE[a.dtype] * int(a.shape[1])
    return a.region == b.region and b.offset == a.offset + row_bytes * int(a.shape[0])


def merge_key(request: pb.SampleRequest) -> Hashable:
    """Requests with equal keys can share one call (region references: when they also follow each other);
    hidden states and output regions go alone."""
    kind = request.WhichOneof("input")
    logits = _logits(request)
    if kind not in ("logits", "logits_ref") or request.HasField("output") or len(logits.shape) != 2:
        return ("alone", id(request))
    return (
        logits.region if kind == "logits_ref" else None,
        logits.dtype,
        tuple(logits.shape[1:]),
        request.num_samples if request.HasField("num_samples") else 1,
        request.return_logprobs,
        request.logprobs_mode or pb.LOGPROBS_MODE_RAW,
        request.top_logprobs,
    )


def _expand(values: Sequence, rows: int, default: object) -> list:
    """A 0/1/B-valued column as B values; any other count is left for the server to reject alone."""
    if len(values) == rows:
        return list(values)
    if len(values) > 1:
        raise ValueError(f"a column of {len(values)} values for {rows} rows cannot be merged")
    return [values[0] if len(values) == 1 else default] * rows


def _expand_lists(lists: pb.TokenLists, rows: int, values: Sequence[float] = ()) -> tuple[list[int], list[int], list[float]]:
    """Per-row (lengths, ids, values) of TokenLists with 0, 1 or B lengths; `values` run alongside ids."""
    if len(lists.lengths) == 0:
        return [0] * rows, [], []
    if len(lists.lengths) == 1:
        return list(lists.lengths) * rows, list(lists.ids) * rows, list(values) * rows
    if len(lists.lengths) != rows:
        raise ValueError(f"{len(lists.lengths)} token lists for {rows} rows cannot be merged")
    return list(lists.lengths), list(lists.ids), list(values)


def _expand_sequences(sequences: pb.TokenSequences, rows: int) -> tuple[list[int], list[int], list[int]]:
    """Per-row (counts, lengths, ids) of TokenSequences with 0 or B counts."""
    if len(sequences.counts) == 0:
        return [len(sequences.lengths)] * rows, list(sequences.lengths) * rows, list(sequences.ids) * rows
    if len(sequences.counts) != rows:
        raise ValueError(f"{len(sequences.counts)} sequence counts for {rows} rows cannot be merged")
    return list(sequences.counts), list(sequences.lengths), list(sequences.ids)


def _bitmask_words(request: pb.SampleRequest, rows: int, words: int) -> bytes:
    """The request's token_bitmask as `rows` rows of `words` int32 words: its first words (the later ones hold no
    token's bit), or all ones (unrestricted) when it has none."""
    if not request.params.HasField("token_bitmask"):
        return b"\xff" * (4 * rows * words)
    mask = request.params.token_bitmask
    shape = list(mask.shape)
    if mask.dtype != pb.DTYPE_INT32 or len(shape) != 2 or shape[0] != rows or shape[1] < words \
            or len(mask.data) != 4 * rows * shape[1]:
        raise ValueError("a token_bitmask that is not int32 [B, W >= ceil(V / 32)] cannot be merged")
    if shape[1] == words:
        return mask.data
    return np.frombuffer(mask.data, dtype="<i4").reshape(rows, shape[1])[:, :words].tobytes()


def _row_starts(ref: pb.TensorRef) -> range:
    """Where each row of a [B, V] region reference starts, in bytes from the region's start."""
    row_bytes = ITEMSIZE[ref.dtype] * int(ref.shape[1])
    return range(ref.offset, ref.offset + row_bytes * int(ref.shape[0]), row_bytes)


def merge_requests(requests: Sequence[pb.SampleRequest], *, gather: bool = False) -> pb.SampleRequest:
    """One request whose rows are the rows of `requests`, in order. All must share a merge_key.

    Region references that do not follow each other merge only with `gather` (the server lists the feature
    "region_rows"). Raises ValueError for requests that must be sent alone: malformed columns, or region
    references that cannot be merged.
    """
    if len(requests) == 1:
        return requests[0]
    first = requests[0]
    merged = pb.SampleRequest()
    row_counts = [num_rows(r) for r in requests]
    rows = sum(row_counts)
    if first.WhichOneof("input") == "logits_ref":
        if all(follows(a, b) for a, b in itertools.pairwise(requests)):
            merged.logits_ref.CopyFrom(first.logits_ref)
            merged.logits_ref.shape[0] = rows
        elif gather:
            ref, rows_ref = first.logits_ref, merged.logits_rows
            rows_ref.region, rows_ref.dtype, rows_ref.row_size = ref.region, ref.dtype, ref.shape[1]
            for r in requests:
                rows_ref.row_offsets.extend(_row_starts(r.logits_ref))
        else:
            raise ValueError("region references that do not follow each other cannot be merged by this server")
    else:
        merged.logits.dtype = first.logits.dtype
        merged.logits.shape[:] = [rows, *first.logits.shape[1:]]
        merged.logits.data = b"".join(r.logits.data for r in requests)
    if first.HasField("num_samples"):
        merged.num_samples = first.num_samples
    merged.return_logprobs = first.return_logprobs
    merged.logprobs_mode = first.logprobs_mode
    merged.top_logprobs = first.top_logprobs

    params = merged.params
    # The fields any request sets (ListFields lists the set ones alone): a decode loop's calls set a few.
    present = set().union(*({field.name for field, _ in r.params.ListFields()} for r in requests))
    for name in present.intersection(COLUMN_DEFAULTS):
        columns = [getattr(r.params, name) for r in requests]
        if all(len(column) == 1 and column[0] == columns[0][0] for column in columns):
            getattr(params, name).append(columns[0][0])  # one value every row shares stays one value
            continue
        default = COLUMN_DEFAULTS[name]
        for column, count in zip(columns, row_counts):
            getattr(params, name).extend(_expand(column, count, default))
    if "seed" in present:
        for r, count in zip(requests, row_counts):
            params.seed.extend(_expand(r.params.seed, count, 0))
            has_seed = list(r.params.has_seed) if len(r.params.has_seed) else [len(r.params.seed) > 0] * count
            params.has_seed.extend(has_seed)
    for name in present.intersection(TOKEN_LIST_FIELDS):
        for r, count in zip(requests, row_counts):
            lengths, ids, _ = _expand_lists(getattr(r.params, name), count)
            getattr(params, name).lengths.extend(lengths)
            getattr(params, name).ids.extend(ids)
    if "logit_bias" in present:
        for r, count in zip(requests, row_counts):
            bias = r.params.logit_bias
            lengths, ids, values = _expand_lists(bias.tokens, count, bias.values)
            params.logit_bias.tokens.lengths.extend(lengths)
            params.logit_bias.tokens.ids.extend(ids)
            params.logit_bias.values.extend(values)
    if "token_bitmask" in present:
        words = -(-int(_logits(first).shape[1]) // 32)
        merged_mask = params.token_bitmask
        merged_mask.dtype, merged_mask.shape[:] = pb.DTYPE_INT32, [rows, words]
        merged_mask.data = b"".join(_bitmask_words(r, count, words) for r, count in zip(requests, row_counts))
    if "dry_sequence_breakers" in present:
        merged_breakers = params.dry_sequence_breakers
        for r, count in zip(requests, row_counts):
            counts, lengths, ids = _expand_sequences(r.params.dry_sequence_breakers, count)
            merged_breakers.counts.extend(counts)
            merged_breakers.lengths.extend(lengths)
            merged_breakers.ids.extend(ids)
    return merged
