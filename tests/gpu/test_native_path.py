"""The native path (csrc/native_path.cpp, native_path.py) against the Python path.

In process, no RPC: a CUDA tensor of this process stands for a registered CUDA region. Every request the
native path answers must get the response the Python path gives it (validation/sample.py + the CUDA backend):
the same tokens, flags and seeds, to the bit, since both launch the same kernels on the same rows. Every
request it must leave to the Python path (other inputs, log-probs, processing, output regions, errors)
must be declined. Requests queued together are sampled as one batch, each answered as alone. Then the server
end to end: unary and stream over a CUDA region, metrics included, and concurrent calls merged.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.core.config import Limits
from tokensampler_server.resources.regions import Region
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.rpc.sample_rpc import referenced_input
from tokensampler_server.validation.sample import validate_sample_request

from ..conftest import RunningServer, start_server
from .conftest import degenerate_rows, logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

LIMITS = Limits(max_batch_rows=512, max_batch_elements=512 * 151936)
TORCH_TO_PROTO = {torch.float32: pb.DTYPE_FLOAT32, torch.bfloat16: pb.DTYPE_BFLOAT16, torch.float16: pb.DTYPE_FLOAT16}
REGION = "native-test-region"
REGION_BYTES = 256 << 20


@pytest.fixture(scope="module")
def region_buffer() -> torch.Tensor:
    return torch.zeros(REGION_BYTES, dtype=torch.uint8, device="cuda")


def make_path(cuda_backend, **batching):
    """The native path of the CUDA backend, queueing on a batcher of its own (`batching`: the batcher's queue
    options)."""
    from tokensampler_server.batching.batcher import DynamicBatcher
    from tokensampler_server.rpc.native_path import NativePath

    batcher = DynamicBatcher(cuda_backend, max_batch_rows=LIMITS.max_batch_rows,
                             max_batch_elements=LIMITS.max_batch_elements, **batching)
    return NativePath.for_backend(cuda_backend, LIMITS, batcher)


@pytest.fixture(scope="module")
def native(cuda_backend, region_buffer: torch.Tensor):
    path = make_path(cuda_backend)
    path.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None))
    return path


def put(region_buffer: torch.Tensor, x: torch.Tensor, offset: int = 0) -> pb.TensorRef:
    """Writes x into the region at `offset` and returns the reference to it."""
    raw = x.contiguous().view(torch.uint8).flatten()
    region_buffer[offset: offset + raw.numel()].copy_(raw)
    torch.cuda.synchronize()
    return pb.TensorRef(region=REGION, offset=offset, dtype=TORCH_TO_PROTO[x.dtype], shape=list(x.shape))


def python_answer(cuda_backend, request: pb.SampleRequest, region_buffer: torch.Tensor) -> pb.SampleResponse:
    """What the Python path answers (sample_rpc.py's steps): the region reference resolved by regions.py (or
    the carried logits decoded), validation/sample.py's batch, the CUDA backend. Its errors raise (ServiceError)."""
    kind = request.WhichOneof("input")
    referenced = None
    if kind != "logits":
        if kind not in ("logits_ref", "logits_rows") or getattr(request, kind).region != REGION:
            raise ServiceError("not a request for this test's region")
        region = Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None)
        referenced = referenced_input(region, getattr(request, kind), kind, LIMITS)
    batch, seeds = validate_sample_request(request, LIMITS, referenced=referenced)
    result = cuda_backend.sample(batch)
    return pb.SampleResponse(
        tokens=pb.Tensor(dtype=pb.DTYPE_INT32, shape=list(result.tokens.shape),
                         data=result.tokens.to(torch.int32).numpy().tobytes()),
        seeds=seeds.tolist(), valid=result.valid.tolist(), nan_detected=result.nan_detected.tolist())


def answer_alone(native, raw: bytes, request_id: str, stream_message: bool):
    """The native path's answer to one request submitted alone (its own launch), or None: declined."""
    return asyncio.run(native.sample(raw, request_id, stream_message))


def assert_same_answer(native, cuda_backend, region_buffer: torch.Tensor, request: pb.SampleRequest) -> pb.SampleResponse:
    answer = answer_alone(native, request.SerializeToString(), "rid-1", False)
    assert answer is not None, "declined a request it should answer"
    got = pb.SampleResponse.FromString(answer.response)
    if not request.params.has_seed and not request.params.seed:  # fresh seeds: replay them on the Python path
        request = pb.SampleRequest.FromString(request.SerializeToString())
        request.params.seed[:] = got.seeds
    elif list(request.params.has_seed) and not all(request.params.has_seed):
        request = pb.SampleRequest.FromString(request.SerializeToString())
        request.params.seed[:] = got.seeds
        del request.params.has_seed[:]
    expected = python_answer(cuda_backend, request, region_buffer)
    assert got.tokens.dtype == pb.DTYPE_INT32 and list(got.tokens.shape) == list(expected.tokens.shape)
    assert got.tokens.data == expected.tokens.data
    assert list(got.seeds) == list(expected.seeds)
    assert list(got.valid) == list(expected.valid) and list(got.nan_detected) == list(expected.nan_detected)
    assert got.request_id == "rid-1" and got.timings.total_ns >= got.timings.compute_ns > 0
    rows = len(expected.valid)
    assert answer.batch_rows == rows and sum(answer.rows_by_mode) == rows
    return got


