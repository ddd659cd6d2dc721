"""Hostile but well-typed calls of the RPCs other than Sample and the workloads, against a real CPU server.

The registry RPCs (RegisterRegion, ListRegions, UnregisterRegion, RegisterWeights, RegisterWeightsFromFile,
RegisterWeightsFromRegion, ListWeights, UnregisterWeights, GetServerInfo) are fuzzed as programs of calls, some of
them sent three times at once, checked against a model of what is registered: every answer is OK or a client-error
status whose message begins with a field of the request; a well-formed request on a free name under the caps is
answered OK with the WeightsInfo / RegionInfo it asked for; ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION and
RESOURCE_EXHAUSTED come exactly where the model says; the listings and GetServerInfo's counts match the model.
SampleStream gets streams of messages with carried, region-referenced and hidden-state inputs, outputs written to a
region and a message that does not parse: one answer per message, in order, each OK and well-formed or an error of
a client-error code naming a field, and a stream whose message does not parse ends INVALID_ARGUMENT after the answers
before it. Colocate, which needs the CUDA backend, is refused FAILED_PRECONDITION at once whatever it is sent.
Then: the stream flow control still bounds a stream that sent a message declaring a negative batch size, a weight
the server has no memory for is refused RESOURCE_EXHAUSTED (not INTERNAL), a malformed safetensors entry is refused
INVALID_ARGUMENT (not INTERNAL), references and file tensors of no element are refused naming their shape, and the
server still serves with no descriptor left open by the fuzzing.
Every call has a deadline of a few seconds: a hang fails. The examples are derandomized: the last test asks that
every method answered some call OK, which a random draw of a run need not give.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
import resource
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc

from .conftest import RunningServer, start_server
from .gated_server import GATE_SEED, ServerGate

TIMEOUT = 10.0
"""Deadline of every call: the server answers each of these in milliseconds; a hang fails the test."""
OK = grpc.StatusCode.OK
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE}
"""OUT_OF_RANGE: a region reference past the region's end (documented in resources/regions.py)."""
FIELDS = {
    "RegisterRegion": ("name", "source", "shm.key", "shm.byte_size", "cuda_ipc"),
    "UnregisterRegion": ("name",),
    "RegisterWeights": ("name", "dtype", "shape", "options", "data", "sha256", "weight"),
    "RegisterWeightsFromFile": ("name", "path", "tensor", "options", "weight"),
    "RegisterWeightsFromRegion": ("name", "weight", "options"),
    "UnregisterWeights": ("name",),
    "SampleStream": ("input", "logits", "logits_ref", "logits_rows", "hidden", "params", "num_samples", "top_logprobs",
                     "logprobs_mode", "output", "stream message"),
}
"""The fields each method's error messages may begin with ("weight" for the weight itself, NaN rows and empty
shapes, whichever way it came: docs/hardening.md)."""

MAX_REGIONS, MAX_WEIGHTS = 5, 4
WIRE = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT16: 2}
_TAG = f"tsfuzz{os.getpid()}"
SEG_FINITE, SEG_NAN, SEG_IN, SEG_OUT = (f"{_TAG}-{kind}" for kind in ("finite", "nan", "in", "out"))
SEG_BYTES = {SEG_FINITE: 4096, SEG_NAN: 256, SEG_IN: 4096, SEG_OUT: 4096}
FINITE_SEGMENTS = {SEG_FINITE, SEG_IN}
"""Filled with bytes 0..0x3f: every aligned float32, bfloat16 or float16 in them is finite. SEG_NAN is all 0xff."""
IN_REGION, OUT_REGION, HEAD = "s.in", "s.out", "s.head"
"""The stream fuzzer's regions and LM head, registered by the fixture for the whole module."""
HEAD_V, HEAD_D = 6, 4
BASE_REGIONS = {IN_REGION: (SEG_IN, SEG_BYTES[SEG_IN]), OUT_REGION: (SEG_OUT, SEG_BYTES[SEG_OUT])}

# The weight files of --weights-dir: (V, D, dtype) of the tensor "lm_head.weight" of the readable ones.
FILES = {"head.safetensors": (8, 4, pb.DTYPE_FLOAT32), "sub/head16.safetensors": (5, 3, pb.DTYPE_FLOAT16)}
FILE_ALIASES = {"./head.safetensors": "head.safetensors", "head.safetensors/": "head.safetensors",
                "sub//head16.safetensors": "sub/head16.safetensors"}
"""Paths the server reads as pathlib does: "." components, doubled and trailing slashes dropped."""
PATHS = [*FILES, *FILE_ALIASES, "link.safetensors", "fifo", "dir", "junk.bin", "short.safetensors", "nope",
         "", ".", "..", "../head.safetensors", "/etc/passwd", "sub/../head.safetensors", "sub", "x" * 300, "x\0y",
         "é.safetensors"]
"""Left out of the fuzzed paths, each the subject of a test of its own: bad_dtype.safetensors (a malformed entry) and
big.safetensors (a tensor the server has no memory for)."""
TENSORS = ["lm_head.weight", "lm_head.weight", "bias", "ids", "vector", "nan", "empty", "__metadata__", "", "nope"]

ANSWERED: collections.Counter[str] = collections.Counter()
"""OK answers per method, for the last test: a method never answered OK had none of its answers checked."""


# --- the server ------------------------------------------------------------------------------------------------


def _fill(segment: shared_memory.SharedMemory, key: str) -> None:
    size = SEG_BYTES[key]
    if key == SEG_NAN:
        segment.buf[:size] = b"\xff" * size
    else:
        segment.buf[:size] = np.random.default_rng(len(key)).integers(0, 0x40, size, dtype=np.uint8).tobytes()


