"""TLS for the TCP port (`--tls-cert`, `--tls-key`) and mutual TLS (`--tls-client-ca`)."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from tokensampler_server.core.config import StartupError


class TlsConfigError(StartupError):
    """A certificate or key file the server cannot start with."""


class _EncryptedKey(Exception):
    """Raised by _no_passphrase: OpenSSL asked for the key's passphrase."""


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def _check(cert: Path, key: Path, client_ca: Path | None) -> None:
    """Loads the files with the standard library first: grpc would only say "failed to bind" for a
    key that does not match its certificate, or a file that is not PEM."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback: without one OpenSSL prompts on the terminal for an encrypted key (or fails
        # obscurely with none), and grpc cannot use such a key anyway.
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except _EncryptedKey:
        raise TlsConfigError(f"--tls-key {key}: the key is encrypted (passphrase-protected); give the server an "
                             "unencrypted key, e.g. `openssl pkey -in KEY -out PLAIN`") from None
    except (OSError, ssl.SSLError) as err:
        raise TlsConfigError(f"--tls-cert {cert}, --tls-key {key}: cannot use them: {err}") from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as err:
            raise TlsConfigError(f"--tls-client-ca {client_ca}: cannot use it: {err}") from None


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    """Server credentials; with `client_ca`, a client must present a certificate that CA signed."""
    _check(cert, key, client_ca)
    root = None if client_ca is None else client_ca.read_bytes()
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=root,
        require_client_auth=root is not None,
    )
