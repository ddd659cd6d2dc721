"""The LM-head weight registry: logits finishing, uploads, server-side files, reference counting."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.core.budget import ByteBudget
from tokensampler_server.core.errors import InvalidArgument, ServiceError
from tokensampler_server.core.request_context import raise_if_abandoned
from tokensampler_server.resources.weight_files import MAX_HEADER_BYTES, open_weights_file, read_safetensor
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight, WeightRegistry, check_finish
from tokensampler_server.resources.refcounted import MAX_NAME_BYTES
from tokensampler_server.rpc.weights_rpc import read_upload, registered_off_loop, upload_budget

from .polling import wait_until_async


def test_logits_apply_bias_scale_cap_and_drop_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, hidden, bias = torch.randn(10, 6, generator=gen), torch.randn(3, 6, generator=gen), torch.randn(10, generator=gen)
    registry = WeightRegistry(torch.device("cpu"))
    finish = LogitsFinish(vocab_size=7, bias=bias, soft_cap=2.0, logit_scale=0.5)
    entry = registry.register("head", weight.to(torch.bfloat16), finish, "x")
    expected = 2.0 * torch.tanh(((hidden.double() @ weight.bfloat16().double().T + bias.double()) * 0.5) / 2.0)
    torch.testing.assert_close(entry.logits(hidden).double(), expected[:, :7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(bias=torch.zeros(9)), "options.bias.shape"),
        (dict(bias=torch.tensor([float("nan")] * 10)), "options.bias.data"),
        (dict(vocab_size=11), "options.vocab_size"),
        (dict(vocab_size=0), "options.vocab_size"),
        (dict(soft_cap=0.0), "options.soft_cap"),
        (dict(soft_cap=float("inf")), "options.soft_cap"),
        (dict(logit_scale=float("nan")), "options.logit_scale"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict, field: str) -> None:
    args = dict(bias=None, vocab_size=None, soft_cap=None, logit_scale=None) | kwargs
    with pytest.raises(InvalidArgument) as raised:
        check_finish(10, **args)
    assert raised.value.field == field


@pytest.mark.parametrize("bad, row", [(float("nan"), 4), (float("inf"), 0), (float("-inf"), 5)])
def test_a_weight_with_a_nan_or_infinity_is_refused_naming_its_row(bad: float, row: int) -> None:
    weight = torch.randn(6, 8).half()
    weight[row, 3] = bad
    registry = WeightRegistry(torch.device("cpu"))
    with pytest.raises(InvalidArgument, match=f"row {row}") as raised:
        registry.register("head", weight, LogitsFinish(vocab_size=6), "x")
    assert raised.value.field == "weight"
    registry.register("head", torch.randn(6, 8).half(), LogitsFinish(vocab_size=6), "x")  # the name stays free


def test_an_empty_name_is_not_set_rather_than_not_found() -> None:
    registry = WeightRegistry(torch.device("cpu"))
    with pytest.raises(InvalidArgument, match="not set") as raised:
        with registry.use("", "hidden.weights"):
            pass
    assert raised.value.field == "hidden.weights"


def test_an_idle_upload_ends_and_gives_its_bytes_back() -> None:
    """A header declaring the whole budget holds nothing; an upload that stops sending ends after the idle timeout
    (DEADLINE_EXCEEDED) and frees what it held."""
    budget = _budget(1 << 20)
    registry = WeightRegistry(torch.device("cpu"))
    messages = _chunks(torch.randn(33, 7).half())

    async def stalls():
        yield messages[0]
        await asyncio.sleep(30)

    async def run() -> None:
        header_only = pb.RegisterWeightsChunk(name="hog", dtype=pb.DTYPE_FLOAT16, shape=[512, 1024])
        hog = asyncio.ensure_future(read_upload(stalls_after(header_only), 1 << 20, registry.check_free, budget))
        await asyncio.sleep(0.01)
        assert budget.held == 0
        with pytest.raises(ServiceError) as ended:
            await read_upload(stalls(), 1 << 20, registry.check_free, budget, idle_timeout_s=0.05)
        assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and budget.held == 0
        hog.cancel()

    async def stalls_after(message):
        yield message
        await asyncio.sleep(30)

    asyncio.run(run())


def _chunks(weight: torch.Tensor, name: str = "w", chunk_bytes: int = 100, sha256: str | None = None, **header):
    data = weight.contiguous().view(torch.uint8).numpy().tobytes()
    digest = sha256 if sha256 is not None else hashlib.sha256(data).hexdigest()
    first = pb.RegisterWeightsChunk(name=name, dtype=pb.DTYPE_FLOAT16, shape=list(weight.shape), **header)
    messages = [first] + [pb.RegisterWeightsChunk() for _ in range(max(0, (len(data) - 1) // chunk_bytes))]
    for index, message in enumerate(messages):
        message.data = data[index * chunk_bytes : (index + 1) * chunk_bytes]
    messages[-1].sha256 = digest
    return messages


async def _stream(messages):
    for message in messages:
        yield message


def _budget(max_bytes: int) -> ByteBudget:
    return upload_budget(max_bytes)


def _read(messages, max_bytes: int = 1 << 20, registry: WeightRegistry | None = None):
    registry = registry if registry is not None else WeightRegistry(torch.device("cpu"))
    return asyncio.run(read_upload(_stream(messages), max_bytes, registry.check_free, _budget(max_bytes)))


def test_upload_in_chunks_is_verified_and_complete() -> None:
    weight = torch.randn(33, 7).half()
    upload = _read(_chunks(weight, options=pb.WeightOptions(vocab_size=30, soft_cap=5.0)))
    assert torch.equal(upload.weight, weight) and upload.name == "w"
    assert upload.finish.vocab_size == 30 and upload.finish.soft_cap == 5.0


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m[-1].ClearField("data"), "data"),  # a truncated upload never becomes usable
        (lambda m: m[-1].__setattr__("data", m[-1].data + b"xx"), "data"),
        (lambda m: m[-1].__setattr__("sha256", "0" * 64), "sha256"),
        (lambda m: m[-1].__setattr__("sha256", ""), "sha256"),
        (lambda m: m[0].__setattr__("dtype", pb.DTYPE_INT32), "dtype"),
        (lambda m: m[0].shape.pop(), "shape"),
        (lambda m: m[1].__setattr__("name", "again"), "name"),
        (lambda m: m[1].options.CopyFrom(pb.WeightOptions(soft_cap=-1.0)), "options"),  # options only in the header
        (lambda m: m[0].__setattr__("name", "n" * (MAX_NAME_BYTES + 1)), "name"),
        (lambda m: m[0].__setattr__("name", "head\nINFO forged log line"), "name"),
        (lambda m: m[0].__setattr__("name", "head\x00"), "name"),
        (lambda m: m[0].options.CopyFrom(pb.WeightOptions(soft_cap=-1.0)), "options.soft_cap"),
        (lambda m: m[0].options.bias.CopyFrom(encode_tensor(torch.zeros(33, dtype=torch.int64))), "options.bias.dtype"),
        (lambda m: m.clear(), "name"),
    ],
)
def test_bad_uploads_are_refused(mutate, field: str) -> None:
    messages = _chunks(torch.randn(33, 7).half())
    mutate(messages)
    with pytest.raises(InvalidArgument) as raised:
        _read(messages)
    assert raised.value.field == field


@pytest.mark.parametrize("taken", [True, False])
def test_an_upload_whose_name_cannot_be_registered_is_refused_at_its_header(taken: bool) -> None:
    """A name already taken (ALREADY_EXISTS), or a registry at its limit (RESOURCE_EXHAUSTED), is refused when the
    header arrives: no data message is read."""
    registry = WeightRegistry(torch.device("cpu"), max_weights=1)
    registry.register("w" if taken else "other", torch.randn(4, 2), LogitsFinish(vocab_size=4), sha256="")
    messages = _chunks(torch.randn(33, 7).half(), chunk_bytes=64)

    async def header_then_fail():
        yield messages[0]
        raise AssertionError("a data message was read")

    with pytest.raises(ServiceError) as raised:
        asyncio.run(read_upload(header_then_fail(), 1 << 20, registry.check_free, _budget(1 << 20)))
    want = grpc.StatusCode.ALREADY_EXISTS if taken else grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.code == want


def test_upload_larger_than_the_limit_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="at most 100"):
        _read(_chunks(torch.randn(33, 7).half()), max_bytes=100)


def _read_file(root: Path | None, relative: str, tensor: str = "lm_head.weight", max_bytes: int = 1 << 20) -> torch.Tensor:
    fd = open_weights_file(root, relative)
    try:
        return read_safetensor(fd, relative, tensor, max_bytes)
    finally:
        os.close(fd)


def test_weights_dir_confinement(tmp_path: Path) -> None:
    """Paths leaving the directory or going through a link anywhere are refused, and so is whatever is not a
    regular file (a FIFO is refused at once: opening it must not wait for a writer)."""
    root = tmp_path / "weights"
    (root / "sub").mkdir(parents=True)
    save_file({"lm_head.weight": torch.randn(5, 3)}, root / "sub" / "head.safetensors")
    (tmp_path / "outside.safetensors").write_bytes(b"")
    os.symlink(tmp_path / "outside.safetensors", root / "link.safetensors")
    os.symlink(root / "sub", root / "linked-dir")
    os.mkfifo(root / "pipe.safetensors")
    assert _read_file(root, "sub/head.safetensors").shape == (5, 3)
    for path, code in [
        ("../outside.safetensors", grpc.StatusCode.PERMISSION_DENIED),
        (str(tmp_path / "outside.safetensors"), grpc.StatusCode.PERMISSION_DENIED),
        ("link.safetensors", grpc.StatusCode.PERMISSION_DENIED),
        ("linked-dir/head.safetensors", grpc.StatusCode.PERMISSION_DENIED),
        ("missing.safetensors", grpc.StatusCode.NOT_FOUND),
        ("sub", grpc.StatusCode.NOT_FOUND),
        ("pipe.safetensors", grpc.StatusCode.NOT_FOUND),
        ("sub/head.safetensors/x", grpc.StatusCode.NOT_FOUND),
        (".", grpc.StatusCode.PERMISSION_DENIED),  # no parts at all: was an IndexError (INTERNAL)
    ]:
        with pytest.raises(ServiceError) as raised:
            open_weights_file(root, path)
        assert raised.value.code == code, path
        assert str(tmp_path) not in raised.value.message or path.startswith(str(tmp_path)), raised.value.message
    with pytest.raises(ServiceError) as raised:
        open_weights_file(None, "sub/head.safetensors")
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ServiceError) as raised:
        _read_file(root, "sub/head.safetensors", "missing")
    assert raised.value.code == grpc.StatusCode.NOT_FOUND and "lm_head.weight" in raised.value.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_file_tensor_is_read_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    """The header is parsed here (the safetensors library opens by name and maps): the tensor read is the one
    saved, bit for bit, among others of other shapes and dtypes."""
    want = torch.randn(7, 5).to(dtype)
    save_file({"a": torch.arange(6, dtype=torch.int64), "lm_head.weight": want, "z": torch.ones(3, dtype=torch.float16)},
              tmp_path / "m.safetensors", metadata={"format": "pt"})
    got = _read_file(tmp_path, "m.safetensors")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(InvalidArgument, match="expected a \\[V, D\\] float tensor"):
        _read_file(tmp_path, "m.safetensors", "a")
    with pytest.raises(InvalidArgument, match="larger than 60 bytes"):
        _read_file(tmp_path, "m.safetensors", max_bytes=60)


def test_a_file_swapped_for_a_link_after_it_is_opened_is_read_as_opened(tmp_path: Path) -> None:
    """Every read goes through the descriptor opened without following links: a name swapped for a link to a file
    outside the directory in between (an atomic rename) is not followed."""
    root, inside, outside = tmp_path / "weights", torch.zeros(4, 2), torch.ones(4, 2)
    root.mkdir()
    save_file({"lm_head.weight": inside}, root / "m.safetensors")
    save_file({"lm_head.weight": outside}, tmp_path / "secret.safetensors")
    fd = open_weights_file(root, "m.safetensors")
    try:
        os.symlink(tmp_path / "secret.safetensors", root / "swap")
        os.replace(root / "swap", root / "m.safetensors")
        assert torch.equal(read_safetensor(fd, "m.safetensors", "lm_head.weight", 1 << 20), inside)
    finally:
        os.close(fd)
    with pytest.raises(ServiceError) as raised:
        open_weights_file(root, "m.safetensors")
    assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_file_cut_short_while_it_is_read_is_refused_and_faults_nothing(tmp_path: Path, monkeypatch) -> None:
    """A file truncated under the read: the read comes up short (FAILED_PRECONDITION), where a mapped file would
    fault the process (SIGBUS)."""
    from tokensampler_server.resources import weight_files

    save_file({"lm_head.weight": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    real = os.preadv

    def truncating(fd, buffers, offset):
        os.truncate(tmp_path / "m.safetensors", offset)  # the file ends where the data begins
        return real(fd, buffers, offset)

    monkeypatch.setattr(weight_files.os, "preadv", truncating)
    with pytest.raises(ServiceError) as raised:
        _read_file(tmp_path, "m.safetensors")
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION and "changed" in raised.value.message


@pytest.mark.parametrize("header, words", [
    (MAX_HEADER_BYTES + 1, "header length is past"),  # refused before it is read, its length not echoed
    (b"[1, 2]", "not an object"),
    (b"\xff\xfe", "not JSON"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}', "data takes 8 bytes"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 800]}}', "data takes 800 bytes"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}', "malformed entry"),
    (b'{"lm_head.weight": [1, 2]}', "malformed entry"),  # not a tensor's description: not a missing tensor
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}', "ends past the file"),
    # data_offsets must tile the data: tensors that share bytes, or leave a hole, are not a safetensors file
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}, '
     b'"other": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]}}', "overlaps"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [4, 8]}}', "begins 4 bytes past"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}, "other": [0, 4]}',
     "malformed entry for 'other'"),
])
def test_malformed_safetensors_headers_are_refused_by_field(tmp_path: Path, header, words: str) -> None:
    if isinstance(header, int):
        (tmp_path / "m.safetensors").write_bytes(header.to_bytes(8, "little") + b"{}")
    else:
        (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(InvalidArgument) as raised:
        _read_file(tmp_path, "m.safetensors")
    assert raised.value.field == "path" and words in raised.value.message, raised.value.message


def test_a_file_with_bytes_past_its_tensors_is_refused(tmp_path: Path) -> None:
    """The format's library refuses a file its tensors do not cover to the end: so does the server."""
    header = json.dumps({"lm_head.weight": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    assert _read_file(tmp_path, "m.safetensors").shape == (1, 2)
    with open(tmp_path / "m.safetensors", "ab") as file:
        file.write(b"\0" * 3)
    with pytest.raises(InvalidArgument) as raised:
        _read_file(tmp_path, "m.safetensors")
    assert raised.value.field == "path" and "3 bytes past its tensors' data" in raised.value.message


@pytest.mark.parametrize("shape", [[4], [2, 2, 1], [2**62, 2**62, 0]])
def test_a_file_tensor_of_another_rank_is_refused_before_it_is_shaped(tmp_path: Path, shape: list[int]) -> None:
    # [2^62, 2^62, 0] holds 0 bytes, as its offsets say, but no tensor can take its shape (int64 overflow).
    size = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1) * (shape[2] if len(shape) > 2 else 1)
    entry = {"dtype": "F32", "shape": shape, "data_offsets": [0, size]}
    header = json.dumps({"lm_head.weight": entry}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(size))
    with pytest.raises(InvalidArgument) as raised:
        _read_file(tmp_path, "m.safetensors")
    assert raised.value.field == "tensor" and "expected a [V, D] float tensor" in raised.value.message


def test_unregister_waits_for_requests_in_flight() -> None:
    registry = WeightRegistry(torch.device("cpu"))
    registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "x")
    with pytest.raises(ServiceError) as raised:
        registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "x")
    assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS

    async def run() -> list[str]:
        events: list[str] = []
        with registry.use("head"):
            task = asyncio.ensure_future(registry.unregister("head"))
            await wait_until_async(lambda: registry.list() == [], "the unregistering under way")
            assert not task.done()  # still in use
            with pytest.raises(ServiceError):  # but already gone for new requests
                with registry.use("head"):
                    pass
            events.append("released")
        await task
        events.append("unregistered")
        return events

    assert asyncio.run(run()) == ["released", "unregistered"]
    assert registry.list() == []


