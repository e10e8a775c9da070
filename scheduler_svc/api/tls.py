"""TLS for the gRPC API from certificate files, reloaded without a restart: gRPC asks for the
certificate configuration at each new handshake, and gets a new one when a file changed (or
after SIGHUP), so rotated certificates apply to new connections while open streams go on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from pagedserve.scheduler.file_watch import file_stamp, watch_files

log = logging.getLogger("pagedserve.scheduler")


class TLSError(ValueError):
    """TLS settings that cannot be used; the message says which."""


class CertificateFiles:
    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        """cert: PEM chain, key: its private key; client_ca: PEM of the CAs whose client
        certificates are accepted (mutual TLS), empty: clients need no certificate."""
        self.paths = [Path(p) for p in (cert, key, client_ca) if p]
        self.client_ca = bool(client_ca)
        self._stamp = file_stamp(self.paths)
        self._forced = False
        self._followers: list[Callable[[], None]] = []
        self.initial = self._load()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=self.client_ca)

    def reload(self) -> None:
        """Re-read the files at the next handshake, and run the followers now (SIGHUP)."""
        self._forced = True
        self._run_followers()

    def follow(self, reload: Callable[[], None]) -> None:
        """Also call reload (e.g. the metrics server's) whenever the files change."""
        self._followers.append(reload)

    async def watch(self, period_s: float = 5.0) -> None:
        """Run the followers when the files change (gRPC itself checks at each handshake)."""
        await watch_files(self.paths, self._run_followers, period_s)

    def _run_followers(self) -> None:
        for reload in self._followers:
            try:
                reload()
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                log.error("TLS certificate reload failed, keeping the previous one: %s", e)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration, or None to keep it."""
        stamp = file_stamp(self.paths)
        if stamp == self._stamp and not self._forced:
            return None
        self._stamp, self._forced = stamp, False
        try:
            config = self._load()
        except (OSError, ValueError) as e:  # a half-written file: keep serving the old one
            log.error("TLS certificate reload failed, keeping the previous one: %s", e)
            return None
        log.info("TLS certificates reloaded from %s", ", ".join(map(str, self.paths)))
        return config

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self.paths[0].read_bytes(), self.paths[1].read_bytes()
        if b"PRIVATE KEY" not in key or b"CERTIFICATE" not in cert:
            raise ValueError("not a PEM certificate and private key")
        ca = self.paths[2].read_bytes() if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
