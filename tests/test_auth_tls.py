"""Access control against real servers: bearer tokens (`--auth-token-file`), TLS and mutual TLS.

Certificates are made at test time: a CA, a server certificate for 127.0.0.1 and localhost, a client
certificate, and a client certificate of another CA.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError
from tokensampler_client._channel import call_metadata, channel_target
from tokensampler_server.rpc.auth import BearerTokens, TokenFileError
from tokensampler_server.app.cli import parse_args

from .conftest import RunningServer, serving
from .test_metrics import metrics_port, parse_samples, scrape_text, value

TOKENS = [secrets.token_urlsafe(32), secrets.token_urlsafe(32)]
SAMPLE = "/tokensampler.v1.Sampler/Sample"


# --- bearer tokens ----------------------------------------------------------------------------


def test_token_file_format(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# deploy keys\n\n  {TOKENS[0]}  \n{TOKENS[1]}\n")
    tokens = BearerTokens.from_file(path)
    for token in TOKENS:
        assert tokens.admits([("authorization", f"Bearer {token}")])
        assert tokens.admits([("x-request-id", "1"), ("authorization", f"bearer {token}")])  # scheme: any case
    assert not tokens.admits([("authorization", f"Bearer {TOKENS[0]}x")])
    assert not tokens.admits([("authorization", TOKENS[0])])  # no scheme
    assert not tokens.admits([("authorization", f"Basic {TOKENS[0]}")])
    assert not tokens.admits([("x-token", f"Bearer {TOKENS[0]}")])
    assert not tokens.admits(None)

    path.write_text(f"{TOKENS[0]}\nshort-secret\n")
    with pytest.raises(TokenFileError, match="line 2") as raised:
        BearerTokens.from_file(path)
    assert "short-secret" not in str(raised.value)  # an error never shows a token
    for text in ("", "# only a comment\n"):
        path.write_text(text)
        with pytest.raises(TokenFileError, match="no tokens"):
            BearerTokens.from_file(path)
    with pytest.raises(TokenFileError, match="cannot read"):
        BearerTokens.from_file(tmp_path / "missing")


def test_a_bad_token_file_stops_the_server_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("too-short\n")
    result = subprocess.run([sys.executable, "-m", "tokensampler_server", "--auth-token-file", str(path), "--port", "0",
                             "--no-metrics"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--auth-token-file" in result.stderr and "Traceback" not in result.stderr
    assert "too-short" not in result.stderr


def test_client_metadata_carries_the_token() -> None:
    assert call_metadata("id") == (("x-request-id", "id"),)
    assert call_metadata("id", "tok") == (("x-request-id", "id"), ("authorization", "Bearer tok"))
    for bad in ("", "two words", "line\nbreak", "caf\u00e9"):
        with pytest.raises(ValueError, match="auth_token"):
            SamplerClient("127.0.0.1:1", auth_token=bad)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text("\n".join(TOKENS) + "\n")
    yield from serving("--device", "cpu", "--auth-token-file", str(path))


def _refused(call) -> TokenSamplerError:
    with pytest.raises(TokenSamplerError) as raised:
        call()
    assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED, raised.value
    assert "bearer token" in raised.value.details and "(request id " in raised.value.details
    return raised.value


def test_every_kind_of_call_needs_a_valid_token(auth_server: RunningServer) -> None:
    logits = torch.randn(2, 16)
    with SamplerClient(auth_server.target, timeout=30, retries=0) as anonymous:
        _refused(lambda: anonymous.sample(logits))  # unary
        _refused(lambda: anonymous.register_weights("w", torch.randn(8, 4)))  # client streaming
        with anonymous.stream() as stream:  # bidirectional streaming
            _refused(lambda: stream.sample(logits))
        assert anonymous.health() == "SERVING"  # probes need no token
    with SamplerClient(auth_server.target, timeout=30, retries=0, auth_token=secrets.token_urlsafe(32)) as wrong:
        _refused(lambda: wrong.sample(logits))
        _refused(lambda: wrong.server_info())
    for token in TOKENS:  # every token of the file is accepted
        with SamplerClient(auth_server.target, timeout=30, auth_token=token) as client:
            assert client.sample(logits, seed=[1, 2]).tokens.shape == (2, 1)
            assert client.register_weights("w", torch.randn(8, 4)).name == "w"
            assert client.unregister_weights("w").name == "w"
            with client.stream() as stream:
                assert stream.sample(logits, seed=[1, 2]).tokens.shape == (2, 1)


def test_async_client_sends_the_token(auth_server: RunningServer) -> None:
    async def run() -> None:
        async with AsyncSamplerClient(auth_server.target, timeout=30, auth_token=TOKENS[1]) as client:
            assert (await client.sample(torch.randn(1, 8), seed=1)).tokens.shape == (1, 1)
            async with client.stream() as stream:
                assert (await stream.sample(torch.randn(1, 8), seed=1)).tokens.shape == (1, 1)
        async with AsyncSamplerClient(auth_server.target, timeout=30, retries=0) as anonymous:
            with pytest.raises(TokenSamplerError) as raised:
                await anonymous.sample(torch.randn(1, 8))
            assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(run())


def test_refused_calls_reach_no_parser_and_no_method(auth_server: RunningServer) -> None:
    """Without a token: random bytes, unknown methods and reflection all get UNAUTHENTICATED alike."""
    with grpc.insecure_channel(auth_server.target) as channel:
        for method, payload in ((SAMPLE, secrets.token_bytes(64)), ("/tokensampler.v1.Sampler/NoSuchMethod", b"")):
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary(method)(payload, timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listing = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as raised:
            list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([listing]), timeout=10))
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With a token, reflection answers.
        metadata = call_metadata("r", TOKENS[0])
        answers = list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([listing]), timeout=10, metadata=metadata))
        assert "tokensampler.v1.Sampler" in {s.name for s in answers[0].list_services_response.service}
    # Refusals are counted, methods the server lacks under one label.
    samples = parse_samples(scrape_text(metrics_port(auth_server)))
    assert value(samples, "tokensampler_requests_total", method=SAMPLE.lstrip("/"), code="UNAUTHENTICATED") >= 1
    assert value(samples, "tokensampler_requests_total", method="unknown", code="UNAUTHENTICATED") >= 1


# --- TLS ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
                 *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> tuple[Path, Path | None]:
        cert_path = folder / f"{name}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is None:
            return cert_path, None
        key_path = folder / f"{name}.key"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path

    keys = {name: ec.generate_private_key(ec.SECP256R1()) for name in ("ca", "server", "client", "rogue_ca", "rogue")}
    ca, _ = write("ca", _certificate("test CA", keys["ca"], "test CA", keys["ca"], ca=True))
    server = write("server", _certificate("localhost", keys["server"], "test CA", keys["ca"], server=True), keys["server"])
    client = write("client", _certificate("engine", keys["client"], "test CA", keys["ca"]), keys["client"])
    rogue = write("rogue", _certificate("intruder", keys["rogue"], "rogue CA", keys["rogue_ca"]), keys["rogue"])
    return Pki(ca, *server, *client, *rogue)


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                       "--tls-client-ca", str(pki.ca))


def _unavailable(client: SamplerClient) -> None:
    with pytest.raises(TokenSamplerError) as raised:
        client.sample(torch.randn(1, 8))
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE, raised.value


def test_tls(tls_server: RunningServer, pki: Pki) -> None:
    with SamplerClient(tls_server.target, timeout=30, tls_ca=pki.ca) as client:
        assert client.sample(torch.randn(2, 8), seed=[1, 2]).tokens.shape == (2, 1)
    with SamplerClient(f"localhost:{tls_server.port}", timeout=30, tls_ca=pki.ca.read_bytes()) as by_name:
        assert by_name.health() == "SERVING"
    with SamplerClient(tls_server.target, timeout=30, retries=0) as plaintext:
        _unavailable(plaintext)  # plaintext to a TLS port
    with SamplerClient(tls_server.target, timeout=30, retries=0,
                       credentials=grpc.ssl_channel_credentials()) as untrusted:
        _unavailable(untrusted)  # the system's roots do not know the test CA


def test_mutual_tls(mtls_server: RunningServer, pki: Pki) -> None:
    with SamplerClient(mtls_server.target, timeout=30, tls_ca=pki.ca, tls_cert=pki.client_cert,
                       tls_key=pki.client_key) as client:
        assert client.sample(torch.randn(2, 8), seed=[1, 2]).tokens.shape == (2, 1)
    with SamplerClient(mtls_server.target, timeout=30, retries=0, tls_ca=pki.ca) as no_certificate:
        _unavailable(no_certificate)
    with SamplerClient(mtls_server.target, timeout=30, retries=0, tls_ca=pki.ca, tls_cert=pki.rogue_cert,
                       tls_key=pki.rogue_key) as rogue:
        _unavailable(rogue)  # a certificate that another CA signed

    async def run() -> None:
        async with AsyncSamplerClient(mtls_server.target, timeout=30, tls_ca=pki.ca, tls_cert=pki.client_cert,
                                      tls_key=pki.client_key) as client:
            assert (await client.sample(torch.randn(1, 8), seed=1)).tokens.shape == (1, 1)

    asyncio.run(run())


def test_tls_options_are_checked(pki: Pki) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--tls-cert", str(pki.server_cert)])  # no key
    with pytest.raises(SystemExit):
        parse_args(["--tls-client-ca", str(pki.ca)])  # mutual TLS without TLS
    config = parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"])
    assert (config.tls_cert, config.tls_key, config.tls_client_ca) == (Path("c.pem"), Path("k.pem"), Path("ca.pem"))
    with pytest.raises(ValueError, match="tls_cert, tls_key"):
        SamplerClient("127.0.0.1:1", tls_cert=pki.client_cert)
    with pytest.raises(ValueError, match="credentials"):
        SamplerClient("127.0.0.1:1", tls_ca=pki.ca, credentials=grpc.ssl_channel_credentials())
    with pytest.raises(ValueError, match="tls_ca: cannot read"):
        SamplerClient("127.0.0.1:1", tls_ca=pki.ca.parent / "missing.pem")


def test_a_key_that_does_not_match_the_certificate_stops_the_server(pki: Pki) -> None:
    result = subprocess.run([sys.executable, "-m", "tokensampler_server", "--tls-cert", str(pki.server_cert),
                             "--tls-key", str(pki.rogue_key), "--port", "0", "--no-metrics"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--tls-key" in result.stderr and "Traceback" not in result.stderr
    assert "mismatch" in result.stderr.lower()


def test_an_encrypted_key_stops_the_server_saying_so_without_a_prompt(pki: Pki, tmp_path: Path) -> None:
    """OpenSSL asks for an encrypted key's passphrase on the terminal (and the server waited there): the server
    refuses the key at once, saying it is encrypted."""
    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"passphrase")))
    result = subprocess.run([sys.executable, "-m", "tokensampler_server", "--tls-cert", str(pki.server_cert),
                             "--tls-key", str(encrypted), "--port", "0", "--no-metrics"],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--tls-key" in result.stderr and "encrypted" in result.stderr and "pass phrase" not in result.stderr.lower()


def test_a_port_in_use_stops_the_server_with_one_line() -> None:
    """grpc raises for an address in use: a one-line error naming the flags and exit status 2, as for every other
    setting the server cannot start with."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", str(port),
                                 "--no-metrics", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--host/--port" in result.stderr and str(port) in result.stderr


def test_failover_targets() -> None:
    assert channel_target("localhost:1") == "localhost:1"
    assert channel_target(["127.0.0.1:1", "127.0.0.2:2"]) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert channel_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    for bad in (["localhost:1"], ["127.0.0.1"], ["127.0.0.1:1", "[::1]:2"], []):
        with pytest.raises(ValueError, match="target"):
            channel_target(bad)


def test_command_line_client_with_token_and_mutual_tls(auth_server: RunningServer, mtls_server: RunningServer,
                                                       pki: Pki, tmp_path: Path, capsys) -> None:
    from tokensampler_client.cli import main as cli

    token_file = tmp_path / "token"
    token_file.write_text(TOKENS[0] + "\n")
    assert cli(["--target", auth_server.target, "--auth-token-file", str(token_file), "info"]) == 0
    assert cli(["--target", auth_server.target, "info"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    assert cli(["--target", mtls_server.target, *tls, "sample", "--random-logits", "2x16", "--seed", "3"]) == 0
    with pytest.raises(SystemExit):
        cli(["--target", mtls_server.target, "--tls-cert", str(pki.client_cert), "health"])  # no key, no CA
