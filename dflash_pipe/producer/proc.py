"""The producer process: the socket, the target threads and the signals around a ``ProducerCore``.

``ProducerProc`` serves with the parts ``producer.build.ProducerParts`` built from the run's context (the
bound ROUTER, the rendezvous store, metrics, dashboard, rings and the core) and reads no config of its own.
It starts the target threads on the loaded replicas and runs the busy loop, a few named steps: receive,
refill, dispatch, watch, show. What each step decides (plans, leases, accounting) is the core's
(``producer.core``); the dashboard and summary read in ``producer.display``. An attaching producer's link
is ``producer.upstream`` and only its hooks are here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dflash_pipe.producer.balance import balance_hint
from dflash_pipe.producer.build import ProducerParts
from dflash_pipe.producer.core import WorkerWatch
from dflash_pipe.producer.display import ProducerSummary, dashboard_state, data_metrics, data_report, summary
from dflash_pipe.producer.errors import RunAborted
from dflash_pipe.producer.target_threads import TargetThread, build_eval_batches
from dflash_pipe.producer.upstream import CoordinatorLost
from dflash_pipe.target import TargetCore
from dflash_pipe.target.decode.choose import engine_refusal
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.errors import BadMessage

_TICK_S = 0.02
_MAX_MESSAGES_PER_TICK = 256
"""Inbound messages handled per loop turn: all that are waiting (up to this), not one, so many fast workers
never leave their ACKs and READYs queued behind the producer's other work."""
_SHOW_EVERY_S = 0.5
_HINT_EVERY_S = 30.0
TARGET_STOP_TIMEOUT_S = 120.0
"""How long closing waits for each target thread's current batch (a forward of a big target, or its compile);
after a stop signal, no longer than the drain has left (``_drain_left_s``)."""
DRAIN_MARGIN_S = 3.0
"""Of a drain's ``--stop-timeout``, what waiting for the target threads leaves for the summary and exit."""


def drain(
    recv: Callable[[float], tuple[bytes, Any] | None],
    handle: Callable[[bytes, Any], None],
    *,
    limit: int,
    wait_s: float = _TICK_S,
) -> int:
    """Handles every message already waiting, up to ``limit``: the first receive waits up to ``wait_s``,
    the rest take only what is there. Returns how many were handled."""
    handled = 0
    got = recv(wait_s)
    while got is not None:
        handle(*got)
        handled += 1
        if handled >= limit:
            break
        got = recv(0.0)
    return handled


