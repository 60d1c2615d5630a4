#!/usr/bin/env bash
# Installs every system package memveil needs (Debian 12), checks the Rust
# toolchain, builds the release binaries and installs them as the Debian package
# scripts/package.sh makes (memveil in /usr/bin). Idempotent; run as root (or via sudo).
#   scripts/install.sh            packages + release build + the memveil package
#   scripts/install.sh --deps     packages only
# Parts of --deps, for scripts/test.sh (it installs what the compile needs
# first and the rest beside its compile steps, which need none of it):
#   scripts/install.sh --build-packages the Debian packages that build memveil
#                                       (scripts/packages-build.txt)
#   scripts/install.sh --packages the Debian packages of scripts/packages-build.txt
#                                 and scripts/packages.txt
#   scripts/install.sh --hooks    the artefacts of scripts/install.d/*.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
    ""|--deps|--build-packages|--packages|--hooks) ;;
    *) echo "install.sh: unknown option $mode (--deps, --build-packages, --packages or --hooks)" >&2; exit 2 ;;
esac

# The Debian packages of the lists given (one per line, '#' comments) that are
# not installed yet.
install_packages() {
    local p
    local -a need_pkgs=()
    while read -r p; do
        p=${p%%#*}; p=$(echo "$p" | xargs)
        [ -z "$p" ] && continue
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
    done < <(cat "$@")

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
}
if [ "$mode" = --build-packages ]; then
    install_packages scripts/packages-build.txt
    exit 0
fi
[ "$mode" = --hooks ] || install_packages scripts/packages-build.txt scripts/packages.txt
[ "$mode" = --packages ] && exit 0

# Extra artefacts built from Debian packages (guest kernel, initramfs, ...).
for hook in scripts/install.d/*.sh; do
    [ -e "$hook" ] || continue
    bash "$hook"
done
[ "$mode" = --hooks ] && exit 0

if ! command -v cargo >/dev/null 2>&1; then
    echo "install.sh: cargo not found: install Rust (stable) with rustup, then rerun" >&2
    exit 1
fi

if [ "$mode" != --deps ]; then
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
