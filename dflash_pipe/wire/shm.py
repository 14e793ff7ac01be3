"""Same-host payloads through shared memory: a ring of fixed-size slots in one anonymous segment.

The producer creates the ring (``ShmRing.create``) and uses it as its ``PayloadStaging``: the target thread
acquires a slot, the device-to-host copy writes the features into it, and the BATCH header names the slot
and offsets instead of carrying the bytes (``codec.encode(..., ring=)``). A worker on the same host maps the
same segment (``ShmRing.attach``) and reads the tensors straight from it; the slot is freed when the batch
is ACKed (the scheduler's release-on-ACK), and a lost worker's batches keep their slots until the copy
redelivered to another worker is ACKed.

- Never overwritten while leased: ``acquire`` blocks while every slot is leased (back-pressure).
- No leaks on any exit path, SIGKILL included: the segment is a ``memfd`` (no name in /dev/shm or anywhere
  in the file system), freed by the kernel when the last process holding it (an fd or a mapping) exits.
- Sharing: a worker opens ``/proc/<producer pid>/fd/<fd>``, which Linux allows only to a process that may
  ptrace-read the producer (the same user, in the same pid namespace); a random token written in the
  segment's first page and sent in WELCOME proves it mapped the right one (not a recycled pid's fd).
- With CUDA, each side registers its mapping as pinned memory (``cudaHostRegister``), so device-to-host
  copies land in the slot and host-to-device copies read from it at full speed, asynchronously.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipe.wire.ring import RingUnavailable, SlotRing, round_up

log = logging.getLogger("dflash_pipe.wire.shm")

_MAGIC = b"DFPRING1"
_HEADER_BYTES = 4096  # first page: magic + token; slots start page-aligned after it
_TOKEN_BYTES = 16
_PAGE = 4096
_OFFER_KEYS = frozenset({"pid", "fd", "slots", "slot_bytes", "token"})
# Fault every page in at map time: a slot touched for the first time costs a page fault per 4 KiB, which
# made the ring slower than plain pyzmq on 2 cores (each slot of a fresh ring is first-touch).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


NODE_ENV = "DFLASH_PIPE_NODE"
"""Set, it joins the host identity: processes of one machine with different values act as separate nodes
(no ring between them, features counted as crossing the network), as the multi-node tests simulate."""


def host_identity(*, simulated: bool = True) -> str:
    """Two processes that may share a memfd through /proc report the same string: hostname, boot id and
    pid namespace (workers in another container on the same machine differ), and ``$DFLASH_PIPE_NODE``
    (``simulated`` False leaves it out: the machine and pid namespace themselves)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # not Linux: never same-host
    node = os.environ.get(NODE_ENV, "") if simulated else ""
    return f"{socket.gethostname()}/{boot}/{pidns}" + (f"/{node}" if node else "")


def shm_supported() -> bool:
    return hasattr(os, "memfd_create") and host_identity() != ""


@dataclass(frozen=True, slots=True)
class RingOffer:
    """What WELCOME tells a same-host worker so it can map the ring (sent as a plain msgpack map)."""

    pid: int
    fd: int
    slots: int
    slot_bytes: int
    token: str  # hex

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "fd": self.fd,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "token": self.token,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RingOffer:
        if data.keys() != _OFFER_KEYS:
            raise ValueError(f"ring offer must have keys {sorted(_OFFER_KEYS)}, got {sorted(data)}")
        ints = {k: data[k] for k in ("pid", "fd", "slots", "slot_bytes")}
        if not all(type(v) is int and v >= 0 for v in ints.values()) or data["slots"] < 1:
            raise ValueError(f"ring offer fields pid/fd/slots/slot_bytes must be non-negative ints: {ints}")
        if not isinstance(data["token"], str) or len(data["token"]) != 2 * _TOKEN_BYTES:
            raise ValueError("ring offer token must be a hex string of 16 bytes")
        return cls(**data)


