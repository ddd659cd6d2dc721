"""GetServerInfo.features lists what this server serves, not what a setting switched off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.resources.regions import RegionRegistry
from tokensampler_server.rpc.service import FEATURES, SamplerService, served_features

SWITCHABLE = {"regions", "region_rows", "weights_from_region", "weights_from_file", "colocated"}


def _features(weights_dir: Path | None, regions: RegionRegistry) -> list[str]:
    async def ask() -> list[str]:
        service = SamplerService(CpuBackend(), Limits(), weights_dir=weights_dir, regions=regions)
        try:
            return list((await service.GetServerInfo(pb.GetServerInfoRequest(), None)).features)
        finally:
            await service.close()

    return asyncio.run(ask())


@pytest.mark.parametrize(("with_dir", "allow_shm", "allow_cuda_ipc", "expected_on"), [
    (False, False, False, set()),
    (True, False, False, {"weights_from_file"}),
    (False, True, False, {"regions", "region_rows", "weights_from_region"}),
    (False, False, True, {"regions", "region_rows", "weights_from_region"}),
    (True, True, True, SWITCHABLE - {"colocated"}),  # a CPU backend: no colocated loops
])
def test_features_follow_the_settings(tmp_path: Path, with_dir: bool, allow_shm: bool, allow_cuda_ipc: bool,
                                      expected_on: set[str]) -> None:
    regions = RegionRegistry(allow_shm=allow_shm, allow_cuda_ipc=allow_cuda_ipc)
    features = _features(tmp_path if with_dir else None, regions)
    assert set(features) & SWITCHABLE == expected_on
    # Everything else is always served, listed in the order of FEATURES.
    assert features == [feature for feature in FEATURES if feature not in SWITCHABLE - expected_on]


@pytest.mark.parametrize(("on_gpu", "kinds", "listed"), [
    (True, {"shm", "cuda_ipc"}, True),
    (True, {"cuda_ipc"}, False),  # the flags page is a shared-memory region
    (True, {"shm"}, False),
    (False, {"shm", "cuda_ipc"}, False),  # the hand-off runs on the GPU
])
def test_colocated_is_listed_only_where_a_loop_can_open(on_gpu: bool, kinds: set[str], listed: bool) -> None:
    assert ("colocated" in served_features(None, frozenset(kinds), on_gpu)) == listed


def test_a_cpu_server_reports_no_mps_state() -> None:
    async def ask() -> pb.ServerInfo:
        service = SamplerService(CpuBackend(), Limits())
        try:
            return await service.GetServerInfo(pb.GetServerInfoRequest(), None)
        finally:
            await service.close()

    assert asyncio.run(ask()).mps == ""
