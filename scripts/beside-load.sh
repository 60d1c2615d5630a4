#!/usr/bin/env bash
# Runs a command beside N busy loops (CPU contention, issues 33 and 34: the
# shield's handler and sweep fall behind when other threads want the CPU).
#
#   scripts/beside-load.sh N CMD [ARGS...]         CMD once beside N busy loops
#   REPEAT=K scripts/beside-load.sh N CMD [ARGS...] CMD K times (loops kept running);
#                                                   prints "beside-load: F of K failed"
#
# The loops run at nice 0 (as an ordinary program would), each under
# `timeout` (LIMIT seconds, 1800 by default) so that none outlives the run
# even if this script is killed with SIGKILL; a trap kills them on every
# other way out. The exit status is CMD's (with REPEAT: 0 when every run
# passed, 1 otherwise). N=0 runs CMD alone, for the quiet baseline.
#
# Examples:
#   scripts/beside-load.sh 2 target/release/examples/exposure 100
#   REPEAT=20 scripts/beside-load.sh 2 cargo test --release -p memveil --test shield_run -- a_secret_read_every_100_ms
set -uo pipefail

die() { echo "beside-load.sh: $*" >&2; exit 2; }
[ $# -ge 2 ] || die "usage: beside-load.sh N CMD [ARGS...] (N busy loops beside CMD)"
n=$1
shift
[[ "$n" =~ ^[0-9]+$ ]] || die "N must be a number of busy loops, got '$n'"
limit=${LIMIT:-1800}
repeat=${REPEAT:-1}
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || die "REPEAT must be a positive count, got '$repeat'"

pids=()
stop() {
    for p in "${pids[@]}"; do
        kill "$p" 2>/dev/null
    done
    wait 2>/dev/null
}
trap stop EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 "$n"); do
    timeout "$limit" sh -c 'while :; do :; done' &
    pids+=("$!")
done

if [ "$repeat" -eq 1 ]; then
    "$@"
    exit $?
fi
failed=0
for i in $(seq 1 "$repeat"); do
    if "$@"; then
        echo "beside-load: run $i/$repeat passed"
    else
        failed=$((failed + 1))
        echo "beside-load: run $i/$repeat FAILED"
    fi
done
echo "beside-load: $failed of $repeat failed (beside $n busy loops)"
[ "$failed" -eq 0 ]
