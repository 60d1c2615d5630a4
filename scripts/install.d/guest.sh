#!/usr/bin/env bash
# Builds the QEMU guest of the entropy-service test (issue 4) into build/guest/:
#   vmlinuz         a Debian 12 cloud kernel (linux-image-6.1.0-*-cloud-amd64)
#   initramfs.cpio.gz  busybox-static + the kernel's virtio modules + an init that
#                   reads N bytes from /dev/hwrng, prints them as hex between marker
#                   lines on the serial console, and powers off.
# Both come from Debian packages fetched with `apt-get download` and unpacked with
# `dpkg -x`; nothing is installed on the host. Idempotent: does nothing when the
# artefacts exist and match this script's recipe (build/guest/stamp).
set -euo pipefail
cd "$(dirname "$0")/../.."

out=build/guest
recipe_hash=$(sha256sum "$0" | cut -c1-16)
if [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$recipe_hash" ] \
    && [ -f "$out/vmlinuz" ] && [ -f "$out/initramfs.cpio.gz" ]; then
    exit 0
fi

for tool in apt-get apt-cache dpkg cpio gzip; do
    command -v "$tool" >/dev/null || { echo "guest.sh: $tool missing (Debian: apt-get install $tool)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"   # apt-get download drops root to _apt when it can write here

# The newest cloud kernel apt offers; fall back to older ones if a download fails.
mapfile -t kernels < <(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-cloud-amd64$' \
    | awk '{print $1}' | sort -rV)
if [ ${#kernels[@]} -eq 0 ]; then
    echo "guest.sh: apt offers no linux-image-6.1.0-*-cloud-amd64; run apt-get update (Debian 12 main)" >&2
    exit 1
fi
kpkg=""
for k in "${kernels[@]}"; do
    if (cd "$work" && apt-get download -q "$k" >/dev/null 2>&1); then kpkg=$k; break; fi
done
[ -n "$kpkg" ] || { echo "guest.sh: could not download any of ${kernels[*]}" >&2; exit 1; }
(cd "$work" && apt-get download -q busybox-static >/dev/null 2>&1) \
    || { echo "guest.sh: apt-get download busybox-static failed" >&2; exit 1; }

dpkg -x "$work"/linux-image-*.deb "$work/k"
dpkg -x "$work"/busybox-static_*.deb "$work/bb"
kver=$(ls "$work/k/lib/modules")
moddir="$work/k/lib/modules/$kver/kernel/drivers"

root="$work/root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,mod}
cp "$work/bb/bin/busybox" "$root/bin/busybox"
for a in sh mount insmod cat od sleep poweroff echo ls grep head; do
    ln -s busybox "$root/bin/$a"
done

# Load order: each module after the ones its `depends=` names (checked below,
# since the package ships no modules.dep).
order=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio-rng)
loaded=" "
for m in "${order[@]}"; do
    f=$(find "$moddir" -name "$m.ko" -o -name "$m.ko.xz" | head -n1)
    [ -n "$f" ] || { echo "guest.sh: $m.ko not in $kpkg" >&2; exit 1; }
    case "$f" in
        *.xz) xz -dc "$f" > "$root/mod/$m.ko" ;;
        *) cp "$f" "$root/mod/$m.ko" ;;
    esac
    deps=$(tr '\0' '\n' < "$root/mod/$m.ko" | sed -n 's/^depends=//p' | head -n1 | tr ',' ' ')
    for d in $deps; do
        d=${d//-/_}
        case "$loaded" in *" $d "*) ;; *)
            echo "guest.sh: $m depends on $d, which the load order does not put first" >&2; exit 1 ;;
        esac
    done
    loaded="$loaded${m//-/_} "
done

cat > "$root/init" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio-rng; do
    insmod /mod/$m.ko || echo "MEMVEIL-GUEST-ERROR insmod $m failed"
done
n=4096
for w in $(cat /proc/cmdline); do
    case "$w" in memveil.bytes=*) n=${w#memveil.bytes=} ;; esac
done
i=0
while [ ! -e /dev/hwrng ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
echo "MEMVEIL-HWRNG-CURRENT $(cat /sys/class/misc/hw_random/rng_current 2>/dev/null)"
echo "MEMVEIL-HWRNG-BEGIN $n"
head -c "$n" /dev/hwrng | od -An -v -tx1
echo "MEMVEIL-HWRNG-END"
poweroff -f
EOF
chmod 755 "$root/init"

mkdir -p "$out"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -9) > "$out/initramfs.cpio.gz.tmp"
cp "$work/k/boot/vmlinuz-$kver" "$out/vmlinuz.tmp"
mv "$out/initramfs.cpio.gz.tmp" "$out/initramfs.cpio.gz"
mv "$out/vmlinuz.tmp" "$out/vmlinuz"
echo "$kpkg" > "$out/kernel-package"
echo "$recipe_hash" > "$out/stamp"
echo "guest.sh: built $out/vmlinuz ($kpkg) and $out/initramfs.cpio.gz" >&2
