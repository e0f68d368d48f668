#!/usr/bin/env bash
# The README's test command on a busy box: N CPU-bound processes (default 6) run beside it
# for the whole run, then stop. Prints pass/fail, the minutes it took and the box's load.
#   bash scripts/test_under_load.sh                 the README's `python3 -m pytest -q`
#   LOAD_PROCS=3 bash scripts/test_under_load.sh tests/executor    fewer hogs, one folder
# Run it after `bash scripts/setup.sh --test`, in the same Python. Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
n="${LOAD_PROCS:-6}"
hogs=()
stop_hogs() { [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null; hogs=(); }
trap stop_hogs EXIT
# Each load process in a session of its own: where the kernel groups CPU time by session
# (sched_autogroup), hogs in pytest's own session would only slow pytest; in sessions of their
# own they load the whole box, as N busy neighbours would.
for _ in $(seq "$n"); do
  setsid bash -c 'while :; do :; done' &
  hogs+=($!)
done
echo "test_under_load: $n CPU-bound processes started on $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
t0=$SECONDS
python3 -m pytest -q "$@"
rc=$?
secs=$((SECONDS - t0))
load="$(cut -d' ' -f1-3 /proc/loadavg)"
stop_hogs
verdict=$([ "$rc" -eq 0 ] && echo pass || echo "FAIL (pytest exit $rc)")
printf 'test_under_load: %s in %d.%d min beside %d CPU-bound processes (load at the end %s)\n' \
  "$verdict" $((secs / 60)) $((secs % 60 * 10 / 60)) "$n" "$load"
exit "$rc"
