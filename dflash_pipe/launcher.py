"""``dflash-pipe launch``: the producer in this process, one worker process per drafter device.

With ``--drafter-mode threads``, one worker process instead, running a drafter thread per drafter device
(``worker/threads.py``); to the producer it is a single peer holding the credits of all its drafters.

Workers run ``python -m dflash_pipe worker`` (the same command users run to attach), in their own process
session so a terminal Ctrl-C reaches only the producer, which drains them in order. Each worker's output
goes to RUN_DIR/logs/; a worker dying is reported (name, exit status, last log lines) and the run goes on
with the others. Workers that outlived a killed producer are adopted by ``launch --resume``, not doubled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.dir import RunDir

if TYPE_CHECKING:
    from dflash_pipe.producer.setup import RunContext

# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs out of service).
SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def compile_cache_env(cache_dir: Path, *, workers_on_host: int) -> dict[str, str]:
    """Set before torch is imported in a worker: one cache per run, bounded compile threads."""
    cpus = os.cpu_count() or 1
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TRITON_CACHE_DIR": str(cache_dir / "triton"),
        "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, min(8, cpus // max(workers_on_host, 1)))),
    }


def worker_command(
    address: str,
    device: str,
    *,
    name: str,
    threads: bool = False,
    keys: Path | None = None,
    join_timeout_s: float | None = None,
    reconnect_timeout_s: float | None = None,
    stop_timeout_s: float | None = None,
    compile_cache: Path | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The ``dflash-pipe worker`` command line (the one users run), wherever one is built: the launcher's
    workers, ``worker --gpus`` (one process per GPU) and ``launch --dry-run``. ``device`` is
    comma-separated for several (``cuda:0,cuda:1``, with ``threads``); None leaves an option to its
    default."""
    cmd = [python, "-m", "dflash_pipe", "worker", "--connect", address, "--device", device, "--name", name]
    if join_timeout_s is not None:
        cmd += ["--join-timeout", str(join_timeout_s)]
    if reconnect_timeout_s is not None:
        cmd += ["--reconnect-timeout", str(reconnect_timeout_s)]
    if stop_timeout_s is not None:
        cmd += ["--stop-timeout", str(stop_timeout_s)]
    if threads:
        cmd += ["--threads"]
    if compile_cache is not None:
        cmd += ["--compile-cache", str(compile_cache)]
    if keys is not None:
        cmd += ["--keys", str(keys)]
    return cmd


def launched_worker_command(
    cfg: RunConfig, address: str, *, name: str, device: str, python: str = sys.executable
) -> list[str]:
    """What ``launch`` runs for one of its workers: the run's keys, its reconnect and stop timeouts and
    drafter mode (the compile cache comes in the environment, ``compile_cache_env``)."""
    return worker_command(
        address,
        device,
        name=name,
        threads=cfg.layout.drafter_mode == "threads",
        keys=cfg.wire.keys,
        reconnect_timeout_s=cfg.wire.reconnect_timeout_s,
        stop_timeout_s=cfg.wire.stop_timeout_s,
        python=python,
    )


@dataclass(slots=True)
class WorkerProcess:
    name: str
    device: str
    proc: subprocess.Popen
    log_path: Path
    log: IO[bytes]
    reported: bool = False


@dataclass(slots=True)
class AdoptedWorker:
    """A worker started by a previous (killed) producer of this run; it reconnects by itself."""

    name: str
    device: str
    pid: int
    reported: bool = False

    def running(self) -> bool:
        return _is_worker_process(self.pid)


