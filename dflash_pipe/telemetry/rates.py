"""Rates and time shares: a sliding-window `RateMeter` (tokens/s per stage) and `TimeShares` (the share
of time a stage was idle or starved). No torch import: the dashboard and the benchmarks read them too."""

from __future__ import annotations

import threading
import time
from collections import deque


class RateMeter:
    """Units per second (tokens/s) over a sliding window of `window_s` seconds; thread-safe.

    The rate is measured between events: units added after a reference event divided by the time since it.
    The reference is the newest event at or before the window start (or the oldest event kept), so a single
    event gives 0.0 until a second arrives; call `add(0)` when work starts to count the first batch too.
    Times are `time.monotonic()` unless `now` is passed (tests inject them).
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"RateMeter window_s must be > 0, got {window_s!r}; use e.g. 10.0 seconds")
        self.window_s = float(window_s)
        self.total = 0
        self._events: deque[tuple[float, float]] = deque()  # (time, units), time non-decreasing
        self._lock = threading.Lock()

    def add(self, n: float, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        with self._lock:
            if self._events and t < self._events[-1][0]:
                t = self._events[-1][0]  # clocks from different threads: keep the deque ordered
            self._events.append((t, n))
            self.total += n
            self._prune(t)

    def rate(self, now: float | None = None) -> float:
        t = time.monotonic() if now is None else now
        with self._lock:
            self._prune(t)
            if not self._events:
                return 0.0
            ref_t = self._events[0][0]
            units = sum(n for et, n in list(self._events)[1:] if et <= t)
            return units / (t - ref_t) if t > ref_t and units else 0.0

    def span(self, now: float | None = None) -> float:
        """Seconds the rate is measured over (0.0 before the first event): a rate over a few milliseconds,
        two workers' first ACKs say, is noise, not a throughput (see ``MIN_RATE_SPAN_S``)."""
        t = time.monotonic() if now is None else now
        with self._lock:
            self._prune(t)
            return max(0.0, t - self._events[0][0]) if self._events else 0.0

    def _prune(self, now: float) -> None:
        """Drop events older than the reference (the newest event at or before now - window_s)."""
        cutoff = now - self.window_s
        while len(self._events) >= 2 and self._events[1][0] <= cutoff:
            self._events.popleft()


class TimeShares:
    """Seconds spent in named conditions, and time-weighted means of named levels, sampled tick by tick.

    ``observe(now, waiting_for_credits=True, queue_depth=3)`` credits the time since the previous call to
    the values seen then (a bool counts as 0/1), so ``seconds("waiting_for_credits")`` is how long that
    condition held and ``mean("queue_depth")`` the average depth. Not thread-safe: one loop owns it.
    """

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, float]] | None = None
        self._integral: dict[str, float] = {}
        self.elapsed_s = 0.0

    def observe(self, now: float, **values: float) -> None:
        if self._last is not None:
            t0, previous = self._last
            dt = max(0.0, now - t0)
            self.elapsed_s += dt
            for key, value in previous.items():
                self._integral[key] = self._integral.get(key, 0.0) + dt * value
        self._last = (now, {k: float(v) for k, v in values.items()})

    def seconds(self, name: str) -> float:
        """Integral of ``name`` over the observed time (for a condition: seconds it held)."""
        return self._integral.get(name, 0.0)

    def mean(self, name: str) -> float:
        return self.seconds(name) / self.elapsed_s if self.elapsed_s > 0 else 0.0
