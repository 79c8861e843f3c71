"""The GIL-free data path pieces (``retainzfs/_iobuf.pyx``) and what the mount does with them
(issue 10): O_DIRECT images by default, write-only descriptors with FOPEN_DIRECT_IO, reads
answered from the device's own aligned buffer.

Property tests run the codecs over sizes around each limit: the 16 KiB checksum piece, the
three-piece interleave of the hardware CRC, 4 KiB blocks, the scratch buffer of a gather
write, the pooled size classes."""
from __future__ import annotations

import errno
import os
from array import array
import random
import subprocess
import time

import pytest
from crc32c import crc32c as ref_crc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retainzfs import _iobuf as I
from retainzfs import device as D
from retainzfs.csums import CSUM_PIECE, ZoneChecksums, crcs_of
from retainzfs.records import CSUM_PIECE as PIECE

from conftest import MOUNT

KiB, MiB = 1 << 10, 1 << 20
P = PIECE
_sizes = st.one_of(st.integers(0, 3 * P + 17),
                   st.sampled_from([P - 1, P, P + 1, 3 * P - 1, 3 * P, 3 * P + 1, 6 * P + 5,
                                    4096, 4095, 4097, MiB - 1, MiB, MiB + 1]))


def _dirty(n: int):
    """A pooled buffer of ``n`` bytes full of 0xff (dropped, it leaves the pool dirty)."""
    n = max(n, 1)
    return I.assemble([(0, b"\xff" * n)], n)


def _ref_pieces(data: bytes, piece: int) -> list[int]:
    return [ref_crc(data[i:i + piece]) for i in range(0, len(data), piece)]


def _split(data: bytes, cuts: list[int]) -> list:
    cuts = sorted({min(c, len(data)) for c in cuts})
    out, pos = [], 0
    for c in cuts + [len(data)]:
        out.append(data[pos:c])
        pos = c
    return [memoryview(p) if i % 2 else p for i, p in enumerate(out)]   # mixed buffer types


@settings(max_examples=120, deadline=None)
@given(size=_sizes, cuts=st.lists(st.integers(0, 7 * P), max_size=4), seed=st.integers(0, 255),
       hw=st.booleans())
def test_crc32c_pieces_equal_the_crc32c_package(size, cuts, seed, hw):
    data = bytes((seed + i * 131) & 0xFF for i in range(size)) if size < 4096 else os.urandom(size)
    parts = _split(data, cuts)
    I.set_hardware_crc(hw)
    try:
        assert list(I.crc32c_pieces(parts, size, P)) == _ref_pieces(data, P)
        assert list(crcs_of(parts, size)) == _ref_pieces(data, CSUM_PIECE)
        assert I.crc32c(data) == ref_crc(data)
        k = size // 3
        assert I.crc32c(data[k:], I.crc32c(data[:k])) == ref_crc(data)
    finally:
        I.set_hardware_crc(True)


def test_crc32c_pieces_refuses_short_parts():
    with pytest.raises(ValueError):
        I.crc32c_pieces([b"x" * 10], 11, P)
    with pytest.raises(ValueError):
        crcs_of([b"x" * 10], 11)


def test_bad_pieces_names_exactly_the_flipped_pieces():
    data = bytearray(os.urandom(7 * P + 100))
    zs = ZoneChecksums()
    zs.add(3, 0, len(data), crcs_of([bytes(data)], len(data)))
    for k in (0, 2, 3, 7):
        data[k * P + 5] ^= 0x10
    (run, lo, hi), = zs.span(3, 0, len(data))
    assert ZoneChecksums.bad_pieces(run, lo, hi, bytes(data), 0) == [k * P for k in (0, 2, 3, 7)]
    (run, lo, hi), = zs.span(3, 4 * P, 2 * P)          # a middle range: no bad piece in it
    a = ZoneChecksums.piece_range(run, lo, hi)[0]
    assert ZoneChecksums.bad_pieces(run, lo, hi, memoryview(data)[a:], a) == []


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 12 * P), st.integers(1, 3 * P + 5)),
    st.tuples(st.just("clip"), st.integers(0, 15 * P), st.just(0))), max_size=12))
