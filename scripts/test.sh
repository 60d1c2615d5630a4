#!/usr/bin/env bash
# The whole test suite, exactly what .ci/run runs: install what the tests need,
# then formatting, lints, docs, unit/integration/end-to-end tests, fuzz smoke.
# Ends with the count of skipped tests by reason. Under CI=true (.ci/run sets
# it) a test that would skip for want of something scripts/install.sh provides
# fails instead (crates/testkit); machine features (root, memfd_secret,
# userfaultfd, a CPU feature...) stay skips and are counted.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's header shows the seconds since the start, so a log tells what each step costs.
step() { echo; echo "==> [$((SECONDS))s] $*"; }

# Every skip appends `SKIP <test>: <reason>: <detail>` here (memveil_testkit::skip).
MEMVEIL_SKIP_LOG=$(mktemp "${TMPDIR:-/tmp}/memveil-skips.XXXXXX")
export MEMVEIL_SKIP_LOG
count_skips() {
    local rc=$?
    stop_background
    # The tests failed before the check at the end: name leftovers all the same.
    if [ -n "${MEMVEIL_TEST_RUN:-}" ] && [ -z "${LEFTOVERS_CHECKED:-}" ]; then
        step "processes the tests started"
        check_leftovers || true
    fi
    step "skipped tests, by reason${CI:+ (CI=$CI)}"
    if [ -s "$MEMVEIL_SKIP_LOG" ]; then
        # A test that skips the same part twice (gcore of two processes) counts once.
        sort -u -o "$MEMVEIL_SKIP_LOG" "$MEMVEIL_SKIP_LOG"
        cat "$MEMVEIL_SKIP_LOG"
        echo "by reason:"
        awk -F': ' '{ print $2 }' "$MEMVEIL_SKIP_LOG" | sort | uniq -c | sort -rn
        echo "test.sh: $(wc -l < "$MEMVEIL_SKIP_LOG") skips"
    else
        echo "test.sh: no test skipped"
    fi
    rm -f "$MEMVEIL_SKIP_LOG"
    exit "$rc"
}
trap count_skips EXIT

