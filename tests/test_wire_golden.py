"""Golden bytes of the tensor wire format, written out by hand from the contract (sampler.proto: row-major,
little-endian elements; DType numbers). Client and server share one codec, so a layout bug common to both
sides (byte order, bfloat16, row order) passes every round trip: these bytes do not come from the codec."""

from __future__ import annotations

import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import serialize_sample_request
from tokensampler_client.tensors import decode_owned, decode_tensor, encode_tensor

FLOATS = [[1.0, 2.0, 3.0], [-1.0, 0.5, -2.5]]
# dtype -> (DType number, the 2x3 values, their bytes: row 0 then row 1, each element least significant byte first)
GOLDEN: dict[torch.dtype, tuple[int, list[list[float]], bytes]] = {
    torch.float32: (1, FLOATS, bytes.fromhex(
        "0000803f 00000040 00004040"     # 1.0 = 0x3f800000, 2.0 = 0x40000000, 3.0 = 0x40400000
        "000080bf 0000003f 000020c0")),  # -1.0 = 0xbf800000, 0.5 = 0x3f000000, -2.5 = 0xc0200000
    torch.bfloat16: (2, FLOATS, bytes.fromhex(
        "803f 0040 4040"                 # the high halves of the float32 words above
        "80bf 003f 20c0")),
    torch.float16: (3, FLOATS, bytes.fromhex(
        "003c 0040 0042"                 # 1.0 = 0x3c00, 2.0 = 0x4000, 3.0 = 0x4200
        "00bc 0038 00c1")),              # -1.0 = 0xbc00, 0.5 = 0x3800, -2.5 = 0xc100
    torch.int32: (4, [[1, 2, 3], [-1, 2**24 + 256, -2]], bytes.fromhex(
        "01000000 02000000 03000000"
        "ffffffff 00010001 feffffff")),  # -1, 0x01000100, -2 (two's complement)
    torch.int64: (5, [[1, 2, 3], [-1, 2**40 + 256, -2]], bytes.fromhex(
        "0100000000000000 0200000000000000 0300000000000000"
        "ffffffffffffffff 0001000000010000 feffffffffffffff")),  # 0x0000010000000100 in the middle
    torch.uint8: (6, [[1, 2, 3], [255, 128, 0]], bytes.fromhex("010203 ff8000")),
}
DTYPES = list(GOLDEN)


def _message_bytes(dtype_number: int, data: bytes) -> bytes:
    """A serialized Tensor{dtype, shape [2, 3], data}: field 1 varint, field 2 packed varints, field 3 bytes."""
    assert len(data) < 128  # one-byte length
    return bytes([0x08, dtype_number, 0x12, 0x02, 0x02, 0x03, 0x1A, len(data)]) + data


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_gives_the_golden_bytes(dtype: torch.dtype) -> None:
    number, values, data = GOLDEN[dtype]
    message = encode_tensor(torch.tensor(values, dtype=dtype))
    assert message.dtype == number and list(message.shape) == [2, 3]
    assert message.data == data
    assert message.SerializeToString() == _message_bytes(number, data)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_reads_the_golden_bytes(dtype: torch.dtype) -> None:
    number, values, data = GOLDEN[dtype]
    expected = torch.tensor(values, dtype=dtype)
    message = pb.Tensor.FromString(_message_bytes(number, data))
    decoded = decode_tensor(message)
    assert decoded.dtype == dtype and decoded.shape == (2, 3) and torch.equal(decoded, expected)
    wide = torch.int64 if not dtype.is_floating_point else torch.float32
    assert torch.equal(decode_owned(message, "tensor", wide), expected.to(wide))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sample_request_carries_the_golden_logits(dtype: torch.dtype) -> None:
    """The request serializer frames the logits itself (wire.py): field 1 of SampleRequest, first."""
    number, values, data = GOLDEN[dtype]
    tensor = _message_bytes(number, data)
    request = serialize_sample_request(torch.tensor(values, dtype=dtype))
    assert request.startswith(bytes([0x0A, len(tensor)]) + tensor)


def test_dtype_names_read_as_words_for_every_value() -> None:
    """What refusals print for a tensor's dtype: its name, 'unspecified' for a tensor sent without one, and the
    number for a value that is no DType (which must not raise while the refusal is written)."""
    from tokensampler_client.tensors import dtype_name

    assert dtype_name(pb.DTYPE_FLOAT32) == "float32" and dtype_name(pb.DTYPE_BFLOAT16) == "bfloat16"
    assert dtype_name(0) == "unspecified"
    assert dtype_name(99) == "99 (no such dtype)"
