"""validation/wire_pieces.py: a message cut into pieces that merge into the same message, its long packed runs cut at
value boundaries; rpc/parsing.py merges them on a thread a piece at a time, so the event loop is not held for the
whole parse."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.core.config import Limits
from tokensampler_server.rpc.parsing import Parses
from tokensampler_server.validation.wire_pieces import PIECE_BYTES, pieces

SAMPLE = pb.SampleRequest.DESCRIPTOR
RNG = np.random.default_rng(7)


def _merged(message: bytes) -> pb.SampleRequest:
    split = pieces(message, SAMPLE)
    assert split is not None
    merged = pb.SampleRequest()
    for head, body in split:
        assert len(body) <= PIECE_BYTES + 10
        merged.MergeFromString(head + body)
    return merged


def _ids(count: int, high: int) -> list[int]:
    return RNG.integers(0, high, count).tolist()


@pytest.mark.parametrize("high", [100, 1 << 20, 1 << 31])  # one-, three- and five-byte varints: cuts inside values
def test_pieces_merge_into_the_message_a_whole_parse_gives(high: int) -> None:
    request = pb.SampleRequest(
        logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=bytes(24)),
        params=pb.SamplingParams(seed=[1, 2], temperature=RNG.random(200_000).astype(np.float32).tolist(),
                                 output_token_ids=pb.TokenLists(ids=_ids(300_000, high), lengths=[150_000] * 2),
                                 banned_token_ids=pb.TokenLists(ids=[3, 4])),
        num_samples=2)
    message = request.SerializeToString()
    assert _merged(message) == request == pb.SampleRequest.FromString(message)


def test_the_wires_rules_hold_across_pieces() -> None:
    """Fields repeated, a oneof's case replaced, a scalar given twice and unknown fields, around a long run: the
    pieces merge as the whole parses (the last case and scalar win, runs and messages concatenate)."""
    long = pb.SampleRequest(params=pb.SamplingParams(output_token_ids=pb.TokenLists(ids=_ids(400_000, 50_000))))
    parts = [
        pb.SampleRequest(logits_rows=pb.RowsRef(region="a", row_offsets=[0, 8])).SerializeToString(),
        pb.SampleRequest(num_samples=3, params=pb.SamplingParams(seed=[9])).SerializeToString(),
        long.SerializeToString(),
        b"\xf8\x7f\x05",  # an unknown varint field (4095)
        pb.SampleRequest(logits_ref=pb.TensorRef(region="b", shape=[1, 4]), num_samples=5).SerializeToString(),
        long.SerializeToString(),
    ]
    message = b"".join(parts)
    whole = pb.SampleRequest.FromString(message)
    merged = _merged(message)
    assert merged == whole and merged.WhichOneof("input") == "logits_ref" and merged.num_samples == 5
    assert len(merged.params.output_token_ids.ids) == 800_000
    assert merged.SerializeToString() == whole.SerializeToString()  # the unknown field kept, in its place


def test_a_message_without_long_runs_is_parsed_whole() -> None:
    big_tensor = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1 << 20], data=bytes(4 << 20)))
    assert pieces(big_tensor.SerializeToString(), SAMPLE) is None
    run = pb.SampleRequest(params=pb.SamplingParams(seed=[5] * 1000)).SerializeToString()
    assert pieces(run, SAMPLE) is None


def test_a_repeated_message_is_not_cut_into_elements() -> None:
    """A piece of a repeated message field would merge as an element of its own: such a field is left whole (no
    request holds one; a descriptor set does, a long packed run inside one of its files)."""
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet()
    files.file.add(name="a.proto").source_code_info.location.add(path=_ids(400_000, 1 << 20))
    message = files.SerializeToString()
    assert pieces(message, descriptor_pb2.FileDescriptorSet.DESCRIPTOR) is None


def test_a_run_cut_short_or_a_group_is_left_to_the_whole_parse() -> None:
    message = pb.SampleRequest(params=pb.SamplingParams(
        output_token_ids=pb.TokenLists(ids=_ids(400_000, 1 << 20)))).SerializeToString()
    assert pieces(message[:-2], SAMPLE) is None
    assert pieces(message + b"\x0b\x0c", SAMPLE) is None  # a group: not walked


def test_a_long_parse_on_a_thread_lets_the_event_loop_run() -> None:
    """2^24 token ids (16 MB of varints): parsed whole, the event loop waits as long as the parse; merged a piece
    at a time, it runs between pieces (the longest wait is a repeated field's growth, a copy of its values)."""
    request = pb.SampleRequest(params=pb.SamplingParams(
        output_token_ids=pb.TokenLists(ids=_ids(1 << 24, 1 << 7))))
    message = request.SerializeToString()

    async def longest_wait(parse) -> tuple[float, float]:
        waits, done = [], threading.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                waits.append(now - last)
                last = now

        ticking = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        began = time.perf_counter()
        parsed = await parse()
        took = time.perf_counter() - began
        done.set()
        await ticking
        assert len(parsed.params.output_token_ids.ids) == 1 << 24
        return max(waits), took

    async def run() -> tuple[tuple[float, float], tuple[float, float]]:
        whole = await longest_wait(lambda: asyncio.to_thread(pb.SampleRequest.FromString, message))
        in_pieces = await longest_wait(lambda: Parses(Limits(max_token_entries=1 << 25)).parse(
            pb.SampleRequest.FromString, message, SAMPLE))
        return whole, in_pieces

    (whole_wait, whole_took), (pieces_wait, _) = asyncio.run(run())
    print(f"event loop's longest wait: {whole_wait:.3f} s parsed whole ({whole_took:.3f} s), "
          f"{pieces_wait:.3f} s in pieces")
    assert whole_wait > 0.5 * whole_took  # the whole parse holds the loop: the measure can see it
    assert pieces_wait < 0.5 * whole_took
