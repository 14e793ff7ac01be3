"""Threads that run torch code, and an exit that does not abort while one of them still computes.

A daemon thread inside a torch op when the interpreter finalizes takes the whole process down with SIGABRT
("terminate called without an active exception"). A drain bounded by ``--stop-timeout`` can end with a
target thread still inside a long prefill: everything worth keeping is written by then, so the command
exits at once (``os._exit``) instead of finalizing around the thread, and says which thread it left.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable

_COMPUTING: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def computes_torch(thread: threading.Thread) -> None:
    """Registers a (daemon) thread that runs torch code: ``exit_past_computing`` looks for it."""
    _COMPUTING.add(thread)


def still_computing() -> list[str]:
    """The names of registered threads still alive, sorted."""
    return sorted(t.name for t in list(_COMPUTING) if t.is_alive())


def exit_past_computing(say: Callable[[str], None], code: int = 0) -> None:
    """Returns when no registered thread is alive; else says which ones run, flushes stdout and stderr
    and ends the process with ``code`` at once (no interpreter finalization, which would abort)."""
    if not (names := still_computing()):
        return
    say(f"note: {', '.join(names)} still computing at exit; leaving without waiting for it (nothing is lost)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
