"""build_demo_target: cached by fingerprint, atomic, and the real build actually learns the data."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dflash_pipe.data import DataConfig, demo_data_path, demo_tokenizer, load_samples
from dflash_pipe.target import DemoRecipe, TargetCore, build_demo_target, default_cache_dir
from dflash_pipe.target import demo as demo_mod

TINY = DemoRecipe(steps=3, batch_size=4, warmup_steps=1)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 40 demo conversations: enough to exercise the build quickly."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    lines = demo_data_path().read_text().splitlines()[:40]
    path.write_text("\n".join(lines) + "\n")
    return path


def _snapshot(d: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(d.iterdir())}


def test_build_is_idempotent_and_rebuilds_on_change(tmp_path, small_data, monkeypatch):
    out = tmp_path / "target"
    assert build_demo_target(out, recipe=TINY, data_path=small_data, progress=True) == out
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", demo_mod.FINGERPRINT_FILE):
        assert (out / name).is_file()
    first = _snapshot(out)
    info = demo_mod.read_build_info(out)
    assert info["train"]["steps"] == 3 and info["fingerprint"]["recipe"]["steps"] == 3

    trainings = []
    real_train = demo_mod._train_and_save
    monkeypatch.setattr(
        demo_mod, "_train_and_save", lambda *a, **k: trainings.append(1) or real_train(*a, **k)
    )
    assert build_demo_target(out, recipe=TINY, data_path=small_data) == out
    assert trainings == []  # the cache hit trained nothing
    assert _snapshot(out) == first  # untouched: same bytes, same mtimes

    # A different recipe is a different fingerprint: rebuilt in place.
    build_demo_target(out, recipe=DemoRecipe(steps=2, batch_size=4, warmup_steps=1), data_path=small_data)
    assert demo_mod.read_build_info(out)["train"]["steps"] == 2 and trainings == [1]
    # An incomplete dir (a file lost) is rebuilt too.
    (out / "model.safetensors").unlink()
    build_demo_target(out, recipe=TINY, data_path=small_data)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["target"]


def test_same_recipe_gives_same_weights(tmp_path, small_data):
    a = build_demo_target(tmp_path / "a", recipe=TINY, data_path=small_data)
    b = build_demo_target(tmp_path / "b", recipe=TINY, data_path=small_data)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def _build_until_killed(out: Path, data: Path, started) -> None:
    """A child's build that has written part of its files when it tells the parent, then never ends."""

    def half_then_hang(tmp: Path, *args, **kwargs):
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        started.set()
        time.sleep(600)

    demo_mod._train_and_save = half_then_hang  # in the child only
    build_demo_target(out, recipe=TINY, data_path=data)


def test_a_build_killed_midway_leaves_no_half_build(tmp_path, small_data):
    """SIGKILL runs no cleanup: the half-written files stay in the temporary dir, never under the build's
    name, and the killed builder's lock does not stop the next build."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("fork")  # this process has imported everything already: fast
    started = ctx.Event()
    child = ctx.Process(target=_build_until_killed, args=(tmp_path / "target", small_data, started))
    child.start()
    try:
        assert started.wait(60), f"the child build never started (exit code {child.exitcode})"
        child.kill()
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    assert not (tmp_path / "target").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".target.tmp-")]
    assert len(leftovers) == 1 and (tmp_path / leftovers[0] / "config.json").is_file()  # what it had written
    assert build_demo_target(tmp_path / "target", recipe=TINY, data_path=small_data) == tmp_path / "target"
    assert demo_mod.read_build_info(tmp_path / "target")["train"]["steps"] == 3


def test_an_error_midway_cleans_up_after_itself(tmp_path, small_data, monkeypatch):
    def boom(tmp: Path, *args, **kwargs):
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("failed mid-build")

    monkeypatch.setattr(demo_mod, "_train_and_save", boom)
    with pytest.raises(RuntimeError, match="failed mid-build"):
        build_demo_target(tmp_path / "target", recipe=TINY, data_path=small_data)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_default_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_PIPE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "demo-target"
    monkeypatch.delenv("DFLASH_PIPE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "dflash-pipe" / "demo-target"


def test_recipe_validation():
    with pytest.raises(ValueError, match="DemoRecipe.steps=-1"):
        DemoRecipe(steps=-1)
    with pytest.raises(ValueError, match="DemoRecipe.lr=0"):
        DemoRecipe(lr=0)


def _greedy_accuracy(model_dir: Path, samples) -> float:
    """Fraction of positions where the target's greedy next token is the data's next token."""
    core = TargetCore(model_dir, [1], "cpu", torch.float32)
    ids = torch.cat([s.input_ids for s in samples])
    lengths = [s.input_ids.numel() for s in samples]
    pred = core.greedy_next(ids, lengths)
    hits = sum(
        int((p[:-1] == t[1:]).sum()) for p, t in zip(pred.split(lengths), ids.split(lengths), strict=True)
    )
    return hits / sum(n - 1 for n in lengths)


@pytest.mark.slow
def test_real_build_learns_the_data(tmp_path):
    """The default recipe (about 30-60 s on 2 cores) makes greedy predictions follow the data.

    The trained build is the default cached one, the one every demo run and bench uses: built here when
    the cache is empty, else the build with this recipe's fingerprint (RECIPE_VERSION included), which
    is the same build, so the suite trains the demo target once, not twice."""
    trained = build_demo_target(progress=False)
    assert trained == default_cache_dir()
    untrained = build_demo_target(tmp_path / "init", recipe=DemoRecipe(steps=0))
    stats = demo_mod.read_build_info(trained)["train"]
    assert stats["loss_last10"] < 0.25 * stats["loss_first"], stats

    tok = demo_tokenizer()
    samples = load_samples(DataConfig(path=demo_data_path(), max_length=256), tok).samples[::100]
    acc_trained, acc_init = _greedy_accuracy(trained, samples), _greedy_accuracy(untrained, samples)
    assert acc_trained > 0.6 and acc_init < 0.05, (acc_trained, acc_init)
    assert len(tok) == TargetCore(trained, [0], "cpu", torch.float32).vocab_size


def test_the_build_has_the_mode_the_umask_says(tmp_path, small_data):
    import os
    import stat

    before = os.umask(0o022)
    try:
        out = build_demo_target(tmp_path / "target", recipe=TINY, data_path=small_data)
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
