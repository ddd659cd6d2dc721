"""The committed stubs are exactly what tools/generate_stubs.py makes from proto/ today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools (dev extra) not installed")
def test_stubs_are_up_to_date(tmp_path: Path) -> None:
    from generate_stubs import STUB_DIR, generate

    for fresh in generate(tmp_path):
        committed = STUB_DIR / fresh.name
        assert committed.exists(), f"{committed} is missing: run python tools/generate_stubs.py"
        assert committed.read_text() == fresh.read_text(), f"{committed.name} is stale: run python tools/generate_stubs.py"


def test_stubs_import_and_describe_the_service() -> None:
    from tokensampler_client._proto import sampler_pb2, sampler_pb2_grpc

    service = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"]
    assert service.full_name == "tokensampler.v1.Sampler"
    assert {"Sample", "GetServerInfo"} <= set(service.methods_by_name)
    assert hasattr(sampler_pb2_grpc, "SamplerStub")
