#!/usr/bin/env bash
# The PKCS#11 module (issue 17): until the memveil package is installed (it
# owns /usr/share/p11-kit/modules/memveil.module), registers this checkout's
# libmemveil_pkcs11.so with p11-kit there (-> /usr/local/lib/memveil/), and
# puts python-pkcs11 (PyPI, pinned) in build/pyvenv for the tests.
# Until install.sh has built and copied the library, /usr/local/lib/memveil/
# holds a link to this checkout's target/release build (what the tests load).
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."

lib=/usr/local/lib/memveil/libmemveil_pkcs11.so
if [ "$(id -u)" -eq 0 ]; then
    mkdir -p /usr/local/lib/memveil /usr/share/p11-kit/modules
    if [ ! -e "$lib" ] || [ -L "$lib" ]; then
        ln -sfn "$PWD/target/release/libmemveil_pkcs11.so" "$lib"
    fi
    # One registration: the memveil package's (scripts/install.sh installs it)
    # once there is one; until then the same file names this checkout's build.
    mod=/usr/share/p11-kit/modules/memveil.module
    if ! dpkg-query -S "$mod" >/dev/null 2>&1; then
        printf 'module: %s\ncritical: no\n' "$lib" > "$mod"
    fi
else
    echo "pkcs11.sh: not root: the module is not registered with p11-kit" >&2
fi

venv=build/pyvenv
want="python-pkcs11==0.10.1"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pkcs11' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$want"
fi
