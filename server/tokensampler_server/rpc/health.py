"""gRPC health (grpc.health.v1): Check and Watch of the server's services, NOT_SERVING from shutdown on.

Not grpc_health's asyncio servicer, for two reasons. Its Watch drops the condition that every watcher of a service
shares as soon as one of them leaves, so the others never hear of a change again: an outsider opening and closing
one Watch kept every load balancer watching the server from seeing NOT_SERVING at shutdown. And its Watch streams
ran until the grace period cancelled them, so one open Watch held every shutdown for the whole of it. Here every
watcher waits on a change counter (no lock held while it writes, so a watcher that does not read holds up no one),
and at shutdown each writes NOT_SERVING and, a second later, ends with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokensampler_server.core.errors import ServiceError, quoted

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
SHUTDOWN_LINGER_S = 1.0
"""How long a Watch stays open after writing NOT_SERVING at shutdown: grpc's sync client drops a message it has not
asked for yet once the call's status is in, so a stream ended at once could lose NOT_SERVING to a client reading one
message at a time."""


class HealthService(health_pb2_grpc.HealthServicer):
    """The services' statuses: "" (the server as a whole) SERVING from the start, the others as set."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        self._changes = 0
        self._changed = asyncio.Condition()
        self._shutting_down = False
        self._watchers = 0
        self._told = 0  # watchers that have written NOT_SERVING at shutdown

    def status(self, service: str) -> int | None:
        """The service's status; None for a service never set."""
        return self._status.get(service)

    async def set(self, service: str, status: int) -> None:
        """Sets a service's status and tells its watchers; nothing from shutdown on (NOT_SERVING for good)."""
        if not self._shutting_down:
            self._status[service] = status
            await self._notify()

    async def enter_graceful_shutdown(self, timeout_s: float = 1.0) -> None:
        """Every service NOT_SERVING for good; each Watch stream writes it, then ends (UNAVAILABLE). Returns once
        every watcher has written it (at most timeout_s): the server's stop, which comes next, lost such writes."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in self._status:
            self._status[service] = NOT_SERVING
        await self._notify()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._told >= self._watchers), timeout_s)
            except asyncio.TimeoutError:  # a watcher whose client does not read: the grace period ends it
                pass

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            raise ServiceError(f"service: {quoted(request.service)} is not served here", grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        seen, sent = -1, None
        self._watchers += 1
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self._changes != seen)
                    seen = self._changes
                status = self._status.get(request.service, SERVICE_UNKNOWN)
                if status != sent:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    sent = status
                if self._shutting_down:
                    await self._tell_written()
                    await asyncio.sleep(SHUTDOWN_LINGER_S)
                    raise ServiceError("health: the server is shutting down (NOT_SERVING sent); watch another server",
                                       grpc.StatusCode.UNAVAILABLE)
        finally:
            self._watchers -= 1

    async def _tell_written(self) -> None:
        async with self._changed:
            self._told += 1
            self._changed.notify_all()

    async def _notify(self) -> None:
        async with self._changed:
            self._changes += 1
            self._changed.notify_all()
