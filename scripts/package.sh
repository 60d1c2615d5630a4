#!/usr/bin/env bash
# Builds the memveil Debian package (build/memveil_VERSION_ARCH.deb) with
# dpkg-deb from this checkout's release build:
#   /usr/bin/memveil, /usr/bin/memveil-vault
#   /usr/lib/<multiarch>/memveil/libmemveil_shield_preload.so   (memveil run finds it there)
#   /usr/lib/<multiarch>/memveil/memveil-shield-loader          (memveil run's loader for static programs)
#   /usr/lib/<multiarch>/pkcs11/libmemveil_pkcs11.so            (the PKCS#11 module)
#   /usr/share/p11-kit/modules/memveil.module                   (p11-kit loads it: p11tool --list-tokens)
#   /lib/systemd/system/memveil-{vault,rng,exporter}.service, /usr/lib/systemd/user/memveil-agent.service
#   /usr/share/man/man1/memveil*.1.gz, bash/zsh/fish completions   (made by the binary itself)
# The units are installed, not enabled: systemctl enable --now memveil-vault.
#
#   scripts/package.sh              cargo build --release, then the package; prints its path
#   scripts/package.sh --no-build   package what target/release holds
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "package.sh: $*" >&2; exit 1; }

case "${1:-}" in
    --no-build) ;;
    "") cargo build --release --locked -p memveil -p memveil-vault -p memveil-shield-preload -p memveil-shield-loader -p memveil-pkcs11 >&2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
esac

rel=target/release
for f in memveil memveil-vault libmemveil_shield_preload.so memveil-shield-loader libmemveil_pkcs11.so; do
    [ -f "$rel/$f" ] || die "$rel/$f missing: build it (cargo build --release --workspace)"
done
command -v dpkg-deb >/dev/null || die "dpkg-deb not found (Debian's dpkg package)"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
[ -n "$version" ] || die "no version in Cargo.toml's [workspace.package]"

root=$(mktemp -d "${TMPDIR:-/tmp}/memveil-pkg.XXXXXX")
trap 'rm -rf "$root"' EXIT
chmod 0755 "$root"   # the package's "./": mktemp made it 0700
# Debug information stripped, as Debian ships binaries.
put() { install -D -m "$1" "$2" "$3" && strip --strip-debug "$3"; }
put 0755 "$rel/memveil" "$root/usr/bin/memveil"
put 0755 "$rel/memveil-vault" "$root/usr/bin/memveil-vault"
put 0644 "$rel/libmemveil_shield_preload.so" "$root/usr/lib/$multiarch/memveil/libmemveil_shield_preload.so"
put 0755 "$rel/memveil-shield-loader" "$root/usr/lib/$multiarch/memveil/memveil-shield-loader"
put 0644 "$rel/libmemveil_pkcs11.so" "$root/usr/lib/$multiarch/pkcs11/libmemveil_pkcs11.so"
sed "s|/usr/lib/x86_64-linux-gnu/|/usr/lib/$multiarch/|" contrib/debian/memveil.module \
    | install -D -m 0644 /dev/stdin "$root/usr/share/p11-kit/modules/memveil.module"
for u in vault rng exporter; do
    install -D -m 0644 "contrib/debian/memveil-$u.service" "$root/lib/systemd/system/memveil-$u.service"
done
install -D -m 0644 contrib/debian/memveil-agent.service "$root/usr/lib/systemd/user/memveil-agent.service"

gen="$root/gen"
"$rel/memveil" package-files "$gen" 2>/dev/null
mkdir -p "$root/usr/share/man/man1"
for m in "$gen"/man1/*.1; do
    gzip -9n < "$m" > "$root/usr/share/man/man1/$(basename "$m").gz"
done
install -D -m 0644 "$gen/completions/bash/memveil" "$root/usr/share/bash-completion/completions/memveil"
install -D -m 0644 "$gen/completions/zsh/_memveil" "$root/usr/share/zsh/vendor-completions/_memveil"
install -D -m 0644 "$gen/completions/fish/memveil.fish" "$root/usr/share/fish/vendor_completions.d/memveil.fish"
rm -rf "$gen"

doc="$root/usr/share/doc/memveil"
install -D -m 0644 README.md "$doc/README.md"
install -m 0644 SECURITY.md "$doc/SECURITY.md"
cp -r docs "$doc/docs" && rm -rf "$doc/docs/figures"
printf 'Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: memveil\n\nFiles: *\nLicense: Apache-2.0\n See /usr/share/common-licenses/Apache-2.0\n' > "$doc/copyright"
find "$doc" -type d -exec chmod 0755 {} + && find "$doc" -type f -exec chmod 0644 {} +

mkdir -p "$root/DEBIAN"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat > "$root/DEBIAN/control" <<CONTROL
Package: memveil
Version: $version
Architecture: $arch
Maintainer: memveil developers <memveil@localhost>
Installed-Size: $size
Depends: libc6 (>= 2.36), libssl3, libgcc-s1
Recommends: p11-kit, fuse3
Suggests: systemd
Section: admin
Priority: optional
Homepage: https://github.com/memveil/memveil
Description: protection of data in use on Linux hosts
 memveil keeps keys and secrets in memory the kernel cannot map (a key vault
 in memfd_secret memory, a PKCS#11 module and an SSH agent over it), keeps an
 unmodified program's heap as AES-XTS ciphertext (memveil run), serves
 entropy, and probes what memory protection the host offers.
CONTROL

mkdir -p build
out="build/memveil_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$out" >/dev/null
echo "$out"
