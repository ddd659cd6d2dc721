"""Admission control: caps on the calls held at once, counted after authentication.

The call guard (call_guard.py) admits each call as its handler starts, so a call that the bearer-token check
refused (auth.py) never takes a slot. Three caps, each 0 for no limit:

- `--max-concurrent-rpcs`: calls of the Sampler service and reflection held at once; a stream holds one slot
  until it ends.
- `--max-health-watchers`: health Watch streams, which every caller may open, in a pool of their own: they can
  never take the slots of the service's calls. Health Check is not counted: it answers at once and holds
  nothing, and a probe must get through while the watchers are full.
- `--max-calls-per-client`: the calls one client holds at once, of every kind counted.

A client is the accepted bearer token it presents (kept as its SHA-256 digest), else its connection (the peer
with its port): colocated engines all connect from 127.0.0.1, and keyed by address they would share one cap. A
caller without a token can open more connections for more calls; the global cap still bounds them all, and
tokens make a client one client whatever its connections.

Past a cap the call gets RESOURCE_EXHAUSTED at once, its message naming the limit and its value, with the
trailing metadata `x-retryable: overload` of a full queue: retrying later can succeed. The slot comes back when
the call ends, however it ends (response sent, error, cancel, deadline): grpc runs the context's done callbacks
when the call's task finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import grpc
from prometheus_client import Counter

from tokensampler_server.rpc.auth import BearerTokens
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.rpc.metrics import ServerMetrics

WATCH_METHOD = "grpc.health.v1.Health/Watch"
UNCOUNTED_METHODS = frozenset({"grpc.health.v1.Health/Check"})
"""Methods that answer at once and hold no slot."""


@dataclass
class Pool:
    """Calls held now against one cap (`limit`, 0: none) that the flag `flag` sets."""

    name: str
    """The metric label value."""
    flag: str
    limit: int
    what: str
    """What the pool holds, for the refusal's message."""
    held: int = 0


class Admission:
    """Counts the calls held now, per pool and per client, and refuses a call past a cap."""

    def __init__(self, max_calls: int, max_health_watchers: int, max_calls_per_client: int,
                 tokens: BearerTokens | None = None, metrics: ServerMetrics | None = None) -> None:
        self.calls = Pool("calls", "--max-concurrent-rpcs", max_calls, "calls")
        self.watchers = Pool("health_watchers", "--max-health-watchers", max_health_watchers,
                             "health Watch streams")
        self._per_client = max_calls_per_client
        self._held_by: dict[bytes | str, int] = {}
        """Calls held per client; a client with none has no entry, so the dict grows only with calls held."""
        self._tokens = tokens
        self._refused: dict[str, Counter] = {}
        if metrics is not None:
            for pool in (self.calls, self.watchers):
                metrics.admitted_calls.labels(pool.name).set_function(lambda pool=pool: pool.held)
            self._refused = {limit: metrics.admission_refusals.labels(limit)
                             for limit in (self.calls.name, self.watchers.name, "calls_per_client")}

    def pool_of(self, method: str) -> Pool | None:
        """The pool `method` (full name, no leading slash) counts against; None for a method not counted."""
        if method in UNCOUNTED_METHODS:
            return None
        pool = self.watchers if method == WATCH_METHOD else self.calls
        return pool if pool.limit or self._per_client else None

    def client_of(self, context: grpc.aio.ServicerContext) -> bytes | str | None:
        """The digest of the accepted token the call presents, else the peer's connection (types keep them apart);
        None for a Unix-socket connection without one: grpc names every such peer alike, so counting them under
        one name would let one local client's calls refuse every other's (the connection's own stream limit,
        grpc_options, bounds each). Only an accepted token counts: any other string would give a caller a fresh
        cap per call."""
        if self._tokens is not None:
            digest = self._tokens.digest_of(context.invocation_metadata())
            if digest is not None:
                return digest
        peer = context.peer()
        return None if peer.startswith("unix:") else peer

    def admit(self, pool: Pool, context: grpc.aio.ServicerContext) -> None:
        """Takes a slot of `pool` and of the call's client until the call ends; raises RESOURCE_EXHAUSTED past
        a cap (the client's first: it names the limit that its own calls reached)."""
        client = self.client_of(context)
        held = self._held_by.get(client, 0)
        if self._per_client and client is not None and held >= self._per_client:
            raise self._refuse("calls_per_client", "calls of one client", "--max-calls-per-client", self._per_client)
        if pool.limit and pool.held >= pool.limit:
            raise self._refuse(pool.name, pool.what, pool.flag, pool.limit)
        pool.held += 1
        self._held_by[client] = held + 1
        context.add_done_callback(partial(self._release, pool, client))

    def _refuse(self, limit: str, what: str, flag: str, value: int) -> ServiceError:
        """The refusal at the cap `flag` = `value`, counted under the label value `limit`."""
        counter = self._refused.get(limit)
        if counter is not None:
            counter.inc()
        return ServiceError(f"too many {what} held at once: at most {value} ({flag}); retry with backoff",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)

    def _release(self, pool: Pool, client: bytes | str | None, _context: grpc.aio.ServicerContext) -> None:
        # Every guarded call runs on the server's event loop, and so do these callbacks: no lock needed.
        pool.held -= 1
        held = self._held_by[client] - 1
        if held:
            self._held_by[client] = held
        else:
            del self._held_by[client]
