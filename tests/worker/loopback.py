"""A producer's side of the real wire, in process, for tests that drive the worker's training loop: a
``ProducerEndpoint`` on ipc:// and a real ``ProducerLink`` to it (the worker's IO thread, heartbeats,
msgpack frames), so nothing on the worker's side of the wire is a stand-in."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

from dflash_pipe.wire import ProducerEndpoint
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.errors import PeerGoneError
from dflash_pipe.worker.link import ProducerLink

_END = -1.0
"""The time of the heartbeat ``finish`` sends: once the producer has it, it has everything sent before."""


class LoopbackProducer:
    """Sends the ``offer``ed batches when the worker says READY, heartbeats like a producer, records every
    message, and sends DONE once every batch is acked. ``link`` is the worker's end."""

    def __init__(self, heartbeat_s: float = 0.5) -> None:
        self._dir = tempfile.mkdtemp(prefix="dfl")  # short: ipc paths are limited to ~107 bytes
        self.endpoint = ProducerEndpoint(f"ipc://{self._dir}/p.sock")
        self.link = ProducerLink(self.endpoint.address)
        self.heartbeat_s = heartbeat_s
        self.received: list[object] = []
        self.acked: list[int] = []
        self._lock = threading.Lock()
        self._batches: list[m.Batch] = []
        self._expected = 0
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopback-producer", daemon=True)
        self._thread.start()

    def offer(self, batches: list[m.Batch], timeout_s: float = 60.0) -> None:
        """The worker's batches: sent on its READY (sent here, as a worker does after its WELCOME), and
        returns once all of them are in the link's inbox. A step trains the batches that have arrived (up
        to one per replica), so on a loaded machine batches trickling in would make steps of one batch
        where the test means steps of two: waiting makes the steps the same on every run."""
        with self._lock:
            self._batches, self._expected = list(batches), len(batches)
        self.link.send(m.Ready(credits=len(batches)))
        deadline = time.monotonic() + timeout_s
        while self.link._inbox.qsize() < len(batches):  # noqa: SLF001 - the link has no public count
            assert time.monotonic() < deadline, f"{len(batches)} batches not delivered in {timeout_s:.0f} s"
            time.sleep(0.01)

    def losses(self) -> list[float]:
        return [
            msg.values["loss"] for msg in self.received if isinstance(msg, m.Metrics) and "loss" in msg.values
        ]

    def finish(self, timeout_s: float = 30.0) -> None:
        """Waits until every message the worker sent so far has arrived here."""
        assert self.link.send_and_flush(m.Heartbeat(time=_END), timeout_s), "the worker's link never sent"
        assert self._ended.wait(timeout_s), "the producer never got the worker's last messages"

    def close(self) -> None:
        # the serving thread first: it beats the worker's link, and a beat after the link closed raised
        # PeerGoneError in the thread (seen once in a full suite)
        self._stop.set()
        self._thread.join(10)
        self.link.close()
        self.endpoint.close(linger_s=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        peer, done_sent, last_beat = None, False, time.monotonic()
        while not self._stop.is_set():
            got = self.endpoint.recv(0.02)
            if peer is not None and time.monotonic() - last_beat >= self.heartbeat_s:
                try:
                    self.endpoint.send(peer, m.Heartbeat(time=time.time()))
                except PeerGoneError:  # the worker left: as a producer does, stop beating it
                    peer = None
                last_beat = time.monotonic()
            if got is None:
                continue
            peer, msg = got
            self.received.append(msg)
            if isinstance(msg, m.Heartbeat) and msg.time == _END:
                self._ended.set()
            elif isinstance(msg, m.Ready):
                with self._lock:
                    batches, self._batches = self._batches, []
                for batch in batches:
                    self.endpoint.send(peer, batch)
            elif isinstance(msg, m.Ack):
                self.acked += msg.batch_ids
                if not done_sent and self._expected and len(self.acked) == self._expected:
                    self.endpoint.send(peer, m.Done(reason="all acked"))
                    done_sent = True
