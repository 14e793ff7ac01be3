import json

import pytest
import torch

from dflash_pipe.run import checkpoint as ck
from dflash_pipe.run.ledger import Ledger


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 2).requires_grad_(False)


def make():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.fc(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_weights_optimizer_ledger_and_rng(tmp_path):
    model, opt = make()
    ledger = Ledger(10, 2)
    ledger.mark(0, [1, 2, 3])
    path = ck.save_checkpoint(
        tmp_path,
        step=7,
        model=model,
        drafter_config={"a": 1},
        optimizer=opt,
        ledger=ledger.to_dict(),
        extra={"world_size": 2},
    )
    assert path.name == "step-00000007" and ck.latest_checkpoint(tmp_path) == path
    assert "frozen.weight" not in json.dumps(list(ck.trainable_state(model)))
    expected_rand = torch.rand(3)
    fresh, fresh_opt = Tiny(), None
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    state = ck.load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.fc.weight, model.fc.weight)
    assert torch.equal(torch.rand(3), expected_rand)  # RNG restored to the moment of saving
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert state.step == 7 and Ledger.from_dict(state.ledger).trained(0) == {1, 2, 3}
    assert state.extra == {"world_size": 2}


def test_a_failed_save_leaves_the_previous_latest_intact(tmp_path, monkeypatch):
    model, opt = make()
    first = ck.save_checkpoint(tmp_path, step=1, model=model, drafter_config={}, optimizer=opt, ledger={})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "_rng_state", disk_full)
    with pytest.raises(OSError, match="no space left for checkpoint step-00000002"):
        ck.save_checkpoint(tmp_path, step=2, model=model, drafter_config={}, optimizer=opt, ledger={})
    assert ck.latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001"]


def test_keeps_only_the_last_checkpoints(tmp_path):
    model, opt = make()
    for step in range(1, 6):
        ck.save_checkpoint(
            tmp_path, step=step, model=model, drafter_config={}, optimizer=opt, ledger={}, keep_last=2
        )
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000004", "step-00000005"]


def test_a_dangling_latest_pointer_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-00000009\n")
    with pytest.raises(FileNotFoundError, match="step-00000009"):
        ck.latest_checkpoint(tmp_path)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = make()
    path = ck.save_checkpoint(tmp_path, step=1, model=model, drafter_config={}, optimizer=opt, ledger={})

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 3)

    with pytest.raises(ValueError, match="does not fit"):
        ck.load_checkpoint(path, model=Other(), optimizer=None)


def test_the_manifest_records_every_file_as_written(tmp_path):
    import hashlib

    model, opt = make()
    path = ck.save_checkpoint(tmp_path, step=3, model=model, drafter_config={}, optimizer=opt, ledger={})
    manifest = json.loads((path / ck.MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != ck.MANIFEST)
    assert sorted(manifest) == on_disk and set(ck.REQUIRED_FILES) <= set(manifest)
    for name, entry in manifest.items():
        data = (path / name).read_bytes()
        assert len(data) < ck.CHUNK_BYTES  # one piece each: the file's plain sha256 (sha256sum)
        assert entry == {
            "bytes": len(data),
            "chunk_bytes": ck.CHUNK_BYTES,
            "sha256": [hashlib.sha256(data).hexdigest()],
        }
    weights = (path / ck.DRAFTER_WEIGHTS).read_bytes()  # in pieces, on threads, as a big file is hashed
    pieces = [hashlib.sha256(weights[i : i + 16]).hexdigest() for i in range(0, len(weights), 16)]
    assert len(pieces) > 8 and ck.file_digests(path / ck.DRAFTER_WEIGHTS, chunk_bytes=16) == pieces
    assert ck.verify_checkpoint(path) is None
    (path / ck.OPTIMIZER).write_bytes((path / ck.OPTIMIZER).read_bytes() + b"x")
    assert "optimizer.pt has" in ck.verify_checkpoint(path)
    assert ck.verify_checkpoint(path, files=(ck.DRAFTER_WEIGHTS, ck.DRAFTER_CONFIG)) is None  # export's
    assert "does not exist" in ck.verify_checkpoint(tmp_path / "nope")


def test_a_held_checkpoint_outlives_pruning_until_released(tmp_path):
    """``export`` of a running run holds the checkpoint it reads: the run's pruning keeps it meanwhile (the
    CI flake this fixes: the latest pruned between export's lookup and its read), drops it after, and a
    hold left by a dead reader stops counting after ``HOLD_TTL_S``."""
    import os
    import time

    from dflash_pipe.run.locate import held_checkpoint

    model, opt = make()

    def save(step):
        return ck.save_checkpoint(
            tmp_path, step=step, model=model, drafter_config={}, optimizer=opt, ledger={}, keep_last=1
        )

    save(1)
    with held_checkpoint(tmp_path) as held:
        assert held.name == "step-00000001"
        save(2)
        save(3)
        assert held.is_dir()  # kept while held; step 2 was not held and is gone
        assert sorted(p.name for p in (tmp_path / ck.CHECKPOINTS_DIR).glob("step-*")) == [
            held.name,
            "step-00000003",
        ]
    save(4)
    assert not held.exists()
    stale = tmp_path / ck.CHECKPOINTS_DIR / f"{ck.HOLD_PREFIX}step-00000004-1"
    stale.touch()
    old = time.time() - ck.HOLD_TTL_S - 1
    os.utime(stale, (old, old))
    save(5)
    assert not (tmp_path / ck.CHECKPOINTS_DIR / "step-00000004").exists()