class WorkerPool:
    def __init__(self, cfg: RunConfig, address: str, *, prefix: str = "", logs: Path | None = None) -> None:
        """``prefix`` and ``logs``: an attaching producer's workers are named ``NAME-worker0`` ... and log
        under its own directory, beside the coordinator's ``worker0`` ... in ``RUN_DIR/logs``."""
        self.cfg = cfg
        self.address = address
        self.prefix = prefix
        self.logs = logs if logs is not None else RunDir(cfg.run_dir).logs
        self.workers: list[WorkerProcess] = []
        self.adopted: list[AdoptedWorker] = []

    def start(self, previous: list[dict] | None = None) -> None:
        """One worker per drafter device (or one for all, threaded), except those a previous producer
        started that still run."""
        logs = self.logs
        logs.mkdir(parents=True, exist_ok=True)
        drafters = self.cfg.layout.num_workers
        cpus = os.cpu_count() or 1
        running = {w["name"]: w for w in previous or [] if _is_worker_process(int(w["pid"]), self.address)}
        for i, devices in enumerate(self.cfg.layout.worker_processes()):
            name, device = f"{self.prefix}worker{i}", ",".join(devices)
            if name in running:
                self.adopted.append(AdoptedWorker(name, device, int(running[name]["pid"])))
                continue
            env = {**os.environ, **SAFE_GPU_ENV, "PYTHONUNBUFFERED": "1"}
            env.update(compile_cache_env(self.cfg.cache_dir, workers_on_host=drafters))
            if devices[0] == "cpu":
                env["OMP_NUM_THREADS"] = str(max(1, cpus * len(devices) // (drafters + 1)))
            log_path = logs / f"{name}.log"
            log = open(log_path, "ab")  # noqa: SIM115 -- held open for the child; closed in stop()
            cmd = self.worker_command(name, device)
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.workers.append(WorkerProcess(name, device, proc, log_path, log))

    def worker_command(self, name: str, device: str) -> list[str]:
        """The command line of one launched worker (``launched_worker_command``)."""
        return launched_worker_command(self.cfg, self.address, name=name, device=device)

    def records(self) -> list[dict]:
        """For RUN_DIR/producer.json: which worker processes serve this run."""
        own = [{"name": w.name, "device": w.device, "pid": w.proc.pid} for w in self.workers]
        return own + [{"name": w.name, "device": w.device, "pid": w.pid} for w in self.adopted]

    def newly_failed(self) -> list[tuple[str, str]]:
        """(name, what happened) for each worker that exited with an error since the last call."""
        failed = []
        for w in self.workers:
            rc = w.proc.poll()
            if rc not in (None, 0) and not w.reported:
                w.reported = True
                why = f"exited with {_describe(rc)}.\n{_tail(w.log_path)}"
                failed.append((w.name, why))
        for a in self.adopted:
            if not a.reported and not a.running():
                a.reported = True
                failed.append((a.name, "exited (started by the previous producer; exit status unknown)"))
        return failed

    def alive(self) -> int:
        return sum(w.proc.poll() is None for w in self.workers) + sum(a.running() for a in self.adopted)

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (a worker's drain signal), then SIGKILL whatever is left. Safe to call twice."""
        alive = [w for w in self.workers if w.proc.poll() is None]
        for w in alive:
            w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in alive:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for a in self.adopted:  # not our children: signal by pid, poll for the exit
            if a.running():
                os.kill(a.pid, signal.SIGTERM)
        while any(a.running() for a in self.adopted) and time.monotonic() < deadline:
            time.sleep(0.1)
        for a in self.adopted:
            if a.running():
                os.kill(a.pid, signal.SIGKILL)
        for w in self.workers:
            w.log.close()

    def kill(self) -> None:
        """SIGKILL every worker of this run at once (a hard stop; their checkpoints are atomic)."""
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(OSError):
                    w.proc.kill()
        for a in self.adopted:
            if a.running():
                with contextlib.suppress(OSError):
                    os.kill(a.pid, signal.SIGKILL)


def _is_worker_process(pid: int, address: str | None = None) -> bool:
    """Whether ``pid`` is a running ``dflash_pipe worker`` (connected to ``address`` when given)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state == "Z" or b"dflash_pipe" not in argv or b"worker" not in argv:
        return False
    return address is None or address.encode() in argv


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"last lines of {path}:\n" + "\n".join("  " + line for line in text)


def prepare(cfg: RunConfig, *, resume: bool, live: bool | None = None) -> tuple[RunContext, Future]:
    """The run's context, with its target replicas loading: the data tokenizes in the background (worker
    processes for a big file) while a thread puts the target's weights on its devices; only the set-up that
    needs the data (ledger, train/eval split) waits for it. The future's ``result()`` is the replicas (or the
    loading error); ``ProducerProc`` waits for it when it starts serving."""
    from dflash_pipe.producer import target_threads
    from dflash_pipe.producer.setup import start_run

    with start_run(cfg, resume=resume, progress=live) as pending:  # stops the tokenization on any error
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
            return _launch(cfg, resume=resume, console=console, live=live, stop=stop)
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


def _launch(cfg: RunConfig, *, resume: bool, console, live: bool | None, stop: HardStop):
    """Prepares the run (the target loads while the data tokenizes), starts producer and workers, and
    returns the producer's summary."""
    import torch
    from transformers.utils import logging as hf_logging

    from dflash_pipe.producer.proc import ProducerProc

    if cfg.layout.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (cfg.layout.num_workers + 1)))
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
    from dflash_pipe.run.record import read_record, write_record
    from dflash_pipe.run.resume import record_complete

    ctx, replicas = prepare(cfg, resume=resume, live=live)
    check_open_work(ctx)
    previous = read_record(cfg.run_dir).get("workers", []) if resume else []
    producer = ProducerProc(ctx, console=console, live=live, replicas=replicas, signals=stop.signals)
    pool = stop.pool = WorkerPool(cfg, producer.address)
    console.print(
        f"[bold]dflash-pipe[/] run {ctx.run_id}: producer at {producer.address}, "
        f"{cfg.layout.num_workers} drafter(s) on {', '.join(cfg.layout.worker_devices())} "
        f"({'threads of one worker process' if cfg.layout.drafter_mode == 'threads' else 'one process each'}), "
        f"{len(ctx.train_samples)} training samples, run dir {cfg.run_dir}"
        + (f", resuming from {ctx.resume_from.name}" if ctx.resume_from else "")
    )
    for note in ctx.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    left_out = ctx.data.skipped_lines + sum(ctx.data.drop_reasons.values()) + ctx.data.truncated
    if ctx.regen is None and left_out:
        from dflash_pipe.producer.display import data_lines, data_report

        console.print(data_lines(data_report(producer.core))[0], markup=False, highlight=False)
    try:
        pool.start(previous)
        write_record(cfg.run_dir, workers=pool.records())
        if pool.adopted:
            names = ", ".join(f"{a.name} (pid {a.pid})" for a in pool.adopted)
            console.print(f"adopting worker(s) still running from the previous producer: {names}")
        summary = producer.serve(watch=pool)
        pool.wait(timeout_s=10 if stop.signals.stop.is_set() else 60)
        if producer.core.scheduler.finished() and summary.steps > 0:  # 0 steps is never complete
            record_complete(cfg.run_dir, checkpoint=summary.last_checkpoint, epochs=cfg.train.epochs)
        return summary
    finally:
        producer.close()
        pool.stop()