def test_uploads_in_progress_hold_at_most_the_budget_together() -> None:
    """Uploads hold the bytes they have received, together at most the budget: a header declaring more holds
    nothing; a second upload is refused (RESOURCE_EXHAUSTED) at the message that would pass the budget while the
    first is in progress; once the first ends, by success or failure, its bytes are free again."""
    weight = torch.randn(33, 7).half()  # 462 bytes, in messages of 100
    budget = _budget(500)
    registry = WeightRegistry(torch.device("cpu"))

    async def run() -> None:
        first = _chunks(weight, name="first")
        second = _chunks(weight, name="second")
        gate = asyncio.Event()

        async def slow():
            yield first[0]
            await gate.wait()
            for message in first[1:]:
                yield message

        pending = asyncio.ensure_future(read_upload(slow(), 1 << 20, registry.check_free, budget))
        await asyncio.sleep(0.01)
        assert budget.held == 100
        with pytest.raises(ServiceError) as refused:
            await read_upload(_stream(second), 1 << 20, registry.check_free, budget)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and budget.held == 100
        assert refused.value.message.startswith("data: uploads in progress hold "), refused.value.message
        gate.set()
        assert (await pending).name == "first" and budget.held == 0
        bad = _chunks(weight, name="second", sha256="0" * 64)
        with pytest.raises(InvalidArgument):
            await read_upload(_stream(bad), 1 << 20, registry.check_free, budget)
        assert budget.held == 0
        assert (await read_upload(_stream(second), 1 << 20, registry.check_free, budget)).name == "second"

    asyncio.run(run())


