"""The worker's IO thread: a failed heartbeat send marks the link lost (never a silently dead thread)."""

from __future__ import annotations

import pytest

from dflash_pipe.wire import messages as m
from dflash_pipe.wire.errors import SendTimeoutError
from dflash_pipe.worker.link import ProducerLink, ProducerLostError


def test_a_heartbeat_that_cannot_be_sent_loses_the_link():
    lost: list[str] = []
    # Nobody listens there: zmq connects lazily, so only the send below fails.
    link = ProducerLink("tcp://127.0.0.1:9", heartbeat_s=0.05, on_lost=lost.append)
    real_send = link._endpoint.send

    def send(msg, **kw):
        if isinstance(msg, m.Heartbeat):
            raise SendTimeoutError(None, "its queue stayed full")
        return real_send(msg, **kw)

    link._endpoint.send = send  # type: ignore[method-assign]
    try:
        with pytest.raises(ProducerLostError, match="queue stayed full"):
            for _ in range(50):
                link.get(timeout_s=0.1)
        assert lost and "queue stayed full" in lost[0]
    finally:
        link.close()
