#!/usr/bin/env bash
# test.sh: 20 s of fuzzing (scripts/test.sh runs two scripts at a time, the longest first)
# Fuzz smoke run of the probe's parsers (recorded-facts JSON, kernel log,
# cpuinfo, sysfs and /proc/swaps text; crates/probe): 20 s of libFuzzer on
# stable Rust. A crash leaves its input in fuzz/artifacts/probe_facts/.
set -euo pipefail
cd "$(dirname "$0")/../../fuzz"
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
    echo "probe_fuzz.sh: cargo-fuzz missing: run scripts/install.d/cargo-fuzz.sh" >&2
    exit 1
fi
mkdir -p corpus/probe_facts
cp -n ../crates/probe/tests/fixtures/*.json corpus/probe_facts/ 2>/dev/null || true
RUSTC_BOOTSTRAP=1 cargo fuzz run probe_facts --sanitizer none -- \
    -max_total_time=20 -rss_limit_mb=2048 -print_final_stats=1 2>&1 | tail -n 12