@pytest.mark.parametrize("mode, params", [
    ("greedy", dict(temperature=[0.0])),
    ("gumbel", dict(temperature=[0.8])),
    ("top_k_top_p", dict(top_k=[50], top_p=[0.9])),
    ("top_p", dict(top_p=[0.9])),
    ("min_p", dict(min_p=[0.05])),
    ("top_p_min_p", dict(temperature=[0.7], top_p=[0.8], min_p=[0.02])),
    ("large_k", dict(top_k=[1000], top_p=[0.95])),
    ("k_of_minus_one_and_k_past_v", dict(top_k=[-1])),
])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("input_kind", ["logits_ref", "logits"])
def test_uniform_rows_match_the_python_path(native, cuda_backend, region_buffer, mode: str, params: dict,
                                            rows: int, input_kind: str) -> None:
    """Logits in the region, or carried in the request's bytes (uploaded from them)."""
    x = logits("spiky" if rows != 3 else "flat", rows, 151936, seed=rows).cuda()
    logits_input = {input_kind: put(region_buffer, x) if input_kind == "logits_ref" else encode_tensor(x)}
    request = pb.SampleRequest(**logits_input, params=pb.SamplingParams(
        seed=[11 * r + 5 for r in range(rows)], position=[r % 7 for r in range(rows)], iteration=[2], **params))
    assert_same_answer(native, cuda_backend, region_buffer, request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [2, 3, 1000, 32000])
@pytest.mark.parametrize("input_kind", ["logits_ref", "logits"])
def test_mixed_rows_every_dtype_and_vocabulary(native, cuda_backend, region_buffer, dtype: torch.dtype,
                                               vocab: int, input_kind: str) -> None:
    """One row per mode and again (top-p past 32 rows takes the frontier), per-row columns."""
    rows = 40
    gen = torch.Generator().manual_seed(vocab)
    x = logits("spiky", rows, vocab, seed=vocab, dtype=dtype).cuda()
    temperature = [0.0 if r % 6 == 0 else 0.5 + float(torch.rand(1, generator=gen)) for r in range(rows)]
    top_k = [[0, 5, 0, 0, 300, -1][r % 6] for r in range(rows)]
    top_p = [[1.0, 0.9, 0.7, 1.0, 1.0, 1.0][r % 6] for r in range(rows)]
    min_p = [[0.0, 0.0, 0.1, 0.05, 0.0, 0.0][r % 6] for r in range(rows)]
    logits_input = {input_kind: put(region_buffer, x) if input_kind == "logits_ref" else encode_tensor(x)}
    request = pb.SampleRequest(**logits_input, params=pb.SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=[r * 3 + 1 for r in range(rows)]))
    assert_same_answer(native, cuda_backend, region_buffer, request)


