"""The proto stays wire-compatible with its last release as it grows (tools/proto_snapshot.py)."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tokensampler_client._proto import sampler_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from proto_snapshot import RELEASED, Snapshot, breaking_changes, describe  # noqa: E402

PKG = "tokensampler.v1"


def _released() -> Snapshot:
    return json.loads(RELEASED.read_text())


def test_live_descriptor_keeps_every_released_field_value_and_rpc() -> None:
    released = _released()
    assert len(released["messages"]) > 30 and len(released["services"][f"{PKG}.Sampler"]) > 10  # a real snapshot
    assert breaking_changes(released, describe(sampler_pb2.DESCRIPTOR)) == []


def _remove_field(s: Snapshot) -> None:
    del s["messages"][f"{PKG}.SampleRequest"]["top_logprobs"]


def _reuse_number(s: Snapshot) -> None:  # a field removed and its number given to a new one
    fields = s["messages"][f"{PKG}.SampleRequest"]
    fields["top_logprobs_v2"] = fields.pop("top_logprobs")


def _renumber(s: Snapshot) -> None:
    s["messages"][f"{PKG}.Tensor"]["data"]["number"] = 4


def _retype(s: Snapshot) -> None:
    s["messages"][f"{PKG}.Tensor"]["shape"]["type"] = "TYPE_INT32"


def _make_singular(s: Snapshot) -> None:
    s["messages"][f"{PKG}.Tensor"]["shape"]["label"] = "LABEL_OPTIONAL"


def _change_message_type(s: Snapshot) -> None:
    s["messages"][f"{PKG}.SampleRequest"]["logits"]["type_name"] = f"{PKG}.TensorRef"


def _leave_oneof(s: Snapshot) -> None:
    s["messages"][f"{PKG}.SampleRequest"]["hidden"]["oneof"] = None


def _remove_message(s: Snapshot) -> None:
    del s["messages"][f"{PKG}.Timings"]


def _renumber_enum_value(s: Snapshot) -> None:
    s["enums"][f"{PKG}.DType"]["DTYPE_BFLOAT16"] = 7


def _remove_rpc(s: Snapshot) -> None:
    del s["services"][f"{PKG}.Sampler"]["VerifyDraft"]


def _change_rpc_request(s: Snapshot) -> None:
    s["services"][f"{PKG}.Sampler"]["TopKProbs"]["input"] = f"{PKG}.SampleRequest"


def _stream_rpc(s: Snapshot) -> None:
    s["services"][f"{PKG}.Sampler"]["Sample"]["server_streaming"] = True


BREAKING: dict[str, tuple[Callable[[Snapshot], None], str]] = {
    "field removed": (_remove_field, "field tokensampler.v1.SampleRequest.top_logprobs removed"),
    "number reused": (_reuse_number, "field tokensampler.v1.SampleRequest.top_logprobs removed"),
    "field renumbered": (_renumber, "field tokensampler.v1.Tensor.data changed"),
    "field retyped": (_retype, "field tokensampler.v1.Tensor.shape changed"),
    "repeated made singular": (_make_singular, "field tokensampler.v1.Tensor.shape changed"),
    "message type changed": (_change_message_type, "field tokensampler.v1.SampleRequest.logits changed"),
    "field out of its oneof": (_leave_oneof, "field tokensampler.v1.SampleRequest.hidden changed"),
    "message removed": (_remove_message, "message tokensampler.v1.Timings removed"),
    "enum value renumbered": (_renumber_enum_value, "value tokensampler.v1.DType.DTYPE_BFLOAT16 changed"),
    "rpc removed": (_remove_rpc, "rpc tokensampler.v1.Sampler.VerifyDraft removed"),
    "rpc request type changed": (_change_rpc_request, "rpc tokensampler.v1.Sampler.TopKProbs changed"),
    "rpc made streaming": (_stream_rpc, "rpc tokensampler.v1.Sampler.Sample changed"),
}


@pytest.mark.parametrize("change", list(BREAKING))
def test_a_breaking_change_is_reported(change: str) -> None:
    edit, expected = BREAKING[change]
    live = copy.deepcopy(_released())
    edit(live)
    problems = breaking_changes(_released(), live)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_additions_are_compatible() -> None:
    live = copy.deepcopy(_released())
    live["messages"][f"{PKG}.SampleRequest"]["seed_per_row"] = {
        "number": 99, "type": "TYPE_BOOL", "label": "LABEL_OPTIONAL", "type_name": "", "oneof": None}
    live["messages"][f"{PKG}.NewRequest"] = {}
    live["enums"][f"{PKG}.DType"]["DTYPE_FLOAT8"] = 8
    live["services"][f"{PKG}.Sampler"]["NewRpc"] = {
        "input": f"{PKG}.NewRequest", "output": f"{PKG}.ServerInfo", "client_streaming": False,
        "server_streaming": False}
    assert breaking_changes(_released(), live) == []
