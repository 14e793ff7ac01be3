#!/usr/bin/env bash
# The test suite's time as CI sees it: a fresh clone of a commit, cold caches (dflash-pipe's and Inductor's
# in empty folders, Inductor's precompiled headers removed), `bash .ci/run` (install, test assets, pytest),
# the CPU of the whole machine sampled every 5 s. What README's `make test` line and issue 51's notes quote;
# with a make target, that target in place of `.ci/run` (README's `make test-fast` line: `test-fast`).
#
#   bench/suite_time.sh [COMMIT] [OUT] [MAKE_TARGET]     # default: HEAD, bench-results/suite-<time>, .ci/run
#
# OUT gets run.log (the run's output, with pytest's --durations=0 list and `wall/user/sys` at the end),
# cpu.log (/proc/stat's cpu line every 5 s) and summary.txt (the run's times and the cores' mean use).
# Run it alone on the machine: any other job on the cores lengthens the suite.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="${1:-HEAD}"
target="${3:-}"
run=(bash .ci/run)
[ -n "$target" ] && run=(make "$target")
out="$(realpath -m "${2:-bench-results/suite-$(date +%Y%m%d-%H%M%S)}")"
work="$(mktemp -d /tmp/dflash-suite-XXXXXX)"
mkdir -p "$out"
git clone -q "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$commit"
rm -rf "${TMPDIR:-/tmp}/torchinductor_$(id -un)/precompiled_headers"
(while true; do echo "$(date +%s) $(head -1 /proc/stat)" >> "$out/cpu.log"; sleep 5; done) &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT
set +e
(cd "$work/clone" && DFLASH_PIPE_CACHE="$work/cache" TORCHINDUCTOR_CACHE_DIR="$work/inductor" \
  PYTEST_ADDOPTS="--durations=0" /usr/bin/time -f "wall %e user %U sys %S" "${run[@]}") > "$out/run.log" 2>&1
rc=$?
set -e
kill $sampler 2>/dev/null || true
{
  echo "commit $(git -C "$work/clone" rev-parse HEAD), ${run[*]}, exit status $rc"
  grep -E "^test asset|passed|failed|^wall " "$out/run.log" || true
  awk '{idle = $6 + $7; total = 0; for (i = 3; i <= 10; i++) total += $i;
        if (NR > 1) { busy += (total - pt) - (idle - pi); all += total - pt } pt = total; pi = idle }
       END { if (all) printf "cores busy: %.0f%% of the machine\n", 100 * busy / all }' "$out/cpu.log"
} | tee "$out/summary.txt"
rm -rf "$work"
exit $rc