def test_end_is_past_the_last_covered_byte_after_any_adds_and_clips(ops):
    """``ZoneChecksums.end`` (kept as runs are added, in order or not, and clipped) is what a
    walk over the runs gives: a mount asks it of every zone."""
    zs = ZoneChecksums()
    for kind, a, n in ops:
        if kind == "add":
            zs.add(5, a, n, array("I", [0] * -(-n // P)))
        else:
            zs.clip(5, a)
        walk = max((r.zoff + r.length for r in zs.runs(5)), default=0)
        assert zs.end(5) == walk


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.one_of(st.integers(1, 3 * P + 5), st.sampled_from([4096, P - 1, P, P + 1])),
                     min_size=1, max_size=5),
       at=st.one_of(st.integers(0, 20 * P), st.sampled_from([0, P - 1, P, P + 1, 2 * P])))
def test_clip_keeps_exactly_the_pieces_wholly_below_the_cut(lens, at):
    """A power cut's lost writes (``MountRecovery.drop_lost_writes``): the runs of a zone
    written back to back, clipped at a write pointer anywhere, keep every piece wholly below
    it with its CRC and nothing else; the returned offset is where verified bytes end."""
    data = os.urandom(sum(lens))
    zs = ZoneChecksums()
    off = 0
    for n in lens:
        zs.add(7, off, n, crcs_of([data[off:off + n]], n))
        off += n
    cut = zs.clip(7, at)
    assert cut <= min(at, off) or (at >= off and cut == at)
    if min(cut, off):
        spans = zs.span(7, 0, min(cut, off))          # all of [0, cut) verifies as before
        assert spans is not None
        for run, lo, hi in spans:
            assert ZoneChecksums.bad_pieces(run, lo, hi, data, 0) == []
    assert zs.end(7) == min(cut, off)
    if cut < off:                                     # nothing at or past the cut is covered
        assert zs.span(7, cut, 1) is None
    # the cut is at a run's start, at ``at`` itself, or at a piece boundary of the run there
    starts = [sum(lens[:i]) for i in range(len(lens))]
    assert cut == at or cut in starts or any(s < cut and (cut - s) % P == 0 for s in starts)
    zs.clip(7, 0)
    assert zs.end(7) == 0 and 7 not in zs.zones


def _direct_fd(tmp_path, size):
    p = tmp_path / "dio"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.ftruncate(fd, size)
    return fd


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nblocks=st.integers(1, 300), cuts=st.lists(st.integers(0, 300 * 4096), max_size=5),
       scratch=st.sampled_from([64 * KiB, 128 * KiB, MiB]), at=st.integers(0, 16),
       rd=st.tuples(st.integers(0, 300 * 4096), st.integers(1, 300 * 4096)))
def test_gather_write_and_aligned_read_round_trip(tmp_path, nblocks, cuts, scratch, at, rd):
    n = nblocks * 4096
    data = os.urandom(n)
    fd = _direct_fd(tmp_path, 4 * MiB)
    try:
        off = at * 4096
        assert I.gather_pwrite(fd, off, _split(data, cuts), n, I.AlignedBuf(scratch)) == n
        with open(tmp_path / "dio", "rb") as f:               # the page cache agrees
            f.seek(off)
            assert f.read(n) == data
        lo = min(rd[0], n - 1)
        ln = min(rd[1], n - lo)
        v = memoryview(I.pread_aligned(fd, off + lo, ln, 4096))   # any alignment
        assert v.nbytes == ln and bytes(v) == data[lo:lo + ln]
    finally:
        os.close(fd)


def test_aligned_buffers_outlive_their_reader_and_are_reused(tmp_path):
    fd = _direct_fd(tmp_path, 4 * MiB)
    try:
        a, b = os.urandom(MiB), os.urandom(MiB)
        with open(tmp_path / "dio", "r+b") as f:
            f.write(a + b)
        va = memoryview(I.pread_aligned(fd, 0, MiB, 4096))     # the view holds the buffer
        vb = memoryview(I.pread_aligned(fd, MiB, MiB, 4096))   # a second, distinct buffer
        assert bytes(va) == a and bytes(vb) == b
        del va                                                 # back to the pool...
        vc = memoryview(I.pread_aligned(fd, 0, MiB, 4096))     # ...reused, not shared with vb
        assert bytes(vb) == b and bytes(vc) == a
        with pytest.raises(OSError) as e:                      # past the end: EIO, not zeros
            I.pread_aligned(fd, 4 * MiB, 4096, 4096)
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        I.pread_aligned(fd, 0, 4096, 4096)                     # closed descriptor
    assert e.value.errno == errno.EBADF


