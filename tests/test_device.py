"""Tests for retainzfs.device: the zone state machine, image format, locking, persistence.

BlockZonedDevice needs a real zoned device for end-to-end runs (a QEMU guest); here it is
covered by struct packing/parsing, the sysfs checks on a fake sysfs tree, and its O_DIRECT
I/O path against a regular file with the ioctls emulated.
"""
from __future__ import annotations

import array
import errno
import os
import random
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from retainzfs import device as D
from retainzfs.device import (BlockZonedDevice, DeviceError, ImageZonedDevice, Zone,
                              ZoneCond, ZonedDevice, create_image, open_device)

REPO = str(Path(__file__).resolve().parents[1])
BS = 4096
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def blk(n: int, fill: int = 0xAB) -> bytes:
    return bytes([fill]) * (n * BS)


@pytest.fixture
def img(tmp_path):
    """8 zones of 64 KiB, capacity 48 KiB, max_open 2, max_active 3."""
    dev = create_image(tmp_path / "z.img", 8 * 64 * KiB, 64 * KiB, zone_capacity=48 * KiB,
                       max_open=2, max_active=3)
    yield dev
    dev.close()


def errno_of(excinfo) -> int:
    return excinfo.value.errno


# --------------------------------------------------------------------------------------
# create_image / geometry / format
# --------------------------------------------------------------------------------------

def test_create_geometry_and_api(tmp_path):
    p = tmp_path / "a.img"
    dev = create_image(p, 10 * MiB + 123, 1 * MiB, zone_capacity=768 * KiB, max_open=3,
                       max_active=5)
    assert isinstance(dev, ZonedDevice) and isinstance(dev, ImageZonedDevice)
    assert (dev.path, dev.block_size, dev.zone_size, dev.zone_capacity) == \
        (str(p), 4096, MiB, 768 * KiB)
    assert (dev.nr_zones, dev.max_open, dev.max_active) == (10, 3, 5)   # rounded down
    assert (dev.bytes_written, dev.resets, dev.open_count(), dev.active_count()) == (0, 0, 0, 0)
    zs = dev.zones()
    assert len(zs) == 10
    z = zs[7]
    assert z == Zone(7, 7 * MiB, MiB, 768 * KiB, 0, ZoneCond.EMPTY)
    assert z.free == 768 * KiB and not z.is_open and not z.is_active
    # zone() returns a copy, not the cache
    z.wp = 999
    assert dev.zone(7).wp == 0
    with pytest.raises(IndexError):
        dev.zone(10)
    # data area aligned to max(zone_size, 1 MiB)
    assert dev._data_off % MiB == 0 and dev._data_off >= 4096
    assert os.path.getsize(p) == dev._data_off + 10 * MiB
    dev.close()
    dev.close()                                  # idempotent


def test_zone_properties():
    z = Zone(0, 0, 100, 80, 30, ZoneCond.IMP_OPEN)
    assert z.is_open and z.is_active and z.free == 50
    z.cond = ZoneCond.EXP_OPEN
    assert z.is_open and z.is_active
    z.cond = ZoneCond.CLOSED
    assert not z.is_open and z.is_active
    for c in (ZoneCond.EMPTY, ZoneCond.FULL, ZoneCond.READONLY, ZoneCond.OFFLINE,
              ZoneCond.NOT_WP):
        z.cond = c
        assert not z.is_open and not z.is_active


def test_zonecond_values():
    assert [int(c) for c in ZoneCond] == [0x0, 0x1, 0x2, 0x3, 0x4, 0xD, 0xE, 0xF]


def test_create_refuses_existing_without_force(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 4 * MiB, MiB).close()
    with pytest.raises(DeviceError, match="already exists"):
        create_image(p, 4 * MiB, MiB)
    other = tmp_path / "notes.txt"
    other.write_text("precious")
    with pytest.raises(DeviceError, match="already exists"):
        create_image(other, 4 * MiB, MiB)
    assert other.read_text() == "precious"
    # force replaces (new geometry, fresh zones)
    dev = ImageZonedDevice(p)
    dev.write(0, 0, blk(1))
    dev.close()
    dev = create_image(p, 8 * MiB, MiB, force=True)
    assert dev.nr_zones == 8 and dev.zone(0).wp == 0
    assert dev.read(0, 0, BS) == bytes(BS)
    dev.close()


def test_create_force_refuses_image_in_use(tmp_path):
    p = tmp_path / "a.img"
    dev = create_image(p, 4 * MiB, MiB)
    dev.write(0, 0, blk(1))
    with pytest.raises(DeviceError, match="in use by another process"):
        create_image(p, 4 * MiB, MiB, force=True)
    assert dev.read(0, 0, BS) == blk(1)          # untouched
    dev.close()


def test_create_force_refuses_non_regular(tmp_path):
    with pytest.raises(DeviceError):
        create_image(tmp_path, 4 * MiB, MiB, force=True)


@pytest.mark.parametrize("kw, msg", [
    (dict(size=3 * MiB, zone_size=MiB), "at least 4"),
    (dict(size=4 * MiB - 1, zone_size=MiB), "at least 4"),
    (dict(size=64 * MiB, zone_size=3 * MiB), "power of two"),
    (dict(size=64 * MiB, zone_size=2048), "power of two"),           # < block size
    (dict(size=64 * MiB, zone_size=MiB, zone_capacity=2 * MiB), "capacity"),
    (dict(size=64 * MiB, zone_size=MiB, zone_capacity=1000), "capacity"),
    (dict(size=64 * MiB, zone_size=MiB, zone_capacity=0), "capacity"),
    (dict(size=64 * MiB, zone_size=MiB, block_size=1000), "block size"),
    (dict(size=64 * MiB, zone_size=MiB, max_open=-1), ">= 0"),
    (dict(size=64 * MiB, zone_size=MiB, max_open=4, max_active=2), "cannot exceed"),
])
def test_create_rejects_bad_geometry(tmp_path, kw, msg):
    p = tmp_path / "bad.img"
    with pytest.raises(DeviceError, match=msg):
        create_image(p, **kw)
    assert not p.exists()                        # nothing left behind


def test_create_512_byte_blocks(tmp_path):
    dev = create_image(tmp_path / "a.img", 4 * 64 * KiB, 64 * KiB, block_size=512)
    dev.write(0, 0, bytes(512))
    assert dev.zone(0).wp == 512
    with pytest.raises(OSError) as e:
        dev.write(0, 512, bytes(256))
    assert errno_of(e) == errno.EINVAL
    dev.close()


def test_header_is_crc_protected(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 4 * MiB, MiB).close()
    raw = bytearray(p.read_bytes()[:64])
    assert raw[:8] == b"RZIMG001"
    raw[20] ^= 0xFF                              # flip a geometry byte
    with open(p, "r+b") as f:
        f.write(raw)
    with pytest.raises(DeviceError, match="corrupt"):
        ImageZonedDevice(p)


