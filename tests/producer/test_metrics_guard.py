"""A worker's METRICS message can never take the producer down."""

from dflash_pipe.producer.proc import _checked_metrics


def test_malformed_metrics_are_dropped_and_named():
    good, bad = _checked_metrics({"loss": 1.5, "acc": [0.1, 0.2], "lr": [1.0], "tau": "x", "steps": True})
    assert good == {"loss": 1.5, "acc": [0.1, 0.2]}
    assert sorted(bad) == ["lr", "steps", "tau"]
