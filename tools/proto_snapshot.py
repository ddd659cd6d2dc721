"""The wire contract of the released proto as JSON, and the changes to it that would break a released peer.

    python tools/proto_snapshot.py [--out proto/tokensampler/v1/sampler.v1.0.json]

Run at a release: the file it writes is what tests/test_proto_compat.py holds the live descriptor to. A peer
built from the released proto keeps working while every message keeps its fields (number, type, label,
message or enum type, oneof), every enum its values and every RPC its request and response types; new
messages, fields, values and RPCs are fine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

ROOT = Path(__file__).resolve().parent.parent
RELEASED = ROOT / "proto" / "tokensampler" / "v1" / "sampler.v1.0.json"

Snapshot = dict[str, Any]
_FIELD = descriptor_pb2.FieldDescriptorProto


def _messages(prefix: str, messages: Any, out: Snapshot) -> None:
    for message in messages:
        name = f"{prefix}.{message.name}"
        oneofs = [oneof.name for oneof in message.oneof_decl]
        out["messages"][name] = {
            field.name: {
                "number": field.number,
                "type": _FIELD.Type.Name(field.type),
                "label": _FIELD.Label.Name(field.label),
                "type_name": field.type_name.lstrip("."),
                # A proto3 `optional` field's synthetic oneof is presence, not a oneof of the contract.
                "oneof": oneofs[field.oneof_index] if field.HasField("oneof_index") and not field.proto3_optional
                else None,
            }
            for field in message.field
        }
        _enums(name, message.enum_type, out)
        _messages(name, message.nested_type, out)


def _enums(prefix: str, enums: Any, out: Snapshot) -> None:
    for enum in enums:
        out["enums"][f"{prefix}.{enum.name}"] = {value.name: value.number for value in enum.value}


def describe(file: FileDescriptor) -> Snapshot:
    """Every message's fields, enum's values and service's RPCs of `file`, by full name."""
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    out: Snapshot = {"package": proto.package, "messages": {}, "enums": {}, "services": {}}
    _messages(proto.package, proto.message_type, out)
    _enums(proto.package, proto.enum_type, out)
    for service in proto.service:
        out["services"][f"{proto.package}.{service.name}"] = {
            method.name: {
                "input": method.input_type.lstrip("."),
                "output": method.output_type.lstrip("."),
                "client_streaming": method.client_streaming,
                "server_streaming": method.server_streaming,
            }
            for method in service.method
        }
    return out


def _changed(kind: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What of `old`'s entries `new` lacks or holds differently, as one line each."""
    problems = []
    for name, was in old.items():
        if name not in new:
            problems.append(f"{kind} {name} removed")
        elif new[name] != was:
            problems.append(f"{kind} {name} changed: {was} -> {new[name]}")
    return problems


def breaking_changes(released: Snapshot, live: Snapshot) -> list[str]:
    """The changes from `released` to `live` that a peer built from `released` would not survive; additions
    are not among them."""
    problems = [] if released["package"] == live["package"] else [f"package {released['package']} renamed"]
    for section, kind in (("messages", "field"), ("enums", "value"), ("services", "rpc")):
        for name, members in released[section].items():
            if name not in live[section]:
                problems.append(f"{section[:-1]} {name} removed")
                continue
            qualified = {f"{name}.{member}": value for member, value in members.items()}
            current = {f"{name}.{member}": value for member, value in live[section][name].items()}
            problems += _changed(kind, qualified, current)
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description="Writes the wire contract of the proto as JSON (at a release).")
    parser.add_argument("--out", type=Path, default=RELEASED, help="file to write (default: %(default)s)")
    args = parser.parse_args()
    from tokensampler_client._proto import sampler_pb2

    args.out.write_text(json.dumps(describe(sampler_pb2.DESCRIPTOR), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
