"""SEEK_DATA / SEEK_HOLE (lseek(2)), from the store's extents and buffered bytes.

Before, the binding left LSEEK unanswered (ENOSYS) and the kernel answered as if every file
were dense: ``retainzfs scrub`` of a mount read every hole of a sparse file (a file made with
``truncate -s 8E`` kept it reading zeros until killed), and ``cp`` / ``tar --sparse`` read
holes as data.  Holes are reported in whole 4 KiB blocks, as ext4 reports them, so the answers
are compared with ext4's for the same calls.
"""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import subprocess

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import RETAINZFS, run
from test_store import fresh

BLOCK = 4096
MiB = 1 << 20


def _model_answers(mapped: bytearray, size: int, off: int) -> tuple[int | str, int | str]:
    """(SEEK_DATA, SEEK_HOLE) at ``off`` for a file whose written bytes are ``mapped``: a block
    with any written byte is data, the end of the file is a hole."""
    if off >= size:
        return "ENXIO", "ENXIO"
    data = [any(mapped[b:min(b + BLOCK, size)]) for b in range(0, size, BLOCK)]
    d = next((max(off, i * BLOCK) for i in range(off // BLOCK, len(data)) if data[i]), "ENXIO")
    h = next((max(off, i * BLOCK) for i in range(off // BLOCK, len(data)) if not data[i]), size)
    return d, min(h, size)


def _probe_offsets(size: int) -> list[int]:
    pts = {0, size - 1, size, size + 1}
    for b in range(0, size + BLOCK, BLOCK):
        pts.update((b - 1, b, b + 1, b + BLOCK // 2))
    return sorted(p for p in pts if p >= 0)


OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 40_000), st.integers(1, 9_000)),
    st.tuples(st.just("commit"), st.just(0), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 45_000), st.just(0)),
    st.tuples(st.sampled_from(["punch", "zero"]), st.integers(0, 40_000), st.integers(1, 9_000)),
), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_seek_data_and_hole_match_a_block_model(tmp_path_factory, ops):
    """Any mix of buffered and committed writes, truncates, punched and zeroed ranges (sizes
    around the 4 KiB block), SEEK_DATA and SEEK_HOLE at every block edge and either side of it
    are exactly a block model's (a block with any written byte is data), the two agree (an
    offset is in data or in a hole, not both), and every byte of a reported hole reads as
    zero.  (A write buffer joins a write a little past its end with the zeros between,
    ``OpenFiles.gap_locked``: never over a whole block, so the model holds.)"""
    path, dev, s = fresh(tmp_path_factory.mktemp("seek"))
    try:
        ino = s.create(1, b"f", 0o644).ino
        s.open(ino)
        mapped, size = bytearray(), 0
        for op, off, n in ops:
            if op == "write":
                data = os.urandom(n)
                if s.buffer_write(ino, off, data) is None:
                    s.write(ino, off, data)
                if off + n > len(mapped):
                    mapped.extend(bytes(off + n - len(mapped)))
                mapped[off:off + n] = b"\1" * n
                size = max(size, off + n)
            elif op == "commit":
                s.commit(ino, durable=False)
            elif op == "truncate":
                s.truncate(ino, off)
                mapped = mapped[:off] + bytes(max(0, off - len(mapped)))
                size = off
            else:
                s.punch(ino, off, n, op == "zero", True)
                end = min(off + n, size)
                if end > off:
                    mapped[off:end] = bytes(end - off)
        mapped = mapped[:size] + bytes(max(0, size - len(mapped)))
        content = s.read(ino, 0, size) if size else b""
        for off in _probe_offsets(size):
            got = []
            for whence in (os.SEEK_DATA, os.SEEK_HOLE):
                try:
                    got.append(s.seek(ino, off, whence))
                except OSError as e:
                    got.append(errno.errorcode[e.errno])
            d, h = got
            assert (d, h) == _model_answers(mapped, size, off), (off, size, ops)
            if off >= size:
                assert (d, h) == ("ENXIO", "ENXIO")
                continue
            assert (d == off) != (h == off), (off, d, h, ops)       # data or hole, not both
            assert d == "ENXIO" or (d >= off and (d == off or d % BLOCK == 0))
            assert off <= h <= size and (h == off or h == size or h % BLOCK == 0)
            if d == off:                                            # data up to h
                assert h > off
            else:                                                   # a hole up to d
                assert not any(mapped[off:d if d != "ENXIO" else size]), (off, d, ops)
                assert not any(content[off:d if d != "ENXIO" else size]), (off, d, ops)
        s.release(ino)
    finally:
        s.close()
        dev.close()


SESSION = r"""
import errno, os, sys
d = sys.argv[1]
def ans(fd, off, w):
    try:
        return os.lseek(fd, off, w)
    except OSError as e:
        return errno.errorcode[e.errno]
def show(name):
    fd = os.open(os.path.join(d, name), os.O_RDONLY)
    size = os.fstat(fd).st_size
    pts = sorted({0, 1, 4095, 4096, 4097, 65535, 65536, 1 << 20, (1 << 20) + 5000, size - 1, size,
                  size + 7} | {p for p in range(0, size + 8192, 8192 * 16)})
    for p in pts:
        if p >= 0:
            print(name, p, ans(fd, p, os.SEEK_DATA), ans(fd, p, os.SEEK_HOLE))
    os.close(fd)
def mk(name, writes, size=None, falloc=None, punch=None, sync=True):
    fd = os.open(os.path.join(d, name), os.O_CREAT | os.O_RDWR, 0o644)
    if size is not None:
        os.truncate(fd, size)
    for off, n in writes:
        os.pwrite(fd, bytes([7]) * n, off)
    if falloc:
        os.posix_fallocate(fd, *falloc)
    if punch:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(fd, 3, *punch) == 0      # PUNCH_HOLE | KEEP_SIZE
    if sync:
        os.fsync(fd)
    os.close(fd)
if sys.argv[2] == "make":
    mk("empty", [])
    mk("dense", [(0, 300_000)])
    mk("tail_hole", [(0, 5000)], size=3 << 20)
    mk("head_hole", [(2 << 20, 10)])
    mk("islands", [(100, 1), (8191, 2), (70_000, 4096), (1 << 20, 1 << 20)], size=5 << 20)
    mk("punched", [(0, 3 << 20)], punch=((1 << 20) + 100, 1 << 20))
    mk("fallocated", [(0, 10)], falloc=(1 << 20, 1 << 20))
    mk("unsynced", [(4096, 3), (1 << 20, 70_000)], size=2 << 20, sync=False)
    mk("hdhd", [(4096, 4096), (12288, 4096)], sync=False)     # seek_sanity_test's 06
    mk("strided", [(i * 6000, 1000) for i in range(40)], sync=False)
for n in ("empty", "dense", "tail_hole", "head_hole", "islands", "punched", "fallocated",
          "unsynced", "hdhd", "strided"):
    show(n)
"""


def test_seek_data_and_hole_answer_as_on_ext4(tmp_path, mounted):
    """The same files made the same way (dense, sparse at the head and the tail, islands of a
    byte to a MiB, a punched hole, a fallocated range, bytes not yet fsynced) on the host's ext4
    and on the mount: SEEK_DATA and SEEK_HOLE give the same answers at the same offsets, and
    again after a remount.  (Before, every file answered as dense.)"""
    script = tmp_path / "seek.py"
    script.write_text(SESSION)
    host = tmp_path / "host"
    host.mkdir()
    want = run("python3", script, host, "make").stdout
    got = run("python3", script, mounted.path, "make").stdout
    assert got == want
    assert len(want.splitlines()) > 100
    mounted.remount()
    assert run("python3", script, mounted.path, "show").stdout == want


def test_scrub_and_cp_skip_the_holes_of_a_huge_sparse_file(mounted):
    """A file of 8 EiB (``truncate``: ext4 would refuse, the mount takes it) with 3 MiB of data
    in three places: ``retainzfs scrub`` verifies exactly those 3 MiB and finishes (before: it
    read zeros until killed); ``cp --sparse=always`` of a 1 GiB sparse file copies its bytes and
    keeps its holes."""
    big = mounted / "huge"
    with open(big, "wb") as f:
        for off in (0, 1 << 40, (1 << 62) - MiB):
            f.seek(off)
            f.write(os.urandom(MiB))
        f.truncate((1 << 63) - 1)
        os.fsync(f.fileno())
    r = subprocess.run([RETAINZFS, "scrub", "--json", mounted.path], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["bytes_verified"] == 3 * MiB and rep["errors"] == []
    sparse = mounted / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)
        f.seek(500 * MiB)
        f.write(b"x" * 10_000)
    copy = mounted / "copy"
    run("cp", "--sparse=always", sparse, copy)
    assert os.stat(copy).st_size == 1 << 30
    assert os.stat(copy).st_blocks * 512 <= 64 * 1024
    with open(sparse, "rb") as a, open(copy, "rb") as b:
        assert (hashlib.sha256(a.read()).digest() == hashlib.sha256(b.read()).digest())


def test_bytes_stored_through_a_mapping_and_not_written_back_are_data(mounted):
    """The reason SEEK_DATA / SEEK_HOLE were long left to the kernel's default: the kernel asks
    without writing back pages a shared mapping dirtied, so an answer from the extents called
    such bytes a hole (SEEK_DATA from 4 KiB: ENXIO while ``read`` saw "hello") and ``cp``
    copied zeros.  Now the range an answer would call a hole is invalidated first (the kernel
    writes its dirty pages back) and the store asked again: the mapped bytes are data, and a
    sparse copy made before any msync has them."""
    p = mounted / "mapped"
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        os.truncate(fd, 8 * MiB)
        os.pwrite(fd, b"a" * 10, 0)
        os.fsync(fd)
        with mmap.mmap(fd, 8 * MiB) as mm:
            mm[5 * MiB:5 * MiB + 5] = b"hello"
            assert os.lseek(fd, BLOCK, os.SEEK_DATA) == 5 * MiB
            assert os.lseek(fd, 5 * MiB, os.SEEK_HOLE) == 5 * MiB + BLOCK
            mm[7 * MiB:7 * MiB + 5] = b"world"
            run("cp", "--sparse=always", p, mounted / "copy")      # no msync before it
            assert os.lseek(fd, 0, os.SEEK_HOLE) == BLOCK
            mm.flush()
    finally:
        os.close(fd)
    with open(mounted / "copy", "rb") as f:
        got = f.read()
    assert got[:10] == b"a" * 10 and got[5 * MiB:5 * MiB + 5] == b"hello"
    assert got[7 * MiB:7 * MiB + 5] == b"world" and len(got) == 8 * MiB
    mounted.remount()
    with open(p, "rb") as f:
        assert f.read() == got
