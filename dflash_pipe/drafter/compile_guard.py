"""Threaded mode's compile safety: no compile ever runs while another drafter thread runs compiled code.

Dynamo's compiled-code cache is shared by the threads of a process, but compiling is not thread-safe, and
tracing flips process-wide FX state that a compiled function entered on another thread trips over
(docs/architecture.md, "Threaded mode"). ``CompileGuard`` makes that impossible by construction:

- A drafter thread runs a whole step (forward and backward, checkpoint recomputes included) as a *shared*
  holder of one process-wide reader/writer lock, while the process stance is ``fail_on_recompile``: a call
  that finds no compiled variant for its shapes and grad mode raises instead of compiling.
- That step is then thrown away (its partial gradients reset) and run again as the *exclusive* holder,
  with compiling allowed: the first call of every new variant runs alone in the process, and its lazily
  compiled backward with it, since backward is part of the step.
- Variants are warmed before the threads start (``train/warmup.py``), so in steady state nobody waits.

Dynamo config is thread-local (torch >= 2.12), so ``compute.compile.apply_dynamo_settings`` runs in every
thread that can compile: each drafter thread, and autograd's backward threads through a pre-hook on the loss'
grad node (``backward_with_settings``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

_FAIL_MARKER = "fail_on_recompile"
T = TypeVar("T")


class CompileNeededError(RuntimeError):
    """A shared step met a variant with no compiled code yet; it is re-run exclusively."""


def needs_compile(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) is Dynamo refusing to compile under fail_on_recompile."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, CompileNeededError) or _FAIL_MARKER in str(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


class CompileGuard:
    """One per process (``GUARD``): a writer-preferring reader/writer lock plus the compile stance."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._threaded = 0
        self.exclusive_runs = 0
        """Steps that had to run alone because they compiled something (a metric; 0 once warm)."""

    @contextlib.contextmanager
    def threaded(self) -> Iterator[None]:
        """While drafter threads run: any compile outside ``exclusive`` raises instead of compiling."""
        with self._cond:
            self._threaded += 1
            first = self._threaded == 1
        if first:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            yield
        finally:
            with self._cond:
                self._threaded -= 1
                last = self._threaded == 0
            if last:
                torch.compiler.set_stance("default")

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Alone in the process, with compiling allowed (the stance is process-wide, hence safe only here)."""
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True
        try:
            with torch.compiler.set_stance("default") if self._threaded else contextlib.nullcontext():
                yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    def run(self, step: Callable[[], T], *, reset: Callable[[], None]) -> T:
        """``step()`` alongside the other threads; if it must compile, ``reset()`` then ``step()`` alone."""
        try:
            with self.shared():
                return step()
        except Exception as exc:
            if not needs_compile(exc):
                raise
        reset()
        with self.exclusive():
            self.exclusive_runs += 1
            return step()


GUARD = CompileGuard()
"""The process-wide guard: every drafter thread of the process goes through it."""