# Every process a test starts inherits MEMVEIL_TEST_RUN (pykmip-server,
# memveil vault/agent/rng/disk/probe serve, memveil run, qemu, prometheus,
# rngd, gocryptfs, ssh-agent...); the daemons that write their title over
# their environment (nginx, sshd, redis-server, postgres) are found by their
# command line instead, if they were not running before. Whatever of either
# is still alive after the tests is a leftover: a test or bench part that
# did not stop what it started. (Another test run on the machine at the same
# time may start such daemons too: run the suite alone.)
DAEMONS='nginx|sshd.*sshd_config|redis-server|postgres'
# Whether process $1 is this script or runs under it (the check's own pipeline).
ours() {
    local p=$1
    while [ -n "$p" ] && [ "$p" -gt 1 ]; do
        [ "$p" = $$ ] && return 0
        p=$(awk '/^PPid:/ { print $2 }' "/proc/$p/status" 2>/dev/null)
    done
    return 1
}
# A zombie is dead (its init may be slow to reap it), the rest is running.
alive() {
    [ "$(awk '/^State:/ { print $2 }' "/proc/$1/status" 2>/dev/null)" != Z ] && [ -e "/proc/$1" ]
}
leftovers() {
    local pid
    for pid in $(pgrep -f -- "$DAEMONS" || true); do
        grep -qx "$pid" <<<"$DAEMONS_BEFORE" || ours "$pid" || ! alive "$pid" || echo "$pid"
    done
    for pid in /proc/[0-9]*; do
        pid=${pid#/proc/}
        grep -qzx "MEMVEIL_TEST_RUN=$MEMVEIL_TEST_RUN" "/proc/$pid/environ" 2>/dev/null &&
            ! ours "$pid" && alive "$pid" && echo "$pid"
    done
    # The loop's status is its last test's (a process gone meanwhile makes
    # grep answer 2): under set -e and pipefail that would end the script.
    return 0
}
check_leftovers() {
    local pids
    LEFTOVERS_CHECKED=1
    pids=$(leftovers | sort -un)
    # What was killed a moment ago may still be on its way out.
    [ -z "$pids" ] || { sleep 2; pids=$(leftovers | sort -un); }
    [ -z "$pids" ] && { echo "test.sh: no process the tests started is left"; return 0; }
    echo "test.sh: processes the tests started are still running (a test or bench part does not stop what it starts):"
    for pid in $pids; do
        echo "  $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
    done
    return 1
}

# The fuzz targets (scripts/test.d runs them), all in one cargo command, in
# fuzz/target (cargo fuzz's own flags: every crate, aws-lc-sys's C library
# too, compiles again there). Built beside `cargo test` at nice 19: the tests
# take a core whenever they want one (a nice-19 task weighs 15 against a
# nice-0 task's 1024), the build takes what the tests' waits leave (etcd's
# and the idle samplers' seconds of sleep). In its own session, so that a
# failed run stops it whole (stop_background, from the EXIT trap).
FUZZ_PID=
FUZZ_OUT=
BESIDE_PID=
BESIDE_OUT=
start_fuzz_build() {
    [ -d fuzz ] && { command -v cargo-fuzz >/dev/null 2>&1 ||
        [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; } || return 0
    FUZZ_OUT=$(mktemp -d "${TMPDIR:-/tmp}/memveil-fuzzbuild.XXXXXX")
    setsid bash -c 'cd fuzz && s=$SECONDS rc=0
        RUSTC_BOOTSTRAP=1 nice -n 19 cargo fuzz build --sanitizer none || rc=$?
        echo "$rc $((SECONDS - s))" > "$1/rc"' fuzzbuild "$FUZZ_OUT" > "$FUZZ_OUT/log" 2>&1 &
    FUZZ_PID=$!
}
# What runs in the background (the fuzz build, the tests beside cargo test),
# stopped whole when the run ends early (from the EXIT trap).
stop_background() {
    local p
    for p in "$FUZZ_PID" "$BESIDE_PID"; do
        [ -z "$p" ] || kill -- "-$p" 2>/dev/null || true
    done
    rm -rf "$FUZZ_OUT" "$BESIDE_OUT"
    FUZZ_PID= BESIDE_PID=
}
# Waits for the build; its output under its own header, with the seconds it
# took and the seconds the run waited for it after cargo test.
wait_fuzz_build() {
    local rc s=$SECONDS
    [ -n "$FUZZ_PID" ] || return 0
    wait "$FUZZ_PID" || true
    FUZZ_PID=
    step "the fuzz targets, built beside cargo test ($(cut -d' ' -f2 "$FUZZ_OUT/rc" 2>/dev/null) s; waited $((SECONDS - s)) s for it here)"
    cat "$FUZZ_OUT/log"
    rc=$(cut -d' ' -f1 "$FUZZ_OUT/rc" 2>/dev/null || echo 1)
    rm -rf "$FUZZ_OUT"
    FUZZ_OUT=
    [ "$rc" = 0 ] || { echo "test.sh: cargo fuzz build failed"; return 1; }
}

# The tests that run in a lane of their own beside the rest of `cargo test`
# (ARCHITECTURE.md, "The test run"), one after the other: `test target` and
# the test's exact name. shield_etcd sleeps most of its 138 s (it samples two
# idle servers, 66 s each); the disk proof waits on fio, gcore and two
# scanners. The rest of `cargo test` skips exactly these names, so each test
# runs once; a name that no longer matches a test fails the run (it would
# otherwise run in neither lane).
BESIDE=(
    "shield_etcd etcd_answers_as_plainly_keeps_a_secret_value_out_of_its_heap_and_stops_cleanly"
    "proof key_is_not_in_dumps_of_the_disk_server_or_vault_but_gocryptfs_key_is_found"
)
start_beside() {
    BESIDE_OUT=$(mktemp -d "${TMPDIR:-/tmp}/memveil-beside.XXXXXX")
    # shellcheck disable=SC2016 # expanded by the lane's own bash
    setsid bash -c 'set -o pipefail
        out=$1 s=$SECONDS rc=0 n=0
        shift
        for t in "$@"; do
            n=$((n + 1))
            cargo test --locked --workspace --release --no-fail-fast --test "${t%% *}" \
                -- --exact "${t#* }" 2>&1 | tee "$out/$n.log" || rc=1
            grep -q "^test ${t#* } \.\.\. " "$out/$n.log" ||
                { echo "test.sh: no test ${t#* } in --test ${t%% *} (BESIDE in scripts/test.sh)"; rc=1; }
        done
        echo "$rc $((SECONDS - s))" > "$out/rc"' beside "$BESIDE_OUT" "${BESIDE[@]}" \
        > "$BESIDE_OUT/log" 2>&1 &
    BESIDE_PID=$!
}
# Waits for the lane beside cargo test; its output under its own header.
wait_beside() {
    local rc
    [ -n "$BESIDE_PID" ] || return 0
    wait "$BESIDE_PID" || true
    BESIDE_PID=
    step "cargo test, the lane beside it: ${BESIDE[*]%% *} ($(cut -d' ' -f2 "$BESIDE_OUT/rc" 2>/dev/null) s)"
    cat "$BESIDE_OUT/log"
    rc=$(cut -d' ' -f1 "$BESIDE_OUT/rc" 2>/dev/null || echo 1)
    rm -rf "$BESIDE_OUT"
    BESIDE_OUT=
    [ "$rc" = 0 ] || { echo "test.sh: a test beside cargo test failed"; return 1; }
}

# The scripts of scripts/test.d (fuzz smoke runs of fixed length, and checks),
# two at a time: on the two cores CI gives, each fuzzer has a core of its own
# for its whole -max_total_time, as when they ran one after the other. They
# start once the fuzz targets are built (wait_fuzz_build). Longest first (the
# seconds a script's `# test.sh: N s` line gives), so both lanes end
# together; each script's output is shown whole, under its own header.
run_test_d() {
    local f n i=0 rc=0 out
    local -a scripts=()
    wait_fuzz_build
    mapfile -t scripts < <(for f in scripts/test.d/*.sh; do
        [ -e "$f" ] || continue
        n=$(sed -n 's/^# test\.sh: \([0-9]*\) s.*/\1/p' "$f" | head -n1)
        echo "${n:-0} $f"
    done | sort -k1,1nr -k2)
    out=$(mktemp -d "${TMPDIR:-/tmp}/memveil-testd.XXXXXX")
    for f in "${scripts[@]}"; do
        f=${f#* }
        while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n || true; done
        (
            s=$SECONDS
            rc=0
            bash "$f" > "$out/$i.log" 2>&1 || rc=$?
            echo "$rc $((SECONDS - s))" > "$out/$i.rc"
        ) &
        i=$((i + 1))
    done
    wait
    i=0
    for f in "${scripts[@]}"; do
        f=${f#* }
        step "$f ($(cut -d' ' -f2 "$out/$i.rc") s)"
        cat "$out/$i.log"
        [ "$(cut -d' ' -f1 "$out/$i.rc")" = 0 ] || { echo "test.sh: $f failed"; rc=1; }
        i=$((i + 1))
    done
    rm -rf "$out"
    return "$rc"
}

scripts/install.sh --deps

# One build serves every step (ARCHITECTURE.md, "The test run"): every cargo
# command below takes the release profile, so build scripts (aws-lc-sys's C
# library) and proc macros are built once, and the ones that compile code
# take --workspace with the tests selected, so features resolve once, with
# the tests' dev-dependencies (aes's hazmat, getrandom's std, ...). A plain
# `cargo build --release` resolves without them, and `-p X` with X's alone:
# each of those would compile most of the workspace again.
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --locked --workspace --all-targets --release -- -D warnings
step "cargo check and doc (the features a plain cargo build --release resolves: what install.sh builds and the package ships)"
cargo check --locked --workspace --release
RUSTDOCFLAGS=-Dwarnings cargo doc --locked --workspace --no-deps --release --quiet
step "cargo build (the binaries and preload library the end-to-end tests run programs under, and the tests)"
cargo build --locked --workspace --release --lib --bins --tests --examples --timings
step "BENCHMARKS.md's figure table against docs/figures/*.json"
scripts/figures.sh --check
step "the figure sheet: a target says what it is of; a missed µs target with a passing ratio is missed"
cargo test --locked --release -q --workspace --lib sheet
step "docs agree with the CLI (commands, flags, links, anchors, sections); every -h and --help in 100 columns"
cargo test --locked --release -q --workspace --bin memveil -- doc_check every_subcommand
step "memveil probe's report in 100 columns"
cargo test --locked --release -q --workspace --test fixtures
step "the Debian package: systemd-analyze verify, installed into a fresh root, smoke path"
scripts/test-package.sh
step "cargo test"
DAEMONS_BEFORE=$(pgrep -f -- "$DAEMONS" || true)
MEMVEIL_TEST_RUN="$$-$(date +%s%N)"
export MEMVEIL_TEST_RUN
start_fuzz_build
start_beside
skips=()
for t in "${BESIDE[@]}"; do skips+=(--skip "${t#* }"); done
rc=0
cargo test --locked --workspace --release --no-fail-fast -- --exact "${skips[@]}" 2>&1 || rc=$?
wait_beside || rc=1
[ "$rc" = 0 ] || exit "$rc"
run_test_d
step "no process the tests started is left"
check_leftovers
echo
echo "test.sh: all checks passed in $((SECONDS))s"
