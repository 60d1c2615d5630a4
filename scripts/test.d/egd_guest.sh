#!/usr/bin/env bash
# The QEMU guest test of the entropy service (crates/drng/tests/qemu_guest.rs)
# prints SKIP when qemu or the guest artefacts are missing. In CI it must have
# run: fail here if anything it needs is absent (scripts/install.sh builds it).
set -euo pipefail
cd "$(dirname "$0")/../.."
for f in build/guest/vmlinuz build/guest/initramfs.cpio.gz; do
    [ -f "$f" ] || { echo "egd_guest.sh: $f missing: run scripts/install.d/guest.sh" >&2; exit 1; }
done
command -v qemu-system-x86_64 >/dev/null \
    || { echo "egd_guest.sh: qemu-system-x86_64 missing (apt-get install qemu-system-x86)" >&2; exit 1; }
echo "egd_guest.sh: qemu and build/guest present, so the QEMU guest test ran in cargo test"
