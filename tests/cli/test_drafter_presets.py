"""--drafter-preset and its config key: the preset's fields land in drafter.*, the normal flags and the config
file override them, --help lists every preset, and bad combinations name the flag to change."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from dflash_pipe.cli import main
from dflash_pipe.config.presets import PRESETS

SLIDING, FULL = "sliding_attention", "full_attention"


def drafter_section(*args: str) -> dict:
    result = CliRunner().invoke(
        main, ["launch", "--device", "cpu", "--print-config", *args], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)["drafter"]


def test_each_preset_sets_its_fields_over_the_demo_defaults() -> None:
    expected = {
        "qwen3-8b": (5, 16, [FULL] * 5, None),
        "qwen3.6-27b": (5, 16, [SLIDING] * 4 + [FULL], 2048),
        "qwen3.5-35b-a3b": (8, 16, [FULL] * 8, None),
        "llama3.1-8b": (5, 10, [FULL] * 5, None),
    }
    assert set(expected) <= set(PRESETS)
    for name, (layers, bs, types, window) in expected.items():
        d = drafter_section("--drafter-preset", name)  # the demo's default depth is 3: the preset wins
        assert (d["preset"], d["num_layers"], d["block_size"], d["layer_types"], d["sliding_window"]) == (
            name,
            layers,
            bs,
            types,
            window,
        )
        assert d["max_anchors"] == 32  # a field the preset does not set keeps the demo default


def test_flags_and_file_override_a_preset(tmp_path: Path) -> None:
    d = drafter_section("--drafter-preset", "qwen3.6-27b", "--sliding-window", "64", "--block-size", "8")
    assert d["sliding_window"] == 64 and d["block_size"] == 8 and d["layer_types"][0] == SLIDING
    d = drafter_section("--drafter-preset", "qwen3.6-27b", "--layer-types", "full,full,full,full,full")
    assert d["layer_types"] == [FULL] * 5 and d["sliding_window"] is None  # the preset's window goes too
    f = tmp_path / "run.yaml"
    f.write_text("drafter: {preset: qwen3.6-27b, sliding_window: 512}\n")
    d = drafter_section("--config", str(f))
    assert d["sliding_window"] == 512 and d["layer_types"] == [SLIDING] * 4 + [FULL]
    d = drafter_section("--config", str(f), "--draft-layers", "2", "--layer-types", "sliding,full")
    assert d["num_layers"] == 2 and d["layer_types"] == [SLIDING, FULL] and d["sliding_window"] == 512


def test_bad_combinations_name_the_flag() -> None:
    runner = CliRunner()
    cases = {
        ("--drafter-preset", "qwen3.6-27b", "--draft-layers", "3"): "--layer-types",
        ("--layer-types", "sliding,full,full"): "--sliding-window",
        ("--sliding-window", "64"): "no layer is sliding_attention",
        (
            "--layer-types",
            "sliding,diagonal,full",
            "--sliding-window",
            "8",
        ): "full_attention, sliding_attention",
        ("--drafter-preset", "gpt-5"): "gpt-5",
    }
    for args, needle in cases.items():
        result = runner.invoke(main, ["launch", "--device", "cpu", "--print-config", *args])
        assert result.exit_code != 0 and needle in result.output, (args, result.output)


def test_help_lists_every_preset() -> None:
    text = " ".join(CliRunner().invoke(main, ["launch", "--help"]).output.split())
    for preset in PRESETS.values():
        assert preset.name in text and preset.summary() in text
