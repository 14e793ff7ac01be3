"""The DFlash reference package itself (``dflash`` from the package index, in a venv of its own that cannot
import dflash_pipe: ``reference_venv``) loads our export the way its README loads a published drafter
(``DFlashDraftModel.from_pretrained(EXPORT_DIR)``, no remote code) and speculates with its own generate loop
(``spec_generate``) next to the demo target loaded with transformers. Proved here: every exported weight is
one the reference builds (none missing or unexpected), its decoding equals the target's greedy ``generate``
token for token, and a drafter trained on the demo target accepts more tokens per step (tau) there than an
untrained one exported the same way, so the reference reads our weights, config, mask token and target
layers as we trained them; its block logits equal our drafter's for full and sliding + YaRN layers; and the
``serve-command --engine reference`` snippet runs there. Skipped only when the package index cannot be
reached to build the venv (CI reaches it: these run in ``make test``)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3ForCausalLM

from dflash_pipe.data import DataConfig, demo_data_path, demo_tokenizer, load_samples
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig, export_drafter
from dflash_pipe.drafter.generate_eval import end_of_turn_ids
from dflash_pipe.drafter.serve import REFERENCE_DEVICE, plan_from_path, serve_command
from dflash_pipe.drafter.speculate import context_features
from dflash_pipe.target import TargetCore, build_demo_target
from tests.tiny_models import tiny_qwen3_config

from .conftest import tiny_config
from .reference_venv import RegistryUnreachable, reference_python
from .test_export_remote_code import DRAFTERS, PROMPT

BLOCK = 8
LAYERS = (1, 3)  # two feature layers of the demo target's six: fc reads k*H
STEPS = 300
BATCH = 8
TRAIN_SAMPLES = 400
HELD_OUT = 6  # the data's last conversations, never trained on
TURNS = 2  # prompts per held-out conversation: the text before each of its first assistant turns
MAX_NEW = 24

# Runs in the reference venv (python -I: no cwd, no PYTHONPATH, so the repo is not on its path).
# argv: job.json, result.json. Target forwards are counted by a hook, since the reference's own
# stats (return_stats) time with torch.cuda.synchronize and need CUDA.
CHILD = r"""
import importlib.metadata, importlib.util, json, sys
assert importlib.util.find_spec("dflash_pipe") is None, "the reference venv must not see dflash_pipe"
import torch
import dflash
from dflash import DFlashDraftModel
from transformers import AutoModelForCausalLM

job = json.load(open(sys.argv[1]))
torch.set_num_threads(1)
target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
forwards = [0]
target.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
prompts = [torch.tensor([p]) for p in job["prompts"]]
with torch.inference_mode():
    greedy = [
        target.generate(
            p, attention_mask=torch.ones_like(p), max_new_tokens=job["max_new"], do_sample=False,
            eos_token_id=job["stops"], pad_token_id=job["stops"][0],
        )[0, p.shape[1]:].tolist()
        for p in prompts
    ]
result = {
    "dflash": dflash.__file__,
    "versions": {n: importlib.metadata.version(n) for n in ("dflash", "torch", "transformers")},
    "greedy": greedy,
    "drafters": {},
}
for name, export in job["exports"].items():
    draft, info = DFlashDraftModel.from_pretrained(export, output_loading_info=True, dtype=torch.float32)
    runs = []
    for p in prompts:
        forwards[0] = 0
        out = draft.spec_generate(
            target=target, input_ids=p, max_new_tokens=job["max_new"], stop_token_ids=job["stops"],
            temperature=0.0,
        )
        runs.append({"new": out[0, p.shape[1]:].tolist(), "steps": forwards[0] - 1})  # minus the prefill
    result["drafters"][name] = {
        "loading": {k: sorted(map(str, v)) for k, v in info.items()},
        "block_size": draft.block_size,
        "mask_token_id": draft.mask_token_id,
        "target_layer_ids": list(draft.target_layer_ids),
        "runs": runs,
    }
json.dump(result, open(sys.argv[2], "w"))
"""

# Runs in the reference venv too. argv: target dir, out dir, then export names (OUT/NAME, OUT/NAME.in):
# the reference's block logits after a real context, written to OUT/NAME.out.
LOGITS_CHILD = r"""
import sys
import torch
from safetensors.torch import load_file, save_file
from dflash import DFlashDraftModel
from transformers import AutoModelForCausalLM

