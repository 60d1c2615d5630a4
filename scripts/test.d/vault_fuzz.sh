#!/usr/bin/env bash
# test.sh: 90 s of fuzzing (scripts/test.sh runs two scripts at a time, the longest first)
# Fuzz smoke runs of the vault's control codec and ring-descriptor checks
# (crates/vault/src/proto/, ring.rs), the key-file reader (keyfile.rs),
# memveil agent's ssh-agent codec (crates/agent/src/proto.rs) and its
# LOCK/UNLOCK path (lock.rs; 10 s): 20 s of libFuzzer each on stable Rust.
# A crash leaves its input in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/../../fuzz"
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
    echo "vault_fuzz.sh: cargo-fuzz missing: run scripts/install.d/cargo-fuzz.sh" >&2
    exit 1
fi
for t in vault_proto:20 vault_ring:20 keyfile:20 agent_proto:20 agent_lock:10; do
    RUSTC_BOOTSTRAP=1 cargo fuzz run "${t%%:*}" --sanitizer none -- \
        -max_total_time="${t##*:}" -rss_limit_mb=2048 -print_final_stats=1 2>&1 | tail -n 6
done
