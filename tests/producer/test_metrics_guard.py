"""A worker's METRICS message can never take the producer down."""

from dflash_pipe.producer.display import checked_metrics


def test_malformed_metrics_are_dropped_and_named():
    good, bad = checked_metrics({"loss": 1.5, "acc": [0.1, 0.2], "lr": [1.0], "tau": "x", "steps": True})
    assert good == {"loss": 1.5, "acc": [0.1, 0.2]}
    assert sorted(bad) == ["lr", "steps", "tau"]


def test_the_acceptance_lists_pass_as_lists():
    values = {
        "simulated/tau": 1.9,
        "simulated/acceptance_per_slot": [0.5, 0.2],
        "real/tau": 1.5,
        "real/acceptance_per_position": [0.4, 0.1],
        "real/lossless_mismatches": 0,
    }
    good, bad = checked_metrics(values)
    assert good == values and bad == []
    assert checked_metrics({"real/tau": [1.5]})[1] == ["real/tau"]