def rows_at(region_buffer: torch.Tensor, x: torch.Tensor, order: list[int], offset: int) -> pb.RowsRef:
    """Writes x's rows into the region from `offset` on, one element apart (so every other row starts off the
    16-byte grid the kernels' vector loads want), and returns the reference gathering rows `order` of x."""
    stride = (x.shape[1] + 1) * x.element_size()
    for i in range(x.shape[0]):
        put(region_buffer, x[i], offset + i * stride)
    return pb.RowsRef(region=REGION, dtype=TORCH_TO_PROTO[x.dtype], row_size=x.shape[1],
                      row_offsets=[offset + i * stride for i in order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_gathered_from_anywhere_in_the_region_match_the_python_path(native, cuda_backend, region_buffer,
                                                                         dtype: torch.dtype) -> None:
    """logits_rows: rows out of order, one repeated, none 16-byte aligned in half of them, every mode; and 300
    top-p rows (the frontier route). The Python path copies the rows together; the kernels read them in place."""
    x = logits("spiky", 8, 151936, seed=12, dtype=dtype).cuda()
    order = [5, 0, 7, 7, 2, 1, 6, 3, 4]
    params = pb.SamplingParams(temperature=[0.0, 0.8, 0.7, 1.0, 1.0, 0.9, 1.2, 1.0, 0.6],
                               top_k=[0, 0, 50, 0, 0, 1000, 0, 0, 5], top_p=[1.0, 1.0, 0.9, 0.9, 1.0, 0.95, 1.0, 1.0, 1.0],
                               min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0], seed=list(range(9)))
    request = pb.SampleRequest(logits_rows=rows_at(region_buffer, x, order, offset=1024), params=params)
    got = assert_same_answer(native, cuda_backend, region_buffer, request)
    tokens = torch.frombuffer(bytearray(got.tokens.data), dtype=torch.int32)
    assert tokens[0] == x[5].float().argmax()  # the greedy row read row 5

    many = logits("flat", 300, 32000, seed=13, dtype=dtype).cuda()
    order = list(range(299, -1, -1))
    request = pb.SampleRequest(logits_rows=rows_at(region_buffer, many, order, offset=64 << 20),
                               params=pb.SamplingParams(top_p=[0.9], seed=list(range(300))))
    assert_same_answer(native, cuda_backend, region_buffer, request)


def test_frontier_rows_and_degenerate_rows(native, cuda_backend, region_buffer) -> None:
    x = degenerate_rows(300, 151936, torch.device("cuda"))
    request = pb.SampleRequest(logits_ref=put(region_buffer, x, offset=4096), params=pb.SamplingParams(
        top_p=[0.9], seed=list(range(300))))
    got = assert_same_answer(native, cuda_backend, region_buffer, request)
    assert list(got.valid)[:3] == [False, True, True] and list(got.nan_detected)[:3] == [False, True, False]
    assert list(got.tokens.data[:4]) == list((-1).to_bytes(4, "little", signed=True))


def test_fresh_and_partly_given_seeds(native, cuda_backend, region_buffer) -> None:
    x = logits("flat", 8, 1000, seed=3).cuda()
    fresh = pb.SampleRequest(logits_ref=put(region_buffer, x))  # no params at all: T = 1, fresh seeds
    first = assert_same_answer(native, cuda_backend, region_buffer, fresh)
    again = pb.SampleResponse.FromString(answer_alone(native, fresh.SerializeToString(), "rid-2", False).response)
    assert list(first.seeds) != list(again.seeds)  # 8 fresh 64-bit seeds twice: equal with probability 2^-512
    partly = pb.SampleRequest(logits_ref=put(region_buffer, x), params=pb.SamplingParams(
        seed=list(range(8)), has_seed=[True, False] * 4))
    got = assert_same_answer(native, cuda_backend, region_buffer, partly)
    assert list(got.seeds)[0::2] == [0, 2, 4, 6]


def test_a_stream_message_wraps_the_response(native, region_buffer) -> None:
    x = logits("spiky", 2, 1000, seed=4).cuda()
    request = pb.SampleRequest(logits_ref=put(region_buffer, x), params=pb.SamplingParams(temperature=[0.0]))
    answer = answer_alone(native, request.SerializeToString(), "s.0", True)
    message = pb.SampleStreamResponse.FromString(answer.response)
    assert message.WhichOneof("result") == "response" and message.response.request_id == "s.0"
    tokens = torch.frombuffer(bytearray(message.response.tokens.data), dtype=torch.int32)
    assert torch.equal(tokens.long(), x.float().argmax(dim=1).cpu())


def _input_with(kind: str, ref: pb.TensorRef | pb.RowsRef, **fields) -> bytes:
    """A request whose input `kind` is a copy of `ref` with `fields` changed (lists replace repeated fields)."""
    changed = type(ref)()
    changed.CopyFrom(ref)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(changed, name)[:] = value
        else:
            setattr(changed, name, value)
    return pb.SampleRequest(**{kind: changed}).SerializeToString()


def _declined_requests(ref: pb.TensorRef) -> dict[str, bytes]:
    def request(**fields) -> bytes:
        return pb.SampleRequest(logits_ref=ref, **fields).SerializeToString()

    def params(**fields) -> bytes:
        return request(params=pb.SamplingParams(**fields))

    def ref_with(**fields) -> bytes:
        return _input_with("logits_ref", ref, **fields)

    return {
        "hidden states": pb.SampleRequest(hidden=pb.HiddenStates(weights="w")).SerializeToString(),
        "no input": pb.SampleRequest(params=pb.SamplingParams(temperature=[0.0])).SerializeToString(),
        "log-probs": request(return_logprobs=True),
        "top log-probs": request(top_logprobs=3),
        "bad log-probs mode": request(logprobs_mode=7),
        "two samples": request(num_samples=2),
        "zero samples": request(num_samples=0),
        "output region": request(output=pb.OutputRefs(tokens=ref)),
        "penalty": params(repetition_penalty=[1.1]),
        "banned tokens": params(banned_token_ids=pb.TokenLists(ids=[1], lengths=[1])),
        "negative temperature": params(temperature=[-1.0]),
        "nan temperature": params(temperature=[float("nan")]),
        "infinite temperature": params(temperature=[float("inf")]),
        "k below -1": params(top_k=[-2]),
        "p of 0": params(top_p=[0.0]),
        "p above 1": params(top_p=[1.5]),
        "min_p above 1": params(min_p=[1.0000001]),
        "two values for three rows": params(temperature=[1.0, 0.5]),
        "has_seed without seeds": params(has_seed=[True, True, True]),
        "has_seed of one row": params(seed=[1], has_seed=[True]),
        "unknown region": ref_with(region="nobody"),
        "past the region's end": ref_with(offset=REGION_BYTES - 64),
        "misaligned offset": ref_with(offset=2),
        "int32 dtype": ref_with(dtype=pb.DTYPE_INT32),
        "three dimensions": ref_with(shape=[3, 10, 10]),
        "no rows": ref_with(shape=[0, 10]),
        "rows past the limit": ref_with(shape=[LIMITS.max_batch_rows + 1, 10]),
        "elements past the limit": ref_with(shape=[2, LIMITS.max_batch_elements]),
        "garbage": b"\xff\xff\xff",
        "truncated": request()[:-1],
    }


def _declined_rows_requests(rows: pb.RowsRef) -> dict[str, bytes]:
    def rows_with(**fields) -> bytes:
        return _input_with("logits_rows", rows, **fields)

    both = pb.SampleRequest(logits_ref=pb.TensorRef(region=REGION, dtype=rows.dtype, shape=[1, rows.row_size]))
    return {
        "unknown region": rows_with(region="nobody"),
        "a row past the region's end": rows_with(row_offsets=[0, REGION_BYTES - 64]),
        "a misaligned row": rows_with(row_offsets=[0, 2]),
        "int32 dtype": rows_with(dtype=pb.DTYPE_INT32),
        "no rows": rows_with(row_offsets=[]),
        "rows of no elements": rows_with(row_size=0),
        "rows past the limit": rows_with(row_offsets=[0] * (LIMITS.max_batch_rows + 1)),
        "elements past the limit": rows_with(row_size=LIMITS.max_batch_elements),
        "a row size past int64": rows_with(row_size=1 << 63),
        "two oneof cases (the last would win)": both.SerializeToString() + rows_with(),
        "log-probs": pb.SampleRequest(logits_rows=rows, return_logprobs=True).SerializeToString(),
    }


def _declined_carried_requests(x: torch.Tensor, ref: pb.TensorRef) -> dict[str, bytes]:
    tensor = encode_tensor(x)

    def tensor_with(**fields) -> bytes:
        return _input_with("logits", tensor, **fields)

    unknown_field = pb.SampleRequest()
    unknown_field.logits.MergeFromString(tensor.SerializeToString() + b"\x20\x01")  # field 4, a varint

    return {
        "int32 dtype": tensor_with(dtype=pb.DTYPE_INT32, data=tensor.data),
        "no dtype": tensor_with(dtype=pb.DTYPE_UNSPECIFIED),
        "three dimensions": tensor_with(shape=[3, 10, 10]),
        "one dimension": tensor_with(shape=[300]),
        "no rows": tensor_with(shape=[0, 100], data=b""),
        "a byte short": tensor_with(data=tensor.data[:-1]),
        "a byte over": tensor_with(data=tensor.data + b"\0"),
        "no bytes": tensor_with(data=b""),
        "rows past the limit": tensor_with(shape=[LIMITS.max_batch_rows + 1, 1], data=bytes(4 * (LIMITS.max_batch_rows + 1))),
        "elements past the limit": tensor_with(shape=[1, LIMITS.max_batch_elements + 1]),
        "an unknown Tensor field": unknown_field.SerializeToString(),
        "a region reference beside": _input_with("logits", tensor) + pb.SampleRequest(logits_ref=ref).SerializeToString(),
        "log-probs": pb.SampleRequest(logits=tensor, return_logprobs=True).SerializeToString(),
    }


def test_everything_else_is_declined(native, region_buffer) -> None:
    x = logits("flat", 3, 100, seed=5).cuda()
    ref = put(region_buffer, x)
    for name, raw in _declined_requests(ref).items():
        assert answer_alone(native, raw, "rid", False) is None, name
    assert answer_alone(native, pb.SampleRequest(logits=encode_tensor(x)).SerializeToString(), "rid", False) is not None
    for name, raw in _declined_carried_requests(x, ref).items():
        assert answer_alone(native, raw, "rid", False) is None, name
    rows = rows_at(region_buffer, x, [2, 0], offset=4096)
    assert answer_alone(native, pb.SampleRequest(logits_rows=rows).SerializeToString(), "rid", False) is not None
    for name, raw in _declined_rows_requests(rows).items():
        assert answer_alone(native, raw, "rid", False) is None, name


def test_removed_region_and_dead_producer_are_declined(cuda_backend, region_buffer) -> None:

    path = make_path(cuda_backend)
    raw = pb.SampleRequest(logits_ref=put(region_buffer, logits("flat", 2, 100, seed=6).cuda())).SerializeToString()
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None,
                             producer_pid=int(exited.stdout)))
    assert answer_alone(path, raw, "rid", False) is None  # its producer has exited
    path.region_removed(REGION)
    path.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None))
    assert answer_alone(path, raw, "rid", False) is not None
    path.region_removed(REGION)
    assert answer_alone(path, raw, "rid", False) is None
    path.region_added(Region(name=REGION, kind="shm", buffer=torch.zeros(REGION_BYTES, dtype=torch.uint8),
                             release=lambda: None))
    assert answer_alone(path, raw, "rid", False) is None  # shared-memory regions take the Python path


