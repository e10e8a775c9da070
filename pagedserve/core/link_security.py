"""Who may sit at the other end of the executor link.

The link carries users' prompts and the tokens generated for them, so either it stays on this
host (loopback TCP or an ipc:// socket) or it is authenticated and encrypted with ZeroMQ CURVE:
the scheduler has a key pair, each executor has one, and the scheduler accepts only executors
whose public key is in its allow-list directory. Keys are ZeroMQ certificate files (pyzmq's
zmq.auth format): `NAME.key` holds the public key, `NAME.key_secret` both keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


class LinkSecurityError(ValueError):
    """Keys missing, unreadable, or an exposed link without them; the message says which."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85
    secret: bytes  # z85


def is_local(address: str) -> bool:
    """Whether a ZeroMQ address stays on this host (ipc, inproc, loopback TCP)."""
    scheme = address.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(address).hostname or ""
    return host in _LOCAL_HOSTS or host.startswith("127.")


def check_exposure(address: str, keyed: bool, insecure: bool) -> None:
    """Refuse a link reachable from other hosts without keys, unless told otherwise."""
    if keyed or insecure or is_local(address):
        return
    raise LinkSecurityError(
        f"the executor link {address} is reachable from other hosts, and without keys anyone "
        f"who connects could read users' prompts: give the link keys (`pagedserve keys` makes "
        f"them; see --scheduler-key), bind a loopback or ipc:// address, or pass "
        f"--insecure-executor-link")


def load_keypair(path: str | Path) -> KeyPair:
    """A `NAME.key_secret` certificate file."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise LinkSecurityError(f"link key {path}: {e}") from e
    if secret is None:
        raise LinkSecurityError(f"link key {path}: no secret key in it (give the .key_secret "
                                f"file, not the public .key)")
    return KeyPair(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """A `NAME.key` (or `NAME.key_secret`) certificate file's public key."""
    import zmq.auth

    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise LinkSecurityError(f"public key {path}: {e}") from e
    return public


def allowed_keys(directory: str | Path, peers: str = "executor") -> list[bytes]:
    """The public keys of every `*.key` file in directory (the peers' allow-list)."""
    import zmq.auth

    d = Path(directory)
    if not d.is_dir():
        raise LinkSecurityError(f"allowed {peers} keys: {d} is not a directory")
    keys = list(zmq.auth.load_certificates(d))
    if not keys:
        raise LinkSecurityError(f"allowed {peers} keys: no *.key file in {d}")
    return keys


def curve_server(ctx, sock, key_file: str, allowed_dir: str, peers: str, flag: str):
    """Make sock (of ctx, an asyncio context of its own) a CURVE server with the key pair
    of key_file that accepts only the public keys in allowed_dir (flag names it); returns
    the started authenticator, to stop at close, and how many keys it accepts
    (LinkSecurityError for bad keys)."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    key = load_keypair(key_file)
    if not allowed_dir:
        raise LinkSecurityError(f"a key ({key_file}) but no allow-list of {peers} keys "
                                f"({flag})")
    allowed = allowed_keys(allowed_dir, peers)
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=allowed_dir)
    sock.curve_secretkey, sock.curve_publickey = key.secret, key.public
    sock.curve_server = True
    return auth, len(allowed)


def create_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret into directory (kept if they exist already, so a
    restarted deployment keeps its keys); the secret file readable by its owner only."""
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if not secret.exists():
        zmq.auth.create_certificates(d, name)
    secret.chmod(0o600)
    return public, secret