@pytest.mark.parametrize("by_ref", [False, True])
def test_hidden_states_of_the_wrong_width_name_their_own_field(by_ref: bool) -> None:
    from tokensampler_client.tensors import encode_tensor as encode
    from tokensampler_server.core.config import Limits
    from tokensampler_server.validation.sample import validate_sample_request

    head = WeightRegistry(torch.device("cpu")).register("head", torch.randn(6, 4), LogitsFinish(vocab_size=6), "x")
    states = torch.zeros(2, 5)
    request = pb.SampleRequest()
    request.hidden.weights = "head"
    if by_ref:
        request.hidden.states_ref.CopyFrom(pb.TensorRef(region="r", dtype=pb.DTYPE_FLOAT32, shape=[2, 5]))
    else:
        encode(states, out=request.hidden.states)
    with pytest.raises(InvalidArgument, match="D=5") as raised:
        validate_sample_request(request, Limits(), lm_head=head, referenced=states if by_ref else None)
    assert raised.value.field == ("hidden.states_ref.shape" if by_ref else "hidden.states.shape")


def test_a_weight_joins_its_region_before_its_name_is_visible() -> None:
    """An UnregisterWeights landing right after the name is added removes the entry from its region; the entry
    must already be there, or it would be added after and keep the region registered for good. A name refused
    (ALREADY_EXISTS) leaves the region as it was."""
    from types import SimpleNamespace

    region = SimpleNamespace(name="r", weights=set(), buffer=None)  # a shared-memory region: its weights are copies
    registry = WeightRegistry(torch.device("cpu"))
    real_add = registry._weights.add
    seen = []

    def add(name, entry, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(entry in region.weights)
        return real_add(name, entry, **kwargs)

    registry._weights.add = add
    entry = registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "", region=region)
    assert seen == [True] and region.weights == {entry}
    with pytest.raises(ServiceError):
        registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "", region=region)
    assert region.weights == {entry}


