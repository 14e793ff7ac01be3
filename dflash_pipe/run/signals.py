"""What a signal means to a run, on both sides (``launch`` and ``dflash-pipe worker``).

SIGINT and SIGTERM drain: the first asks the process to finish its step, checkpoint and leave, and starts a
watchdog that stops the process hard (``on_hard_stop``) once ``stop_timeout_s`` have passed, so a drain is
bounded whatever it waits on. A second one stops at once (a SIGTERM within ``SAME_TERM_S`` of the first is the same one). While the process has nothing to drain yet (set-up,
a worker still warming up), the first one raises ``StopNow`` in the main thread instead of waiting. The
preemption signal (``wire.preempt_signal``, USR1 by default: what Slurm's ``--signal=B:USR1@120`` sends) asks
for a checkpoint now and changes nothing else. Handlers only set events, raise, or stop hard: the loops read
the events at their next turn.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAME_TERM_S = 2.0
"""A SIGTERM this soon after the first is the same request, not a second one: Slurm and systemd may signal
every process of a job at once, and a batch script passes the signal on as well."""
_RESERVED = {"INT", "TERM", "KILL", "STOP", "CHLD", "PIPE", "SEGV", "BUS", "FPE", "ILL", "ABRT"}


def parse_preempt_signal(name: str | None) -> str:
    """``USR1``, ``SIGUSR1``, ``usr1`` -> ``USR1``; ``off`` (or empty) -> ``off``. ValueError naming the choices
    for an unknown signal or one the run already gives a meaning (INT and TERM drain)."""
    text = (name or "off").strip().upper().removeprefix("SIG")
    if text in ("OFF", "NONE", ""):
        return "off"
    if text in _RESERVED or not hasattr(signal, f"SIG{text}"):
        raise ValueError(
            f"wire.preempt_signal (--preempt-signal) {name!r}: not a signal a run can take for 'checkpoint "
            "now' (SIGINT and SIGTERM drain the run); choose USR1, USR2, HUP, or off."
        )
    return text


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopNow(BaseException):  # noqa: N818 -- a control-flow signal like KeyboardInterrupt, not an error
    """A stop signal arrived while there was nothing to drain (set-up): unwind at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class Signals:
    """The process's stop and preemption signals. ``install()`` in the main thread; ``restore()`` undoes it.

    ``stop`` is set by the first SIGINT/SIGTERM (``stop_name`` says which); ``save`` by the preemption
    signal (clear it once the checkpoint is asked for). ``drainable`` says whether a first stop waits for the
    loop to drain (True) or raises ``StopNow`` (False). ``on_hard_stop(reason, exit_code)`` must end the
    process; it runs on a second stop signal (in the handler) or when the drain outlives ``stop_timeout_s``
    (in the watchdog thread)."""

    def __init__(
        self,
        *,
        stop_timeout_s: float,
        preempt: str = "off",
        on_hard_stop: Callable[[str, int], None],
        drainable: bool = False,
    ) -> None:
        self.stop_timeout_s = stop_timeout_s
        self.preempt = parse_preempt_signal(preempt)
        self.on_hard_stop = on_hard_stop
        self.drainable = drainable
        self.stop = threading.Event()
        self.save = threading.Event()
        self.stop_name: str | None = None
        self.stopped_at: float | None = None
        """When the first stop signal came (monotonic); ``stopped_wall``: the same as time.time()."""
        self.stopped_wall: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> Signals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_stop)
        if self.preempt != "off":
            signum = getattr(signal, f"SIG{self.preempt}")
            self._previous[signum] = signal.signal(signum, self._on_save)
        return self

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def request_stop(self, signum: int) -> None:
        """What the first stop signal does (also callable directly, e.g. from a test)."""
        self.stop_name = signal_name(signum)
        self.stopped_at, self.stopped_wall = time.monotonic(), time.time()
        self.stop.set()
        threading.Thread(target=self._watchdog, name="dflash-stop-watchdog", daemon=True).start()

    def drain_left_s(self, margin_s: float = 0.0) -> float | None:
        """Seconds left before the watchdog stops the process hard, less ``margin_s`` (at least 0); None
        before a stop signal."""
        if self.stopped_at is None:
            return None
        return max(0.0, self.stop_timeout_s - (time.monotonic() - self.stopped_at) - margin_s)

    def _on_stop(self, signum: int, _frame: object) -> None:
        repeated = signum == signal.SIGTERM and self.stop_name == "SIGTERM"
        if self.stop.is_set() and repeated and time.monotonic() - (self.stopped_at or 0.0) < SAME_TERM_S:
            return
        if self.stop.is_set():
            self.on_hard_stop(f"a second {signal_name(signum)}: stopped at once", 128 + signum)
            return
        self.request_stop(signum)
        if not self.drainable:
            raise StopNow(signum)

    def _on_save(self, _signum: int, _frame: object) -> None:
        self.save.set()

    def _watchdog(self) -> None:
        time.sleep(self.stop_timeout_s)
        self.on_hard_stop(
            f"the drain after {self.stop_name} took longer than {self.stop_timeout_s:.0f} s "
            "(--stop-timeout); stopped hard",
            1,
        )
