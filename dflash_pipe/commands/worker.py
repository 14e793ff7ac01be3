"""``dflash-pipe worker``: drafter worker(s) that connect to a producer (one process per device, or one
process with a drafter thread per device)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from dflash_pipe.commands import STARTED
from dflash_pipe.run.config import WireConfig


@click.command()
@click.option(
    "--connect", required=True, help="The producer's address, as `launch` printed it (tcp://HOST:PORT)."
)
@click.option("--device", help="Device of this worker: cpu or cuda:N; comma-separated for several.")
@click.option("--gpus", help="Start one worker per GPU, e.g. 6 or 6,7.")
@click.option(
    "--threads",
    is_flag=True,
    help="One process for all the devices, a drafter thread each (launch --drafter-mode threads).",
)
@click.option("--name", help="Worker name in logs and the dashboard (default: HOST-DEVICE).")
@click.option(
    "--compile-cache", type=click.Path(path_type=Path), help="torch.compile cache dir to share with the run."
)
@click.option(
    "--join-timeout",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds to wait for the producer's WELCOME.",
)
@click.option(
    "--keys",
    type=click.Path(path_type=Path),
    help="The producer's CURVE key directory (needs client.key_secret and server.key).",
)
@click.option(
    "--reconnect-timeout",
    type=float,
    default=WireConfig.__dataclass_fields__["reconnect_timeout_s"].default,
    show_default=True,
    help="If the producer dies, seconds to keep trying the same address (for `launch --resume`); 0 exits.",
)
@click.option(
    "--no-redirect",
    is_flag=True,
    help="Stay with the producer at --connect: the run's coordinator otherwise sends a worker to the "
    "producer attached on its own node, so its features do not cross the network.",
)
@click.option(
    "--stop-timeout",
    type=float,
    default=WireConfig.__dataclass_fields__["stop_timeout_s"].default,
    show_default=True,
    help="After SIGTERM or Ctrl-C: seconds to finish the step and leave before exiting hard.",
)
def worker(
    connect: str,
    device: str | None,
    gpus: str | None,
    threads: bool,
    name: str | None,
    compile_cache: Path | None,
    join_timeout: float,
    keys: Path | None,
    reconnect_timeout: float,
    no_redirect: bool,
    stop_timeout: float,
) -> None:
    """Run drafter worker(s) that connect to a producer.

    \b
    Examples:
      dflash-pipe worker --connect tcp://10.0.0.5:5555 --gpus 6,7
      dflash-pipe worker --connect tcp://127.0.0.1:5555 --device cpu
      dflash-pipe worker --connect tcp://10.0.0.5:5555 --gpus 6,7 --threads   # one process, two threads

    \b
    Given the run's coordinator, a worker on a node where a producer of the run is attached (`dflash-pipe
    producer --connect`) is sent to that producer and trains on its features (shared memory or CUDA IPC),
    unless --no-redirect.
    """
    import socket
    import subprocess

    from dflash_pipe.run.layout import parse_gpu_spec
    from dflash_pipe.worker_pool import SAFE_GPU_ENV, compile_cache_env, worker_command

    if bool(device) == bool(gpus):
        raise click.UsageError("Give exactly one of --device (cpu, cuda:N) or --gpus (e.g. 6,7).")
    devices = device.split(",") if device else [f"cuda:{i}" for i in parse_gpu_spec(gpus, flag="--gpus")]
    if compile_cache is not None:
        os.environ.update(compile_cache_env(compile_cache, workers_on_host=len(devices)))
    for key, value in SAFE_GPU_ENV.items():
        os.environ.setdefault(key, value)
    host = socket.gethostname()
    if len(devices) > 1 and not threads:
        procs = [
            subprocess.Popen(
                worker_command(
                    connect,
                    d,
                    name=f"{name or host}-{d}",
                    join_timeout_s=join_timeout,
                    reconnect_timeout_s=reconnect_timeout,
                    stop_timeout_s=stop_timeout,
                    compile_cache=compile_cache,
                    keys=keys,
                    redirect=not no_redirect,
                )
            )
            for d in devices
        ]
        _forward_stop_signals(procs)
        sys.exit(max(p.wait() for p in procs))
    from dflash_pipe.worker.proc import run_worker

    sys.exit(
        run_worker(
            connect,
            device=",".join(devices),
            name=name or f"{host}-{'+'.join(devices)}",
            join_timeout_s=join_timeout,
            started_at=STARTED,
            keys=keys,
            reconnect_timeout_s=reconnect_timeout,
            stop_timeout_s=stop_timeout,
            redirect=not no_redirect,
        )
    )


def _forward_stop_signals(procs: list) -> None:
    """``worker --gpus 6,7``: SIGTERM to this parent drains each child worker as it would drain one; a
    terminal's Ctrl-C already reaches every child (one process group), so the parent only waits for them."""
    import signal

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
