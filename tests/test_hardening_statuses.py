"""Request data that used to cost unbounded work or end in INTERNAL, against a real CPU server: each case
gets a specific status naming the field, and the server keeps answering everyone."""

from __future__ import annotations

import errno
import hashlib
import os
import tracemalloc
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.params import build_sample_request
from tokensampler_client.tensors import TensorDecodeError, decode_tensor
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument, ServiceError
from tokensampler_server.validation.sample import validate_sample_request

from .conftest import RunningServer, serving

HUGE_EMPTY = [2**40, 2**40, 0]  # no element, but sizes whose product overflows int64
UINT32_MAX = 2**32 - 1


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def running(weights_dir: Path) -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--allow-shm", "--weights-dir", str(weights_dir))


@pytest.fixture(scope="module")
def stub(running: RunningServer) -> Iterator[pb_grpc.SamplerStub]:
    with grpc.insecure_channel(running.target) as channel:
        yield pb_grpc.SamplerStub(channel)


def _status(call, *args) -> tuple[grpc.StatusCode, str]:
    try:
        call(*args, timeout=60)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _assert_invalid(answer: tuple[grpc.StatusCode, str], field: str, *words: str) -> None:
    code, details = answer
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}:"), answer
    assert all(word in details for word in words), answer


# --- token lists ---------------------------------------------------------------------------------------


def _shared_list_request(rows: int, ids: int) -> pb.SampleRequest:
    """One banned list of `ids` ids given once for all `rows` rows of V = 2 (each id one byte on the wire)."""
    request = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[rows, 2], data=bytes(4 * rows)))
    request.params.banned_token_ids.ids.extend([1] * ids)
    request.params.banned_token_ids.lengths.append(ids)
    return request


def test_a_shared_list_is_bounded_before_it_is_expanded(stub: pb_grpc.SamplerStub) -> None:
    """4096 rows × one list of 262144 ids: a 0.3 MB request that would expand to 2^30 entries (16 GiB)."""
    request = _shared_list_request(4096, 262144)
    assert request.ByteSize() < 400_000
    limit = Limits().max_token_entries
    _invalid = _status(stub.Sample, request)
    _assert_invalid(_invalid, "params.banned_token_ids.lengths", "4096 rows", str(4096 * 262144), str(limit),
                    "max_token_entries")
    # Refused from the counts alone: nothing of the list is decoded or expanded.
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument):
            validate_sample_request(request, Limits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    # Within the limit, the same shared list is taken (and every row gets it).
    assert _status(stub.Sample, _shared_list_request(64, 1000))[0] == grpc.StatusCode.OK


def test_the_entry_limit_counts_every_list_of_a_request_and_each_diffusion_position() -> None:
    limits = Limits(max_token_entries=100)
    request = build_sample_request(torch.zeros(4, 10), seed=1, banned_token_ids=[[1] * 20] * 4,
                                   output_token_ids=[[2] * 5] * 4)
    assert validate_sample_request(request, limits)[0].processing.banned.rows.numel() == 80
    request.params.prompt_token_ids.ids.extend([3] * 21)
    request.params.prompt_token_ids.lengths.append(21)  # 84 entries more, shared by the 4 rows
    with pytest.raises(InvalidArgument) as raised:
        validate_sample_request(request, limits)
    assert raised.value.field == "params.prompt_token_ids.lengths"
    assert "84 token entries after 100 in the lists before it, expected at most 100" in raised.value.message

    from tokensampler_server.validation.workloads import validate_diffusion_request
    step = pb.DiffusionStepRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 30, 4], data=bytes(480)),
                                   mask=pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[1, 30], data=bytes(30)))
    step.params.banned_token_ids.ids.extend([1, 2, 3, 0])
    step.params.banned_token_ids.lengths.append(4)  # copied to each of the 30 positions: 120 entries
    with pytest.raises(InvalidArgument) as raised:
        validate_diffusion_request(step, limits)
    assert "4 × 30 positions token entries" in raised.value.message


