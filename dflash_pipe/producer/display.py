"""What the producer shows and records: the dashboard's state, the metrics a worker's METRICS adds to, and
the end-of-run summary, all read from a ``ProducerCore``'s counters."""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_pipe.producer.coordinator import link_bytes
from dflash_pipe.producer.min_workers import heard_waiting
from dflash_pipe.telemetry import RunState

if TYPE_CHECKING:
    from dflash_pipe.producer.accounting import Accounting
    from dflash_pipe.producer.parts import CoreParts
    from dflash_pipe.producer.peers import Peer
    from dflash_pipe.wire import messages as m

MIN_RATE_SPAN_S = 1.0
"""A stage's tokens/s goes into the metrics only once its meter has measured over at least this long."""
LIST_METRICS = frozenset({"acc", "simulated/acceptance_per_slot", "real/acceptance_per_position"})
"""Metrics that are per-slot lists; every other metric is one number."""


@dataclass(slots=True)
class ProducerSummary:
    steps: int
    """The global step the run reached (the resumed checkpoint's step plus this launch's)."""
    stop_reason: str
    wall_s: float
    last_checkpoint: str | None
    first_step_s: dict[str, float]
    acked_tokens: int
    duplicates_redelivered: int
    steady_tokens_per_s: float
    """Trained tokens/s from the first ACK to the end: the pipeline's rate once every worker is warm."""
    ack_window_s: float = 0.0
    """Seconds from the end of the first trained step (its last ACK) to the last ACK: every worker's first
    step (compile, warm-up) and the end's checkpoint and eval are left out."""
    ack_window_tokens: int = 0
    """Tokens acknowledged in that window: their ratio is the pipeline's training rate."""
    produced_window_tokens: int = 0
    """Tokens the target replicas finished in the same window. Over a short window the ready queue built
    during start-up can feed the workers faster than the target produces; the smaller of the two counts is
    what the pipeline sustains."""
    waits: dict[str, float] = field(default_factory=dict)
    """Where time went between the first ACK and DONE (see ``wait_report``)."""
    regen: dict[str, Any] = field(default_factory=dict)
    """With ``data.responses = "target"``: what regeneration did (``Regeneration.summary``)."""
    start_step: int = 0
    """The step this launch started from (the resumed checkpoint's; 0 for a fresh run)."""
    data: dict[str, Any] = field(default_factory=dict)
    """What the data gave and what was left out, by reason (``data_report``)."""

    @property
    def launch_steps(self) -> int:
        """Steps trained by this launch."""
        return self.steps - self.start_step


def summary(core: CoreParts, *, stop_reason: str, wall_s: float, busy: dict[str, float]) -> ProducerSummary:
    """``busy``: the target threads' busy and generating seconds (``wait_report``)."""
    account, leases = core.account, core.leases
    return ProducerSummary(
        steps=account.step,
        stop_reason=stop_reason,
        wall_s=wall_s,
        last_checkpoint=account.last_checkpoint,
        first_step_s={
            **{p.name: p.first_step_s for p in core.peers.values() if p.first_step_s is not None},
            **account.attached_first_steps,
        },
        acked_tokens=leases.scheduler.stats.acked_tokens,
        duplicates_redelivered=leases.scheduler.stats.redelivered,
        steady_tokens_per_s=_steady_rate(account, leases.scheduler.stats.acked_tokens),
        **_ack_window(account),
        waits=wait_report(account, busy),
        regen=leases.regen.summary() if leases.regen is not None else {},
        start_step=core.ctx.resume_step,
        data=data_report(core),
    )


def data_report(core: CoreParts) -> dict[str, Any]:
    """What the data gave and what was left out: training samples, held-out samples, bad lines skipped by
    reason, samples dropped by reason (with regeneration: the conversations left out before it and those that
    came out with nothing to train, so far), samples cut to ``max_length``, and the note when nothing could be held out."""
    ctx, data, regen = core.ctx, core.ctx.data, core.leases.regen
    if regen is not None:
        samples = regen.samples_ready
        held_out, dropped = (
            len(regen.eval_indexes),
            dict(Counter(data.drop_reasons if data is not None else {}) + regen.void_reasons),
        )
    else:
        samples, held_out = len(ctx.train_samples), len(ctx.eval_samples)
        dropped = dict(data.drop_reasons) if data is not None else {}
    return {
        "file": str(core.cfg.data.path),
        "max_length": core.cfg.data.max_length,
        "samples": samples,
        "held_out": held_out,
        "skipped": dict(data.skip_reasons) if data is not None else {},
        "dropped": dropped,
        "truncated": data.truncated if data is not None else 0,
        "notes": list(ctx.notes),
    }


