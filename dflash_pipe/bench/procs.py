"""Bench child processes, started as the launcher starts workers (same environment, one per device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_pipe.cpus import threads_per_process


def child_env(cache_dir: Path, device: str, workers: int) -> dict[str, str]:
    """The environment the launcher gives a worker: shared compile cache, bounded threads, safe NCCL."""
    from dflash_pipe.worker_pool import SAFE_GPU_ENV, compile_cache_env

    env = {**os.environ, **SAFE_GPU_ENV, "PYTHONUNBUFFERED": "1"}
    env.update(compile_cache_env(cache_dir, workers_on_host=workers))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(threads_per_process(workers + 1))
    return env


@dataclass(slots=True)
class Children:
    """Child processes of one stage: ``python -m dflash_pipe.bench.child KIND SPEC OUT`` each."""

    kind: str
    procs: list[tuple[subprocess.Popen, Any, Path, Path]]

    def wait(self, timeout_s: float) -> list[dict]:
        """Each child's result. When one fails (or ``timeout_s`` passes) the others are killed too, so
        a lockstep partner never hangs in a collective; the error shows the end of each failed log."""
        deadline = time.monotonic() + timeout_s
        try:
            while any(proc.poll() is None for proc, *_ in self.procs):
                if self.failed() or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            self.kill()
        results, failures = [], []
        for proc, _, out_path, log_path in self.procs:
            if proc.returncode == 0 and out_path.exists():
                results.append(json.loads(out_path.read_text()))
                continue
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            why = (
                f"exited with {proc.returncode}" if proc.returncode != -9 else "was stopped (see the others)"
            )
            failures.append(f"bench {self.kind} process ({log_path}) {why}:\n{tail}")
        if failures:
            if time.monotonic() > deadline:
                failures.insert(0, f"bench {self.kind} processes did not finish within {timeout_s:.0f} s")
            raise RuntimeError("\n".join(failures))
        return results

    def failed(self) -> bool:
        """Whether a child has already exited with an error."""
        return any(proc.poll() not in (None, 0) for proc, *_ in self.procs)

    def kill(self) -> None:
        """Kills the children still running; safe to call twice."""
        for proc, log, _, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def start_children(folder: Path, cache_dir: Path, kind: str, specs: list[dict[str, Any]]) -> Children:
    """One child per spec, all at once, each with the launcher's worker environment on ``cache_dir``;
    ``spec["started"]`` is the wall time just before its process starts."""
    tag = f"{kind}-{uuid.uuid4().hex[:6]}"
    folder.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, spec in enumerate(specs):
        spec_path, out_path, log_path = (
            folder / f"{tag}-{i}.{ext}" for ext in ("spec.json", "out.json", "log")
        )
        spec_path.write_text(json.dumps({**spec, "started": time.time()}))
        log = open(log_path, "wb")  # noqa: SIM115 -- closed by Children.wait / kill
        cmd = [sys.executable, "-m", "dflash_pipe.bench.child", kind, str(spec_path), str(out_path)]
        env = child_env(cache_dir, spec["device"], len(specs))
        procs.append(
            (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, out_path, log_path)
        )
    return Children(kind, procs)
