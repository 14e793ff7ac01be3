"""An export loads as the published DFlash drafters load: ``AutoModel.from_pretrained(DIR,
trust_remote_code=True)`` in a fresh process that cannot import dflash_pipe, then ``spec_generate`` against
a saved HF target. Checked there: no missing or unexpected weights, the loaded drafter's block logits equal
our DFlashDrafter's (so the exported modeling file is checked against our model, not only against itself),
and its decoding equals the target's greedy ``generate`` token for token, with drafts that are all accepted,
partly accepted and never accepted, and with a stop token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

from dflash_pipe.drafter import DFlashDrafter, export_drafter
from dflash_pipe.drafter.export import MODELING_NAME
from dflash_pipe.drafter.speculate import context_features
from tests.tiny_models import tiny_qwen3_config

from .conftest import tiny_config

BS = 4
LAYERS = (0, 2)
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
NEW = 24

# Runs in the fresh process: argv = export dir, target dir, out dir. Writes logits.safetensors and result.json.
CHILD = r"""
import json, sys
sys.modules["dflash_pipe"] = None  # the export must stand alone: importing our package fails here
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

export_dir, target_dir, out = sys.argv[1:4]
torch.set_num_threads(1)
draft, info = AutoModel.from_pretrained(
    export_dir, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
)
draft.eval()
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
inputs = load_file(out + "/inputs.safetensors")
with torch.inference_mode():
    features = inputs["features"]  # [n, k*H]
    n = features.shape[0]
    block = torch.full((1, draft.block_size), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = inputs["tokens"][-1]
    noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
    hidden = draft(
        position_ids=torch.arange(n + draft.block_size)[None], noise_embedding=noise, target_hidden=features[None]
    )
    logits = draft.compute_logits(hidden, target.get_output_embeddings())[0]
save_file({"logits": logits.contiguous()}, out + "/logits.safetensors")

prompt = inputs["prompt"][None]
new = int(inputs["new"])
greedy = target.generate(
    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, eos_token_id=None
)[0, prompt.shape[1]:].tolist()


def oracle(wrong_from):
    # drafts the target's own continuation, wrong from slot `wrong_from` on (None: never wrong)
    def propose(target_, tokens, features_):
        done = tokens.numel() - prompt.shape[1]
        d = torch.tensor((greedy + [0] * draft.block_size)[done : done + draft.block_size - 1])
        if wrong_from is not None:
            d[wrong_from:] = (d[wrong_from:] + 1) % target.config.vocab_size
        return d
    return propose


runs = {}
real_draft = draft.draft
for name, propose, stops in [
    ("drafter", real_draft, None),
    ("oracle", oracle(None), None),
    ("half", oracle(1), None),
    ("stop", oracle(None), [greedy[10]]),
]:
    draft.draft = propose
    stats = draft.spec_generate(
        target=target, input_ids=prompt, max_new_tokens=new, stop_token_ids=stops, temperature=0.0,
        return_stats=True,
    )
    runs[name] = {"ids": stats.output_ids[0].tolist(), "steps": stats.acceptance_lengths}
json.dump(
    {
        "loading": {k: sorted(v) for k, v in info.items() if k != "error_msgs"} | {"error_msgs": info["error_msgs"]},
        "class": type(draft).__name__,
        "greedy": greedy,
        "runs": runs,
    },
    open(out + "/result.json", "w"),
)
"""


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, vocab_size=50, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return model, path


DRAFTERS = {
    "full": {},
    "mixed-yarn": dict(
        num_hidden_layers=3,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=5,  # shorter than the context: the window really cuts
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
}


def run_child(export_dir, target_dir, out) -> dict:
    env = dict(os.environ, HF_MODULES_CACHE=str(out / "hf_modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(export_dir), str(target_dir), str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_export_loads_with_trust_remote_code_and_decodes_losslessly(tmp_path, target, name) -> None:
    model, target_dir = target
    torch.manual_seed(1)
    cfg = tiny_config(block_size=BS, target_layer_ids=LAYERS, num_target_layers=4, **DRAFTERS[name])
    drafter = DFlashDrafter(cfg, model.get_input_embeddings(), model.lm_head).eval()
    export_dir = tmp_path / "export"
    export_drafter(drafter, export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (export_dir / MODELING_NAME).is_file()

    # our drafter's logits of one block after a real context (the target's features of PROMPT)
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        out = model(input_ids=prompt[None], output_hidden_states=True)
        features = context_features(out.hidden_states, LAYERS)[0]  # [n, k*H]
        n = features.shape[0]
        tokens = torch.cat([prompt, torch.tensor([17])])  # [n+1]: the block's first token last
        padded = torch.cat([features, features.new_zeros(1, features.shape[1])])
        hidden = drafter.block_hidden(
            tokens[None], padded[None], torch.tensor([[n]]), torch.ones(1, 1, dtype=torch.bool)
        )
        ours = torch.nn.functional.linear(hidden[0, 0], model.lm_head.weight)  # [bs, V]
    save_file(
        {"features": features.contiguous(), "tokens": tokens, "prompt": prompt, "new": torch.tensor(NEW)},
        str(tmp_path / "inputs.safetensors"),
    )

    result = run_child(export_dir, target_dir, tmp_path)

    assert result["class"] == "DFlashDraftModel"
    assert result["loading"] == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    theirs = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)

    greedy, runs = result["greedy"], result["runs"]
    assert len(greedy) == NEW
    for run in ("drafter", "oracle", "half"):
        assert runs[run]["ids"] == PROMPT + greedy, run
        assert sum(runs[run]["steps"]) == NEW - 1, run  # the prefill's token, then the steps' tokens
    assert set(runs["oracle"]["steps"][:-1]) == {BS}  # every draft accepted, plus the target's token
    assert set(runs["half"]["steps"][:-1]) == {2}  # the first draft token accepted, the rest refused
    stop = greedy[10]
    first = greedy.index(stop)
    assert runs["stop"]["ids"] == PROMPT + greedy[: first + 1]  # ends at the stop token, kept
