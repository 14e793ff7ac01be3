"""``dflash-pipe launch``: the producer in this process, one worker process per drafter device.

With ``--drafter-mode threads``, one worker process instead, running a drafter thread per drafter device
(``worker/threads.py``); to the producer it is a single peer holding the credits of all its drafters.

Workers run ``python -m dflash_pipe worker`` (the same command users run to attach), started, watched and
stopped by ``worker_pool.WorkerPool``; a worker dying is reported and the run goes on with the others.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_pipe.cpus import threads_per_process
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.worker_pool import SAFE_GPU_ENV, WorkerPool

if TYPE_CHECKING:
    from dflash_pipe.producer.setup import RunContext
    from dflash_pipe.run.resume import LaunchCheck, ResumePoint


def prepare(
    cfg: RunConfig, *, resume: bool, point: ResumePoint | None = None, live: bool | None = None
) -> tuple[RunContext, Future]:
    """The run's context, with its target replicas loading: the data tokenizes in the background (worker
    processes for a big file) while a thread puts the target's weights on its devices; only the set-up that
    needs the data (ledger, train/eval split) waits for it. The future's ``result()`` is the replicas (or the
    loading error); ``ProducerProc`` waits for it when it starts serving. ``point``: the resumed checkpoint
    the checks under the run dir's lock read (once)."""
    from dflash_pipe.producer import target_threads
    from dflash_pipe.producer.setup import start_run

    # leaving the block stops the tokenization on any error
    with start_run(cfg, resume=resume, point=point, progress=live) as pending:
        loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-target-load")
        replicas = loader.submit(target_threads.load_replicas, pending)
        loader.shutdown(wait=False)  # the thread ends when the target is loaded
        return pending.context(), replicas


def launch(cfg: RunConfig, *, resume: bool, console, live: bool | None = None):
    """Takes the run dir (refused while another launch holds it), checks a resumed run before anything
    loads (finished: ``RunComplete``; damaged: ``RunDirError``), then runs it (``_launch``)."""
    from rich.markup import escape

    from dflash_pipe.run.resume import check_launch
    from dflash_pipe.run.signals import Signals

    stop = HardStop(cfg.run_dir)
    signals = Signals(
        stop_timeout_s=cfg.wire.stop_timeout_s, preempt=cfg.wire.preempt_signal, on_hard_stop=stop
    ).install()
    stop.signals = signals
    try:
        with RunDir(cfg.run_dir).lock(check=lambda: check_launch(cfg, resume=resume)) as lock:
            stop.lock = lock
            for note in lock.notes:
                console.print(f"[yellow]warning:[/] {escape(note)}")
            return _launch(cfg, resume=resume, checked=lock.checked, console=console, live=live, stop=stop)
    finally:
        signals.restore()


class HardStop:
    """How a launch stops when draining is not an option (a second signal, or a drain past --stop-timeout):
    its workers killed, the run dir marked released, one line saying what the latest checkpoint is, exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.signals: Any = None
        self.lock: Any = None
        self.pool: WorkerPool | None = None

    def __call__(self, reason: str, code: int) -> None:
        try:
            if self.pool is not None:
                self.pool.kill()
            since = self.signals.stopped_wall if self.signals is not None else None
            line = f"run stopped: {reason}; {checkpoint_note(self.run_dir, since)}"
            if self.lock is not None:
                self.lock.mark_released()
            sys.stderr.write(f"{line}\nResume with: dflash-pipe launch --resume {self.run_dir}\n")
            sys.stderr.flush()
        finally:
            os._exit(code)


def checkpoint_note(run_dir: Path, since: float | None) -> str:
    """What the run dir holds, as read from disk: a checkpoint written since ``since`` (time.time()), an
    older one, or none."""
    from dflash_pipe.run.checkpoint import written_at

    try:
        latest = RunDir(run_dir).latest_checkpoint()
    except (OSError, ValueError):
        latest = None
    if latest is None:
        return "no checkpoint was written"
    at = written_at(latest)
    if since is not None and at is not None and at >= since:
        return f"the final checkpoint {latest.name} was written"
    return f"no final checkpoint; the latest is {latest.name}"


def _launch(
    cfg: RunConfig, *, resume: bool, checked: LaunchCheck | None, console, live: bool | None, stop: HardStop
):
    """Prepares the run (the target loads while the data tokenizes), starts producer and workers, and
    returns the producer's summary."""
    import torch
    from transformers.utils import logging as hf_logging

    from dflash_pipe.config.mask_token import mask_line
    from dflash_pipe.producer.build import ProducerParts
    from dflash_pipe.producer.proc import DRAIN_MARGIN_S, ProducerProc

    if cfg.layout.device == "cpu":
        torch.set_num_threads(threads_per_process(cfg.layout.num_workers + 1))
    else:
        cfg.layout.validate_against(torch.cuda.device_count())
        if shared := cfg.layout.shared_gpus():
            console.print(
                f"[yellow]note:[/] GPUs {shared} host both the target and a drafter worker; they share memory and compute."
            )
    for key, value in SAFE_GPU_ENV.items():
        os.environ.setdefault(key, value)
    hf_logging.disable_progress_bar()
    from dflash_pipe.producer.setup import check_open_work
    from dflash_pipe.run.record import read_record, record_complete, write_record

    point = checked.resume if checked is not None else None
    ctx, replicas = prepare(cfg, resume=resume, point=point, live=live)
    check_open_work(ctx)
    previous = read_record(cfg.run_dir).get("workers", []) if resume else []
    parts = ProducerParts(ctx, replicas=replicas, signals=stop.signals, console=console, live=live)
    producer = ProducerProc(parts)
    console.print(
        f"[bold]dflash-pipe[/] run {ctx.run_id}: producer at {producer.address}, "
        f"{cfg.layout.num_workers} drafter(s) on {', '.join(cfg.layout.worker_devices())} "
        f"({'threads of one worker process' if cfg.layout.drafter_mode == 'threads' else 'one process each'}), "
        f"{len(ctx.train_samples)} training samples, run dir {cfg.run_dir}"
        + (f", resuming from {ctx.resume_from.name}" if ctx.resume_from else "")
    )
    console.print(mask_line(ctx.drafter), markup=False, highlight=False)
    if cfg.train.min_workers > 1:
        console.print(f"note: first step {cfg.first_step_note()}", markup=False, highlight=False)
    for note in ctx.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    left_out = ctx.data.skipped_lines + sum(ctx.data.drop_reasons.values()) + ctx.data.truncated
    if ctx.regen is None and left_out:
        from dflash_pipe.producer.display import data_lines, data_report

        console.print(data_lines(data_report(producer.core))[0], markup=False, highlight=False)
    pool = stop.pool = WorkerPool(cfg, producer.address)
    try:
        pool.start(previous)
        write_record(cfg.run_dir, workers=pool.records())
        if pool.adopted:
            names = ", ".join(f"{a.name} (pid {a.pid})" for a in pool.adopted)
            console.print(f"adopting worker(s) still running from the previous producer: {names}")
        summary = producer.serve(watch=pool)
        left = stop.signals.drain_left_s(DRAIN_MARGIN_S)  # a worker that never joined heard no DONE
        pool.wait(timeout_s=60 if left is None else min(10.0, left))
        if producer.core.leases.scheduler.finished() and summary.steps > 0:  # 0 steps is never complete
            record_complete(cfg.run_dir, checkpoint=summary.last_checkpoint, epochs=cfg.train.epochs)
        return summary
    finally:
        producer.close()
        pool.stop()