class ShmRing(SlotRing):
    """A ring of ``slots`` slots of ``slot_bytes`` each; a ``PayloadStaging`` on the producer, a read-only
    view source (``codec.SharedRing``) on both sides. Use ``create`` or ``attach``."""

    PATH = "shm"

    def __init__(
        self, fd: int, mm: mmap.mmap, slots: int, slot_bytes: int, token: bytes, *, owner: bool, pin: bool
    ):
        self.token = token
        self._fd = fd  # producer: kept open so workers can open /proc/<pid>/fd/<fd>; worker: -1
        self._mm = mm
        self._all = torch.frombuffer(mm, dtype=torch.uint8)  # [header + slots * slot_bytes]
        self._init_slots(self._all[_HEADER_BYTES:], slots, slot_bytes, owner=owner)
        self.pinned = False
        if pin:
            self._pin()

    # --- construction ------------------------------------------------------------------------------------

    @classmethod
    def create(cls, slots: int, slot_bytes: int, *, pin: bool | None = None) -> ShmRing:
        """A new anonymous segment (memfd) for ``slots`` slots of at least ``slot_bytes`` (page-rounded)."""
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots >= 1 and slot_bytes >= 1, got {slots} x {slot_bytes}")
        if not hasattr(os, "memfd_create"):
            raise RingUnavailable("os.memfd_create is not available on this system (Linux only)")
        slot_bytes = round_up(slot_bytes, _PAGE)
        size = _HEADER_BYTES + slots * slot_bytes
        fd = os.memfd_create("dflash-pipe-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(_TOKEN_BYTES)
        mm[: len(_MAGIC) + _TOKEN_BYTES] = _MAGIC + token
        return cls(fd, mm, slots, slot_bytes, token, owner=True, pin=_want_pin(pin))

    @classmethod
    def attach(cls, offer: RingOffer, *, pin: bool | None = None) -> ShmRing:
        """Maps the producer's ring; raises ``RingUnavailable`` (use frames instead) if it cannot."""
        path = f"/proc/{offer.pid}/fd/{offer.fd}"
        size = _HEADER_BYTES + offer.slots * offer.slot_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise RingUnavailable(f"cannot open the producer's ring at {path}: {e}") from None
        try:
            if os.fstat(fd).st_size != size:
                raise RingUnavailable(f"{path} is {os.fstat(fd).st_size} bytes, the offer says {size}")
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise RingUnavailable(f"cannot map the producer's ring at {path}: {e}") from None
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        if mm[: len(_MAGIC) + _TOKEN_BYTES] != _MAGIC + bytes.fromhex(offer.token):
            mm.close()
            raise RingUnavailable(f"{path} is not this run's ring (token mismatch: a recycled pid?)")
        return cls(
            -1, mm, offer.slots, offer.slot_bytes, bytes.fromhex(offer.token), owner=False, pin=_want_pin(pin)
        )

    def offer(self) -> RingOffer:
        if not self.owner:
            raise RuntimeError("only the producer's ring can be offered")
        return RingOffer(
            pid=os.getpid(), fd=self._fd, slots=self.slots, slot_bytes=self.slot_bytes, token=self.token.hex()
        )

    def _private(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    # --- lifetime ----------------------------------------------------------------------------------------

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._all.data_ptr(), self._all.numel(), 0)
        if int(err) != 0:
            log.warning(
                "cudaHostRegister of the %d-byte ring failed (%s); copies use pageable memory",
                self._all.numel(),
                err,
            )
            return
        self.pinned = True

    def close(self) -> None:
        """Unpins and unmaps; the producer also closes the fd. Safe to call twice. The kernel frees the
        segment once no process maps it, whatever way the processes end."""
        if not self._close_slots():
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._all.data_ptr())
            self.pinned = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._data = self._all = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a tensor still views the mapping: unmapped when it goes
            self._mm.close()


def _want_pin(pin: bool | None) -> bool:
    return torch.cuda.is_available() if pin is None else pin
