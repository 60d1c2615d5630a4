#!/usr/bin/env bash
# test.sh: 20 s of fuzzing (scripts/test.sh runs two scripts at a time, the longest first)
# Fuzz smoke run of the KMIP TTLV decoder and response parser
# (crates/kmip/src/ttlv.rs, msg.rs): 20 s of libFuzzer on stable Rust.
# A crash leaves its input in fuzz/artifacts/kmip_ttlv/.
set -euo pipefail
cd "$(dirname "$0")/../../fuzz"
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
    echo "kmip_fuzz.sh: cargo-fuzz missing: run scripts/install.d/cargo-fuzz.sh" >&2
    exit 1
fi
RUSTC_BOOTSTRAP=1 cargo fuzz run kmip_ttlv --sanitizer none -- \
    -max_total_time=20 -rss_limit_mb=2048 -print_final_stats=1 2>&1 | tail -n 6