def _same_tokens(got: pb.SampleResponse, expected: pb.SampleResponse) -> bool:
    return (got.tokens == expected.tokens and got.seeds == expected.seeds and got.valid == expected.valid
            and got.nan_detected == expected.nan_detected)


def test_queued_requests_are_sampled_as_one_batch_each_answered_as_alone(cuda_backend, native,
                                                                        region_buffer) -> None:
    """Seven seeded requests queued together (a queue delay): one batch per vocabulary and dtype, contiguous,
    gathered and carried rows of mixed modes merged. Every answer equals the same request's answer alone, to the
    bit (batch invariance)."""

    queued = make_path(cuda_backend, max_queue_delay_us=20_000)
    queued.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None))
    x1, x2 = logits("spiky", 6, 1000, seed=30).cuda(), logits("flat", 5, 1000, seed=31).cuda()
    x3 = logits("spiky", 4, 1000, seed=32)
    x4, x5 = logits("spiky", 3, 700, seed=33).cuda(), logits("spiky", 3, 1000, seed=34).half().cuda()
    requests = [
        pb.SampleRequest(logits_ref=put(region_buffer, x1), params=pb.SamplingParams(
            top_k=[50], top_p=[0.9], seed=list(range(6)))),
        pb.SampleRequest(logits_ref=put(region_buffer, x2, 1 << 20), params=pb.SamplingParams(
            temperature=[0.0], seed=list(range(5)))),
        pb.SampleRequest(logits_rows=rows_at(region_buffer, x1, [5, 0, 3], offset=2 << 20),
                         params=pb.SamplingParams(min_p=[0.1], seed=[7, 8, 9])),
        pb.SampleRequest(logits=encode_tensor(x3), params=pb.SamplingParams(temperature=[0.7], seed=[11])),
        pb.SampleRequest(logits_ref=put(region_buffer, x4, 3 << 20), params=pb.SamplingParams(
            top_p=[0.8], seed=[1, 2, 3])),
        pb.SampleRequest(logits_ref=put(region_buffer, x5, 4 << 20), params=pb.SamplingParams(
            top_k=[20], seed=[4, 5, 6])),
        pb.SampleRequest(logits_ref=put(region_buffer, x2, 1 << 20), params=pb.SamplingParams(
            top_p=[0.5], seed=[12], position=[3])),
    ]
    raws = [request.SerializeToString() for request in requests]
    alone = [answer_alone(native, raw, f"a{i}", False) for i, raw in enumerate(raws)]

    async def together():
        return await asyncio.gather(*[queued.submit(raw, f"m{i}", False) for i, raw in enumerate(raws)])

    merged = asyncio.run(together())
    assert [answer.batch_rows for answer in merged] == [23, 23, 23, 23, 3, 3, 23]
    for i, (got, expected) in enumerate(zip(merged, alone)):
        assert expected.batch_rows == len(pb.SampleResponse.FromString(expected.response).valid)
        assert _same_tokens(pb.SampleResponse.FromString(got.response),
                            pb.SampleResponse.FromString(expected.response)), i
    assert pb.SampleResponse.FromString(merged[1].response).timings.queue_ns >= 10_000_000  # the delay


