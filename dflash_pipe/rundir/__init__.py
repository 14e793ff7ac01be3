"""The run directory as a whole: who owns it, which run a path names, and what a resume checks first.

One launch writes into a run directory at a time. ``RunDirLock`` holds an OS file lock (``filelock``) on
RUN_DIR/.lock for the launch's lifetime and records its owner (pid, host, command, version) in
RUN_DIR/owner.json, so a second launch is refused before it writes or spawns anything, naming the process.
The OS drops the lock of a process that dies (SIGKILL, OOM); its owner.json, never marked released, tells
the next launch to take the run dir over with a warning. ``report`` and ``export`` only read a run
(``report`` writes its PNGs under RUN_DIR/report/, which a launch never touches), so they take no lock.

``--resume PATH`` resumes PATH, wherever it now is (``load_run_config``); ``check_resume`` then finds the
checkpoint to resume from (verified against its manifest; a damaged latest falls back to the previous intact
one, set aside, never deleted), reports a cut-short metrics line, and stops a finished run with one line
saying how to train on. Each problem is one line naming the file and what to do.
"""

from dflash_pipe.rundir.checkpoints import choose_checkpoint, find_checkpoint, held_checkpoint
from dflash_pipe.rundir.config import load_run_config, save_run_config
from dflash_pipe.rundir.lock import OWNER_FILE, RunDirBusy, RunDirLock, read_owner
from dflash_pipe.rundir.resume import (
    NothingTrained,
    RunComplete,
    check_launch,
    check_open_work,
    check_resume,
    complete_message,
    record_complete,
)

__all__ = [
    "OWNER_FILE",
    "NothingTrained",
    "RunComplete",
    "RunDirBusy",
    "RunDirLock",
    "check_launch",
    "check_open_work",
    "check_resume",
    "choose_checkpoint",
    "complete_message",
    "find_checkpoint",
    "held_checkpoint",
    "load_run_config",
    "read_owner",
    "record_complete",
    "save_run_config",
]
