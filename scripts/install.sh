#!/usr/bin/env bash
# Installs every system package memveil needs (Debian 12), checks the Rust
# toolchain, builds the release binaries and installs them as the Debian package
# scripts/package.sh makes (memveil in /usr/bin). Idempotent; run as root (or via sudo).
#   scripts/install.sh            packages + release build + the memveil package
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
    # The Debian package of this build (scripts/package.sh): memveil on the PATH,
    # the preload library and the loader for static programs, the PKCS#11 module registered with p11-kit, man pages,
    # completions and the systemd units.
    deb=$(scripts/package.sh --no-build)
    if [ "$(id -u)" -eq 0 ]; then
        dpkg -i "$deb" >/dev/null
        if [ -d /run/systemd/system ]; then
            systemctl daemon-reload
            echo "install.sh: start the vault with: systemctl enable --now memveil-vault" >&2
        else
            echo "install.sh: no systemd here; start the vault with: memveil vault serve &" >&2
        fi
        echo "install.sh: installed $deb: $(command -v memveil)" >&2
    else
        echo "install.sh: built $deb; install it as root: sudo dpkg -i $deb" >&2
    fi
fi
