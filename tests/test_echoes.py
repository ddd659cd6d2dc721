"""What a refusal echoes of a client's strings: a bounded quote, never the whole string, and never a line break that a
pattern let through."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import grpc
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.core.errors import MAX_QUOTED_CHARS, InvalidArgument, ServiceError, bounded, quoted
from tokensampler_server.resources.regions import open_shared_memory
from tokensampler_server.resources.weight_files import open_weights_file, read_safetensor
from tokensampler_server.resources.weights import WeightRegistry


def _read(root: Path, relative: str, tensor: str) -> torch.Tensor:
    fd = open_weights_file(root, relative)
    try:
        return read_safetensor(fd, relative, tensor, 1 << 20)
    finally:
        os.close(fd)


def test_quoted_and_bounded_cut_what_they_are_given() -> None:
    assert quoted("head") == "'head'"
    long = quoted("\x01" * 10**6)
    assert len(long) < 6 * MAX_QUOTED_CHARS and long.endswith("... (1000000 characters)")
    assert bounded("x" * 100) == "x" * 100
    assert len(bounded("é" * 10**6).encode()) < 1100 and bounded("é" * 10**6).endswith("(2000000 bytes)")


def test_a_huge_name_is_quoted_in_part() -> None:
    """UnregisterWeights of a 4 MiB name (before: the NOT_FOUND message copied it whole, several times its size in
    memory, before the status cut it)."""
    registry = WeightRegistry(torch.device("cpu"))
    with pytest.raises(ServiceError) as raised:
        asyncio.run(registry.unregister("w" * (4 << 20)))
    assert raised.value.code == grpc.StatusCode.NOT_FOUND and len(raised.value.message) < 1000


@pytest.mark.parametrize("key", ["segment\n", "a" * 200 + "\n", "..\n"])
def test_a_shared_memory_key_ending_in_a_line_break_is_refused(key: str) -> None:
    """`$` matched before a final line break, so such keys passed the key's pattern."""
    with pytest.raises(InvalidArgument) as raised:
        open_shared_memory(pb.SharedMemorySource(key=key, byte_size=8))
    assert raised.value.field == "shm.key"


def test_a_file_that_is_not_safetensors_does_not_have_its_first_bytes_echoed(tmp_path: Path) -> None:
    (tmp_path / "token").write_bytes(b"hf_AbCdEfGhIjKlMnOp")
    with pytest.raises(InvalidArgument) as raised:
        _read(tmp_path, "token", "w")
    assert str(int.from_bytes(b"hf_AbCdE", "little")) not in raised.value.message


@pytest.mark.parametrize("shape", [[0, 2**63 - 1], [0, 2**61], [2**40, 0]])
def test_an_empty_tensor_of_a_huge_size_is_refused_by_its_shape(tmp_path: Path, shape: list[int]) -> None:
    """[0, 2^63 - 1] holds no bytes, but torch cannot make it: INTERNAL before (its hash failed)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(InvalidArgument) as raised:
        _read(tmp_path, "m.safetensors", "w")
    assert raised.value.field == "weight.shape"


def test_a_health_check_of_a_huge_unknown_service_quotes_it_in_part() -> None:
    """Check is open to every caller: its NOT_FOUND quotes at most MAX_QUOTED_CHARS of the name it was given."""
    from grpc_health.v1 import health_pb2
    from tokensampler_server.rpc.health import HealthService

    with pytest.raises(ServiceError) as raised:
        asyncio.run(HealthService().Check(health_pb2.HealthCheckRequest(service="s" * (4 << 20)), None))
    assert raised.value.code == grpc.StatusCode.NOT_FOUND and len(raised.value.message) < 1000