def test_direct_image_routes_small_io_through_the_page_cache(tmp_path):
    """Large zone writes and reads take O_DIRECT; small ones (a small file's padded block) the
    page cache; both read back the same bytes through either path, before and after flush."""
    img = tmp_path / "i.zns"
    D.create_image(img, 32 * MiB, 4 * MiB).close()
    dev = D.ImageZonedDevice(img, direct=True)
    try:
        assert dev.direct
        small, big = os.urandom(4096), os.urandom(D._IMAGE_DIRECT_MIN + 8192)
        dev.write(0, 0, small)
        dev.write(0, 4096, [big[:1000], memoryview(big)[1000:]])
        for z, o, want in ((0, 0, small), (0, 4096, big)):
            assert dev.read(z, o, len(want)) == want
            assert bytes(dev.read_view(z, o, len(want))) == want
        v = dev.read_view(0, 4096 + 100, len(big) - 100)      # unaligned start: still exact
        assert isinstance(v, memoryview) and bytes(v) == big[100:]
        dev.flush()
    finally:
        dev.close()
    dev = D.ImageZonedDevice(img)                              # buffered reopen sees it all
    try:
        assert dev.read(0, 0, 4096 + len(big)) == small + big
    finally:
        dev.close()


def _write_remount_read(m, size: int) -> bytes:
    """Write ``size`` random bytes through mount ``m``, remount, read them back."""
    data = os.urandom(size)
    (m / "f").write_bytes(data)
    m.remount()
    assert (m / "f").read_bytes() == data
    return data


