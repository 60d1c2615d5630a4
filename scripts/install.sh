#!/usr/bin/env bash
# Installs every system package memveil needs (Debian 12), checks the Rust
# toolchain, and builds the release binary. Idempotent; run as root (or via sudo).
#   scripts/install.sh            packages + release build
#   scripts/install.sh --deps     packages only
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=()
while read -r p; do
    p=${p%%#*}; p=$(echo "$p" | xargs)
    [ -z "$p" ] && continue
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
done < scripts/packages.txt

if [ ${#need_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install.sh: missing packages: ${need_pkgs[*]}; run as root (sudo scripts/install.sh)" >&2
        exit 1
    fi
    echo "install.sh: installing ${need_pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

# Extra artefacts built from Debian packages (guest kernel, initramfs, ...).
for hook in scripts/install.d/*.sh; do
    [ -e "$hook" ] || continue
    bash "$hook"
done

if ! command -v cargo >/dev/null 2>&1; then
    echo "install.sh: cargo not found: install Rust (stable) with rustup, then rerun" >&2
    exit 1
fi

if [ "${1:-}" != "--deps" ]; then
    cargo build --release --locked --workspace
    echo "install.sh: built target/release/memveil" >&2
    if [ "$(id -u)" -eq 0 ]; then
        # The PKCS#11 module, where scripts/install.d/pkcs11.sh told p11-kit to look.
        rm -f /usr/local/lib/memveil/libmemveil_pkcs11.so
        install -D -m 0755 target/release/libmemveil_pkcs11.so /usr/local/lib/memveil/libmemveil_pkcs11.so
    fi
fi