def _safetensors(path: Path, tensors: dict[str, tuple[str | list, list[int], bytes]]) -> None:
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _weights_dir(root: Path) -> None:
    rng = np.random.default_rng(0)
    _safetensors(root / "head.safetensors", {
        "lm_head.weight": ("F32", [8, 4], rng.standard_normal((8, 4), dtype=np.float32).tobytes()),
        "bias": ("F32", [8], rng.standard_normal(8, dtype=np.float32).tobytes()),
        "ids": ("I64", [8, 4], np.arange(32, dtype=np.int64).tobytes()),
        "vector": ("F32", [32], rng.standard_normal(32, dtype=np.float32).tobytes()),
        "nan": ("F32", [2, 2], np.array([1, np.nan, 0, 1], dtype=np.float32).tobytes()),
        "empty": ("F32", [0, 4], b""),
    })
    _safetensors(root / "sub" / "head16.safetensors",
                 {"lm_head.weight": ("F16", [5, 3], rng.standard_normal((5, 3)).astype(np.float16).tobytes())})
    (root / "link.safetensors").symlink_to(root / "head.safetensors")
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (root / "junk.bin").write_bytes(rng.integers(0, 256, 64, dtype=np.uint8).tobytes())
    (root / "short.safetensors").write_bytes(b"\x10\0\0")
    (root / "é.safetensors").write_bytes(b"")
    _safetensors(root / "bad_dtype.safetensors", {"w": (["F32"], [2, 2], bytes(16))})  # valid JSON, no dtype name
    _safetensors(root / "big.safetensors", {"w": ("F32", [1, 1], bytes(4))})  # rewritten sparse by its test


@dataclass
class Fuzzed:
    server: RunningServer
    gate: ServerGate
    weights_dir: Path
    segments: dict[str, shared_memory.SharedMemory]
    base_fds: int = 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    root = tmp_path_factory.mktemp("weights")
    _weights_dir(root)
    segments = {}
    try:
        for key, size in SEG_BYTES.items():
            segments[key] = shared_memory.SharedMemory(name=key, create=True, size=size)
            _fill(segments[key], key)
        gate = ServerGate()
        server = start_server("--device", "cpu", "--allow-shm", "--allow-cuda-ipc", "--weights-dir", str(root),
                              "--max-regions", str(MAX_REGIONS), "--max-weights", str(MAX_WEIGHTS),
                              "--unregister-timeout-s", "2", gate=gate)
        try:
            yield Fuzzed(server, gate, root, segments)
        finally:
            server.stop()
    finally:
        for segment in segments.values():
            segment.close()
            segment.unlink()


@pytest.fixture(scope="module")
def stub(fuzzed: Fuzzed) -> Iterator[pb_grpc.SamplerStub]:
    """A stub whose server has the stream fuzzer's regions and LM head registered."""
    with grpc.insecure_channel(fuzzed.server.target) as channel:
        stub = pb_grpc.SamplerStub(channel)
        for name, (key, size) in BASE_REGIONS.items():
            stub.RegisterRegion(pb.RegisterRegionRequest(name=name, shm=pb.SharedMemorySource(key=key, byte_size=size)),
                                timeout=TIMEOUT)
        weight = np.random.default_rng(1).standard_normal((HEAD_V, HEAD_D), dtype=np.float32).tobytes()
        stub.RegisterWeights(iter([pb.RegisterWeightsChunk(name=HEAD, dtype=pb.DTYPE_FLOAT32, shape=[HEAD_V, HEAD_D],
                                                           data=weight, sha256=hashlib.sha256(weight).hexdigest())]),
                             timeout=TIMEOUT)
        fuzzed.base_fds = _fds(fuzzed.server.process.pid)
        yield stub


def _call(method: Callable, request: object) -> tuple[grpc.StatusCode, str, object]:
    try:
        return OK, "", method(request, timeout=TIMEOUT)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None


def _assert_client_error(method: str, code: grpc.StatusCode, details: str) -> None:
    """A refusal: a client-error status whose message begins with one of the method's fields."""
    assert code in CLIENT_ERRORS, (method, code, details)
    fields = "|".join(re.escape(name) for name in FIELDS[method])
    assert re.match(rf"({fields})[.:\[ ]", details), (method, code, details)
    assert "request id" in details, details


# --- the registry RPCs ---------------------------------------------------------------------------------------


def _name_ok(name: str) -> bool:
    return bool(name) and name.isprintable() and len(name.encode()) <= 256


def mostly(valid: list, hostile: list) -> st.SearchStrategy:
    """A valid value four times in five: the answers to check are mostly OK ones."""
    return st.integers(0, 4).flatmap(lambda i: st.sampled_from(valid if i < 4 else hostile))


region_names = mostly(["r0", "r1"], ["r 2", "", "bad\nname", "n" * 257])
weight_names = mostly(["w0", "w1"], ["w 2", "", "tab\tname", "é" * 129])


@st.composite
def weight_options(draw, rows: int) -> tuple[pb.WeightOptions, bool]:
    """Options for a weight of `rows` rows, and whether they are valid."""
    options, valid = pb.WeightOptions(), True
    if draw(st.integers(0, 3)) == 3:
        size = draw(mostly([rows], [rows + 1, rows - 1]))
        dtype = draw(mostly([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16], [pb.DTYPE_INT32, 0]))
        value = draw(mostly([0.5], [float("nan")]))
        data = np.full(size, value, dtype=np.float16 if dtype == pb.DTYPE_FLOAT16 else np.float32).tobytes()
        options.bias.CopyFrom(pb.Tensor(dtype=dtype, shape=[size], data=data))
        valid &= size == rows and dtype in (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16) and not math.isnan(value)
    if draw(st.integers(0, 3)) == 3:
        options.vocab_size = draw(mostly([1, rows], [0, rows + 1]))
        valid &= 1 <= options.vocab_size <= rows
    if draw(st.integers(0, 3)) == 3:
        options.soft_cap = draw(mostly([5.0, 0.5], [0.0, -1.0, float("nan"), float("inf")]))
        valid &= math.isfinite(options.soft_cap) and options.soft_cap > 0
    if draw(st.integers(0, 3)) == 3:
        options.logit_scale = draw(mostly([2.0, 0.0, -1.0], [float("nan"), float("inf"), -float("inf")]))
        valid &= math.isfinite(options.logit_scale)
    return options, valid


@dataclass
class Op:
    method: str
    request: object
    valid: bool = True
    """Whether the request is well-formed whatever is registered (RegisterWeightsFromRegion: also given its region)."""
    expect: dict = field(default_factory=dict)
    """What an OK answer must say."""
    times: int = 1
    """Sent this many times at once."""


