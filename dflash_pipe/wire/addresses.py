"""Address and key policy: which addresses the producer may bind without CURVE keys, and the fix to name.

Kept apart from ``transport`` (the zmq module) so the run config validates an address without loading
pyzmq: loopback tcp:// and ipc:// (or inproc://) go without keys, anything else needs a key directory.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

DEFAULT_ADDRESS = "tcp://127.0.0.1:0"
"""The producer's default: loopback, port 0 picks a free one."""
GENERATE_HINT = (
    "create keys with `dflash-pipe keys generate DIR`, then pass `--keys DIR` to `dflash-pipe launch` and "
    "to every `dflash-pipe worker`"
)
"""The fix every key error names."""


def host_of(address: str) -> str | None:
    """The host part of a tcp:// address, or None for ipc://, inproc:// (local by construction)."""
    transport, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(f"address {address!r} has no transport; use 'tcp://127.0.0.1:0' or 'ipc:///path'")
    if transport in ("ipc", "inproc"):
        return None
    if transport != "tcp":
        raise ValueError(f"address {address!r}: transport {transport!r} not supported; use tcp:// or ipc://")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port:
        raise ValueError(f"address {address!r} needs a host and a port, e.g. 'tcp://127.0.0.1:0'")
    return host.strip("[]")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", "0.0.0.0", interface names, host names


def is_local_address(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host: the addresses that may go without keys."""
    host = host_of(address)
    return host is None or _is_loopback(host)


def require_keys_for(address: str, keys: Path | None) -> None:
    """Raise a ValueError naming the fix when `address` is not local and no key directory is given."""
    if keys is None and not is_local_address(address):
        raise ValueError(
            f"refusing to bind {address!r} without CURVE keys: it is not a loopback address, so anyone who "
            f"can reach it could feed or read the run. Either {GENERATE_HINT}; or bind tcp://127.0.0.1:PORT "
            "or ipc:///PATH."
        )


def store_host(address: str) -> str:
    """The host the drafters' rendezvous store listens on: the producer's tcp:// host as written (brackets
    kept), loopback for ipc:// and inproc://."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    rest = address.split("://", 1)[1]
    return rest.rsplit(":", 1)[0] if rest.count(":") else "127.0.0.1"
