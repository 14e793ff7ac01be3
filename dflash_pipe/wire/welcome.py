"""Waiting for a WELCOME: what a worker and an attaching producer both do after their HELLO."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dflash_pipe.wire import messages as m


def await_welcome(
    recv: Callable[[float], Any],
    *,
    address: str,
    peer: str,
    me: str,
    error: type[Exception],
    timeout_s: float,
    hint: str,
) -> m.Welcome:
    """The WELCOME ``recv(timeout_s)`` brings within ``timeout_s``; a REJECT, an ERROR or the timeout raise
    ``error`` naming ``peer`` (who answers: "producer", "coordinator") and why, ``hint`` saying what to
    check when nothing came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = recv(1.0)
        if isinstance(msg, m.Welcome):
            return msg
        if isinstance(msg, m.Reject):
            raise error(f"the {peer} at {address} refused this {me}: {msg.reason}")
        if isinstance(msg, m.Error):
            raise error(f"the {peer} at {address} failed: {msg.message}")
    raise error(f"no WELCOME from {address} within {timeout_s:.0f} s. {hint}")
