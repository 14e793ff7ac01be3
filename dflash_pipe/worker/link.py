"""The worker's side of the wire: one IO thread owns the DEALER socket and talks through queues.

The training thread never touches the socket, so heartbeats keep flowing while it compiles or computes,
and a silent producer is noticed even while the training thread is blocked in a collective.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.wire import messages as m
from dflash_pipe.wire.auth import AuthError
from dflash_pipe.wire.cuda_ipc import CudaIpcOffer, CudaIpcRing
from dflash_pipe.wire.errors import TransportError
from dflash_pipe.wire.ring import RingUnavailable, SlotRing
from dflash_pipe.wire.shm import RingOffer, ShmRing
from dflash_pipe.wire.transport import WorkerEndpoint


class ProducerLostError(RuntimeError):
    """The producer stopped answering (crashed, killed, or the network went away)."""


class ProducerLink:
    def __init__(
        self,
        address: str,
        *,
        heartbeat_s: float = 2.0,
        peer_timeout_s: float = 120.0,
        on_lost: Callable[[str], None] | None = None,
        keys: Path | None = None,
    ) -> None:
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._on_lost = on_lost
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._outbox: queue.Queue[tuple[Any, threading.Event | None]] = queue.Queue()
        self._stop = threading.Event()
        self.lost_reason: str | None = None
        self.refused: str | None = None
        """The producer refused this worker's CURVE handshake (its keys): retrying cannot help."""
        self._endpoint = WorkerEndpoint(address, keys=keys)
        self._thread = threading.Thread(target=self._run, name="producer-link", daemon=True)
        self._thread.start()

    def map_ring(self, welcome: m.Welcome, device: torch.device) -> SlotRing | None:
        """Opens the first ring WELCOME offered that this process can share, the CUDA IPC ring (GPU memory)
        before the shared-memory one (pinned when ``device`` is CUDA), so BATCH headers may name its slots;
        None if none was offered or none opens (the producer then sends frames). Prints one line saying why
        a ring could not be opened. Call before the first READY, which tells the producer
        (``ready_paths``); close the ring after the link."""
        cuda = device.type == "cuda"
        if cuda:  # multi-frame tensors land in pinned memory, so their host-to-device copy is async
            self._endpoint.alloc = _pinned
        ring: SlotRing | None = None
        if welcome.cuda_ring:
            try:
                ring = CudaIpcRing.attach(CudaIpcOffer.from_dict(welcome.cuda_ring))
            except (RingUnavailable, ValueError) as exc:
                fallback = "through shared memory" if welcome.ring else "as frames"
                print(
                    f"dflash-pipe worker: cannot open the producer's CUDA IPC ring ({exc}); payloads come "
                    f"{fallback}",
                    file=sys.stderr,
                    flush=True,
                )
        if ring is None and welcome.ring:
            try:
                ring = ShmRing.attach(RingOffer.from_dict(welcome.ring), pin=cuda)
            except (RingUnavailable, ValueError) as exc:
                print(f"dflash-pipe worker: payloads come as frames: {exc}", file=sys.stderr, flush=True)
        self._endpoint.ring = ring  # read by the IO thread on its next receive
        return ring

    def send(self, msg: Any) -> None:
        self._outbox.put((msg, None))

    def send_and_flush(self, msg: Any, timeout_s: float = 5.0) -> bool:
        done = threading.Event()
        self._outbox.put((msg, done))
        return done.wait(timeout_s)

    def get(self, timeout_s: float) -> Any | None:
        """Next message from the producer (heartbeats are handled here), or None after the timeout."""
        try:
            msg = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            msg = None
        if self.lost_reason is not None and msg is None:
            raise ProducerLostError(self.lost_reason)
        return msg

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._endpoint.close()

    def _run(self) -> None:
        last_heard = last_sent = time.monotonic()
        while not self._stop.is_set():
            while True:
                try:
                    msg, done = self._outbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._endpoint.send(msg)
                except TransportError as exc:  # refused CURVE keys, or a producer that stopped reading
                    self._lose(str(exc), refused=isinstance(exc, AuthError))
                    return
                finally:
                    if done is not None:
                        done.set()
                last_sent = time.monotonic()
            try:
                msg = self._endpoint.recv(timeout_s=0.02)
            except TransportError as exc:  # e.g. the producer refused this worker's CURVE key
                self._lose(str(exc), refused=isinstance(exc, AuthError))
                return
            except Exception as exc:  # a malformed message from the producer is fatal for this link
                self._lose(f"undecodable message from the producer at {self.address}: {exc}")
                return
            now = time.monotonic()
            if msg is not None:
                last_heard = now
                if not isinstance(msg, m.Heartbeat):
                    self._inbox.put(msg)
            if now - last_sent >= self.heartbeat_s:
                try:
                    self._endpoint.send(m.Heartbeat(time=time.time()))
                except TransportError as exc:  # as for any send: the link is lost, never a silent dead thread
                    self._lose(str(exc))
                    return
                last_sent = now
            if now - last_heard > self.peer_timeout_s:
                self._lose(
                    f"the producer at {self.address} has been silent for {now - last_heard:.0f} s "
                    f"(timeout {self.peer_timeout_s:.0f} s); it probably died"
                )
                return

    def _lose(self, reason: str, *, refused: bool = False) -> None:
        if refused:
            self.refused = reason
        self.lost_reason = reason
        self._inbox.put(None)
        if self._on_lost is not None:
            self._on_lost(reason)
        else:
            print(f"dflash-pipe worker: {reason}", file=sys.stderr)


def ready_paths(ring: SlotRing | None) -> dict[str, bool]:
    """The first READY's ``shm`` / ``cuda_ipc`` flags for the ring ``map_ring`` opened."""
    return {"shm": isinstance(ring, ShmRing), "cuda_ipc": isinstance(ring, CudaIpcRing)}


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
