"""Checks every payload ring must pass (shared memory and CUDA IPC alike)."""

from __future__ import annotations

import threading
import time

import pytest


def check_back_pressure(ring) -> None:
    """With every slot leased, ``acquire`` waits (never overwrites) until one is released; a duplicate
    release never frees the slot again."""
    slots = [ring.acquire(1000) for _ in range(ring.slots)]
    assert sorted(s.slot_id for s in slots) == list(range(ring.slots)) and ring.leased == ring.slots
    assert all(s.buffer.device == ring.device for s in slots)
    with pytest.raises(TimeoutError, match="stayed leased"):
        ring.acquire(1000, timeout_s=0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(1000, timeout_s=5)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: nothing was overwritten
    slots[-1].release()
    waiter.join(5)
    assert got and got[0].slot_id == slots[-1].slot_id
    slots[-1].release()  # a duplicate release is a no-op, never frees the re-leased slot
    assert ring.leased == ring.slots
