"""Admission control: caps on the calls held at once, counted after authentication.

The call guard (call_guard.py) admits each call as its handler starts, so a call that the bearer-token check
refused (auth.py) never takes a slot. Four caps, each 0 for no limit:

- `--max-concurrent-rpcs`: calls of the Sampler service and reflection held at once; a stream holds one slot
  until it ends.
- `--max-health-watchers`: health Watch streams, which every caller may open, in a pool of their own: they can
  never take the slots of the service's calls. Health Check is not counted: it answers at once and holds
  nothing, and a probe must get through while the watchers are full.
- `--max-uploads`: RegisterWeights uploads, in a pool of their own: an upload waits on its client between chunks for
  as long as the client keeps sending, so uploads that trickled a byte now and then held every slot of the service
  (each byte restarts an upload's idle timer, and such a call is never idle long enough to be reclaimed).
- `--max-calls-per-client`: the calls one client holds at once, of every kind counted.

A call that has waited on its client for at least `--reclaim-idle-calls-s` is idle: a bidirectional stream
(SampleStream, reflection) that has answered every message it read and waits for the next, or any call whose answer
grpc is sending and the client does not take (HTTP/2 flow control holds it). When `--max-concurrent-rpcs` is
reached, a new call takes the slot of the call idle longest: a stream waiting for a message ends with
RESOURCE_EXHAUSTED (marked retryable: reopening it can succeed), a call whose answer is not taken is cancelled.
Without this, streams opened and left silent, or calls whose answers were never read, on as many connections as it
takes, held every slot until they ended, however long that was; an engine's stream between two steps is idle for
far less than a second, and an engine reads its answers.
A colocated loop (Colocate) is never taken: it holds an engine's GPU hand-off, and waits between an engine's
requests by design (colocated.py ends loops by their own rules). A client at its own --max-calls-per-client is
refused before any reclaim: its idle streams are its own to close.

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

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from tokensampler_server.rpc.auth import BearerTokens
from tokensampler_server.core.errors import ServiceError
from tokensampler_server.rpc.metrics import ServerMetrics

WATCH_METHOD = "grpc.health.v1.Health/Watch"
UPLOAD_METHOD = "tokensampler.v1.Sampler/RegisterWeights"
UNCOUNTED_METHODS = frozenset({"grpc.health.v1.Health/Check"})
"""Methods that answer at once and hold no slot."""
UNRECLAIMED_METHODS = frozenset({"tokensampler.v1.Sampler/Colocate"})
"""Methods whose calls never lose their slots while idle."""


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


@dataclass(eq=False)
class Slot:
    """One admitted call's hold on its pool and its client's count, given back once."""

    pool: Pool
    client: bytes | str | None
    released: bool = False


class Admission:
    """Counts the calls held now, per pool and per client, and refuses a call past a cap."""

    def __init__(self, max_calls: int, max_health_watchers: int, max_calls_per_client: int,
                 tokens: BearerTokens | None = None, metrics: ServerMetrics | None = None,
                 reclaim_idle_s: float = 0.0, *, max_uploads: int = 0) -> None:
        """`reclaim_idle_s`: how long a call must have been idle before a new call may take its slot; 0: never."""
        self.calls = Pool("calls", "--max-concurrent-rpcs", max_calls, "calls")
        self.watchers = Pool("health_watchers", "--max-health-watchers", max_health_watchers,
                             "health Watch streams")
        self.uploads = Pool("uploads", "--max-uploads", max_uploads, "RegisterWeights uploads")
        self._per_client = max_calls_per_client
        self._held_by: dict[bytes | str, int] = {}
        """Calls held per client; a client with none has no entry, so the dict grows only with calls held."""
        self._tokens = tokens
        self.reclaim_idle_s = reclaim_idle_s
        self._idle: dict[Slot, tuple[float, Callable[[float], None]]] = {}
        """Idle calls' slots, the longest idle first: since when, and what ends the call (given its idle s)."""
        self._watches: dict[Slot, IdleWatch] = {}
        """The watched streams, by slot, until their calls end."""
        self.shutting_down = False
        """Set once the server stops: a watched stream ends when it next waits for its client's message."""
        self._refused: dict[str, Counter] = {}
        if metrics is not None:
            for pool in (self.calls, self.watchers, self.uploads):
                metrics.admitted_calls.labels(pool.name).set_function(lambda pool=pool: pool.held)
            self._refused = {limit: metrics.admission_refusals.labels(limit)
                             for limit in (self.calls.name, self.watchers.name, self.uploads.name, "calls_per_client")}

    def reclaims(self, method: str) -> bool:
        """Whether an idle call of `method` may lose its slot to a new call."""
        return self.reclaim_idle_s > 0 and self.watches(method)

    def watches(self, method: str) -> bool:
        """Whether a bidirectional stream of `method` is watched (IdleWatch): to be reclaimed while idle, when
        reclaim_idle_s allows it, and to end at shutdown once it waits for its client."""
        return method not in UNRECLAIMED_METHODS

    def pool_of(self, method: str) -> Pool | None:
        """The pool `method` (full name, no leading slash) counts against; None for a method not counted."""
        if method in UNCOUNTED_METHODS:
            return None
        pool = self.watchers if method == WATCH_METHOD else self.uploads if method == UPLOAD_METHOD else self.calls
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

    def admit(self, pool: Pool, context: grpc.aio.ServicerContext) -> Slot:
        """Takes a slot of `pool` and of the call's client until the call ends; raises RESOURCE_EXHAUSTED past
        a cap (the client's first: it names the limit that its own calls reached). At the pool's cap the slot of
        the call idle longest is taken, if one has been idle long enough."""
        client = self.client_of(context)
        if self._per_client and client is not None and self._held_by.get(client, 0) >= self._per_client:
            raise self._refuse("calls_per_client", "calls of one client", "--max-calls-per-client", self._per_client)
        if pool.limit and pool.held >= pool.limit and not self._reclaim(pool):
            raise self._refuse(pool.name, pool.what, pool.flag, pool.limit)
        pool.held += 1
        self._held_by[client] = self._held_by.get(client, 0) + 1
        slot = Slot(pool, client)
        context.add_done_callback(lambda _context: self._release(slot))
        return slot

    def idle(self, slot: Slot, end: Callable[[float], None]) -> None:
        """The call holding `slot` waits on its client: a stream for the next message with every one it read
        answered, or any call for its client to take an answer; `end(idle_s)` ends it if its slot is taken. A call
        already waiting keeps the time it began."""
        if self.reclaim_idle_s > 0 and not slot.released:
            since = self._idle[slot][0] if slot in self._idle else time.monotonic()
            self._idle[slot] = (since, end)

    def busy(self, slot: Slot) -> None:
        """The call holding `slot` no longer waits on its client."""
        self._idle.pop(slot, None)

    def end_waiting_streams(self) -> None:
        """At shutdown: ends with UNAVAILABLE every watched stream that waits for its client's next message with each
        one it read answered, now and whenever one does from here on (nothing of it is lost: its client reopens it,
        on another server). Such a stream would otherwise hold the shutdown for its grace period, then be
        cancelled under grpc."""
        self.shutting_down = True
        for watch in list(self._watches.values()):
            watch.end_waiting()

    def _reclaim(self, pool: Pool) -> bool:
        """Gives back the slot of the call of `pool` idle longest, and ends that call, if it has been idle at least
        reclaim_idle_s; whether it did."""
        now = time.monotonic()
        for slot, (since, end) in self._idle.items():
            if now - since < self.reclaim_idle_s:
                return False  # the longest idle first: none after it has waited longer
            if slot.pool is pool:
                self._release(slot)
                end(now - since)
                return True
        return False

    def _refuse(self, limit: str, what: str, flag: str, value: int) -> ServiceError:
        """The refusal at the cap `flag` = `value`, counted under the label value `limit`."""
        counter = self._refused.get(limit)
        if counter is not None:
            counter.inc()
        return ServiceError(f"too many {what} held at once: at most {value} ({flag}); retry with backoff",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)

    def _release(self, slot: Slot) -> None:
        # Every guarded call runs on the server's event loop, and so do these callbacks: no lock needed.
        if slot.released:  # taken back from an idle call, which then ended
            return
        slot.released = True
        self._idle.pop(slot, None)
        self._watches.pop(slot, None)
        slot.pool.held -= 1
        held = self._held_by[slot.client] - 1
        if held:
            self._held_by[slot.client] = held
        else:
            del self._held_by[slot.client]


