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
    # A step failed while the packages and install.d hooks still installed: they end first.
    if declare -F wait_hooks >/dev/null; then
        wait_hooks || true
    fi
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

# The scripts of scripts/test.d (fuzz smoke runs of fixed length, and checks),
# two at a time: on the two cores CI gives, each fuzzer has a core of its own
# for its whole -max_total_time, as when they ran one after the other. The
# fuzz targets were built beside the tests (cargo_test). Longest first (the
# seconds a script's `# test.sh: N s` line gives), so both lanes end
# together; each script's output is shown whole, under its own header.
run_test_d() {
    local f n i=0 rc=0 out
    local -a scripts=()
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

# The fuzz targets, all in one cargo command (scripts/test.d runs them).
have_cargo_fuzz() {
    [ -d fuzz ] && { command -v cargo-fuzz >/dev/null 2>&1 ||
        [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; }
}
build_fuzz() {
    (cd fuzz && RUSTC_BOOTSTRAP=1 nice -n 19 cargo fuzz build --sanitizer none)
}

# cargo test in two parts (ARCHITECTURE.md, "The test run"). The test files
# whose first line is `// test.sh: alone` test the shield: its threads run at
# SCHED_IDLE and the tests sample memory on time, so nothing runs beside them.
# The other test files, the unit tests and the doc tests run first, beside
# the fuzz targets' build (nice 19): they leave most of a core idle. A file
# without the mark runs beside the build; two files of one name must agree,
# since `--test NAME` selects both.
cargo_test() {
    local f n k rc=0 fuzz_pid= fuzz_log
    local -a alone=() beside=()
    local -A part=()
    for f in crates/*/tests/*.rs; do
        n=$(basename "$f" .rs)
        if head -n1 "$f" | grep -q '^// test\.sh: alone'; then k=alone; else k=beside; fi
        if [ -n "${part[$n]:-}" ]; then
            [ "${part[$n]}" = "$k" ] && continue
            echo "test.sh: two test files named $n, one marked alone and one not (--test $n selects both): mark both or rename one" >&2
            return 1
        fi
        part[$n]=$k
        if [ "$k" = alone ]; then alone+=(--test "$n"); else beside+=(--test "$n"); fi
    done
    if have_cargo_fuzz; then
        step "cargo test: unit, doc and $((${#beside[@]} / 2)) test files, beside the fuzz targets' build"
        fuzz_log=$(mktemp "${TMPDIR:-/tmp}/memveil-fuzzbuild.XXXXXX")
        build_fuzz > "$fuzz_log" 2>&1 &
        fuzz_pid=$!
    else
        step "cargo test: unit, doc and $((${#beside[@]} / 2)) test files (no cargo-fuzz: the fuzz targets are not built)"
    fi
    cargo test --locked --workspace --release --no-fail-fast --lib --bins "${beside[@]}" 2>&1 || rc=1
    cargo test --locked --workspace --release --no-fail-fast --doc 2>&1 || rc=1
    if [ -n "$fuzz_pid" ]; then
        step "the fuzz targets' build (beside the tests above)"
        local frc=0 s=$SECONDS
        wait "$fuzz_pid" || frc=$?
        echo "(waited $((SECONDS - s)) s for it after the tests)"
        cat "$fuzz_log"
        rm -f "$fuzz_log"
        [ "$frc" = 0 ] || { echo "test.sh: the fuzz targets' build failed ($frc)"; rc=1; }
    fi
    step "cargo test: the shield's $((${#alone[@]} / 2)) test files, alone"
    cargo test --locked --workspace --release --no-fail-fast "${alone[@]}" 2>&1 || rc=1
    return "$rc"
}

# What the tests need (scripts/install.sh --deps): the Debian packages that
# build memveil first (seconds: a fresh Debian machine has them); then the
# rest, the other packages and the artefacts of scripts/install.d (the guest
# kernel download, two Python venvs, cargo-fuzz: network and dpkg waits,
# little CPU but cargo-fuzz's build), beside the compile steps, which need
# none of them (on a clean machine the packages took 47 s and the hooks ~50 s
# of the run one after the other). Their output and status come after the
# build step, before the first step that runs anything.
scripts/install.sh --build-packages
HOOKS_LOG=$(mktemp "${TMPDIR:-/tmp}/memveil-hooks.XXXXXX")
scripts/install.sh --deps > "$HOOKS_LOG" 2>&1 &
HOOKS_PID=$!
wait_hooks() {
    local rc=0
    [ -n "${HOOKS_PID:-}" ] || return 0
    wait "$HOOKS_PID" || rc=$?
    HOOKS_PID=
    cat "$HOOKS_LOG"
    rm -f "$HOOKS_LOG"
    [ "$rc" = 0 ] || echo "test.sh: scripts/install.sh --deps failed ($rc)"
    return "$rc"
}

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
step "scripts/install.sh --deps: the packages and scripts/install.d (beside the steps above)"
wait_hooks
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
cargo_test
run_test_d
step "no process the tests started is left"
check_leftovers
echo
echo "test.sh: all checks passed in $((SECONDS))s"
