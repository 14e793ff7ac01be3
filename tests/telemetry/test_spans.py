"""span timer, SpanStats arithmetic and thread safety, RateMeter with injected times."""

import threading
import time

import pytest

from dflash_pipe.telemetry import RateMeter, SpanStats, span


def test_span_stats_arithmetic():
    stats = SpanStats()
    for s in (0.5, 1.5, 1.0):
        stats.add("step", s)
    stats.add("recv", 0.25)
    snap = stats.snapshot()
    assert snap["step"].count == 3
    assert snap["step"].total_s == pytest.approx(3.0)
    assert snap["step"].mean_s == pytest.approx(1.0)
    assert snap["step"].last_s == pytest.approx(1.0)
    assert snap["recv"].count == 1 and snap["recv"].mean_s == pytest.approx(0.25)
    stats.add("step", 2.0)
    assert snap["step"].count == 3  # snapshot is a copy
    old = stats.reset()
    assert old["step"].count == 4 and old["step"].total_s == pytest.approx(5.0)
    assert stats.snapshot() == {}


def test_span_times_block_calls_sync_and_records():
    stats = SpanStats()
    calls = []
    with span("sleep", stats, sync=lambda: calls.append(time.perf_counter())) as t:
        time.sleep(0.02)
    assert len(calls) == 2
    assert 0.015 <= t.elapsed_s < 1.0
    snap = stats.snapshot()["sleep"]
    assert snap.count == 1 and snap.last_s == t.elapsed_s


def test_span_without_sink_and_failing_block_not_recorded():
    with span("plain") as t:
        pass
    assert t.elapsed_s is not None and t.elapsed_s >= 0
    stats = SpanStats()
    syncs = []
    with pytest.raises(RuntimeError), span("bad", stats, sync=lambda: syncs.append(1)) as t2:
        raise RuntimeError("boom")
    assert stats.snapshot() == {}
    assert syncs == [1]  # synced at start only
    assert t2.elapsed_s is not None


def test_span_stats_thread_safe():
    stats = SpanStats()

    def work():
        for _ in range(2000):
            stats.add("x", 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    snap = stats.snapshot()["x"]
    assert snap.count == 8000
    assert snap.total_s == pytest.approx(8.0)


def test_rate_meter_steady_rate():
    meter = RateMeter(window_s=10)
    for t in range(0, 21):  # 100 tokens every second
        meter.add(100, now=float(t))
    assert meter.rate(now=20.0) == pytest.approx(100.0)
    assert meter.total == 2100


def test_rate_meter_window_forgets_old_bursts_and_stalls_decay():
    meter = RateMeter(window_s=10)
    meter.add(0, now=0.0)
    meter.add(10_000, now=1.0)  # early burst
    for t in range(2, 31):
        meter.add(50, now=float(t))
    assert meter.rate(now=30.0) == pytest.approx(50.0)  # burst left the window
    # stall: no events after t=30; rate falls, then goes to 0 once nothing new is in the window
    assert meter.rate(now=35.0) == pytest.approx(50 * 5 / 10)  # ref event t=25, 5 events after it
    assert meter.rate(now=45.0) == 0.0


def test_rate_meter_edge_cases():
    meter = RateMeter(window_s=5)
    assert meter.rate(now=0.0) == 0.0
    meter.add(100, now=1.0)
    assert meter.rate(now=2.0) == 0.0  # one event: no interval yet
    meter.add(100, now=3.0)
    assert meter.rate(now=3.0) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="window_s"):
        RateMeter(window_s=0)


def test_rate_meter_span_says_how_long_the_rate_is_measured_over():
    meter = RateMeter(window_s=10)
    assert meter.span(now=0.0) == 0.0
    meter.add(500, now=1.0)
    meter.add(500, now=1.001)  # two workers' first ACKs, a millisecond apart
    assert meter.span(now=1.001) == pytest.approx(0.001)
    assert meter.rate(now=1.001) == pytest.approx(500_000.0)  # why callers check span() first
    for t in range(2, 30):
        meter.add(100, now=float(t))
    assert meter.span(now=29.0) == pytest.approx(10.0)  # the window, once it is full
