"""retainzfs end to end on a real Linux zoned block device (QEMU's emulated ZNS namespace).

In the boot the ``qemu`` tests share (tests/zns_guest.py), scripts/zns_guest_check.py runs
once per namespace: one-line errors (non-zoned, too few zones, in use), mkfs + mount with no
options, a latest-K checkpoint loop with rm, blkzone report vs retainzfs status (zones
reset), umount/remount with sha256 of every retained byte, kill -9 mid-write + remount +
fsck.  Two geometries: 4M zones (capacity = size) and 4M zones with 3M capacity.
Needs scripts/install_qemu_deps.sh; skipped when missing, except under CI=true.
"""

import json

import pytest
import zns_guest as Z

pytestmark = pytest.mark.qemu


@pytest.mark.parametrize("config", ["4M", "4M-cap3M"])
def test_retainzfs_on_zns(zns_guest, config, say):
    sec = zns_guest.section(f"retainzfs-{config}")
    lines = [ln for ln in sec.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result from the guest (rc {sec.rc})\n{sec.stdout[-6000:]}"
    res = json.loads(lines[-1].split(" ", 1)[1])
    say(f"\nQEMU ZNS {config}: loop {res.get('loop')}, resets {res.get('zone_resets')}, "
        f"blkzone {res.get('blkzone')}, guest {res.get('seconds')} s")
    assert sec.rc == 0 and not res["fails"], (
        f"guest checks failed: {res['fails']}\n{sec.stdout[-6000:]}")
    cap = 3 << 20 if "cap3M" in config else 4 << 20
    assert res["zone_size"] == 4 << 20 and res["zone_capacity"] == cap
    assert res["zone_resets"] > 0
    assert res["loop"]["gens"] == Z.GENS