def _history_request(rows: int, per_row: int, vocab: int) -> tuple[pb.SampleRequest, np.ndarray]:
    history = np.random.default_rng(0).integers(0, vocab, rows * per_row, dtype=np.int32)
    history[:3] = [0, vocab - 1, 16383]  # one-, three- and two-byte varints at the start
    request = build_sample_request(torch.zeros(rows, vocab, dtype=torch.float16), seed=1, frequency_penalty=0.5)
    request.params.output_token_ids.ids.extend(history.tolist())
    request.params.output_token_ids.lengths.extend([per_row] * rows)
    return request, history


def test_long_histories_are_decoded_exactly_in_little_memory() -> None:
    """2^21 ids of V = 128000 (5.9 MB on the wire): the entries hold 16 bytes an id; the rest of the
    decoding stays within a few MiB (one Python int per id took 70 bytes an id more)."""
    rows, per_row = 8, 2**18
    request, history = _history_request(rows, per_row, 128000)
    tracemalloc.start()
    try:
        batch, _ = validate_sample_request(request, Limits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    entries = batch.processing.output_tokens
    assert torch.equal(entries.tokens, torch.from_numpy(history.astype(np.int64)))
    assert torch.equal(entries.rows, torch.arange(rows).repeat_interleave(per_row))
    size = rows * per_row
    print(f"\n{size} ids ({request.ByteSize() / 2**20:.1f} MiB): peak traced {peak / size:.1f} bytes an id")
    assert peak < 16 * size + request.params.output_token_ids.ByteSize() + 24 * 2**20, peak


def test_heavy_lists_can_be_decoded_off_the_event_loop_and_give_the_same_batch() -> None:
    from tokensampler_server.validation.sample import decode_token_lists, heavy_token_lists

    request, _ = _history_request(4, 2**17, 50000)
    request.params.banned_token_ids.ids.extend([5, 7])
    request.params.banned_token_ids.lengths.append(2)
    assert heavy_token_lists(request) and not heavy_token_lists(build_sample_request(torch.zeros(4, 8), seed=1))
    decoded = decode_token_lists(request, Limits())
    inline, _ = validate_sample_request(request, Limits())
    given, _ = validate_sample_request(request, Limits(), token_lists=decoded)
    for name in ("output_tokens", "banned"):
        mine, theirs = getattr(inline.processing, name), getattr(given.processing, name)
        assert torch.equal(mine.rows, theirs.rows) and torch.equal(mine.tokens, theirs.tokens)
    request.params.output_token_ids.ids[70000] = 50000  # out of range: found from the decoded lists too
    with pytest.raises(InvalidArgument, match=r"got 50000, expected token ids in \[0, V=50000\)"):
        validate_sample_request(request, Limits(), token_lists=decode_token_lists(request, Limits()))


# --- shapes of no element whose sizes overflow -----------------------------------------------------------


def test_decode_tensor_refuses_sizes_whose_product_overflows() -> None:
    with pytest.raises(TensorDecodeError) as raised:
        decode_tensor(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=HUGE_EMPTY), "t")
    assert raised.value.field == "t.shape" and "2^63" in str(raised.value)
    assert decode_tensor(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**20, 2**20, 0])).shape == (2**20, 2**20, 0)


@pytest.fixture(scope="module")
def region(stub: pb_grpc.SamplerStub) -> Iterator[str]:
    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        stub.RegisterRegion(pb.RegisterRegionRequest(name="r", shm=pb.SharedMemorySource(key=segment.name, byte_size=4096)),
                            timeout=60)
        yield "r"
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="r"), timeout=60)
    finally:
        segment.close()
        segment.unlink()


def test_empty_shapes_with_overflowing_sizes_are_invalid_everywhere(stub: pb_grpc.SamplerStub, region: str) -> None:
    huge_ref = pb.TensorRef(region=region, dtype=pb.DTYPE_FLOAT32, shape=HUGE_EMPTY)
    _assert_invalid(_status(stub.Sample, pb.SampleRequest(logits_ref=huge_ref)), "logits_ref.shape", "2^63")
    output = pb.TensorRef(region=region, dtype=pb.DTYPE_INT32, shape=HUGE_EMPTY)
    request = build_sample_request(torch.zeros(1, 4), seed=1)
    request.output.tokens.CopyFrom(output)
    _assert_invalid(_status(stub.Sample, request), "output.tokens.shape", "2^63")
    weight = pb.RegisterWeightsFromRegionRequest(name="w", weight=huge_ref)
    _assert_invalid(_status(stub.RegisterWeightsFromRegion, weight), "weight.shape", "2^63")
    bias = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=HUGE_EMPTY)
    header = pb.RegisterWeightsChunk(name="w", dtype=pb.DTYPE_FLOAT32, shape=[2, 2], data=bytes(16),
                                     options=pb.WeightOptions(bias=bias), sha256=hashlib.sha256(bytes(16)).hexdigest())
    _assert_invalid(_status(stub.RegisterWeights, iter([header])), "options.bias.shape", "2^63")


