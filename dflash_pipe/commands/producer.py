"""``dflash-pipe producer``: target replicas on another node that attach to a running run, with the drafter
workers of that node (``producer.attach``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import click

from dflash_pipe.commands import console
from dflash_pipe.commands.options import field_options

_LAYOUT = ("device", "target_gpus", "drafter_gpus", "workers", "target_parallel", "drafter_mode")


@click.command()
@click.option(
    "--connect",
    required=True,
    help="The run's coordinator: the address its `launch` printed (`producer at tcp://HOST:PORT`).",
)
@field_options(
    "layout.device",
    "layout.target_gpus",
    "layout.drafter_gpus",
    "layout.cpu_workers",
    "layout.target_parallel",
    "layout.drafter_mode",
    "wire.bind",
)
@click.option("--name", help="This producer's name in the run's dashboard and logs (default: HOST).")
@click.option(
    "--keys",
    type=click.Path(path_type=Path),
    help="The run's CURVE key directory: client keys to reach the coordinator, server keys for a --bind "
    "that is not loopback.",
)
@click.option(
    "--join-timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds to wait for the coordinator's WELCOME.",
)
@click.option("--dry-run", is_flag=True, help="Print what would run (devices, addresses) and start nothing.")
def producer(**opts) -> None:
    """Attach target replicas on this node to a running run, with this node's drafter workers.

    \b
    The run's coordinator (its `launch`) keeps the data order, the ledger and the checkpoints; this
    producer leases batches from it, computes their features on --target-gpus and feeds them to the
    workers on --drafter-gpus through shared memory or CUDA IPC, so features never leave the node. Killed,
    its open batches go back to the run; the run dir must be on storage every node mounts.
    \b
    Examples:
      dflash-pipe producer --connect tcp://10.0.0.5:5555 --keys KEYS --target-gpus 0-3 --drafter-gpus 4-7
      dflash-pipe producer --connect tcp://127.0.0.1:5555 --device cpu --workers 2
    """
    from rich.markup import escape

    from dflash_pipe.commands.launch_config import layout_from_flags
    from dflash_pipe.compute.torch_threads import exit_past_computing
    from dflash_pipe.producer.attach import AttachError, run_attached
    from dflash_pipe.producer.errors import RunAborted
    from dflash_pipe.wire.addresses import DEFAULT_ADDRESS

    given = {k: opts[k] for k in _LAYOUT if opts.get(k) is not None}
    try:
        layout = layout_from_flags({}, given)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    name = opts["name"] or socket.gethostname()
    bind = opts["bind"] or DEFAULT_ADDRESS
    if opts["dry_run"]:
        for line in dry_run_plan(opts["connect"], layout, name=name, bind=bind, keys=opts["keys"]):
            click.echo(line)
        return
    try:
        summary = run_attached(
            opts["connect"],
            layout,
            name=name,
            keys=opts["keys"],
            bind=bind,
            join_timeout_s=opts["join_timeout"],
            console=console,
        )
    except (AttachError, ValueError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(2)
    except RunAborted as exc:
        console.print(f"[red]producer stopped:[/] {escape(str(exc))}")
        sys.exit(1)
    console.print(
        f"producer {name} done: {summary.stop_reason}; "
        f"{summary.acked_tokens} tokens trained from its batches",
        markup=False,
        highlight=False,
    )
    exit_past_computing(lambda line: console.print(line, markup=False, highlight=False))


def dry_run_plan(connect: str, layout, *, name: str, bind: str, keys: Path | None) -> list[str]:
    """What ``producer`` would do, as ``launch --dry-run`` says it for a launch."""
    return [
        f"dflash-pipe producer {name} (dry run): would join the run at {connect}",
        f"  target         {', '.join(layout.target_devices())} ({layout.target_parallel})",
        f"  drafters       {layout.num_workers} on {', '.join(layout.worker_devices())} ({layout.drafter_mode})",
        f"  serves them at {bind}",
        f"  keys           {keys if keys is not None else 'none (the coordinator must be on loopback)'}",
        "  the run's config, data order and checkpoints come from the coordinator",
        "nothing was started",
    ]
