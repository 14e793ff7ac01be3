"""prepare_run refuses inputs that do not fit the target or the run dir, with one line naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import ViTConfig

from dflash_pipe.data import DataConfig, demo_data_path
from dflash_pipe.producer.setup import OptionsError, SetupError, prepare_run
from dflash_pipe.run.checkpoint import latest_checkpoint, save_checkpoint
from dflash_pipe.run.config import DrafterOptions, RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.files import RunDirError
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.run.ledger import Ledger
from tests.tiny_models import tiny_qwen3_config


def config(run_dir: Path, **drafter) -> RunConfig:
    return RunConfig(
        run_dir=run_dir,
        data=DataConfig(path=demo_data_path(), max_length=64),
        drafter=DrafterOptions(num_layers=1, **drafter),
        layout=LayoutConfig(device="cpu"),
    )


def one_line(exc: BaseException, *needles: str) -> None:
    text = str(exc)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_target_layer_ids_beyond_the_target(tmp_path: Path):
    with pytest.raises(OptionsError) as info:
        prepare_run(config(tmp_path / "r", target_layer_ids=(1, 99)), resume=False, progress=False)
    one_line(info.value, "--target-layer-ids 1,99", "[99] do not exist", "layers (ids 0-")


def test_target_layer_ids_unsorted(tmp_path: Path):
    with pytest.raises(OptionsError) as info:
        prepare_run(config(tmp_path / "r", target_layer_ids=(2, 1)), resume=False, progress=False)
    one_line(info.value, "increasing order", "1,2")


def test_default_draft_layers_on_a_shallow_target(tmp_path: Path):
    """5 draft layers (the default) cannot spread over a 4-layer target: one line naming both flags, from
    the target's config alone (before the tokenizer or the data)."""
    target = tmp_path / "shallow"
    tiny_qwen3_config(num_hidden_layers=4).save_pretrained(target)
    cfg = config(tmp_path / "r")
    cfg.target_model = target
    cfg.drafter.num_layers = 5
    with pytest.raises(OptionsError) as info:
        prepare_run(cfg, resume=False, progress=False)
    one_line(
        info.value, "--draft-layers 5", "only 4 layers", "--draft-layers 1 or fewer", "--target-layer-ids"
    )
    tiny_qwen3_config(num_hidden_layers=7).save_pretrained(target)
    with pytest.raises(OptionsError, match="--draft-layers 4 or fewer"):
        prepare_run(cfg, resume=False, progress=False)


def test_a_target_that_is_no_decoder_only_lm_is_refused_by_its_config(tmp_path: Path):
    target = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(target)
    cfg = config(tmp_path / "r")
    cfg.target_model = target
    with pytest.raises(SetupError) as info:
        prepare_run(cfg, resume=False, progress=False)
    one_line(info.value, f"--target-model {target}", "'vit' has no causal-LM class")


def test_mask_token_beyond_the_vocabulary(tmp_path: Path):
    with pytest.raises(OptionsError) as info:
        prepare_run(config(tmp_path / "r", mask_token_id=10**9), resume=False, progress=False)
    one_line(info.value, "--mask-token-id 1000000000", "vocabulary of")


def test_resume_with_a_checkpoint_of_another_drafter_names_the_field(tmp_path: Path):
    run_dir = tmp_path / "r"
    ctx = prepare_run(config(run_dir), resume=False, progress=False)
    other = {**ctx.drafter.to_dict(), "hidden_size": ctx.drafter.hidden_size * 2}
    model = torch.nn.Linear(4, 3)
    ledger = Ledger(len(ctx.train_samples), 1).to_dict()
    step = save_checkpoint(
        run_dir,
        step=1,
        model=model,
        drafter_config=other,
        optimizer=torch.optim.AdamW(model.parameters()),
        ledger=ledger,
    )
    assert latest_checkpoint(run_dir) == step
    with pytest.raises(RunDirError) as info:
        prepare_run(RunDir(run_dir).load_config(), resume=True, progress=False)
    one_line(info.value, f"--resume {run_dir}", "hidden_size=", "new --run-dir")


def test_resume_of_a_dir_without_a_run(tmp_path: Path):
    with pytest.raises(RunDirError, match="no config.json there"):
        prepare_run(config(tmp_path / "empty"), resume=True, progress=False)


def test_a_data_file_too_small_to_hold_out_an_eval_set_says_so(tmp_path: Path):
    data = tmp_path / "one.jsonl"
    data.write_text(demo_data_path().read_text().splitlines()[0] + "\n")
    cfg = config(tmp_path / "r")
    cfg.data.path = data
    ctx = prepare_run(cfg, resume=False, progress=False)
    assert len(ctx.train_samples) == 1 and len(ctx.eval_samples) == 0
    [note] = ctx.notes
    one_line(ValueError(note), f"{data} has 1 sample(s), too few to hold out an eval set", "no tau")
    cfg = config(tmp_path / "r2")
    cfg.data.path, cfg.eval_samples = data, 0  # no eval set asked for: nothing to say
    assert prepare_run(cfg, resume=False, progress=False).notes == []
    assert prepare_run(config(tmp_path / "r3"), resume=False, progress=False).notes == []  # 3000 samples


def test_regeneration_that_cannot_fit_a_prompt_stops_before_generating(tmp_path: Path):
    from dflash_pipe.data import DataError

    run_dir = tmp_path / "r"
    cfg = config(run_dir)
    cfg.data = DataConfig(path=demo_data_path(), max_length=8, responses="target")
    with pytest.raises(DataError) as info:
        prepare_run(cfg, resume=False, progress=False)
    one_line(
        info.value,
        f"no sample of {demo_data_path()} fits --max-length 8: the shortest first prompt is ",
        "raise --max-length (data.max_length) to at least ",
    )
    assert not (run_dir / "regenerated.jsonl").exists() and not (run_dir / "config.json").exists()


def test_target_layer_ids_with_the_last_layer(tmp_path: Path):
    """The demo target has 6 layers: id 5 has no layer 6 whose input vLLM and SGLang would capture."""
    with pytest.raises(OptionsError) as info:
        prepare_run(config(tmp_path / "r", target_layer_ids=(1, 5)), resume=False, progress=False)
    one_line(info.value, "--target-layer-ids 1,5", "last layer", "6 layers", "vLLM and SGLang", "layer id+1")
