"""What a resume checks before anything starts: the run at the path given, damaged files (each one line naming
the file and the fix), the fallback to an intact checkpoint (nothing deleted), a finished run, --epochs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dflash_pipe.commands.launch_config import build_run_config
from dflash_pipe.run import checkpoint as ck
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.files import RunDirError
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.run.locate import choose_checkpoint, find_checkpoint
from dflash_pipe.run.record import write_record
from dflash_pipe.run.resume import ResumePoint, RunComplete, check_resume

SAMPLES = 4


def make_run(run_dir: Path, steps: tuple[int, ...] = (2, 4), trained: int = 2, epochs: int = 1) -> Path:
    """A run dir as a launch leaves it: config.json and checkpoints (the last with ``trained`` samples)."""
    cfg, _ = build_run_config({"run_dir": run_dir, "device": "cpu", "epochs": epochs})
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).save_config(cfg)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, step in enumerate(steps):
        ledger = Ledger(SAMPLES, epochs)
        ledger.mark(0, range(trained if i == len(steps) - 1 else 1))
        ck.save_checkpoint(
            run_dir, step=step, model=model, drafter_config={"a": 1}, optimizer=opt, ledger=ledger.to_dict()
        )
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def files(run_dir: Path) -> set[str]:
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}


def resumed(run_dir: Path, **flags) -> object:
    cfg, resume = build_run_config({"resume_dir": run_dir, **flags})
    assert resume
    return cfg


def test_the_path_given_is_the_run_wherever_it_was_started(tmp_path: Path):
    original = make_run(tmp_path / "a" / "run")
    moved = tmp_path / "b" / "copy"
    shutil.copytree(original, moved)
    cfg = resumed(moved)
    assert cfg.run_dir == moved  # not the run_dir recorded in its config.json
    assert json.loads((moved / "config.json").read_text())["run_dir"] == str(original)
    assert cfg.data.path.is_absolute()  # saved absolute: resumable from any directory
    with pytest.raises(ValueError, match="--run-dir .* names another directory"):
        build_run_config({"resume_dir": moved, "run_dir": original})


def test_a_config_from_another_version_names_the_file_and_the_version(tmp_path: Path):
    run_dir = make_run(tmp_path / "run")
    data = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**data, "future_knob": 1}))
    (run_dir / "owner.json").write_text(json.dumps({"pid": 1, "version": "9.9.0"}))
    with pytest.raises(RunDirError) as err:
        RunDir(run_dir).load_config()
    message = str(err.value)
    assert f"{run_dir / 'config.json'} does not fit dflash-pipe" in message
    assert "future_knob" in message and "dflash-pipe==9.9.0" in message and "new --run-dir" in message
    (run_dir / "config.json").write_text('{"run_dir": ')
    with pytest.raises(RunDirError, match="config.json cannot be read .*damaged"):
        RunDir(run_dir).load_config()
    with pytest.raises(RunDirError, match="Give the run directory itself"):
        RunDir(run_dir / "checkpoints").load_config()


def test_an_intact_latest_is_resumed_without_a_word(tmp_path: Path):
    run_dir = make_run(tmp_path / "run")
    assert check_resume(resumed(run_dir)).notes == []
    assert choose_checkpoint(run_dir) == (step_dir(run_dir, 4), [])


@pytest.mark.parametrize(
    "damage, expect",
    [
        (lambda d: (d / ck.OPTIMIZER).unlink(), "optimizer.pt is missing"),
        (lambda d: _truncate(d / ck.DRAFTER_WEIGHTS), "drafter.safetensors has .* bytes, its manifest says"),
        (lambda d: _flip_byte(d / ck.RNG), "rng.pt does not match its sha256"),
        (lambda d: (d / ck.MANIFEST).write_text("{"), "manifest.json is unreadable"),
    ],
)
def test_a_damaged_latest_falls_back_to_the_previous_intact_one(tmp_path: Path, damage, expect):
    run_dir = make_run(tmp_path / "run")
    damage(step_dir(run_dir, 4))
    before = files(run_dir)
    notes = check_resume(resumed(run_dir)).notes
    assert len(notes) == 1 and "step-00000002 instead" in notes[0], notes
    assert re.search(expect, notes[0]), notes[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    aside = run_dir / "checkpoints" / "damaged-step-00000004"
    assert aside.is_dir() and "damaged-step-00000004" in notes[0]
    # nothing deleted: the same files, the damaged checkpoint's under its new name
    moved = {f.replace("checkpoints/step-00000004", "checkpoints/damaged-step-00000004") for f in before}
    assert files(run_dir) == moved


def test_a_damaged_latest_without_an_intact_one_is_refused(tmp_path: Path):
    run_dir = make_run(tmp_path / "run", steps=(4,))
    _truncate(step_dir(run_dir, 4) / ck.TRAINER_STATE)
    before = files(run_dir)
    with pytest.raises(RunDirError, match=r"trainer_state.json has .* bytes.*no older intact checkpoint"):
        check_resume(resumed(run_dir))
    assert files(run_dir) == before


def test_a_latest_naming_nothing_says_how_to_point_it(tmp_path: Path):
    run_dir = make_run(tmp_path / "run")
    (run_dir / "checkpoints" / "latest").write_text("step-00000009\n")
    with pytest.raises(RunDirError) as err:
        check_resume(resumed(run_dir))
    message = str(err.value)
    assert "latest names 'step-00000009'" in message
    assert "step-00000002, step-00000004" in message and "echo step-00000004 >" in message
    (run_dir / "checkpoints" / "latest").unlink()  # no pointer at all: the newest intact, said so
    notes = check_resume(resumed(run_dir)).notes
    assert "latest is missing" in notes[0] and "step-00000004" in notes[0]


def test_a_checkpoint_from_before_manifests_is_accepted(tmp_path: Path):
    run_dir = make_run(tmp_path / "run", steps=(4,))
    (step_dir(run_dir, 4) / ck.MANIFEST).unlink()
    assert check_resume(resumed(run_dir)).notes == []
    (step_dir(run_dir, 4) / ck.TRAINER_STATE).write_text("{")
    assert "trainer_state.json is unreadable" in ck.verify_checkpoint(step_dir(run_dir, 4))


def test_metrics_lines_cut_short_are_named(tmp_path: Path):
    run_dir = make_run(tmp_path / "run")
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    notes = check_resume(resumed(run_dir)).notes
    assert len(notes) == 1 and "metrics.jsonl: the last line is cut short (15 bytes" in notes[0]
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo{"step": 3}\n{"step": 4}\n')
    notes = check_resume(resumed(run_dir)).notes
    assert len(notes) == 1 and "metrics.jsonl:2 is not a JSON record" in notes[0]
    assert f"sed -i '2d' {metrics}" in notes[0]


def test_a_finished_run_says_so_and_how_to_train_on(tmp_path: Path):
    run_dir = make_run(tmp_path / "run", trained=SAMPLES)
    with pytest.raises(RunComplete) as err:
        check_resume(resumed(run_dir))
    message = str(err.value)
    assert "is complete: all 1 epoch(s) trained (checkpoint step-00000004, step 4)" in message
    assert f"launch --resume {run_dir} --epochs 2" in message and "export" in message
    assert check_resume(resumed(run_dir, epochs=2)).notes == []  # more epochs train on
    with pytest.raises(RunComplete, match="--epochs 2"):  # more steps alone do not train on
        check_resume(resumed(run_dir, max_steps=20))


def test_max_steps_reached_is_complete(tmp_path: Path):
    run_dir = make_run(tmp_path / "run")
    with pytest.raises(RunComplete, match=r"step 4 reached max_steps 4.*--resume .* --max-steps 8"):
        check_resume(resumed(run_dir, max_steps=4))
    assert check_resume(resumed(run_dir, max_steps=5)).notes == []


def test_a_run_recorded_complete_is_complete_even_with_an_open_ledger(tmp_path: Path):
    """Regenerated conversations with nothing to train never fill the ledger; the launch's record says it."""
    run_dir = make_run(tmp_path / "run")
    write_record(run_dir, complete={"checkpoint": "step-00000004", "epochs": 1})
    with pytest.raises(RunComplete):
        check_resume(resumed(run_dir))
    assert check_resume(resumed(run_dir, epochs=2)).notes == []
    write_record(run_dir, complete={"checkpoint": "step-00000002", "epochs": 1})  # an older checkpoint's
    assert check_resume(resumed(run_dir)).notes == []


