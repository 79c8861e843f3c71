"""retainzfs end to end on a real Linux zoned block device (QEMU's emulated ZNS namespace).

Each case boots one TCG guest with scripts/qemu_zns.py and runs scripts/zns_guest_check.py
inside it: one-line errors (non-zoned, too few zones, in use), mkfs + mount with no options,
a latest-K checkpoint loop with rm, blkzone report vs retainzfs status (zones reset),
umount/remount with sha256 of every retained byte, kill -9 mid-write + remount + fsck.
Two geometries: 4M zones (capacity = size) and 4M zones with 3M capacity.
Needs scripts/install_qemu_deps.sh; skipped when missing, except under CI=true.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "scripts" / "qemu_zns.py"
GUEST = "scripts/zns_guest_check.py"

pytestmark = pytest.mark.qemu

CONFIGS = {
    "4M": ["--zone-size", "4M"],
    "4M-cap3M": ["--zone-size", "4M", "--zone-capacity", "3M"],
}
# Guest work per boot; the loop writes GENS x GEN_MIB through FUSE (several x the device).
GENS = int(os.environ.get("RETAINZ_QEMU_GENS", "30"))
GEN_MIB = os.environ.get("RETAINZ_QEMU_GEN_MIB", "6")


def _missing_prereqs():
    proc = subprocess.run([sys.executable, str(RUNNER), "--dry-run", "--", "true"],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or proc.stdout.strip())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_retainzfs_on_zns(config):
    missing = _missing_prereqs()
    if missing:
        if os.environ.get("CI"):
            pytest.fail("QEMU ZNS prerequisites missing in CI: " + missing)
        pytest.skip("QEMU ZNS prerequisites missing: " + missing)
    cmd = [sys.executable, str(RUNNER), "--timeout", "900", "--size", "256M",
           "--max-open", "8", "--max-active", "8", *CONFIGS[config], "--",
           f"python3 {GUEST} --gens {GENS} --gen-mib {GEN_MIB}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=960)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (f"no result from the guest (rc {proc.returncode})\nstdout:\n"
                   f"{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1].split(" ", 1)[1])
    print(f"{config}: loop {res.get('loop')}, resets {res.get('zone_resets')}, "
          f"blkzone {res.get('blkzone')}, guest {res.get('seconds')} s")
    assert proc.returncode == 0 and not res["fails"], (
        f"guest checks failed: {res['fails']}\n{proc.stdout[-6000:]}")
    cap = 3 << 20 if "cap3M" in config else 4 << 20
    assert res["zone_size"] == 4 << 20 and res["zone_capacity"] == cap
    assert res["zone_resets"] > 0
    assert res["loop"]["gens"] == GENS
