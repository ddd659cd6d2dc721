"""Bearer-token access control (`--auth-token-file`): calls without a valid token get UNAUTHENTICATED.

The token travels as call metadata `authorization: Bearer <token>`. Only the health service is
open to every caller, so that load balancers and Kubernetes probes need no secret. Reflection is
not open: it reveals nothing beyond the public proto, but it is one more parser of input (a
bidirectional stream) that an outsider would reach; grpcurl sends the token with `-H`.

A refused call is answered before any of its request bytes are read or parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

from tokensampler_server.core.config import StartupError
from tokensampler_server.rpc.metrics import ServerMetrics
from tokensampler_server.core.request_context import request_id_from_metadata

log = logging.getLogger(__name__)

AUTHORIZATION_METADATA_KEY = "authorization"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
MIN_TOKEN_LENGTH = 16
_SCHEME = "bearer "
_REFUSAL = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"


class TokenFileError(StartupError):
    """A token file the server cannot start with; the message never contains a token."""


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of the tokens' lengths.
    return hashlib.sha256(token.encode()).digest()


class BearerTokens:
    """The accepted tokens, kept only as SHA-256 digests."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = [_digest(token) for token in tokens]
        if not self._digests:
            raise TokenFileError("no tokens given: every call would be refused")

    @classmethod
    def from_file(cls, path: Path) -> BearerTokens:
        """One token per line; blank lines and lines starting with '#' are skipped."""
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise TokenFileError(f"--auth-token-file {path}: cannot read it: {err}") from None
        tokens = []
        for number, line in enumerate(lines, start=1):
            token = line.strip()
            if not token or token.startswith("#"):
                continue
            if len(token) < MIN_TOKEN_LENGTH or not token.isascii() or not token.isprintable() or " " in token:
                raise TokenFileError(
                    f"--auth-token-file {path}, line {number}: expected at least {MIN_TOKEN_LENGTH} printable "
                    "ASCII characters without spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
            tokens.append(token)
        if not tokens:
            raise TokenFileError(f"--auth-token-file {path}: no tokens in it: every call would be refused")
        return cls(tokens)

    def admits(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """True when an `authorization` entry carries one of the tokens (scheme case-insensitive)."""
        return self.digest_of(metadata) is not None

    def digest_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
        """The digest of the accepted token an `authorization` entry carries, else None."""
        for key, value in metadata or ():
            if key != AUTHORIZATION_METADATA_KEY or not isinstance(value, str):
                continue
            if value[: len(_SCHEME)].lower() != _SCHEME:
                continue
            presented = _digest(value[len(_SCHEME) :].strip())
            match = False
            for digest in self._digests:  # no early exit: every token is compared every time
                match |= hmac.compare_digest(presented, digest)
            if match:
                return presented
        return None


def _refusal(request_id: str) -> grpc.RpcMethodHandler:
    """A bidirectional-streaming handler suits a call of any kind, and its behaviour reads nothing:
    a refused caller's request bytes are never parsed."""

    async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{_REFUSAL} (request id {request_id})")

    return grpc.stream_stream_rpc_method_handler(refuse)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls with a valid bearer token, and health checks; refuses the rest (UNAUTHENTICATED).

    The server's one interceptor: a refused call never reaches a handler or its guard (call_guard.py).
    Refusals are counted in tokensampler_requests_total with code UNAUTHENTICATED ("unknown" for methods
    the server lacks, so that callers cannot add label values).
    """

    def __init__(self, tokens: BearerTokens, metrics: ServerMetrics | None = None) -> None:
        self._tokens = tokens
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in OPEN_METHODS or self._tokens.admits(details.invocation_metadata):
            return await continuation(details)
        if self._metrics is not None:
            known = await continuation(details) is not None
            method = details.method.lstrip("/") if known else "unknown"
            self._metrics.requests.labels(method, grpc.StatusCode.UNAUTHENTICATED.name).inc()
        request_id = request_id_from_metadata(details.invocation_metadata)
        log.debug("refused %r %s: %s", details.method, request_id, _REFUSAL)  # %r: the path is the caller's text
        return _refusal(request_id)