def test_fewer_epochs_than_already_trained_are_refused(tmp_path: Path):
    run_dir = make_run(tmp_path / "run", epochs=3)
    ledger = Ledger(SAMPLES, 3)
    ledger.mark(0, range(SAMPLES))
    ledger.mark(1, [0])
    ck.save_checkpoint(
        run_dir,
        step=6,
        model=torch.nn.Linear(1, 1),
        drafter_config={},
        optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0),
        ledger=ledger.to_dict(),
    )
    with pytest.raises(
        RunDirError, match=r"--epochs 1: the checkpoint has already trained 1 sample\(s\) of epoch 2"
    ):
        check_resume(resumed(run_dir, epochs=1))


def test_export_finds_the_checkpoint_from_a_run_its_checkpoints_or_itself(tmp_path: Path):
    run_dir = make_run(tmp_path / "run")
    latest = step_dir(run_dir, 4)
    assert find_checkpoint(run_dir) == latest
    assert find_checkpoint(run_dir / "checkpoints") == latest
    assert find_checkpoint(step_dir(run_dir, 2)) == step_dir(run_dir, 2)
    with pytest.raises(RunDirError, match="is not a checkpoint: give a run dir"):
        find_checkpoint(tmp_path)
    _flip_byte(latest / ck.DRAFTER_WEIGHTS)
    with pytest.raises(
        RunDirError, match=r"cannot export .*drafter.safetensors does not match.*step-00000002"
    ):
        find_checkpoint(run_dir / "checkpoints")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_voids_of_a_regenerated_run_count_as_trained_after_set_up(tmp_path: Path):
    """Conversations regenerated with nothing to train are never in the ledger: the set-up check counts them,
    and the launch that trained every epoch records it for the next resume."""
    from types import SimpleNamespace

    from dflash_pipe.producer.setup import check_open_work
    from dflash_pipe.run.record import record_complete

    run_dir = make_run(tmp_path / "run", trained=SAMPLES - 1)
    cfg = resumed(run_dir)
    ledger = Ledger(SAMPLES, 1)
    ledger.mark(0, range(SAMPLES - 1))
    ctx = SimpleNamespace(cfg=cfg, ledger=ledger, resume_from=step_dir(run_dir, 4), resume_step=4, regen=None)
    check_open_work(ctx)  # one sample still to train
    ctx.regen = SimpleNamespace(voids={SAMPLES - 1})
    with pytest.raises(RunComplete, match="all 1 epoch"):
        check_open_work(ctx)
    assert check_resume(cfg).notes == []  # the checkpoint alone does not know ...
    record_complete(run_dir, checkpoint=str(step_dir(run_dir, 4).resolve()), epochs=1)
    with pytest.raises(RunComplete):  # ... the launch's record does
        check_resume(cfg)


