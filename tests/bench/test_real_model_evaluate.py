"""The real-model bench's evaluation on CPU (a tiny random target over the demo tokenizer, a random drafter's
export): rows for every drafter and set, and the greedy references stored for the next evaluation, reused
only for the same prompts and settings."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_pipe.bench import real_model
from dflash_pipe.bench.stored_references import load_references
from dflash_pipe.data import demo_data_path
from dflash_pipe.drafter.generate_eval import Reference
from dflash_pipe.drafter.speculate import GreedyOutput
from tests.tiny_models import export_random_drafter, save_demo_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    target = save_demo_target(root / "target", tie_word_embeddings=True)
    export_random_drafter(target, root / "ours-2min")
    lines = demo_data_path().read_text().splitlines(keepends=True)
    (root / "eval_a.jsonl").write_text("".join(lines[:3]))
    (root / "eval_b.jsonl").write_text("".join(lines[3:5]))
    return root


def evaluate(root, references_file, **kwargs):
    return real_model.evaluate_drafters(
        root / "target",
        {"ours-2min": root / "ours-2min"},
        {"a": root / "eval_a.jsonl", "b": root / "eval_b.jsonl"},
        device="cpu",
        max_new_tokens=kwargs.pop("max_new_tokens", 8),
        max_prompts=2,
        references_file=references_file,
        **kwargs,
    )


def test_references_are_stored_and_reused_for_the_same_prompts(bench_dir, tmp_path, monkeypatch):
    stored = tmp_path / "references.json"
    rows = evaluate(bench_dir, stored)
    assert [(r["drafter"], r["set"]) for r in rows] == [("ours-2min", "a"), ("ours-2min", "b")]
    assert all(r["lossless_mismatches"] == 0 and r["prompts"] == 2 for r in rows)
    saved = json.loads(stored.read_text())
    assert sorted(saved["sets"]) == ["a", "b"] and len(saved["sets"]["a"]) == 2

    decoded = []
    import dflash_pipe.drafter.generate_eval as generate_eval

    real_reference_for = generate_eval.reference_for
    monkeypatch.setattr(
        generate_eval, "reference_for", lambda *a, **k: decoded.append(1) or real_reference_for(*a, **k)
    )
    again = evaluate(bench_dir, stored)
    assert decoded == []  # every greedy decoding came from the file
    assert [r["tau"] for r in again] == [r["tau"] for r in rows]
    evaluate(bench_dir, stored, max_new_tokens=6)  # other settings: decoded afresh, the file rewritten
    assert len(decoded) == 4
    assert json.loads(stored.read_text())["settings"]["max_new_tokens"] == 6


def test_checked_graphed_drafting_compares_every_draft_with_the_forward(bench_dir, tmp_path):
    """``draft_graphs="check"`` off CUDA: the graphed proposer's buffers, run eagerly, draft what the forward
    drafts at every step (the same tau), and each row says how many drafts were compared."""
    plain = evaluate(bench_dir, tmp_path / "references.json")
    checked = evaluate(bench_dir, tmp_path / "references.json", draft_graphs="check")
    assert [r["tau"] for r in checked] == [r["tau"] for r in plain]
    for row in checked:
        assert row["draft_graphs"] == "check" and row["draft_attention"] == "sdpa"
        assert row["graph_check"]["checked"] == row["steps"] > 0
        assert row["graph_check"]["mismatched"] == 0 and row["graph_check"]["first"] == []
    with pytest.raises(ValueError, match="draft_graphs must be off, on or check, got True"):
        evaluate(bench_dir, None, draft_graphs=True)  # the old flag's form: refused, not read as "off"


def test_a_stored_reference_for_other_prompt_tokens_is_not_reused(tmp_path):
    path = tmp_path / "references.json"
    settings = {"target": "t", "max_new_tokens": 4}
    prompt = torch.tensor([1, 2, 3])
    ref = Reference(greedy=GreedyOutput([5, 6], 0.5), baseline=GreedyOutput([5, 6], 0.1))
    from dflash_pipe.bench.stored_references import save_references

    save_references(path, settings, {"a": [prompt]}, {"a": {0: ref}})
    back = load_references(path, settings, {"a": [prompt]})["a"][0]
    assert back.greedy.tokens == [5, 6] and back.baseline.seconds == 0.1
    assert load_references(path, settings, {"a": [torch.tensor([1, 2, 4])]}) == {"a": {}}
    assert load_references(path, {**settings, "max_new_tokens": 5}, {"a": [prompt]}) == {"a": {}}
    assert load_references(tmp_path / "none.json", settings, {"a": [prompt]}) == {"a": {}}


def test_evaluations_in_several_calls_add_up(tmp_path, monkeypatch):
    """Phase d after phase b evaluates ours, after the peer only the peer's: the second call's rows join the
    first's (a drafter and set evaluated again replaces its row), so summarize sees both trainers."""
    import argparse
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "real_model_cli", Path(__file__).resolve().parents[2] / "bench" / "real_model.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for name in ("ours-8min", "peer-8min"):
        (tmp_path / "drafters" / name).mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "eval_sharegpt.jsonl").write_text("")
    calls = []

    def fake(target, drafters, sets, **kwargs):
        calls.append(kwargs["references_file"])
        return [{"drafter": d, "set": s, "tau": float(len(calls))} for d in drafters for s in sets]

    monkeypatch.setattr(real_model, "evaluate_drafters", fake)
    monkeypatch.setattr(real_model, "target_dir", lambda target: target)

    def run(*only):
        args = argparse.Namespace(
            out=tmp_path, drafter=[], only=list(only), target=tmp_path / "t", device="cpu",
            max_new_tokens=8, eval_prompts=2, all_sets_at=[8.0], dtype="float32", draft_attention="auto",
            draft_graphs="off", rows="eval_rows.json",
        )  # fmt: skip
        cli.evaluate(args)
        return json.loads((tmp_path / "eval_rows.json").read_text())

    assert [(r["drafter"], r["tau"]) for r in run("ours-8min")] == [("ours-8min", 1.0)]
    assert [(r["drafter"], r["tau"]) for r in run("peer-8min")] == [("ours-8min", 1.0), ("peer-8min", 2.0)]
    assert [(r["drafter"], r["tau"]) for r in run("ours-8min")] == [("peer-8min", 2.0), ("ours-8min", 3.0)]
    assert calls == [tmp_path / "references.json"] * 3  # every call shares the stored references
