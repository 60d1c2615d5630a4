#!/usr/bin/env bash
# The PKCS#11 module (issue 17): registers libmemveil_pkcs11.so with p11-kit
# (/usr/share/p11-kit/modules/memveil.module -> /usr/local/lib/memveil/), and
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
    printf 'module: %s\ncritical: no\n' "$lib" > /usr/share/p11-kit/modules/memveil.module
else
    echo "pkcs11.sh: not root: the module is not registered with p11-kit" >&2
fi

venv=build/pyvenv
want="python-pkcs11==0.10.1"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pkcs11' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$want"
fi