def test_a_checkpoint_of_another_target_or_drafter_shape_is_refused_naming_the_field(tmp_path: Path):
    from tests.drafter.conftest import tiny_config

    now = tiny_config().to_dict()
    run_dir = make_run(tmp_path / "run")
    ckpt = step_dir(run_dir, 4)
    (ckpt / ck.DRAFTER_CONFIG).write_text(json.dumps(now))
    ResumePoint.read(ckpt, run_dir).check_fits(now, run_dir)  # the same shape: fine
    for field, other in (("hidden_size", 64), ("target_layer_ids", [0, 1]), ("num_hidden_layers", 3)):
        (ckpt / ck.DRAFTER_CONFIG).write_text(json.dumps({**now, field: other}))
        point = ResumePoint.read(ckpt, run_dir)
        with pytest.raises(RunDirError, match=re.escape(f"the checkpoint's drafter has {field}={other!r}")):
            point.check_fits(now, run_dir)
        point.check_fits(now, run_dir, skip=(field,))  # a field not known yet is not compared
    (ckpt / ck.DRAFTER_CONFIG).write_text("{")
    with pytest.raises(RunDirError, match="drafter_config.json .*The checkpoint is damaged"):
        ResumePoint.read(ckpt, run_dir)


def test_the_resumed_checkpoint_is_read_once_and_handed_on(tmp_path: Path):
    """``check_resume`` (under the launch's lock) reads the step, ledger and drafter config; what it returns
    is all the set-up needs, so nothing reads the checkpoint's files again."""
    run_dir = make_run(tmp_path / "run")
    point = check_resume(resumed(run_dir)).resume
    assert point is not None and point.checkpoint == step_dir(run_dir, 4) and point.step == 4
    assert point.ledger.num_samples == SAMPLES
    assert point.drafter_config == json.loads((step_dir(run_dir, 4) / ck.DRAFTER_CONFIG).read_text())


