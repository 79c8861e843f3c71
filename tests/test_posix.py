"""DESIGN §9 through a real mount: every POSIX operation checkpoint frameworks rely on.

Each test mounts a fresh image with the real `mount.retainzfs` (see conftest.py) and uses real
programs (cp, dd) or plain Python file APIs against the mountpoint.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import random
import shutil
import stat
import subprocess
import threading
import time

import pytest
import xattr

from conftest import missing, on_host_and_mount, run
from retainzfs import hints as H

MiB = 1 << 20


def sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def rand_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def write_file(path, data: bytes, fsync=False) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------------------- data path

def test_sequential_large_writes_cp_dd(mounted, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(rand_bytes(48 * MiB + 12345, 1))
    run("cp", src, mounted / "copy.bin")
    assert sha(mounted / "copy.bin") == sha(src)
    run("dd", f"if={src}", f"of={mounted / 'dd.bin'}", "bs=1M", "status=none", "conv=fsync")
    assert sha(mounted / "dd.bin") == sha(src)
    # dd with odd block sizes (unaligned writes) still produces the same bytes
    run("dd", f"if={src}", f"of={mounted / 'dd_odd.bin'}", "bs=99999", "status=none")
    assert sha(mounted / "dd_odd.bin") == sha(src)
    assert os.stat(mounted / "dd.bin").st_size == src.stat().st_size
    mounted.remount()
    for name in ("copy.bin", "dd.bin", "dd_odd.bin"):
        assert sha(mounted / name) == sha(src), name


def test_overwrite_below_eof(mounted):
    p = mounted / "f"
    ref = bytearray(rand_bytes(10 * MiB, 2))
    write_file(p, bytes(ref))
    rng = random.Random(3)
    with open(p, "r+b") as f:
        for _ in range(40):
            off = rng.randrange(0, len(ref) - 70000)
            data = rng.randbytes(rng.randrange(1, 70000))
            f.seek(off)
            f.write(data)
            ref[off:off + len(data)] = data
            if rng.random() < 0.3:
                f.flush()
                assert os.pread(f.fileno(), len(data), off) == data
    assert p.read_bytes() == ref
    # dd conv=notrunc into the middle
    patch = rand_bytes(3 * MiB, 4)
    subprocess.run(["dd", f"of={p}", "bs=1M", "seek=2", "conv=notrunc", "status=none",
                    "iflag=fullblock"], input=patch, check=True)
    ref[2 * MiB:5 * MiB] = patch
    assert p.read_bytes() == ref
    mounted.remount()
    assert p.read_bytes() == ref
    # the superseded ranges are dead bytes, not live ones
    st = mounted.status()
    assert st["live_bytes"] == len(ref)


_FALLOC = ctypes.CDLL(None, use_errno=True).fallocate      # glibc's


def _fallocate(fd: int, mode: int, off: int, n: int) -> int:
    """fallocate(2) itself (os.posix_fallocate hides EOPNOTSUPP behind glibc's emulation)."""
    _FALLOC.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return 0 if _FALLOC(fd, mode, off, n) == 0 else ctypes.get_errno()


#: ``$1``: a directory.  Punches holes and zeroes ranges (block-aligned and not, across the
#: end, past it, over bytes still in a write buffer, over mmap'd pages) between writes, and
#: prints the file's size and checksum (read(2) and mmap) after each call, and each error
_PUNCH_PY = r"""
import ctypes, hashlib, mmap, os, random, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
KEEP, PUNCH, ZERO = 0x01, 0x02, 0x10
rnd = random.Random(7)
p = os.path.join(sys.argv[1], "f")
with open(p, "wb") as f:
    f.write(rnd.randbytes(600_000))
fd = os.open(p, os.O_RDWR)
def show(what):
    size = os.fstat(fd).st_size
    h = hashlib.sha256(os.pread(fd, size + 1, 0)).hexdigest()[:12]
    if size:
        with mmap.mmap(fd, size) as m:
            h += " " + hashlib.sha256(m[:]).hexdigest()[:12]
    print(what, size, h)
def fa(mode, off, n):
    r = libc.fallocate(fd, mode, off, n)
    show(f"{mode:#x} {off} {n} {'ok' if r == 0 else os.strerror(ctypes.get_errno())}")
for mode, off, n in [(PUNCH | KEEP, 0, 4096), (PUNCH | KEEP, 5000, 100),
                     (PUNCH | KEEP, 4095, 8194), (PUNCH | KEEP, 590_000, 50_000),
                     (PUNCH | KEEP, 700_000, 10), (ZERO, 100_000, 65536),
                     (ZERO | KEEP, 598_000, 20_000), (ZERO, 599_000, 20_000),
                     (ZERO, 700_000, 5), (PUNCH, 0, 10), (PUNCH | KEEP, -1, 10),
                     (PUNCH | KEEP, 0, 0)]:
    fa(mode, off, n)
for i in range(80):
    if i % 3 == 0:             # bytes still buffered in the daemon, then a hole over them
        os.pwrite(fd, rnd.randbytes(rnd.randrange(1, 40_000)), rnd.randrange(0, 800_000))
    if i % 7 == 0:             # pages dirtied through a mapping
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size) as m:
            at = rnd.randrange(0, size - 100)
            m[at:at + 100] = rnd.randbytes(100)
    if i % 11 == 0:
        os.ftruncate(fd, rnd.randrange(0, 900_000))
    mode = rnd.choice([PUNCH | KEEP, PUNCH | KEEP, ZERO, ZERO | KEEP])
    n = rnd.choice([1, 511, 4096, 4097, 65536, rnd.randrange(1, 200_000)])
    fa(mode, rnd.choice([0, 4096, rnd.randrange(0, 900_000)]), n)
ro = os.open(p, os.O_RDONLY)
print("read-only", libc.fallocate(ro, PUNCH | KEEP, 0, 10), os.strerror(ctypes.get_errno()))
"""


def test_punch_hole_and_zero_range_as_on_ext4(image):
    """fallocate PUNCH_HOLE and ZERO_RANGE (``fallocate -p/-z/-d``, databases and VM images
    handing space back; xfstests skips dozens of tests without them) were EOPNOTSUPP.  The
    same 92 calls on ext4 and on the mount give the same sizes, bytes (read and mmap) and
    errors; the same bytes after a remount."""
    on_host_and_mount(image, f"cd \"$1\"; python3 - . <<'EOF'\n{_PUNCH_PY}\nEOF\n",
                      remount_check="sha256sum $1/f")


def test_holes_survive_a_crash_and_hand_zones_back(make_image, mount_image):
    """A hole made durable by fsync is there after ``kill -9`` (a PUNCH record, replayed),
    its bytes count dead, and a zone whose data were all punched is reset as after an
    ``rm``; fsck is clean."""
    m = mount_image(make_image("256M", "4M"))
    data = rand_bytes(12 * MiB, 5)
    p = m / "f"
    write_file(p, data)
    before = m.status()
    fd = os.open(p, os.O_RDWR)
    try:
        t = os.fstat(fd).st_mtime_ns
        time.sleep(0.01)
        assert _fallocate(fd, 0x03, MiB, 8 * MiB) == 0
        assert os.fstat(fd).st_mtime_ns > t
        assert _fallocate(fd, 0x10, 10 * MiB + 3, 5) == 0
        assert _fallocate(fd, 0x10, 12 * MiB, MiB) == 0                # zero past the end: grows
        os.fsync(fd)
    finally:
        os.close(fd)
    want = data[:MiB] + bytes(8 * MiB) + data[9 * MiB:10 * MiB + 3] + bytes(5) \
        + data[10 * MiB + 8:] + bytes(MiB)
    assert p.read_bytes() == want
    st = m.status()
    assert st["live_bytes"] <= before["live_bytes"] - 8 * MiB + 4096, (before, st)
    assert st["zone_resets"] >= before["zone_resets"] + 1, (before, st)   # whole zones freed
    m.kill()
    m.mount()
    assert p.read_bytes() == want
    assert os.stat(p).st_blocks * 512 < 6 * MiB
    m.umount()
    assert "0 problems" in run("retainzfs", "fsck", m.img).stdout


def test_fallocate_extends_or_checks_space_and_refuses_the_rest(make_image, mount_image):
    """fallocate answered EOPNOTSUPP: ``fallocate -l`` failed, and glibc's posix_fallocate
    wrote a byte into every block itself (64 MiB in 2 s, 80 MiB of padding).  Now modes 0 and
    KEEP_SIZE check the unwritten bytes of the range against the free space and (mode 0) set
    the size; nothing is written and st_blocks stays what was written (a zoned log cannot set
    blocks aside, as OpenZFS's copy-on-write files cannot).  Collapsing and inserting ranges:
    EOPNOTSUPP (punching and zeroing: ``test_punch_hole_and_zero_range_*``)."""
    KEEP, PUNCH, COLLAPSE, INSERT = 0x01, 0x02, 0x08, 0x20
    m = mount_image(make_image("256M", "4M"))
    p = m / "f"
    data = rand_bytes(10_000, 3)
    write_file(p, data)
    fd = os.open(p, os.O_RDWR)
    try:
        before = m.status()["logical_bytes"]
        assert _fallocate(fd, 0, 4096, 4096) == 0                   # inside the data: no change
        assert os.fstat(fd).st_size == 10_000
        assert _fallocate(fd, KEEP, 0, 64 * MiB) == 0               # past EOF, size kept
        assert os.fstat(fd).st_size == 10_000
        assert _fallocate(fd, 0, 5000, 32 * MiB) == 0               # extends
        assert os.fstat(fd).st_size == 5000 + 32 * MiB
        assert os.fstat(fd).st_blocks * 512 < MiB                   # nothing was written
        assert _fallocate(fd, 0, 0, 1 << 30) == errno.ENOSPC        # more than the device
        assert _fallocate(fd, COLLAPSE, 0, 4096) == errno.EOPNOTSUPP
        assert _fallocate(fd, INSERT, 0, 4096) == errno.EOPNOTSUPP
        assert _fallocate(fd, PUNCH, 0, 4096) == errno.EOPNOTSUPP   # needs KEEP_SIZE (VFS)
        assert os.fstat(fd).st_size == 5000 + 32 * MiB
        # glibc's posix_fallocate uses the call, not its block-by-block emulation
        t = time.monotonic()
        os.posix_fallocate(fd, 0, 48 * MiB)
        assert time.monotonic() - t < 1.0 and os.fstat(fd).st_size == 48 * MiB
        assert m.status()["logical_bytes"] - before < MiB
        os.pwrite(fd, b"tail", 48 * MiB - 4)
    finally:
        os.close(fd)
    m.remount()
    with open(p, "rb") as f:
        got = f.read()
    assert len(got) == 48 * MiB and got[:10_000] == data and got[-4:] == b"tail"
    assert got[10_000:-4].count(0) == len(got) - 10_004
    m.umount()
    f = run("retainzfs", "fsck", m.img, check=False)
    assert f.returncode == 0 and " 0 problems" in f.stdout, f.stdout + f.stderr


def test_o_trunc(mounted):
    p = mounted / "t"
    write_file(p, rand_bytes(6 * MiB, 5))
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    assert os.fstat(fd).st_size == 0
    os.write(fd, b"short")
    os.close(fd)
    assert p.read_bytes() == b"short"
    # shell redirection truncates too
    run("sh", "-c", f"echo hello > '{p}'")
    assert p.read_bytes() == b"hello\n"
    mounted.remount()
    assert p.read_bytes() == b"hello\n"
    assert mounted.status()["live_bytes"] == 6


def test_ftruncate_extend_and_shrink(mounted):
    p = mounted / "tr"
    data = rand_bytes(5 * MiB + 100, 6)
    write_file(p, data)
    with open(p, "r+b") as f:
        os.ftruncate(f.fileno(), 8 * MiB)          # extend: a hole reading as zeros
        assert os.fstat(f.fileno()).st_size == 8 * MiB
        f.seek(0)
        got = f.read()
        assert got[:len(data)] == data and got[len(data):] == bytes(8 * MiB - len(data))
        os.ftruncate(f.fileno(), 1 * MiB + 7)      # shrink
        assert os.fstat(f.fileno()).st_size == MiB + 7
        os.ftruncate(f.fileno(), 3 * MiB)          # extend again: old bytes must not reappear
        f.seek(0)
        got = f.read()
    assert got == data[:MiB + 7] + bytes(3 * MiB - MiB - 7)
    # truncate while data are still buffered (written, not yet closed)
    with open(p, "r+b") as f:
        f.seek(3 * MiB)
        f.write(b"x" * 5000)
        f.flush()
        os.ftruncate(f.fileno(), 3 * MiB + 10)
        os.ftruncate(f.fileno(), 3 * MiB + 100)
        f.seek(3 * MiB)
        assert f.read() == b"x" * 10 + bytes(90)
    os.truncate(p, 0)
    os.truncate(p, 4096)
    assert p.read_bytes() == bytes(4096)
    mounted.remount()
    assert p.read_bytes() == bytes(4096)


def test_fsync(mounted):
    p = mounted / "synced"
    data = rand_bytes(3 * MiB + 17, 7)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.fdatasync(f.fileno())
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    dfd = os.open(mounted.path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)                                   # fsyncdir
    os.close(dfd)
    os.sync()                                       # syncfs path
    assert p.read_bytes() == data + data
    assert mounted.status()["commits"] >= 1
    mounted.remount()
    assert p.read_bytes() == data + data


# ---------------------------------------------------------------------------- namespace

def test_rename_over_existing_file(mounted):
    a, b = mounted / "a", mounted / "b"
    write_file(a, rand_bytes(2 * MiB, 8))
    write_file(b, rand_bytes(3 * MiB, 9))
    ino_a = os.stat(a).st_ino
    live0 = mounted.status()["live_bytes"]
    os.replace(a, b)
    assert not a.exists()
    assert os.stat(b).st_ino == ino_a
    assert b.read_bytes() == rand_bytes(2 * MiB, 8)
    assert mounted.status()["live_bytes"] == live0 - 3 * MiB     # the victim's data died
    # the classic atomic-save pattern: write tmp, fsync, rename over
    for i in range(5):
        tmp = mounted / "ckpt.tmp"
        write_file(tmp, f"gen{i}".encode() * 1000, fsync=True)
        os.rename(tmp, mounted / "ckpt")
    assert (mounted / "ckpt").read_bytes() == b"gen4" * 1000
    # rename over an open file: the open fd still reads the old contents
    write_file(mounted / "x", b"old" * 100)
    with open(mounted / "x", "rb") as f:
        write_file(mounted / "y", b"new" * 100)
        os.replace(mounted / "y", mounted / "x")
        assert f.read() == b"old" * 100
    assert (mounted / "x").read_bytes() == b"new" * 100
    mounted.remount()
    assert (mounted / "b").read_bytes() == rand_bytes(2 * MiB, 8)
    assert (mounted / "ckpt").read_bytes() == b"gen4" * 1000
    assert sorted(os.listdir(mounted.path)) == ["b", "ckpt", "x"]


def test_directory_rename(mounted):
    d = mounted / "step-1"
    (d / "sub").mkdir(parents=True)
    write_file(d / "sub" / "shard0", rand_bytes(MiB, 10))
    write_file(d / "meta", b"m")
    (mounted / "old").mkdir()
    os.rename(d, mounted / "old" / "step-1-final")
    assert not d.exists()
    nd = mounted / "old" / "step-1-final"
    assert (nd / "sub" / "shard0").read_bytes() == rand_bytes(MiB, 10)
    assert os.stat(mounted / "old").st_nlink == 3
    assert os.stat(mounted.path).st_nlink == 3
    # rename over an empty directory works, over a non-empty one is ENOTEMPTY
    (mounted / "empty").mkdir()
    os.rename(mounted / "old", mounted / "empty")
    (mounted / "full").mkdir()
    (mounted / "full" / "f").write_bytes(b"1")
    (mounted / "d2").mkdir()
    with pytest.raises(OSError) as ei:
        os.rename(mounted / "d2", mounted / "full")
    assert ei.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    with pytest.raises(OSError) as ei:
        os.rename(mounted / "empty", mounted / "empty" / "step-1-final" / "inside")
    assert ei.value.errno == errno.EINVAL
    mounted.remount()
    assert (mounted / "empty" / "step-1-final" / "sub" / "shard0").read_bytes() == rand_bytes(MiB, 10)
    assert (mounted / "empty" / "step-1-final" / "meta").read_bytes() == b"m"
    assert sorted(os.listdir(mounted.path)) == ["d2", "empty", "full"]


def test_unlink_rmdir_rmtree_beside_writers(mounted):
    """Deleting old generations while the trainer writes new ones (threads)."""
    errors: list[BaseException] = []
    stop = threading.Event()
    written: dict[str, bytes] = {}

    def writer(wid: int) -> None:
        try:
            for g in range(12):
                d = mounted / f"w{wid}" / f"step-{g}"
                d.mkdir(parents=True)
                for s in range(3):
                    data = rand_bytes(300_000 + s * 7777, wid * 1000 + g * 10 + s)
                    write_file(d / f"shard{s}", data, fsync=(s == 0))
                    written[str(d / f"shard{s}")] = data
                if g >= 3:      # keep the latest 3: rm -r the oldest, beside the other writer
                    shutil.rmtree(mounted / f"w{wid}" / f"step-{g - 3}")
        except BaseException as e:     # noqa: BLE001
            errors.append(e)

    def deleter() -> None:
        try:
            while not stop.is_set():
                for name in os.listdir(mounted.path):
                    if name.startswith("tmp"):
                        p = mounted / name
                        for f in os.listdir(p):
                            os.unlink(p / f)
                        os.rmdir(p)
                d = mounted / f"tmp{time.monotonic_ns()}"
                d.mkdir()
                for i in range(5):
                    write_file(d / f"f{i}", b"z" * 50_000)
        except BaseException as e:     # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    dt = threading.Thread(target=deleter)
    for t in threads:
        t.start()
    dt.start()
    for t in threads:
        t.join(120)
    stop.set()
    dt.join(60)
    assert not errors, errors
    for wid in range(3):
        assert sorted(os.listdir(mounted / f"w{wid}")) == ["step-10", "step-11", "step-9"]
        for g in (9, 10, 11):
            for s in range(3):
                p = mounted / f"w{wid}" / f"step-{g}" / f"shard{s}"
                assert p.read_bytes() == written[str(p)]
    # rmtree of a directory while a writer keeps an open file in it
    d = mounted / "busy"
    d.mkdir()
    f = open(d / "open", "wb")
    f.write(b"a" * 100_000)
    shutil.rmtree(d)
    f.write(b"b" * 100_000)
    f.close()
    assert not d.exists()
    # RELEASE is sent asynchronously after close(2): wait until the unlinked file is freed
    deadline = time.monotonic() + 10
    st = mounted.status()
    while st["files"] != sum(len(fs) for _, _, fs in os.walk(mounted.path)) and time.monotonic() < deadline:
        time.sleep(0.05)
        st = mounted.status()
    mounted.remount()
    st2 = mounted.status()
    assert st2["live_bytes"] == st["live_bytes"]
    assert st2["files"] == st["files"]


def test_unlinked_but_open_file_readable_until_close(mounted):
    p = mounted / "doomed"
    data = rand_bytes(6 * MiB, 11)
    write_file(p, data)
    live_before = mounted.status()["live_bytes"]
    f = open(p, "rb")
    os.unlink(p)
    assert not p.exists()
    assert f.read() == data                         # readable after unlink
    assert os.fstat(f.fileno()).st_nlink == 0
    assert mounted.status()["live_bytes"] == live_before   # not freed while open
    # writable too (an unlinked scratch file)
    g = open(mounted / "scratch", "w+b")
    os.unlink(mounted / "scratch")
    g.write(data[:MiB])
    g.flush()
    g.seek(0)
    assert g.read() == data[:MiB]
    g.close()
    f.seek(MiB)
    assert f.read(10) == data[MiB:MiB + 10]
    f.close()
    assert wait_live(mounted, 0), mounted.status()["live_bytes"]
    mounted.remount()
    assert os.listdir(mounted.path) == []
    assert mounted.status()["live_bytes"] == 0


def wait_live(m, value, timeout=5.0) -> bool:
    """release is asynchronous (close returns before the daemon frees): poll status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m.status()["live_bytes"] == value:
            return True
        time.sleep(0.05)
    return False


def test_symlink_readlink(mounted):
    write_file(mounted / "target", b"T" * 10)
    os.symlink("target", mounted / "link")
    os.symlink("/nonexistent/dangling", mounted / "dangling")
    (mounted / "d").mkdir()
    os.symlink("../target", mounted / "d" / "up")
    assert os.readlink(mounted / "link") == "target"
    assert (mounted / "link").read_bytes() == b"T" * 10
    assert (mounted / "d" / "up").read_bytes() == b"T" * 10
    assert os.lstat(mounted / "link").st_size == len("target")
    assert stat.S_ISLNK(os.lstat(mounted / "dangling").st_mode)
    assert not (mounted / "dangling").exists()
    with pytest.raises(OSError) as ei:
        os.readlink(mounted / "target")
    assert ei.value.errno == errno.EINVAL
    long_target = "x/" * 1000 + "y"
    os.symlink(long_target, mounted / "long")
    mounted.remount()
    assert os.readlink(mounted / "link") == "target"
    assert os.readlink(mounted / "dangling") == "/nonexistent/dangling"
    assert os.readlink(mounted / "long") == long_target
    os.unlink(mounted / "link")
    assert (mounted / "target").exists()


SGID_SESSION = r"""
cd "$1"
mkdir team; chgrp 1000 team; chmod 2777 team
touch team/root-file; mkdir team/root-dir; mkdir -m 700 team/private; mkfifo team/fifo
ln -s root-file team/link; mkdir team/root-dir/deeper
$N sh -c 'umask 022; touch team/nobody-file; mkdir team/nobody-dir; chmod 2755 team/nobody-file'
mkdir plain; chgrp 1000 plain; touch plain/f; mkdir plain/d
stat -c "%A %u %g %n" team team/* team/root-dir/deeper plain plain/*
"""


def test_a_set_group_id_directory_gives_its_group_as_on_ext4(image):
    """A team's shared directory (``chgrp team; chmod g+s``): what anyone makes in it takes
    the directory's group, and a new directory its set-group-ID bit too; a file of that
    group whose owner is not in it cannot be made set-group-ID.  The same session on the
    host's file system (ext4 here) and on the mount, the same ``stat`` lines, and again
    after a remount.  Files took their maker's group before (``-rw-r--r-- 0 team/f``)."""
    got = on_host_and_mount(image, SGID_SESSION, 'cd "$1" && stat -c "%A %u %g %n" team '
                             'team/* team/root-dir/deeper plain plain/*')
    assert "drwxr-sr-x 0 1000 team/root-dir" in got
    assert "-rwxr-xr-x 65534 1000 team/nobody-file" in got    # (2755: the S_ISGID dropped)


PRIVILEGE_SESSION = r"""
cd "$1"
r() { "$@" >/dev/null 2>&1; echo "rc=$? $*"; }
# set-ID bits a change by someone other than root takes away (kernel: write, truncate,
# chown; the daemon: O_TRUNC, done in its open).  Not here: set-group-ID without group
# execute, which ext4 takes from a writer outside the group and the kernel's FUSE keeps.
for m in 4755 6755 4700 2775; do
  f=kp$m; echo x > $f; chown 65534:1000 $f; chmod $m $f
  $N sh -c "echo y >> $f"; stat -c "%a %n write" $f
  chmod $m $f; $N truncate -s 1 $f; stat -c "%a %n truncate" $f
  chmod $m $f; $N sh -c ": > $f"; stat -c "%a %n o_trunc" $f
  chmod $m $f; : > $f; stat -c "%a %n o_trunc-by-root" $f
  chmod $m $f; chown 65534:1001 $f; stat -c "%a %n chgrp-by-root" $f
  chmod $m $f; chown 0 $f; stat -c "%a %n chown-by-root" $f
done
echo x > kw; chown 65534 kw; chmod 4777 kw
$N python3 -c "import os; fd = os.open('kw', os.O_RDWR); os.pwrite(fd, b'zz', 0)"
stat -c "%a %n pwrite" kw; chmod 4777 kw
$N python3 -c "
import mmap, os
fd = os.open('kw', os.O_RDWR); m = mmap.mmap(fd, 1); m[0:1] = b'q'; m.flush()"
stat -c "%a %n mmap" kw; chmod 4777 kw
$N fallocate -l 8192 kw; stat -c "%a %s %n fallocate" kw
# a sticky directory: only owners remove or replace
mkdir st; chmod 1777 st; touch st/rootf; $N touch st/nf
r $N rm -f st/rootf; r $N mv st/nf st/rootf; r $N rm st/nf; ls st
# link counts
mkdir -p n/a/b n/c; mv n/a/b n/c/; stat -c "%h %n" n n/a n/c n/c/b; rmdir n/c/b; stat -c "%h %n" n/c
echo h > h1; ln h1 h2; ln h2 h3; rm h1; stat -c "%h %n" h2
# renames that must fail
mkdir e1 e2; touch e2/x; r mv -T e1 e2
r python3 -c "import os; os.rename('h2', 'e1')"; r python3 -c "import os; os.rename('e1', 'h2')"
# who may chmod, chgrp and set times
touch u; chmod 666 u; r $N chmod 777 u; r $N touch -d 2001-01-01 u; r $N touch u
mkdir w; chmod 777 w; touch w/r; r $N rm -f w/r; $N touch w/mine
r $N chgrp 1000 w/mine; $N ln -s target w/nl
stat -c "%a %u %g %n" u w/mine; stat -c "%u %g %A %n" w/nl
r mknod cdev c 1 3; stat -c "%A %t %T %n" cdev
r setfattr -h -n user.a -v 1 w/nl; mkfifo ff; r setfattr -n user.a -v 1 ff
"""


def test_who_may_change_what_and_the_set_id_bits_answer_as_on_ext4(image):
    """Ownership and mode rules, run as root and as ``nobody`` on the host's ext4 and on the
    mount, the same output line for line: set-user-ID (and set-group-ID with group execute)
    taken away by another user's write, truncate, O_TRUNC, pwrite, mmap write, fallocate
    and by root's chown; a sticky directory; link counts; renames that must fail; who may
    chmod, chgrp and set times.  ``: > f`` by a user kept a setuid file setuid: the daemon
    does O_TRUNC in its open (FUSE_ATOMIC_O_TRUNC), where the kernel's truncate would have
    taken the bit."""
    got = on_host_and_mount(image, PRIVILEGE_SESSION)
    assert "755 kp4755 o_trunc\n" in got and "4755 kp4755 o_trunc-by-root\n" in got


TIMES_SESSION = r"""
import os, sys, time
os.chdir(sys.argv[1])
def st(p):
    try:
        s = os.lstat(p); return (s.st_mtime_ns, s.st_ctime_ns)
    except FileNotFoundError:
        return None
def chk(label, fn, paths):
    before = {p: st(p) for p in paths}
    time.sleep(0.02)
    try:
        fn(); r = "ok"
    except OSError as e:
        r = e.strerror
    out = []
    for p in paths:
        a, b = before[p], st(p)
        if a is None or b is None:
            out.append(f"{p}:-"); continue
        out.append(f"{p}:{'m' if a[0]!=b[0] else '.'}{'c' if a[1]!=b[1] else '.'}")
    print(f"{label:28s} {r:4s} " + " ".join(out))
os.mkdir("d"); os.mkdir("d2")
open("d/f", "wb").write(b"12345")
chk("create", lambda: open("d/g", "wb").close(), ["d", "d/f"])
chk("write", lambda: open("d/f", "ab").write(b"x"), ["d", "d/f"])
chk("write 0 bytes", lambda: open("d/f", "ab").write(b""), ["d/f"])
chk("o_trunc empty file", lambda: open("d/g", "wb").close(), ["d/g"])
chk("o_trunc nonempty", lambda: open("d/f", "wb").close(), ["d/f"])
open("d/f", "wb").write(b"12345")
chk("truncate same size", lambda: os.truncate("d/f", 5), ["d/f"])
chk("truncate grow", lambda: os.truncate("d/f", 9), ["d/f"])
chk("ftruncate same", lambda: os.ftruncate(os.open("d/f", os.O_WRONLY), 9), ["d/f"])
chk("chmod", lambda: os.chmod("d/f", 0o600), ["d", "d/f"])
chk("chmod same", lambda: os.chmod("d/f", 0o600), ["d/f"])
chk("chown same", lambda: os.chown("d/f", 0, 0), ["d/f"])
chk("chown -1 -1", lambda: os.chown("d/f", -1, -1), ["d/f"])
chk("setxattr", lambda: os.setxattr("d/f", "user.a", b"1"), ["d", "d/f"])
chk("removexattr", lambda: os.removexattr("d/f", "user.a"), ["d/f"])
chk("link", lambda: os.link("d/f", "d2/l"), ["d", "d2", "d/f"])
chk("unlink one of two", lambda: os.unlink("d2/l"), ["d2", "d/f"])
chk("rename in dir", lambda: os.rename("d/f", "d/f2"), ["d", "d/f2"])
chk("rename across", lambda: os.rename("d/f2", "d2/f"), ["d", "d2", "d2/f"])
open("d/v", "wb").write(b"v")
chk("rename over", lambda: os.rename("d2/f", "d/v"), ["d", "d2", "d/v"])
chk("rename to itself", lambda: os.rename("d/v", "d/v"), ["d", "d/v"])
os.mkdir("d/sub")
chk("rename dir across", lambda: os.rename("d/sub", "d2/sub"), ["d", "d2", "d2/sub"])
chk("mkdir", lambda: os.mkdir("d/m"), ["d"])
chk("rmdir", lambda: os.rmdir("d/m"), ["d"])
chk("symlink", lambda: os.symlink("x", "d/s"), ["d"])
chk("utime now", lambda: os.utime("d/v"), ["d/v"])
chk("utime set", lambda: os.utime("d/v", (1, 2)), ["d/v"])
chk("read", lambda: open("d/v", "rb").read(), ["d/v"])
chk("readdir", lambda: os.listdir("d"), ["d"])
chk("fallocate keep size", lambda: os.posix_fallocate(os.open("d/v", os.O_RDWR), 0, 8192), ["d/v"])
chk("mknod fifo", lambda: os.mkfifo("d/p"), ["d"])
chk("unlink", lambda: os.unlink("d/p"), ["d"])
chk("rename exchange-none", lambda: os.rename("d/s", "d/s2"), ["d"])
fd = os.open("d/v", os.O_RDWR)
chk("pwrite", lambda: os.pwrite(fd, b"z", 0), ["d/v"])
chk("fsync", lambda: os.fsync(fd), ["d/v"])
os.close(fd)
"""


ERRORS_SESSION = r"""
import errno, os, sys
os.chdir(sys.argv[1])
def t(label, fn):
    try:
        r = fn(); out = "ok" if r is None or isinstance(r, int) else f"ok {r!r}"[:40]
    except OSError as e:
        out = errno.errorcode.get(e.errno, str(e.errno))
    print(f"{label:34s} {out}")
os.mkdir("d"); os.mkdir("d/sub"); open("d/f", "wb").write(b"abc"); os.symlink("f", "d/l")
os.symlink("loop2", "d/loop1"); os.symlink("loop1", "d/loop2"); os.mkdir("e")
t("rmdir nonempty", lambda: os.rmdir("d"))
t("rmdir file", lambda: os.rmdir("d/f"))
t("rmdir dot", lambda: os.rmdir("d/sub/."))
t("rmdir symlink", lambda: os.rmdir("d/l"))
t("unlink dir", lambda: os.unlink("d/sub"))
t("mkdir existing", lambda: os.mkdir("d/f"))
t("mkdir under file", lambda: os.mkdir("d/f/x"))
t("open under file", lambda: open("d/f/x"))
t("open dir for write", lambda: os.open("d", os.O_WRONLY))
t("open O_DIRECTORY file", lambda: os.open("d/f", os.O_RDONLY | os.O_DIRECTORY))
t("open O_EXCL existing", lambda: os.open("d/f", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
t("open O_EXCL symlink", lambda: os.open("d/l", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
t("open O_NOFOLLOW symlink", lambda: os.open("d/l", os.O_RDONLY | os.O_NOFOLLOW))
t("open loop", lambda: open("d/loop1"))
t("open dangling creat", lambda: os.close(os.open("d/dang", os.O_CREAT | os.O_WRONLY)))
os.symlink("nowhere/x", "d/dang2")
t("open dangling dir creat", lambda: os.open("d/dang2", os.O_CREAT | os.O_WRONLY))
t("link to dir", lambda: os.link("d/sub", "d/sub2"))
t("link existing", lambda: os.link("d/f", "d/l"))
t("link to symlink", lambda: os.link("d/l", "d/l2", follow_symlinks=False))
t("readlink file", lambda: os.readlink("d/f"))
t("truncate dir", lambda: os.truncate("d", 0))
t("truncate negative", lambda: os.truncate("d/f", -1))
t("rename dir over file", lambda: os.rename("d/sub", "d/f"))
t("rename file over dir", lambda: os.rename("d/f", "d/sub"))
t("rename dir over nonempty", lambda: os.rename("e", "d"))
t("rename dir into self", lambda: os.rename("d", "d/sub/x"))
t("rename missing", lambda: os.rename("d/zz", "d/yy"))
t("rename dot", lambda: os.rename("d/sub/.", "d/q"))
t("rename over dotdot", lambda: os.rename("e", "d/sub/.."))
t("rename file to itself (link)", lambda: os.rename("d/f", "d/f"))
os.link("d/f", "d/hard")
t("rename hardlink over twin", lambda: os.rename("d/f", "d/hard"))
t("listdir after", lambda: sorted(os.listdir("d")))
t("mknod regular", lambda: os.mknod("d/reg", 0o644))
t("mknod existing", lambda: os.mknod("d/reg", 0o644))
t("symlink existing", lambda: os.symlink("x", "d/reg"))
t("symlink empty target", lambda: os.symlink("", "d/empty"))
t("chdir file", lambda: os.chdir("d/f"))
t("utime missing", lambda: os.utime("d/nope"))
t("xattr missing get", lambda: os.getxattr("d/f", "user.none"))
t("xattr create twice", lambda: (os.setxattr("d/f", "user.a", b"1", os.XATTR_CREATE), os.setxattr("d/f", "user.a", b"1", os.XATTR_CREATE)))
t("xattr replace missing", lambda: os.setxattr("d/f", "user.b", b"1", os.XATTR_REPLACE))
t("xattr remove missing", lambda: os.removexattr("d/f", "user.zz"))
t("xattr name 256", lambda: os.setxattr("d/f", "user." + "n" * 251, b"1"))
t("xattr empty value", lambda: (os.setxattr("d/f", "user.e", b""), os.getxattr("d/f", "user.e")))
t("lseek data beyond", lambda: os.lseek(os.open("d/f", os.O_RDONLY), 100, os.SEEK_DATA))
t("lseek hole", lambda: os.lseek(os.open("d/f", os.O_RDONLY), 0, os.SEEK_HOLE))
t("pread beyond eof", lambda: os.pread(os.open("d/f", os.O_RDONLY), 10, 100))
t("write to O_RDONLY", lambda: os.write(os.open("d/f", os.O_RDONLY), b"x"))
t("read from O_WRONLY", lambda: os.read(os.open("d/f", os.O_WRONLY), 1))
t("write to dir fd", lambda: os.write(os.open("d", os.O_RDONLY), b"x"))
t("read dir fd", lambda: os.read(os.open("d", os.O_RDONLY), 1))
t("fallocate negative", lambda: os.posix_fallocate(os.open("d/f", os.O_RDWR), 0, -1))
t("rmdir root-ish dotdot", lambda: os.rmdir("d/sub/.."))
"""


@pytest.mark.parametrize("session,lines", [(TIMES_SESSION, 34), (ERRORS_SESSION, 53)],
                         ids=["times", "errors"])
def test_calls_answer_as_on_ext4(tmp_path, mounted, session, lines):
    """The same calls on the host's ext4 and on the mount, the same output line for line.
    times: 34 calls (creates, writes, truncates to the same and other sizes, O_TRUNC, chmod,
    chown, xattrs, links, renames, utime, fallocate, ...), each printing whether it changed
    the modification and change times of the file and of the directories involved; two
    differed: O_TRUNC of an empty file and truncate() to the size a file already has
    changed no mtime (the kernel sends a truncate's size alone; ext4 sets both times at any
    size change).  errors: 53 calls that must fail (or must not) and the errno each gives
    (rmdir, unlink, mkdir, open flags, symlink loops, links, renames onto and into
    themselves, readlink, truncate, xattr flags and bounds, SEEK_DATA/HOLE, descriptors'
    modes); these agreed already."""
    script = tmp_path / "session.py"
    script.write_text(session)
    host = tmp_path / "host"
    host.mkdir()
    want = run("python3", script, host).stdout
    got = run("python3", script, mounted.path).stdout
    assert got == want
    assert len(got.splitlines()) == lines


def test_chmod_utime(mounted):
    p = mounted / "f"
    write_file(p, b"x")
    os.chmod(p, 0o600)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert stat.S_ISREG(os.stat(p).st_mode)
    os.chmod(p, 0o4755)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o4755
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    (mounted / "d").mkdir()
    os.chmod(mounted / "d", 0o700)
    os.utime(mounted / "d", (12345, 67890))
    run("touch", "-d", "2001-02-03 04:05:06 UTC", mounted / "touched")
    before = time.time_ns()
    os.utime(p)                                     # "now"
    assert os.stat(p).st_mtime_ns >= before - 2_000_000_000
    mtime = os.stat(p).st_mtime_ns
    os.chown(p, 1234, 5678)
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 5678)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o755              # chown clears set-uid
    mounted.remount()
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o755
    assert st.st_mtime_ns == mtime
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert stat.S_IMODE(os.stat(mounted / "d").st_mode) == 0o700
    assert os.stat(mounted / "d").st_mtime == 67890
    assert os.stat(mounted / "touched").st_mtime == 981173106


I64 = (1 << 63) - 1


@pytest.mark.parametrize("sec,nsec,want", [
    (-1, 123_456_789, -876_543_211),                              # just before 1970
    (-(1 << 31), 5, -(1 << 31) * 10**9 + 5),                      # 1901, ext4's floor
    (1 << 33, 999_999_999, (1 << 33) * 10**9 + 999_999_999),      # 2242
    (9_223_372_035, 999_999_999, 9_223_372_035_999_999_999),      # the last whole second kept
    (9_223_372_036, 0, I64),                                      # 2262: clamped, not wrapped
    (253_402_300_799, 0, I64),                                    # 9999-12-31
    (-9_223_372_036, 0, -9_223_372_036 * 10**9),                  # 1677
    (-9_223_372_037, 0, -I64 - 1),
    (-(1 << 40), 1, -I64 - 1),                                    # 34,000 years ago
])
def test_times_outside_what_is_kept_are_clamped_not_wrapped(mounted, sec, nsec, want):
    """The record keeps int64 nanoseconds; `touch -d 9999-12-31` once came back as 1816."""
    p = mounted / "f"
    write_file(p, b"x")
    os.utime(p, ns=(sec * 10**9 + nsec, sec * 10**9 + nsec))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (want, want)
    assert (st.st_mtime_ns >= 0) == (sec >= 0)
    mounted.remount()
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (want, want)


def test_names_are_bytes_not_text(mounted):
    """Names are any bytes but '/' and NUL (an archive from another locale), kept as given."""
    root = os.fsencode(str(mounted))
    names = [b"\xff\xfe\x80latin1-\xe9", b"a\nb\tc", b"\xed\xa0\x80", b"-" * 255]
    for i, n in enumerate(names):
        with open(root + b"/" + n, "wb") as f:
            f.write(n * (i + 1))
    os.mkdir(root + b"/\xc3\x28dir")
    os.rename(root + b"/" + names[0], root + b"/\xc3\x28dir/\xa0")
    mounted.remount()
    assert sorted(os.listdir(root)) == sorted(names[1:] + [b"\xc3\x28dir"])
    assert open(root + b"/\xc3\x28dir/\xa0", "rb").read() == names[0]
    for i, n in enumerate(names[1:], 1):
        assert open(root + b"/" + n, "rb").read() == n * (i + 1)
    with pytest.raises(OSError) as ei:
        open(root + b"/" + b"x" * 256, "wb")
    assert ei.value.errno == errno.ENAMETOOLONG


def test_stable_st_ino(mounted):
    names = ["a", "b", "d", "d/e", "d/f"]
    (mounted / "d").mkdir()
    for n in names:
        if n != "d":
            write_file(mounted / n, n.encode())
    os.symlink("a", mounted / "s")
    names.append("s")
    inos = {n: os.lstat(mounted / n).st_ino for n in names}
    assert len(set(inos.values())) == len(names)
    assert os.stat(mounted.path).st_ino == 1
    # survives rename and re-lookup
    os.rename(mounted / "b", mounted / "d" / "b2")
    assert os.stat(mounted / "d" / "b2").st_ino == inos["b"]
    inos["d/b2"] = inos.pop("b")
    # readdir reports the same numbers as stat
    for e in os.scandir(mounted / "d"):
        assert e.inode() == inos[f"d/{e.name}"]
    mounted.remount()
    for n, ino in inos.items():
        assert os.lstat(mounted / n).st_ino == ino, n
    # new inodes never reuse a number of a live one
    write_file(mounted / "new", b"n")
    assert os.stat(mounted / "new").st_ino not in inos.values()


def test_directory_mtime_changes_on_add_remove(mounted):
    d = mounted / "dir"
    d.mkdir()
    os.utime(d, ns=(0, 0))
    t0 = os.stat(d).st_mtime_ns
    write_file(d / "f", b"1")
    t1 = os.stat(d).st_mtime_ns
    assert t1 > t0
    os.utime(d, ns=(0, 0))
    os.unlink(d / "f")
    assert os.stat(d).st_mtime_ns > 0
    os.utime(d, ns=(0, 0))
    (d / "sub").mkdir()
    assert os.stat(d).st_mtime_ns > 0
    os.utime(d, ns=(0, 0))
    os.rmdir(d / "sub")
    assert os.stat(d).st_mtime_ns > 0
    os.utime(d, ns=(0, 0))
    write_file(mounted / "outside", b"o")
    os.rename(mounted / "outside", d / "inside")
    assert os.stat(d).st_mtime_ns > 0
    os.utime(d, ns=(0, 0))
    os.symlink("x", d / "l")
    assert os.stat(d).st_mtime_ns > 0
    os.utime(d, ns=(0, 0))
    os.link(d / "inside", d / "hard")
    assert os.stat(d).st_mtime_ns > 0
    # ctime follows too; after remount the latest mtime is kept
    t = os.stat(d).st_mtime_ns
    mounted.remount()
    assert os.stat(d).st_mtime_ns == t


# ---------------------------------------------------------------------------- readdir

def test_readdir_scandir_while_adding(mounted):
    d = mounted / "big"
    d.mkdir()
    base = {f"f{i:05d}" for i in range(600)}
    for n in base:
        (d / n).touch()
    seen = []
    added = set()
    with os.scandir(d) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i % 10 == 0:         # add entries while the listing is in progress
                n = f"new{i:05d}"
                (d / n).touch()
                added.add(n)
    assert len(seen) == len(set(seen)), "an entry was returned twice"
    assert base <= set(seen), "an existing entry was skipped"
    assert set(seen) <= base | added
    assert set(os.listdir(d)) == base | added
    # removing entries during a listing never skips or repeats survivors
    seen = []
    removed = set()
    with os.scandir(d) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i % 7 == 0:
                victim = sorted(base - set(seen) - removed)[-1:]
                for v in victim:
                    os.unlink(d / v)
                    removed.add(v)
    assert len(seen) == len(set(seen))
    assert (base | added) - removed <= set(seen)
    # (entries removed mid-listing may or may not appear: POSIX leaves it unspecified)
    assert not removed & set(os.listdir(d))


class _Dirent(ctypes.Structure):
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64),
                ("d_reclen", ctypes.c_ushort), ("d_type", ctypes.c_ubyte),
                ("d_name", ctypes.c_char * 256)]


def test_readdir_telldir_seekdir(mounted):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = [ctypes.c_char_p]
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = [ctypes.c_void_p]
    libc.telldir.restype = ctypes.c_long
    libc.telldir.argtypes = [ctypes.c_void_p]
    libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
    libc.closedir.argtypes = [ctypes.c_void_p]
    libc.rewinddir.argtypes = [ctypes.c_void_p]

    d = mounted / "dir"
    d.mkdir()
    names = [f"entry-{i:04d}-" + "x" * 40 for i in range(1500)]   # several getdents batches
    for n in names:
        (d / n).touch()

    def read_rest(dirp) -> list[str]:
        out = []
        while True:
            ent = libc.readdir(dirp)
            if not ent:
                return out
            out.append(ent.contents.d_name.decode())

    dirp = libc.opendir(str(d).encode())
    assert dirp
    first = []
    positions = {}
    for _ in range(700):
        pos = libc.telldir(dirp)
        ent = libc.readdir(dirp)
        name = ent.contents.d_name.decode()
        positions[name] = pos
        first.append(name)
    mid = libc.telldir(dirp)
    rest = read_rest(dirp)
    all_names = first + rest
    assert sorted(n for n in all_names if n not in (".", "..")) == sorted(names)
    # seekdir back to the middle: the same tail again
    libc.seekdir(dirp, mid)
    assert read_rest(dirp) == rest
    # seekdir to any remembered position reproduces the listing from there
    for name in (first[3], first[400], first[699]):
        libc.seekdir(dirp, positions[name])
        again = read_rest(dirp)
        assert again == all_names[all_names.index(name):]
    # entries created/removed after telldir do not disturb the offsets of the others
    os.unlink(d / rest[0])
    (d / "zz-late").touch()
    libc.seekdir(dirp, mid)
    again = read_rest(dirp)
    assert again[:len(rest) - 1] == rest[1:]
    libc.rewinddir(dirp)
    assert len(read_rest(dirp)) == len(names) + 2      # -1 removed, +1 added, + . and ..
    libc.closedir(dirp)
    # stable across remount too: offsets are cookies, not positions
    mounted.remount()
    dirp = libc.opendir(str(d).encode())
    libc.seekdir(dirp, positions[first[400]])
    after = read_rest(dirp)
    libc.closedir(dirp)
    assert after[0] == first[400]


def test_renaming_each_entry_away_and_back_while_reading_ends(mounted):
    """xfstests' generic/736 (the bug btrfs fixed in 9b378f6ad48c): a program renaming each
    entry it reads to a temporary name and back never finished: each name came back with a
    new cookie, after the reader's position.  A stream now lists the entries the directory
    had when it was opened (or rewound), each once, as ext4 does here (5,002 with . and ..);
    what is added meanwhile is listed after a rewind."""
    d = mounted / "dir"
    d.mkdir()
    for i in range(1, 3001):
        (d / str(i)).touch()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = []
        with os.scandir(fd) as it:
            for e in it:
                seen.append(e.name)
                assert len(seen) <= 9000, "the listing does not end"
                os.rename(e.name, "TEMPFILE", src_dir_fd=fd, dst_dir_fd=fd)
                os.rename("TEMPFILE", e.name, src_dir_fd=fd, dst_dir_fd=fd)
        assert sorted(seen, key=int) == [str(i) for i in range(1, 3001)]
    finally:
        os.close(fd)
    (d / "new").touch()
    assert len(os.listdir(d)) == 3001                   # a new stream sees everything


# ---------------------------------------------------------------------------- reads, mmap

def test_concurrent_random_offset_reads(mounted):
    data = rand_bytes(24 * MiB, 12)
    p = mounted / "r"
    write_file(p, data)
    errors = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                for _ in range(150):
                    off = rng.randrange(0, len(data))
                    n = rng.choice([1, 4096, 65536, 1 << 20, rng.randrange(1, 3 * MiB)])
                    got = os.pread(fd, n, off)
                    if got != data[off:off + n]:
                        errors.append((seed, off, n))
                        return
            finally:
                os.close(fd)
        except BaseException as e:     # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]


@pytest.mark.parametrize("seed", [1, 2])
def test_threads_writing_one_file_in_random_order_while_others_read_it(mounted, seed):
    """Four threads pwrite disjoint pieces (1 byte to a few hundred KiB, 48 MiB in all) of one
    file through one descriptor in random order, fsyncing now and then, while two readers
    check random pieces already written: every read sees the bytes written, and the file is
    whole after close and after a remount.  fsx runs one process; nothing else wrote one file
    from several threads at offsets out of order (buffer breaks, overlays of buffered bytes
    on stored ones, flushes racing reads)."""
    rng = random.Random(seed)
    size = 48 * MiB
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(3000))})
    pieces = list(zip(cuts, cuts[1:]))
    rng.shuffle(pieces)
    data = rng.randbytes(size)
    p = mounted / "shared"
    written: list[list] = [[] for _ in range(4)]
    errors: list = []
    stop = threading.Event()
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)

    def writer(k: int) -> None:
        r = random.Random(seed * 10 + k)
        try:
            for a, b in pieces[k::4]:
                assert os.pwrite(fd, data[a:b], a) == b - a
                written[k].append((a, b))
                if r.random() < 0.01:
                    os.fsync(fd)
        except BaseException as e:     # noqa: BLE001
            errors.append(("write", k, e))

    def reader(k: int) -> None:
        r = random.Random(seed * 100 + k)
        rfd = os.open(p, os.O_RDONLY)
        try:
            while not stop.is_set():
                seen = [piece for w in written for piece in list(w)]
                for a, b in r.sample(seen, min(20, len(seen))):
                    if os.pread(rfd, b - a, a) != data[a:b]:
                        errors.append(("read", a, b))
                        return
        except BaseException as e:     # noqa: BLE001
            errors.append(("read", k, e))
        finally:
            os.close(rfd)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    readers = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
    for t in threads + readers:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    for t in readers:
        t.join(60)
    os.close(fd)
    assert not errors, errors[:3]
    assert sum(len(w) for w in written) == len(pieces)
    assert p.read_bytes() == data
    mounted.remount()
    assert p.read_bytes() == data


def test_mmap_shared_readonly_and_private(mounted):
    data = rand_bytes(9 * MiB + 123, 13)
    p = mounted / "m"
    write_file(p, data)
    with open(p, "rb") as f:
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            assert len(m) == len(data)
            assert m[:] == data
            rng = random.Random(1)
            for _ in range(50):
                off = rng.randrange(len(data))
                assert m[off:off + 4096] == data[off:off + 4096]
    with open(p, "r+b") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:    # MAP_PRIVATE
            assert m[:100] == data[:100]
            m[0:5] = b"HELLO"
            assert m[0:5] == b"HELLO"
    assert p.read_bytes() == data                    # private writes never reach the file
    # numpy/torch style: np.memmap read-only
    import numpy as np
    arr = np.memmap(p, dtype=np.uint8, mode="r")
    assert bytes(arr[-1000:]) == data[-1000:]
    del arr


def test_mmap_shared_writes_reach_the_file(mounted):
    """Writable shared mappings (``np.memmap(mode="w+")``, dataset and index builders, tools
    that patch a checkpoint in place): the bytes written through the mapping are the file's,
    seen by another descriptor before it closes, kept by a remount, and what ``msync`` returned
    for survives a kill -9 of the daemon with the mapping still open."""
    import numpy as np
    p = mounted / "mm"
    n = 10 * MiB + 3 * 4096 + 17                  # not a whole number of pages or blocks
    want = bytearray(rand_bytes(n, 31))
    arr = np.memmap(p, dtype=np.uint8, mode="w+", shape=(n,))
    arr[:] = np.frombuffer(bytes(want), dtype=np.uint8)
    arr.flush()
    del arr
    assert p.read_bytes() == want
    rng = random.Random(5)
    with open(p, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:     # edits over written extents
        for _ in range(200):
            off = rng.randrange(n - 9000)
            d = rng.randbytes(rng.randrange(1, 9000))          # across page/block boundaries
            m[off:off + len(d)] = d
            want[off:off + len(d)] = d
        m[n - 5:] = b"TAIL!"
        want[n - 5:] = b"TAIL!"
        m.flush()
        assert p.read_bytes() == want                          # before the close
    mounted.remount()
    assert p.read_bytes() == want
    fd = os.open(p, os.O_RDWR)
    m = mmap.mmap(fd, 0)
    try:
        m[4096:4096 + 11] = b"msync'd ok!"
        want[4096:4096 + 11] = b"msync'd ok!"
        m.flush()                                  # msync(MS_SYNC): FUSE FSYNC of the range
        mounted.kill()                             # the mapping and the descriptor still open
    finally:
        m.close()
        try:
            os.close(fd)
        except OSError:
            pass
    run("fusermount3", "-uz", mounted.path, check=False)
    mounted.mount()
    assert p.read_bytes() == want


def test_file_over_4gib(make_image, mount_image):
    img = make_image(size="8G")
    m = mount_image(img)
    p = m / "huge"
    G = 1 << 30
    pieces = {0: rand_bytes(MiB, 20), 4 * G - 3000: rand_bytes(MiB, 21),   # straddles 4 GiB
              5 * G + 17: rand_bytes(2 * MiB + 5, 22)}
    with open(p, "wb") as f:
        for off, d in pieces.items():
            f.seek(off)
            f.write(d)
    size = 5 * G + 17 + 2 * MiB + 5
    assert os.stat(p).st_size == size
    with open(p, "rb") as f:
        for off, d in pieces.items():
            f.seek(off)
            assert f.read(len(d)) == d
        f.seek(2 * G)
        assert f.read(MiB) == bytes(MiB)             # a hole reads as zeros
    # dd at a high offset, then read past 4 GiB through mmap
    run("dd", "if=/dev/zero", f"of={m / 'dd_high'}", "bs=1M", "count=1", "seek=4200",
        "status=none")
    assert os.stat(m / "dd_high").st_size == 4201 * MiB
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[5 * G + 17:5 * G + 17 + 1000] == pieces[5 * G + 17][:1000]
    m.remount()
    assert os.stat(p).st_size == size
    with open(p, "rb") as f:
        for off, d in pieces.items():
            f.seek(off)
            assert f.read(len(d)) == d
    assert m.status()["live_bytes"] == sum(map(len, pieces.values())) + MiB


def test_st_blocks_count_what_a_file_holds(mounted):
    """``st_blocks`` is what a file holds, not its size: ``du`` of a sparse file and
    ``cp --sparse`` see its holes (it was size / 512: a 100 MiB file with 5 KB in it showed as
    100 MiB).  Counted while buffered, after close, after overwrites (not twice, also while the
    new bytes are still buffered over the stored ones), a
    truncation and a remount."""
    p = mounted / "sparse"
    with open(p, "wb") as f:
        f.seek(100 * MiB)
        f.write(b"x" * 5000)
        f.flush()
        assert os.fstat(f.fileno()).st_blocks == 10           # buffered, not yet in a zone
    st = os.stat(p)
    assert st.st_size == 100 * MiB + 5000 and st.st_blocks == 10
    with open(p, "r+b") as f:                                 # an overwrite counts once:
        f.seek(100 * MiB)
        f.write(b"y" * 5000)
        f.flush()                                             # buffered over stored bytes
        assert os.fstat(f.fileno()).st_blocks == 10
    assert os.stat(p).st_blocks == 10
    du = run("du", "-k", str(p)).stdout.split()[0]
    assert int(du) < 64, du
    full = mounted / "full"
    write_file(full, rand_bytes(3 * MiB + 100, 3))
    assert os.stat(full).st_blocks == (3 * MiB + 100 + 511) // 512
    os.truncate(full, MiB)
    assert os.stat(full).st_blocks == MiB // 512
    mounted.remount()
    assert os.stat(p).st_blocks == 10 and os.stat(full).st_blocks == MiB // 512
    assert (mounted / "sparse").read_bytes()[100 * MiB:] == b"y" * 5000


def test_statfs_reports_real_free_space(mounted):
    s0 = os.statvfs(mounted.path)
    assert s0.f_blocks * s0.f_frsize > 900 * MiB
    assert 0 < s0.f_bavail <= s0.f_bfree <= s0.f_blocks
    free0 = s0.f_bavail * s0.f_frsize
    for i in range(4):
        write_file(mounted / f"f{i}", rand_bytes(16 * MiB, 30 + i), fsync=True)
    free1 = os.statvfs(mounted.path).f_bavail * s0.f_frsize
    assert free0 - free1 >= 64 * MiB - 8 * MiB, (free0, free1)
    assert free0 - free1 <= 64 * MiB + 16 * MiB
    df = run("df", "-B1", "--output=avail", mounted.path).stdout.split()[-1]
    assert abs(int(df) - free1) <= 16 * MiB
    for i in range(4):
        os.unlink(mounted / f"f{i}")
    # deletion empties the zones; they are reset and the space comes back
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        free2 = os.statvfs(mounted.path).f_bavail * s0.f_frsize
        if free2 >= free0 - 8 * MiB:
            break
        time.sleep(0.05)
    assert free2 >= free0 - 8 * MiB, (free0, free2)
    st = mounted.status()
    assert st["zone_resets"] > 0
    assert st["live_bytes"] == 0


def test_statfs_counts_what_gc_gives_back(make_image, mount_image):
    """``df`` after ``rm`` of a file whose zones it shared with a file that stays: the zones
    are not reset (live data left), but GC gives the dead half back to the next writer, so the
    free space reported grows by about the file removed, and a writer gets that much.  Before,
    ``df`` showed no change (a job or a monitor checking free space before a save saw none)."""
    m = mount_image(make_image(size="96M", zone_size="4M"))

    def avail() -> int:
        st = os.statvfs(m.path)
        return st.f_bavail * st.f_frsize

    a0 = avail()
    n = 0
    with open(m / "A", "wb") as fa, open(m / "B", "wb") as fb:
        while (n + 2) * MiB < a0 * 0.9:       # 1 MiB of each in turn: they share zones
            for i, f in enumerate((fa, fb)):
                f.write(rand_bytes(MiB, 100 + n + i))
                f.flush()
                os.fsync(f.fileno())
            n += 2
    a_data = (m / "A").read_bytes()
    a1 = avail()
    assert a1 < a0 * 0.2, (a0, a1)
    os.unlink(m / "B")
    st = m.status()
    # (at most one zone reset: the last, near a full device, writes go to a zone at once and
    # pad a block each now and then, so B's last bytes may spill into a zone of their own)
    assert st["zone_resets"] <= 1 and st["invalid_bytes"] >= n // 2 * MiB * 0.9, st
    a2 = avail()
    assert a2 - a1 >= n // 2 * MiB * 0.9, (a1, a2, n)
    assert st["reclaimable_bytes"] >= n // 2 * MiB * 0.9, st
    got = int((a2 - a1) * 0.8) // MiB * MiB          # a writer gets it (through GC)
    write_file(m / "C", rand_bytes(got, 7), fsync=True)
    assert m.status()["gc_copied_bytes"] > 0
    m.remount()
    assert (m / "A").read_bytes() == a_data
    assert (m / "C").read_bytes() == rand_bytes(got, 7)


def test_posix_acls_are_refused_not_stored_unenforced_under_noacl(image, mount_image):
    """``-o noacl`` (or a kernel without FUSE_POSIX_ACL): the kernel checks access by mode bits
    alone, so an ACL must be refused (EOPNOTSUPP, as a file system mounted without ACLs
    answers; ``setfacl`` then says "Operation not supported") instead of stored.  Before stop
    33 every mount was so, and before that ``setfacl -m m::---`` succeeded and ``getfacl``
    showed a mask that took write from the group, while the group kept writing.  Other
    namespaces (trusted, security, user) are still kept.  ACLs on: tests/test_acl.py."""
    import base64
    mounted = mount_image(image, "noacl")
    p = mounted / "acl"
    write_file(p, b"data")
    os.chmod(p, 0o664)
    # user::rw- user:nobody:r-- group::rw- mask::r-- other::r-- (what setfacl would send)
    acl = base64.b64decode("AgAAAAEABgD/////AgAEAP7/AAAEAAYA/////xAABAD/////IAAEAP////8=")
    for name in ("system.posix_acl_access", "system.posix_acl_default"):
        target = mounted if name.endswith("default") else p
        with pytest.raises(OSError) as ei:
            os.setxattr(target, name, acl)
        assert ei.value.errno == errno.EOPNOTSUPP, name
        with pytest.raises(OSError) as ei:
            os.getxattr(target, name)
        assert ei.value.errno == errno.ENODATA, name
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o664
    for name in ("trusted.t", "security.s", "user.u"):
        os.setxattr(p, name, b"v")
    mounted.remount()
    assert {n: os.getxattr(p, n) for n in ("trusted.t", "security.s", "user.u")} == \
        {"trusted.t": b"v", "security.s": b"v", "user.u": b"v"}
    assert not any(n.startswith("system.posix_acl") for n in os.listxattr(p))


def test_xattr_names_outside_the_namespaces_are_refused_as_ext4_refuses_them(mounted):
    """The kernel hands FUSE any name; ext4 answers EOPNOTSUPP outside user., trusted.,
    security. (and system.'s ACLs) and EINVAL for a namespace with no name.  These were
    stored, and listed to ``cp -a`` / ``rsync -X``, which then failed copying them elsewhere."""
    p = mounted / "f"
    write_file(p, b"x")
    for name, want in (("foo", errno.EOPNOTSUPP), ("system.data", errno.EOPNOTSUPP),
                       ("usr.x", errno.EOPNOTSUPP), ("user.", errno.EINVAL),
                       ("trusted.", errno.EINVAL), ("security.", errno.EINVAL)):
        with pytest.raises(OSError) as ei:
            os.setxattr(p, name, b"v")
        assert ei.value.errno == want, name
    assert os.listxattr(p) == []
    os.setxattr(p, "user.x.y", b"v")                  # dots after the namespace are names
    assert os.getxattr(p, "user.x.y") == b"v"


def test_xattrs(mounted):
    p = mounted / "x"
    write_file(p, b"data")
    with pytest.raises(OSError) as ei:
        xattr.getxattr(p, "user.absent")
    assert ei.value.errno == errno.ENODATA
    xattr.setxattr(p, "user.a", b"1")
    xattr.setxattr(p, "user.b", b"\x00binary\xff" * 100)
    assert xattr.getxattr(p, "user.a") == b"1"
    assert xattr.getxattr(p, "user.b") == b"\x00binary\xff" * 100
    assert {"user.a", "user.b"} <= set(xattr.listxattr(p))
    with pytest.raises(OSError) as ei:
        xattr.setxattr(p, "user.a", b"2", xattr.XATTR_CREATE)
    assert ei.value.errno == errno.EEXIST
    with pytest.raises(OSError) as ei:
        xattr.setxattr(p, "user.c", b"2", xattr.XATTR_REPLACE)
    assert ei.value.errno == errno.ENODATA
    xattr.removexattr(p, "user.a")
    with pytest.raises(OSError) as ei:
        xattr.getxattr(p, "user.a")
    assert ei.value.errno == errno.ENODATA
    with pytest.raises(OSError) as ei:
        xattr.removexattr(p, "user.a")
    assert ei.value.errno == errno.ENODATA
    # hint xattrs on a directory are inherited; the virtual hint xattr reports it
    d = mounted / "gen"
    d.mkdir()
    xattr.setxattr(d, H.XATTR_BIRTH, b"100")
    xattr.setxattr(d, H.XATTR_RECLAIM, b"400")
    write_file(d / "shard", rand_bytes(MiB, 40))
    h = json.loads(xattr.getxattr(d / "shard", H.XATTR_HINT))
    assert (h["birth"], h["reclaim"]) == (100, 400)
    assert xattr.getxattr(d / "shard", H.XATTR_ZONES)
    # a hint set right after create (data already written, still buffered) still counts
    with open(mounted / "late_hint", "wb") as f:
        f.write(rand_bytes(100_000, 41))
        xattr.setxattr(f.fileno(), H.XATTR_BIRTH, b"7")
        xattr.setxattr(f.fileno(), H.XATTR_RECLAIM, b"inf")
    h = json.loads(xattr.getxattr(mounted / "late_hint", H.XATTR_HINT))
    assert (h["birth"], h["reclaim"]) == (7, "inf")
    xattr.setxattr(mounted.path, "user.on_root", b"r")
    # getfattr (a real program) agrees
    out = run("getfattr", "-d", "-m", "user\\.", d).stdout if shutil.which("getfattr") else ""
    if out:
        assert 'user.retainz.reclaim="400"' in out
    mounted.remount()
    assert xattr.getxattr(p, "user.b") == b"\x00binary\xff" * 100
    assert "user.a" not in xattr.listxattr(p)
    assert xattr.getxattr(d, H.XATTR_RECLAIM) == b"400"
    assert xattr.getxattr(mounted.path, "user.on_root") == b"r"


def test_hard_links(mounted):
    a = mounted / "a"
    data = rand_bytes(2 * MiB, 50)
    write_file(a, data)
    (mounted / "d").mkdir()
    os.link(a, mounted / "d" / "b")
    st_a, st_b = os.stat(a), os.stat(mounted / "d" / "b")
    assert st_a.st_ino == st_b.st_ino and st_a.st_nlink == 2
    with open(mounted / "d" / "b", "r+b") as f:          # write through one name
        f.write(b"LINK")
    assert a.read_bytes()[:4] == b"LINK"
    os.unlink(a)
    assert os.stat(mounted / "d" / "b").st_nlink == 1
    assert (mounted / "d" / "b").read_bytes() == b"LINK" + data[4:]
    with pytest.raises(OSError) as ei:
        os.link(mounted / "d", mounted / "dlink")
    assert ei.value.errno == errno.EPERM
    os.link(mounted / "d" / "b", mounted / "c")
    mounted.remount()
    assert os.stat(mounted / "c").st_nlink == 2
    assert (mounted / "c").read_bytes() == b"LINK" + data[4:]
    assert mounted.status()["live_bytes"] == 2 * MiB
    os.unlink(mounted / "c")
    os.unlink(mounted / "d" / "b")
    assert wait_live(mounted, 0)


def _renameat2(a, b, flags: int) -> int:
    """renameat(2) with flags: 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    r = libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), flags)
    return 0 if r == 0 else ctypes.get_errno()


def test_renameat2_flags(mounted):
    """RENAME_NOREPLACE is done (EEXIST onto a name, a plain rename otherwise); EXCHANGE swaps
    (``test_rename_exchange_*``); WHITEOUT moves the file and leaves a whiteout, a character
    device 0/0, at the old name (overlayfs's; before stop 38 it was EINVAL and overlayfs
    refused a mount as its upper directory, and before stop 11 it was taken for a plain
    rename: the source vanished with no whiteout).  In a set-group-ID directory the whiteout
    takes the directory's group, as mknod's node does; a durable one survives kill -9."""
    m = mounted
    (m / "a").write_bytes(b"AAA")
    (m / "b").write_bytes(b"BBBB")
    assert _renameat2(m / "a", m / "b", 1) == errno.EEXIST
    assert _renameat2(m / "a", m / "c", 1) == 0
    assert _renameat2(m / "c", m / "new", 2) == errno.ENOENT          # EXCHANGE: both must exist
    assert _renameat2(m / "c", m / "b", 2) == 0
    assert _renameat2(m / "c", m / "b", 6) == errno.EINVAL            # EXCHANGE|WHITEOUT
    assert _renameat2(m / "nope", m / "x", 4) == errno.ENOENT
    assert _renameat2(m / "c", m / "w", 4) == 0                       # WHITEOUT
    assert _renameat2(m / "w", m / "b", 5) == errno.EEXIST            # NOREPLACE|WHITEOUT
    (m / "g").mkdir()
    os.chown(m / "g", 0, 4321)
    os.chmod(m / "g", 0o2775)
    (m / "g" / "f").write_bytes(b"G")
    assert _renameat2(m / "g" / "f", m / "g" / "f2", 4) == 0
    want = {"b": b"AAA", "w": b"BBBB", "g/f2": b"G"}
    for d in ("g", "."):
        fd = os.open(m / d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    for crash in (False, True):
        if crash:
            m.kill()
            m.mount()
        else:
            m.remount()
        assert sorted(os.listdir(m.path)) == ["b", "c", "g", "w"]
        assert sorted(os.listdir(m / "g")) == ["f", "f2"]
        assert {k: (m / k).read_bytes() for k in want} == want
        for wo, gid in (("c", 0), ("g/f", 4321)):
            st_ = os.lstat(m / wo)
            assert (stat.S_ISCHR(st_.st_mode), st_.st_rdev, st_.st_nlink, st_.st_uid,
                    st_.st_gid) == (True, 0, 1, 0, gid), wo
    os.unlink(m / "c")                                  # a whiteout is removed as a node is
    (m / "c").write_bytes(b"again")
    assert (m / "c").read_bytes() == b"again"


def test_overlayfs_upper_directory_as_on_ext4(image):
    """An overlayfs whose upper and work directories are on the mount (a container's
    writable layer, a job's scratch over a read-only dataset): overlayfs mounts (it needs
    RENAME_WHITEOUT and trusted xattrs of a FUSE upper), and deleting, renaming, copying up,
    replacing a deleted directory (opaque) and hard links through it give what they give
    with the upper directory on ext4, the merged view and the upper directory's whiteouts
    alike; after a remount the overlay mounts again and shows the same."""
    if "overlay" not in open("/proc/filesystems").read():
        subprocess.run(["modprobe", "overlay"], capture_output=True)
        if "overlay" not in open("/proc/filesystems").read():
            missing("no overlayfs in this kernel")
    show = """
    show() {
        (cd "$1" && find . -mindepth 1 | sort | while read -r p; do
            printf '%s %s %s' "$p" "$(stat -c '%F %t:%T' "$p")" "$(getfattr --absolute-names \
                --only-values -n trusted.overlay.opaque "$p" 2>/dev/null)"
            [ -f "$p" ] && printf ' %s' "$(cat "$p")"; echo
        done)
    }
    ov() { mount -t overlay overlay -o "lowerdir=$1/lower,upperdir=$1/upper,workdir=$1/work" \
        "$1/merged"; }
    """
    on_host_and_mount(image, show + """
    cd "$1"; mkdir lower upper work merged
    mkdir -p lower/d/sub lower/keep; echo a > lower/a; echo b > lower/b; echo c > lower/d/sub/c
    echo k > lower/keep/k
    ov "$1"
    rm merged/a; mv merged/b merged/b2; rm -r merged/d; mkdir merged/d; echo new > merged/d/n
    echo more >> merged/keep/k; ln merged/keep/k merged/klink; echo top > merged/top
    mv merged/top merged/keep/top; rm merged/klink
    echo merged; show merged
    umount "$1/merged"
    echo upper; show upper | grep -v '^./work'
    """, remount_check=show + """
    ov "$1"; show "$1/merged"; umount "$1/merged"
    """)


#: ``x DIR A B``: renameat2(DIR/A, DIR/B, RENAME_EXCHANGE), printing ok or the error
_EXCHANGE_SH = (
    'x() { python3 -c "import ctypes, os, sys; l = ctypes.CDLL(None, use_errno=True); '
    'r = l.renameat2(-100, os.fsencode(sys.argv[1]), -100, os.fsencode(sys.argv[2]), 2); '
    'print(sys.argv[3], \'ok\' if r == 0 else os.strerror(ctypes.get_errno()))" '
    '"$1/$2" "$1/$3" "$2 $3"; }\n')


def test_rename_exchange_as_on_ext4(image):
    """renameat2(RENAME_EXCHANGE) (``mv --exchange``, atomic swaps of a directory or a
    "latest" file): files and directories swap names within a directory and across two,
    directory link counts and ``..`` follow, hard links and the errors of ext4; the same
    after a remount.  It was EINVAL."""
    on_host_and_mount(image, _EXCHANGE_SH + """
    cd "$1"; mkdir -p A/sub/deep B/other; echo f > A/f; echo g > B/g; ln A/f A/f2
    echo s > A/sub/deep/s
    x . A/f B/g; x . A/sub B/g; x . A/f A/f2; x . A/nope B/g; x . B/other B/sub
    x . A B; x . A/g A/f; x . B/sub/deep A/g
    for p in $(find . | sort); do stat -c '%n %F %h' "$p"; done
    for p in $(find . -type f | sort); do echo "$p: $(cat "$p")"; done
    for d in $(find . -mindepth 1 -type d | sort); do
        [ "$(stat -c %i "$d/..")" = "$(stat -c %i "$(dirname "$d")")" ] && echo "$d/.. ok"
    done
    """, remount_check="cd $1 && find . -printf '%p %y %n\\n' | sort && cat $(find . -type f | sort)")


def test_rename_exchange_survives_a_crash_and_checks_a_policy(mounted):
    """Exchanges made durable (``fsync`` of the directories) are there after ``kill -9``
    (journal replay); a file arriving at ``.retainz`` by an exchange must hold a valid
    policy, like a rename onto it (EINVAL, nothing swapped), and a valid one takes effect."""
    m = mounted
    (m / "a").mkdir()
    (m / "b").mkdir()
    for i in range(20):
        (m / "a" / f"f{i}").write_bytes(b"a%d" % i)
        (m / "b" / f"f{i}").write_bytes(b"b%d" % i * 1000)
    for i in range(0, 20, 2):
        assert _renameat2(m / "a" / f"f{i}", m / "b" / f"f{i}", 2) == 0
    assert _renameat2(m / "a", m / "b", 2) == 0                 # and the directories
    for d in ("a", "b", "."):
        fd = os.open(m / d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    want = {f"{d}/{p.name}": p.read_bytes() for d in ("a", "b") for p in (m / d).iterdir()}
    assert (want["a/f0"], want["a/f1"], want["b/f0"], want["b/f1"]) == (    # swapped twice
        b"a0", b"b1" * 1000, b"b0" * 1000, b"a1")
    m.kill()
    m.mount()
    assert {f"{d}/{p.name}": p.read_bytes() for d in ("a", "b") for p in (m / d).iterdir()} == want
    (m / "job").mkdir()
    (m / "job" / ".retainz").write_text("keep_latest = 2\n")
    (m / "job" / "bad").write_text("keep_latest = 'two'\n")
    (m / "job" / "good").write_text("keep_latest = 5\n")
    assert _renameat2(m / "job" / "bad", m / "job" / ".retainz", 2) == errno.EINVAL
    assert (m / "job" / ".retainz").read_text() == "keep_latest = 2\n"
    assert _renameat2(m / "job" / "good", m / "job" / ".retainz", 2) == 0
    assert (m / "job" / ".retainz").read_text() == "keep_latest = 5\n"
    assert (m / "job" / "good").read_text() == "keep_latest = 2\n"


# ---------------------------------------------------------------------------- between processes
def _append_records(path: str, k: int, n: int) -> None:
    """Process ``k``: ``n`` records of varying length appended through its own O_APPEND fd."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for i in range(n):
            os.write(fd, b"%02d-%06d-%s\n" % (k, i, b"x" * (i % 61)))
    finally:
        os.close(fd)


def _try_lock(path: str, q) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        import fcntl
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)
        q.put("locked")
    except OSError as e:
        q.put(errno.errorcode[e.errno])
    finally:
        os.close(fd)


def test_record_locks_and_appenders_between_processes_as_on_ext4(mounted):
    """What jobs sharing a run directory do across processes: POSIX record locks (a lock file
    guarding a "latest" pointer), open-file-description locks, and several ranks appending
    to one log with O_APPEND.  The kernel keeps the locks for a FUSE file system that answers
    none of their requests; the appends must interleave whole records, none lost or torn, and
    stay so after a remount."""
    import fcntl
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    lk = str(mounted / "lock")
    write_file(lk, b"0" * 100)
    fd = os.open(lk, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)
    q = ctx.Queue()
    for want in ("EAGAIN", "locked"):          # held by this process, then released
        p = ctx.Process(target=_try_lock, args=(lk, q))
        p.start()
        p.join(30)
        assert q.get(timeout=5) == want
        fcntl.lockf(fd, fcntl.LOCK_UN, 10, 0)
    # F_GETLK names the holder; OFD locks conflict between two descriptions in one process
    fd2 = os.open(lk, os.O_RDWR)
    F_OFD_SETLK = 37
    flock = lambda t: __import__("struct").pack("hhqqi", t, 0, 0, 10, 0)   # noqa: E731
    fcntl.fcntl(fd, F_OFD_SETLK, flock(fcntl.F_WRLCK))
    with pytest.raises(OSError) as e:
        fcntl.fcntl(fd2, F_OFD_SETLK, flock(fcntl.F_WRLCK))
    assert e.value.errno == errno.EAGAIN
    os.close(fd)
    fcntl.fcntl(fd2, F_OFD_SETLK, flock(fcntl.F_WRLCK))      # closing the holder released it
    os.close(fd2)

    log = str(mounted / "log")
    ps = [ctx.Process(target=_append_records, args=(log, k, 1500)) for k in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
    assert [p.exitcode for p in ps] == [0] * 4

    def check() -> None:
        lines = open(log, "rb").read().split(b"\n")
        assert lines.pop() == b""
        assert len(lines) == 6000
        seen = set()
        for line in lines:
            k, i, pad = line.split(b"-")
            assert pad == b"x" * (int(i) % 61), line
            seen.add((int(k), int(i)))
        assert len(seen) == 6000
        # each process's records in its own order
        for k in range(4):
            mine = [int(x.split(b"-")[1]) for x in lines if x.startswith(b"%02d-" % k)]
            assert mine == list(range(1500))
    check()
    mounted.remount()
    check()


def test_splice_sendfile_and_copy_file_range_copy_whole_files(mounted, tmp_path):
    """The kernel's copy paths out of and into the mount (``cp`` uses copy_file_range inside
    one file system, Python's ``shutil`` sendfile; pipes use splice), across zone-capacity
    boundaries (4 MiB zones) and with an odd tail, each equal to the source after a remount."""
    data = rand_bytes(9 * MiB + 4097, 21)
    src = mounted / "src"
    write_file(src, data)
    host = tmp_path / "host"
    host.write_bytes(data)

    def via_splice(a, b) -> None:
        r, w = os.pipe()
        fi, fo = os.open(a, os.O_RDONLY), os.open(b, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while n := os.splice(fi, w, 65536):
                while n:
                    n -= os.splice(r, fo, n)
        finally:
            for fd in (fi, fo, r, w):
                os.close(fd)

    def via_sendfile(a, b) -> None:
        with open(a, "rb") as fi, open(b, "wb") as fo:
            off = 0
            while n := os.sendfile(fo.fileno(), fi.fileno(), off, 3 * MiB + 1):
                off += n

    def via_cfr(a, b) -> None:
        with open(a, "rb") as fi, open(b, "wb") as fo:
            while os.copy_file_range(fi.fileno(), fo.fileno(), 5 * MiB):
                pass

    made = []
    for how in (via_splice, via_sendfile, via_cfr):
        for a, b in ((src, mounted / f"{how.__name__}.in"), (host, mounted / f"{how.__name__}.h"),
                     (src, tmp_path / f"{how.__name__}.out")):
            if how is via_cfr and a.parent != b.parent:
                continue        # between file systems the kernel answers EXDEV (cp falls back)
            how(a, b)
            made.append(b)
    mounted.remount()
    for b in made:
        assert sha(b) == sha(host), b


def test_lazy_unmount_with_a_writer_keeps_its_bytes(mounted):
    """``umount -l`` while a job still writes (an operator detaching a busy mount): the
    writer goes on through its open descriptor, fsyncs and closes; the daemon then finishes
    and exits, and a new mount has every byte."""
    p = mounted / "w"
    h = hashlib.sha256()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    for i in range(20):
        b = rand_bytes(MiB + 17, i)
        h.update(b)
        os.write(fd, b)
    run("umount", "-l", mounted.path)
    pid, mounted.pid = mounted.pid, None
    for i in range(20, 40):
        b = rand_bytes(MiB + 17, i)
        h.update(b)
        os.write(fd, b)
    os.fsync(fd)
    os.close(fd)
    from conftest import _alive, image_locked, wait_for
    assert wait_for(lambda: not _alive(pid), 30), "daemon still running after the last close"
    assert wait_for(lambda: not image_locked(mounted.img), 10)
    mounted.mount()
    assert sha(p) == h.hexdigest()
    assert os.path.getsize(p) == 40 * (MiB + 17)