def test_a_waiting_request_whose_region_goes_is_declined(cuda_backend, region_buffer) -> None:
    """A queued request whose region is unregistered before it is sampled is declined (the Python path answers it
    NOT_FOUND), and the path goes on serving."""

    path = make_path(cuda_backend, max_queue_delay_us=20_000)
    path.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None))
    raw = pb.SampleRequest(logits_ref=put(region_buffer, logits("spiky", 3, 1000, seed=35).cuda()),
                           params=pb.SamplingParams(temperature=[0.0])).SerializeToString()

    async def run():
        queued = path.submit(raw, "r1", False)
        path.region_removed(REGION)
        return await queued

    assert asyncio.run(run()) is None
    assert answer_alone(path, raw, "r3", False) is None
    path.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None))
    assert answer_alone(path, raw, "r4", False) is not None


def test_the_queue_is_bounded_and_a_delay_gathers_requests(cuda_backend, region_buffer) -> None:
    """Past max_queue_rows queued rows a request gets RESOURCE_EXHAUSTED at once; with max_queue_delay_us a
    lone request waits that long for others, which join its batch."""
    import grpc

    raw = pb.SampleRequest(logits_ref=put(region_buffer, logits("spiky", 6, 1000, seed=36).cuda()),
                           params=pb.SamplingParams(seed=list(range(6)))).SerializeToString()
    bounded = make_path(cuda_backend, max_queue_rows=10, max_queue_delay_us=20_000)
    delayed = make_path(cuda_backend, max_queue_delay_us=50_000)
    for path in (bounded, delayed):
        path.region_added(Region(name=REGION, kind="cuda_ipc", buffer=region_buffer, release=lambda: None))

    async def overfill():
        queued = bounded.submit(raw, "r1", False)
        with pytest.raises(ServiceError) as raised:
            bounded.submit(raw, "r2", False)
        return raised.value, await queued

    refused, answered = asyncio.run(overfill())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 10" in refused.message
    assert answered.batch_rows == 6

    async def gathered():
        first = delayed.submit(raw, "d1", False)
        # One loop turn later: the delay's timer, even if already due, runs after this task in that turn.
        await asyncio.sleep(0)
        second = delayed.submit(raw, "d2", False)
        return await first, await second

    first, second = asyncio.run(gathered())
    assert first.batch_rows == second.batch_rows == 12 and first.response != second.response


