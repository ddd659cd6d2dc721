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


Edit = Callable[[Snapshot], None]
# Paths of the snapshot's entries that the edits change: a section, then a name.
MESSAGE = ("messages", f"{PKG}.SampleRequest")
TENSOR = ("messages", f"{PKG}.Tensor")
SAMPLER = ("services", f"{PKG}.Sampler")


def _parent(s: Snapshot, path: tuple[str, ...]) -> dict:
    """The entry of the snapshot that holds the last key of `path` (section, name, then keys)."""
    for key in path[:-1]:
        s = s[key]
    return s


def _set(*path: str, to: object) -> Edit:
    def edit(s: Snapshot) -> None:
        _parent(s, path)[path[-1]] = to

    return edit


def _delete(*path: str) -> Edit:
    def edit(s: Snapshot) -> None:
        del _parent(s, path)[path[-1]]

    return edit


def _reuse_number(s: Snapshot) -> None:  # a field removed and its number given to a new one
    fields = s["messages"][f"{PKG}.SampleRequest"]
    fields["top_logprobs_v2"] = fields.pop("top_logprobs")


BREAKING: dict[str, tuple[Edit, str]] = {
    "field removed": (_delete(*MESSAGE, "top_logprobs"), "field tokensampler.v1.SampleRequest.top_logprobs removed"),
    "number reused": (_reuse_number, "field tokensampler.v1.SampleRequest.top_logprobs removed"),
    "field renumbered": (_set(*TENSOR, "data", "number", to=4), "field tokensampler.v1.Tensor.data changed"),
    "field retyped": (_set(*TENSOR, "shape", "type", to="TYPE_INT32"), "field tokensampler.v1.Tensor.shape changed"),
    "repeated made singular": (_set(*TENSOR, "shape", "label", to="LABEL_OPTIONAL"),
                               "field tokensampler.v1.Tensor.shape changed"),
    "message type changed": (_set(*MESSAGE, "logits", "type_name", to=f"{PKG}.TensorRef"),
                             "field tokensampler.v1.SampleRequest.logits changed"),
    "field out of its oneof": (_set(*MESSAGE, "hidden", "oneof", to=None),
                               "field tokensampler.v1.SampleRequest.hidden changed"),
    "message removed": (_delete("messages", f"{PKG}.Timings"), "message tokensampler.v1.Timings removed"),
    "enum value renumbered": (_set("enums", f"{PKG}.DType", "DTYPE_BFLOAT16", to=7),
                              "value tokensampler.v1.DType.DTYPE_BFLOAT16 changed"),
    "rpc removed": (_delete(*SAMPLER, "VerifyDraft"), "rpc tokensampler.v1.Sampler.VerifyDraft removed"),
    "rpc request type changed": (_set(*SAMPLER, "TopKProbs", "input", to=f"{PKG}.SampleRequest"),
                                 "rpc tokensampler.v1.Sampler.TopKProbs changed"),
    "rpc made streaming": (_set(*SAMPLER, "Sample", "server_streaming", to=True),
                           "rpc tokensampler.v1.Sampler.Sample changed"),
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
