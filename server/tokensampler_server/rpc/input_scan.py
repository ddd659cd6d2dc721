"""What a serialized SampleRequest holds in the server once begun, found without parsing its payload.

A stream message is counted against its stream's window as it arrives: its own bytes, the region bytes its input
references (read into the server when it starts) and the answer it will hold until the client reads it. Parsing a
large message to look costs its copy on the event loop (a 64 MiB message: 39 ms), and trusting a large message to
hold no reference let one padded past the size limit reference 32 MiB each uncounted (2.5 GB for one stream). So
the top-level fields are walked by their tags and lengths, and only a head is parsed: the input (its tensors'
data left out) and the counts that size the answer, with protobuf's own rules (the oneof's last case wins, the
occurrences of a message field merge), since the head keeps those fields' occurrences in order.
"""

from __future__ import annotations

from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.wire import length_prefix

from tokensampler_server.validation.wire import fields

# Field numbers of sampler.proto. SampleRequest: the input oneof, and what sizes the answer.
_LOGITS, _HIDDEN, _LOGITS_REF, _LOGITS_ROWS = 1, 2, 3, 10
_NUM_SAMPLES, _RETURN_LOGPROBS, _TOP_LOGPROBS = 5, 6, 8
_HEAD = {_LOGITS, _HIDDEN, _LOGITS_REF, _LOGITS_ROWS, _NUM_SAMPLES, _RETURN_LOGPROBS, _TOP_LOGPROBS}
_TENSOR_DATA = 3  # Tensor.data
_HIDDEN_STATES = 1  # HiddenStates.states, a Tensor
# The most fields a level of the head is walked for: SampleRequest, Tensor and HiddenStates have a few each, and a
# message padded with millions of tiny fields (16 M two-byte fields took 7.8 s of the event loop) is parsed whole.
_MOST_FIELDS = 64


def head_of(message: bytes) -> pb.SampleRequest:
    """The message's input and answer-sizing fields, its tensors' data left out (empty data). Raises UnusualWire
    where only a whole parse can tell."""
    head = bytearray()
    for number, wire, whole, payload in fields(message, _MOST_FIELDS):
        if number not in _HEAD:
            continue
        if wire == 2 and number == _LOGITS:
            head += _delimited(number, _without(payload, _TENSOR_DATA))
        elif wire == 2 and number == _HIDDEN:
            head += _delimited(number, _hidden_without_data(payload))
        else:
            head += whole
    return pb.SampleRequest.FromString(bytes(head))


def _hidden_without_data(hidden: memoryview) -> bytes:
    out = bytearray()
    for number, wire, whole, payload in fields(hidden, _MOST_FIELDS):
        out += _delimited(number, _without(payload, _TENSOR_DATA)) if wire == 2 and number == _HIDDEN_STATES else whole
    return bytes(out)


def _without(message: memoryview, dropped: int) -> bytes:
    """The message's fields but those numbered `dropped`."""
    return b"".join(bytes(whole) for number, _, whole, _ in fields(message, _MOST_FIELDS) if number != dropped)


def _delimited(number: int, payload: bytes) -> bytes:
    return length_prefix(number, len(payload)) + payload