@st.composite
def register_region(draw) -> Op:
    name = draw(region_names)
    request = pb.RegisterRegionRequest(name=name)
    kind = draw(mostly(["shm"], ["cuda_ipc", "none"]))
    if kind == "shm":
        key = draw(mostly([SEG_FINITE, SEG_FINITE, SEG_NAN], ["nope", ".", "..", "", "a/b", "k" * 201]))
        size = SEG_BYTES.get(key, 64)
        byte_size = draw(mostly([size, size, 16, 64], [0, size + 1, 2**64 - 1]))
        request.shm.CopyFrom(pb.SharedMemorySource(key=key, byte_size=byte_size))
        valid = _name_ok(name) and key in SEG_BYTES and 1 <= byte_size <= size
        return Op("RegisterRegion", request, valid, {"key": key, "byte_size": byte_size})
    if kind == "cuda_ipc":
        request.cuda_ipc.CopyFrom(pb.CudaIpcSource(device_uuid=draw(st.sampled_from(["", "GPU-0"])),
                                                   handle=draw(st.binary(max_size=8)),
                                                   storage_size_bytes=draw(st.sampled_from([0, 64, 2**64 - 1]))))
    return Op("RegisterRegion", request, False)


@st.composite
def upload(draw) -> Op:
    """RegisterWeights: a header, data in chunks, the SHA-256 somewhere; sometimes one thing wrong."""
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16]))
    values = np.random.default_rng(draw(st.integers(0, 9))).uniform(-1, 1, (rows, cols)).astype(np.float32)
    fault = draw(mostly([None], ["nan", "dtype", "shape", "short", "long", "sha", "no_sha", "resent", "empty"]))
    if fault == "nan":
        values[draw(st.integers(0, rows - 1)), 0] = np.nan
    data = {pb.DTYPE_FLOAT32: values.tobytes(), pb.DTYPE_FLOAT16: values.astype(np.float16).tobytes(),
            pb.DTYPE_BFLOAT16: (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()}[dtype]
    shape = [rows, cols]
    digest = hashlib.sha256(data).hexdigest()
    if fault == "dtype":
        dtype = draw(st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_UINT8, 0, 99]))
    elif fault == "shape":
        shape = draw(st.sampled_from([[rows], [rows, cols, 1], [0, cols], [-rows, -cols], [2**33, 1], []]))
    elif fault == "short":
        data = data[: -draw(st.integers(1, len(data)))]
    elif fault == "long":
        data += b"\0\0"
    options, options_valid = draw(weight_options(rows))
    name = draw(weight_names)
    cut = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces = [data[a:b] for a, b in zip([0, *cut], [*cut, len(data)])]
    chunks = [pb.RegisterWeightsChunk(name=name, dtype=dtype, shape=shape, options=options, data=pieces[0])]
    chunks += [pb.RegisterWeightsChunk(data=piece) for piece in pieces[1:]]
    where = draw(st.sampled_from(["header", "last", "upper"]))
    sha = {"sha": "0" * 64, "no_sha": ""}.get(fault, digest.upper() if where == "upper" else digest)
    (chunks[0] if where == "header" else chunks[-1]).sha256 = sha
    if fault == "resent":  # a header field again, after the header
        again = draw(st.sampled_from([{"name": "w9"}, {"dtype": pb.DTYPE_FLOAT32}, {"shape": [rows, cols]},
                                      {"options": pb.WeightOptions(soft_cap=1.0)}]))
        chunks.insert(draw(st.integers(1, len(chunks))), pb.RegisterWeightsChunk(**again))
    if fault == "empty":
        chunks = []
    valid = fault is None and options_valid and _name_ok(name)
    return Op("RegisterWeights", chunks, valid,
              {"name": name, "shape": shape, "dtype": dtype, "bytes": len(data), "sha256": digest, "region": "",
               "vocab": options.vocab_size if options.HasField("vocab_size") else rows})


@st.composite
def from_file(draw) -> Op:
    path = draw(st.one_of(st.sampled_from([*FILES, *FILE_ALIASES]), st.sampled_from(PATHS)))
    tensor = draw(st.one_of(st.just("lm_head.weight"), st.sampled_from(TENSORS)))
    real = FILE_ALIASES.get(path, path)
    rows = FILES[real][0] if real in FILES else 8
    options, options_valid = draw(weight_options(rows))
    name = draw(weight_names)
    valid = real in FILES and tensor == "lm_head.weight" and options_valid and _name_ok(name)
    expect = {}
    if real in FILES:
        rows, cols, dtype = FILES[real]
        expect = {"name": name, "shape": [rows, cols], "dtype": dtype, "bytes": rows * cols * WIRE[dtype], "file": real,
                  "region": "", "vocab": options.vocab_size if options.HasField("vocab_size") else rows}
    return Op("RegisterWeightsFromFile", pb.RegisterWeightsFromFileRequest(name=name, path=path, tensor=tensor,
                                                                           options=options), valid, expect)


@st.composite
def from_region(draw) -> Op:
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    dtype = draw(mostly([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16], [pb.DTYPE_INT32, 0]))
    shape = draw(mostly([[rows, cols]], [[rows], [], [0, cols], [rows, 0], [-1, cols], [rows, cols, 1], [2**33, 1],
                                         [1, 2**62]]))
    offset = draw(mostly([0, 0, 4, 16, 32], [2, 4096 - 16, 256, 4096, 2**64 - 4]))
    region = draw(mostly([IN_REGION, IN_REGION, "r0", "r1"], ["r 2", "nope", ""]))
    options, options_valid = draw(weight_options(rows))
    name = draw(weight_names)
    request = pb.RegisterWeightsFromRegionRequest(name=name, options=options)
    if draw(st.integers(0, 9)) < 9:
        request.weight.CopyFrom(pb.TensorRef(region=region, offset=offset, dtype=dtype, shape=shape))
    itemsize = WIRE.get(dtype, 4)
    well_formed = (request.HasField("weight") and dtype in WIRE and len(shape) == 2 and min(shape) >= 1
                   and max(shape) < 2**32 and offset % itemsize == 0 and options_valid and _name_ok(name))
    return Op("RegisterWeightsFromRegion", request, well_formed,
              {"name": name, "shape": shape, "dtype": dtype, "region": region, "offset": offset,
               "bytes": math.prod(shape) * itemsize, "sha256": "",
               "vocab": options.vocab_size if options.HasField("vocab_size") else rows})


def _named(method: str, request_type: type, names: st.SearchStrategy) -> st.SearchStrategy:
    return names.map(lambda name: Op(method, request_type(name=name)))