def test_corrupt_zone_table_entry(tmp_path):
    p = tmp_path / "a.img"
    dev = create_image(p, 4 * MiB, MiB)
    off = dev._table_off + 2 * 16
    dev.close()
    with open(p, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<QB", 2 * MiB, 0x2))   # wp past capacity
    # An invalid entry reads as FULL (readable, never written into) and is reported; a reset
    # rewrites it (the store's recovery decides, tests/test_integrity.py's zone_table cases).
    dev = ImageZonedDevice(p)
    assert "zone table entry 2" in dev.damaged[2]
    z = dev.zone(2)
    assert z.cond == ZoneCond.FULL and z.wp == z.capacity
    assert dev.read(2, 0, 4096) == bytes(4096)
    with pytest.raises(OSError):
        dev.write(2, z.wp, bytes(4096))
    dev.reset(2)
    assert not dev.damaged and dev.zone(2).cond == ZoneCond.EMPTY
    dev.close()
    dev = ImageZonedDevice(p)
    assert not dev.damaged and dev.zone(2).wp == 0
    dev.write(2, 0, b"x" * 4096)
    dev.close()
    with open(p, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<QB", 4096, 0xE))      # FULL with wp != capacity
    dev = ImageZonedDevice(p)
    assert 2 in dev.damaged
    dev.repair_entry(2)
    dev.close()
    dev = ImageZonedDevice(p)
    assert not dev.damaged and dev.zone(2).cond == ZoneCond.FULL
    assert dev.read(2, 0, 4096) == b"x" * 4096
    dev.close()


def test_truncated_image(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 4 * MiB, MiB).close()
    os.truncate(p, os.path.getsize(p) - MiB)
    with pytest.raises(DeviceError, match="truncated"):
        ImageZonedDevice(p)


# --------------------------------------------------------------------------------------
# foreign / missing targets, open_device dispatch
# --------------------------------------------------------------------------------------

def test_foreign_file_rejected(tmp_path):
    p = tmp_path / "random.bin"
    p.write_bytes(os.urandom(3 * MiB))
    for opener in (ImageZonedDevice, open_device):
        with pytest.raises(DeviceError) as e:
            opener(p)
        msg = str(e.value)
        assert "not a retainzfs zoned image" in msg and "\n" not in msg
    empty = tmp_path / "empty"
    empty.touch()
    with pytest.raises(DeviceError, match="not a retainzfs zoned image"):
        open_device(empty)


def test_missing_path(tmp_path):
    for opener in (ImageZonedDevice, open_device, BlockZonedDevice):
        with pytest.raises(DeviceError, match="no such file"):
            opener(tmp_path / "nope.img")


def test_open_device_dispatch(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 4 * MiB, MiB).close()
    dev = open_device(p)
    assert type(dev) is ImageZonedDevice
    dev.close()
    with pytest.raises(DeviceError, match="directory"):
        open_device(tmp_path)
    with pytest.raises(DeviceError, match="neither a block device nor"):
        open_device("/dev/null")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DeviceError):
        open_device(fifo)
    with pytest.raises(DeviceError, match="not a block device"):
        BlockZonedDevice(p)


# --------------------------------------------------------------------------------------
# write rules
# --------------------------------------------------------------------------------------

def test_sequential_write_and_read(img):
    assert img.write(0, 0, blk(2, 1)) == 2 * BS
    assert img.write(0, 2 * BS, bytearray(blk(1, 2))) == BS
    big = bytearray(blk(3, 3))
    assert img.write(0, 3 * BS, memoryview(big)[BS:]) == 2 * BS      # slice, no copy
    arr = array.array("Q", [7] * (BS // 8))                            # non-byte format
    assert img.write(0, 5 * BS, memoryview(arr)) == BS
    assert img.write(0, 6 * BS, arr) == BS                              # any buffer
    z = img.zone(0)
    assert (z.wp, z.cond) == (7 * BS, ZoneCond.IMP_OPEN)
    assert img.bytes_written == 7 * BS
    assert img.read(0, 0, 7 * BS) == blk(2, 1) + blk(1, 2) + blk(2, 3) + arr.tobytes() * 2
    assert img.read(0, 100, 10) == blk(1, 1)[:10]                       # unaligned read
    assert img.read(0, 7 * BS, BS) == bytes(BS)                         # past wp: zeros
    assert img.read(0, 0, 0) == b""


def test_write_not_at_wp_einval(img):
    img.write(1, 0, blk(1))
    for off in (0, 2 * BS, BS + 512, -BS):
        with pytest.raises(OSError) as e:
            img.write(1, off, blk(1))
        assert errno_of(e) == errno.EINVAL
    assert img.zone(1).wp == BS


def test_write_misaligned_length_einval(img):
    for n in (1, 512, BS + 1, BS - 1):
        with pytest.raises(OSError) as e:
            img.write(0, 0, bytes(n))
        assert errno_of(e) == errno.EINVAL
    assert img.zone(0).cond == ZoneCond.EMPTY and img.open_count() == 0


def test_zero_length_write_is_noop(img):
    assert img.write(0, 0, b"") == 0
    assert img.zone(0).cond == ZoneCond.EMPTY and img.open_count() == 0


def test_write_bad_zone_einval(img):
    for z in (-1, 8, 100):
        with pytest.raises(OSError) as e:
            img.write(z, 0, blk(1))
        assert errno_of(e) == errno.EINVAL
        with pytest.raises(OSError):
            img.read(z, 0, BS)


def test_capacity_smaller_than_size(img):
    cap = img.zone_capacity
    assert cap == 48 * KiB < img.zone_size == 64 * KiB
    img.write(0, 0, blk(cap // BS - 1))
    with pytest.raises(OSError) as e:
        img.write(0, cap - BS, blk(2))           # would pass capacity
    assert errno_of(e) == errno.EINVAL
    assert img.zone(0).wp == cap - BS
    img.write(0, cap - BS, blk(1))
    z = img.zone(0)
    assert (z.wp, z.cond, z.free) == (cap, ZoneCond.FULL, 0)
    assert img.open_count() == 0 and img.active_count() == 0      # FULL leaves the sets
    with pytest.raises(OSError) as e:
        img.write(0, cap, blk(1))                # write to FULL
    assert errno_of(e) == errno.EINVAL
    with pytest.raises(OSError) as e:
        img.read(0, cap - BS, 2 * BS)            # read past capacity
    assert errno_of(e) == errno.EINVAL
    with pytest.raises(OSError) as e:
        img.read(0, -1, 10)
    assert errno_of(e) == errno.EINVAL
    assert img.read(0, cap - BS, BS) == blk(1)


def test_single_write_fills_zone(img):
    img.write(3, 0, blk(12))
    assert img.zone(3).cond == ZoneCond.FULL and img.open_count() == 0


def test_write_to_full_zone_after_finish(img):
    img.finish(0)
    with pytest.raises(OSError) as e:
        img.write(0, img.zone_capacity, blk(1))
    assert errno_of(e) == errno.EINVAL
    with pytest.raises(OSError) as e:
        img.write(0, 0, blk(1))
    assert errno_of(e) == errno.EINVAL


# --------------------------------------------------------------------------------------
# limits
# --------------------------------------------------------------------------------------

def test_implicit_open_limit_etoomanyrefs(img):
    img.write(0, 0, blk(1))
    img.write(1, 0, blk(1))
    assert img.open_count() == 2 and img.active_count() == 2
    with pytest.raises(OSError) as e:
        img.write(2, 0, blk(1))
    # EMPTY zone: active slot free (3), open slots exhausted (2) -> ETOOMANYREFS
    assert errno_of(e) == errno.ETOOMANYREFS
    assert img.zone(2).cond == ZoneCond.EMPTY and img.zone(2).wp == 0
    assert img.read(2, 0, BS) == bytes(BS)       # nothing written
    img.write(0, BS, blk(1))                      # already-open zones keep working
    img.close(0)
    assert img.zone(0).cond == ZoneCond.CLOSED
    img.write(2, 0, blk(1))                       # slot freed by close
    assert img.open_count() == 2 and img.active_count() == 3
    # CLOSED zone re-open needs an open slot too
    with pytest.raises(OSError) as e:
        img.write(0, 2 * BS, blk(1))
    assert errno_of(e) == errno.ETOOMANYREFS
    assert img.zone(0).cond == ZoneCond.CLOSED


def test_active_limit_eoverflow(img):
    img.write(0, 0, blk(1))
    img.write(1, 0, blk(1))
    img.close(0)
    img.close(1)
    img.write(2, 0, blk(1))
    assert img.open_count() == 1 and img.active_count() == 3
    with pytest.raises(OSError) as e:
        img.write(3, 0, blk(1))                   # EMPTY -> active: over max_active
    assert errno_of(e) == errno.EOVERFLOW
    with pytest.raises(OSError) as e:
        img.open(3)
    assert errno_of(e) == errno.EOVERFLOW
    img.write(0, BS, blk(1))                      # CLOSED -> open does not need an active slot
    assert img.open_count() == 2 and img.active_count() == 3
    img.finish(1)                                 # frees an active slot
    assert img.active_count() == 2
    img.close(0)
    img.write(3, 0, blk(1))
    assert img.active_count() == 3


def test_active_checked_before_open(tmp_path):
    # Both limits hit: EOVERFLOW wins (QEMU order).
    dev = create_image(tmp_path / "a.img", 8 * MiB, MiB, max_open=2, max_active=2)
    dev.write(0, 0, blk(1))
    dev.write(1, 0, blk(1))
    with pytest.raises(OSError) as e:
        dev.write(2, 0, blk(1))
    assert errno_of(e) == errno.EOVERFLOW
    dev.close()


def test_unlimited(tmp_path):
    dev = create_image(tmp_path / "a.img", 16 * MiB, MiB)
    for z in range(16):
        dev.write(z, 0, blk(1))
    assert dev.open_count() == 16 and dev.active_count() == 16
    dev.close()


def test_explicit_open(img):
    img.open(0)
    z = img.zone(0)
    assert (z.cond, z.wp) == (ZoneCond.EXP_OPEN, 0) and z.is_open and z.is_active
    img.open(0)                                   # idempotent
    assert img.open_count() == 1
    img.write(0, 0, blk(1))
    assert img.zone(0).cond == ZoneCond.EXP_OPEN  # writes keep it explicit
    img.write(1, 0, blk(1))
    img.open(1)                                   # IMP -> EXP uses no new slot
    assert img.zone(1).cond == ZoneCond.EXP_OPEN and img.open_count() == 2
    with pytest.raises(OSError) as e:
        img.open(2)
    assert errno_of(e) == errno.ETOOMANYREFS
    img.finish(3)
    with pytest.raises(OSError) as e:
        img.open(3)                               # FULL
    assert errno_of(e) == errno.EINVAL
    with pytest.raises(OSError) as e:
        img.open(99)
    assert errno_of(e) == errno.EINVAL


def test_close_transitions(img):
    img.open(0)
    img.close(0)                                  # explicit open, nothing written -> EMPTY
    assert img.zone(0).cond == ZoneCond.EMPTY and img.active_count() == 0
    img.write(1, 0, blk(1))
    img.close(1)
    assert img.zone(1).cond == ZoneCond.CLOSED and img.zone(1).wp == BS
    assert img.open_count() == 0 and img.active_count() == 1
    img.close(1)                                  # already closed: no-op
    img.close(2)                                  # EMPTY: no-op
    img.finish(3)
    img.close(3)                                  # FULL: no-op
    assert img.zone(3).cond == ZoneCond.FULL
    img.write(1, BS, blk(1))                      # CLOSED -> IMP_OPEN
    assert img.zone(1).cond == ZoneCond.IMP_OPEN


def test_finish(img):
    img.write(0, 0, blk(1))
    img.finish(0)
    z = img.zone(0)
    assert (z.cond, z.wp, z.free) == (ZoneCond.FULL, img.zone_capacity, 0)
    assert img.open_count() == 0 and img.active_count() == 0
    assert img.bytes_written == BS                # finish writes no data
    img.finish(0)                                 # FULL: no-op
    img.write(1, 0, blk(1))
    img.close(1)
    img.finish(1)                                 # CLOSED -> FULL
    assert img.active_count() == 0
    # EMPTY -> FULL needs no resource, even with all slots taken
    img.write(2, 0, blk(1))
    img.close(2)
    img.write(3, 0, blk(1))
    img.write(4, 0, blk(1))
    assert img.open_count() == 2 and img.active_count() == 3
    img.finish(5)
    assert img.zone(5).cond == ZoneCond.FULL and img.active_count() == 3


def test_reset(img):
    img.write(0, 0, blk(3, 9))
    img.reset(0)
    z = img.zone(0)
    assert (z.cond, z.wp) == (ZoneCond.EMPTY, 0)
    assert img.open_count() == 0 and img.active_count() == 0 and img.resets == 1
    assert img.read(0, 0, 3 * BS) == bytes(3 * BS)   # reset data reads back as zeros
    img.reset(0)                                  # EMPTY: no-op, not counted
    assert img.resets == 1
    img.finish(1)
    img.reset(1)
    assert img.zone(1).cond == ZoneCond.EMPTY and img.resets == 2
    img.write(1, 0, blk(1))
    img.close(1)
    img.reset(1)
    assert img.active_count() == 0 and img.resets == 3
    img.write(0, 0, blk(1, 5))                    # reusable
    assert img.read(0, 0, BS) == blk(1, 5)


def test_a_reset_on_a_host_that_punches_no_holes(tmp_path, monkeypatch):
    """Found by the torn-write campaign (LazyFS, a FUSE host with no fallocate): the reset of a
    zone opened but never written (a power cut kept its open, not a write) failed the mount
    with "range() arg 3 must not be zero" where the reset writes zeros instead of a hole.
    Now it writes nothing there, and zeros over what a written zone held."""
    monkeypatch.setattr(D, "_fallocate", lambda *a: errno.EOPNOTSUPP)
    dev = create_image(tmp_path / "a.img", 8 * MiB, 2 * MiB)
    dev.open(0)
    assert (dev.zone(0).cond, dev.zone(0).wp) == (ZoneCond.EXP_OPEN, 0)
    dev.reset(0)
    assert (dev.zone(0).cond, dev.zone(0).wp) == (ZoneCond.EMPTY, 0)
    dev.write(1, 0, os.urandom(BS))
    dev.reset(1)
    assert dev.read(1, 0, 2 * MiB) == bytes(2 * MiB)
    dev.close()


@pytest.mark.parametrize("roomy", [True, False], ids=["roomy host", "tight host"])
def test_a_reset_zone_keeps_its_blocks_while_the_host_is_roomy(tmp_path, roomy):
    """An image holds a zone's blocks from its opening on and, while the host file system has
    a tenth of its size free, past a reset (zeros in place: the next writes go to blocks the
    host has); on a tight host a reset gives them back, and so does ``medium_free`` for the
    empty zones held when the host has become tight.  Either way the zone reads as zeros."""
    dev = create_image(tmp_path / "a.img", 8 * MiB, 2 * MiB)
    if not roomy:
        dev._host_roomy = lambda: False
    blocks = lambda: os.stat(dev.path).st_blocks * 512       # noqa: E731
    before = blocks()
    dev.write(0, 0, os.urandom(BS))
    assert blocks() >= before + 2 * MiB                     # the whole zone, at its opening
    dev.write(0, BS, os.urandom(2 * MiB - BS))
    dev.flush()
    dev.reset(0)
    assert dev.read(0, 0, 2 * MiB) == bytes(2 * MiB)
    if roomy and D._fallocate(dev._fd, D._FALLOC_ZERO_RANGE | D._FALLOC_KEEP_SIZE,
                              dev._data_off + 3 * 2 * MiB, BS) == 0:   # ext4, xfs: not tmpfs
        assert blocks() >= before + 2 * MiB                 # kept
        assert dev._give_back() and blocks() < before + MiB   # the host became tight
        assert not dev._give_back()
    else:
        assert blocks() < before + MiB                      # given back
    dev.write(0, 0, os.urandom(2 * MiB))                    # reusable
    dev.close()


def test_readonly_and_offline_eio(img):
    img.write(0, 0, blk(1, 4))
    img.write(1, 0, blk(1))
    img.inject_fault(0, ZoneCond.READONLY)
    img.inject_fault(1, ZoneCond.OFFLINE)
    assert img.open_count() == 0 and img.active_count() == 0
    assert img.read(0, 0, BS) == blk(1, 4)        # READONLY still reads
    with pytest.raises(OSError) as e:
        img.read(1, 0, BS)
    assert errno_of(e) == errno.EIO
    for z in (0, 1):
        for op in (lambda: img.write(z, BS, blk(1)), lambda: img.reset(z),
                   lambda: img.finish(z), lambda: img.open(z), lambda: img.close(z)):
            with pytest.raises(OSError) as e:
                op()
            assert errno_of(e) == errno.EIO
    with pytest.raises(ValueError):
        img.inject_fault(2, ZoneCond.FULL)


# --------------------------------------------------------------------------------------
# persistence, locking
# --------------------------------------------------------------------------------------

def snapshot(dev: ZonedDevice):
    return [(z.wp, z.cond) for z in dev.zones()]


def test_reopen_preserves_state(tmp_path):
    p = tmp_path / "a.img"
    dev = create_image(p, 8 * MiB, MiB, zone_capacity=512 * KiB, max_open=3, max_active=4)
    dev.write(0, 0, blk(2, 1))
    dev.write(1, 0, blk(1, 2))
    dev.close(1)
    dev.finish(2)
    dev.open(3)
    dev.inject_fault(4, ZoneCond.READONLY)
    snap = snapshot(dev)
    dev.close()
    dev = ImageZonedDevice(p)
    assert snapshot(dev) == snap
    assert (dev.zone_capacity, dev.max_open, dev.max_active) == (512 * KiB, 3, 4)
    assert dev.open_count() == 2 and dev.active_count() == 3
    assert dev.bytes_written == 0 and dev.resets == 0            # counters are per open
    assert dev.read(0, 0, 2 * BS) == blk(2, 1)
    dev.write(0, 2 * BS, blk(1))
    assert dev.report() == dev.zones()
    dev.close()


def _run_child(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=60, **kw)


def test_killed_process_wps_survive(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 16 * MiB, MiB, max_open=4, max_active=6).close()
    r = _run_child("""
        import os, signal, sys
        from retainzfs.device import ImageZonedDevice
        d = ImageZonedDevice(sys.argv[1])
        for i in range(37):
            d.write(0, i * 4096, bytes([i]) * 4096)
        d.write(1, 0, b"x" * 8192)
        d.close(1)
        d.finish(2)
        d.write(3, 0, b"y" * (1 << 20))                 # fills the zone
        d.write(4, 0, b"z" * 4096); d.reset(4)
        d.open(5)
        d.write(6, 0, b"w" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)            # no close, no flush
    """, str(p))
    assert r.returncode == -signal.SIGKILL, r.stderr
    dev = ImageZonedDevice(p)                      # the lock died with the process
    expect = {0: (37 * BS, ZoneCond.IMP_OPEN), 1: (2 * BS, ZoneCond.CLOSED),
              2: (MiB, ZoneCond.FULL), 3: (MiB, ZoneCond.FULL), 4: (0, ZoneCond.EMPTY),
              5: (0, ZoneCond.EXP_OPEN), 6: (BS, ZoneCond.IMP_OPEN)}
    for z, (wp, cond) in expect.items():
        assert (dev.zone(z).wp, dev.zone(z).cond) == (wp, cond), z
    assert dev.open_count() == 3 and dev.active_count() == 4
    assert dev.read(0, 36 * BS, BS) == bytes([36]) * BS
    assert dev.read(3, 0, MiB) == b"y" * MiB
    dev.write(0, 37 * BS, blk(1))                  # continues exactly at the old wp
    dev.close()


def test_os_exit_without_close(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 4 * MiB, MiB).close()
    r = _run_child("""
        import os, sys
        from retainzfs.device import ImageZonedDevice
        d = ImageZonedDevice(sys.argv[1])
        d.write(2, 0, b"q" * 12288)
        os._exit(0)
    """, str(p))
    assert r.returncode == 0, r.stderr
    dev = ImageZonedDevice(p)
    assert dev.zone(2).wp == 3 * BS and dev.read(2, 0, 3 * BS) == b"q" * 3 * BS
    dev.close()


def test_lock_same_process(tmp_path):
    p = tmp_path / "a.img"
    dev = create_image(p, 4 * MiB, MiB)
    for opener in (ImageZonedDevice, open_device):
        with pytest.raises(DeviceError, match="is in use by another process"):
            opener(p)
    dev.close()
    ImageZonedDevice(p).close()                    # released on close


def test_lock_other_process(tmp_path):
    p = tmp_path / "a.img"
    create_image(p, 4 * MiB, MiB).close()
    env = dict(os.environ, PYTHONPATH=REPO)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from retainzfs.device import open_device
        d = open_device(sys.argv[1])
        print("ready", flush=True)
        sys.stdin.read()
    """), str(p)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(DeviceError) as e:
            open_device(p)
        assert str(e.value) == f"{p} is in use by another process"
    finally:
        child.kill()
        child.wait()
    open_device(p).close()


def test_context_manager_and_flush(tmp_path):
    p = tmp_path / "a.img"
    with create_image(p, 4 * MiB, MiB) as dev:
        dev.write(0, 0, blk(1))
        dev.flush()
    with open_device(p) as dev:
        assert dev.zone(0).wp == BS


def test_report_rereads_table(img):
    img.write(0, 0, blk(1))
    # another writer of the table (simulated): the medium is the truth for report()
    os.pwrite(img._fd, struct.pack("<QB7x", 2 * BS, 0x4), img._table_off)
    assert img.zone(0).wp == BS
    zs = img.report()
    assert (zs[0].wp, zs[0].cond) == (2 * BS, ZoneCond.CLOSED)
    assert img.open_count() == 0 and img.active_count() == 1


def test_large_sparse_image(tmp_path):
    p = tmp_path / "big.img"
    dev = create_image(p, 6 * GiB, 256 * MiB, zone_capacity=192 * MiB)
    assert dev.nr_zones == 24
    st_ = os.stat(p)
    assert st_.st_size > 6 * GiB
    assert st_.st_blocks * 512 < 16 * MiB          # sparse
    last = dev.nr_zones - 1
    assert dev.zone(last).start == last * 256 * MiB > 4 * GiB
    payload = os.urandom(MiB)
    dev.write(last, 0, payload)
    dev.write(last, MiB, payload)
    dev.finish(last - 1)
    dev.close()
    dev = ImageZonedDevice(p)
    assert dev.zone(last).wp == 2 * MiB and dev.zone(last - 1).cond == ZoneCond.FULL
    assert dev.read(last, MiB, MiB) == payload
    assert dev.read(last, MiB - 10, 20) == payload[-10:] + payload[:10]
    assert dev._data_off + last * dev.zone_size > 4 * GiB
    dev.close()


# --------------------------------------------------------------------------------------
# property test: random op sequences vs a reference model of the zone state machine
# --------------------------------------------------------------------------------------

NZ, ZSIZE, ZCAP, MOPEN, MACT = 6, 32 * KiB, 24 * KiB, 2, 3
EMPTY, IOPEN, EOPEN, CLOSED = ZoneCond.EMPTY, ZoneCond.IMP_OPEN, ZoneCond.EXP_OPEN, ZoneCond.CLOSED
FULL, RO, OFF = ZoneCond.FULL, ZoneCond.READONLY, ZoneCond.OFFLINE


class Model:
    """A deliberately naive reference: recount everything, no incremental bookkeeping."""

    def __init__(self):
        self.wp = [0] * NZ
        self.cond = [EMPTY] * NZ
        self.data = [bytearray(ZCAP) for _ in range(NZ)]
        self.bytes_written = 0
        self.resets = 0

    def nopen(self):
        return sum(c in (IOPEN, EOPEN) for c in self.cond)

    def nactive(self):
        return sum(c in (IOPEN, EOPEN, CLOSED) for c in self.cond)

    def _acquire(self, act, opn):
        if act and self.nactive() + 1 > MACT:
            return errno.EOVERFLOW
        if opn and self.nopen() + 1 > MOPEN:
            return errno.ETOOMANYREFS
        return None

    def write(self, z, off, payload):
        c, n = self.cond[z], len(payload)
        if c in (RO, OFF):
            return errno.EIO
        if c == FULL or off != self.wp[z] or n % BS or off + n > ZCAP:
            return errno.EINVAL
        if n == 0:
            return None
        if c in (EMPTY, CLOSED):
            e = self._acquire(c == EMPTY, True)
            if e:
                return e
            self.cond[z] = IOPEN
        self.data[z][off:off + n] = payload
        self.wp[z] += n
        self.bytes_written += n
        if self.wp[z] == ZCAP:
            self.cond[z] = FULL
        return None

    def reset(self, z):
        if self.cond[z] in (RO, OFF):
            return errno.EIO
        if self.cond[z] != EMPTY:
            self.resets += 1
        self.wp[z], self.cond[z], self.data[z] = 0, EMPTY, bytearray(ZCAP)
        return None

    def finish(self, z):
        if self.cond[z] in (RO, OFF):
            return errno.EIO
        self.wp[z], self.cond[z] = ZCAP, FULL
        return None

    def open(self, z):
        c = self.cond[z]
        if c in (RO, OFF):
            return errno.EIO
        if c == FULL:
            return errno.EINVAL
        if c in (EMPTY, CLOSED):
            e = self._acquire(c == EMPTY, True)
            if e:
                return e
        self.cond[z] = EOPEN
        return None

    def close(self, z):
        c = self.cond[z]
        if c in (RO, OFF):
            return errno.EIO
        if c in (IOPEN, EOPEN):
            self.cond[z] = CLOSED if self.wp[z] else EMPTY
        return None

    def fault(self, z, cond):
        self.cond[z] = cond


zone_st = st.integers(0, NZ - 1)
write_st = st.tuples(st.just("write"), zone_st, st.integers(0, 3),
                     st.sampled_from([0] * 8 + [BS, -BS, 512]), st.sampled_from([0] * 15 + [100]))
op_st = st.one_of(
    write_st, write_st, write_st, write_st,
    st.tuples(st.just("close"), zone_st),
    st.tuples(st.just("close"), zone_st),
    st.tuples(st.just("open"), zone_st),
    st.tuples(st.just("reset"), zone_st),
    st.tuples(st.just("finish"), zone_st),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("fault"), st.integers(NZ - 2, NZ - 1), st.sampled_from([RO, OFF])),
)


def run_against_model(ops, seen=None):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.img")
        dev = create_image(path, NZ * ZSIZE, ZSIZE, zone_capacity=ZCAP, max_open=MOPEN,
                           max_active=MACT)
        m = Model()
        try:
            for step, op in enumerate(ops):
                kind, args = op[0], op[1:]
                if kind == "reopen":
                    dev.close()
                    dev = ImageZonedDevice(path)
                    m.bytes_written = m.resets = 0
                    continue
                if kind == "fault":
                    dev.inject_fault(*args)
                    m.fault(*args)
                    continue
                if kind == "write":
                    z, nblk, delta, extra = args
                    payload = bytes([step % 251 + 1]) * (nblk * BS + extra)
                    off = m.wp[z] + delta
                    call = lambda: dev.write(z, off, payload)     # noqa: E731
                    expect = m.write(z, off, payload)
                else:
                    z = args[0]
                    call = lambda: getattr(dev, kind)(z)          # noqa: E731
                    expect = getattr(m, kind)(z)
                try:
                    call()
                    got = None
                except OSError as e:
                    got = e.errno
                assert got == expect, (step, op)
                label = f"{kind}: {errno.errorcode.get(got, 'ok')}"
                if seen is None:
                    event(label)
                else:
                    seen.add(label)
                assert snapshot(dev) == list(zip(m.wp, m.cond)), (step, op)
                assert dev.open_count() == m.nopen() and dev.active_count() == m.nactive()
                assert (dev.bytes_written, dev.resets) == (m.bytes_written, m.resets)
                if m.cond[z] != OFF:
                    assert dev.read(z, 0, ZCAP) == bytes(m.data[z]), (step, op)
            dev.close()
            dev = ImageZonedDevice(path)                         # final state persisted
            assert snapshot(dev) == list(zip(m.wp, m.cond))
            for z in range(NZ):
                if m.cond[z] != OFF:
                    assert dev.read(z, 0, ZCAP) == bytes(m.data[z])
        finally:
            dev.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, min_size=1, max_size=120))
def test_state_machine_matches_model(ops):
    run_against_model(ops)


def test_state_machine_long_random_run():
    """A long seeded walk: guarantees every rule (incl. both limit errors) is exercised."""
    rng = random.Random(1234)
    ops = []
    for _ in range(4000):
        r = rng.random()
        z = rng.randrange(NZ)
        if r < 0.45:
            ops.append(("write", z, rng.randrange(4), rng.choice([0] * 10 + [BS, -BS, 512]),
                        rng.choice([0] * 20 + [100])))
        elif r < 0.62:
            ops.append(("close", z))
        elif r < 0.74:
            ops.append(("open", z))
        elif r < 0.86:
            ops.append(("reset", z))
        elif r < 0.95:
            ops.append(("finish", z))
        elif r < 0.995 or len(ops) < 3000:
            ops.append(("reopen",))
        else:                                      # faults are permanent: late, one zone
            ops.append(("fault", NZ - 1, rng.choice([RO, OFF])))
    seen: set[str] = set()
    run_against_model(ops, seen)
    for label in ("write: ok", "write: EINVAL", "write: ETOOMANYREFS", "write: EOVERFLOW",
                  "write: EIO", "open: ETOOMANYREFS", "open: EOVERFLOW", "open: EINVAL",
                  "reset: ok", "finish: ok", "close: ok", "close: EIO"):
        assert label in seen, (label, sorted(seen))


# --------------------------------------------------------------------------------------
# BlockZonedDevice: uAPI structs, report parsing, sysfs checks, O_DIRECT path (emulated)
# --------------------------------------------------------------------------------------

def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x12 << 8) | nr


def test_ioctl_numbers_match_uapi_encoding():
    W, R, RW = 1, 2, 3
    assert D.BLKREPORTZONE == _ioc(RW, 130, 16)       # _IOWR(0x12,130,struct blk_zone_report)
    assert D.BLKRESETZONE == _ioc(W, 131, 16)         # _IOW(0x12,131,struct blk_zone_range)
    assert D.BLKGETZONESZ == _ioc(R, 132, 4)          # _IOR(0x12,132,__u32)
    assert D.BLKGETNRZONES == _ioc(R, 133, 4)
    assert D.BLKOPENZONE == _ioc(W, 134, 16)
    assert D.BLKCLOSEZONE == _ioc(W, 135, 16)
    assert D.BLKFINISHZONE == _ioc(W, 136, 16)
    assert (D.BLKREPORTZONE, D.BLKRESETZONE, D.BLKGETZONESZ, D.BLKGETNRZONES, D.BLKOPENZONE,
            D.BLKCLOSEZONE, D.BLKFINISHZONE) == (0xC0101282, 0x40101283, 0x80041284,
                                                 0x80041285, 0x40101286, 0x40101287,
                                                 0x40101288)


def _blk_zone_bytes(start, ln, wp, ztype, cond, cap):
    b = bytearray(64)
    struct.pack_into("<QQQ", b, 0, start, ln, wp)
    b[24], b[25] = ztype, cond
    struct.pack_into("<Q", b, 32, cap)
    return bytes(b)


def test_report_header_packing():
    buf = D.pack_report_header(4096, 3)
    assert len(buf) == 16 + 3 * 64
    assert struct.unpack_from("<QII", buf) == (4096, 3, 0)
    assert bytes(buf[16:]) == bytes(3 * 64)


def test_parse_synthetic_report():
    zs = 8192                                          # 4 MiB zones in sectors
    entries = [
        _blk_zone_bytes(0, zs, 0, 2, 0x1, 6144),                 # EMPTY
        _blk_zone_bytes(zs, zs, zs + 100, 2, 0x2, 6144),         # IMP_OPEN, wp 100 sectors
        _blk_zone_bytes(2 * zs, zs, 2 * zs + 8, 2, 0x4, 6144),   # CLOSED
        _blk_zone_bytes(3 * zs, zs, 2**64 - 1, 2, 0xE, 6144),    # FULL: wp is garbage
        _blk_zone_bytes(4 * zs, zs, 4 * zs + 16, 2, 0x3, 6144),  # EXP_OPEN
        _blk_zone_bytes(5 * zs, zs, 5 * zs, 2, 0xF, 6144),       # OFFLINE
        _blk_zone_bytes(6 * zs, zs, 6 * zs + 24, 2, 0xD, 6144),  # READONLY
    ]
    buf = struct.pack("<QII", 0, len(entries), D.BLK_ZONE_REP_CAPACITY) + b"".join(entries)
    flags, zones = D.parse_report(buf)
    assert flags == 1 and len(zones) == 7
    assert zones[1] == D.BlkZone(zs, zs, zs + 100, 2, 2, 6144)
    states = [D.blk_zone_state(z) for z in zones]
    size, cap = 4 * MiB, 3 * MiB
    assert states == [
        (size, cap, 0, 0x1), (size, cap, 100 * 512, 0x2), (size, cap, 8 * 512, 0x4),
        (size, cap, cap, 0xE), (size, cap, 16 * 512, 0x3), (size, cap, 0, 0xF),
        (size, cap, 24 * 512, 0xD)]


def test_parse_report_without_capacity_flag_and_short_count():
    zs = 2048
    entries = [_blk_zone_bytes(i * zs, zs, i * zs, 2, 0x1, 77) for i in range(4)]
    # kernel filled only 2 of 4 slots; no capacity flag -> capacity = len
    buf = struct.pack("<QII", 0, 2, 0) + b"".join(entries)
    flags, zones = D.parse_report(bytearray(buf))
    assert flags == 0 and len(zones) == 2
    assert all(z.capacity == zs for z in zones)
    assert D.blk_zone_state(zones[0]) == (MiB, MiB, 0, 0x1)


def test_conventional_zone_state():
    z = D.BlkZone(0, 2048, 12345, D.BLK_ZONE_TYPE_CONVENTIONAL, 0x0, 2048)
    assert D.blk_zone_state(z) == (MiB, MiB, 0, 0x0)


def test_needs_mq_deadline():
    assert D.needs_mq_deadline("6.1.0-18-amd64", "[none] mq-deadline kyber")
    assert D.needs_mq_deadline("5.15.0", "mq-deadline [none]")
    assert not D.needs_mq_deadline("6.1.0-18-amd64", "[mq-deadline] kyber none")
    assert not D.needs_mq_deadline("6.10.0", "[none] mq-deadline")
    assert not D.needs_mq_deadline("6.12.9-arch1", "[none]")
    assert not D.needs_mq_deadline("7.0.0", "[none]")


@pytest.fixture
def fake_blockdev(tmp_path, monkeypatch):
    """A block-device node with a fake sysfs tree; returns (node, queue_dir)."""
    node = tmp_path / "fakezns"
    rdev = os.makedev(259, 4000)
    try:
        os.mknod(node, stat.S_IFBLK | 0o600, rdev)
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot create a block device node here: {e}")
    sysroot = tmp_path / "sys"
    q = sysroot / "dev" / "block" / "259:4000" / "queue"
    q.mkdir(parents=True)
    monkeypatch.setattr(D, "_SYSFS", str(sysroot))
    return node, q


@pytest.mark.parametrize("model", ["host-aware", "none"])
def test_block_rejects_non_host_managed(fake_blockdev, model):
    node, q = fake_blockdev
    (q / "zoned").write_text(model + "\n")
    with pytest.raises(DeviceError, match="not a host-managed zoned device") as e:
        open_device(node)
    assert model in str(e.value)


def test_block_rejects_partition(fake_blockdev):
    node, q = fake_blockdev
    q.rmdir()
    with pytest.raises(DeviceError, match="partition"):
        BlockZonedDevice(node)


def test_block_host_managed_unopenable(fake_blockdev):
    node, q = fake_blockdev
    for name, val in dict(zoned="host-managed", chunk_sectors=8192, nr_zones=16,
                          max_open_zones=0, max_active_zones=0, logical_block_size=4096,
                          scheduler="[mq-deadline] none").items():
        (q / name).write_text(f"{val}\n")
    with pytest.raises(DeviceError, match="cannot open|no such"):
        BlockZonedDevice(node)                     # no driver behind 259:4000


class EmulatedBlockDevice(BlockZonedDevice):
    """BlockZonedDevice over a regular file with O_DIRECT; the blkzoned ioctls emulated
    (QEMU-like: closing an open zone with wp == start leaves it CLOSED)."""

    def __init__(self, path, nr_zones, zone_size, cap, max_open=0, max_active=0, lbs=4096):
        self._fd = -1
        spz = zone_size // 512
        self.fz = [[i * spz, spz, i * spz, 2, 0x1, cap // 512] for i in range(nr_zones)]
        self.ioctls = []
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        self._setup(str(path), fd, lbs, zone_size, nr_zones, max_open, max_active)

    def _ioctl(self, request, arg):
        self.ioctls.append(request)
        if request == D.BLKREPORTZONE:
            sector, n, _ = struct.unpack_from("<QII", arg)
            idx = [i for i, z in enumerate(self.fz) if z[0] >= sector][:n]
            struct.pack_into("<QII", arg, 0, sector, len(idx), D.BLK_ZONE_REP_CAPACITY)
            for k, i in enumerate(idx):
                arg[16 + 64 * k:16 + 64 * (k + 1)] = _blk_zone_bytes(*self.fz[i])
            return
        sector, nsec = struct.unpack("<QQ", arg)
        z = self.fz[sector // self.fz[0][1]]
        assert nsec == z[1] and sector == z[0]
        if request == D.BLKRESETZONE:
            z[2], z[4] = z[0], 0x1
        elif request == D.BLKFINISHZONE:
            z[2], z[4] = z[0] + z[5], 0xE
        elif request == D.BLKOPENZONE:
            z[4] = 0x3
        elif request == D.BLKCLOSEZONE:
            z[4] = 0x4
        else:
            raise AssertionError(hex(request))

    def _io_write(self, zone, wp, data, n):
        super()._io_write(zone, wp, data, n)
        z = self.fz[zone]
        z[2] += n // 512
        z[4] = 0xE if z[2] == z[0] + z[5] else (z[4] if z[4] == 0x3 else 0x2)


@pytest.fixture
def emu(tmp_path):
    p = tmp_path / "blk.raw"
    with open(p, "wb") as f:
        f.truncate(8 * 4 * MiB)
    try:
        dev = EmulatedBlockDevice(p, 8, 4 * MiB, 3 * MiB, max_open=2, max_active=3)
    except OSError as e:
        pytest.skip(f"O_DIRECT unsupported here: {e}")
    yield dev
    dev.close()


def test_block_direct_io_path(emu):
    assert (emu.nr_zones, emu.zone_size, emu.zone_capacity, emu.block_size) == \
        (8, 4 * MiB, 3 * MiB, 4096)
    payload = os.urandom(3 * MiB - 4096)
    # unaligned source memory (a slice of bytes) must go through the aligned bounce buffer
    emu.write(1, 0, memoryview(b"\0" + payload)[1:1 + 4096])
    emu.write(1, 4096, payload[4096:])
    assert emu.zone(1).wp == 3 * MiB - 4096 and emu.zone(1).cond == ZoneCond.IMP_OPEN
    assert emu.read(1, 0, 3 * MiB - 4096) == payload
    assert emu.read(1, 4096 + 13, 5000) == payload[4096 + 13:4096 + 13 + 5000]   # unaligned
    emu.write(1, 3 * MiB - 4096, blk(1))
    assert emu.zone(1).cond == ZoneCond.FULL
    assert emu.report() == emu.zones()             # emulated device agrees with the cache
    with pytest.raises(OSError) as e:
        emu.write(2, 4096, blk(1))
    assert errno_of(e) == errno.EINVAL


def test_block_large_write_and_read_chunked(emu, monkeypatch):
    monkeypatch.setattr(D, "_DIO_CHUNK", 8 * MiB)
    data = os.urandom(3 * MiB)
    emu.write(0, 0, data)                          # 1 chunk
    assert emu.read(0, 1, 3 * MiB - 1) == data[1:]
    # force multi-chunk reads through a small bounce buffer
    monkeypatch.setattr(D, "_DIO_CHUNK", 64 * KiB)
    import threading
    out = {}

    def rd(k):
        out[k] = emu.read(0, 777 * k, 200 * KiB + 3)
    ts = [threading.Thread(target=rd, args=(k,)) for k in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for k in range(4):
        assert out[k] == data[777 * k:777 * k + 200 * KiB + 3]


def test_block_mgmt_and_limits(emu):
    emu.write(0, 0, blk(1))
    emu.write(1, 0, blk(1))
    with pytest.raises(OSError) as e:
        emu.write(2, 0, blk(1))
    assert errno_of(e) == errno.ETOOMANYREFS
    assert D.BLKRESETZONE not in emu.ioctls
    emu.close(0)
    assert emu.zone(0).cond == ZoneCond.CLOSED and emu.fz[0][4] == 0x4
    emu.open(2)
    emu.close(2)
    # the emulated (QEMU-like) device leaves it CLOSED at wp 0: the cache adopts that
    assert emu.zone(2).cond == ZoneCond.CLOSED and emu.active_count() == 3
    with pytest.raises(OSError) as e:
        emu.open(3)
    assert errno_of(e) == errno.EOVERFLOW
    emu.finish(2)
    emu.reset(0)
    assert emu.zone(0).cond == ZoneCond.EMPTY and emu.zone(0).wp == 0 and emu.resets == 1
    assert emu.zone(2).cond == ZoneCond.FULL and emu.zone(2).wp == 3 * MiB
    assert emu.report() == emu.zones()
    assert emu.active_count() == 1 and emu.open_count() == 1
    emu.flush()


# ---------------------------------------------------------------- reservations (parallel writes)

def _reserved_write(dev, zone, off, data, order_log=None):
    """The writer's side of a reservation: write, commit in turn, pass the turn."""
    try:
        dev.write_reserved(zone, off, data)
        dev.commit(zone, off, len(data))
        if order_log is not None:
            order_log.append(off)
    finally:
        dev.pass_turn(zone, off, len(data))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), perm=st.randoms())
def test_reserved_writes_land_in_order_whatever_order_they_finish(img, sizes, perm):
    """Reservations of one zone written by threads finishing in any order: each commits in
    its turn (the order of ``order_log``), the write pointer only ever covers written bytes,
    and the zone holds the bytes in reservation order, also after a reopen."""
    import threading
    zone = 3
    img.reset(zone)
    sizes = sizes[:]
    while sum(sizes) > 12:                   # capacity 48 KiB = 12 blocks
        sizes.pop()
    datas = [blk(n, 0x10 + i) for i, n in enumerate(sizes)]
    order = list(range(len(datas)))
    perm.shuffle(order)                      # drawn first: hypothesis may end an example here
    offs = [img.reserve(zone, len(d)) for d in datas]
    assert offs == [sum(len(d) for d in datas[:i]) for i in range(len(datas))]
    assert img.zone(zone).wp == 0 and img.pending(zone) == len(datas)
    with pytest.raises(OSError):             # a plain write is not at the next offset
        img.write(zone, 0, blk(1))
    log = []
    threads = [threading.Thread(target=_reserved_write, args=(img, zone, offs[i], datas[i], log))
               for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log == offs and img.pending(zone) == 0
    total = sum(len(d) for d in datas)
    assert img.zone(zone).wp == total
    assert img.read(zone, 0, total) == b"".join(datas)
    path = img.path
    img.close()
    again = ImageZonedDevice(path)
    try:
        assert again.zone(zone).wp == total and again.read(zone, 0, total) == b"".join(datas)
    finally:
        again.close()
    img.__init__(path)                        # the fixture closes it


def test_management_commands_wait_for_reservations(img):
    """A finish (reset, close) of a zone with a reservation outstanding waits until it is
    passed: it never lands between a write and its commit."""
    import threading
    import time
    off = img.reserve(2, 2 * BS)
    done = []
    t = threading.Thread(target=lambda: (img.finish(2), done.append(img.zone(2).wp)))
    t.start()
    time.sleep(0.2)
    assert not done and img.zone(2).cond == ZoneCond.IMP_OPEN
    _reserved_write(img, 2, off, blk(2))
    t.join(5)
    assert done == [48 * KiB] and img.zone(2).cond == ZoneCond.FULL
    assert img.read(2, 0, 2 * BS) == blk(2)


def test_a_failed_reserved_write_finishes_the_zone_and_keeps_the_later_ones(img):
    """The write of the first of two reservations fails: in its turn the zone is finished
    behind the hole; the second one's bytes (written) are below the write pointer and its
    commit succeeds; nothing more can be written there."""
    a = img.reserve(4, BS)
    b = img.reserve(4, 2 * BS)
    img.write_reserved(4, b, blk(2, 0x22))
    import threading
    t = threading.Thread(target=_reserved_write, args=(img, 4, b, blk(2, 0x22)))
    t.start()                                 # waits for a's turn
    try:
        img.abandon(4, a, BS)                 # a's write failed
    finally:
        img.pass_turn(4, a, BS)
    t.join(5)
    assert not t.is_alive() and img.pending(4) == 0
    z = img.zone(4)
    assert z.cond == ZoneCond.FULL and z.wp == 48 * KiB
    assert img.read(4, b, 2 * BS) == blk(2, 0x22)
    with pytest.raises(OSError):
        img.reserve(4, BS)


def test_reservations_count_against_the_open_limit(img):
    """A reservation opens its zone at once (max_open 2 here): a third zone is refused
    before any byte is written, as a write would be."""
    img.reserve(0, BS)
    img.reserve(1, BS)
    with pytest.raises(OSError) as ei:
        img.reserve(5, BS)
    assert errno_of(ei) == errno.ETOOMANYREFS
    for z in (0, 1):
        _reserved_write(img, z, 0, blk(1))
    assert img.zone(0).wp == img.zone(1).wp == BS


def test_a_failed_write_is_taken_back_and_the_zone_takes_the_retry(img, monkeypatch):
    """A plain write (or the last reservation) whose I/O fails leaves the zone as it was:
    same write pointer, no reservation pending, and a retry at the same offset works (the
    journal retries its frames so).  With a reservation after it, it cannot be taken back."""
    real = type(img)._io_write
    fail = [True]

    def flaky(self, zone, wp, data, n):
        if fail[0]:
            raise OSError(errno.EIO, "injected")
        return real(self, zone, wp, data, n)
    monkeypatch.setattr(type(img), "_io_write", flaky)
    with pytest.raises(OSError):
        img.write(6, 0, blk(2))
    assert img.zone(6).wp == 0 and img.pending(6) == 0
    fail[0] = False
    assert img.write(6, 0, blk(2)) == 2 * BS and img.zone(6).wp == 2 * BS
    a = img.reserve(6, BS)
    b = img.reserve(6, BS)
    assert not img.cancel(6, a, BS)               # b came after it
    assert img.cancel(6, b, BS)                   # the last one can go
    _reserved_write(img, 6, a, blk(1, 0x33))
    assert img.zone(6).wp == 3 * BS and img.pending(6) == 0


def test_a_full_host_takes_back_the_empty_zones_the_image_held(tmp_path):
    """A write that meets a full host while the image holds blocks of empty zones (here: a
    zone opened, so allocated, and closed unwritten) gives those back and lands; with none
    held it fails with ENOSPC as before.  A 16 MiB tmpfs, filled by another file."""
    from conftest import tmpfs
    with tmpfs(tmp_path / "host", "16M") as host:
        dev = create_image(host / "a.img", 32 * MiB, 2 * MiB, max_open=4, max_active=4)
        dev.open(1)
        dev.close(1)                                       # EMPTY again, its blocks held
        assert dev.zone(1).cond == ZoneCond.EMPTY and 1 in dev._alloc
        with open(host / "filler", "wb") as f:             # another program fills the host
            with pytest.raises(OSError):
                while True:
                    f.write(bytes(MiB))
                    f.flush()
        data = os.urandom(MiB)
        dev.write(0, 0, data)                              # zone 0's blocks: given back
        assert dev.read(0, 0, MiB) == data and 1 not in dev._alloc
        with pytest.raises(OSError) as e:                  # nothing more to give
            dev.write(2, 0, os.urandom(2 * MiB))
        assert e.value.errno == errno.ENOSPC
        dev.close()


def test_kept_zones_stay_allocated_across_resets(tmp_path):
    """``keep_allocated``: the metadata zones' blocks are the image's own from the start and
    again after a reset punched them out (they read as zeros), so a journal frame cannot fail
    for want of host space, even on a tight host; other zones are given back there."""
    dev = create_image(str(tmp_path / "k.zns"), 16 * MiB, 1 * MiB, max_open=4, max_active=4)
    dev._host_roomy = lambda: False

    def blocks() -> int:
        return os.fstat(dev._fd).st_blocks * 512

    try:
        b0 = blocks()
        assert dev.keep_allocated(range(2)) == 0
        b1 = blocks()
        assert b1 - b0 >= 2 * MiB
        dev.write(5, 0, b"\xab" * (256 * 1024))
        assert blocks() - b1 >= 256 * 1024
        dev.reset(5)
        assert blocks() == b1                 # zone 5 went back to the host
        dev.write(0, 0, b"\xcd" * (256 * 1024))
        assert blocks() == b1                 # written into its own blocks
        dev.reset(0)
        assert blocks() == b1                 # zeroed or punched, and allocated again
        assert os.pread(dev._fd, 256 * 1024, dev._data_off) == bytes(256 * 1024)
    finally:
        dev.close()
