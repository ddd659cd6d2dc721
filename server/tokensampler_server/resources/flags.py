"""The flags page of a colocated loop as the server's GPU sees it (docs/colocated.md, "Flags").

The page is the engine's shared-memory region, mapped here and pinned for the GPU once. The server's CPU never
loads or stores through the mapping: a producer that shrinks its segment would turn such an access into SIGBUS.
Its one write, the abort that ends its own wait, goes through the file (pwrite), whose page is the pinned one
while the segment keeps its size; not through a stream, which may share a hardware queue of the GPU with the
blocked wait it is meant to end.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import grpc
from tokensampler_client.handoff import ABORT, FLAGS_BYTES, READY_OFFSET, StreamMemOps

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
        self._fd = region.segment.fileno()
        exported = ctypes.c_char.from_buffer(self._map)
        self._host = ctypes.addressof(exported)
        del exported  # the mapping can close once nothing exports it
        try:
            self.device_address = StreamMemOps.get().register_host(self._host, FLAGS_BYTES)
        except RuntimeError as err:  # registered twice in this process, or the driver refused
            self._map.close()
            raise ServiceError(f"{field}: cannot pin region {region.name!r} for the GPU ({err})",
                               grpc.StatusCode.FAILED_PRECONDITION) from None

    def abort(self) -> None:
        """Writes ABORT into READY through the file; nothing when the producer has shrunk the segment below it."""
        try:
            if os.fstat(self._fd).st_size >= READY_OFFSET + 4:
                os.pwrite(self._fd, struct.pack("<I", ABORT), READY_OFFSET)
        except OSError:
            pass  # the descriptor is the region's, still open; the GPU write of Handoff.abort is the fallback

    def close(self) -> None:
        """Unpins and unmaps the page: only once no queued GPU work reads or writes it."""
        StreamMemOps.unregister_host(self._host)
        self._map.close()
