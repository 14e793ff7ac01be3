"""Live view of a training run: a rich Live panel on a terminal, rate-limited log lines otherwise.

Only the process that owns the terminal (the producer) draws it. The training code fills a `RunState`
and calls `Dashboard.update`; the dashboard never computes training quantities itself, except keeping a
short loss history for the sparkline.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

STAGES = ("producer", "wire", "drafters")
_BLOCKS = "▁▂▃▄▅▆▇█"


class WorkerRow(TypedDict, total=False):
    """One drafter worker as the producer sees it."""

    name: str
    rank: int
    device: str
    state: str  # e.g. "joining", "compiling", "training", "gone"
    steps: int
    first_step_s: float | None  # wall time of its first step (compile + warm-up), None until done


@dataclass(kw_only=True, slots=True)
class RunState:
    """Everything the dashboard shows; filled by the producer each log interval."""

    step: int = 0
    epoch: int = 0
    progress: float = 0.0  # 0..1 of all planned samples (over all epochs)
    elapsed_s: float = 0.0
    eta_s: float | None = None
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # keys from STAGES
    queue_depth: int = 0  # ready batches waiting in the producer
    leased: int = 0  # batches handed out and not yet acked
    workers: list[WorkerRow] = field(default_factory=list)
    loss: float | None = None
    acc: list[float] = field(
        default_factory=list
    )  # per scored block slot 1..bs-1 (as worker/loop.py logs it)
    tau: float | None = None  # simulated (teacher-forced) acceptance length, when evaluated
    real_tau: float | None = None  # real acceptance length (speculative decoding), when evaluated
    lr: float | None = None
    messages: list[str] = field(default_factory=list)  # recent warnings, oldest first
    regen: dict[str, float] | None = None
    """While the target regenerates the data: done, total (conversations), tokens_per_s, failed_turns."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.progress <= 1.0):
            raise ValueError(
                f"RunState.progress must be in [0, 1], got {self.progress!r}; pass done/planned samples"
            )