def test_a_registration_holds_its_name_from_before_its_work_and_its_slot_too() -> None:
    registry = WeightRegistry(torch.device("cpu"), max_weights=2)
    started, finish = threading.Event(), threading.Event()
    refused = []

    def slow() -> RegisteredWeight:
        started.set()
        finish.wait(10)
        raise_if_abandoned()
        return registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "", reserved=True)

    async def scenario() -> None:
        first = asyncio.ensure_future(registered_off_loop(registry, "head", slow))
        await asyncio.to_thread(started.wait, 10)
        with pytest.raises(ServiceError) as raised:  # the same name, refused before any work of its own
            await registered_off_loop(registry, "head", slow, on_unrun=lambda: refused.append(True))
        assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS and "being registered" in raised.value.message
        registry.register("other", torch.randn(4, 2), LogitsFinish(vocab_size=4), "")
        with pytest.raises(ServiceError) as raised:  # the reservation takes one of the two slots
            registry.check_free("third")
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        finish.set()
        assert (await first).name == "head"

    asyncio.run(scenario())
    assert refused == [True] and sorted(entry.name for entry in registry.list()) == ["head", "other"]


def test_a_registration_whose_caller_has_gone_registers_nothing() -> None:
    registry = WeightRegistry(torch.device("cpu"))
    started, finish, ended = threading.Event(), threading.Event(), threading.Event()

    def slow() -> RegisteredWeight:
        started.set()
        finish.wait(10)
        try:
            raise_if_abandoned()
            return registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "", reserved=True)
        finally:
            ended.set()

    async def scenario() -> None:
        call = asyncio.ensure_future(registered_off_loop(registry, "head", slow))
        await asyncio.to_thread(started.wait, 10)
        call.cancel()  # what grpc.aio does to a handler whose deadline passed or whose client cancelled
        with pytest.raises(asyncio.CancelledError):
            await call
        finish.set()
        await asyncio.to_thread(ended.wait, 10)

    asyncio.run(scenario())
    assert registry.list() == []
    registry.check_free("head")  # the name is free again: a retry registers


