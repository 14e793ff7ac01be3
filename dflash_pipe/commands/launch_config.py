"""From ``dflash-pipe launch`` flags and an optional config file to one validated RunConfig, and its plan.

Precedence, lowest first: the dataclass defaults, the demo's defaults (only without --target-model), the
fields of a drafter preset (--drafter-preset or drafter.preset), the config file, the flags the user typed.
Each flag that sets a config field is declared by that field (``flag`` in its metadata) and made into a
click option by ``commands.options.field_options``; `FLAG_FIELDS` maps them back (the configuration reference shows them
next to each field).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
import warnings
from pathlib import Path
from typing import Any

from dflash_pipe.commands.options import config_flags
from dflash_pipe.config.drafter import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_pipe.config.presets import preset_options
from dflash_pipe.data import demo_data_path
from dflash_pipe.data.sources import found_note
from dflash_pipe.fields import flag_of
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.config_file import ConfigFileError, check_run_file, dump, load_file
from dflash_pipe.run.layout import LayoutConfig, parse_gpu_spec

_FLAGS = [(path, flag_of(f)) for path, f, _ in config_flags()]
FLAG_FIELDS: dict[str, str] = {spec.param_name: path for path, spec in _FLAGS if spec is not None}
"""launch option (click parameter name) -> the RunConfig field it sets: made from the fields' flags."""
_LAYOUT_FLAGS = ("device", "target_gpus", "drafter_gpus", "workers")

DEMO_DEFAULTS: dict[str, Any] = {
    "drafter.num_layers": 3,
    "drafter.max_anchors": 32,
    "train.epochs": 1,
    "data.token_budget": 2048,
    "data.max_length": 512,
    "data.responses": "target",
    "regen.max_new_tokens": 64,
    "train.checkpoint_every": 100,
    "train.eval_max_new_tokens": 128,
}
"""Without --target-model (the built-in demo): a small drafter, one short epoch, trained on the demo
target's own replies (``--responses dataset`` trains on the bundled text instead)."""
RESUME_OVERRIDES = {spec.param_name for _, spec in _FLAGS if spec is not None and spec.resume} | {"live"}
"""Flags that may change on --resume; everything else comes from the run's saved config."""


def load_run_file(path: str | Path) -> dict[str, Any]:
    """A launch config file, checked against RunConfig (unknown keys and bad values name the key)."""
    data = load_file(path)
    layout = data.get("layout")
    if isinstance(layout, dict):
        for key in ("target_gpus", "drafter_gpus"):
            if isinstance(layout.get(key), str):  # "0-4" as on the command line
                try:
                    layout[key] = parse_gpu_spec(layout[key], flag=f"layout.{key}")
                except ValueError as exc:
                    raise ConfigFileError(f"{path}: {exc}") from None
    return check_run_file(data, source=str(path), hints=FLAG_FIELDS)


def build_run_config(
    opts: dict[str, Any], file_values: dict[str, Any] | None = None
) -> tuple[RunConfig, bool]:
    """``opts``: the flags the user gave (None or absent = not given); ``file_values``: `load_run_file`."""
    given = {
        k: v  # `is`, not `in`: 0 == False, and a typed 0 (--tokenize-workers 0, --seed 0) is a value
        for k, v in opts.items()
        if v is not None and v is not False and v != () and not (k == "device" and v == "auto")
    }
    if given.get("resume_dir"):
        if file_values:
            raise ValueError(
                "--config and --resume do not mix: --resume continues with the run's saved config.json "
                "(only --max-steps, --epochs, --peer-timeout, --log and the device flags may change)."
            )
        return _resume_config(given), True
    values: dict[str, Any] = {}
    file_values = file_values or {}
    demo = "target_model" not in given and file_values.get("target_model") is None
    if demo:
        for path, value in DEMO_DEFAULTS.items():
            _set(values, path, value)
    preset = given.get("drafter_preset") or (file_values.get("drafter") or {}).get("preset")
    if preset is not None:  # above the demo defaults, below the file and the flags
        for key, value in preset_options(preset).items():
            _set(values, f"drafter.{key}", value)
        preset_window = values["drafter"]["sliding_window"]
    for key, value in file_values.items():
        if isinstance(value, dict):
            values.setdefault(key, {}).update(value)
        else:
            values[key] = value
    for option, value in given.items():
        path = FLAG_FIELDS.get(option)
        if path is None or path.startswith("layout."):
            continue  # layout flags: layout_from_flags()
        _set(values, path, _flag_value(option, value))
    drafter = values.get("drafter", {})
    window_left_over = preset is not None and drafter.get("sliding_window") == preset_window is not None
    if window_left_over and SLIDING_ATTENTION not in (drafter.get("layer_types") or ()):
        drafter["sliding_window"] = None  # the preset's window, with its layer types overridden to full
    data = values.setdefault("data", {})
    if data.get("path") is None:
        if not demo:
            raise ValueError(
                "--data (or data.path in the config file) is needed with --target-model: "
                "a JSONL file of conversations, parquet/arrow files, a save_to_disk folder or a Hub dataset id "
                "in the local cache."
            )
        data["path"] = demo_data_path()
    values.setdefault("run_dir", Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    values["layout"] = _layout_dict(layout_from_flags(values.get("layout", {}), given))
    return RunConfig.from_dict(values), False


def _resume_config(given: dict[str, Any]) -> RunConfig:
    from dflash_pipe.run.dir import RunDir

    fixed = sorted(set(given) - RESUME_OVERRIDES - {"run_dir", "resume_dir"})
    if fixed:
        flags = ", ".join("--" + k.replace("_", "-") for k in fixed)
        raise ValueError(f"--resume uses the run's saved config; {flags} cannot change on resume.")
    run_dir = Path(given["resume_dir"])
    if "run_dir" in given and Path(given["run_dir"]).resolve() != run_dir.resolve():
        raise ValueError(
            f"--resume {run_dir} continues that run where it is; --run-dir {given['run_dir']} names another "
            "directory. Leave --run-dir out (or copy the run dir there and --resume the copy)."
        )
    cfg = RunDir(run_dir).load_config()
    values = cfg.to_dict()
    for option, value in given.items():  # the allowed overrides, set and validated like a fresh config
        path = FLAG_FIELDS.get(option, "")
        if path and not path.startswith("layout."):
            _set(values, path, _flag_value(option, value))
    if any(FLAG_FIELDS.get(k, "").startswith("layout.") for k in given):  # before validation, with the rest
        saved = {} if "device" in given else _layout_dict(cfg.layout)
        values["layout"] = _layout_dict(layout_from_flags(saved, given))
    return RunConfig.from_dict(values)


_GPU_FLAGS = (("--target-gpus", "target_gpus"), ("--drafter-gpus", "drafter_gpus"))


def layout_from_flags(saved: dict[str, Any], given: dict[str, Any]) -> LayoutConfig:
    """The file's layout section with the device flags on top; unset device = CUDA if a GPU is visible."""
    lay = dict(saved)
    if "device" in given:
        lay["device"] = given["device"]
    if "target_gpus" in given:
        lay["target_gpus"] = parse_gpu_spec(given["target_gpus"], flag="--target-gpus")
    if "drafter_gpus" in given:
        lay["drafter_gpus"] = parse_gpu_spec(given["drafter_gpus"], flag="--drafter-gpus")
    if "workers" in given:
        lay["cpu_workers"] = given["workers"]
    for option, path in FLAG_FIELDS.items():  # any other layout flag sets its field as is
        if path.startswith("layout.") and option not in _LAYOUT_FLAGS and option in given:
            lay[path.removeprefix("layout.")] = given[option]
    gpus = [flag for flag, key in _GPU_FLAGS if lay.get(key)]
    if lay.get("device") == "cpu" and gpus:
        raise ValueError(
            f"--device cpu with {' and '.join(gpus)}: GPUs cannot be used on the CPU. Drop "
            f"{' and '.join(gpus)} to train on the CPU, or drop --device cpu to use those GPUs."
        )
    if lay.get("device") in (None, "auto"):
        import torch

        # GPU ids ask for CUDA: a machine without it is refused (check_machine), never a silent CPU run
        lay["device"] = "cuda" if gpus or torch.cuda.is_available() else "cpu"
    if lay["device"] == "cuda" and not lay.get("target_gpus") and not lay.get("drafter_gpus"):
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError("--device cuda but no GPU is visible; give --target-gpus and --drafter-gpus.")
        lay["target_gpus"], lay["drafter_gpus"] = ((0,), (0,)) if n == 1 else ((0,), tuple(range(1, n)))
        if n == 1:
            warnings.warn("One GPU: the target and the drafter worker share it.", stacklevel=2)
    if lay["device"] == "cuda" and (not lay.get("target_gpus") or not lay.get("drafter_gpus")):
        raise ValueError("Give both --target-gpus and --drafter-gpus (e.g. 0-4 and 5-7).")
    return LayoutConfig(**lay)


def _layout_dict(layout: LayoutConfig) -> dict[str, Any]:
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}


def _flag_value(option: str, value: Any) -> Any:
    if option == "target_layer_ids":
        return tuple(int(x) for x in str(value).split(","))
    if option == "layer_types":
        short = {"full": FULL_ATTENTION, "sliding": SLIDING_ATTENTION}
        return tuple(short.get(t.strip(), t.strip()) for t in str(value).split(","))
    if option == "chat_template_arg":
        return parse_template_args(value)
    if option == "log":
        items = [value] if isinstance(value, str) else list(value)
        return tuple(k.strip() for item in items for k in str(item).split(",") if k.strip())
    return value


def parse_template_args(items: Any) -> dict[str, Any]:
    """``--chat-template-arg KEY=VALUE`` (repeatable) as a dict; VALUE is read as JSON (``false``, ``2``,
    ``"x"``) and otherwise kept as a string."""
    out: dict[str, Any] = {}
    for item in [items] if isinstance(items, str) else list(items):
        key, sep, raw = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--chat-template-arg {item!r}: write KEY=VALUE, e.g. --chat-template-arg enable_thinking=false"
            )
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def _set(values: dict[str, Any], path: str, value: Any) -> None:
    *sections, key = path.split(".")
    for section in sections:
        values = values.setdefault(section, {})
    values[key] = value


# --- --print-config and --dry-run -------------------------------------------------------------------------


def config_text(cfg: RunConfig) -> str:
    """The resolved config as YAML: valid input for ``launch --config``."""
    return dump(cfg.to_dict())


def _target_line(cfg: RunConfig, folder: Path) -> str:
    """The target's family and shape from its config.json, or why a launch would refuse it (no weights read)."""
    from transformers import AutoConfig

    from dflash_pipe.producer.setup import SetupError, check_options_fit_target, check_target_family
    from dflash_pipe.target.families import describe_target

    config = AutoConfig.from_pretrained(str(folder))
    try:
        check_target_family(config, cfg.target_model)
        check_options_fit_target(cfg.drafter, config, cfg.target_model)
    except SetupError as exc:
        return f"[a launch would stop here: {exc}]"
    return describe_target(config)


def plan_text(cfg: RunConfig, *, resume: bool) -> str:
    """What ``launch`` would do with this config; touches no GPU, model or socket."""
    from dflash_pipe.run.dir import RunDir
    from dflash_pipe.run.files import RunDirError
    from dflash_pipe.target.gguf import converted_folder, gguf_source, is_gguf
    from dflash_pipe.telemetry.metrics import sink_problem
    from dflash_pipe.worker_pool import launched_worker_command

    lines = ["dflash-pipe launch --dry-run: the plan (nothing was started).", ""]
    run = RunDir(cfg.run_dir)

    def row(label: str, text: str) -> None:
        lines.append(f"{label:<14} {text}")

    if cfg.target_model is None:
        from dflash_pipe.target import default_cache_dir

        cache = default_cache_dir()
        state = "cached" if (cache / "config.json").exists() else "built and trained (~45 s) on first use"
        row("target", f"built-in demo target at {cache} ({state})")
    elif is_gguf(cfg.target_model):
        folder = converted_folder(cfg.target_model) if cfg.target_model.is_file() else None
        found = folder is not None and gguf_source(folder) is not None
        if folder is None:
            state = "  [no such file on this machine]"
        else:
            state = f" (GGUF, {'converted' if found else 'converted once, on first use,'} to {folder})"
        row("target", f"{cfg.target_model}{state}")
        if found:
            row("", _target_line(cfg, folder))
    else:
        found = (cfg.target_model / "config.json").exists()
        row("target", f"{cfg.target_model}" + ("" if found else "  [no config.json there on this machine]"))
        if found:
            row("", _target_line(cfg, cfg.target_model))
    row(
        "data",
        f"{cfg.data.path}{found_note(cfg.data.path)}"
        + f" (max length {cfg.data.max_length}, token budget {cfg.data.token_budget})",
    )
    if cfg.data.responses == "target":
        g = cfg.regen
        how = (
            "greedy"
            if g.greedy
            else f"temperature {g.temperature}, top-p {g.top_p}, top-k {g.top_k}, seed {g.seed}"
        )
        row(
            "responses",
            f"regenerated by the target turn by turn ({how}, at most {g.max_new_tokens} new tokens a turn) "
            f"into {run.regenerated}, while the drafters train",
        )
    else:
        row("responses", "as in the data file (--responses target: the target's own replies)")
    run_dir = cfg.run_dir
    try:
        run.check(resume=resume)
    except RunDirError as exc:
        row("run dir", f"{run_dir}  [a launch would stop here: {exc}]")
    else:
        state = "resume from its latest checkpoint" if resume else "exists" if run_dir.exists() else "new"
        row("run dir", f"{run_dir} ({state})")
    lay = cfg.layout
    each = "threads of one worker process" if lay.drafter_mode == "threads" else "one worker process each"
    if lay.device == "cpu":
        row("device", f"cpu: the target in this process, {lay.cpu_workers} CPU drafter(s) ({each})")
    else:
        targets = ", ".join(lay.target_devices())
        row("target GPUs", f"{targets} ({len(lay.target_gpus)} replica thread(s) in the producer process)")
        row("drafter GPUs", f"{', '.join(lay.worker_devices())} ({each}, NCCL)")
        shared = sorted(set(lay.target_gpus) & set(lay.drafter_gpus))
        if shared:
            row("", f"GPUs {shared} are shared by the target and a drafter (allowed, with a warning)")
        row("", "GPU ids were not checked against this machine (dry run); a real launch checks them")
    keys = getattr(cfg.wire, "keys", None)
    row(
        "producer",
        f"this process, bound to {cfg.wire.bind}"
        + (f" with CURVE keys from {keys}" if keys else "")
        + f", heartbeat {cfg.wire.heartbeat_s} s, peer timeout {cfg.wire.peer_timeout_s} s",
    )
    processes = lay.worker_processes()
    row("workers", f"{len(processes)} process(es), output in {run.worker_log('workerN')}:")
    for i, devices in enumerate(processes):
        cmd = launched_worker_command(
            cfg, "<producer address>", name=f"worker{i}", device=",".join(devices), python="python"
        )
        lines.append(" " * 15 + shlex.join(cmd))
    if cfg.train.min_workers > 1:
        row("first step", cfg.first_step_note())
    row("compile cache", f"{cfg.cache_dir} (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR)")
    sinks = []
    for kind in dict.fromkeys(["jsonl", *cfg.log]):
        problem = sink_problem(kind)
        sinks.append(kind + (f" [{problem}]" if problem else ""))
    row("metrics", f"{run.metrics}; sinks: {', '.join(sinks)}")
    stop = f"{cfg.train.epochs} epoch(s)" + (
        f" or {cfg.train.max_steps} steps, whichever comes first" if cfg.train.max_steps else ""
    )
    row("stops after", stop + f"; checkpoint every {cfg.train.checkpoint_every} steps and at the end")
    lines += ["", "resolved config (valid input for --config):", "", config_text(cfg)]
    return "\n".join(lines)