def sparkline(values: Sequence[float], width: int = 30) -> str:
    """Unicode block sparkline of the last `width` values, scaled min..max; non-finite values show as '!'."""
    tail = list(values)[-width:]
    finite = [v for v in tail if math.isfinite(v)]
    if not finite:
        return "!" * len(tail)
    lo, hi = min(finite), max(finite)
    span = hi - lo
    chars = []
    for v in tail:
        if not math.isfinite(v):
            chars.append("!")
        elif span == 0:
            chars.append(_BLOCKS[len(_BLOCKS) // 2])
        else:
            chars.append(_BLOCKS[min(len(_BLOCKS) - 1, int((v - lo) / span * len(_BLOCKS)))])
    return "".join(chars)


def regen_text(regen: Mapping[str, float]) -> str:
    """``regen 120/3000 conv held-out 8/16 1.2k tok/s (target 64% generating, drafters 3% idle) 2 failed``:
    where the target's regeneration of the data stands (the held-out set shown until it is complete: no
    evaluation before), and whether it starves the drafters."""
    done, total = int(regen.get("done", 0)), int(regen.get("total", 0))
    text = f"regen {done}/{total} conv"
    eval_done, eval_total = int(regen.get("eval_done", 0)), int(regen.get("eval_total", 0))
    if eval_done < eval_total:
        text += f" held-out {eval_done}/{eval_total}"
    if done < total:
        text += f" {format_rate(regen.get('tokens_per_s'))} tok/s"
        if "target_share" in regen and "drafters_idle_share" in regen:
            text += (
                f" (target {regen['target_share']:.0%} generating, "
                f"drafters {regen['drafters_idle_share']:.0%} idle)"
            )
    failed = int(regen.get("failed_turns", 0))
    return text + (f" {failed} failed" if failed else "")


def format_duration(seconds: float | None) -> str:
    """`1:02:03` / `4:05`; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rate(rate: float | None) -> str:
    """Compact tokens/s: 950, 12.3k, 1.20M."""
    if rate is None or not math.isfinite(rate):
        return "-"
    if rate >= 1e6:
        return f"{rate / 1e6:.2f}M"
    if rate >= 1e3:
        return f"{rate / 1e3:.1f}k"
    return f"{rate:.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean_acc(acc: Sequence[float | None]) -> float | None:
    """Mean over the logged slots: slots 1..bs-1 (the anchor slot 0 is not scored and not logged)."""
    scored = [a for a in acc if a is not None and math.isfinite(a)]
    return sum(scored) / len(scored) if scored else None


class Dashboard:
    """`update(state)` per log interval, `close()` at the end (or use as a context manager).

    live=None picks rich Live when the console is a terminal, plain log lines otherwise (files, pipes,
    SLURM logs). Plain lines are rate limited to one per `plain_every_s`; the latest state is always
    printed on close, and new warning messages are printed as soon as they appear.
    """

    def __init__(
        self,
        title: str,
        total_steps: int | None,
        live: bool | None = None,
        *,
        console: Console | None = None,
        plain_every_s: float = 10.0,
        history: int = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if plain_every_s < 0:
            raise ValueError(f"plain_every_s must be >= 0, got {plain_every_s!r}")
        self.title = title
        self.total_steps = total_steps
        self.console = console if console is not None else Console(stderr=True)
        self.live = self.console.is_terminal if live is None else live
        self.plain_every_s = plain_every_s
        self._clock = clock
        self._loss_history: deque[float] = deque(maxlen=history)
        self._last_step: int | None = None
        self._state: RunState | None = None
        self._printed_state: RunState | None = None
        self._last_print: float | None = None
        self._seen_messages: dict[str, None] = {}
        self._closed = False
        self._live: Any = None
        if self.live:
            from rich.live import Live

            self._live = Live(
                self._render(RunState()), console=self.console, refresh_per_second=4, transient=False
            )
            self._live.start()

    # -- public -------------------------------------------------------------------------------------------
    def update(self, state: RunState) -> None:
        if self._closed:
            return
        self._state = state
        if state.loss is not None and state.step != self._last_step:
            self._loss_history.append(state.loss)
            self._last_step = state.step
        if self._live is not None:
            self._live.update(self._render(state))
            return
        self._print_new_messages(state)
        now = self._clock()
        if self._last_print is None or now - self._last_print >= self.plain_every_s:
            self._print_line(state, now)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            if self._state is not None:
                self._live.update(self._render(self._state))
            self._live.stop()
        elif self._state is not None and self._state is not self._printed_state:
            self._print_line(self._state, self._clock())

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain mode ---------------------------------------------------------------------------------------
    def _print_line(self, state: RunState, now: float) -> None:
        self._printed_state = state
        self._last_print = now
        self.console.print(self.plain_line(state), markup=False, highlight=False, soft_wrap=True)

    def _print_new_messages(self, state: RunState) -> None:
        for msg in state.messages:
            if msg not in self._seen_messages:
                self._seen_messages[msg] = None
                self.console.print(f"[{self.title}] {msg}", markup=False, highlight=False, soft_wrap=True)
        while len(self._seen_messages) > 1000:  # bounded memory on long runs
            del self._seen_messages[next(iter(self._seen_messages))]

    def plain_line(self, state: RunState) -> str:
        """One compact line: where the run is, how it learns, how fast each stage goes."""
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"[{self.title}] step {state.step}{total} ep {state.epoch} {state.progress * 100:.1f}%"]
        learn = f"loss {_fmt(state.loss, '.4f')}"
        mean_acc = _mean_acc(state.acc)
        if mean_acc is not None:
            learn += f" acc {mean_acc:.3f}"
        if state.tau is not None:
            learn += f" tau(simulated) {state.tau:.2f}"
        if state.real_tau is not None:
            learn += f" tau(real) {state.real_tau:.2f}"
        if state.lr is not None:
            learn += f" lr {state.lr:.2e}"
        parts.append(learn)
        rates = " ".join(
            f"{k} {format_rate(state.tokens_per_s.get(k))}" for k in STAGES if k in state.tokens_per_s
        )
        if rates:
            parts.append(f"tok/s {rates}")
        if state.regen is not None:
            parts.append(regen_text(state.regen))
        parts.append(f"queue {state.queue_depth} leased {state.leased}")
        if state.workers:
            training = sum(1 for w in state.workers if w.get("state") == "training")
            parts.append(f"workers {training}/{len(state.workers)} training")
        parts.append(f"elapsed {format_duration(state.elapsed_s)} eta {format_duration(state.eta_s)}")
        return " | ".join(parts)

    # -- live mode ----------------------------------------------------------------------------------------
    def _render(self, state: RunState) -> RenderableType:
        header = Table.grid(padding=(0, 2))
        for _ in range(5):
            header.add_column()
        total = f"/{self.total_steps}" if self.total_steps else ""
        header.add_row(
            Text(self.title, style="bold"),
            Text(f"step {state.step}{total}  epoch {state.epoch}"),
            ProgressBar(total=1.0, completed=state.progress, width=30),
            Text(f"{state.progress * 100:5.1f}%"),
            Text(f"elapsed {format_duration(state.elapsed_s)}  ETA {format_duration(state.eta_s)}"),
        )

        stages = Table(title="pipeline", title_justify="left", expand=False)
        stages.add_column("stage")
        stages.add_column("tokens/s", justify="right")
        for name in STAGES:
            stages.add_row(name, format_rate(state.tokens_per_s.get(name)))
        if state.regen is not None:
            stages.add_row("regenerate", regen_text(state.regen).removeprefix("regen "))
        stages.add_row("queue", f"{state.queue_depth} ready", style="dim")
        stages.add_row("leased", f"{state.leased} in flight", style="dim")

        learning = Table(title="learning", title_justify="left", expand=False)
        learning.add_column("metric")
        learning.add_column("value", justify="right")
        learning.add_column("", no_wrap=True)
        learning.add_row("loss", _fmt(state.loss, ".4f"), sparkline(self._loss_history))
        scored = state.acc
        mean_acc = _mean_acc(state.acc)
        learning.add_row(
            "acc (mean, by slot)", _fmt(mean_acc, ".3f"), " ".join(f"{a:.2f}" for a in scored[:8])
        )
        learning.add_row(
            "tau (simulated)", _fmt(state.tau, ".2f"), "" if state.tau is not None else "not evaluated yet"
        )
        if state.real_tau is not None:
            learning.add_row("tau (real)", _fmt(state.real_tau, ".2f"), "speculative decoding")
        learning.add_row("lr", _fmt(state.lr, ".2e"), "")

        middle = Table.grid(padding=(0, 4))
        middle.add_column()
        middle.add_column()
        middle.add_row(stages, learning)

        workers = Table(title="workers", title_justify="left")
        for col, justify in (("name", "left"), ("rank", "right"), ("device", "left"), ("state", "left")):
            workers.add_column(col, justify=justify)
        workers.add_column("steps", justify="right")
        workers.add_column("first step", justify="right")
        for w in sorted(state.workers, key=lambda w: (w.get("rank", 1 << 30), w.get("name", ""))):
            first = w.get("first_step_s")
            workers.add_row(
                str(w.get("name", "?")),
                str(w.get("rank", "-")),
                str(w.get("device", "-")),
                str(w.get("state", "-")),
                str(w.get("steps", 0)),
                "-" if first is None else f"{first:.1f}s",
            )
        if not state.workers:
            workers.add_row("(none yet)", "", "", "", "", "")

        parts: list[RenderableType] = [header, middle, workers]
        if state.messages:
            parts.append(Text("\n".join(f"! {m}" for m in state.messages[-5:]), style="yellow"))
        return Panel(Group(*parts), title="dflash-pipe", border_style="blue")


# -- end-of-run summary -------------------------------------------------------------------------------------
def latest_per_step(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One merged record per step, sorted by step; a resumed run re-logs steps after its checkpoint and the
    later values win."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = row.get("step")
        if isinstance(step, int):
            by_step.setdefault(step, {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def _start_mid_end(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, Any]]:
    have = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if not have:
        return []
    return [have[0], have[(len(have) - 1) // 2], have[-1]]


def summary_table(
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str = "run summary",
    loss_key: str = "loss",
    acc_key: str = "acc",
    tau_key: str = "simulated/tau",
    real_tau_key: str = "real/tau",
    tokens_key: str = "tokens_per_s",
) -> Table:
    """End-of-run table from metrics records (`read_metrics` output): loss/acc/tau/tokens/s at the start,
    middle and end of the run (so the loss going down is visible), and wall time from the record times."""
    times = [r["time"] for r in rows if isinstance(r.get("time"), int | float)]
    wall = max(times) - min(times) if times else None  # includes any downtime between resumes
    rows = latest_per_step(rows)
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for col in ("start", "middle", "end"):
        table.add_column(col, justify="right")
    if not rows:
        table.add_row("(no metrics logged)", "-", "-", "-")
        return table

    def add(label: str, key: str, fmt: Callable[[Any], str]) -> None:
        points = _start_mid_end(rows, key)
        if points:
            table.add_row(label, *(f"{fmt(v)} @{s}" for s, v in points))

    def fmt_acc(v: Any) -> str:
        mean = _mean_acc(v) if isinstance(v, list) else v
        return _fmt(mean, ".3f")

    add("loss", loss_key, lambda v: _fmt(v, ".4f"))
    add("acc (mean of slots)", acc_key, fmt_acc)
    add("tau (simulated)", tau_key, lambda v: _fmt(v, ".2f"))
    add("tau (real)", real_tau_key, lambda v: _fmt(v, ".2f"))
    add("tau (real, pooled over steps)", "real/tau_pooled", lambda v: _fmt(v, ".2f"))
    add("real decoding tokens/s", "real/tokens_per_s", lambda v: _fmt(v, ".1f"))
    add("real speedup vs greedy", "real/speedup", lambda v: _fmt(v, ".2f"))
    add("real not lossless (prompts)", "real/lossless_mismatches", lambda v: _fmt(v, ".0f"))
    add("tokens/s", tokens_key, lambda v: format_rate(v) if isinstance(v, int | float) else "-")
    table.add_row(
        "steps", str(rows[0]["step"]), str(rows[(len(rows) - 1) // 2]["step"]), str(rows[-1]["step"])
    )
    table.add_row("wall time", "", "", format_duration(wall))
    return table