one_op = st.one_of(
    register_region(), register_region(), register_region(),
    _named("UnregisterRegion", pb.UnregisterRegionRequest, region_names),
    upload(), from_file(), from_region(), from_region(), from_region(),
    _named("UnregisterWeights", pb.UnregisterWeightsRequest, weight_names),
    st.just(Op("ListRegions", pb.ListRegionsRequest())), st.just(Op("ListWeights", pb.ListWeightsRequest())),
    st.just(Op("GetServerInfo", pb.GetServerInfoRequest())),
)


@st.composite
def programs(draw) -> list[Op]:
    ops = draw(st.lists(one_op, min_size=1, max_size=12))
    program: list[Op] = []
    for op in ops:
        if op.method.startswith(("Register", "Unregister")) and draw(st.integers(0, 5)) == 5:
            op = replace(op, times=3)  # sent three times at once: one of them at most is OK
        program.append(op)
    for at, op in reversed(list(enumerate(program))):
        if op.method.startswith("Register") and draw(st.integers(0, 2)) == 2:  # and unregistered later on
            name = op.request.name if op.method != "RegisterWeights" else op.expect["name"]
            undo = Op("UnregisterRegion", pb.UnregisterRegionRequest(name=name)) if op.method == "RegisterRegion" \
                else Op("UnregisterWeights", pb.UnregisterWeightsRequest(name=name))
            program.insert(draw(st.integers(at + 1, len(program))), undo)
    return program


@dataclass
class Registry:
    """What the server should hold: regions by name (segment key, bytes), weights by name (region or "", bytes)."""

    regions: dict[str, tuple[str, int]]
    weights: dict[str, tuple[str, int]]


def _file_sha(path: Path, tensor: str = "lm_head.weight") -> str:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + length])[tensor]["data_offsets"]
    return hashlib.sha256(raw[8 + length + begin:8 + length + end]).hexdigest()


def _check_weights_info(info: pb.WeightsInfo, op: Op, weights_dir: Path) -> None:
    want = op.expect
    rows, cols = want["shape"]
    assert (info.name, info.padded_vocab_size, info.hidden_size, info.dtype, info.bytes, info.region) == \
        (want["name"], rows, cols, want["dtype"], rows * cols * WIRE[want["dtype"]], want["region"]), (info, want)
    assert info.vocab_size == want["vocab"], (info, want)
    sha = _file_sha(weights_dir / want["file"]) if "file" in want else want["sha256"]
    assert info.sha256 == sha, (info, want)


def _expected_ok(op: Op, model: Registry) -> bool:
    """Whether the model says `op`, sent once, must be answered OK."""
    name = getattr(op.request, "name", None) if op.method != "RegisterWeights" else op.expect.get("name")
    if op.method == "RegisterRegion":
        return op.valid and name not in model.regions and len(model.regions) < MAX_REGIONS
    if op.method == "UnregisterRegion":
        return name in model.regions and not any(region == name for region, _ in model.weights.values())
    if op.method == "UnregisterWeights":
        return name in model.weights
    if op.method.startswith("RegisterWeights"):
        if not op.valid or name in model.weights or len(model.weights) >= MAX_WEIGHTS:
            return False
        if op.method == "RegisterWeightsFromRegion":
            key, size = model.regions.get(op.expect["region"], ("", 0))
            return key in FINITE_SEGMENTS and op.expect["offset"] + op.expect["bytes"] <= size
        return True
    return True  # the listings and GetServerInfo


def _weights_bytes(op: Op) -> int:
    if op.method == "RegisterWeights":
        return op.expect["bytes"]
    return math.prod(op.expect["shape"]) * WIRE[op.expect["dtype"]]


def _send(stub: pb_grpc.SamplerStub, op: Op) -> list[tuple[grpc.StatusCode, str, object]]:
    method = getattr(stub, op.method)
    if op.times == 1:
        return [_call(method, iter(op.request) if op.method == "RegisterWeights" else op.request)]
    futures = [method.future(iter(op.request) if op.method == "RegisterWeights" else op.request, timeout=TIMEOUT)
               for _ in range(op.times)]
    answers = []
    for future in futures:
        try:
            answers.append((OK, "", future.result()))
        except grpc.RpcError as err:
            answers.append((err.code(), err.details() or "", None))
    return answers


def _run(stub: pb_grpc.SamplerStub, op: Op, model: Registry, weights_dir: Path, fuzzing: bool = True) -> None:
    """Sends `op`, checks its answers against the model and updates the model (`fuzzing`: inside a Hypothesis test,
    whose statistics count the answers)."""
    answers = _send(stub, op)
    expected = _expected_ok(op, model)
    name = getattr(op.request, "name", None) if op.method != "RegisterWeights" else op.expect.get("name")
    oks = [answer for answer in answers if answer[0] == OK]
    for code, details, _ in answers:
        if fuzzing:
            event(f"{op.method}: {code.name}" + (f" {details.split(':')[0]}" if code != OK else ""))
        if code != OK:
            _assert_client_error(op.method, code, details)
    # One of the copies sent at once at most is OK; the others find the name taken, or gone.
    assert len(oks) == (1 if expected else 0), (op.method, op.request, expected, answers)
    if op.times > 1 and expected:
        again = {"UnregisterRegion": grpc.StatusCode.NOT_FOUND, "UnregisterWeights": grpc.StatusCode.NOT_FOUND}.get(
            op.method, grpc.StatusCode.ALREADY_EXISTS)
        assert all(code in (OK, again, grpc.StatusCode.RESOURCE_EXHAUSTED) for code, _, _ in answers), answers
    if not oks:  # refused: where the model says why, the status says the same
        code = answers[0][0]
        if op.times == 1 and op.method in ("UnregisterRegion", "UnregisterWeights"):
            registered = model.regions if op.method == "UnregisterRegion" else model.weights
            want = grpc.StatusCode.FAILED_PRECONDITION if name in registered else grpc.StatusCode.NOT_FOUND
            assert code == want, (op.method, name, answers, model)
        for code_, details, _ in answers:  # taken: registered, or (a copy sent at once) being registered
            if code_ == grpc.StatusCode.ALREADY_EXISTS:
                assert name in (model.regions if op.method == "RegisterRegion" else model.weights) or (
                    op.times > 1 and "is being registered" in details), (op, answers, model)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and op.times == 1:
            count = len(model.regions) if op.method == "RegisterRegion" else len(model.weights)
            assert count >= (MAX_REGIONS if op.method == "RegisterRegion" else MAX_WEIGHTS), (op, answers, model)
        if op.times == 1 and op.valid and op.method.startswith("Register") and name not in (
                model.regions if op.method == "RegisterRegion" else model.weights):
            cap = MAX_REGIONS if op.method == "RegisterRegion" else MAX_WEIGHTS
            if len(model.regions if op.method == "RegisterRegion" else model.weights) >= cap:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (op, answers, model)
        return
    ANSWERED[op.method] += 1
    response = oks[0][2]
    if op.method == "RegisterRegion":
        assert (response.name, response.kind, response.byte_size, response.device, response.in_flight) == \
            (name, "shm", op.expect["byte_size"], "cpu", 0), response
        model.regions[name] = (op.expect["key"], op.expect["byte_size"])
    elif op.method == "UnregisterRegion":
        assert response.region.name == name and response.region.byte_size == model.regions.pop(name)[1], response
    elif op.method == "UnregisterWeights":
        assert response.weights.name == name and response.weights.bytes == model.weights.pop(name)[1], response
    elif op.method.startswith("RegisterWeights"):
        _check_weights_info(response, op, weights_dir)
        model.weights[name] = (op.expect["region"], _weights_bytes(op))
    elif op.method == "ListRegions":
        assert {r.name: (r.byte_size, r.kind, r.in_flight) for r in response.regions} == \
            {n: (size, "shm", 0) for n, (_, size) in model.regions.items()}, (response, model)
    elif op.method == "ListWeights":
        assert {w.name: (w.region, w.bytes, w.in_flight) for w in response.weights} == \
            {n: (region, size, 0) for n, (region, size) in model.weights.items()}, (response, model)
    elif op.method == "GetServerInfo":
        _check_server_info(response, model)