def test_a_registration_cancelled_before_a_thread_takes_it_gives_its_name_and_descriptor_back() -> None:
    """With every thread of the loop's executor busy, a registration's work waits in the executor's queue; a call
    cancelled there drops the job, so the work never runs. The name (and its --max-weights slot) must come back, and
    what the work would have closed (a file's descriptor) must be closed, or each such call leaks them for good."""
    from concurrent.futures import ThreadPoolExecutor

    registry = WeightRegistry(torch.device("cpu"), max_weights=1)
    busy, ran, unrun = threading.Event(), [], []

    def work() -> RegisteredWeight:
        ran.append(True)
        return registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "", reserved=True)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        blocker = asyncio.ensure_future(asyncio.to_thread(busy.wait, 10))  # the executor's one thread, taken
        call = asyncio.ensure_future(registered_off_loop(registry, "head", work, on_unrun=lambda: unrun.append(True)))
        await asyncio.sleep(0.05)  # the call has reserved the name and queued its work behind the blocker
        with pytest.raises(ServiceError):
            registry.check_free("head")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        busy.set()
        await blocker
        await asyncio.to_thread(lambda: None)  # the executor has drained its queue

    asyncio.run(scenario())
    assert ran == [] and unrun == [True]
    registry.check_free("head")  # the name and the one slot are free again
    assert registry.register("head", torch.randn(4, 2), LogitsFinish(vocab_size=4), "").name == "head"