@pytest.fixture(scope="module")
def servers():
    native = start_server("--device", "cuda", "--allow-cuda-ipc", "--metrics-port", "0", timeout=300)
    python = start_server("--device", "cuda", "--allow-cuda-ipc", "--no-native-path", "--metrics-port", "0",
                          timeout=300)
    yield native, python
    native.stop()
    python.stop()


def _metric(server: RunningServer, sample: str) -> float:
    """The value of one Prometheus sample (its name and labels as exposed) on `server`; 0 when absent."""
    port = next(int(m.group(1)) for line in server.log if (m := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line)))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _rows_total(server: RunningServer, mode: str) -> float:
    return _metric(server, f'tokensampler_rows_total{{mode="{mode}"}}')


def test_server_native_and_python_paths_answer_alike(servers) -> None:
    """Unary and stream over one CUDA region, and with the logits carried in the request: the native server
    equals the --no-native-path one, and its metrics count the rows it answered natively."""
    native_server, python_server = servers
    assert any("native path on" in line for line in native_server.log)
    x = logits("spiky", 48, 151936, seed=8).cuda()
    torch.cuda.synchronize()
    answers = []
    for server in (native_server, python_server):
        with SamplerClient(server.target, timeout=300) as client:
            region = client.register_cuda_region("e2e", x)
            try:
                view = region.view_of(x)
                unary = [client.sample(view, top_k=50, top_p=0.9, seed=list(range(48))).tokens,
                         client.sample(view, top_p=0.9, seed=list(range(48))).tokens,
                         client.sample(view, temperature=0.0).tokens]
                with client.stream() as stream:
                    streamed = [stream.sample(view, min_p=0.05, seed=list(range(48)), position=step).tokens
                                for step in range(3)]
                    streamed.append(stream.sample(x.cpu(), top_p=0.8, seed=list(range(48))).tokens)
                carried_logits = [client.sample(x.cpu(), top_k=50, top_p=0.9, seed=list(range(48))).tokens,
                                  client.sample(x.cpu().half(), temperature=0.7, seed=list(range(48))).tokens]
            finally:
                client.unregister_region(region)
        answers.append(unary + streamed + carried_logits)
    for got, expected in zip(*answers):
        assert torch.equal(got, expected)
    assert torch.equal(answers[0][2][:, 0], x.argmax(dim=1).cpu())
    assert _rows_total(native_server, "top_k") >= 48 and _rows_total(native_server, "min_p") >= 3 * 48