target_dir, out = sys.argv[1:3]
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
for name in sys.argv[3:]:
    draft, info = DFlashDraftModel.from_pretrained(f"{out}/{name}", output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), (name, info)
    inputs = load_file(f"{out}/{name}.in")
    features = inputs["features"]  # [n, k*H]
    block = torch.full((1, draft.block_size), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = inputs["token"]
    with torch.inference_mode():
        noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
        positions = torch.arange(features.shape[0] + draft.block_size)[None]
        hidden = draft(position_ids=positions, noise_embedding=noise, target_hidden=features[None])
        logits = draft.compute_logits(hidden, target.get_output_embeddings())[0]  # [bs, V]
    save_file({"logits": logits.contiguous()}, f"{out}/{name}.out")
"""


@pytest.fixture(scope="module")
def reference() -> str:
    """The reference venv's Python (built and cached on first use)."""
    try:
        return str(reference_python())
    except RegistryUnreachable as e:
        pytest.skip(f"package registry unreachable, so the dflash reference venv cannot be built: {e}")


def padded(samples, features) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids [B, S]``, ``features [B, S, k*H]``, ``loss_mask [B, S]`` of some samples."""
    width = max(s.input_ids.numel() for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    feats = torch.zeros(len(samples), width, features[0].shape[-1])
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for b, (s, f) in enumerate(zip(samples, features, strict=True)):
        n = s.input_ids.numel()
        ids[b, :n], feats[b, :n], mask[b, :n] = s.input_ids, f, s.loss_mask.bool()
    return ids, feats, mask


def train(drafter: DFlashDrafter, core: TargetCore, samples) -> list[float]:
    """AdamW on the drafter's objective over the target's features of ``samples``; the losses."""
    features = [core.features(s.input_ids, [s.input_ids.numel()]) for s in samples]  # each [S, k*H]
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        rows = torch.randint(len(samples), (BATCH,), generator=gen).tolist()
        out = drafter(*padded([samples[r] for r in rows], [features[r] for r in rows]), generator=gen)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


def turn_prompts(samples) -> list[list[int]]:
    """Each sample's tokens before each of its first TURNS assistant turns."""
    prompts = []
    for s in samples:
        mask = s.loss_mask.bool()
        starts = [i for i in range(1, mask.numel()) if mask[i] and not mask[i - 1]][:TURNS]
        prompts += [s.input_ids[:i].tolist() for i in starts]
    return prompts


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """A drafter trained on the demo target and an untrained one of the same shape, both exported with
    ``export_drafter``, and what the reference venv's child runs them on. About 100 s in a full suite, most of
    it its 300 AdamW steps (STEPS) on one thread. The test's claim is that the trained drafter's tau, in the
    reference's own decoding, beats the untrained one's by 0.4, and that needs a drafter that has learned."""
    root = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is several times faster on a busy 2-core box
    try:
        return _train_and_export(root)
    finally:
        torch.set_num_threads(threads)


def _train_and_export(root) -> dict:
    target_dir = build_demo_target(progress=False)  # the cached demo target (built once per machine)
    tok = demo_tokenizer()
    samples = load_samples(DataConfig(path=demo_data_path(), max_length=256), tok).samples
    cfg = DrafterConfig.from_target(
        AutoConfig.from_pretrained(target_dir),
        tokenizer=tok,
        num_layers=1,
        block_size=BLOCK,
        target_layer_ids=LAYERS,
        max_anchors=32,
        attention_backend="sdpa",
    )
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    embed, head = core.model.get_input_embeddings(), core.model.get_output_embeddings()
    torch.manual_seed(0)
    untrained = DFlashDrafter(cfg, embed, head).eval()
    export_drafter(untrained, root / "untrained")
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, embed, head)
    start = time.perf_counter()
    losses = train(drafter, core, samples[:TRAIN_SAMPLES])
    export_drafter(drafter.eval(), root / "trained")
    return {
        "target": str(target_dir),
        "exports": {name: str(root / name) for name in ("trained", "untrained")},
        "prompts": turn_prompts(samples[-HELD_OUT:]),
        "max_new": MAX_NEW,
        "stops": end_of_turn_ids(tok, target_dir),
        "cfg": cfg,
        "losses": losses,
        "train_s": time.perf_counter() - start,
    }


