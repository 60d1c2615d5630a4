#!/usr/bin/env bash
# test.sh: 10 s of fuzzing (scripts/test.sh runs two scripts at a time, the longest first)
# Fuzz smoke run of the request-head parser of `memveil probe --serve`
# (crates/probe/src/http.rs): 10 s of libFuzzer on stable Rust, seeded with a
# good request and near misses. A crash leaves its input in
# fuzz/artifacts/probe_http/.
set -euo pipefail
cd "$(dirname "$0")/../../fuzz"
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
    echo "probe_http_fuzz.sh: cargo-fuzz missing: run scripts/install.d/cargo-fuzz.sh" >&2
    exit 1
fi
mkdir -p corpus/probe_http
printf 'GET /metrics HTTP/1.1\r\nHost: h:9464\r\nAccept: text/plain\r\n\r\n' > corpus/probe_http/get
printf 'HEAD /metrics?x=1 HTTP/1.0\n\n' > corpus/probe_http/head
printf 'POST /x HTTP/1.1\r\nno colon\r\n\r\n' > corpus/probe_http/bad
RUSTC_BOOTSTRAP=1 cargo fuzz run probe_http --sanitizer none -- \
    -max_total_time=10 -rss_limit_mb=2048 -print_final_stats=1 2>&1 | tail -n 12
