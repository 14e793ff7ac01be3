"""CURVE keys for the wire: write a key directory, read it back, and decide which clients may connect.

A key directory (``dflash-pipe keys generate DIR``) holds zmq.auth certificate files:

    DIR/                     mode 0700
      server.key             the producer's public key (workers need it)
      server.key_secret      the producer's secret key (only the producer host needs it)
      client.key             the workers' public key
      client.key_secret      the workers' secret key (every worker host needs it)
      clients/client.key     allow-list: the producer accepts exactly the public keys in clients/*.key

Every file is written with mode 0600 and a secret file readable by other users is refused, as ssh does.
The producer reads ``server.key_secret`` + ``clients/``; a worker reads ``client.key_secret`` +
``server.key``. To admit another worker key pair, drop its public ``.key`` file into ``clients/``.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from dflash_pipe.wire.addresses import GENERATE_HINT
from dflash_pipe.wire.errors import TransportError

SERVER = "server"
CLIENT = "client"
CLIENTS_DIR = "clients"

log = logging.getLogger("dflash_pipe.wire")


class KeyFileError(ValueError):
    """A key directory is missing, incomplete, unreadable, malformed or too open."""


class AuthError(TransportError):
    """The CURVE handshake with the peer failed: the other side does not hold the right keys."""


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """What the producer needs: its key pair and the allow-list of client public keys (z85)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]
    directory: Path


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a worker needs: its key pair and the producer's public key (z85)."""

    public: bytes
    secret: bytes
    server_public: bytes
    directory: Path


def generate_keys(directory: Path) -> list[Path]:
    """Write a fresh server and client key pair (and the allow-list) into `directory`; returns the files.

    Refuses to overwrite existing keys: replacing them would lock out every worker holding the old ones.
    """
    directory = Path(directory)
    existing = [
        p for p in (directory / f"{SERVER}.key_secret", directory / f"{CLIENT}.key_secret") if p.exists()
    ]
    if existing:
        raise KeyFileError(
            f"{existing[0]} already exists; refusing to overwrite keys that workers may hold. "
            "Choose a new DIR, or delete the old key directory first"
        )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)  # mkdir's mode is masked by umask and ignored for an existing dir
    clients = directory / CLIENTS_DIR
    clients.mkdir(exist_ok=True, mode=0o700)
    os.chmod(clients, 0o700)
    server_public, server_secret = zmq.auth.create_certificates(directory, SERVER)
    client_public, client_secret = zmq.auth.create_certificates(directory, CLIENT)
    allowed = clients / f"{CLIENT}.key"
    allowed.write_bytes(Path(client_public).read_bytes())
    files = [Path(p) for p in (server_public, server_secret, client_public, client_secret)] + [allowed]
    for path in files:
        os.chmod(path, 0o600)
    return files


def load_server_keys(directory: Path) -> ServerKeys:
    """The producer's side of a key directory; errors name the file and the fix."""
    directory = _key_dir(directory)
    public, secret = _load(directory / f"{SERVER}.key_secret", need_secret=True)
    clients = directory / CLIENTS_DIR
    if not clients.is_dir():
        raise KeyFileError(
            f"--keys {directory}: no {CLIENTS_DIR}/ directory of allowed worker keys; {GENERATE_HINT}"
        )
    allowed = frozenset(_load(p, need_secret=False)[0] for p in sorted(clients.glob("*.key")))
    if not allowed:
        raise KeyFileError(
            f"--keys {directory}: {CLIENTS_DIR}/ holds no *.key file, so no worker could connect; "
            f"copy {CLIENT}.key there or {GENERATE_HINT}"
        )
    return ServerKeys(public=public, secret=secret, allowed=allowed, directory=directory)


def load_client_keys(directory: Path) -> ClientKeys:
    """A worker's side of a key directory; errors name the file and the fix."""
    directory = _key_dir(directory)
    public, secret = _load(directory / f"{CLIENT}.key_secret", need_secret=True)
    server_public, _ = _load(directory / f"{SERVER}.key", need_secret=False)
    return ClientKeys(public=public, secret=secret, server_public=server_public, directory=directory)


class AllowList:
    """ZAP credentials provider: admits the listed client keys and logs every refusal."""

    def __init__(self, allowed: frozenset[bytes], directory: Path) -> None:
        self.allowed = allowed
        self.directory = directory
        self.refused = 0
        self.refused_keys: dict[bytes, int] = {}
        """Refusals per client key: each key is logged once, then at 10, 100, ... refusals."""

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.allowed:
            return True
        self.refused += 1
        n = self.refused_keys[client_key] = self.refused_keys.get(client_key, 0) + 1
        if is_log_count(n):  # bounded: a hostile peer may retry forever
            count = "first refusal of this key; later ones are counted" if n == 1 else f"{n} refusals so far"
            log.warning(
                "refused a worker connection: its CURVE public key %s is not in %s (%s)",
                client_key.decode("ascii", "replace"),
                self.directory / CLIENTS_DIR,
                count,
            )
        return False


def is_log_count(n: int) -> bool:
    """1, 10, 100, ...: when a repeated refusal is worth a log line (with its count)."""
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _key_dir(directory: Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise KeyFileError(f"--keys {directory}: no such directory; {GENERATE_HINT}")
    return directory


def _load(path: Path, *, need_secret: bool) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise KeyFileError(f"--keys {path.parent}: no {path.name} there; {GENERATE_HINT}")
    if need_secret:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise KeyFileError(
                f"{path}: a secret key readable by other users (mode {mode:04o}) is refused; run `chmod 600 {path}`"
            )
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path}: not a readable zmq certificate ({e}); {GENERATE_HINT}") from None
    keys = (public, secret) if need_secret else (public,)
    if not all(k is not None and len(k) == 40 and _is_z85(k) for k in keys):
        which = "secret" if need_secret else "public"
        raise KeyFileError(f"{path}: no valid {which} key in this certificate; {GENERATE_HINT}")
    return public, secret or b""


def _is_z85(key: bytes) -> bool:
    try:
        z85.decode(key)
    except (ValueError, KeyError, TypeError):
        return False
    return True
