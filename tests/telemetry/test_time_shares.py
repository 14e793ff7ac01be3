"""TimeShares: seconds a condition held and time-weighted means, from injected times."""

import pytest

from dflash_pipe.telemetry import TimeShares


def test_integrates_each_value_over_the_interval_that_follows_it():
    shares = TimeShares()
    assert shares.mean("idle") == 0.0
    shares.observe(10.0, idle=True, depth=4)
    shares.observe(12.0, idle=False, depth=2)  # idle for 2 s at depth 4
    shares.observe(13.0, idle=True, depth=0)  # busy for 1 s at depth 2
    assert shares.elapsed_s == pytest.approx(3.0)
    assert shares.seconds("idle") == pytest.approx(2.0)
    assert shares.mean("idle") == pytest.approx(2 / 3)
    assert shares.mean("depth") == pytest.approx((2 * 4 + 1 * 2) / 3)
    assert shares.seconds("never") == 0.0
    shares.observe(12.5, idle=False)  # a clock running backwards adds nothing
    assert shares.elapsed_s == pytest.approx(3.0)