def data_metrics(report: dict[str, Any]) -> dict[str, float]:
    """``data_report`` as metrics: ``data/samples``, ``data/held_out``, ``data/truncated``,
    ``data/skipped`` and ``data/dropped`` (totals) and one ``data/skipped/REASON`` or ``data/dropped/REASON``
    per reason (lower case, words joined by ``_``: ``data/dropped/too_long_for_max_length``)."""
    out = {f"data/{key}": float(report[key]) for key in ("samples", "held_out", "truncated")}
    for kind in ("skipped", "dropped"):
        out[f"data/{kind}"] = float(sum(report[kind].values()))
        for reason, n in report[kind].items():
            out[f"data/{kind}/{reason_key(reason)}"] = float(n)
    return out


def data_lines(data: dict[str, Any]) -> list[str]:
    """The summary's data line (``data_report``), then its notes (e.g. no held-out set)."""

    def by_reason(counts: dict[str, int]) -> str:
        if not counts:
            return "none"
        return (
            f"{sum(counts.values())} (" + ", ".join(f"{n} {why}" for why, n in sorted(counts.items())) + ")"
        )

    line = (
        f"data: {data['samples']} training samples, {data['held_out']} held out, from {data['file']}; "
        f"bad lines skipped: {by_reason(data['skipped'])}; samples dropped: {by_reason(data['dropped'])}; "
        f"{data['truncated']} cut to --max-length {data['max_length']}"
    )
    return [line, *(f"note: {note}" for note in data.get("notes", ()))]


def reason_key(reason: str) -> str:
    """A reason as a metric name's last part: ``"not JSON"`` -> ``not_json``."""
    return re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_") or "other"


def _ack_window(account: Accounting) -> dict[str, float]:
    if account.window_start is None or account.last_ack is None:
        return {}
    _, t0, acked0, produced0 = account.window_start
    t1, acked1, produced1 = account.last_ack
    return {
        "ack_window_s": t1 - t0,
        "ack_window_tokens": acked1 - acked0,
        "produced_window_tokens": int(produced1 - produced0),
    }


def _steady_rate(account: Accounting, acked_tokens: int) -> float:
    if account.first_ack is None:
        return 0.0
    t0, tokens0 = account.first_ack
    elapsed = time.monotonic() - t0
    return (acked_tokens - tokens0) / elapsed if elapsed > 0 else 0.0


def wait_report(account: Accounting, busy: dict[str, float]) -> dict[str, float]:
    """Shares of the observed time: target replicas idle (the ready queue at its bound, waiting for
    credits), workers holding unused credits (waiting for batches), and the mean ready-queue depth; the
    replicas' busy seconds, and of those the seconds spent regenerating conversations (``busy``)."""
    waits = account.waits
    return {
        "observed_s": waits.elapsed_s,
        "target_idle_share": waits.mean("target_idle"),
        "workers_starved_share": waits.mean("workers_starved"),
        "queue_depth_mean": waits.mean("queue_depth"),
        "target_busy_s": busy.get("target_busy_s", 0.0),
        "target_generate_s": busy.get("target_generate_s", 0.0),
    }


def stage_rates(account: Any) -> dict[str, float]:
    """Each stage's tokens/s, once its meter spans ``MIN_RATE_SPAN_S`` (the first step's record has none:
    its two ACKs a millisecond apart once logged 1.57M tokens/s for the demo)."""
    meters = {
        "tokens_per_s": account.train_rate,
        "tokens_per_s/producer": account.target_rate,
        "tokens_per_s/wire": account.wire_rate,
        "tokens_per_s/drafters": account.train_rate,
    }
    return {key: meter.rate() for key, meter in meters.items() if meter.span() >= MIN_RATE_SPAN_S}


