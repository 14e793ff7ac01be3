"""RateMeter with injected times (TimeShares: test_time_shares.py)."""

import pytest

from dflash_pipe.telemetry import RateMeter


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
