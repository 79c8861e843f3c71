"""Property tests of the binary namespace snapshot codec (records.py) and its Store-level use.

Round trips of random inodes (names up to NAME_MAX, xattrs, symlink targets, hints with an
infinite reclaim, extents, directory entries, checksum runs), truncation and stray bytes
refused by the codec, and a flipped byte in a snapshot on the device refused (the journal's
chunk CRC) — never a silently different namespace.
"""
from __future__ import annotations

import math
import os
import stat
from array import array

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from retainzfs import _journal as J
from retainzfs import records as R
from retainzfs.device import create_image, open_device
from retainzfs.namespace import Inode, encode_snapshot, load_snapshot
from retainzfs.store import Store, StoreOptions

MiB = 1 << 20
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-2**63, 2**63 - 1)
name = st.binary(min_size=1, max_size=255)
hint = st.tuples(i64, st.one_of(st.just(math.inf), st.floats(allow_nan=False)), i64,
                 st.sampled_from(["xattr", "policy", "none", "gc", "xattr-inherited"]))
extent = st.tuples(u64, u64, u32, u64, st.one_of(st.just(math.inf), st.floats(allow_nan=False)))


@st.composite
def inode_rec(draw):
    fixed = (draw(u64), draw(u32), draw(u32), draw(u32), draw(u32), draw(u64), draw(i64),
             draw(i64), draw(i64), draw(u64), draw(u64))
    xs = draw(st.dictionaries(name, st.binary(max_size=300), max_size=4))
    return R.InodeRec(fixed, draw(st.binary(max_size=255)),
                      draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=4096))),
                      list(xs.items()), draw(st.none() | hint), draw(st.none() | hint),
                      draw(st.binary(max_size=200)), draw(st.lists(extent, max_size=5)),
                      draw(st.lists(st.tuples(name, u64), max_size=5)))


def _same(a: R.InodeRec, b: R.InodeRec) -> bool:
    # floats compare by value (inf == inf); -0.0/0.0 and the like round trip bit-exactly
    def canon(r):
        return repr([list(v) if isinstance(v, (list, tuple)) else v
                     for v in (getattr(r, k) for k in R.InodeRec.__slots__)])
    return a == b and canon(a) == canon(b)