class IdleWatch:
    """A bidirectional stream's messages and answers, counted so that admission knows when the stream waits on its
    client (every message it read answered and the next awaited, or an answer its client does not take) and can end
    it there to take its slot."""

    def __init__(self, admission: Admission, slot: Slot) -> None:
        self._admission = admission
        self._slot = slot
        self._unanswered = 0
        self._waiting: asyncio.Task | None = None
        """The task awaiting the stream's next message, while one is."""
        self._delivering: asyncio.Task | None = None
        """The task grpc sends an answer in, while it does."""
        self._cancelled: asyncio.Task | None = None
        """The task _end cancelled."""
        self._ended_after: float | None = None
        """The idle seconds after which admission took the slot; None while the stream holds it."""
        if not slot.released:
            admission._watches[slot] = self  # noqa: SLF001 - a watch and its admission are one mechanism

    async def requests(self, requests: AsyncIterator[object]) -> AsyncIterator[object]:
        """`requests`, the stream's messages; ends the stream with RESOURCE_EXHAUSTED once its slot is taken."""
        messages = aiter(requests)
        while True:
            if not self._unanswered and self._admission.shutting_down:
                raise self._refusal()
            self._waiting = asyncio.current_task()
            if not self._unanswered:
                self._admission.idle(self._slot, self._end)
            try:
                # A message that has arrived but not yet resumed this task when its slot is taken is dropped with
                # the stream, whose status says to retry: never processed, so never answered twice.
                message = await anext(messages)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if self._cancelled is not asyncio.current_task():
                    raise
                # Cancelled by _end, not by grpc: the stream ends with its status. Python 3.11 counts cancellations,
                # which the task would otherwise still carry; 3.10 has no count.
                uncancel = getattr(self._waiting, "uncancel", None)
                if uncancel is not None:
                    uncancel()
                raise self._refusal() from None
            finally:
                self._waiting = None
                if self._delivering is None:
                    self._admission.busy(self._slot)
            self._unanswered += 1
            yield message

    def delivering(self) -> None:
        """grpc begins to send an answer, in the current task: it waits on the client until the client takes it."""
        self._delivering = asyncio.current_task()
        self._admission.idle(self._slot, self._end)

    def answered(self) -> None:
        """The stream sent the answer to one of its messages."""
        self._delivering = None
        self._admission.busy(self._slot)
        self._unanswered -= 1
        if not self._unanswered and self._waiting is not None:
            if self._admission.shutting_down:
                self.end_waiting()
            else:
                self._admission.idle(self._slot, self._end)

    def _end(self, idle_s: float) -> None:
        """Ends the stream where it waits: an answer not taken ends the call (grpc's task, cancelled), a message not
        sent ends the stream with its status."""
        self._ended_after = idle_s
        self._cancelled = self._delivering or self._waiting
        if self._cancelled is not None:
            self._cancelled.cancel()

    def end_waiting(self) -> None:
        """Ends the stream if it waits for its client's next message with each one it read answered (the server
        shuts down)."""
        if self._waiting is None or self._unanswered or self._delivering is not None:
            return
        self._cancelled = self._waiting
        self._waiting.cancel()

    def _refusal(self) -> ServiceError:
        if self._admission.shutting_down and self._ended_after is None:
            return ServiceError("stream ended: the server is shutting down, with every message it read answered; "
                                "reopen it (on another server) and send again what was not answered",
                                grpc.StatusCode.UNAVAILABLE)
        pool = self._slot.pool
        return ServiceError(
            f"stream ended: idle {self._ended_after:.1f} s (--reclaim-idle-calls-s "
            f"{self._admission.reclaim_idle_s:g}) while all {pool.limit} {pool.what} of {pool.flag} were held; "
            "a new call took its slot; reopen the stream", grpc.StatusCode.RESOURCE_EXHAUSTED)