def test_the_weights_hold_at_most_their_budget_together() -> None:
    """Two 512-byte heads under a 1000-byte budget: the second is refused RESOURCE_EXHAUSTED naming the weight and the
    flag, until the first is unregistered."""
    registry = WeightRegistry(torch.device("cpu"), max_bytes=1000)
    registry.register("a", torch.randn(16, 8), LogitsFinish(vocab_size=16), "")
    with pytest.raises(ServiceError) as raised:
        registry.register("b", torch.randn(16, 8), LogitsFinish(vocab_size=16), "")
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.message.startswith("weight: 512 bytes") and "--max-weights-mb" in raised.value.message
    assert [entry.name for entry in registry.list()] == ["a"]
    asyncio.run(registry.unregister("a"))
    registry.register("b", torch.randn(16, 8), LogitsFinish(vocab_size=16), "")


def test_registrations_in_progress_claim_their_bytes_before_they_allocate(tmp_path: Path) -> None:
    """A registration that has claimed 800 of 1000 bytes leaves 200 to the others: a file's 512-byte tensor is refused
    before it is read (naming `tensor`), and read once the claim is given back; a claim ends with the registration
    that made it."""
    registry = WeightRegistry(torch.device("cpu"), max_bytes=1000)
    registry.reserve("big")
    registry.claim("big", 800, "weight")
    save_file({"lm_head.weight": torch.randn(16, 8)}, str(tmp_path / "head.safetensors"))
    registry.reserve("file")

    def read() -> torch.Tensor:
        fd = open_weights_file(tmp_path, "head.safetensors")
        try:
            return read_safetensor(fd, "head.safetensors", "lm_head.weight", 1 << 20,
                                   lambda nbytes: registry.claim("file", nbytes, "tensor"))
        finally:
            os.close(fd)

    with pytest.raises(ServiceError) as raised:
        read()
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and raised.value.message.startswith("tensor: 512")
    registry.unreserve("big")
    weight = read()
    registry.register("file", weight, LogitsFinish(vocab_size=16), "", reserved=True)
    registry.reserve("next")
    registry.claim("next", 488, "weight")  # exactly what is left: the claim became the weight's bytes, not both