def log_worker_metrics(core: CoreParts, peer: Peer, msg: m.Metrics) -> None:
    """A worker's METRICS, checked, with the producer's own figures added to each training record."""
    account, leases = core.account, core.leases
    values, bad = checked_metrics(msg.values)
    if bad:
        core.note(f"worker {peer.name} sent malformed metrics {bad}; ignored them")
    if values.get("compile_fallback"):
        core.note(
            f"worker {peer.name}: its compiled step failed the check against eager (train.compile=full); it "
            "trains with --compile attention, slower steps (its log says why)"
        )
    if "group/min_workers" in values:
        heard_waiting(core, values)
    if "time_to_first_step_s" in values:
        core.peers.first_step(peer, float(values["time_to_first_step_s"]))
        values = {f"time_to_first_step_s/{peer.name}": peer.first_step_s}
    for key, value in values.items():  # an attaching producer's worker's, named by that producer
        if key.startswith("time_to_first_step_s/") and peer.role == "producer":
            account.attached_first_step(key.split("/", 1)[1], float(value))
    if "loss" in values:
        account.trained(values)
        values.update(stage_rates(account))
        values["queue_depth"] = leases.scheduler.ready_count()
        values["leased"] = leases.scheduler.leased_count()
        values["batches_via_shm"] = account.sent_by_ref["shm"]
        values["batches_via_cuda_ipc"] = account.sent_by_ref["cuda_ipc"]
        values.update(link_bytes(core))
        values["wait/target_idle_share"] = account.waits.mean("target_idle")
        values["wait/workers_starved_share"] = account.waits.mean("workers_starved")
        if leases.regen is not None:
            status = leases.regen.status(leases.target_threads, leases.generate_seconds())
            values.update({f"regen/{k}": v for k, v in status.items()})
    if values.get("eval/skipped"):
        held = ""
        if leases.regen is not None:
            status = leases.regen.status()
            held = (
                f" ({status['eval_done']:.0f}/{status['eval_total']:.0f} held-out conversations regenerated)"
            )
        core.note(f"step {msg.step}: evaluation skipped: the held-out set is still being regenerated{held}")
    account.evaluated(values)
    if values.get("real/lossless_mismatches"):
        core.note(
            f"REAL EVAL NOT LOSSLESS at step {msg.step}: {values['real/lossless_mismatches']:.0f} prompt(s) "
            "decoded other tokens than the target's greedy decoding (see the rank-0 worker log)"
        )
    account.log(values, msg.step)


def checked_metrics(values: dict) -> tuple[dict, list[str]]:
    """Keeps well-shaped metrics (numbers, or lists of numbers where a list is expected) and names the rest,
    so a confused or buggy worker cannot take the producer down with a bad METRICS message."""

    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    good, bad = {}, []
    for key, value in values.items():
        ok = isinstance(value, list) and all(map(number, value)) if key in LIST_METRICS else number(value)
        if ok:
            good[key] = value
        else:
            bad.append(key)
    return good, bad


def dashboard_state(core: CoreParts, started: float) -> RunState:
    """A snapshot of the run for the dashboard (``started``: the producer's start, monotonic): built anew
    each time from the components' counters, so the dashboard never holds or writes them."""
    account, leases, cfg = core.account, core.leases, core.cfg
    total = core.ctx.ledger.num_samples * cfg.train.epochs
    done = core.ctx.ledger.total_trained() + leases.scheduler.stats.acked_samples
    progress = min(1.0, done / total)
    if cfg.train.max_steps:
        progress = max(progress, min(1.0, account.step / cfg.train.max_steps))
    elapsed = time.monotonic() - started
    meters = {"producer": account.target_rate, "wire": account.wire_rate, "drafters": account.train_rate}
    regen = None
    if leases.regen is not None:
        regen = leases.regen.status(leases.target_threads, leases.generate_seconds())
        regen["drafters_idle_share"] = account.waits.mean("workers_starved")
    return RunState(
        step=account.step,
        progress=progress,
        elapsed_s=elapsed,
        eta_s=elapsed * (1 - progress) / progress if progress > 0 else None,
        tokens_per_s={k: m.rate() for k, m in meters.items() if m.span() >= MIN_RATE_SPAN_S},
        queue_depth=leases.scheduler.ready_count(),
        leased=leases.scheduler.leased_count(),
        workers=[
            {
                "name": p.name,
                "rank": p.rank,
                "device": p.device,
                "state": p.state,
                "steps": p.steps,
                "first_step_s": p.first_step_s,
            }
            for p in core.peers.values()
        ],
        loss=account.loss,
        acc=list(account.acc),
        tau=account.tau,
        real_tau=account.real_tau,
        lr=account.lr,
        messages=list(account.messages),
        regen=regen,
    )
