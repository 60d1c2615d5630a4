#!/usr/bin/env bash
# cargo-fuzz, for the fuzz smoke runs in scripts/test.d/ (fuzz/ targets run on
# stable with RUSTC_BOOTSTRAP=1 and --sanitizer none). Idempotent.
set -euo pipefail
if command -v cargo-fuzz >/dev/null 2>&1 || [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
    exit 0
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo-fuzz.sh: cargo not found yet; install Rust, then rerun scripts/install.sh" >&2
    exit 0
fi
echo "cargo-fuzz.sh: installing cargo-fuzz from crates.io" >&2
cargo install --locked --quiet cargo-fuzz
