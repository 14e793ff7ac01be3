"""What the producer counts and says: the step, the stages' rates, the ACK window, the checkpoints, the
workers' latest training figures and the dashboard's lines.

``Accounting`` owns these counters; nothing outside it writes them (a test reads the code to keep it
so). The summary and the dashboard read them (``producer.display``, which builds a fresh ``RunState``
each time: the dashboard reads a snapshot, never the counters themselves).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dflash_pipe.telemetry import MetricsLogger, RateMeter, TimeShares

MESSAGES_KEPT = 5
"""Lines the dashboard shows at once (the latest)."""


class Accounting:
    """The run's counters, its latest training figures and the lines the dashboard shows."""

    def __init__(
        self, *, metrics: MetricsLogger, step: int, warn: Callable[[str], None] | None = None
    ) -> None:
        """``step``: where this launch starts (the resumed checkpoint's). ``warn(line)``: the console a
        lost worker or a checkpoint is announced on (the dashboard's)."""
        self.metrics = metrics
        self.warn = warn or (lambda _line: None)
        self.step = step
        self.messages: list[str] = []
        self.target_rate = RateMeter()
        self.wire_rate = RateMeter()
        self.train_rate = RateMeter()
        self.loss: float | None = None
        self.acc: list[float] = []
        self.lr: float | None = None
        self.tau: float | None = None
        self.real_tau: float | None = None
        self.last_checkpoint: str | None = None
        self.last_checkpoint_at: float | None = None
        """When the latest CHECKPOINT arrived (monotonic): a drain's summary says whether one came after the
        signal."""
        self.save_asked: str | None = None
        """Why a checkpoint was asked of the workers (a preemption signal) and has not arrived yet."""
        self.bye_reason: str | None = None
        self.first_ack: tuple[float, int] | None = None
        self.window_start: tuple[int, float, int, float] | None = None
        """(step, time, acked tokens, produced tokens) at the latest ACK of the first trained step."""
        self.last_ack: tuple[float, int, float] | None = None
        """(time, acked tokens, produced tokens) at the latest ACK."""
        self.waits = TimeShares()
        """From the first ACK to DONE: idle target share, starved worker share, ready queue depth."""
        self.attached_first_steps: dict[str, float] = {}
        """Time to the first step of each worker of an attaching producer (its METRICS name it)."""
        self.sent_by_ref = {"shm": 0, "cuda_ipc": 0}
        """BATCHes whose features went through each ring (a slot reference) instead of socket frames."""

    def note(self, text: str) -> None:
        self.messages = (self.messages + [text])[-MESSAGES_KEPT:]

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """``values`` into ``metrics.jsonl`` at ``step`` (default: the run's step now)."""
        self.metrics.log(values, self.step if step is None else step)

    def acked(self, step: int, tokens: int, acked_total: int) -> None:
        """An ACK of ``step``, which trained ``tokens`` (``acked_total`` since the launch)."""
        now, produced = time.monotonic(), self.target_rate.total
        if self.first_ack is None:
            self.first_ack = (now, acked_total)
        if self.window_start is None or self.window_start[0] == step:
            self.window_start = (step, now, acked_total, produced)
        self.last_ack = (now, acked_total, produced)
        self.train_rate.add(tokens)
        self.step = max(self.step, step)

    def checkpoint_asked(self, why: str) -> None:
        self.save_asked = why

    def checkpoint_arrived(self, path: str, step: int) -> None:
        self.last_checkpoint, self.last_checkpoint_at = path, time.monotonic()
        if self.save_asked is not None:
            self.warn(f"checkpoint written at step {step} ({self.save_asked}): {path}")
            self.save_asked = None

    def bye(self, reason: str) -> None:
        """A peer's BYE: the first reason is the run's, should every worker leave."""
        self.bye_reason = self.bye_reason or reason

    def batch_sent(self, tokens: int, ring: str | None) -> None:
        """A BATCH of ``tokens`` went to a worker; ``ring``: the ring its features went through by
        reference (``shm``, ``cuda_ipc``), None for socket frames."""
        self.wire_rate.add(tokens)
        if ring is not None:
            self.sent_by_ref[ring] += 1

    def attached_first_step(self, worker: str, seconds: float) -> None:
        self.attached_first_steps[worker] = seconds

    def trained(self, values: dict[str, Any]) -> None:
        """A training record's loss, per-slot accuracy and learning rate."""
        self.loss = float(values["loss"])
        self.acc = list(values.get("acc", []))
        self.lr = float(values.get("lr", 0.0))

    def evaluated(self, values: dict[str, Any]) -> None:
        """An evaluation's simulated and real tau, whichever it has."""
        if "simulated/tau" in values:
            self.tau = float(values["simulated/tau"])
        if "real/tau" in values:
            self.real_tau = float(values["real/tau"])

    def observe_waits(self, *, target_idle: float, workers_starved: float, queue_depth: float) -> None:
        if self.first_ack is not None:
            self.waits.observe(
                time.monotonic(),
                target_idle=target_idle,
                workers_starved=workers_starved,
                queue_depth=queue_depth,
            )
