#!/bin/bash
# Install what scripts/qemu_zns.py needs to boot a TCG QEMU guest with an emulated
# ZNS NVMe namespace: QEMU, Debian's kernel (+ modules in /lib/modules), busybox
# (virtme-ng's initramfs), zoned/fs tools used inside the guest, and virtme-ng.
# Idempotent; safe on a fresh machine (run as root).
set -euo pipefail

APT_PKGS=(
    qemu-system-x86     # qemu-system-x86_64 (TCG; KVM is not usable here)
    linux-image-amd64   # /boot/vmlinuz-* and /lib/modules/<ver> for the guest
    busybox-static      # virtme-ng builds its initramfs with busybox
    kmod                # modprobe/depmod, used by virtme-ng and in the guest
    util-linux          # blkzone
    nvme-cli
    btrfs-progs         # mkfs.btrfs -O zoned
    f2fs-tools          # mkfs.f2fs -m (needs an extra conventional device)
    fuse3               # /dev/fuse tooling, libfuse3 for pyfuse3
)

missing=()
for p in "${APT_PKGS[@]%% *}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$p")
done
if ! compgen -G "/boot/vmlinuz-*" >/dev/null; then
    missing+=(linux-image-amd64)
fi
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=900 update -q
    apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends "${missing[@]}"
else
    echo "install_qemu_deps: apt packages already installed"
fi

PY=${PYTHON:-python3}
if ! "$PY" -c "import virtme_ng" 2>/dev/null; then
    "$PY" -m pip install -q virtme-ng
else
    echo "install_qemu_deps: virtme-ng already installed"
fi

kernel=$(ls /boot/vmlinuz-* | sort -V | tail -1)
ver=${kernel#/boot/vmlinuz-}
[ -d "/lib/modules/$ver" ] || { echo "install_qemu_deps: /lib/modules/$ver missing" >&2; exit 1; }
echo "install_qemu_deps: ok ($(qemu-system-x86_64 --version | head -1); kernel $ver; $("$PY" -m pip show virtme-ng 2>/dev/null | grep -i '^version' ))"