def test_a_run_that_trained_zero_steps_is_never_complete_and_does_not_export(tmp_path: Path):
    """A checkpoint at step 0 (an older launch wrote one when it stopped before any step) whose ledger says
    every epoch is done, or whose regenerated conversations are all voids: never "complete", never exported."""
    from types import SimpleNamespace

    from dflash_pipe.producer.setup import check_open_work
    from dflash_pipe.run.record import record_complete
    from dflash_pipe.run.resume import NothingTrained, complete_message

    run_dir = make_run(tmp_path / "run", steps=(0,), trained=SAMPLES)
    cfg = resumed(run_dir)
    assert complete_message(cfg, "step-00000000", 0, epochs_done=True) is None
    record_complete(run_dir, checkpoint="step-00000000", epochs=1)
    assert check_resume(cfg).notes == []  # neither the ledger nor the record makes step 0 complete
    voids = SimpleNamespace(voids=set(range(SAMPLES)), nothing_to_train=lambda: None)
    ctx = SimpleNamespace(
        cfg=cfg, ledger=Ledger(SAMPLES, 1), resume_from=step_dir(run_dir, 0), resume_step=0, regen=voids
    )
    with pytest.raises(NothingTrained) as info:
        check_open_work(ctx)
    assert str(info.value).startswith(f"{run_dir} trained 0 steps and its data has nothing left to train")
    ctx.regen = SimpleNamespace(voids=set(), nothing_to_train=lambda: "regeneration left no sample to train")
    with pytest.raises(NothingTrained, match="trained 0 steps and has nothing to train: regeneration left"):
        check_open_work(ctx)
    with pytest.raises(RunDirError) as info:
        find_checkpoint(run_dir)
    assert str(info.value) == (
        f"cannot export {step_dir(run_dir, 0)}: it was trained 0 steps, so its drafter is the untrained "
        "initialization. Train the run first (dflash-pipe launch --resume RUN_DIR), or export a checkpoint "
        "with steps."
    )


def test_export_of_a_zero_step_checkpoint_is_one_line_and_exit_2(tmp_path: Path):
    from click.testing import CliRunner

    from dflash_pipe.cli import main

    run_dir = make_run(tmp_path / "run", steps=(0,))
    result = CliRunner().invoke(main, ["export", str(run_dir), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "it was trained 0 steps, so its drafter is the untrained initialization" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
