"""A host that answers EIO under an image: a failing disk, or the file system holding the
image failing.  Made real with two mounts: the inner mount's image is a file in the outer
mount, and bytes of the outer image corrupted behind its daemon make the outer mount answer
EIO (its checksums refuse them) for exactly that spot of the inner image.

Found at stop 53 this way: one reader retrying a bad spot made the inner daemon write a
traceback per request (14 MB of log in 10 s); ``fsck``, ``mkfs`` and ``mount`` of an image
whose header read failed printed (or logged) a traceback instead of one line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import MKFS, MOUNT, RETAINZFS, mkfs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
from benchutil import drop_caches  # noqa: E402  (the benchmarks' own: sync, then drop)


@pytest.fixture
def nested(tmp_path, mount_image):
    """(outer image, outer mount, inner image in the outer mount)."""
    outer_img = mkfs(tmp_path / "outer.zns", "256M", "4M")
    outer = mount_image(outer_img, name="outer")
    inner_img = mkfs(outer.path / "inner.zns", "64M", "4M")
    return outer_img, outer, inner_img


def spoil(outer_img, piece: bytes) -> int:
    """Corrupt 16 bytes of the outer image where ``piece`` (4 KiB of the inner image, found
    by its content) lies, behind the outer daemon: reads of it through the outer mount then
    fail with EIO.  Returns where it was."""
    # (the inner daemon's fsync, or its close of the image, made the outer mount commit
    # them; the sync is only belt and braces)
    os.sync()
    raw = outer_img.read_bytes()
    at = raw.find(piece)
    assert at > 0 and any(piece), at
    with open(outer_img, "r+b") as f:
        f.seek(at + 100)
        f.write(b"\xff" * 16)
    drop_caches()
    return at


def test_a_host_answering_eio_for_one_spot_writes_one_traceback_and_a_count(nested,
                                                                           mount_image,
                                                                           request):
    """One reader retries a 4 KiB read of the spot for 3 s: every read fails with EIO,
    ``status`` counts them (``read_errors``), the inner daemon's log holds one traceback and,
    after the unmount, the count of the rest; the rest of the file reads back after a
    remount."""
    request.node.allow_daemon_errors = True            # (the one traceback is the point)
    outer_img, outer, inner_img = nested
    inner = mount_image(inner_img, name="inner")
    data = os.urandom(4 << 20)
    with open(inner / "f", "wb") as fh:
        fh.write(data)
        os.fsync(fh.fileno())
    spoil(outer_img, data[8192:8192 + 4096])
    failed = reads = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        fd = os.open(inner / "f", os.O_RDONLY)
        try:
            os.pread(fd, 4096, 8192)
        except OSError as e:
            assert e.errno == 5
            failed += 1
        finally:
            os.close(fd)
        reads += 1
        if reads % 20 == 0:
            drop_caches()
    assert failed == reads and reads > 100, (failed, reads)
    st = inner.status()                         # observable: counted, shown, exported
    assert st["read_errors"] >= failed and st["checksum_errors"] == 0, st
    table = subprocess.run([RETAINZFS, "status", str(inner)], capture_output=True,
                           text=True).stdout
    assert "read errors" in table, table
    inner.umount()
    log = inner.daemon_log()
    assert log.count("Traceback") == 1 and log.count("ERROR retainzfs: I/O error in read\n") == 1
    m = re.search(r"I/O error in read \((\d+) more like it since \d\d:\d\d:\d\d, not written\)",
                  log)
    assert m and int(m.group(1)) + 1 >= failed, log[-2000:]    # (the kernel may ask twice)
    assert len(log) < 8000, len(log)            # 14 MB in 10 s before
    inner.mount()
    with open(inner / "f", "rb") as fh:
        fh.seek(1 << 20)
        assert fh.read() == data[1 << 20:]
    inner.umount()
    outer.umount()


def test_an_unreadable_image_header_is_one_line_for_fsck_mkfs_and_mount(nested, tmp_path):
    """The image's header (its first block) answers EIO: ``retainzfs fsck``, ``mkfs`` (no
    --force) and ``mount.retainzfs`` each fail with one line that says reading failed and where
    to look, and the daemon's log holds no traceback."""
    outer_img, outer, inner_img = nested
    with open(inner_img, "rb") as f:
        head = f.read(4096)
    spoil(outer_img, head)
    mnt = tmp_path / "inner"
    mnt.mkdir()
    log = tmp_path / "inner.log"
    for cmd in ([RETAINZFS, "fsck", str(inner_img)], [MKFS, str(inner_img)],
                [MOUNT, "-o", f"log={log}", str(inner_img), str(mnt)]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        err = p.stderr.strip()
        assert p.returncode != 0 and "Traceback" not in p.stdout + err, (cmd, p.stdout, err)
        assert len(err.splitlines()) == 1, (cmd, err)
        assert "reading it failed: Input/output error" in err and "dmesg" in err, (cmd, err)
    assert "Traceback" not in log.read_text(), log.read_text()
    assert not any(str(mnt) in ln for ln in open("/proc/mounts"))
    outer.umount()


def test_an_unreadable_metadata_copy_is_read_from_its_mirror(nested, mount_image):
    """The first block of the first metadata zone answers EIO: fsck says that zone is
    unreadable and its mirror used; the mount serves every file with its xattr, says so in
    ``status``, and after a clean unmount fsck finds nothing wrong."""
    outer_img, outer, inner_img = nested
    inner = mount_image(inner_img, name="inner")
    files = {f"f{i}": os.urandom(1 << 20) for i in range(3)}
    for name, data in files.items():
        (inner / name).write_bytes(data)
    os.setxattr(inner / "f1", "user.x", b"kept")
    inner.umount()
    from retainzfs.device import open_device
    dev = open_device(inner_img, readonly=True)
    meta_at = dev._zone_off(0)
    dev.close()
    with open(inner_img, "rb") as f:
        f.seek(meta_at)
        first = f.read(4096)
    spoil(outer_img, first)
    p = subprocess.run([RETAINZFS, "fsck", str(inner_img)], capture_output=True, text=True)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    assert re.search(r"metadata zone \d unreadable; using its mirror \d", p.stdout), p.stdout
    inner.mount()
    for name, data in files.items():
        assert (inner / name).read_bytes() == data
    assert os.getxattr(inner / "f1", "user.x") == b"kept"
    assert inner.status()["metadata_problems"], inner.status()    # (status says so)
    inner.umount()
    p = subprocess.run([RETAINZFS, "fsck", str(inner_img)], capture_output=True, text=True)
    assert p.returncode == 0 and "0 problems" in p.stdout, p.stdout + p.stderr
    outer.umount()


def test_unfsynced_bytes_the_device_cannot_read_at_mount_are_kept_not_cut(nested, mount_image,
                                                                          request):
    """After a crash, the mount reads back the writes no flush proved.  A spot of them the
    device fails to read is the medium failing, not a power cut: the file keeps its bytes
    (reads of the spot fail with EIO, the rest reads back) and, once the host reads that spot
    again, all of it.  Before stop 53 such a file was cut where the spot began, for good,
    and the log said "power cut"."""
    request.node.allow_daemon_errors = True
    outer_img, outer, inner_img = nested
    inner = mount_image(inner_img, "sync_interval=600", name="inner")
    a, b = os.urandom(4 << 20), os.urandom(4 << 20)
    with open(inner / "a", "wb") as f:
        f.write(a)
        os.fsync(f.fileno())
    (inner / "b").write_bytes(b)            # closed, never fsynced: unproven at the crash
    inner.kill()
    subprocess.run(["fusermount3", "-u", "-z", str(inner.path)], capture_output=True)
    at = spoil(outer_img, b[1 << 20:(1 << 20) + 4096])   # (16 x 0xff at at + 100)
    inner.mount()
    log = inner.daemon_log()
    assert "power cut" not in log and "could not be read back at mount" in log, log[-2000:]
    assert inner.status()["lost_writes"] is None
    assert (inner / "a").read_bytes() == a
    assert os.path.getsize(inner / "b") == len(b)
    with open(inner / "b", "rb") as f:
        assert f.read(1 << 20) == b[:1 << 20]
        f.seek(2 << 20)
        assert f.read() == b[2 << 20:]
        with pytest.raises(OSError) as e:
            os.pread(f.fileno(), 4096, 1 << 20)
        assert e.value.errno == 5
    inner.umount()
    # the host reads the spot again (its bytes put back behind the outer daemon): all of b
    with open(outer_img, "r+b") as f:
        f.seek(at + 100)
        f.write(b[(1 << 20) + 100:(1 << 20) + 116])
    drop_caches()
    inner.mount()
    assert (inner / "b").read_bytes() == b and (inner / "a").read_bytes() == a
    inner.umount()
    outer.umount()


def test_a_mount_whose_host_fails_every_write_unmounts_cleanly_and_loses_no_fsynced_file(
        loop_host, mount_image, request):
    """Three layers: ext4 on a loop device holds the outer image; the inner image is a file in
    the outer mount.  The ext4 aborts: the outer mount fails every change (EIO), so the inner
    one's writes fail EIO from its host -- at once, with ``status`` saying why -- and its
    fsynced files still read back.  Its unmount then ends as an unmount (before stop 53 the
    close of its image answered EIO, and the daemon ended in "daemon failed" with a traceback
    before saying it had unmounted); after e2fsck and mounting all three again, every fsynced
    file is there and writes work."""
    request.node.allow_daemon_errors = True    # (the first failed write's report)
    host = loop_host(["mkfs.ext4", "-q"], "700M")
    loop = subprocess.run(["findmnt", "-no", "SOURCE", str(host)], capture_output=True,
                          text=True).stdout.strip()
    outer_img = mkfs(host / "outer.zns", "512M", "4M")
    outer = mount_image(outer_img, name="outer")
    inner_img = mkfs(outer.path / "inner.zns", "128M", "4M")
    inner = mount_image(inner_img, name="inner")
    want = {}
    for i in range(4):
        want[f"f{i}"] = data = os.urandom((i + 1) << 20)
        with open(inner / f"f{i}", "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
    subprocess.run(["mount", "-o", "remount,abort", str(host)], check=True)
    for i in range(2):
        with pytest.raises(OSError) as e:
            with open(inner / f"new{i}", "wb") as f:
                f.write(os.urandom(2 << 20))
                os.fsync(f.fileno())
        assert e.value.errno == 5
    assert inner.status()["device_error"], inner.status()
    drop_caches()
    for name, data in want.items():
        assert (inner / name).read_bytes() == data, name
    inner.umount()
    log = inner.daemon_log()
    assert "daemon failed" not in log and log.rstrip().splitlines()[-1].endswith(
        f"unmounted {inner.path}"), log[-1500:]
    outer.umount()
    subprocess.run(["umount", str(host)], check=True)
    subprocess.run(["e2fsck", "-fy", loop], capture_output=True)
    subprocess.run(["mount", loop, str(host)], check=True)
    outer.mount()
    inner.mount()
    for name, data in want.items():
        assert (inner / name).read_bytes() == data, name
    (inner / "after").write_bytes(b"x" * 5000)
    inner.remount()
    assert (inner / "after").read_bytes() == b"x" * 5000
    inner.umount()
    outer.umount()