# --- weight files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "code", "words"), [
    ("a" * 300, grpc.StatusCode.INVALID_ARGUMENT, ("too long",)),
    ("/".join(["b" * 200] * 40), grpc.StatusCode.INVALID_ARGUMENT, ("too long",)),
    ("nul\0byte", grpc.StatusCode.INVALID_ARGUMENT, ("NUL",)),
])
def test_weight_paths_the_file_system_refuses_get_a_specific_status(
    stub: pb_grpc.SamplerStub, path: str, code: grpc.StatusCode, words: tuple[str, ...]
) -> None:
    answer = _status(stub.RegisterWeightsFromFile, pb.RegisterWeightsFromFileRequest(name="f", path=path, tensor="t"))
    assert answer[0] == code and answer[1].startswith("path:"), answer
    assert all(word in answer[1] for word in words), answer


@pytest.mark.parametrize(("error", "code"), [
    (PermissionError(errno.EACCES, "Permission denied"), grpc.StatusCode.PERMISSION_DENIED),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), grpc.StatusCode.NOT_FOUND),
    (OSError(errno.EIO, "Input/output error"), grpc.StatusCode.FAILED_PRECONDITION),
    (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_a_weight_file_that_cannot_be_read_gets_the_status_of_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: BaseException, code: grpc.StatusCode
) -> None:
    """A read of an open weight file that fails (or a server out of memory): the status of why, not "not
    safetensors", and no path of the server's in the message."""
    from tokensampler_server.resources import weight_files

    save_file({"t": torch.zeros(2, 2)}, tmp_path / "head.safetensors")
    fd = weight_files.open_weights_file(tmp_path, "head.safetensors")

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(weight_files.os, "pread", refuse)
    try:
        with pytest.raises(ServiceError) as raised:
            weight_files.read_safetensor(fd, "head.safetensors", "t", 1 << 20)
    finally:
        os.close(fd)
    assert raised.value.code == code and raised.value.message.startswith(("path:", "tensor:")), raised.value.message
    assert str(tmp_path) not in raised.value.message


# --- weights past WeightsInfo's uint32 sizes -------------------------------------------------------------


def test_a_weight_wider_than_uint32_is_refused_before_it_is_registered(stub: pb_grpc.SamplerStub) -> None:
    """[1, 2^32 + 1] fp16 from a sparse segment (8 GiB of address space, no page touched)."""
    size = 2 * (2**32 + 1)
    segment = shared_memory.SharedMemory(create=True, size=size)
    try:
        stub.RegisterRegion(pb.RegisterRegionRequest(name="wide", shm=pb.SharedMemorySource(key=segment.name, byte_size=size)),
                            timeout=60)
        try:
            ref = pb.TensorRef(region="wide", dtype=pb.DTYPE_FLOAT16, shape=[1, 2**32 + 1])
            _assert_invalid(_status(stub.RegisterWeightsFromRegion, pb.RegisterWeightsFromRegionRequest(name="wide", weight=ref)),
                            "weight.shape", f"D = {2**32 + 1}", str(UINT32_MAX))
            assert stub.ListWeights(pb.ListWeightsRequest(), timeout=60).weights == []  # nothing registered
        finally:
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name="wide"), timeout=60)
    finally:
        segment.close()
        segment.unlink()
    # An upload is refused at its header, before any of its 8 GiB is sent.
    header = pb.RegisterWeightsChunk(name="tall", dtype=pb.DTYPE_FLOAT16, shape=[2**32 + 1, 1])
    _assert_invalid(_status(stub.RegisterWeights, iter([header])), "shape", f"V = {2**32 + 1}", str(UINT32_MAX))
    assert stub.ListWeights(pb.ListWeightsRequest(), timeout=60).weights == []


