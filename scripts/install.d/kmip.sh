#!/usr/bin/env bash
# KMIP (issue 28): PyKMIP's server (PyPI, pinned) in build/kmipvenv, the KMS the
# KMIP tests start on loopback with certificates they make with the openssl CLI.
# SQLAlchemy is held below 2 (PyKMIP's server uses the 1.x ORM API).
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=build/kmipvenv
want=("pykmip==0.10.0" "sqlalchemy<2")
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import kmip.services.server' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${want[@]}"
fi
