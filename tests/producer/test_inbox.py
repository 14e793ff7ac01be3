"""The producer's inbox: every waiting message handled per loop turn, and a failed send named for its cause."""

from __future__ import annotations

from collections import deque

from dflash_pipe.producer.build import gone_reason
from dflash_pipe.producer.proc import drain
from dflash_pipe.telemetry import RateMeter
from dflash_pipe.wire.errors import PeerGoneError, SendTimeoutError


def test_drain_handles_everything_waiting_and_waits_only_once():
    waiting = deque((b"w%d" % (i % 3), i) for i in range(10))
    waits: list[float] = []
    handled: list[int] = []

    def recv(timeout_s: float):
        waits.append(timeout_s)
        return waiting.popleft() if waiting else None

    assert drain(recv, lambda _peer, msg: handled.append(msg), limit=100, wait_s=0.02) == 10
    assert handled == list(range(10))  # in arrival order
    assert waits[0] == 0.02 and set(waits[1:]) == {0.0}


def test_drain_stops_at_the_limit_and_leaves_the_rest_queued():
    waiting = deque((b"w", i) for i in range(10))
    handled: list[int] = []
    recv = lambda _t: waiting.popleft() if waiting else None  # noqa: E731
    assert drain(recv, lambda _p, msg: handled.append(msg), limit=4) == 4
    assert handled == [0, 1, 2, 3] and len(waiting) == 6
    assert drain(lambda _t: None, lambda *_: None, limit=4) == 0


def test_a_failed_send_says_whether_the_worker_hung_or_hung_up():
    hung = gone_reason(SendTimeoutError(b"w", "queue full"), 10.0)
    assert hung.startswith("stopped reading") and "10 s" in hung
    closed = gone_reason(PeerGoneError(b"w", "no connection"), 10.0)
    assert closed.startswith("disconnected")


class MeterAt(RateMeter):
    """A RateMeter read at a fixed ``now``: the rates below do not drift while a loaded machine pauses."""

    def __init__(self, now: float) -> None:
        super().__init__()
        self.now = now

    def rate(self, now: float | None = None) -> float:
        return super().rate(self.now if now is None else now)

    def span(self, now: float | None = None) -> float:
        return super().span(self.now if now is None else now)


def test_stage_rates_wait_until_a_meter_spans_a_second():
    from types import SimpleNamespace

    from dflash_pipe.producer.display import MIN_RATE_SPAN_S, stage_rates

    now = 1000.0
    fresh, steady = MeterAt(now), MeterAt(now)
    fresh.add(500, now=now - 0.002)
    fresh.add(500, now=now - 0.001)  # two first ACKs: 1000 tokens over a millisecond or two
    for i in range(5):
        steady.add(100, now=now - 2.0 + i * 0.5)
    producer = SimpleNamespace(train_rate=fresh, target_rate=steady, wire_rate=steady)
    rates = stage_rates(producer)
    assert set(rates) == {"tokens_per_s/producer", "tokens_per_s/wire"}
    assert rates["tokens_per_s/producer"] == 400 / 2.0
    assert MIN_RATE_SPAN_S >= 0.5
