"""Checks every payload ring must pass (shared memory and CUDA IPC alike)."""

from __future__ import annotations

import threading

import pytest


class WatchedCondition(threading.Condition):
    """The ring's condition, which says when a thread starts waiting on it (so a test knows an
    ``acquire`` is blocked, without sleeping and hoping)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def check_back_pressure(ring) -> None:
    """With every slot leased, ``acquire`` waits (never overwrites) until one is released; a duplicate
    release never frees the slot again."""
    slots = [ring.acquire(1000) for _ in range(ring.slots)]
    assert sorted(s.slot_id for s in slots) == list(range(ring.slots)) and ring.leased == ring.slots
    assert all(s.buffer.device == ring.device for s in slots)
    with pytest.raises(TimeoutError, match="stayed leased"):
        ring.acquire(1000, timeout_s=0.05)
    ring._cond = cond = WatchedCondition()  # nobody holds the old one now
    events: list[str] = []
    got = []

    def wait_for_a_slot() -> None:
        try:
            got.append(ring.acquire(1000, timeout_s=30))
            events.append("acquired")
        finally:
            cond.waiting.set()  # wakes the test at once also when acquire did not wait

    waiter = threading.Thread(target=wait_for_a_slot)
    waiter.start()
    assert cond.waiting.wait(30), "acquire never waited on the ring's condition"
    assert not got, "acquire handed out a slot while every slot was leased (an overwrite)"
    assert waiter.is_alive()  # blocked in acquire until a release
    events.append("released")
    slots[-1].release()
    waiter.join(30)
    assert events == ["released", "acquired"]  # the slot came only after the release
    assert got and got[0].slot_id == slots[-1].slot_id
    slots[-1].release()  # a duplicate release is a no-op, never frees the re-leased slot
    assert ring.leased == ring.slots
