# Progress lines for the setup scripts (sourced: `. scripts/progress.sh NAME`):
#   step "what"   prints `NAME: [12 s] what` and remembers it;
#   a background ticker prints `NAME: [52 s] still at what` every 20 s while a step runs
#   ($RDMA_PLAN_PROGRESS_EVERY seconds, if set);
#   done_in       prints `NAME: done in 3 min 12 s` and stops the ticker.
# The ticker is stopped on exit, whatever the exit. A script run by another that already
# ticks (setup_live.sh under setup.sh) reports its steps through the outer ticker.
_progress_name="$1"
_progress_t0=$SECONDS
_progress_pid=""
if [ -n "${RDMA_PLAN_PROGRESS_STATE:-}" ] && [ -e "$RDMA_PLAN_PROGRESS_STATE" ]; then
  _progress_outer=1
else
  _progress_outer=""
  RDMA_PLAN_PROGRESS_STATE="$(mktemp "${TMPDIR:-/tmp}/rdma-plan-setup.XXXXXX")"
  export RDMA_PLAN_PROGRESS_STATE
fi
_progress_tick() {
  local t0=$1
  while sleep "${RDMA_PLAN_PROGRESS_EVERY:-20}"; do
    [ -s "$RDMA_PLAN_PROGRESS_STATE" ] || continue
    echo "$_progress_name: [$((SECONDS - t0)) s] still at $(cat "$RDMA_PLAN_PROGRESS_STATE")"
  done
}
_progress_stop() {
  if [ -n "$_progress_pid" ]; then
    kill "$_progress_pid" 2>/dev/null || true
    wait "$_progress_pid" 2>/dev/null || true
    _progress_pid=""
  fi
  [ -n "$_progress_outer" ] || rm -f "$RDMA_PLAN_PROGRESS_STATE"
}
step() {
  echo "$_progress_name: $*" > "$RDMA_PLAN_PROGRESS_STATE"
  echo "$_progress_name: [$((SECONDS - _progress_t0)) s] $*"
}
done_in() {
  local t=$((SECONDS - _progress_t0))
  _progress_stop
  echo "$_progress_name: done in $((t / 60)) min $((t % 60)) s"
}
if [ -z "$_progress_outer" ]; then
  _progress_tick "$_progress_t0" &
  _progress_pid=$!
fi
trap _progress_stop EXIT