class ProducerProc:
    def __init__(self, parts: ProducerParts) -> None:
        """``parts``: built by ``ProducerParts`` (the launch's, or an attaching producer's with its
        ``upstream``); ``serve`` waits for their target replicas to load."""
        self.endpoint, self.core, self.upstream = parts.endpoint, parts.core, parts.upstream
        self.address = self.endpoint.address
        self.metrics, self.dashboard, self.rings = parts.metrics, parts.dashboard, parts.rings
        self.staging = self.rings.staging
        """Memory the target threads copy features into; the producer closes it."""
        self.signals, self._own_signals = parts.signals, parts.own_signals
        self.targets, self.limits = parts.targets, parts.limits
        self._store = parts.store
        self._threads: list[TargetThread] = []
        self._cores: list[TargetCore] = []
        self._replicas = parts.replicas
        self._closed = False
        self._started = time.monotonic()
        self._hinted: int | None = None
        """The target GPU count of the last balance hint (``_hint``)."""

    # --- set-up ----------------------------------------------------------------------------------------

    def start_targets(self) -> None:
        """One TargetCore per replica (a GPU, or a group of GPUs for a split target), each fed by its own
        thread."""
        if self.upstream is not None:
            self._keep_link_while_loading(self._replicas)
        self._cores = self._replicas.result()
        placed = ", ".join("+".join(str(d) for d in core.devices) for core in self._cores)
        self.core.note(f"target: {len(self._cores)} replica(s) on {placed}")
        leases = self.core.leases
        regen = leases.regen
        if regen is not None:
            note = regen.size_jobs(
                self._cores, drafters_share_gpus=self.targets.shared_gpus
            )  # before any thread takes a job
            if note is not None:
                self.core.note(note)
        for core in self._cores:
            thread = TargetThread(
                core,
                self.targets.train_samples,
                leases.plans,
                leases.ready,
                self.core.account.target_rate,
                name=str(core.device),
                staging=self.staging,
                wire_dtype=self.targets.wire_dtype,
                make_generator=regen.make_generator if regen is not None else None,
            )
            thread.start()
            self._threads.append(thread)
        jobs_per_thread = 1
        if regen is not None:
            decoder = regen.settings.decoder
            served = all(engine_refusal(core.model, decoder) is None for core in self._cores)
            jobs_per_thread = 2 if served else 1
        leases.targets_started(
            len(self._threads),
            jobs_per_thread=jobs_per_thread,
            generate_seconds=lambda: sum(t.generate_s for t in self._threads),
        )

    def _keep_link_while_loading(self, replicas: Future[list[TargetCore]]) -> None:
        """An attaching producer's target loads for minutes at the scale of a node: the coordinator keeps
        hearing from it meanwhile (asking no plan before a replica can compute one), so it is not dropped
        as silent."""
        while not replicas.done():
            self._pump()
            concurrent.futures.wait([replicas], timeout=_SHOW_EVERY_S)  # its error comes from result()

    def _build_eval_batches(self) -> list[m.Batch]:
        """The eval set of a run on dataset responses, before serving. With regeneration it is built once
        its held-out conversations are regenerated, in a target thread (``ProducerCore._refill_eval``)."""
        return build_eval_batches(self._cores[0], self.targets.eval_samples, self.targets.wire_dtype)

    # --- serving -----------------------------------------------------------------------------------------

    def serve(self, watch: WorkerWatch | None = None) -> ProducerSummary:
        """Runs until training finishes, Ctrl-C drains it, or every worker is gone (RunAborted).

        Workers may join at any time (``dflash-pipe worker --connect``) and leave or die at any time: a lost
        worker's leases go back to the queue and the others train on."""
        started = self._started = time.monotonic()
        if self._own_signals:
            self.signals.install()
        try:
            self._log_data()  # what the data gave and left out, by reason, in metrics.jsonl
            self.start_targets()  # a stop signal until the loop runs raises StopNow: nothing to drain yet
            self.core.leases.set_eval(self._build_eval_batches() if self.targets.eval_samples else [])
            self.signals.drainable = True
            try:
                stop_reason = self._run(watch)
                if self.signals.stop.is_set():
                    stop_reason = self._keep_regenerated(stop_reason)
            except RunAborted:
                self._log_data()
                raise
            self._log_data()  # again at the end: regeneration's drops are known as it goes
        finally:
            self.signals.drainable = False
            if self._own_signals:
                self.signals.restore()
        return summary(
            self.core, stop_reason=stop_reason, wall_s=time.monotonic() - started, busy=self._busy()
        )

    def _log_data(self) -> None:
        self.core.account.log(data_metrics(data_report(self.core)))

    def _busy(self) -> dict[str, float]:
        return {
            "target_busy_s": sum(t.busy_s for t in self._threads),
            "target_generate_s": sum(t.generate_s for t in self._threads),
        }

    def _run(self, watch: WorkerWatch | None) -> str:
        core = self.core
        peers, leases = core.peers, core.leases
        stop_reason = "finished"
        last_show = last_hint = 0.0
        join_deadline = time.monotonic() + self.limits.join_timeout_s
        while True:
            core.check(watch)
            if not peers and time.monotonic() > join_deadline:
                raise RunAborted(
                    f"no worker said HELLO within {self.limits.join_timeout_s:.0f} s "
                    "(wire.join_timeout_s); see RUN_DIR/logs for their output."
                )
            if self.signals.stop.is_set() and not leases.done_sent:
                stop_reason = self._drain()
            if self.signals.save.is_set():
                self.signals.save.clear()
                core.request_checkpoint(f"SIG{self.limits.preempt_signal} (preemption warning)")
            core.take_ready()
            core.refill()
            if self.upstream is not None:
                self._pump()
            drain(self._recv, self._handle, limit=_MAX_MESSAGES_PER_TICK)
            core.dispatch()
            core.observe_waits()
            if core.finished() and not leases.done_sent:
                core.send_done("all epochs trained")
            core.watch_peers()
            now = time.monotonic()
            if now - last_show >= _SHOW_EVERY_S:
                self.dashboard.update(dashboard_state(core, self._started))
                last_show = now
            if now - last_hint >= _HINT_EVERY_S:
                last_hint = now
                self._hint()
            if self.upstream is not None and self.upstream.ended and peers.all_left():
                return "the coordinator said DONE"
            if peers.all_left():
                if peers.lost and not leases.done_sent:
                    if watch is None or watch.alive() == 0:
                        raise RunAborted("every worker is gone:\n" + "\n".join(peers.lost))
                    continue  # a launched worker is still starting up
                if not peers and not self.signals.stop.is_set():
                    continue
                if not leases.done_sent and not leases.scheduler.finished():
                    stop_reason = core.account.bye_reason or "every worker left"
                if self.signals.stop.is_set():
                    stop_reason = self._drained(stop_reason)
                return stop_reason

    def _handle(self, peer_id: bytes, msg: Any) -> None:
        """A worker's message to the core; an attaching producer also forwards what the coordinator keeps
        (ACKs end its leases there, METRICS and CHECKPOINTs make the run's record)."""
        self.core.handle(peer_id, msg)
        peer = self.core.peers.get(peer_id)
        if (
            self.upstream is not None
            and peer is not None
            and isinstance(msg, (m.Ack, m.Metrics, m.Checkpoint))
        ):
            if isinstance(msg, m.Metrics) and "time_to_first_step_s" in msg.values:
                # the coordinator's summary names the worker, not this producer
                first = msg.values["time_to_first_step_s"]
                msg = m.Metrics(step=msg.step, values={f"time_to_first_step_s/{peer.name}": first})
            self._pump(forward=msg)

    def _pump(self, forward: Any = None) -> None:
        """The coordinator's link (an attaching producer): a lost coordinator stops this producer."""
        assert self.upstream is not None
        try:
            if forward is not None:
                self.upstream.forward(forward)
            else:
                self.upstream.pump(self.core)
        except CoordinatorLost as exc:
            raise RunAborted(str(exc)) from exc

    def _hint(self) -> None:
        """The split that would balance the run, when one side idles (said again only when it changes)."""
        hint = balance_hint(self.core)
        if hint is None or hint[1].target == self._hinted:
            return
        line, split = hint
        self._hinted = split.target
        self.core.note(line)
        self.core.account.log({"balance/target_gpus": split.target, "balance/drafter_gpus": split.drafters})

    def _drain(self) -> str:
        """A stop signal: every worker finishes its step, rank 0 checkpoints, all leave (no final evaluation,
        so the drain fits a grace period); ``_drained`` says afterwards what was written."""
        name = self.signals.stop_name
        self.dashboard.console.print(
            f"{name}: draining (workers finish their step, checkpoint and leave; at most "
            f"{self.limits.stop_timeout_s:.0f} s, --stop-timeout); a second {name} stops at once",
            markup=False,
            highlight=False,
        )
        self.core.send_done(f"stopped by {name}", evaluate=False)
        for thread in self._threads:  # the replies being written would outlast the drain: stop them now
            thread.stop_generating()
        return f"stopped by {name}"

    def _keep_regenerated(self, reason: str) -> str:
        """After a drain: the target threads stopped (each within a decode step of the signal), what they
        finished meanwhile written to the regenerated file, and the stop reason saying what it holds."""
        regen = self.core.leases.regen
        if regen is None or (regen.complete and regen.eval_ready):
            return reason
        self._stop_targets(self._drain_left_s())
        self.core.take_ready()
        return f"{reason}; {regen.kept_text()}"

    def _drain_left_s(self) -> float:
        """How long closing may wait for the target threads: ``TARGET_STOP_TIMEOUT_S``, and after a stop
        signal no longer than the drain has left (less a margin for the summary and the exit)."""
        left = self.signals.drain_left_s(DRAIN_MARGIN_S)
        return TARGET_STOP_TIMEOUT_S if left is None else min(TARGET_STOP_TIMEOUT_S, left)

    def _drained(self, reason: str) -> str:
        """The stop reason with the truth about the final checkpoint (a CHECKPOINT after the signal)."""
        account, stopped_at = self.core.account, self.signals.stopped_at or 0.0
        if account.last_checkpoint_at is not None and account.last_checkpoint_at >= stopped_at:
            return f"{reason}: final checkpoint {account.last_checkpoint} written; resume with --resume"
        if account.last_checkpoint:
            return (
                f"{reason}: no step since the last checkpoint {account.last_checkpoint}; resume with --resume"
            )
        return f"{reason} before any step was trained: no checkpoint was written"

    def _recv(self, timeout_s: float) -> tuple[bytes, Any] | None:
        try:
            return self.endpoint.recv(timeout_s=timeout_s)
        except BadMessage as exc:
            self.core.note(f"bad message from peer {exc.peer!r}: {exc}")
            if exc.peer is not None:
                self.endpoint.reject(exc.peer, str(exc))  # never blocks: the peer may not be reading
            return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.upstream is not None:
            self.upstream.leave(self.core, "the attached producer stops")
        self._stop_targets(self._drain_left_s())
        self.dashboard.close()
        self.metrics.close()
        if self.core.leases.regen is not None:
            self.core.leases.regen.store.close()
        self.endpoint.close()
        self.staging.close()
        self.rings.close()  # closing the staging twice is a no-op

    def _stop_targets(self, timeout_s: float = TARGET_STOP_TIMEOUT_S) -> None:
        """Target threads end before the staging memory is freed and before the process exits: the plans
        not started are dropped, each thread finishes the batch it computes (waiting ``timeout_s`` at most
        for all of them; safe to call twice). (A daemon thread still inside the target's forward when the
        interpreter exits aborts the process with SIGABRT; a thread copying into a freed slot would crash
        it.)"""
        for thread in self._threads:
            thread.stop()
        plans = self.core.leases.plans
        with contextlib.suppress(queue.Empty):
            while True:
                plans.get_nowait()
        for _ in self._threads:
            plans.put(None)  # wakes a thread waiting for a plan
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if stuck := [t.name for t in self._threads if t.is_alive()]:
            self.core.note(
                f"target thread(s) {', '.join(stuck)} still computing after {timeout_s:.0f} s; exiting anyway"
            )


def hard_exit(reason: str, code: int) -> None:
    """A producer serving without a launcher around it: say why, stop."""
    sys.stderr.write(f"dflash-pipe producer: {reason}\n")
    sys.stderr.flush()
    os._exit(code)
