#!/usr/bin/env bash
# The whole test suite, exactly what .ci/run runs: install what the tests need,
# then formatting, lints, docs, unit/integration/end-to-end tests, fuzz smoke.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install.sh --deps
step() { echo; echo "==> $*"; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
step "cargo doc"
RUSTDOCFLAGS=-Dwarnings cargo doc --locked --workspace --no-deps --quiet
step "cargo build (the preload library the end-to-end tests run programs under)"
cargo build --locked --workspace --release
step "cargo test"
cargo test --locked --workspace --release --no-fail-fast 2>&1
for f in scripts/test.d/*.sh; do
    [ -e "$f" ] || continue
    step "$f"
    bash "$f"
done
echo
echo "test.sh: all checks passed"
