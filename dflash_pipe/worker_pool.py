"""The worker processes a producer starts: the ``dflash-pipe worker`` command line (the one users run to
attach), the environment it gets, and ``WorkerPool``, which starts one per drafter device (or one running
a drafter thread per device, ``--drafter-mode threads``), watches them and stops them.

Workers run in their own process session so a terminal Ctrl-C reaches only the producer, which drains them
in order. Each worker's output goes to RUN_DIR/logs/; a worker dying is reported (name, exit status, last
log lines) and the run goes on with the others. Workers that outlived a killed producer are adopted by
``launch --resume``, not doubled. Below both the launcher and an attaching producer
(``producer.attach``), which start workers alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dflash_pipe.cpus import threads_per_process, usable_cpus
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.dir import RunDir

# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs out of service).
SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def compile_cache_env(cache_dir: Path, *, workers_on_host: int) -> dict[str, str]:
    """Set before torch is imported in a worker: one cache per run, bounded compile threads."""
    cpus = usable_cpus()
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
    redirect: bool = True,
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
    if not redirect:
        cmd += ["--no-redirect"]
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
        running = {w["name"]: w for w in previous or [] if _is_worker_process(int(w["pid"]), self.address)}
        for i, devices in enumerate(self.cfg.layout.worker_processes()):
            name, device = f"{self.prefix}worker{i}", ",".join(devices)
            if name in running:
                self.adopted.append(AdoptedWorker(name, device, int(running[name]["pid"])))
                continue
            cmd = self.worker_command(name, device)
            env = {**os.environ, **SAFE_GPU_ENV, "PYTHONUNBUFFERED": "1"}
            env.update(compile_cache_env(self.cfg.cache_dir, workers_on_host=drafters))
            if devices[0] == "cpu":
                env["OMP_NUM_THREADS"] = str(threads_per_process(drafters + 1, share=len(devices)))
            log_path = logs / f"{name}.log"
            log = open(log_path, "ab")  # noqa: SIM115 -- held open for the child; closed in stop()
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