def _check_server_info(info: pb.ServerInfo, model: Registry) -> None:
    assert (info.backend, info.device, info.api_version, info.mps) == ("cpu", "cpu", "tokensampler.v1", ""), info
    assert {"regions", "weights_from_file", "weights_from_region", "sample_stream"} <= set(info.features), info.features
    assert "colocated" not in info.features, info.features  # needs the CUDA backend
    assert list(info.logits_dtypes) == [pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16], info
    assert info.limits.max_batch_rows > 0 and info.limits.max_weight_bytes > 0 and info.limits.max_batch_elements > 0
    # Weights read from a segment are copies: the server holds their bytes (only a CUDA region's is used in place).
    assert info.registered_weights == len(model.weights), (info, model)
    assert info.registered_weights_bytes == sum(size for _, size in model.weights.values()), (info, model)
    assert info.device_memory_allocated_bytes == info.device_memory_reserved_bytes == 0


def _cleanup(stub: pb_grpc.SamplerStub) -> None:
    """Back to the module's own regions and weight, whatever the example left."""
    for weight in stub.ListWeights(pb.ListWeightsRequest(), timeout=TIMEOUT).weights:
        if weight.name != HEAD:
            stub.UnregisterWeights(pb.UnregisterWeightsRequest(name=weight.name), timeout=TIMEOUT)
    for region in stub.ListRegions(pb.ListRegionsRequest(), timeout=TIMEOUT).regions:
        if region.name not in BASE_REGIONS:
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name=region.name), timeout=TIMEOUT)


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs())
def test_registry_calls_follow_the_model(fuzzed: Fuzzed, stub: pb_grpc.SamplerStub, program: list[Op]) -> None:
    model = Registry(regions=dict(BASE_REGIONS), weights={HEAD: ("", HEAD_V * HEAD_D * 4)})
    try:
        for op in program:
            _run(stub, op, model, fuzzed.weights_dir)
        # The registries hold what the model holds, and nothing is left in flight.
        for op in (Op("ListRegions", pb.ListRegionsRequest()), Op("ListWeights", pb.ListWeightsRequest()),
                   Op("GetServerInfo", pb.GetServerInfoRequest())):
            _run(stub, op, model, fuzzed.weights_dir)
    finally:
        _cleanup(stub)


# --- SampleStream ---------------------------------------------------------------------------------------------


@dataclass
class Message:
    request: pb.SampleRequest
    rows: int | None
    """B and V where the request states them validly (else None: it cannot be answered OK)."""
    vocab: int | None
    valid: bool
    """Well-formed in every field: must be answered OK."""


seeds = st.integers(0, 2**64 - 1).filter(lambda seed: seed != GATE_SEED)