def test_a_registration_that_succeeded_leaves_a_later_reservation_of_its_name_alone() -> None:
    """Registration A registers "w"; before its thread finishes, "w" is unregistered and registration B reserves
    it and claims its bytes. A must not give back B's reservation (before: its thread's last step unreserved the
    name whoever held it, so a third registration could reserve it too and B's own register then failed with a
    KeyError, an INTERNAL; B's bytes also went uncounted)."""
    registry = WeightRegistry(torch.device("cpu"), max_bytes=1 << 20)
    registered, go_on = threading.Event(), threading.Event()

    def work_a() -> RegisteredWeight:
        entry = registry.register("w", torch.ones(4, 2), LogitsFinish(vocab_size=4), "", reserved=True)
        registered.set()
        go_on.wait(10)  # the thread held between its registration and its end
        return entry

    async def scenario() -> None:
        a = asyncio.ensure_future(registered_off_loop(registry, "w", work_a))
        await asyncio.to_thread(registered.wait, 10)
        await registry.unregister("w")
        registry.reserve("w")  # registration B
        registry.claim("w", 1000, "weight")
        go_on.set()
        await a
        with pytest.raises(ServiceError) as raised:  # a third registration: B still holds the name
            registry.reserve("w")
        assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert registry.register("w", torch.ones(4, 2), LogitsFinish(vocab_size=4), "", reserved=True).name == "w"

    asyncio.run(scenario())
