"""bench/batch_balance.py: the lockstep balance of a batch plan, against hand-computed values."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.bench.helpers import ROOT

_spec = importlib.util.spec_from_file_location("batch_balance", ROOT / "bench" / "batch_balance.py")
batch_balance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(batch_balance)


def test_each_step_lasts_as_long_as_its_slowest_batch():
    costs = np.array([1.0, 3.0, 2.0, 2.0, 5.0])  # steps (1, 3) and (2, 2); the last batch fills no step
    assert batch_balance.lockstep_balance(costs, 2) == pytest.approx(2.0 / 2.5)
    assert batch_balance.lockstep_balance(costs, 1) == 1.0
    with pytest.raises(ValueError, match="cannot fill one step"):
        batch_balance.lockstep_balance(costs, 6)


def test_rows_cost_batches_by_tokens_and_by_squared_lengths():
    lengths = np.array([4, 4, 2, 6])
    rows = batch_balance.balance_rows(lengths, [[0, 1], [2, 3]], [2])  # tokens 8 and 8; squares 32 and 40
    assert rows == [
        {
            "workers": 2,
            "batches": 2,
            "mean_batch_tokens": 8.0,
            "lockstep_tokens": 1.0,
            "lockstep_squared_lengths": pytest.approx(36 / 40, abs=1e-3),
        }
    ]