@st.composite
def stream_messages(draw) -> Message:
    rows, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["logits", "logits", "logits_ref", "logits_ref", "logits_rows", "hidden", "hidden_ref",
                                 "negative", "none"]))
    request = pb.SampleRequest()
    valid = True
    in_bytes = SEG_BYTES[SEG_IN]
    if kind == "logits":
        data = np.random.default_rng(draw(st.integers(0, 9))).standard_normal((rows, vocab), dtype=np.float32).tobytes()
        if draw(st.integers(0, 4)) == 4:
            data = data[: -draw(st.integers(1, len(data)))]
            valid = False
        request.logits.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, vocab], data=data))
    elif kind == "logits_ref":
        dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_INT32]))
        offset = draw(st.sampled_from([0, 0, 64, 2, in_bytes - 4, in_bytes, 2**64 - 4]))
        shape = draw(st.sampled_from([[rows, vocab]] * 3 + [[vocab], [rows, 0], [-rows, vocab], [2**40, 2**40]]))
        region = draw(st.sampled_from([IN_REGION, IN_REGION, IN_REGION, OUT_REGION, "nope", ""]))
        request.logits_ref.CopyFrom(pb.TensorRef(region=region, offset=offset, dtype=dtype, shape=shape))
        valid = (dtype in WIRE and shape == [rows, vocab] and offset % WIRE[dtype] == 0
                 and offset + rows * vocab * WIRE[dtype] <= in_bytes and region == IN_REGION)
    elif kind == "logits_rows":
        dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, 0]))
        row_size = draw(st.sampled_from([vocab, vocab, 0, 2**40]))
        offsets = draw(st.lists(st.sampled_from([0, 64, 32, 6, in_bytes - 4, in_bytes]), min_size=rows, max_size=rows))
        request.logits_rows.CopyFrom(pb.RowsRef(region=draw(st.sampled_from([IN_REGION, IN_REGION, "nope"])),
                                                dtype=dtype, row_size=row_size, row_offsets=offsets))
        itemsize = WIRE.get(dtype, 1)
        valid = (dtype in WIRE and row_size == vocab and request.logits_rows.region == IN_REGION
                 and all(o % itemsize == 0 and o + vocab * itemsize <= in_bytes for o in offsets))
    elif kind in ("hidden", "hidden_ref"):
        width = draw(st.sampled_from([HEAD_D, HEAD_D, HEAD_D + 1]))
        weights = draw(st.sampled_from([HEAD, HEAD, HEAD, "nope", ""]))
        request.hidden.weights = weights
        if kind == "hidden":
            data = np.random.default_rng(3).standard_normal((rows, width), dtype=np.float32).tobytes()
            request.hidden.states.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, width], data=data))
        else:
            request.hidden.states_ref.CopyFrom(pb.TensorRef(region=IN_REGION, offset=draw(st.sampled_from([0, 128])),
                                                            dtype=pb.DTYPE_FLOAT32, shape=[rows, width]))
        vocab = HEAD_V
        valid = width == HEAD_D and weights == HEAD
    elif kind == "negative":  # a batch size no tensor has
        request.logits.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-draw(st.sampled_from([1, 2**40])), vocab]))
        valid = False
    else:
        valid = False
    request.params.seed.extend(draw(st.lists(seeds, min_size=rows, max_size=rows)))
    if draw(st.booleans()):
        request.params.temperature.append(draw(st.sampled_from([0.0, 0.7, 1.0, -1.0, float("nan")])))
        valid &= request.params.temperature[0] >= 0
    if draw(st.booleans()):
        request.params.top_k.append(draw(st.sampled_from([0, 1, 3, -1, -5])))
        valid &= request.params.top_k[0] >= -1
    samples = draw(st.sampled_from([None, None, 1, 2, 3, 0, 65]))
    if samples is not None:
        request.num_samples = samples
        valid &= 1 <= samples <= 64
    num_samples = samples if samples is not None else 1
    request.return_logprobs = draw(st.booleans())
    request.top_logprobs = draw(st.sampled_from([0, 0, 2, 9, 65]))
    request.logprobs_mode = draw(st.sampled_from([0, 1, 2, 2, 7]))
    valid &= request.top_logprobs <= 64 and request.logprobs_mode <= 2
    if draw(st.integers(0, 2)) == 0:  # the tokens (and log-probs) written to a region
        offset = draw(st.sampled_from([0, 0, 128, 2, SEG_BYTES[SEG_OUT] - 4, SEG_BYTES[SEG_OUT]]))
        shape = draw(st.sampled_from([[rows, num_samples], [rows, num_samples], [rows], [num_samples, rows + 1]]))
        dtype = draw(st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_INT32, pb.DTYPE_INT64]))
        region = draw(st.sampled_from([OUT_REGION, OUT_REGION, OUT_REGION, "nope"]))  # s.in stays as filled
        request.output.tokens.CopyFrom(pb.TensorRef(region=region, offset=offset, dtype=dtype, shape=shape))
        valid &= (dtype == pb.DTYPE_INT32 and shape == [rows, num_samples] and offset % 4 == 0
                  and offset + rows * num_samples * 4 <= SEG_BYTES[SEG_OUT] and region == OUT_REGION)
        if request.return_logprobs and draw(st.booleans()):
            at = draw(st.sampled_from([2048, offset]))
            request.output.logprobs.CopyFrom(pb.TensorRef(region=OUT_REGION, offset=at, dtype=pb.DTYPE_FLOAT32,
                                                          shape=[rows, num_samples]))
            valid &= at >= offset + rows * num_samples * 4 or at + rows * num_samples * 4 <= offset
    known = kind not in ("negative", "none")
    return Message(request, rows if known else None, vocab if known else None, valid)


def _check_stream_answer(message: Message, answer: pb.SampleStreamResponse) -> str:
    """Checks one answer against its message: 'ok' or the refused field."""
    if answer.WhichOneof("result") == "error":
        error = answer.error
        code = grpc.StatusCode.INVALID_ARGUMENT
        for status in grpc.StatusCode:
            if status.value[0] == error.code:
                code = status
        assert error.code in [status.value[0] for status in CLIENT_ERRORS], (message.request, error)
        _assert_client_error("SampleStream", code, error.message)
        assert error.request_id and error.request_id in error.message, error
        assert not message.valid, (message.request, error)
        return error.message.split(":")[0]
    assert answer.WhichOneof("result") == "response", answer
    response, request = answer.response, message.request
    rows, vocab = message.rows, message.vocab
    assert rows is not None, (request, response)
    samples = request.num_samples if request.HasField("num_samples") else 1
    assert len(response.seeds) == len(response.valid) == len(response.nan_detected) == rows, response
    assert list(response.seeds) == list(request.params.seed), response  # given for every row
    if request.output.HasField("tokens"):
        assert not response.HasField("tokens"), response  # written to the region instead
    else:
        assert response.tokens.dtype == pb.DTYPE_INT32 and list(response.tokens.shape) == [rows, samples], response
        tokens = np.frombuffer(response.tokens.data, dtype=np.int32).reshape(rows, samples)
        for row, ok in zip(tokens, response.valid):
            assert ((row >= 0) & (row < vocab)).all() if ok else (row == -1).all(), (tokens, response.valid)
    if request.return_logprobs and not request.output.HasField("logprobs"):
        assert response.logprobs.dtype == pb.DTYPE_FLOAT32 and list(response.logprobs.shape) == [rows, samples]
    elif not request.return_logprobs:
        assert not response.HasField("logprobs"), response
    if request.top_logprobs:
        assert list(response.top_logprob_ids.shape)[:1] == [rows] and response.top_logprob_ids.dtype == pb.DTYPE_INT32
        ids = np.frombuffer(response.top_logprob_ids.data, dtype=np.int32)
        assert ((ids >= -1) & (ids < vocab)).all(), ids
    return "ok"


STREAM_METHOD = "/tokensampler.v1.Sampler/SampleStream"


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(messages=st.lists(stream_messages(), min_size=1, max_size=8),
       garbage=st.sampled_from([None] * 4 + list(range(8))))
