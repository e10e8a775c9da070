"""TLS and mutual TLS on the gRPC API, with throw-away CAs made here, called through plain gRPC
channels as any client would; certificates rotated while the server runs."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2_grpc
from tests.integration.service import READINESS, Service

crypto = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING


class CA:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = self._sign(self.name, self.key.public_key(), ca=True)

    def _sign(self, subject, public_key, ca: bool = False, server: bool = False):
        now = datetime.datetime.now(datetime.UTC)
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.name)
             .public_key(public_key).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=1))
             .not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        return b.sign(self.key, hashes.SHA256())

    def issue(self, name: str, directory: Path, server: bool = False) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]),
                          key.public_key(), server=server)
        cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def secure(address: str, ca: CA, client: tuple[Path, Path] | None = None) -> grpc.Channel:
    cert, key = (p.read_bytes() for p in client) if client else (None, None)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.pem(), key, cert))


def ready(channel: grpc.Channel) -> bool:
    """Readiness: an executor has joined (before that, Generate is UNAVAILABLE at once)."""
    try:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS), timeout=5).status == SERVING
    except grpc.RpcError:
        return False


def generate_ok(channel: grpc.Channel) -> bool:
    stub = generate_pb2_grpc.GenerationStub(channel)
    return bool(list(stub.Generate(build_request(text="Hello", max_tokens=2), timeout=60)))


def scrape_ok(port: int, ca: CA) -> bool:
    """/metrics over HTTPS, verified against ca."""
    context = ssl.create_default_context(cadata=ca.pem().decode())
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5,
                                    context=context) as r:
            return b"pagedserve_" in r.read()
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return False


def https_ok(port: int, ca: CA, client: tuple[Path, Path] | None = None) -> bool:
    """The OpenAI-compatible API's /health over HTTPS, verified against ca."""
    context = ssl.create_default_context(cadata=ca.pem().decode())
    if client is not None:
        context.load_cert_chain(*client)
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=5,
                                    context=context) as r:
            return r.status == 200
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return False


def start(tmp: Path, *flags: str) -> Service:
    return Service(tmp / "serve.log", *flags)  # its plain client is not used: TLS only


def wait_ready(svc: Service, channel: grpc.Channel) -> None:
    deadline = time.monotonic() + 180
    while not ready(channel):
        assert svc.proc.poll() is None and time.monotonic() < deadline, \
            svc.log_path.read_text()[-3000:]
        time.sleep(0.5)


def test_tls_serves_verified_clients_and_picks_up_rotated_certificates(tmp_path, model_dir):
    first, second = CA("first-ca"), CA("second-ca")
    cert, key = first.issue("server", tmp_path, server=True)
    svc = start(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        channel = secure(svc.address, first)
        wait_ready(svc, channel)
        assert generate_ok(channel)
        assert scrape_ok(svc.metrics_port, first)  # /metrics is HTTPS with the same pair
        assert https_ok(svc.http_port, first)  # and so is the HTTP API
        (tmp_path / "first.pem").write_bytes(first.pem())
        cli = [sys.executable, "-m", "pagedserve.cli", "health", "--address", svc.address]
        assert subprocess.run([*cli, "--tls-ca", str(tmp_path / "first.pem")],
                              capture_output=True, timeout=60).returncode == 0
        assert subprocess.run(cli, capture_output=True, timeout=60).returncode == 1
        assert not ready(grpc.insecure_channel(svc.address))  # plain text gets nothing
        assert not ready(secure(svc.address, second))  # nor a client trusting another CA
        # rotate: the new pair, from another CA, written over the files
        new_cert, new_key = second.issue("server-new", tmp_path, server=True)
        cert.write_bytes(new_cert.read_bytes())
        key.write_bytes(new_key.read_bytes())
        assert ready(secure(svc.address, second))  # new connections get the new certificate
        assert not ready(secure(svc.address, first))
        assert "TLS certificates reloaded" in svc.log_path.read_text()
        deadline = time.monotonic() + 15  # /metrics follows within its watch period
        while not scrape_ok(svc.metrics_port, second):
            assert time.monotonic() < deadline, "/metrics kept the old certificate"
            time.sleep(0.5)
        while not https_ok(svc.http_port, second):
            assert time.monotonic() < deadline, "the HTTP API kept the old certificate"
            time.sleep(0.5)
    finally:
        svc.stop()


def test_mutual_tls_needs_a_client_certificate_from_the_ca(tmp_path, model_dir):
    ca, stranger = CA("ca"), CA("stranger")
    cert, key = ca.issue("server", tmp_path, server=True)
    (tmp_path / "clients.pem").write_bytes(ca.pem())
    svc = start(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca",
                str(tmp_path / "clients.pem"))
    try:
        good = secure(svc.address, ca, ca.issue("client", tmp_path))
        wait_ready(svc, good)
        assert generate_ok(good)
        assert not ready(secure(svc.address, ca))  # no client certificate
        assert https_ok(svc.http_port, ca, ca.issue("http-client", tmp_path))
        assert not https_ok(svc.http_port, ca)
        assert not https_ok(svc.http_port, ca, stranger.issue("http-intruder", tmp_path))
        assert not ready(secure(svc.address, ca, stranger.issue("intruder", tmp_path)))
    finally:
        svc.stop()
