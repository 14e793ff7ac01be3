"""bench/spec_eval_cost.py in its CPU mode: the rows, their forward counts, and the JSON with provenance."""

from __future__ import annotations

import importlib.util
import json

from tests.bench.helpers import ROOT

_spec = importlib.util.spec_from_file_location("spec_eval_cost", ROOT / "bench" / "spec_eval_cost.py")
spec_eval_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spec_eval_cost)


def test_cpu_mode_measures_both_bounds_and_the_check(tmp_path) -> None:
    result = spec_eval_cost.main(["--cpu", "--out", str(tmp_path)])
    rows = {r["decoding"]: r for r in result.rows}
    assert set(rows) == {"random drafter", "oracle drafts", "greedy (the check)"}
    new = result.config["max_new_tokens"]
    bs = result.config["block_size"]
    for kind in ("random drafter", "oracle drafts"):
        r = rows[kind]
        assert r["tokens_per_prompt"] == new and r["not_lossless"] == 0
        assert r["target_forwards_per_prompt"] == r["drafter_forwards_per_prompt"] + 1  # the prefill
    assert rows["random drafter"]["tau"] < 1.5 < rows["oracle drafts"]["tau"]
    steps = -(-(new - 1) // bs)  # every token after the prefill's, bs per step
    assert rows["oracle drafts"]["drafter_forwards_per_prompt"] == steps
    assert rows["greedy (the check)"]["target_forwards_per_prompt"] == new
    saved = json.loads((tmp_path / "spec_eval_cost.json").read_text())
    assert saved["provenance"]["versions"]["torch"] and saved["rows"] == result.rows
    assert saved["summary"]["real_eval_s_per_prompt_tau1_with_check"] > 0