def test_rows_of_a_cuda_tensor_through_both_servers(servers) -> None:
    """CudaRegion.rows_of: the rows a caller names, in its order, answered alike by the native and Python paths."""
    x = logits("spiky", 48, 151936, seed=16).cuda()
    torch.cuda.synchronize()
    order = [5, 1, 1, 40, 47]
    answers = []
    for server in servers:
        with SamplerClient(server.target, timeout=300) as client:
            region = client.register_cuda_region("rows-of", x)
            try:
                rows = region.rows_of(x, order)
                answers.append([client.sample(rows, temperature=0.0).tokens,
                                client.sample(rows, top_k=50, top_p=0.9, seed=list(range(5))).tokens])
            finally:
                client.unregister_region(region)
    for got, expected in zip(*answers):
        assert torch.equal(got, expected)
    assert answers[0][0][:, 0].tolist() == x[order].argmax(dim=1).tolist()


def test_client_batching_over_slices_with_gaps_answers_as_each_call_alone(servers) -> None:
    """8 threads, each with a 2-row slice of one CUDA buffer and a gap after it: BatchingClient merges their calls
    into logits_rows, which the native path reads in place; every caller gets what it gets alone."""
    from tokensampler_client import BatchingClient

    native_server, _ = servers
    threads, rows, steps = 8, 2, 6
    x = logits("spiky", threads * 2 * rows, 151936, seed=15).cuda()
    torch.cuda.synchronize()
    results: dict[tuple[int, int], object] = {}
    with SamplerClient(native_server.target, timeout=300) as client:
        region = client.register_cuda_region("gaps", x)
        try:
            views = [region.view(torch.float32, (rows, 151936), offset=t * 2 * rows * 151936 * 4) for t in range(threads)]
            with BatchingClient(client, max_rows=64, max_delay_us=5000) as batcher:
                def worker(thread: int) -> None:
                    for step in range(steps):
                        results[thread, step] = batcher.sample(views[thread], top_k=50, top_p=0.9,
                                                               seed=[thread, step], position=step)

                workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
            for (thread, step), result in results.items():
                alone = client.sample(views[thread], top_k=50, top_p=0.9, seed=[thread, step], position=step)
                assert torch.equal(result.tokens, alone.tokens), (thread, step)
        finally:
            client.unregister_region(region)
    assert len({result.request_id for result in results.values()}) < len(results)


def test_a_stream_goes_on_in_order_past_a_message_the_native_path_declines(servers) -> None:
    """Native answers, then a message for the Python path, an invalid one and a native one again: every
    answer in order, the stream open throughout."""
    from tokensampler_client import TokenSamplerError

    native_server, _ = servers
    x = logits("spiky", 4, 1000, seed=9).cuda()
    torch.cuda.synchronize()
    with SamplerClient(native_server.target, timeout=300) as client:
        region = client.register_cuda_region("mixed", x)
        try:
            view = region.view_of(x)
            with client.stream() as stream:
                stream.send(view, temperature=0.0)
                stream.send(view, temperature=0.0, return_logprobs=True)
                stream.send(view, temperature=-1.0)
                stream.send(view, temperature=0.0)
                first, second = stream.receive(), stream.receive()
                with pytest.raises(TokenSamplerError) as raised:
                    stream.receive()
                fourth = stream.receive()
        finally:
            client.unregister_region(region)
    argmax = x.argmax(dim=1).cpu()
    for result in (first, second, fourth):
        assert torch.equal(result.tokens[:, 0], argmax)
    assert first.logprobs is None and second.logprobs is not None
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert first.request_id.endswith(".0") and fourth.request_id.endswith(".3")


def _answered_mutations(native, cuda_backend, region_buffer, bases: list[bytes], count: int, seed: int) -> int:
    """Sends `count` byte-level mutations of `bases` (flipped bits, random bytes, cuts, repeated spans) to the
    native path, which must never fail; whatever it answers, the Python path must answer too, with the same
    tokens, flags and seeds. Returns how many it answered."""
    import random

    from google.protobuf.message import DecodeError

    rng = random.Random(seed)
    answered = 0
    for _ in range(count):
        raw = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            kind, at = rng.randrange(4), rng.randrange(len(raw))
            if kind == 0:
                raw[at] ^= 1 << rng.randrange(8)
            elif kind == 1:
                raw[at] = rng.randrange(256)
            elif kind == 2:
                del raw[at:]
            else:
                raw[at:at] = raw[at: at + rng.randint(1, 8)]
            if not raw:
                raw = bytearray(rng.choice(bases))
        answer = answer_alone(native, bytes(raw), "fuzz", False)
        if answer is None:
            continue
        answered += 1
        got = pb.SampleResponse.FromString(answer.response)
        try:
            request = pb.SampleRequest.FromString(bytes(raw))
            request.params.seed[:] = got.seeds  # fresh seeds replayed
            del request.params.has_seed[:]
            expected = python_answer(cuda_backend, request, region_buffer)
        except (DecodeError, ServiceError) as err:
            raise AssertionError(f"native answered {bytes(raw)!r}, the Python path refuses it: {err}") from None
        assert got.tokens.data == expected.tokens.data and list(got.seeds) == list(expected.seeds), bytes(raw)
        assert list(got.valid) == list(expected.valid) and list(got.nan_detected) == list(expected.nan_detected)
    return answered


