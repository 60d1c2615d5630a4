#!/usr/bin/env bash
# The Debian package (issue 35): scripts/package.sh builds it from target/release;
# systemd-analyze verify checks its units; dpkg installs it into a fresh root
# directory (the machine's own installation is left alone) and the smoke path
# runs from the installed paths only: memveil --version, probe, the man pages,
# a vault (serve, create, encrypt/decrypt), memveil run -- /bin/true with the
# installed preload library, and p11tool --list-tokens finding the token through
# the installed memveil.module (as a user-level p11-kit registration in a
# scratch HOME, p11tool run as nobody: the machine's own registration is not
# ours to change).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "test-package.sh: FAIL: $*" >&2; exit 1; }
skip() { echo "SKIP scripts/test-package.sh: $1: $2" | tee -a "${MEMVEIL_SKIP_LOG:-/dev/null}" >&2; }

deb=$(scripts/package.sh --no-build)
[ -f "$deb" ] || fail "scripts/package.sh made no package"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/memveil-pkgtest.XXXXXX")
vault_pid=
cleanup() {
    if [ -n "$vault_pid" ]; then
        kill "$vault_pid" 2>/dev/null || true
        wait "$vault_pid" 2>/dev/null || true
    fi
    rm -rf "$scratch"
}
trap cleanup EXIT

# A fresh root: an empty dpkg database, nothing else.
root="$scratch/root"
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates"
: > "$root/var/lib/dpkg/status"
dpkg --root="$root" --force-depends --force-script-chrootless -i "$deb" >/dev/null \
    || fail "dpkg --root could not install $deb"
dpkg --root="$root" -s memveil | grep -q "^Status: install ok installed" || fail "not installed"

for f in usr/bin/memveil usr/bin/memveil-vault \
         usr/lib/x86_64-linux-gnu/memveil/libmemveil_shield_preload.so \
         usr/lib/x86_64-linux-gnu/memveil/memveil-shield-loader \
         usr/lib/x86_64-linux-gnu/pkcs11/libmemveil_pkcs11.so \
         usr/share/p11-kit/modules/memveil.module \
         lib/systemd/system/memveil-vault.service lib/systemd/system/memveil-rng.service \
         lib/systemd/system/memveil-exporter.service usr/lib/systemd/user/memveil-agent.service \
         usr/share/man/man1/memveil.1.gz usr/share/man/man1/memveil-vault-serve.1.gz \
         usr/share/bash-completion/completions/memveil usr/share/zsh/vendor-completions/_memveil \
         usr/share/fish/vendor_completions.d/memveil.fish; do
    [ -e "$root/$f" ] || fail "the package lacks /$f"
done
module=$(sed -n 's/^module: //p' "$root/usr/share/p11-kit/modules/memveil.module")
[ -f "$root$module" ] || fail "memveil.module names $module, which the package does not hold"
grep -q "RuntimeDirectory=memveil" "$root/lib/systemd/system/memveil-vault.service" \
    || fail "the vault's unit lacks RuntimeDirectory=memveil"

# The units, as systemd reads them (the binaries they name are the package's).
if command -v systemd-analyze >/dev/null; then
    # The root holds only the package: systemd's own units (sysinit.target,
    # default.target, ...) are copied in from this machine, as on an installed host.
    for d in lib/systemd/system usr/lib/systemd/user; do
        cp -rL --no-clobber /"$d"/. "$root/$d/" 2>/dev/null || true
    done
    # --man=no: the man pages are checked below, from the package's files.
    out=$(systemd-analyze verify --man=no --root="$root" \
        /lib/systemd/system/memveil-vault.service /lib/systemd/system/memveil-rng.service \
        /lib/systemd/system/memveil-exporter.service 2>&1) || fail "systemd-analyze verify: $out"
    echo "$out" | grep -E "(^|/)memveil-[a-z]+\.service:" && fail "systemd-analyze verify complains: $out"
    # --user takes no --root: the user unit, its binary path moved into the root.
    mkdir -p "$scratch/xdg" "$scratch/user" && chmod 0700 "$scratch/xdg"
    sed "s|/usr/bin/memveil|$root/usr/bin/memveil|" "$root/usr/lib/systemd/user/memveil-agent.service" \
        > "$scratch/user/memveil-agent.service"
    out=$(XDG_RUNTIME_DIR="$scratch/xdg" systemd-analyze verify --man=no --user \
        "$scratch/user/memveil-agent.service" 2>&1) || fail "systemd-analyze verify --user: $out"
    echo "$out" | grep -E "(^|/)memveil-[a-z]+\.service:" && fail "systemd-analyze verify --user complains: $out"
    echo "test-package.sh: systemd-analyze verify: 4 units clean"
