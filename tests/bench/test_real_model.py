"""The real-model bench's data preparation and summary (dflash_pipe/bench/real_model.py), on small files written
here: the GPU phases themselves run only on a lent GPU (bench/real_model_h200.sh)."""

import gzip
import json
from pathlib import Path

import pytest

from dflash_pipe.bench import real_model


def sharegpt_file(path, records, *, cut=True):
    text = json.dumps(records)
    path.write_text(text[: text.rindex("}") - 5] if cut else text)  # cut inside the last record
    return path


def conversation(i, *, first="human"):
    other = "gpt" if first == "human" else "human"
    return {
        "id": str(i),
        "conversations": [{"from": first, "value": f"q{i}"}, {"from": other, "value": f"a{i}"}],
    }


def test_prepare_keeps_training_and_held_out_prompts_apart(tmp_path):
    records = [conversation(i) for i in range(12)] + [conversation(12, first="gpt"), {"conversations": []}]
    records += [conversation(i) for i in range(14, 30)]
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"prompt": f"def f{i}():\n", "canonical_solution": "    return 1\n"}) + "\n")
    data = real_model.prepare_data(
        sharegpt_file(tmp_path / "sg.json", records),
        humaneval,
        tmp_path / "out",
        train_records=10,
        eval_prompts=8,
    )
    train = json.loads(data.train.read_text())
    assert [r["id"] for r in train] == [str(i) for i in range(10)]  # the file's first records, as distributed
    held = [json.loads(line)["messages"] for line in data.eval_sets["sharegpt"].read_text().splitlines()]
    assert len(held) == 8
    asked = {m[0]["content"] for m in held}
    assert not asked & {f"q{i}" for i in range(10)}  # none of the training records
    assert all(m[0]["role"] == "user" and m[1]["role"] == "assistant" for m in held)
    assert "q29" not in asked  # the record cut short is not read
    he = [json.loads(line)["messages"] for line in data.eval_sets["humaneval"].read_text().splitlines()]
    assert len(he) == 3 and "def f0():" in he[0][0]["content"] and he[0][1]["content"].endswith("return 1\n")


def test_prepare_refuses_too_few_records(tmp_path):
    with pytest.raises(SystemExit, match="lower --train-records"):
        real_model.prepare_data(
            sharegpt_file(tmp_path / "sg.json", [conversation(i) for i in range(3)], cut=False),
            None,
            tmp_path / "out",
            train_records=3,
            eval_prompts=2,
        )


def test_first_exchange_needs_a_user_turn_then_a_reply():
    assert real_model.first_exchange(conversation(1, first="gpt")) is None
    record = {"conversations": [{"from": "system", "value": "s"}, *conversation(2)["conversations"]]}
    assert real_model.first_exchange(record) == [
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]


def test_summary_checks_the_goals_on_the_last_mark(tmp_path):
    def row(drafter, set_name, tau, mismatches=0):
        return {"drafter": drafter, "set": set_name, "tau": tau, "lossless_mismatches": mismatches,
                "acceptance_per_position": [tau - 1.0]}  # fmt: skip

    rows = [row("ours-target-2min", "sharegpt", 1.5), row("ours-target-8min", "sharegpt", 2.4),
            row("ours-target-8min", "humaneval", 2.0), row("specforge-8min", "sharegpt", 2.0, mismatches=1)]  # fmt: skip
    (tmp_path / "eval_rows.json").write_text(json.dumps(rows))
    (tmp_path / "ours-target.train.json").write_text(json.dumps({"name": "ours-target", "wall_s": 480}))
    paths = real_model.summarize(tmp_path)
    result = json.loads(paths["json"].read_text())
    goals = {g["name"]: g for g in result["summary"]["goals"]}
    assert (
        goals["real tau, held-out ShareGPT"]["value"] == 2.4 and goals["real tau, held-out ShareGPT"]["met"]
    )
    ratio = goals["tau over the peer's, same rows and minutes"]
    assert ratio["value"] == pytest.approx(1.2) and ratio["met"]
    assert goals["prompts not lossless"]["value"] == 1 and not goals["prompts not lossless"]["met"]
    assert [r["minutes"] for r in result["rows"]] == [2.0, 8.0, 8.0, 8.0]


def test_first_turns_cuts_each_training_record_to_its_first_exchange(tmp_path):
    long = conversation(0)
    long["conversations"] += [{"from": "human", "value": "again"}, {"from": "gpt", "value": "more"}]
    records = [long, conversation(1, first="gpt"), conversation(2), *[conversation(i) for i in range(3, 12)]]
    data = real_model.prepare_data(
        sharegpt_file(tmp_path / "sg.json", records), None, tmp_path / "out", train_records=3, eval_prompts=4,
        turns="first",
    )  # fmt: skip
    train = json.loads(data.train.read_text())
    assert [r["id"] for r in train] == ["0", "2"]  # record 1 opens with the assistant: no first exchange
    assert train[0]["conversations"] == [{"from": "human", "value": "q0"}, {"from": "gpt", "value": "a0"}]
    held = {
        json.loads(line)["messages"][0]["content"]
        for line in data.eval_sets["sharegpt"].read_text().splitlines()
    }
    assert held and not held & {"q0", "q1", "q2"}


def test_each_turn_makes_every_exchange_a_record_and_keeps_the_held_out_prompts_apart(tmp_path):
    long = conversation(0)
    long["conversations"] += [{"from": "human", "value": "again"}, {"from": "gpt", "value": "more"}]
    long["conversations"] += [{"from": "human", "value": "unanswered"}]
    records = [long, conversation(1, first="gpt"), conversation(2), *[conversation(i) for i in range(3, 12)]]
    data = real_model.prepare_data(
        sharegpt_file(tmp_path / "sg.json", records), None, tmp_path / "out", train_records=3, eval_prompts=4,
        turns="each",
    )  # fmt: skip
    train = json.loads(data.train.read_text())
    assert [r["id"] for r in train] == ["0-0", "0-1", "2-0"]  # record 1 opens with the assistant
    assert train[1]["conversations"] == [
        {"from": "human", "value": "again"},
        {"from": "gpt", "value": "more"},
    ]
    held = {
        json.loads(line)["messages"][0]["content"]
        for line in data.eval_sets["sharegpt"].read_text().splitlines()
    }
    assert held and not held & {"q0", "q1", "q2", "again"}
    with pytest.raises(ValueError, match="turns='every'"):
        real_model.prepare_data(tmp_path / "sg.json", None, tmp_path / "o2", train_records=3, eval_prompts=4,
                                turns="every")  # fmt: skip


def test_evaluate_only_names_an_export_that_exists(tmp_path):
    """``evaluate --only`` (phase d's second pass, drafting through SDPA) refuses a name it has no export for,
    naming those it has, before loading any model."""
    import subprocess
    import sys

    (tmp_path / "drafters" / "ours-target-8min").mkdir(parents=True)
    cmd = [sys.executable, "bench/real_model.py", "evaluate", "--target", str(tmp_path / "t.gguf")]
    cmd += ["--out", str(tmp_path), "--only", "ours-target-9min", "--draft-attention", "sdpa"]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "--only ours-target-9min: no such export (have: ours-target-8min)" in done.stderr
