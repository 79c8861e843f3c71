"""The FUSE binding (retainzfs/_fuse.pyx on libfuse's multi-threaded loop), on real mounts.

Since stop 14 every request runs in whichever libfuse thread received it, truly in parallel
with the others (pyfuse3 ran handlers one at a time on a trio thread): these tests drive many
threads at once through every kind of operation and check the result after a remount, and the
parts of the protocol the binding does itself (signals, xattr size probes and flags, READDIRPLUS
lookup references, negative entries).
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import random
import re
import signal
import threading
from pathlib import Path

import pytest
import xattr

from conftest import _alive, is_mounted, wait_for

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.getxattr.restype = ctypes.c_ssize_t
libc.listxattr.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.listxattr.restype = ctypes.c_ssize_t

MiB = 1 << 20
#: sizes around the limits the write path cares about: the small-write tail (64 KiB), the
#: binding's GIL-free copy (64 KiB), a request (1 MiB), a flush (4 MiB)
SIZES = [0, 1, 4095, 65535, 65536, 65537, MiB - 1, MiB + 3, 4 * MiB, 5 * MiB + 17]


def _payload(tag: str, n: int) -> bytes:
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


def _worker(root: str, k: int, expect: dict, errors: list) -> None:
    """One thread's share: files of every size written in pieces, fsynced, renamed, some
    deleted, xattrs set and read, directories listed, all interleaved with the other threads."""
    rnd = random.Random(k)
    try:
        d = os.path.join(root, f"d{k % 4}")
        os.makedirs(d, exist_ok=True)
        for i, n in enumerate(SIZES):
            name = f"t{k}-{i}"
            data = _payload(name, n)
            p = os.path.join(d, name + ".tmp")
            with open(p, "wb", buffering=0) as f:
                pos = 0
                while pos < n:                       # uneven requests
                    step = rnd.choice([1000, 4096, 65536, MiB, 3 * MiB])
                    f.write(data[pos:pos + step])
                    pos += step
                if rnd.random() < 0.5:
                    os.fsync(f.fileno())
            final = os.path.join(d, name)
            os.rename(p, final)
            xattr.setxattr(final, "user.k", str(k).encode())
            assert xattr.getxattr(final, "user.k") == str(k).encode()
            with open(final, "rb") as f:
                assert f.read() == data, f"{final}: read back differs"
            os.listdir(d)
            if i % 3 == 2:
                os.unlink(final)
            else:
                expect[final] = hashlib.sha256(data).hexdigest()
    except BaseException as e:          # reported by the main thread
        errors.append(f"thread {k}: {e!r}")


def _check(expect: dict) -> None:
    for p, h in expect.items():
        with open(p, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == h, p
        assert xattr.getxattr(p, "user.k")


def test_many_threads_through_every_operation_at_once_then_remount(mounted):
    expect: dict = {}
    errors: list = []
    ts = [threading.Thread(target=_worker, args=(str(mounted), k, expect, errors))
          for k in range(12)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    _check(expect)
    names = {os.path.join(str(mounted), d, n) for d in os.listdir(mounted)
             for n in os.listdir(os.path.join(str(mounted), d))}
    assert names == set(expect)
    mounted.remount()
    _check(expect)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["term", "int", "hup"])
def test_sigterm_unmounts_cleanly_and_keeps_what_was_written(mounted, sig):
    """Also SIGINT and SIGHUP: the daemon catches them (before serving, to mount nothing;
    libfuse's handlers once it serves), and each unmounts with what was buffered written."""
    data = _payload("sig", 3 * MiB + 5)
    (mounted / "f").write_bytes(data)               # closed, not fsynced: the unmount commits
    pid = mounted.pid
    os.kill(pid, sig)
    assert wait_for(lambda: not _alive(pid), 20), f"daemon still running after {sig!r}"
    assert not is_mounted(mounted.path)
    assert f"signal {int(sig)}: unmounting" in mounted.daemon_log()
    mounted.pid = None
    mounted.mount()
    assert (mounted / "f").read_bytes() == data


def test_xattr_size_probes_and_create_replace_flags(mounted):
    p = mounted / "x"
    p.write_bytes(b"")
    path = os.fsencode(str(p))
    assert libc.listxattr(path, None, 0) == 0                 # none: an empty list
    xattr.setxattr(str(p), "user.v", b"12345")
    assert libc.getxattr(path, b"user.v", None, 0) == 5       # size probe
    small = ctypes.create_string_buffer(4)
    assert libc.getxattr(path, b"user.v", small, 4) == -1 and ctypes.get_errno() == errno.ERANGE
    big = ctypes.create_string_buffer(5)
    assert libc.getxattr(path, b"user.v", big, 5) == 5 and big.raw == b"12345"
    n = libc.listxattr(path, None, 0)
    assert n == len(b"user.v\0")
    assert libc.listxattr(path, small, 4) == -1 and ctypes.get_errno() == errno.ERANGE
    with pytest.raises(OSError) as e:
        xattr.setxattr(str(p), "user.v", b"x", xattr.XATTR_CREATE)
    assert e.value.errno == errno.EEXIST
    with pytest.raises(OSError) as e:
        xattr.setxattr(str(p), "user.nope", b"x", xattr.XATTR_REPLACE)
    assert e.value.errno == errno.ENODATA
    xattr.setxattr(str(p), "user.v", b"new", xattr.XATTR_REPLACE)
    xattr.setxattr(str(p), "user.w", b"w", xattr.XATTR_CREATE)
    assert xattr.getxattr(str(p), "user.v") == b"new"
    assert xattr.getxattr(str(p), "user.w") == b"w"


def test_listing_references_are_forgotten_and_deleted_files_freed(mounted):
    """READDIRPLUS hands the kernel a reference per entry: counted, and given back by FORGET,
    so files listed then deleted are freed (the inode count returns to where it was)."""
    root = str(mounted)

    def used() -> int:                       # inodes in the table: f_files - f_ffree
        st = os.statvfs(root)
        return st.f_files - st.f_ffree
    base = used()
    d = os.path.join(root, "many")
    os.mkdir(d)
    for i in range(1500):                                     # several READDIRPLUS replies
        with open(os.path.join(d, f"n{i:05d}"), "wb") as f:
            f.write(b"y")
    assert used() == base + 1501
    for _ in range(2):
        assert len([e.stat().st_size for e in os.scandir(d)]) == 1500
    assert sorted(os.listdir(d)) == [f"n{i:05d}" for i in range(1500)]
    for i in range(1500):
        os.unlink(os.path.join(d, f"n{i:05d}"))
    os.rmdir(d)
    assert wait_for(lambda: used() == base, 10), (used(), base)


def test_a_missing_name_then_created_is_found(mounted):
    """Lookups that miss are cached by the kernel (negative entries); a create through the
    mount replaces them at once."""
    p = mounted / "later"
    for _ in range(3):
        assert not p.exists()
    p.write_bytes(b"now")
    assert p.read_bytes() == b"now"
    os.mkdir(mounted / "dir")
    assert (mounted / "dir").is_dir()


def test_a_read_only_close_does_not_wait_for_the_daemon(mounted):
    """A file opened only to read gets FOPEN_NOFLUSH: its close(2) sends no FLUSH (a round trip
    a restore paid for every file of a checkpoint), so it returns even while the daemon is
    stopped.  A close of a descriptor that wrote still waits: that FLUSH commits the file."""
    p = mounted / "f"
    p.write_bytes(b"x" * 10_000)
    ro = os.open(p, os.O_RDONLY)
    assert os.read(ro, 10) == b"x" * 10
    rw = os.open(p, os.O_WRONLY)
    os.write(rw, b"y")
    closed = {}

    def close(name, fd):
        os.close(fd)
        closed[name] = True
    os.kill(mounted.pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=close, args=("ro", ro), daemon=True)
        t.start()
        t.join(5)
        assert closed.get("ro"), "the close of a read-only descriptor waited for the daemon"
        w = threading.Thread(target=close, args=("rw", rw), daemon=True)
        w.start()
        w.join(1)
        assert not closed.get("rw"), "the close of a written descriptor did not reach the daemon"
    finally:
        os.kill(mounted.pid, signal.SIGCONT)
    w.join(30)
    assert closed.get("rw")
    assert p.read_bytes() == b"y" + b"x" * 9_999


def test_an_ops_object_lacking_a_handler_is_refused_before_mounting(tmp_path):
    """A handler looked up when its request arrives fails outside the handler's try, and that
    request is never answered (the ceiling bench's null file system lacked ``releasedir``):
    ``mount`` names what is missing instead, and mounts nothing."""
    from retainzfs import _fuse
    from retainzfs.fs import Operations

    class Partial:
        pass

    pyx = (Path(_fuse.__file__).parent / "_fuse.pyx").read_text()
    assert set(_fuse._OPS_NEEDED) == set(re.findall(r"\b_ops\.(\w+)", pyx))   # all it uses
    for name in _fuse._OPS_NEEDED:
        if not name.endswith("timeout") and name not in ("blksize", "want_acl"):
            assert callable(getattr(Operations, name, None)), name   # fs.py has them all
    for name in ("open", "releasedir", "fsyncdir"):
        setattr(Partial, name, lambda *a: None)
    with pytest.raises(TypeError, match=r"lacks access, blksize, .*release, removexattr") as e:
        _fuse.mount(Partial(), str(tmp_path), [])
    assert "releasedir" not in str(e.value) and "open," not in str(e.value)
    assert not is_mounted(str(tmp_path))