@settings(max_examples=300, deadline=None)
@given(inode_rec())
def test_inode_entry_roundtrip(r):
    b = R.pack_inode(r)
    got, end = R.unpack_inode_from(b + b"tail", 0)
    assert end == len(b) and _same(got, r)
    # the INODE_B record is the entry without extents and dirents
    rec = R.unpack_inode(R.pack_inode(r, with_tables=False))
    assert list(rec.extents) == [] and list(rec.dirents) == []
    assert rec.fixed == r.fixed and list(rec.xattrs) == list(r.xattrs) and rec.hint == r.hint
    # every truncation is refused, never decoded as something else
    for cut in sorted({0, 1, len(b) // 2, len(b) - 1}):
        if cut < len(b):
            with pytest.raises(ValueError):
                R.unpack_inode(b[:cut])
    with pytest.raises(ValueError):
        R.unpack_inode(R.pack_inode(r, with_tables=False) + b"x")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(inode_rec(), max_size=40),
       st.dictionaries(st.integers(0, 2000), st.integers(1, 2**32 - 1), max_size=6),
       st.dictionaries(st.integers(0, 2000), st.lists(
           st.tuples(st.integers(0, 2**40), st.integers(1, 5 * R.CSUM_PIECE)), max_size=4),
           max_size=4),
       u64, i64)
def test_snapshot_roundtrip(recs, zgen, runs, next_ino, now):
    cs = {z: [(zoff, n, array("I", [(zoff + k) & 0xFFFFFFFF
                                    for k in range(-(-n // R.CSUM_PIECE))]))
              for zoff, n in rl] for z, rl in runs.items()}
    blob = R.encode_snapshot(R.SnapshotHeader(next_ino, now, zgen, cs), len(recs), iter(recs))
    assert R.is_binary_snapshot(blob)
    head, count, it = R.decode_snapshot(blob)
    got = list(it)
    assert (head.next_ino, head.now, head.zgen) == (next_ino, now, zgen)
    assert {z: [(a, b, list(c)) for a, b, c in v] for z, v in head.csums.items()} == \
        {z: [(a, b, list(c)) for a, b, c in v] for z, v in cs.items()}
    assert count == len(recs) and len(got) == len(recs)
    assert all(_same(a, b) for a, b in zip(got, recs))


def test_snapshot_count_mismatch_and_truncation_refused():
    r = R.InodeRec((2, stat.S_IFREG | 0o644, 0, 0, 1, 0, 1, 1, 1, 0, 1), b"f")
    with pytest.raises(ValueError):
        R.encode_snapshot(R.SnapshotHeader(3), 2, iter([r]))
    import zlib
    raw = zlib.decompress(R.encode_snapshot(R.SnapshotHeader(3), 3, iter([r, r, r])))
    for cut in (len(raw) - 1, len(raw) - 5, 40):
        with pytest.raises(ValueError):
            list(R.decode_snapshot(zlib.compress(raw[:cut]))[2])
    with pytest.raises(ValueError):
        list(R.decode_snapshot(zlib.compress(raw + b"\0"))[2])


def test_large_entries_cross_decode_windows():
    """Entries larger than the decoder's window (a 64 KiB xattr) and many small ones."""
    big = R.InodeRec((5, stat.S_IFREG | 0o600, 1000, 1000, 1, 7, 1, 2, 3, 0, 1), b"big",
                     xattrs=[(b"user.a", os.urandom(65536)), (b"user.b", os.urandom(65536))],
                     extents=[(i * 4096, 4096, 7 + i, i * 8192, 1.5) for i in range(3000)])
    small = [R.InodeRec((10 + i, stat.S_IFREG | 0o644, 0, 0, 1, i, i, i, i, 0, 1),
                        b"f%07d" % i) for i in range(50000)]
    recs = small[:25000] + [big] + small[25000:]
    _, n, it = R.decode_snapshot(R.encode_snapshot(R.SnapshotHeader(99), len(recs), iter(recs)))
    got = list(it)
    assert n == len(recs) and got == recs


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(name, st.sampled_from(["file", "dir", "link"]),
                          st.dictionaries(name, st.binary(max_size=64), max_size=3),
                          st.none() | hint, st.lists(extent, max_size=3)),
                max_size=30, unique_by=lambda t: t[0]))
# found by hypothesis (stop 14): an extent written before the one it continues merged on reload
# (records applied in order) but not in the live map, so the two snapshots differed
@example([(b"\x00", "file", {}, None, [(0, 2, 1, 0, math.inf), (0, 1, 1, 0, math.inf)])])
def test_namespace_snapshot_roundtrip(items):
    """Inode objects -> snapshot -> Inode objects: every persistent attribute survives."""
    root = Inode(1, stat.S_IFDIR | 0o755, nlink=2, atime=5, mtime=5, ctime=5)
    inodes = {1: root}
    for k, (nm, kind, xs, h, exts) in enumerate(items):
        i = 2 + k
        mode = {"file": stat.S_IFREG | 0o644, "dir": stat.S_IFDIR | 0o700,
                "link": stat.S_IFLNK | 0o777}[kind]
        ino = Inode(i, mode, uid=k, gid=2 * k, atime=k, mtime=k + 1, ctime=k + 2, parent=1,
                    name=nm, target=nm[::-1] if kind == "link" else b"", xattrs=xs)
        from retainzfs.namespace import intern_hint
        ino.hint = intern_hint(h)
        for off, length, zone, zoff, eh in exts:
            # (zone offsets as a device has them: below 2^40, so extents cut by later adds
            # stay representable)
            ino.extmap().add(off % (1 << 40), length % (1 << 30), zone, zoff % (1 << 40), eh)
        inodes[i] = ino
        root.link(nm, i)
    head, got = load_snapshot(encode_snapshot(inodes, R.SnapshotHeader(len(inodes) + 1, 7)))
    assert head.next_ino == len(inodes) + 1 and set(got) == set(inodes)
    for i, a in inodes.items():
        b = got[i]
        assert _same(a.to_rec(), b.to_rec())
        assert dict(a.entries) == dict(b.entries) and dict(a.xattrs) == dict(b.xattrs)
        assert _canon(a.extents) == _canon(b.extents)
    assert [n for n, _ in got[1].entries_after(0)] == list(root.entries)


def _canon(exts) -> list:
    """Extents with contiguous neighbours merged (what ``ExtentMap.add`` makes of them when
    they are added in file order, as a snapshot load does)."""
    out: list = []
    for e in sorted(exts, key=lambda e: e.off):
        p = out[-1] if out else None
        if (p is not None and p[0] + p[1] == e.off and p[2] == e.zone
                and p[3] + p[1] == e.zoff and p[4] == e.hint):
            p[1] += e.length
        else:
            out.append([e.off, e.length, e.zone, e.zoff, e.hint])
    return out


def _store_image(tmp_path, nfiles=300):
    path = str(tmp_path / "s.zns")
    dev = create_image(path, 64 * MiB, 4 * MiB, max_open=8, max_active=8)
    Store.format(dev)
    s = Store(dev)
    d = s.mkdir(1, b"dir", 0o755)
    for k in range(nfiles):
        f = s.create(d.ino, b"file-%05d-" % k + b"x" * 200, 0o644)
        s.open(f.ino)
        s.setxattr(f.ino, b"user.k", b"%d" % k)
        if k % 7 == 0:
            s.write(f.ino, 0, os.urandom(1000 + k))
        s.commit(f.ino, durable=False)
        s.release(f.ino)
    s.symlink(d.ino, b"ln", b"file-00001")
    with s.io_lock:
        s.journal.roll()                      # everything in one snapshot, no log after it
    s.close()
    dev.close()
    return path


def _listing(s):
    return sorted((s.path_of(i.ino), i.mode, i.size, i.nlink, tuple(sorted(i.xattrs.items())),
                   i.target, tuple(e.as_list() for e in i.extents)) for i in s.inodes.values())


def test_store_snapshot_roundtrip_and_flipped_byte_refused(tmp_path):
    path = _store_image(tmp_path)
    dev = open_device(path)
    s = Store(dev)
    want = _listing(s)
    assert len(want) == 303 and s.replayed_records == 1      # (the clean unmount's mark)
    assert s.read(s.lookup(s.lookup(1, b"dir").ino, b"file-00007-" + b"x" * 200).ino, 0, 10)
    s.close()
    dev.close()
    # where the snapshot is: the chunk records of the live log
    dev = open_device(path)
    sb = J.probe_superblock(dev)
    info = J.load(dev, sb)
    pair = info.live[0]
    frames, _, _ = J.read_pair(dev, pair, sb.fsid, dev.block_size)
    doff, zs = dev._data_off, dev.zone_size
    snap_frames = [(off, body) for _, body, off in frames
                   if any(t == R.SNAP_CHUNK for t, _ in J.decode_records(body))]
    assert snap_frames
    dev.close()
    off, body = snap_frames[0]
    import random
    rnd = random.Random(1)
    for trial in range(6):
        pos = doff + 2 * pair * zs + off + J.FRAME_HEADER + rnd.randrange(len(body))
        # flip one byte of the snapshot in BOTH copies: no good copy is left
        with open(path, "r+b") as f:
            olds = []
            for z in (2 * pair, 2 * pair + 1):
                p = pos + (z - 2 * pair) * zs
                f.seek(p)
                old = f.read(1)
                olds.append((p, old))
                f.seek(p)
                f.write(bytes([old[0] ^ 0x5A]))
        dev = open_device(path)
        try:
            with pytest.raises(J.JournalError, match="snapshot"):
                Store(dev)
        finally:
            dev.close()
        # one good copy left: recovered, identical
        with open(path, "r+b") as f:
            p, old = olds[1]
            f.seek(p)
            f.write(old)
        dev = open_device(path)
        s = Store(dev, StoreOptions(readonly=True))
        assert _listing(s) == want and s.meta_problems
        dev.close()
        with open(path, "r+b") as f:
            p, old = olds[0]
            f.seek(p)
            f.write(old)


def test_an_inode_entry_holds_the_most_xattrs_the_store_allows():
    """The entry counts xattrs in a u16: ``XATTR_COUNT_MAX`` of them round-trip (the store
    refuses one more with ENOSPC), and one more than the format holds is refused at packing,
    never written wrapped."""
    from retainzfs.xattrops import XATTR_COUNT_MAX, XATTR_TOTAL_MAX
    xs = [(b"user.%05x" % i, b"") for i in range(XATTR_COUNT_MAX)]
    assert sum(len(k) for k, _ in xs) <= XATTR_TOTAL_MAX          # reachable within the bytes
    r = R.InodeRec((5, stat.S_IFREG | 0o644, 0, 0, 1, 0, 0, 0, 0, 0, 1), b"f", b"", xs,
                   None, None, b"", [], [])
    got = R.unpack_inode(R.pack_inode(r, with_tables=False))
    assert list(got.xattrs) == xs
    r.xattrs = xs + [(b"user.one-more", b"")]
    with pytest.raises(Exception):
        R.pack_inode(r, with_tables=False)


@st.composite
def table_row(draw):
    """A row as the table holds it: mostly plain files (fixed fields, name, maybe a hint,
    extents), some with rare attributes, some with bytes only in a write buffer."""
    plain = draw(st.booleans())
    mode = draw(st.sampled_from([stat.S_IFREG | 0o644, stat.S_IFREG | 0o600,
                                 stat.S_IFLNK | 0o777, stat.S_IFDIR | 0o755]))
    fixed = (0, mode, draw(st.sampled_from([0, 1000, 2**31 - 1])),
             draw(st.sampled_from([0, 1000, 7])), draw(st.integers(0, 2**31)),
             draw(st.integers(0, 2**62)), draw(i64), draw(i64), draw(i64),
             0 if plain else draw(st.integers(0, 2**31)), draw(st.integers(0, 2**40)))
    rec = R.InodeRec(fixed, draw(st.binary(max_size=255)), hint=draw(st.none() | hint))
    if not plain:
        rec.xattrs = list(draw(st.dictionaries(name, st.binary(max_size=50), max_size=2)).items())
        rec.placed = draw(st.none() | hint)
        rec.policy = draw(st.binary(max_size=20))
    exts = draw(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(1, 1 << 24),
                                   st.integers(0, 2**31), st.integers(0, 1 << 30)),
                         max_size=4))
    return rec, exts, draw(st.sampled_from([None, b"", b"buffered"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(table_row(), max_size=25), st.sampled_from([0, 2, 10]))
def test_a_snapshot_packed_from_the_rows_is_the_same_bytes(rows, bits):
    """``snapshot_entries`` packs most files straight from their rows (a roll holds Store.lock
    while it encodes every inode): each entry's bytes are exactly ``pack_inode(to_rec())``'s,
    for plain files with or without hints, uid/gid and extents, files with rare attributes,
    and files whose last bytes are only in a write buffer (their size is the durable one)."""
    from retainzfs.namespace import InodeTable, snapshot_entries
    t = InodeTable(bits)
    for k, (rec, exts, buffered) in enumerate(rows):
        ino = 2 + k * 3
        v = t.new(ino, rec.fixed[1])
        rec.fixed = (ino,) + rec.fixed[1:]
        v.set_rec(rec)
        for off, length, zone, zoff in exts:
            v.extmap().add(off, length, zone, zoff, 1.5)
        if buffered is not None:
            v.wbuf.append(v.size, buffered)
            if buffered:
                v.size += len(buffered)
    fast = [e if type(e) is bytes else R.pack_inode(e) for e in snapshot_entries(t)]
    slow = [R.pack_inode(v.to_rec()) for v in t.values()]
    assert fast == slow


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**64 - 1), i64, name,
       st.none() | st.binary(max_size=8) | st.integers(65530, 65536).map(bytes))
@example(1, 0, b"u", b"")
@example(2**64 - 1, -1, b"n" * 255, bytes(65536))
def test_xattr_record_roundtrip_and_every_cut_or_extension_refused(ino, t, key, value):
    """XATTR_B (one xattr set, or removed: None) round-trips for names of 1-255 bytes and
    values of 0-65,536 (XATTR_SIZE_MAX); a payload cut anywhere, or with a byte more, is
    refused (ValueError), never read as another xattr."""
    p = R.pack_xattr(ino, t, key, value)
    assert R.unpack_xattr(p) == (ino, t, key, value)
    assert R.unpack_xattr(memoryview(p)) == (ino, t, key, value)
    for cut in sorted({0, 1, R._XATTR_B.size - 1, R._XATTR_B.size, len(p) - 1}):
        if cut < len(p):
            with pytest.raises(ValueError):
                R.unpack_xattr(p[:cut])
    with pytest.raises(ValueError):
        R.unpack_xattr(p + b"\0")


def test_xattr_record_refuses_what_no_store_writes():
    """An empty or 256-byte name cannot be packed; an unknown op, an empty name or a removal
    carrying a value cannot be unpacked."""
    for bad in (b"", b"n" * 256):
        with pytest.raises(ValueError):
            R.pack_xattr(1, 0, bad, b"v")
    good = bytearray(R.pack_xattr(1, 0, b"user.a", b"v"))
    op = R._XATTR_B.size - 6                     # the op byte: after ino (8) and ctime (8)
    assert op == 16
    for at, byte in ((op, 2), (op + 1, 0)):
        bad = bytearray(good)
        bad[at] = byte
        with pytest.raises(ValueError):
            R.unpack_xattr(bytes(bad))
    removal = bytearray(R.pack_xattr(1, 0, b"user.a", None)) + b"v"
    removal[R._XATTR_B.size - 4] = 1             # value length 1 on a removal
    with pytest.raises(ValueError):
        R.unpack_xattr(bytes(removal))
