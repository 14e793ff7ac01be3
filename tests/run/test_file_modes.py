"""Checkpoint files have the mode the process umask says (safetensors alone creates 0600): a serving
container running as another user can read them under umask 022."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from dflash_pipe.run import checkpoint as ck
from dflash_pipe.run.manifest import chmod_from_umask, current_umask


@pytest.fixture(params=[0o022, 0o027, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def _save(run_dir):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ck.save_checkpoint(run_dir, step=1, model=model, drafter_config={}, optimizer=opt, ledger={})


def test_checkpoint_files_have_the_mode_the_umask_says(tmp_path, umask) -> None:
    path = _save(tmp_path)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert set(modes) == {*ck.REQUIRED_FILES, ck.MANIFEST}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes  # drafter.safetensors too, not 0600
    assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask
    assert ck.verify_checkpoint(path) is None


def test_the_umask_is_read_without_changing_it(tmp_path, umask) -> None:
    assert current_umask() == umask
    assert os.umask(umask) == umask  # unchanged by the read
    f = tmp_path / "f"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    chmod_from_umask(f)
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask
