"""``launch --gpus 0-7`` without a split: a probe picks it (``bench.split``), and the launch says why."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_pipe.commands import console


def probe_gpus(typed: dict) -> tuple[int, ...]:
    """``--gpus``: the GPUs a probe splits, with a placeholder split for the config to validate."""
    from dflash_pipe.run.layout import parse_gpu_spec

    spec = typed.pop("gpus", None)
    if not spec:
        return ()
    if typed.get("target_gpus") or typed.get("drafter_gpus"):
        raise click.UsageError(
            "Give --gpus alone (a probe picks the split) or --target-gpus and --drafter-gpus."
        )
    if typed.get("device") == "cpu":
        raise click.UsageError("--gpus with --device cpu: the CPU has no GPUs to split; drop one of them.")
    try:
        ids = parse_gpu_spec(spec, flag="--gpus")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    typed["target_gpus"], typed["drafter_gpus"] = str(ids[0]), ",".join(map(str, ids[1:] or ids))
    return ids


def picked_split(cfg, gpus: tuple[int, ...]):
    """The split the probe picks for ``gpus`` (``bench split`` without --verify), said with its reason."""
    import dataclasses
    import tempfile

    from dflash_pipe.bench.split import run_split_bench

    console.print(f"probing the target and the drafter on GPUs {list(gpus)} to pick the split", markup=False)
    with tempfile.TemporaryDirectory(prefix="dflash-split-") as scratch:
        result = run_split_bench(
            cfg,
            gpus=gpus,
            seconds=3.0,
            work_dir=Path(scratch),
            verify=False,
            progress=lambda t: console.print(f"probe: {t}", markup=False),
        )
    pick = result.summary["pick"]
    if pick == "shared":
        target, drafters = gpus, gpus
    else:
        t = int(pick.split("+")[0])
        target, drafters = gpus[:t], gpus[t:]
    console.print(
        f"split: --target-gpus {','.join(map(str, target))} --drafter-gpus {','.join(map(str, drafters))}: "
        f"{result.summary['why']}",
        markup=False,
        highlight=False,
    )
    layout = dataclasses.replace(cfg.layout, target_gpus=tuple(target), drafter_gpus=tuple(drafters))
    return dataclasses.replace(cfg, layout=layout)
