#!/usr/bin/env bash
# Stress mode of the fuzz targets (not run by CI or scripts/test.sh): every
# target in fuzz/Cargo.toml for SECONDS (default 60, at least 60) of
# libFuzzer each, one after the other, niced; the test.d smoke runs give each
# 10-20 s. Prints one line per target (runs, coverage, result) and exits
# non-zero if any target crashed; a crash leaves its input in
# fuzz/artifacts/<target>/ and the run's log in fuzz/stress-logs/<target>.log.
#
#   scripts/fuzz-stress.sh            # every target, 60 s each (~10 min of CPU)
#   scripts/fuzz-stress.sh 300        # longer
#   scripts/fuzz-stress.sh 60 agent_lock pkcs11_ecdh   # some targets
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
shift || true
if ! [[ "$secs" =~ ^[0-9]+$ ]] || [ "$secs" -lt 60 ]; then
    echo "fuzz-stress.sh: SECONDS must be a whole number of at least 60 (the smoke runs in scripts/test.d are the short ones), got ${secs}" >&2
    exit 2
fi
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
    echo "fuzz-stress.sh: cargo-fuzz missing: run scripts/install.d/cargo-fuzz.sh" >&2
    exit 1
fi
export RUSTC_BOOTSTRAP=1
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi
nice -n 10 cargo fuzz build --release --sanitizer none
mkdir -p stress-logs
failed=()
for t in "${targets[@]}"; do
    log="stress-logs/$t.log"
    start=$(date +%s)
    if nice -n 10 cargo fuzz run "$t" --release --sanitizer none -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        result=ok
    else
        result=CRASH
        failed+=("$t")
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*' || echo "?")
    printf '%-14s %4ss  %10s runs  cov %6s  %s\n' "$t" "$(($(date +%s) - start))" "$runs" "$cov" "$result"
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz-stress.sh: crashes in: ${failed[*]} (inputs in fuzz/artifacts/, logs in fuzz/stress-logs/)" >&2
    exit 1
fi
echo "fuzz-stress.sh: ${#targets[@]} targets, ${secs} s each, no crash"