def test_stream_answers_each_message_in_order(fuzzed: Fuzzed, stub: pb_grpc.SamplerStub, messages: list[Message],
                                              garbage: int | None) -> None:
    """Messages serialised by hand (so that one may be bytes that do not parse, at index `garbage`)."""
    raw = [message.request.SerializeToString() for message in messages]
    if garbage is not None and garbage <= len(raw):
        raw.insert(garbage, b"\x0a\x05ab")  # the logits field, 5 bytes long, with 2 bytes left
    else:
        garbage = None
    out = fuzzed.segments[SEG_OUT]
    out.buf[: SEG_BYTES[SEG_OUT]] = b"\x7f" * SEG_BYTES[SEG_OUT]  # no token id: what a write leaves tells
    with grpc.insecure_channel(fuzzed.server.target) as channel:
        open_stream = channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                            response_deserializer=pb.SampleStreamResponse.FromString)
        call = open_stream(iter(raw), timeout=TIMEOUT)
        answers, code, details = [], OK, ""
        try:
            answers.extend(call)
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
    expected = len(messages) if garbage is None else garbage
    assert len(answers) == expected, (len(answers), expected, code, details)
    if garbage is None:
        assert code == OK, (code, details)
    else:  # ends the stream, after the answers of the messages before it
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"request: message {garbage} "), details
    last_written = None
    for message, answer in zip(messages, answers):
        outcome = _check_stream_answer(message, answer)
        event(f"SampleStream: {outcome}")
        if outcome == "ok":
            ANSWERED["SampleStream"] += 1
            if message.request.output.tokens.region == OUT_REGION:
                last_written = message
    if last_written is not None:  # the last tokens written to the region are there, and are token ids
        ref = last_written.request.output.tokens
        count = math.prod(ref.shape)
        tokens = np.frombuffer(bytes(out.buf[ref.offset:ref.offset + 4 * count]), dtype=np.int32)
        assert ((tokens >= -1) & (tokens < last_written.vocab)).all(), tokens


# --- Colocate -------------------------------------------------------------------------------------------------


colocate_requests = st.one_of(
    st.builds(lambda step: pb.ColocateRequest(step=pb.ColocateStep(step=step)), st.integers(0, 2**64 - 1)),
    st.builds(lambda region, flags, timeout: pb.ColocateRequest(open=pb.ColocateOpen(
        logits=pb.TensorRef(region=region, dtype=pb.DTYPE_FLOAT32, shape=[1, 4]), flags=flags, wait_timeout_ms=timeout,
        tokens=pb.TensorRef(region=region, dtype=pb.DTYPE_INT32, shape=[1, 1]))),
        st.sampled_from([IN_REGION, "nope", ""]), st.sampled_from([OUT_REGION, ""]), st.integers(0, 2**32 - 1)),
)


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(requests=st.lists(colocate_requests, max_size=4))
def test_colocate_is_refused_on_the_cpu_backend(stub: pb_grpc.SamplerStub, requests: list[pb.ColocateRequest]) -> None:
    call = stub.Colocate(iter(requests), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION, raised.value
    assert raised.value.details().startswith("Colocate: this server samples on the CPU"), raised.value.details()


# --- hazards of their own, each a test ---------------------------------------------------------------------------


def test_a_message_declaring_a_negative_batch_size_does_not_open_the_streams_window(fuzzed: Fuzzed) -> None:
    """A stream's first message is held in the backend; then come 1 MiB messages. The server reads about a window
    (16 MiB) of them and stops, so that HTTP/2 flow control stops the client. Sent right after the held message, a
    message whose logits declare the shape [-2^40, 1] (refused INVALID_ARGUMENT, as it should be) must not change
    that: a message's bytes are counted from its declared batch size (rpc/sample_rpc._answer_bytes), and a negative
    size, counted as such, would lower the window and the budget every stream shares until that message is answered
    (behind the held one, or behind answers its client does not read). validation/sample.declared_rows and
    resources/regions.referenced_bytes count a negative size as 0."""
    vocab = 1 << 18
    big = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, vocab], data=bytes(4 * vocab)))
    big.params.seed.append(1)
    held = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 4], data=bytes(16)))
    held.params.seed.append(GATE_SEED)
    negative = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-(2**40), 1]))
    window = (16 << 20) // big.ByteSize()

    def messages_read(first: list[pb.SampleRequest]) -> tuple[int, list[pb.SampleStreamResponse]]:
        sent, stop = [0], threading.Event()

        def requests() -> Iterator[pb.SampleRequest]:
            for message in [*first, *[big] * 100]:
                sent[0] += 1
                yield message
            stop.wait(TIMEOUT)

        with grpc.insecure_channel(fuzzed.server.target) as channel:
            call = pb_grpc.SamplerStub(channel).SampleStream(requests(), timeout=30)
            try:
                fuzzed.gate.wait_held(TIMEOUT)
                previous = -1
                for _ in range(50):  # until the client's sending stops (a few hundred ms)
                    time.sleep(0.1)
                    if sent[0] == previous:
                        break
                    previous = sent[0]
            finally:
                fuzzed.gate.release()
                stop.set()
            return sent[0], list(call)

    plain, answers = messages_read([held])
    assert len(answers) == 101 and all(a.WhichOneof("result") == "response" for a in answers)
    # The window, the held message, and what the transports buffer of the client's sending (a few MiB).
    assert plain <= window + 12, (plain, window)
    after_negative, answers = messages_read([held, negative])
    assert answers[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], answers[1]
    assert answers[1].error.message.startswith("logits.shape"), answers[1]
    assert after_negative <= window + 13, (f"{after_negative} messages of 1 MiB read while the window holds {window}: "
                                           "the negative batch size opened it")


@pytest.fixture()
def little_memory(fuzzed: Fuzzed) -> Iterator[int]:
    """The server's address space capped at 1 GiB past what it has mapped now (its soft RLIMIT_AS): an allocation of
    several GiB fails there, as it does on a machine with less memory than --max-weight-mb. Yields the size of a
    weight it cannot hold."""
    pid = fuzzed.server.process.pid
    mapped = int(re.search(r"VmSize:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024
    weight_bytes = 8 << 30
    if mapped + (1 << 30) >= weight_bytes:
        pytest.skip(f"the server maps {mapped} bytes already")
    soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (mapped + (1 << 30), hard))
    try:
        yield weight_bytes
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))


