# Sourced by the one-H200 scripts (h200-*.sh): the whole call's time budget and a step runner. Set BUDGET (seconds
# for the script, under the device tool's per-call limit) before sourcing; each step's exit status and seconds go to
# $OUT/steps.txt, so a call that ran out of time still says which steps finished.
# shellcheck shell=bash
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
step() {  # step NAME LIMIT COMMAND...: run under a time limit, record rc and seconds; skipped under 15 s
    local name=$1 limit=$2 t=$SECONDS
    shift 2
    if [ "$limit" -lt 15 ]; then echo "$name: skipped, $limit s left" | tee -a "$OUT/steps.txt"; return; fi
    timeout --kill-after=5 "$limit" "$@"
    echo "$name: rc $? after $((SECONDS - t)) s (limit $limit)" | tee -a "$OUT/steps.txt"
}
