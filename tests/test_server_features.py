"""GetServerInfo.features lists what this server serves, not what a setting switched off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.resources.regions import RegionRegistry
from tokensampler_server.rpc.service import FEATURES, SamplerService

SWITCHABLE = {"regions", "region_rows", "weights_from_region", "weights_from_file"}


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
    (True, True, True, SWITCHABLE),
])
def test_features_follow_the_settings(tmp_path: Path, with_dir: bool, allow_shm: bool, allow_cuda_ipc: bool,
                                      expected_on: set[str]) -> None:
    regions = RegionRegistry(allow_shm=allow_shm, allow_cuda_ipc=allow_cuda_ipc)
    features = _features(tmp_path if with_dir else None, regions)
    assert set(features) & SWITCHABLE == expected_on
    # Everything else is always served, listed in the order of FEATURES.
    assert features == [feature for feature in FEATURES if feature not in SWITCHABLE - expected_on]
