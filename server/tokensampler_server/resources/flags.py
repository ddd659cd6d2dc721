"""The flags page of a colocated loop as the server's GPU sees it (docs/colocated.md, "Flags").

The page is the engine's shared-memory region, mapped here and pinned for the GPU once. The server's CPU never
loads or stores through the mapping: a producer that shrinks its segment would turn such an access into SIGBUS.
The GPU's mapping holds the pinned pages whatever the file does, so every write of the server's (its abort
included) goes through a stream of the GPU.
"""

from __future__ import annotations

import ctypes
import mmap

import grpc
from tokensampler_client.handoff import FLAGS_BYTES, StreamMemOps

from tokensampler_server.core.errors import InvalidArgument, ServiceError
from tokensampler_server.resources.regions import Region


class MappedFlags:
    """Region `region` (a shared-memory one of at least FLAGS_BYTES bytes) pinned for the GPU at `device_address`."""

    def __init__(self, region: Region, field: str) -> None:
        if region.segment is None:
            raise InvalidArgument(field, f"region {region.name!r} is a {region.kind} region; expected a shared-memory "
                                         "(shm) one")
        if region.byte_size < FLAGS_BYTES:
            raise InvalidArgument(field, f"region {region.name!r} has {region.byte_size} bytes; expected at least "
                                         f"{FLAGS_BYTES}")
        try:
            self._map = mmap.mmap(region.segment.fileno(), FLAGS_BYTES)
        except (OSError, ValueError) as err:  # shrunk since it was registered
            raise ServiceError(f"{field}: cannot map region {region.name!r} ({err})",
                               grpc.StatusCode.FAILED_PRECONDITION) from None
        exported = ctypes.c_char.from_buffer(self._map)
        self._host = ctypes.addressof(exported)
        del exported  # the mapping can close once nothing exports it
        try:
            self.device_address = StreamMemOps.get().register_host(self._host, FLAGS_BYTES)
        except RuntimeError as err:  # registered twice in this process, or the driver refused
            self._map.close()
            raise ServiceError(f"{field}: cannot pin region {region.name!r} for the GPU ({err})",
                               grpc.StatusCode.FAILED_PRECONDITION) from None

    def close(self) -> None:
        """Unpins and unmaps the page: only once no queued GPU work reads or writes it."""
        StreamMemOps.unregister_host(self._host)
        self._map.close()
