"""The real evaluation inside a run (rank 0's RealEval): when it runs, its metrics, a target it cannot load."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter import DFlashDrafter
from dflash_pipe.train.batches import DeviceBatch
from dflash_pipe.train.real_eval import RealEval
from tests.drafter.conftest import tiny_config
from tests.tiny_models import save_demo_target
from tests.trained_drafter import train_on_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    return root, save_demo_target(root)


def eval_batches() -> list[DeviceBatch]:
    """Two padded rows: a 5-token prompt then the assistant turn, a 3-token prompt; padding after."""
    ids = torch.arange(20, 40).view(2, 10)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 5:9] = True
    mask[1, 3:6] = True
    return [DeviceBatch(ids, torch.zeros(2, 10, 64), mask, None, tokens=20)]


def drafter_of(model) -> DFlashDrafter:
    cfg = tiny_config(vocab_size=model.config.vocab_size, target_layer_ids=(0, 2), mask_token_id=3)
    return DFlashDrafter(cfg, model.get_input_embeddings(), model.lm_head)


@pytest.mark.parametrize(("mode", "periodic", "final"), [("end", False, True), ("every", True, True)])
def test_runs_when_asked(target_dir, mode, periodic, final) -> None:
    root, model = target_dir
    real = RealEval(
        root, eval_batches(), TrainConfig(eval_generate=mode, eval_max_new_tokens=8), torch.device("cpu")
    )
    assert [p.tolist() for p in real.prompts] == [list(range(20, 25)), list(range(30, 33))]
    assert real.due(final=False) is periodic and real.due(final=True) is final
    first = real.run(drafter_of(model))
    assert first["real/prompts"] == 2 and first["real/lossless_mismatches"] == 0
    assert 1.0 <= first["real/tau"] <= 4 and first["real/new_tokens"] <= 16
    assert len(real._references) == 2  # greedy decoding once per prompt, reused by the next evaluation
    again = real.run(drafter_of(model))
    assert again["real/new_tokens"] == first["real/new_tokens"]


def test_a_trained_drafter_beats_an_untrained_one(target_dir) -> None:
    """What real/tau measures: 40 steps on the target's greedy continuations of the eval prompts lift it
    well above the untrained drafter's (which drafts nothing the target accepts)."""
    root, model = target_dir
    real = RealEval(root, eval_batches(), TrainConfig(eval_max_new_tokens=8), torch.device("cpu"))
    torch.manual_seed(0)
    untrained = real.run(drafter_of(model))
    torch.manual_seed(0)
    drafter = drafter_of(model)
    losses = train_on_greedy(model.eval(), drafter, real.prompts, new_tokens=12, steps=40)
    trained = real.run(drafter)
    assert losses[-1] < losses[0]
    assert trained["real/lossless_mismatches"] == untrained["real/lossless_mismatches"] == 0
    assert trained["real/tau"] > untrained["real/tau"] + 1.0, (untrained["real/tau"], trained["real/tau"])


def test_prompt_limit_and_a_target_that_cannot_load(tmp_path, capsys) -> None:
    real = RealEval(tmp_path / "nowhere", eval_batches(), TrainConfig(eval_prompts=1), torch.device("cpu"))
    assert len(real.prompts) == 1 and real.due(final=True)
    assert real.run(torch.nn.Linear(1, 1)) == {}
    assert real.disabled and not real.due(final=True)
    assert "the real evaluation (train.eval_generate) is off" in capsys.readouterr().err


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="eval_generate must be off, end or every"):
        TrainConfig(eval_generate="sometimes")
    with pytest.raises(ValueError, match="eval_prompts and train.eval_max_new_tokens must be >= 1"):
        TrainConfig(eval_prompts=0)