def run_in_reference(python: str, script: str, *args, cwd) -> None:
    """``script`` in the reference venv (isolated: the repo is not on its path, nor PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [python, "-I", "-c", script, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"the reference child failed:\n{proc.stderr[-4000:]}"


def run_reference(python: str, job: dict, out) -> dict:
    """The CHILD in the reference venv on ``job``; its result.json."""
    (out / "job.json").write_text(json.dumps({k: v for k, v in job.items() if k not in ("cfg", "losses")}))
    run_in_reference(python, CHILD, out / "job.json", out / "result.json", cwd=out)
    return json.loads((out / "result.json").read_text())


def tau(runs: list[dict]) -> float:
    """Tokens per draft-verify step over all prompts, as the reference counts ``acceptance_lengths``: the
    prefill's token aside, every new token is produced by a step (accepted drafts plus the bonus)."""
    return sum(len(r["new"]) - 1 for r in runs) / sum(r["steps"] for r in runs)


@pytest.mark.slow
def test_reference_package_speculates_losslessly_with_our_export(reference, job, tmp_path) -> None:
    """Loaded as-is, lossless against greedy ``generate``, and the trained drafter's tau above the untrained's."""
    losses = job["losses"]
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20]), "the drafter did not learn"
    result = run_reference(reference, job, tmp_path)

    assert "dflash_pipe" not in result["dflash"] and result["versions"]["dflash"] == "0.1.0"
    cfg, greedy = job["cfg"], result["greedy"]
    assert len(greedy) == len(job["prompts"]) >= 8
    taus = {}
    for name, drafter in result["drafters"].items():
        assert drafter["loading"] == {
            "missing_keys": [],
            "unexpected_keys": [],
            "mismatched_keys": [],
            "error_msgs": [],
        }, name
        assert drafter["block_size"] == cfg.block_size and drafter["mask_token_id"] == cfg.mask_token_id
        assert drafter["target_layer_ids"] == list(cfg.target_layer_ids)
        for i, run in enumerate(drafter["runs"]):
            assert run["new"] == greedy[i], f"{name}, prompt {i}: not lossless"
        taus[name] = tau(drafter["runs"])
    print(f"reference tau: {taus}; training {job['train_s']:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    assert taus["untrained"] >= 1.0
    assert taus["trained"] > taus["untrained"] + 0.4, taus


@pytest.mark.slow
def test_reference_package_computes_our_block_logits(reference, tmp_path) -> None:
    """Full attention, and sliding + full layers with YaRN: the reference's logits of one block after a
    real context equal our DFlashDrafter's, so it reads layer types, windows and RoPE as we train them."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=4, vocab_size=50)).eval()
    model.save_pretrained(tmp_path / "target")
    prompt = torch.tensor(PROMPT)
    ours = {}
    for name, overrides in DRAFTERS.items():
        torch.manual_seed(1)
        cfg = tiny_config(block_size=4, target_layer_ids=(0, 2), num_target_layers=4, **overrides)
        drafter = DFlashDrafter(cfg, model.get_input_embeddings(), model.lm_head).eval()
        export_drafter(drafter, tmp_path / name)
        with torch.no_grad():
            features = context_features(model(prompt[None], output_hidden_states=True).hidden_states, (0, 2))
            n = features.shape[1]  # features [1, n, k*H]; the block's first token is 17, at position n
            hidden = drafter.block_hidden(
                torch.cat([prompt, torch.tensor([17])])[None],
                torch.cat([features, features.new_zeros(1, 1, features.shape[2])], dim=1),
                torch.tensor([[n]]),
                torch.ones(1, 1, dtype=torch.bool),
            )
            ours[name] = torch.nn.functional.linear(hidden[0, 0], model.lm_head.weight)  # [bs, V]
        save_file(
            {"features": features[0].contiguous(), "token": torch.tensor(17)}, str(tmp_path / f"{name}.in")
        )

    run_in_reference(reference, LOGITS_CHILD, tmp_path / "target", tmp_path, *DRAFTERS, cwd=tmp_path)

    for name in DRAFTERS:
        theirs = load_file(str(tmp_path / f"{name}.out"))["logits"]
        torch.testing.assert_close(
            theirs, ours[name], rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_serve_command_reference_snippet_runs_in_the_reference_package(reference, job, tmp_path) -> None:
    """``serve-command --engine reference`` prints Python that the reference package as published runs."""
    text = serve_command(plan_from_path(job["exports"]["trained"], target=job["target"]), "reference")
    device_line = f"device = {REFERENCE_DEVICE!r}"
    assert device_line in text
    run_in_reference(reference, text.replace(device_line, "device = 'cpu'"), cwd=tmp_path)
