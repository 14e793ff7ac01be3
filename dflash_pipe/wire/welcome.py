"""Waiting for a WELCOME: what a worker and an attaching producer both do after their HELLO."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dflash_pipe.wire import messages as m


class Redirected(Exception):
    """The producer answered HELLO with REDIRECT: say HELLO to ``redirect.producer`` at
    ``redirect.address`` instead (the producer of this node; ``worker.join.follow``)."""

    def __init__(self, redirect: m.Redirect) -> None:
        super().__init__(f"redirected to producer {redirect.producer} at {redirect.address}")
        self.redirect = redirect


def await_welcome(
    recv: Callable[[float], Any],
    *,
    address: str,
    peer: str,
    me: str,
    error: type[Exception],
    timeout_s: float,
    hint: str,
    redirect: bool = False,
    silent: type[Exception] | None = None,
) -> m.Welcome:
    """The WELCOME ``recv(timeout_s)`` brings within ``timeout_s``; a REJECT, an ERROR or the timeout raise
    ``error`` naming ``peer`` (who answers: "producer", "coordinator") and why, ``hint`` saying what to
    check when nothing came (``silent`` instead of ``error`` for the timeout, if given). A REDIRECT raises
    ``Redirected`` when ``redirect`` (the HELLO said it follows one), else ``error``: a redirect is
    followed at most once, so one to a peer that follows none is a fault of the peer that sent it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = recv(1.0)
        if isinstance(msg, m.Welcome):
            return msg
        if isinstance(msg, m.Reject):
            raise error(f"the {peer} at {address} refused this {me}: {msg.reason}")
        if isinstance(msg, m.Error):
            raise error(f"the {peer} at {address} failed: {msg.message}")
        if isinstance(msg, m.Redirect):
            if redirect:
                raise Redirected(msg)
            raise error(
                f"the {peer} at {address} redirected this {me} to producer {msg.producer} at {msg.address}, "
                f"but this {me} follows no redirect (it was sent here by one, or asked for none); "
                "connect it to the run's coordinator, and report this"
            )
    raise (silent or error)(f"no WELCOME from {address} within {timeout_s:.0f} s. {hint}")
