"""SampleRequests serialized with their carried logits copied once, and the Sample methods that send them.

A request built as a message and then serialized copies a [B, V] tensor's bytes three times (numpy's tobytes,
the message's bytes field, the serialized message): 25 ms each for B = 64 float32 rows of 151936 on a 2-core
machine, more than the call's wire time. Here the request is serialized without its logits and the tensor's
own memory is joined in, in the place SerializeToString would write it (field 1, ahead of every other field),
so the bytes are those SerializeToString gives, after one copy. The Sample and SampleStream methods take either
such bytes or a message.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from ._proto import sampler_pb2 as pb
from .tensors import Array, host_bytes, wire_dtype

SAMPLE_METHOD = "/tokensampler.v1.Sampler/Sample"
SAMPLE_STREAM_METHOD = "/tokensampler.v1.Sampler/SampleStream"
_LENGTH_DELIMITED = 2
_REQUEST_LOGITS_FIELD = 1  # SampleRequest.logits
_TENSOR_DATA_FIELD = 3  # Tensor.data


def serialized(message: bytes | Message) -> bytes:
    """The serializer of Sample and SampleStream messages on both sides: bytes (a request serialized here, an
    answer of the server's native path) go as they are, messages are serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def sample_methods(channel: Any) -> tuple[Any, Any]:
    """(Sample, SampleStream) of a sync or asyncio channel, taking requests as messages or as bytes."""
    sample = channel.unary_unary(SAMPLE_METHOD, request_serializer=serialized,
                                 response_deserializer=pb.SampleResponse.FromString, _registered_method=True)
    stream = channel.stream_stream(SAMPLE_STREAM_METHOD, request_serializer=serialized,
                                   response_deserializer=pb.SampleStreamResponse.FromString, _registered_method=True)
    return sample, stream


def varint(value: int) -> bytes:
    """A protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_prefix(field_number: int, length: int) -> bytes:
    """The key and length of a length-delimited field (also what the server's input scan re-frames)."""
    return varint(field_number << 3 | _LENGTH_DELIMITED) + varint(length)


def serialize_with_logits(request: pb.SampleRequest, rows: Array) -> bytes:
    """`request` (no input set) serialized with logits = `rows`, a contiguous host array of at least one element:
    the bytes of the full message's SerializeToString, with the rows' memory copied once."""
    head = pb.Tensor(dtype=wire_dtype(rows.dtype), shape=rows.shape).SerializeToString()
    data = memoryview(host_bytes(rows)).cast("B")
    data_prefix = length_prefix(_TENSOR_DATA_FIELD, data.nbytes)
    tensor_prefix = length_prefix(_REQUEST_LOGITS_FIELD, len(head) + len(data_prefix) + data.nbytes)
    return b"".join((tensor_prefix, head, data_prefix, data, request.SerializeToString()))
