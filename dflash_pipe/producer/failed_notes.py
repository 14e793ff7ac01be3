"""The log line about regenerated turns that could not be generated, said at most once per interval.

A small target fails hundreds of turns in a few minutes (``sample full`` on SmolLM2-135M: 733 in 8
minutes); one line each buried the dashboard. Each line names the first conversation held back since the
last one and the running totals, so nothing goes unsaid."""

from __future__ import annotations

import time
from collections.abc import Iterable

from dflash_pipe.data.regenerated import Regenerated

EVERY_S = 30.0
"""At most one line per this many seconds (the first failure is said at once)."""


class FailedTurnNotes:
    """Failed conversations (with their job ids) waiting for the next line."""

    def __init__(self) -> None:
        self._unsaid: list[tuple[int, Regenerated]] = []
        self._said_at: float | None = None

    def add(self, failed: Iterable[tuple[int, Regenerated]]) -> None:
        """(job id, record) of each conversation that stopped at a failed turn."""
        self._unsaid.extend(failed)

    def line(self, totals: str) -> str | None:
        """The line to say now (``totals``: every failure so far, by reason), or None: nothing held back, or
        the last line was said less than ``EVERY_S`` ago."""
        now = time.monotonic()
        if not self._unsaid or (self._said_at is not None and now - self._said_at < EVERY_S):
            return None
        failed, self._unsaid, self._said_at = self._unsaid, [], now
        jobs = sorted({job for job, _ in failed})
        which = f"job {jobs[0]}" if len(jobs) == 1 else f"{len(jobs)} jobs ({jobs[0]}-{jobs[-1]})"
        index, first = failed[0][1].index, failed[0][1].failed
        assert first is not None
        return (
            f"regeneration: {len(failed)} conversation(s) of {which} stopped at a turn that could not be "
            f"generated (first: conversation {index}, turn {first.turn}: {first.reason}); their earlier turns "
            f"are kept. So far: {totals}"
        )