else
    skip "systemd not installed" "systemd-analyze not on PATH (scripts/packages.txt: systemd)"
    [ "${CI:-}" = true ] && fail "CI=true: systemd-analyze is missing"
fi

# The smoke path, from the installed paths only.
bin="$root/usr/bin/memveil"
export PATH="$root/usr/bin:/usr/bin:/bin"
unset MEMVEIL_VAULT_SOCKET
"$bin" --version | grep -q "^memveil " || fail "memveil --version"
rc=0; "$bin" probe > "$scratch/probe.txt" || rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || fail "memveil probe exited $rc"
grep -q . "$scratch/probe.txt" || fail "memveil probe printed nothing"
wide=$(LC_ALL=C.UTF-8; while IFS= read -r l; do [ ${#l} -le 100 ] || echo "$l"; done < "$scratch/probe.txt")
[ -z "$wide" ] || fail "memveil probe's report has lines over 100 columns: $wide"
zcat "$root/usr/share/man/man1/memveil-vault-serve.1.gz" | grep -qF -- '\fB\-\-vault\fR' \
    || fail "memveil-vault-serve(1) does not name --vault"

sock="$scratch/vault.sock"
start_vault() {
    "$bin" vault serve --vault "$sock" "$@" > "$scratch/vault.out" 2> "$scratch/vault.err" &
    vault_pid=$!
    for _ in $(seq 100); do
        grep -q "ready" "$scratch/vault.out" 2>/dev/null && return 0
        kill -0 "$vault_pid" 2>/dev/null || { wait "$vault_pid" || true; vault_pid=; return 1; }
        sleep 0.1
    done
    return 1
}
if ! start_vault; then
    # No memfd_secret on this kernel: the documented fallback.
    grep -q "memfd_secret" "$scratch/vault.err" || fail "the installed vault did not start: $(cat "$scratch/vault.err")"
    skip "no memfd_secret" "the packaged vault runs with --allow-level=locked here"
    start_vault --allow-level=locked || fail "the installed vault did not start: $(cat "$scratch/vault.err")"
fi
"$bin" vault create smoke --vault "$sock" > /dev/null || fail "vault create"
echo "a secret" | "$bin" vault encrypt --key smoke --vault "$sock" > "$scratch/c" || fail "vault encrypt"
[ "$("$bin" vault decrypt --key smoke --vault "$sock" -i "$scratch/c")" = "a secret" ] || fail "vault decrypt"

# memveil run finds the preload library where the package put it.
out=$("$bin" run -- /bin/true 2>&1) || {
    if echo "$out" | grep -q "userfaultfd"; then
        skip "no userfaultfd" "$out"
    else
        fail "memveil run -- /bin/true: $out"
    fi
}
echo "$out" | grep -q "not found" && fail "memveil run: $out"

# p11tool --list-tokens with no flags, through memveil.module.
if command -v p11tool >/dev/null; then
    home="$scratch/home"
    mkdir -p "$home/.config/pkcs11/modules"
    # The package's memveil.module, its path moved into the root (a user's
    # module file overrides the machine's of the same name).
    sed "s|^module: |module: $root|" "$root/usr/share/p11-kit/modules/memveil.module" \
        > "$home/.config/pkcs11/modules/memveil.module"
    # p11-kit reads no user configuration for root: p11tool runs as nobody.
    chmod 0755 "$scratch"
    out=$(setpriv --reuid=65534 --regid=65534 --clear-groups \
        env HOME="$home" MEMVEIL_VAULT_SOCKET="$sock" p11tool --list-tokens 2>&1) || true
    echo "$out" | grep -B6 "Module: $root$module" | grep -q "Label: memveil vault" \
        || fail "p11tool --list-tokens does not list the package module's memveil token: $out"
else
    skip "gnutls-bin not installed" "p11tool not on PATH"
fi
echo "test-package.sh: $deb installs into a fresh root and its smoke path passes"
