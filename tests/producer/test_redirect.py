"""The coordinator sends a worker to the attached producer of its own node (REDIRECT instead of WELCOME),
message by message: only once that producer said where it serves (SERVING), only a worker that follows
redirects, never one of the coordinator's own node, never from an attached producer (a redirect never
bounces), and never to a producer that is gone. The attaching side says SERVING once its target serves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
from test_coordinator import FakeEndpoint, _producer_hello, _upstream
from test_core import _core, _hello

from dflash_pipe.wire import messages as m

NODE1 = "tcp://127.0.0.1:41000"


def _follower(name: str, host_id: str = "other-node") -> m.Hello:
    """A worker of the second node that follows redirects (what `dflash-pipe worker` says by default)."""
    hello = _hello(name, host_id=host_id)
    return msgspec.structs.replace(hello, capabilities=[*hello.capabilities, m.REDIRECT_CAPABILITY])


def _with_node1(tmp_path: Path, *, serving: bool = True):
    core, out, metrics = _core(tmp_path)
    core.handle(b"p", _producer_hello("node1"))  # host_id "other-node"
    if serving:
        core.handle(b"p", m.Serving(address=NODE1))
    return core, out, metrics


def test_a_worker_of_a_node_with_a_serving_producer_is_sent_there(tmp_path: Path) -> None:
    core, out, metrics = _with_node1(tmp_path)
    assert core.peers[b"p"].serves == NODE1 and any(
        "serves the workers of its node" in n for n in core.account.messages
    )
    core.handle(b"w", _follower("w"))
    ((who, redirect),) = out.redirected
    assert who == b"w" and redirect == m.Redirect(
        producer="node1", address=NODE1, timeout_s=5.0
    )  # peer timeout
    assert b"w" not in core.peers and not out.of(b"w", m.Welcome)  # never joined here: no rank, no lease
    assert core.peers.redirected == 1 and metrics.records[-1][0] == {"workers_redirected": 1.0}
    assert any("w (cpu on h) sent to producer node1" in n for n in core.account.messages)
    core.handle(b"w", m.Ready(credits=1))  # a redirected worker that talks on is a stranger
    assert out.rejected[-1] == (b"w", "say HELLO first")


@pytest.mark.parametrize(
    "case, hello, warned",
    [
        ("--no-redirect", _hello("w", host_id="other-node"), "--no-redirect"),
        ("the coordinator's own node", _follower("w", host_id="h"), None),
        ("a node with no producer", _follower("w", host_id="third-node"), None),
    ],
)
def test_a_worker_is_welcomed_here_when_it_must_not_be_sent(tmp_path: Path, case, hello, warned) -> None:
    core, out, _ = _with_node1(tmp_path)
    core.handle(b"w", hello)
    assert not out.redirected and out.of(b"w", m.Welcome), case
    network = [n for n in core.account.messages if "gets its features over the network" in n]
    if warned is None:
        assert not network, case
    else:  # the warning stays for the worker that asked for the network path
        assert len(network) == 1 and warned in network[0] and "node1" in network[0], network


def test_no_redirect_before_serving_nor_after_the_producer_is_lost(tmp_path: Path) -> None:
    core, out, _ = _with_node1(tmp_path, serving=False)
    core.handle(b"w1", _follower("w1"))  # its target still loads: it answers no HELLO yet
    assert not out.redirected and out.of(b"w1", m.Welcome)
    assert any("did not serve yet" in n for n in core.account.messages)
    core.handle(b"p", m.Serving(address=NODE1))
    core.drop(core.peers[b"p"], "vanished")  # SIGKILLed
    core.handle(b"w2", _follower("w2"))
    assert not out.redirected and out.of(b"w2", m.Welcome)


def test_an_attached_producer_never_redirects(tmp_path: Path) -> None:
    core, out, _ = _with_node1(tmp_path)
    core.ctx = dataclasses.replace(core.ctx, attached=True)  # the same core, as an attached producer's
    core.handle(b"w", _follower("w"))
    assert not out.redirected and out.of(b"w", m.Welcome)


def test_serving_is_a_producers_word_only(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"x", m.Serving(address=NODE1))  # a stranger
    assert out.rejected == [(b"x", "say HELLO first")]
    core.handle(b"w", _hello("w", host_id="other-node"))
    core.handle(b"w", m.Serving(address=NODE1))  # a worker claiming to serve its node
    assert core.peers[b"w"].serves == "" and any(
        "ignored SERVING from worker w" in n for n in core.account.messages
    )
    core.handle(b"p", _producer_hello("node1"))
    core.handle(b"w2", _follower("w2"))
    assert not out.redirected


def test_the_attaching_side_says_where_it_serves_once_its_target_serves(tmp_path: Path) -> None:
    up, endpoint, core, _ = _upstream(tmp_path)
    up.serves = NODE1
    core.leases.targets_started(0)  # the target loads: HELLOs of its node would wait, so nothing is said yet
    up.pump(core)
    assert not [msg for msg in endpoint.sent if isinstance(msg, m.Serving)]
    core.leases.targets_started(1)
    up.pump(core)
    up.pump(core)
    assert [msg for msg in endpoint.sent if isinstance(msg, m.Serving)] == [m.Serving(address=NODE1)]
    assert up.announced and isinstance(endpoint, FakeEndpoint)
