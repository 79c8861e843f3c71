#!/usr/bin/env bash
# Install everything retainzfs and its tests need on a fresh Debian machine (run as root):
# FUSE 3 (kernel side + libfuse3 headers for pyfuse3), the Python package with its Cython
# extensions, PyTorch (CPU) for the framework tests, QEMU + a Debian kernel for the ZNS guest,
# and the mount(8) helper.  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
PY=${PYTHON:-python3}
need_apt=()
for pkg in gcc fuse3 libfuse3-dev pkg-config attr util-linux fio btrfs-progs xfsprogs acl rsync stress-ng git; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# another apt/dpkg (unattended-upgrades on a fresh machine) may hold the lock: wait for it
APT=(apt-get -o DPkg::Lock::Timeout=900 -o Acquire::Retries=3)
# CPython's own test package (tests/test_suites.py runs its file tests on a mount): part of a
# python.org/pyenv build; Debian's python3 splits it into libpython3.X-testsuite
if ! $PY -c 'import test.support' >/dev/null 2>&1; then
    need_apt+=("libpython$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])')-testsuite")
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    "${APT[@]}" update -qq
    "${APT[@]}" install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
if [ -f scripts/install_qemu_deps.sh ] && [ "${RETAINZFS_NO_QEMU:-0}" != 1 ]; then
    bash scripts/install_qemu_deps.sh
fi
TORCH="torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check "$TORCH"
# The real framework packages of tests/test_frameworks_real.py and tests/test_two_node.py, pinned
# (also in setup.py's [test] extra).  None of them pins torch (torchtitan names no torch at all,
# megatron-core wants torch>=2.6, nvidia-resiliency-ext torch>=2.3), so they install beside the
# CPU torch; "$TORCH" on the same command line keeps pip from replacing it.
$PY -m pip install -q --disable-pip-version-check "$TORCH" \
    "torchtitan==0.3.0" "nvidia-resiliency-ext==0.4.1" "megatron-core==0.16.1"
$PY -m pip install -q --disable-pip-version-check "$TORCH" -e '.[test]'
got=$($PY -c 'import torch; print(torch.__version__.split("+")[0])')
[ "$got" = "${TORCH#torch==}" ] || { echo "setup: torch changed to $got (want ${TORCH#torch==})" >&2; exit 1; }
$PY -m retainzfs.cli.main install-helper >/dev/null
echo "setup: retainzfs $($PY -c 'import retainzfs; print(retainzfs.__version__)') ready"
