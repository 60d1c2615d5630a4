#!/usr/bin/env bash
# The whole test suite, exactly what .ci/run runs: install what the tests need,
# then formatting, lints, docs, unit/integration/end-to-end tests, fuzz smoke.
# Ends with the count of skipped tests by reason. Under CI=true (.ci/run sets
# it) a test that would skip for want of something scripts/install.sh provides
# fails instead (crates/testkit); machine features (root, memfd_secret,
# userfaultfd, a CPU feature...) stay skips and are counted.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo; echo "==> $*"; }

# Every skip appends `SKIP <test>: <reason>: <detail>` here (memveil_testkit::skip).
MEMVEIL_SKIP_LOG=$(mktemp "${TMPDIR:-/tmp}/memveil-skips.XXXXXX")
export MEMVEIL_SKIP_LOG
count_skips() {
    local rc=$?
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

scripts/install.sh --deps

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
step "cargo doc"
RUSTDOCFLAGS=-Dwarnings cargo doc --locked --workspace --no-deps --quiet
step "cargo build (the preload library the end-to-end tests run programs under)"
cargo build --locked --workspace --release
step "BENCHMARKS.md's figure table against docs/figures/*.json"
scripts/figures.sh --check
step "cargo test"
cargo test --locked --workspace --release --no-fail-fast 2>&1
for f in scripts/test.d/*.sh; do
    [ -e "$f" ] || continue
    step "$f"
    bash "$f"
done
echo
echo "test.sh: all checks passed"