def test_a_weight_the_server_has_no_memory_for_is_refused_resource_exhausted(fuzzed: Fuzzed, stub: pb_grpc.SamplerStub,
                                                                            little_memory: int) -> None:
    """An 8 GiB weight (within the default --max-weight-mb of 16 GiB) in a sparse segment, and in a sparse file of
    --weights-dir: reading it needs memory the server does not have. Expected: RESOURCE_EXHAUSTED naming the weight
    (weight_files.read_safetensor means to: it turns a MemoryError into RESOURCE_EXHAUSTED), nothing registered, the
    server serving. The bytes are allocated by resources/host_memory.host_bytes: torch.empty's failure is a
    RuntimeError like any other, which the call guard would answer INTERNAL."""
    rows, cols = 1 << 20, little_memory // (4 << 20)
    key = f"{_TAG}-sparse"
    fd = os.open(f"/dev/shm/{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    header = json.dumps({"w": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, little_memory]}}).encode()
    with open(fuzzed.weights_dir / "big.safetensors", "wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + little_memory)
    answers = {}
    try:
        os.ftruncate(fd, little_memory)
        source = pb.SharedMemorySource(key=key, byte_size=little_memory)
        stub.RegisterRegion(pb.RegisterRegionRequest(name="sparse", shm=source), timeout=TIMEOUT)
        try:
            ref = pb.TensorRef(region="sparse", dtype=pb.DTYPE_FLOAT32, shape=[rows, cols])
            answers["region"] = _call(stub.RegisterWeightsFromRegion,
                                      pb.RegisterWeightsFromRegionRequest(name="huge", weight=ref))[:2]
        finally:
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name="sparse"), timeout=TIMEOUT)
        answers["file"] = _call(stub.RegisterWeightsFromFile, pb.RegisterWeightsFromFileRequest(
            name="huge", path="big.safetensors", tensor="w"))[:2]
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{key}")
        (fuzzed.weights_dir / "big.safetensors").write_bytes(b"")
        _cleanup(stub)
    assert [w.name for w in stub.ListWeights(pb.ListWeightsRequest(), timeout=TIMEOUT).weights] == [HEAD]
    for source, field_name in (("region", "weight"), ("file", "tensor")):
        code, details = answers[source]
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(field_name), (source, code, details)


def test_a_malformed_safetensors_entry_is_invalid_argument(stub: pb_grpc.SamplerStub) -> None:
    """A header entry whose dtype is a JSON list (valid JSON, a malformed safetensors file) must be refused as the
    other malformed entries are: INVALID_ARGUMENT naming the path (or the tensor, as for a dtype it does not take),
    not a TypeError from looking an unhashable value up. Only a file in --weights-dir can carry it: the operator's,
    not a client's; a client only picks it."""
    code, details, _ = _call(stub.RegisterWeightsFromFile, pb.RegisterWeightsFromFileRequest(
        name="bad", path="bad_dtype.safetensors", tensor="w"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(("path:", "tensor:")), (code, details)


def test_empty_references_are_refused_naming_their_shape(stub: pb_grpc.SamplerStub) -> None:
    """A reference or a file tensor of no element (a size 0) is refused INVALID_ARGUMENT naming its shape: its
    no bytes still view as float32 (resources/host_memory.host_bytes gives torch's own empty tensor; numpy's has a
    stride that torch's view refuses, which the call guard would answer INTERNAL), for Sample and SampleStream's
    logits_ref, RegisterWeightsFromRegion and RegisterWeightsFromFile."""
    empty_ref = pb.TensorRef(region=IN_REGION, dtype=pb.DTYPE_FLOAT32, shape=[0, 4])
    from_region = pb.RegisterWeightsFromRegionRequest(name="e", weight=empty_ref)
    from_file = pb.RegisterWeightsFromFileRequest(name="e", path="head.safetensors", tensor="empty")
    calls = [("RegisterWeightsFromRegion", _call(stub.RegisterWeightsFromRegion, from_region), "weight.shape"),
             ("RegisterWeightsFromFile", _call(stub.RegisterWeightsFromFile, from_file), "weight.shape")]
    request = pb.SampleRequest(logits_ref=pb.TensorRef(region=IN_REGION, dtype=pb.DTYPE_FLOAT32, shape=[1, 0]))
    calls.append(("Sample", _call(stub.Sample, request), "logits_ref.shape"))
    [answer] = stub.SampleStream(iter([request]), timeout=TIMEOUT)
    calls.append(("SampleStream", (grpc.StatusCode.INVALID_ARGUMENT if answer.error.code == 3 else answer.error.code,
                                   answer.error.message, None), "logits_ref.shape"))
    for method, (code, details, _), field_name in calls:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field_name}:"), \
            (method, code, details)
    assert [w.name for w in stub.ListWeights(pb.ListWeightsRequest(), timeout=TIMEOUT).weights] == [HEAD]


# --- last -----------------------------------------------------------------------------------------------------


def test_server_still_serves(fuzzed: Fuzzed, stub: pb_grpc.SamplerStub) -> None:
    """After everything above (each fuzzed method answered some calls OK, when the fuzzers ran in this run): the
    server samples, lists its module regions and weight alone, holds no more file descriptors than before the
    fuzzing (each region holds one while registered)."""
    if ANSWERED:
        methods = {"RegisterRegion", "UnregisterRegion", "RegisterWeights", "RegisterWeightsFromFile",
                   "RegisterWeightsFromRegion", "UnregisterWeights", "ListRegions", "ListWeights", "GetServerInfo",
                   "SampleStream"}
        assert all(ANSWERED[method] > 0 for method in methods), ANSWERED
    assert fuzzed.server.process.poll() is None
    logits = np.zeros((2, 5), dtype=np.float32)
    response = stub.Sample(pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 5],
                                                             data=logits.tobytes())), timeout=TIMEOUT)
    assert list(response.tokens.shape) == [2, 1]
    state = Registry(regions=dict(BASE_REGIONS), weights={HEAD: ("", HEAD_V * HEAD_D * 4)})
    for op in (Op("ListRegions", pb.ListRegionsRequest()), Op("ListWeights", pb.ListWeightsRequest()),
               Op("GetServerInfo", pb.GetServerInfoRequest())):
        _run(stub, op, state, fuzzed.weights_dir, fuzzing=False)
    assert _fds(fuzzed.server.process.pid) <= fuzzed.base_fds + 4, (_fds(fuzzed.server.process.pid), fuzzed.base_fds)
