import pytest

from dflash_pipe.run.ledger import Ledger


def test_marks_counts_duplicates_and_progress():
    ledger = Ledger(10, epochs=2)
    ledger.mark(0, range(10))
    ledger.mark(1, [0, 1])
    ledger.mark(1, [1])
    assert ledger.complete(0) and not ledger.complete(1)
    assert ledger.duplicates == 1
    assert ledger.current_epoch() == 1
    assert ledger.progress() == pytest.approx(12 / 20)
    assert ledger.trained(1) == {0, 1}


def test_round_trip_is_exact_and_compact():
    ledger = Ledger(100_003, epochs=3)
    ledger.mark(0, range(0, 100_003, 7))
    ledger.mark(2, [5])
    data = Ledger.from_dict(ledger.to_dict())
    assert data.trained(0) == ledger.trained(0) and data.trained(2) == {5} and data.count(1) == 0
    assert len(ledger.to_dict()["bitmaps"]["0"]) < 20_000  # ~12.5 KB of bits, base64


def test_rejects_out_of_range():
    ledger = Ledger(4, epochs=1)
    with pytest.raises(ValueError, match="sample id"):
        ledger.mark(0, [4])
    with pytest.raises(ValueError, match="epoch"):
        ledger.mark(1, [0])


def test_with_epochs_trains_on_and_never_drops_trained_samples():
    ledger = Ledger(4, epochs=1)
    ledger.mark(0, range(4))
    ledger.mark(0, [2])
    longer = Ledger.from_dict(ledger.to_dict()).with_epochs(3)
    assert longer.epochs == 3 and longer.current_epoch() == 1 and longer.duplicates == 1
    assert longer.progress() == pytest.approx(4 / 12)
    longer.mark(2, [0])  # the new epochs take samples
    assert longer.with_epochs(3).trained(2) == {0}
    with pytest.raises(ValueError, match="already trained 1 sample\\(s\\) of epoch 3; give 3 or more"):
        longer.with_epochs(2)
    assert Ledger(4, 3).with_epochs(1).epochs == 1  # nothing trained in the dropped epochs
