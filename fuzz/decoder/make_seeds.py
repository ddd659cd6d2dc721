"""Writes the seed corpus of the request-decoder fuzzer: real SampleRequest messages, serialized by the
generated protobuf classes, of every input kind the native path takes (carried logits in each dtype,
logits_ref, logits_rows; with and without params, each sampling mode, per-row and scalar columns, seeds with and
without has_seed, num_samples) and of the nearby kinds it declines (num_samples > 1, log-probs, output
regions, hidden states, penalties, other dtypes, unknown regions). Region names and sizes are harness.cpp's.

    python fuzz/decoder/make_seeds.py OUT_DIR

Only the protobuf runtime is needed: sampler_pb2 is loaded from its file, without the client package (torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
REGIONS = {"a": 4096, "odd": 4099, "big": 1 << 16}  # harness.cpp kRegions
ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 4}  # DType: float32, bfloat16, float16, int32


def load_pb() -> ModuleType:
    path = ROOT / "client" / "tokensampler_client" / "_proto" / "sampler_pb2.py"
    spec = importlib.util.spec_from_file_location("fuzz_sampler_pb2", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def params_variants(pb: ModuleType, rows: int) -> Iterator[tuple[str, object]]:
    """(name, SamplingParams or None): every mode, scalar and per-row columns, seeds and streams."""
    yield "noparams", None
    yield "empty", pb.SamplingParams()
    yield "greedy", pb.SamplingParams(temperature=[0.0])
    yield "temp", pb.SamplingParams(temperature=[0.7], seed=[7])
    yield "topk-bucket", pb.SamplingParams(temperature=[1.0], top_k=[5], seed=[1])
    yield "topk-large", pb.SamplingParams(top_k=[300], seed=[2])
    yield "topk-off", pb.SamplingParams(top_k=[-1], seed=[3])
    yield "topp", pb.SamplingParams(temperature=[0.9], top_p=[0.9], seed=[4])
    yield "minp", pb.SamplingParams(min_p=[0.05], seed=[5])
    yield "minp-one", pb.SamplingParams(min_p=[1.0], seed=[5])
    yield "topk-topp-minp", pb.SamplingParams(top_k=[20], top_p=[0.8], min_p=[0.01], seed=[6])
    yield "stream", pb.SamplingParams(seed=[9], position=[12], iteration=[3])
    if rows > 1:
        r = range(rows)
        yield "rows", pb.SamplingParams(
            temperature=[0.0 if i % 3 == 0 else 0.5 + i / rows for i in r],
            top_k=[[0, 5, 100, -1][i % 4] for i in r],
            top_p=[[1.0, 0.9, 0.5][i % 3] for i in r],
            min_p=[[0.0, 0.1][i % 2] for i in r],
            seed=[1000 + i for i in r],
            has_seed=[i % 2 == 0 for i in r],
            position=list(r),
            iteration=[2 * i for i in r],
        )


def requests(pb: ModuleType) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(20260101)
    # carried logits in every dtype the path takes, and two it does not
    for dtype, tag in ((1, "f32"), (2, "bf16"), (3, "f16"), (4, "i32"), (0, "unspecified")):
        for rows, vocab in ((1, 1), (1, 7), (3, 32), (2, 300)):
            data = rng.randbytes(rows * vocab * ITEMSIZE.get(dtype, 4))
            for pname, params in params_variants(pb, rows):
                if dtype not in (1, 2, 3) and pname not in ("noparams", "temp"):
                    continue
                logits = pb.Tensor(dtype=dtype, shape=[rows, vocab], data=data)
                req = pb.SampleRequest(logits=logits, params=params) if params else pb.SampleRequest(logits=logits)
                yield f"carried-{tag}-{rows}x{vocab}-{pname}", req.SerializeToString()
    # enough exact top-p rows (32 or more) for the frontier plan
    rows, vocab = 40, 64
    frontier = pb.SampleRequest(logits=pb.Tensor(dtype=3, shape=[rows, vocab], data=rng.randbytes(rows * vocab * 2)),
                                params=pb.SamplingParams(top_p=[0.7], seed=[11]))
    yield "carried-f16-40x64-frontier", frontier.SerializeToString()
    # carried logits whose bytes do not match the shape, and shapes the path declines
    yield "carried-f32-short", pb.SampleRequest(logits=pb.Tensor(dtype=1, shape=[2, 4], data=bytes(28))).SerializeToString()
    yield "carried-f32-1d", pb.SampleRequest(logits=pb.Tensor(dtype=1, shape=[4], data=bytes(16))).SerializeToString()
    yield "carried-f32-negative", pb.SampleRequest(logits=pb.Tensor(dtype=1, shape=[-1, 4], data=bytes(16))).SerializeToString()
    # logits_ref: contiguous rows in a region
    for dtype, tag in ((1, "f32"), (2, "bf16"), (3, "f16")):
        size = ITEMSIZE[dtype]
        for region, offset, rows, vocab in (("a", 0, 2, 64), ("a", 4096 - 8 * size, 1, 8), ("odd", 4, 3, 100),
                                            ("big", 0, 4, REGIONS["big"] // (4 * size)), ("nope", 0, 1, 8)):
            ref = pb.TensorRef(region=region, offset=offset, dtype=dtype, shape=[rows, vocab])
            for pname, params in params_variants(pb, rows):
                if pname not in ("noparams", "greedy", "topk-bucket", "topp", "minp", "rows"):
                    continue
                req = pb.SampleRequest(logits_ref=ref, params=params) if params else pb.SampleRequest(logits_ref=ref)
                yield f"ref-{tag}-{region}-{offset}-{rows}x{vocab}-{pname}", req.SerializeToString()
    yield "ref-f32-a-past-end", pb.SampleRequest(
        logits_ref=pb.TensorRef(region="a", offset=4092, dtype=1, shape=[1, 2])).SerializeToString()
    yield "ref-f32-a-misaligned", pb.SampleRequest(
        logits_ref=pb.TensorRef(region="a", offset=2, dtype=1, shape=[1, 2])).SerializeToString()
    # logits_rows: rows anywhere in a region
    for dtype, tag in ((1, "f32"), (2, "bf16"), (3, "f16")):
        size = ITEMSIZE[dtype]
        for region, row_size, offsets in (("a", 16, [0, 256, 64, 4096 - 16 * size]), ("a", 8, [4096 - 8 * size]),
                                          ("odd", 50, [4, 4, 2000]), ("a", 16, [4096]), ("nope", 4, [0])):
            ref = pb.RowsRef(region=region, dtype=dtype, row_size=row_size, row_offsets=offsets)
            for pname, params in params_variants(pb, len(offsets)):
                if pname not in ("noparams", "temp", "topk-large", "topk-topp-minp", "rows"):
                    continue
                req = pb.SampleRequest(logits_rows=ref, params=params) if params else pb.SampleRequest(logits_rows=ref)
                yield f"rows-{tag}-{region}-{row_size}x{len(offsets)}-{offsets[-1]}-{pname}", req.SerializeToString()
    # the scalars: the one value taken, and the requests that go to the Python path
    small = pb.Tensor(dtype=1, shape=[1, 4], data=rng.randbytes(16))
    yield "num-samples-1", pb.SampleRequest(logits=small, num_samples=1).SerializeToString()
    yield "num-samples-2", pb.SampleRequest(logits=small, num_samples=2).SerializeToString()
    yield "logprobs", pb.SampleRequest(logits=small, return_logprobs=True, logprobs_mode=2).SerializeToString()
    yield "logprobs-mode-only", pb.SampleRequest(logits=small, logprobs_mode=1).SerializeToString()
    yield "top-logprobs", pb.SampleRequest(logits=small, top_logprobs=3).SerializeToString()
    yield "output-refs", pb.SampleRequest(
        logits=small, output=pb.OutputRefs(tokens=pb.TensorRef(region="a", dtype=4, shape=[1, 1]))).SerializeToString()
    yield "hidden", pb.SampleRequest(
        hidden=pb.HiddenStates(states=pb.Tensor(dtype=1, shape=[1, 4], data=bytes(16)), weights="w")).SerializeToString()
    yield "penalty", pb.SampleRequest(logits=small, params=pb.SamplingParams(repetition_penalty=[1.1])).SerializeToString()
    yield "has-seed-alone", pb.SampleRequest(logits=small, params=pb.SamplingParams(has_seed=[True])).SerializeToString()
    yield "empty", b""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    pb = load_pb()
    count = 0
    for name, data in requests(pb):
        (out / name).write_bytes(data)
        count += 1
    print(f"{count} seed requests in {out}")


if __name__ == "__main__":
    main()
