#!/usr/bin/env bash
# The QEMU guest tests of the entropy service (crates/drng/tests/qemu_guest.rs)
# print SKIP when qemu or the guest artefacts are missing. In CI it must have
# run: fail here if anything it needs is absent (scripts/install.sh builds it).
set -euo pipefail
cd "$(dirname "$0")/../.."
for f in build/guest/vmlinuz build/guest/initramfs.cpio.gz; do
    [ -f "$f" ] || { echo "egd_guest.sh: $f missing: run scripts/install.d/guest.sh" >&2; exit 1; }
done
command -v qemu-system-x86_64 >/dev/null \
    || { echo "egd_guest.sh: qemu-system-x86_64 missing (apt-get install qemu-system-x86)" >&2; exit 1; }
bin="${CARGO_TARGET_DIR:-target}/release/memveil"
[ -x "$bin" ] || { echo "egd_guest.sh: $bin missing, so the guest test against the daemon process skipped" >&2; exit 1; }
echo "egd_guest.sh: qemu, build/guest and $bin present, so both QEMU guest tests ran in cargo test"