def test_an_empty_weight_file_tensor_is_refused(stub: pb_grpc.SamplerStub, weights_dir: Path) -> None:
    """[0, D] used to register, then answer INTERNAL to every Sample through it; [V, 0] registered unusable."""

    save_file({"no_rows": torch.zeros(0, 4), "no_columns": torch.zeros(4, 0)}, str(weights_dir / "empty.safetensors"))
    for tensor, words in (("no_rows", "V = 0"), ("no_columns", "D = 0")):
        request = pb.RegisterWeightsFromFileRequest(name=tensor, path="empty.safetensors", tensor=tensor)
        _assert_invalid(_status(stub.RegisterWeightsFromFile, request), "weight.shape", words, "1 <= V, D")
    assert stub.ListWeights(pb.ListWeightsRequest(), timeout=60).weights == []


def test_many_dry_sequence_breakers_are_decoded_off_the_event_loop() -> None:
    """2M breaker ids (4096 rows of 32 breakers of 16 ids) took 170-250 ms of the event loop per request: they
    count towards what sends a request's lists to a thread, shared breakers once per row."""
    from tokensampler_server.validation.sample import OFF_LOOP_ENTRIES, heavy_token_lists

    rows = 4096
    request = build_sample_request(torch.zeros(rows, 16), seed=1)
    breakers = request.params.dry_sequence_breakers
    breakers.lengths.extend([16] * 32 * rows)
    breakers.counts.extend([32] * rows)
    breakers.ids.extend([1] * 16 * 32 * rows)
    assert heavy_token_lists(request)
    shared = build_sample_request(torch.zeros(rows, 16), seed=1)
    shared.params.dry_sequence_breakers.lengths.extend([8] * 32)  # 256 ids given once, laid out for every row
    shared.params.dry_sequence_breakers.ids.extend([1] * 256)
    assert 256 * rows > OFF_LOOP_ENTRIES and heavy_token_lists(shared)


@pytest.mark.parametrize("kind", ["lengths", "counts", "counts alone"])
def test_breaker_sizes_are_refused_from_their_counts_before_any_is_read(kind: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """5M breaker lengths (and no ids) were converted to an array on the event loop before any size check (50M: 25 s
    and 5 GB for one 200 MB request). Their number alone now refuses them: nothing that long is converted."""
    from tokensampler_server.validation import samplers
    from tokensampler_server.validation.sample import heavy_token_lists

    class _NoLongArrays:
        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        def asarray(self, values, *args, **kwargs):  # noqa: ANN001, ANN201 - numpy's own signature
            assert len(values) < 1_000_000, "a client-sized list was converted before its size was checked"
            return np.asarray(values, *args, **kwargs)

    monkeypatch.setattr(samplers, "np", _NoLongArrays())
    request = build_sample_request(torch.zeros(2, 16), seed=1, dry_multiplier=1.0)
    breakers = request.params.dry_sequence_breakers
    if kind == "counts alone":  # no breakers, and a count past its rows: refused before the counts are read
        breakers.counts.extend([0] * 4_999_999 + [1])
    else:
        breakers.lengths.extend([0] * 5_000_000)
    if kind == "counts":
        breakers.counts.extend([2_500_000, 2_500_000])
    assert not heavy_token_lists(request)  # decoded on the event loop
    with pytest.raises(InvalidArgument) as err:
        validate_sample_request(request, Limits())
    if kind == "counts alone":  # read one by one, 5M counts held the event loop 0.1 s
        assert err.value.field == "params.dry_sequence_breakers.counts" and "B=2" in str(err.value)
    else:
        assert err.value.field == "params.dry_sequence_breakers.lengths" and "at most 32" in str(err.value)


@pytest.mark.parametrize("dtype,named", [(pb.DTYPE_INT32, "got int32"), (99, "got 99 (no such dtype)")])
def test_a_carried_tensors_dtype_is_named_as_a_references_is(dtype: int, named: str) -> None:
    """Carried logits of a wrong dtype said "got 4"; a reference's said "got int32". Both name it now."""
    request = build_sample_request(torch.zeros(2, 8), seed=1)
    request.logits.dtype = dtype
    with pytest.raises(InvalidArgument) as err:
        validate_sample_request(request, Limits())
    assert err.value.field == "logits.dtype" and named in str(err.value)