def test_mutated_requests_are_answered_as_the_python_path_answers_them_or_declined(native, cuda_backend,
                                                                                   region_buffer) -> None:
    """C++ parses untrusted bytes here: 3000 mutations of valid logits_ref requests."""
    x = logits("spiky", 6, 1000, seed=10).cuda()
    bases = [pb.SampleRequest(logits_ref=put(region_buffer, x), params=pb.SamplingParams(**params)).SerializeToString()
             for params in (dict(seed=list(range(6)), top_k=[20], top_p=[0.9]), dict(temperature=[0.0]),
                            dict(seed=[3], min_p=[0.1], position=[1, 2, 3, 4, 5, 6]),
                            dict(seed=list(range(6)), has_seed=[True, False] * 3, top_p=[0.5]))]
    answered = _answered_mutations(native, cuda_backend, region_buffer, bases, 3000, seed=20261122)
    assert 50 <= answered <= 2950, answered  # both sides of the decision exercised (127 answered at this seed)


def test_mutated_gathered_requests_are_answered_as_the_python_path_answers_them_or_declined(native, cuda_backend,
                                                                                            region_buffer) -> None:
    """1000 mutations of valid logits_rows requests (row offsets in the region's first kilobytes, so that a
    mutated offset often still lands inside it)."""
    x = logits("spiky", 4, 50, seed=14).cuda()
    rows = rows_at(region_buffer, x, [3, 1, 1, 0, 2], offset=0)
    bases = [pb.SampleRequest(logits_rows=rows, params=pb.SamplingParams(**params)).SerializeToString()
             for params in (dict(seed=list(range(5)), top_k=[20], top_p=[0.9]), dict(temperature=[0.0]))]
    answered = _answered_mutations(native, cuda_backend, region_buffer, bases, 1000, seed=20261123)
    print(f"answered {answered} of 1000 mutated gathered requests")
    assert 10 <= answered <= 990, answered


def test_mutated_carried_requests_are_answered_as_the_python_path_answers_them_or_declined(native, cuda_backend,
                                                                                           region_buffer) -> None:
    """1000 mutations of requests carrying their logits: a mutated length or shape must never make the native
    path read past the request's bytes, and mutated logits must sample as they do on the Python path."""
    x = logits("spiky", 4, 50, seed=17).cuda()
    bases = [pb.SampleRequest(logits=encode_tensor(x), params=pb.SamplingParams(**params)).SerializeToString()
             for params in (dict(seed=list(range(4)), top_k=[20], top_p=[0.9]), dict(temperature=[0.0]))]
    answered = _answered_mutations(native, cuda_backend, region_buffer, bases, 1000, seed=20261124)
    print(f"answered {answered} of 1000 mutated carried requests")
    assert 10 <= answered <= 990, answered


def test_concurrent_calls_to_a_server_are_merged_natively_each_answered_as_alone() -> None:
    """16 threads x 10 unary calls over slices of one CUDA region, against a server whose queue waits 2 ms: the
    native path merges them (fewer batches than calls in the batch-rows metric), and every call gets what the
    same call gets alone."""
    server = start_server("--device", "cuda", "--allow-cuda-ipc", "--max-queue-delay-us", "2000", timeout=300)
    threads, steps, rows = 16, 10, 2
    x = logits("spiky", threads * rows, 32000, seed=37).cuda()
    torch.cuda.synchronize()
    results: dict[tuple[int, int], torch.Tensor] = {}
    try:
        with SamplerClient(server.target, timeout=300) as client:
            region = client.register_cuda_region("merged", x)
            try:
                views = [region.view_of(x[t * rows:(t + 1) * rows]) for t in range(threads)]
                batches = _metric(server, "tokensampler_batch_rows_count")

                def worker(thread: int) -> None:
                    for step in range(steps):
                        results[thread, step] = client.sample(views[thread], top_k=40, top_p=0.9,
                                                              seed=[thread, step], position=step).tokens

                workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                batches = _metric(server, "tokensampler_batch_rows_count") - batches
                for (thread, step), tokens in results.items():
                    alone = client.sample(views[thread], top_k=40, top_p=0.9, seed=[thread, step], position=step)
                    assert torch.equal(tokens, alone.tokens), (thread, step)
            finally:
                client.unregister_region(region)
    finally:
        server.stop()
    assert len(results) == threads * steps
    print(f"{threads * steps} calls in {batches:.0f} batches")
    assert 0 < batches < threads * steps / 2
