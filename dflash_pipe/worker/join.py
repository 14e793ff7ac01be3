"""Which producer feeds a worker: the one at the address it was given, or the one on its own node.

A worker says HELLO at ``--connect``. When that is the run's coordinator and an attached producer of the
run serves the worker's node, the coordinator answers REDIRECT instead of WELCOME (``producer.handshake
.redirect_for``): the worker closes that link and says HELLO to the producer it names, so its features
come through shared memory or CUDA IPC and only gradients and control messages cross nodes. ``follow``
is that walk: at most one redirect (the second HELLO says it follows none, and an attached producer never
redirects), and a named producer that does not answer (it died since the coordinator named it) sends the
worker back to the coordinator without redirect, fed over the network: never a wait that cannot end.
``worker --no-redirect`` says HELLO without the capability, for a worker that wants the network path.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Protocol, TypeVar

from dflash_pipe.wire import messages as m
from dflash_pipe.wire.cuda_ipc import cuda_ipc_supported
from dflash_pipe.wire.shm import host_identity, shm_supported
from dflash_pipe.wire.welcome import Redirected, await_welcome
from dflash_pipe.worker.link import ProducerLink

CAPABILITIES = ["frames", "shm"] if shm_supported() else ["frames"]
""""frames": payloads on the socket; "shm": can map a same-host producer's shared-memory ring. A worker on
a CUDA device adds "cuda_ipc": it can open a same-host producer's ring in GPU memory; one that follows a
REDIRECT to the producer of its node adds "redirect"."""

T = TypeVar("T")


class HandshakeError(RuntimeError):
    """The producer refused this worker or never answered."""


class RedirectUnanswered(HandshakeError):
    """The producer a REDIRECT named did not answer the HELLO in time (it died since, or is stuck)."""


class ProducerLost(Exception):
    """This session's producer went away; the worker may reconnect to the address it was given."""

    def __init__(self, reason: str, *, welcomed: bool) -> None:
        super().__init__(reason)
        self.welcomed = welcomed


def hello(*, name: str, device: str, redirect: bool) -> m.Hello:
    """This worker's HELLO: what it can open, which node it is on and whether it follows a REDIRECT."""
    capabilities = CAPABILITIES + (["cuda_ipc"] if cuda_ipc_supported(device.split(",")[0]) else [])
    return m.Hello(
        worker_name=name,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        capabilities=capabilities + ([m.REDIRECT_CAPABILITY] if redirect else []),
        host_id=host_identity(),
    )


def handshake(
    link: ProducerLink,
    *,
    name: str,
    device: str,
    timeout_s: float,
    redirect: bool,
    unanswered: type[HandshakeError] = HandshakeError,
) -> m.Welcome:
    """HELLO and its WELCOME; ``Redirected`` when the producer sends this worker to its node's producer
    (only if ``redirect``), ``HandshakeError`` on a REJECT, ``unanswered`` when nothing came in time."""
    link.send(hello(name=name, device=device, redirect=redirect))
    return await_welcome(
        lambda timeout: link.get(timeout_s=timeout),
        address=link.address,
        peer="producer",
        me="worker",
        error=HandshakeError,
        timeout_s=timeout_s,
        hint="Is `dflash-pipe launch` running there, and is the address (host and port) the one it printed?",
        redirect=redirect,
        silent=unanswered,
    )


class Serve(Protocol[T]):
    """One session with the producer at ``address`` (``worker.proc``'s ``_serve``): raises ``Redirected``
    from its handshake when ``redirect`` and the producer redirects, ``unanswered`` when no WELCOME came
    within ``timeout_s``, ``ProducerLost`` when the link was lost."""

    def __call__(
        self, address: str, *, redirect: bool, timeout_s: float, unanswered: type[HandshakeError]
    ) -> T: ...


def follow(
    serve: Serve[T], connect: str, *, redirect: bool, timeout_s: float, say: Callable[[str], None]
) -> T:
    """``serve`` at ``connect``, or at the producer its REDIRECT names (one redirect, never more); back at
    ``connect`` without redirect if that producer never answers. ``say`` prints one line for each turn."""
    try:
        return serve(connect, redirect=redirect, timeout_s=timeout_s, unanswered=HandshakeError)
    except Redirected as exc:
        to = exc.redirect
    say(
        f"redirected by the coordinator to producer {to.producer} at {to.address}: it runs on this node, so "
        "features stay here"
    )
    wait_s = min(timeout_s, to.timeout_s)
    try:
        return serve(to.address, redirect=False, timeout_s=wait_s, unanswered=RedirectUnanswered)
    except RedirectUnanswered:
        why = f"did not answer within {wait_s:.0f} s"
    except ProducerLost as lost:
        if lost.welcomed:  # it fed this worker, then died: the caller's reconnect loop decides
            raise
        why = f"is gone ({lost})"
    say(
        f"producer {to.producer} at {to.address} {why} (it may have died since the coordinator named it); "
        f"joining the coordinator at {connect} instead, features over the network"
    )
    return serve(connect, redirect=False, timeout_s=timeout_s, unanswered=HandshakeError)
