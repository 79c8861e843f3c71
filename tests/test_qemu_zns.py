"""A real Linux zoned block device: QEMU's emulated ZNS NVMe namespace in a TCG guest.

Debian's kernel booted by scripts/qemu_zns.py (virtme-ng, host userspace over 9p), in the
boot the ``qemu`` tests share (tests/zns_guest.py): scripts/zns_guest_basics.py checks,
inside the guest, the zoned sysfs attributes, the zone report, that a direct write
advances the write pointer, that a write off the wp fails, that a reset rewinds it, and
that /dev/fuse plus pyfuse3 can mount a FUSE filesystem.  Needs
scripts/install_qemu_deps.sh; skipped when that is missing, except under CI=true where it
fails instead.
"""

import json

import pytest

pytestmark = pytest.mark.qemu


@pytest.fixture(scope="module")
def guest_result(zns_guest):
    sec = zns_guest.section("basics")
    lines = [ln for ln in sec.stdout.splitlines() if ln.startswith("QEMU_ZNS_RESULT ")]
    assert sec.rc == 0 and lines, (
        f"scripts/zns_guest_basics.py failed in the guest (rc {sec.rc})\n{sec.stdout[-4000:]}\n"
        f"runner stderr:\n{zns_guest.stderr[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def test_zoned_sysfs(guest_result):
    s = guest_result["sysfs"]
    assert guest_result["dev"].startswith("/dev/nvme")
    assert s["zoned"] == "host-managed"
    assert int(s["chunk_sectors"]) == 4 * 1024 * 1024 // 512
    assert int(s["nr_zones"]) == 64
    assert int(s["max_open_zones"]) == 8
    assert int(s["max_active_zones"]) == 8
    assert int(s["logical_block_size"]) == 4096
    assert int(s["physical_block_size"]) == 4096
    # the runner selects mq-deadline (needed for zoned writes before Linux 6.10)
    assert "[mq-deadline]" in s["scheduler"]


def test_zone_report_write_reset(guest_result):
    r = guest_result
    assert r["nzones"] == 64
    z = r["zone1_before"]
    assert (z["start"], z["len"], z["cap"]) == (8192, 8192, 8192)
    assert r["write_rc"] == 0, r["write_err"]
    w = r["zone1_written"]
    assert w["start"] == 8192 and w["wp_rel"] == 16 * 8  # 16 x 4 KiB written
    assert w["cond"] == 2                          # implicitly open
    assert r["bad_write_rc"] != 0                  # write off the wp is refused
    assert r["zone1_after_bad"]["wp_rel"] == w["wp_rel"]
    z = r["zone1_reset"]
    assert z["wp_rel"] == 0 and z["cond"] == 1   # empty


def test_fuse_in_guest(guest_result):
    r = guest_result
    assert r["dev_fuse"]
    assert r.get("fuse_mounted"), r.get("fuse_error")
    assert r["fuse_ls"] == ["hello"]
    assert r["fuse_read"] == "hello from fuse\n"
    assert "fuse_error" not in r, r["fuse_error"]
