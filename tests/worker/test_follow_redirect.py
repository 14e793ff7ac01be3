"""A worker follows the coordinator's REDIRECT to the producer of its node over the real wire (``ProducerLink``
and ``ProducerEndpoint``s on ipc://, in process): one redirect and no more, the second HELLO without the
"redirect" capability, and back to the coordinator without it when the producer it was sent to never
answers (it died meanwhile). ``worker --no-redirect`` stays where it was told."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable

import pytest

from dflash_pipe.run.signals import Signals
from dflash_pipe.wire import ProducerEndpoint
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.welcome import Redirected
from dflash_pipe.worker.join import HandshakeError, RedirectUnanswered, follow, handshake
from dflash_pipe.worker.link import ProducerLink
from dflash_pipe.worker.proc import _serve


def _welcome(run_id: str) -> m.Welcome:
    return m.Welcome(
        run_id=run_id, rendezvous="tcp://127.0.0.1:1", run_dir="/tmp/run", target_path="/t", drafter={},
        train={}, heartbeat_s=0.5, peer_timeout_s=30.0, num_samples=4, credits=1, eval_batches=0,
    )  # fmt: skip


class Answerer:
    """A producer's endpoint on ipc:// that answers each HELLO with ``answer(hello)`` and keeps the HELLOs."""

    def __init__(self, answer: Callable[[m.Hello], m.Message]) -> None:
        self._dir = tempfile.mkdtemp(prefix="dfl")  # short: ipc paths are limited to ~107 bytes
        self.endpoint = ProducerEndpoint(f"ipc://{self._dir}/p.sock")
        self.address = self.endpoint.address
        self.hellos: list[m.Hello] = []
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            got = self.endpoint.recv(0.02)
            if got is not None and isinstance(got[1], m.Hello):
                self.hellos.append(got[1])
                self.endpoint.send(got[0], self._answer(got[1]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.endpoint.close(linger_s=0)
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture
def nodes():
    """The coordinator (redirects a worker that follows redirects to node1) and node1's producer."""
    node1 = Answerer(lambda hello: _welcome("from-node1"))
    coordinator = Answerer(
        lambda hello: (
            m.Redirect(producer="node1", address=node1.address, timeout_s=30.0)
            if m.REDIRECT_CAPABILITY in hello.capabilities
            else _welcome("from-coordinator")
        )
    )
    yield coordinator, node1
    coordinator.close()
    node1.close()


@pytest.fixture
def gone():
    """An ipc:// address nobody binds: a producer that died after the coordinator named it."""
    folder = tempfile.mkdtemp(prefix="dfl")
    yield f"ipc://{folder}/gone.sock"
    shutil.rmtree(folder, ignore_errors=True)


def _serve_handshake(address: str, *, redirect: bool, timeout_s: float, unanswered: type[HandshakeError]):
    """A worker session reduced to its handshake: which producer welcomed it."""
    link = ProducerLink(address)
    try:
        welcome = handshake(
            link, name="w", device="cpu", timeout_s=timeout_s, redirect=redirect, unanswered=unanswered
        )
        return welcome.run_id
    finally:
        link.close()


def test_a_worker_follows_one_redirect_to_its_nodes_producer(nodes) -> None:
    coordinator, node1 = nodes
    said: list[str] = []
    got = follow(_serve_handshake, coordinator.address, redirect=True, timeout_s=10.0, say=said.append)
    assert got == "from-node1"
    assert said == [
        f"redirected by the coordinator to producer node1 at {node1.address}: it runs on this node, so "
        "features stay here"
    ]
    assert m.REDIRECT_CAPABILITY in coordinator.hellos[0].capabilities
    assert [m.REDIRECT_CAPABILITY in h.capabilities for h in node1.hellos] == [False]  # never twice


def test_no_redirect_stays_with_the_coordinator(nodes) -> None:
    coordinator, node1 = nodes
    said: list[str] = []
    got = follow(_serve_handshake, coordinator.address, redirect=False, timeout_s=10.0, say=said.append)
    assert got == "from-coordinator" and not said and not node1.hellos
    assert m.REDIRECT_CAPABILITY not in coordinator.hellos[0].capabilities


def test_a_producer_dead_since_the_redirect_sends_the_worker_back_without_redirect(gone: str) -> None:
    coordinator = Answerer(
        lambda hello: (
            m.Redirect(producer="node1", address=gone, timeout_s=1.0)
            if m.REDIRECT_CAPABILITY in hello.capabilities
            else _welcome("from-coordinator")
        )
    )
    try:
        said: list[str] = []
        got = follow(_serve_handshake, coordinator.address, redirect=True, timeout_s=30.0, say=said.append)
    finally:
        coordinator.close()
    assert got == "from-coordinator"
    assert said[0].startswith("redirected by the coordinator to producer node1")
    assert f"producer node1 at {gone} did not answer within 1 s" in said[1], said
    assert f"joining the coordinator at {coordinator.address} instead, features over the network" in said[1]
    assert [m.REDIRECT_CAPABILITY in h.capabilities for h in coordinator.hellos] == [True, False]


def test_a_second_redirect_is_an_error_not_a_bounce() -> None:
    bouncer = Answerer(lambda hello: m.Redirect(producer="node2", address="tcp://127.0.0.1:9", timeout_s=1.0))
    try:
        with pytest.raises(HandshakeError, match="follows no redirect"):
            _serve_handshake(bouncer.address, redirect=False, timeout_s=10.0, unanswered=HandshakeError)
    finally:
        bouncer.close()


def test_the_worker_session_hands_the_redirect_and_the_silence_up_to_follow(nodes, gone: str) -> None:
    """``_serve`` (the real session) leaves before building anything: no ERROR to the coordinator, no exit."""
    coordinator, _ = nodes
    signals = Signals(stop_timeout_s=1.0, on_hard_stop=lambda reason, code: None)
    common = dict(device="cpu", name="w", started_at=0.0, keys=None, signals=signals)
    with pytest.raises(Redirected) as info:
        _serve(coordinator.address, redirect=True, timeout_s=10.0, unanswered=HandshakeError, **common)
    assert info.value.redirect.producer == "node1"
    with pytest.raises(RedirectUnanswered, match="no WELCOME"):
        _serve(gone, redirect=False, timeout_s=1.0, unanswered=RedirectUnanswered, **common)
