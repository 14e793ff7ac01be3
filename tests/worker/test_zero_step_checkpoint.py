"""A worker writes no checkpoint at step 0: untrained weights are not a checkpoint (a resume of such a run
would be called complete, and its export would hand out the untrained drafter)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.loop import checkpoint


def _session(tmp_path: Path, step: int) -> SimpleNamespace:
    model = torch.nn.Linear(2, 2)
    sent: list = []
    return SimpleNamespace(
        saved_step=None,
        step=step,
        rank=0,
        run_dir=tmp_path,
        model=model,
        drafter_config={},
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ledger=Ledger(2, 1),
        group=SimpleNamespace(world_size=1),
        link=SimpleNamespace(send=sent.append, sent=sent),
    )


def test_no_checkpoint_at_step_0_but_at_step_1(tmp_path: Path) -> None:
    s = _session(tmp_path, step=0)
    assert checkpoint(s) is None
    assert s.saved_step == 0 and s.link.sent == [] and latest_checkpoint(tmp_path) is None
    s.step = 1
    path = checkpoint(s)
    assert path is not None and read_trainer_state(latest_checkpoint(tmp_path)).step == 1
    assert [type(msg) for msg in s.link.sent] == [m.Checkpoint]