def test_mount_uses_o_direct_and_says_so(make_image, mount_image, tmp_path):
    img = make_image()
    m = mount_image(img)
    assert m.status()["tuning"]["image_io"] == "direct"
    data = _write_remount_read(m, 9 * MiB + 123)
    m.umount()
    b = mount_image(img, "image_io=buffered", name="mb")
    assert b.status()["tuning"]["image_io"] == "buffered"
    assert (b / "f").read_bytes() == data
    b.umount()
    p = subprocess.run([MOUNT, str(img), str(tmp_path / "mb"), "-o", "image_io=fast"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    lines = [ln for ln in (p.stderr + p.stdout).strip().splitlines() if ln]
    assert len(lines) == 1 and "image_io='fast'" in lines[0], lines


def test_an_image_on_a_fuse_host_is_not_opened_with_o_direct(mounted, mount_image):
    """Found by the power-cut campaign: on LazyFS (a FUSE host) the O_DIRECT open and its
    one-block probe sometimes succeeded, the O_DIRECT reads of the metadata zones then failed
    their checksums, and the mount refused a sound image ("no metadata frame passes its
    checksum"; a loop of mount/write/umount through LazyFS hit it within 3-11 mounts).
    ``image_io=auto`` now keeps an image on any FUSE file system on the page cache: here an
    image inside a retainzfs mount, mounted and written through."""
    from conftest import mkfs
    assert D.host_fs_type(str(mounted / "x")).startswith("fuse")
    assert D.host_fs_type("/proc/self") == "proc"
    img = mkfs(mounted.path / "inner.zns", "128M", "4M")
    dev = D.open_device(str(img), direct=None)
    try:
        assert not dev.direct
    finally:
        dev.close()
    inner = mount_image(img, name="inner")
    assert inner.status()["tuning"]["image_io"] == "buffered"
    _write_remount_read(inner, 5 * MiB + 7)
    inner.umount()


def test_write_only_descriptor_and_cached_reader_agree(mounted):
    """A write-only descriptor is opened with FOPEN_DIRECT_IO (no page-cache copy, no
    security.capability lookup per write); a reader that cached the old bytes must see the
    new ones, and so must mmap; the size follows every write."""
    import mmap
    p = mounted / "f"
    old = os.urandom(3 * MiB)
    p.write_bytes(old)
    r = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(r, len(old), 0) == old                # now in the page cache
        new = os.urandom(MiB + 7)
        w = os.open(p, os.O_WRONLY)
        try:
            assert os.pwrite(w, new, 4096) == len(new)       # unaligned user buffer
            assert os.fstat(w).st_size == len(old)
            assert os.pwrite(w, b"tail", len(old)) == 4
            assert os.fstat(r).st_size == len(old) + 4
        finally:
            os.close(w)
        want = old[:4096] + new + old[4096 + len(new):] + b"tail"
        assert os.pread(r, len(want) + 10, 0) == want
        with mmap.mmap(r, 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == want
    finally:
        os.close(r)
    mounted.remount()
    assert p.read_bytes() == want


def test_unprivileged_write_to_a_setuid_file_clears_the_bit(make_image, mount_image):
    """Regression (pjdfstest chmod/12.t, found when write-only descriptors went direct): the
    kernel's cached write path clears S_ISUID/S_ISGID on a write by a process without
    CAP_FSETID; a FOPEN_DIRECT_IO descriptor skips that, so set-ID files keep the cached
    path.  A plain file written the same way keeps its mode."""
    m = mount_image(make_image(), "allow_other")
    for name, mode, want in (("suid", 0o4777, 0o777), ("sgid", 0o2777, 0o777),
                             ("plain", 0o777, 0o777)):
        p = m / name
        p.write_bytes(b"")
        os.chmod(p, mode)
        pid = os.fork()
        if pid == 0:     # child: opens (the test's directories are root-only), then writes as nobody
            try:
                fd = os.open(p, os.O_WRONLY)
                os.setgid(65534)
                os.setuid(65534)
                os.write(fd, b"x")
                os.close(fd)
                os._exit(0)
            except BaseException:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.stat(p).st_mode & 0o7777 == want, (name, oct(os.stat(p).st_mode))
        assert p.read_bytes() == b"x"


# ---------------------------------------------------------------- readahead (readahead.py)

def _store(tmp_path, size=64 * MiB, zone=4 * MiB):
    from retainzfs.store import Store
    path = str(tmp_path / "ra.zns")
    D.create_image(path, size, zone, max_open=6, max_active=8).close()
    dev = D.ImageZonedDevice(path, direct=True)
    Store.format(dev)
    return dev, Store(dev)


def _put(s, name: bytes, data: bytes, reclaim: bytes | None = None) -> int:
    ino = s.create(1, name, 0o644).ino
    if reclaim is not None:
        s.setxattr(ino, b"user.retainz.reclaim", reclaim)
    s.open(ino)
    for i in range(0, len(data), MiB):
        s.write(ino, i, data[i:i + MiB])
    s.commit(ino, durable=True)
    s.release(ino)
    return ino


def _seq(s, ino, n, req=MiB):
    out = bytearray()
    for off in range(0, n, req):
        out += s.read(ino, off, req)
    return bytes(out)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.sampled_from([1, 4095, MiB - 1, 3 * MiB + 5, 9 * MiB + 4097]),
       req=st.sampled_from([4096, 128 * KiB, MiB, 3 * MiB]))
def test_sequential_reads_through_the_windows_are_exact(tmp_path_factory, size, req):
    dev, s = _store(tmp_path_factory.mktemp("ra"))
    try:
        data = os.urandom(size)
        ino = _put(s, b"f", data)
        for _ in range(2):                                     # the second pass starts over
            assert _seq(s, ino, size, req) == data
        for off in (size // 3, 0, size - 1):                   # seeks among the windows
            assert s.read(ino, off, req) == data[off:off + req]
        assert s.check() == []
    finally:
        s.close()
        dev.close()


def test_readahead_serves_hits_and_never_stale_bytes(tmp_path):
    """A sequential reader is served from the windows (``status.readahead``, and with
    no device call via ``read_cached``); an overwrite, a truncate, and a zone reset + rewrite of
    the very zone range that was read ahead are all seen at once."""
    from retainzfs.readahead import START
    dev, s = _store(tmp_path, size=START + 64 * MiB)
    try:
        # windows for the last 24 MiB; what the first pass leaves held (its last 12 MiB) is
        # then more than a window past START, so the second reader's own windows start there
        a = os.urandom(START + 24 * MiB)
        ino = _put(s, b"a", a, b"5")
        assert _seq(s, ino, len(a)) == a
        st = s.status()["readahead"]
        assert st["hits"] >= 8 and st["bytes"] >= 8 * MiB
        before = s.status()["readahead"]["bytes"]
        for base in (9, 2, 12, 5, 0, 7):                       # mmap faults: the kernel reads
            for k in range(4):                                 # 4 MiB around each: no windows
                s.read(ino, base * MiB + k * MiB, MiB)
        time.sleep(0.2)
        assert s.status()["readahead"]["bytes"] == before
        s.open(ino)                                            # a new reader (what the
        for off in range(0, START, MiB):                       # last one read may have left
            s.read(ino, off, MiB)                              # the page cache): from 0...
        for _ in range(200):                                   # ...its windows arrive
            hit = s.reads.read_cached(ino, START, MiB)          # the FUSE read's first try
            if hit is not None:
                break
            time.sleep(0.01)
        assert hit is not None and bytes(hit) == a[START:START + MiB]
        s.release(ino)
        # overwrite the middle, read it again: the new extent's bytes
        new = os.urandom(2 * MiB)
        s.open(ino)
        s.write(ino, 6 * MiB, new)
        s.commit(ino, durable=True)
        s.release(ino)
        want = a[:6 * MiB] + new + a[8 * MiB:]
        assert _seq(s, ino, len(want)) == want
        s.truncate(ino, 5 * MiB + 3)
        assert s.read(ino, 0, 16 * MiB) == want[:5 * MiB + 3]
        # delete it: its zones are reset; a new file lands in them; reading must give the new
        # bytes even if the inode number and zone ranges repeat
        zones_a = {e.zone for e in s.inodes[ino].extents}
        gens = {z: s.zgen[z] for z in zones_a}
        s.unlink(1, b"a")
        s.reset_empty_zones()
        assert any(s.zgen[z] != gens[z] for z in zones_a)
        b = os.urandom(16 * MiB)
        ino_b = _put(s, b"b", b, b"5")
        assert _seq(s, ino_b, len(b)) == b
        assert s.check() == []
    finally:
        s.close()
        dev.close()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar"))


def test_header_hops_do_not_read_a_megabyte_each(mounted):
    """``torch.load`` of each DCP item seeks to its zip records and header, reads a few
    bytes, then the tensor: with st_blksize 1 MiB, Python's buffered reader (the stream DCP
    hands torch.load) refilled 1 MiB for every hop, and a 200 MiB DCP load took 0.46-0.58 s
    instead of 0.34-0.43 s.  The preferred I/O size is 128 KiB now, so the reader's read(2)
    calls bring in little more than the file."""
    item, n = 2 * MiB, 24
    data = os.urandom(item * n)
    (mounted / "ckpt").write_bytes(data)
    mounted.remount()
    before = _rchar()
    with open(mounted / "ckpt", "rb") as f:  # default buffering, as torch.load's stream
        for i in range(n):
            end = (i + 1) * item
            f.seek(end - 22)                 # the item's end record
            assert f.read(22) == data[end - 22:end]
            f.seek(end - 600)                # its central directory
            assert f.read(100) == data[end - 600:end - 500]
            f.seek(i * item)                 # its local header
            assert f.read(64) == data[i * item:i * item + 64]
            f.seek(i * item + 4096)          # the tensor
            assert f.read(item - 8192) == data[i * item + 4096:end - 4096]
    copied = _rchar() - before
    assert copied <= 1.25 * len(data), f"read(2) returned {copied / len(data):.2f}x the file"


def _device_reads(dev):
    """Count the bytes the store reads from the device (both read paths)."""
    seen = [0]
    for name in ("read", "read_view"):
        orig = getattr(dev, name)

        def counted(zone, off, n, _orig=orig):
            seen[0] += n
            return _orig(zone, off, n)
        setattr(dev, name, counted)
    return seen


def test_windows_survive_misses_and_a_step_back(tmp_path):
    """Requests arrive out of order (FUSE keeps several in flight) and a DCP load hops back
    to bytes just behind where it read: neither throws away windows already read, so the
    device reads each byte about once (a miss used to drop every held window, and windows
    behind the reader went at once: the same bytes were read again)."""
    from retainzfs.readahead import START
    dev, s = _store(tmp_path, size=START + 64 * MiB)
    try:
        a = os.urandom(START + 32 * MiB)
        ino = _put(s, b"a", a)
        seen = _device_reads(dev)
        got = {}
        order = list(range(0, START + 4 * MiB, MiB))     # a sequence starts the windows
        for base in range(START + 4 * MiB, len(a), 4 * MiB):    # then pairs out of order, a
            order += [base + MiB, base, base + 2 * MiB, base + 3 * MiB, base - 3 * MiB]
        for off in order:                                # step back of 3 MiB each time
            got[off] = s.read(ino, off, MiB)
            time.sleep(0.005)                            # let the windows arrive
        assert all(v == a[o:o + MiB] for o, v in got.items())
        assert seen[0] <= 1.08 * len(a), f"read {seen[0] / len(a):.2f}x the file"
        assert s.status()["readahead"]["hits"] > 10
    finally:
        s.close()
        dev.close()


@settings(max_examples=120, deadline=None)
@given(n=st.one_of(st.integers(0, 3 * 4096 + 5),
                   st.sampled_from([4095, 4096, 4097, 64 * KiB - 1, 64 * KiB, MiB - 1, MiB,
                                    MiB + 1, 4 * MiB - 48, 4 * MiB])),
       extra=st.sampled_from([0, 1, 48, 4095, 4096]),
       cuts=st.lists(st.integers(0, 4 * MiB), max_size=5))
def test_gather_copies_the_parts_into_aligned_zero_padded_memory(n, extra, cuts):
    """``gather_crc`` (the staging copy a flush makes before io_lock): exactly the parts'
    first ``n`` bytes, then zeros up to the padded length, in page-aligned memory — also when
    the pooled buffer it reuses held other bytes (the pool is dirtied first)."""
    import ctypes
    dirty = _dirty(n + extra)
    del dirty                                        # back to the pool, full of 0xff
    data = os.urandom(n)
    b, _ = I.gather_crc(_split(data, cuts) + [b"tail not taken"], n, n + extra, P)
    v = memoryview(b)
    assert v.nbytes == n + extra and bytes(v) == data + bytes(extra)
    if n + extra:
        assert ctypes.addressof(ctypes.c_char.from_buffer(b)) % 4096 == 0


@settings(max_examples=150, deadline=None)
@given(n=st.one_of(st.integers(0, 7 * P + 5),
                   st.sampled_from([P - 1, P, P + 1, 3 * P - 1, 3 * P, 3 * P + 1, 4095, 4096,
                                    4097, MiB - 48, MiB, 4 * MiB - 48, 4 * MiB])),
       extra=st.sampled_from([0, 1, 48, 4095, 4096, P, 3 * P + 7]),
       cuts=st.lists(st.integers(0, 4 * MiB), max_size=5), hw=st.booleans())
def test_gather_crc_equals_gather_then_crc32c_pieces(n, extra, cuts, hw):
    """The staging of a flush in one pass (copy, checksum each three pieces while cached) gives
    what the two passes gave: the same padded bytes, the same CRC of every piece of them (the
    zero padding included), with and without the CRC32 instruction, from a dirty pool."""
    dirty = _dirty(n + extra)
    del dirty
    data = os.urandom(n)
    parts = _split(data, cuts) + [b"tail not taken"]
    I.set_hardware_crc(hw)
    try:
        buf, crcs = I.gather_crc(parts, n, n + extra, P)
        assert bytes(memoryview(buf)) == data + bytes(extra)
        assert list(crcs) == _ref_pieces(data + bytes(extra), P)
    finally:
        I.set_hardware_crc(True)
    with pytest.raises(ValueError):
        I.gather_crc([data], n + 1, n + 1 + extra, P)     # short parts
    with pytest.raises(ValueError):
        I.gather_crc([data], n, n - 1, P) if n else I.gather_crc([], 1, 0, P)


def test_gather_refuses_short_parts_and_short_padding():
    with pytest.raises(ValueError):
        I.gather_crc([b"x" * 10], 11, 4096, P)
    with pytest.raises(ValueError):
        I.gather_crc([b"x" * 10], 10, 9, P)


@settings(max_examples=150, deadline=None)
@given(size=st.one_of(st.integers(0, 3 * 4096 + 5),
                      st.sampled_from([4095, 4096, 4097, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1,
                                       MiB - 48, MiB - 1, MiB, MiB + 1])),
       cuts=st.lists(st.integers(0, MiB + 1), max_size=4),
       holes=st.lists(st.booleans(), max_size=6), overlay=st.one_of(
           st.none(), st.tuples(st.integers(0, MiB), st.integers(1, 5000))))
def test_assemble_puts_parts_at_their_offsets_and_zeros_the_holes(size, cuts, holes, overlay):
    """``assemble`` (a read reply from extents, readahead windows and buffered bytes) against
    a bytearray model: parts in order, some left out (holes), an overlay written last over
    them; from a pool dirtied first, so a hole that is not zeroed shows."""
    dirty = _dirty(max(size, 1))
    del dirty
    data = os.urandom(size)
    bounds = sorted({min(c, size) for c in cuts} | {0, size})
    model = bytearray(size)
    parts = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if i < len(holes) and holes[i]:
            continue                                  # a hole: zeros
        parts.append((a, memoryview(data)[a:b] if i % 2 else data[a:b]))
        model[a:b] = data[a:b]
    if overlay is not None and size:
        o = overlay[0] % size
        ov = bytes([7]) * min(overlay[1], size - o)
        parts.append((o, ov))
        model[o:o + len(ov)] = ov
    got = memoryview(I.assemble(parts, size))
    assert got.nbytes == size and bytes(got) == bytes(model)


def test_assemble_refuses_a_part_outside_the_reply():
    with pytest.raises(ValueError):
        I.assemble([(4096, b"x")], 4096)
    with pytest.raises(ValueError):
        I.assemble([(-1, b"x")], 4096)


def test_a_dcp_shard_read_backwards_item_by_item_reads_each_byte_about_once(tmp_path):
    """A DCP load with FileSystemWriter(thread_count=4) shards reads each shard's items in
    dictionary order, which there is *backwards* through the file, and each item as
    ``torch.load`` does: a read at its end (the zip records), then from its start.  Windows
    end where the file was read before (the kernel holds those bytes): before, they ran on
    past each item's end into the item read just before, and the device read the shard
    1.5x over."""
    from retainzfs.readahead import START
    dev, s = _store(tmp_path, size=192 * MiB)
    try:
        sizes = [2, 3, 4, 5, 6, 7, 9, 24, 28, 10]      # MiB: two longer than START up to 16 MiB
        a = os.urandom(sum(sizes) * MiB)
        ino = _put(s, b"shard", a)
        seen = _device_reads(dev)
        for off in range(0, START, MiB):                             # (an earlier sequence)
            s.read(ino, len(a) - START + off, MiB)
        starts, pos = [], 0
        for n in sizes:
            starts.append((pos, n * MiB))
            pos += n * MiB
        for start, n in reversed(starts[:-1]):                       # backwards, item by item
            end = start + n
            assert s.read(ino, end - 128 * KiB, 128 * KiB) == a[end - 128 * KiB:end]
            for off in range(start, end - 128 * KiB, MiB):
                want = a[off:min(off + MiB, end - 128 * KiB)]
                assert s.read(ino, off, len(want)) == want
                time.sleep(0.003)                                    # the windows arrive
        assert seen[0] <= 1.1 * len(a), f"read {seen[0] / len(a):.2f}x the shard"
        assert s.status()["readahead"]["hits"] >= 3             # the big items had windows
    finally:
        s.close()
        dev.close()


@settings(max_examples=200, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), max_size=40),
       probe=st.tuples(st.integers(0, 70), st.integers(1, 20)), min_len=st.integers(1, 9))
def test_served_ranges_merge_and_clip_windows_like_a_byte_set(ranges, probe, min_len):
    """The ranges a file's reader was answered lately (``readahead._note_served``) stay
    sorted, disjoint and merged; ``_clip`` cuts a window exactly where the first served byte
    at or after its start is, counting only ranges of ``min_len`` or more — in units here,
    any offsets (bytes) in the store."""
    from retainzfs import readahead as RA
    f = RA._File()
    held = set()
    keep = RA.SERVED
    for a, n in ranges:
        RA._note_served(f, a, a + n)
        held |= set(range(a, a + n))
    r = f.served
    assert all(x[0] < x[1] for x in r) and all(r[i][1] < r[i + 1][0] for i in range(len(r) - 1))
    if len(ranges) <= keep:                   # nothing forgotten: exactly the bytes noted
        assert set().union(*(set(range(a, b)) for a, b in r)) == held
    long = [(a, b) for a, b in r if b - a >= min_len]
    got = set().union(*(set(range(a, b)) for a, b in long)) if long else set()
    start, n = probe
    end = start + n
    cut = next((x for x in range(start, end) if x in got), end)
    assert RA._clip(f, start, end, min_len) == cut


def test_mmap_faults_after_a_sequential_pass_and_a_new_open_read_no_windows(tmp_path):
    """``bench_io`` reads a file in sequence, drops the page cache, then mmaps it anew and
    faults 4 KiB at random places, each of which the kernel widens to 4 MiB of 1 MiB READs.
    Those must not start windows (a rule that started them where a once-sequential reader
    jumped to made this 2x slower, 12 MiB of windows per fault, and took the daemon to
    281 MiB)."""
    dev, s = _store(tmp_path)
    try:
        a = os.urandom(32 * MiB)
        ino = _put(s, b"a", a)
        assert _seq(s, ino, len(a)) == a                      # a sequential pass
        time.sleep(0.1)
        before = s.status()["readahead"]["bytes"]
        s.open(ino)                                           # the mmap's open
        rnd = random.Random(3)
        for _ in range(12):
            base = rnd.randrange(0, 28) * MiB
            for k in range(4):
                assert s.read(ino, base + k * MiB, MiB) == a[base + k * MiB:base + (k + 1) * MiB]
        time.sleep(0.1)
        assert s.status()["readahead"]["bytes"] == before
        s.release(ino)
    finally:
        s.close()
        dev.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_daemon_does_not_grow_with_repeated_parallel_saves_and_loads(make_image, mount_image):
    """8 files written in parallel (1 MiB writes, fsync), then read back cold in parallel, eight
    times over the same names: the daemon's memory levels off.  Found in stop 13: its
    aligned I/O buffers came from the heap, fragmented it, and the daemon grew by ~50 MiB per
    GiB moved without bound (210 -> 600 MiB in eight rounds of bench_io's 8 writers and 8
    readers); they are mapped now, so what the pool does not keep goes back to the kernel."""
    import sys
    import threading
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "scripts"))
    from bench_io import read_file as read, write_file          # bench_io's 8 writers/readers
    from benchutil import drop_caches
    m = mount_image(make_image("2G", "64M"))
    per, req = 32 * MiB, os.urandom(MiB)

    def write(p):
        write_file(p, per, req)

    def both(fn, paths):
        ts = [threading.Thread(target=fn, args=(p,)) for p in paths]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    paths = [str(m / f"w{i}") for i in range(8)]
    seen = []
    for _ in range(8):
        both(write, paths)
        drop_caches()
        both(read, paths)
        seen.append(_rss_mib(m.pid))
    # levels off: the last four rounds stay near the first four's peak (the pools and the
    # allocator warm up over 2-4 rounds: 169 -> 233 MiB by round 4 in a stop-38 CI run, then
    # 231-241; the stop-13 bug grew ~25 MiB every round, ~100 MiB over four)
    assert max(seen[4:]) - max(seen[:4]) < 40, \
        f"daemon RSS by round (MiB): {[round(x) for x in seen]}"
    with open(paths[3], "rb") as f:                  # and the bytes are still the bytes
        assert f.read(MiB) == req


def test_a_file_the_kernel_still_knows_is_read_ahead_right_after_it_was_written(tmp_path):
    """Written in background flushes, closed, and still known to the kernel (a lookup
    reference: its name is cached, as right after a save): the next sequential reader gets
    the windows.  Before, the done background flush counted as buffered bytes for as long
    as the kernel held the name, which kept readahead off (a restore right after a save
    read every request from the device itself: ``readahead.hits`` 0 for a 1 GiB file)."""
    dev, s = _store(tmp_path)
    try:
        a = os.urandom(24 * MiB)
        ino = s.create(1, b"a", 0o644).ino
        s.ref(ino)
        s.open(ino)
        for i in range(0, len(a), MiB):
            s.write(ino, i, a[i:i + MiB])
        s.commit(ino, durable=True)
        s.release(ino)
        s.open(ino)
        assert _seq(s, ino, len(a)) == a
        s.release(ino)
        st = s.status()["readahead"]
        assert st["hits"] >= 4 and st["bytes"] >= 4 * MiB, st
    finally:
        s.close()
        dev.close()
