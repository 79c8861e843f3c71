"""The metadata record vocabulary and its payload codecs: the on-disk format, in one place.

``_journal.pyx`` frames records into checksummed, sequence-numbered batches; this module says
what a record means.  Numbers are stable on disk (format v2).
"""
from __future__ import annotations

import json
import struct
import zlib
from array import array

SUPER = 1
SNAP_BEGIN = 2
SNAP_CHUNK = 3
SNAP_END = 4
INODE = 10          # create/update: full attributes (JSON)
INODE_DEL = 11      # inode freed
DIRENT_ADD = 12
DIRENT_DEL = 13
RENAME = 14         # JSON {op, on, np, nn, t}; with "x": 1 (feature ``rename_exchange``)
                    # the two names swap (renameat2 RENAME_EXCHANGE); with "w": [ino, uid,
                    # gid] (feature ``rename_whiteout``) a whiteout inode takes the old name
EXTENT = 20         # file range -> zone range, with the zone's reset generation
TRUNCATE = 21
RELOCATE = 22       # GC moved a live range
CSUM = 23           # CRC32C of each piece of one device write
PUNCH = 24          # file range [start, end) unmapped: a hole (fallocate PUNCH_HOLE/ZERO_RANGE;
                    # feature ``punch_hole``)
ZONE_FINISH = 30
ZONE_RESET = 31     # the zone was reset: its generation is now ``gen``
#: Durability proof (feature ``flush_marks``): every data write named by a CSUM record in a
#: frame numbered <= ``upto`` (ALL_BEFORE: in any frame before this record, or in this one
#: before it) reached the medium before a device flush completed.  Recovery may drop data
#: writes missing from the medium only if no such record proves them (``recovery.Proofs``).
FLUSHED = 32
ALL_BEFORE = (1 << 64) - 1
#: Mount marks (feature ``unmount_marks``, ``lifecycle.mark_log``), with the time.  UNMOUNTED,
#: alone in its frame, ends the log at a clean unmount (and mkfs), written after everything
#: else was durable: so the damage of an acknowledged frame at the end of a cleanly unmounted log has a
#: valid frame after it (damage, not a crash's torn flush), and a log that does not end in one
#: was cut by a crash, whose torn end is what an unfinished flush leaves (``fsck`` notes it,
#: exit 0).  MOUNTED is a read-write mount's first frame, durable before any other: so frames
#: lost after an UNMOUNTED one are damage, never a later mount's unfinished flush.
UNMOUNTED = 33
MOUNTED = 34

NAMES = {SUPER: "super", SNAP_BEGIN: "snap_begin", SNAP_CHUNK: "snap_chunk", SNAP_END: "snap_end",
         INODE: "inode", INODE_DEL: "inode_del", DIRENT_ADD: "dirent_add",
         DIRENT_DEL: "dirent_del", RENAME: "rename", EXTENT: "extent", TRUNCATE: "truncate",
         RELOCATE: "relocate", CSUM: "csum", PUNCH: "punch", ZONE_FINISH: "zone_finish", ZONE_RESET: "zone_reset",
         FLUSHED: "flushed", UNMOUNTED: "unmounted", MOUNTED: "mounted"}

#: bytes covered by one data checksum: small enough that a 4 KiB random read verifies at most
#: two pieces, large enough that the table costs 0.025 % of the data (in RAM and journal)
CSUM_PIECE = 16 << 10
SNAP_CHUNK_SIZE = 1 << 20

_EXTENT = struct.Struct("<QQIIQQd")      # ino, file_off, zone, zgen, zone_off, length, hint
_RELOC = struct.Struct("<QQQIQIIQ")      # ino, file_off, length, old_zone, old_off, new_zone, new_zgen, new_off
_TRUNC = struct.Struct("<QQ")
_PUNCH = struct.Struct("<QQQ")           # ino, start, end
_ZONE = struct.Struct("<I")
_ZGEN = struct.Struct("<II")             # zone, generation
_CSUM = struct.Struct("<IIQQ")           # zone, zgen, zone_off, length; then one u32 per piece


def pack_extent(ino: int, file_off: int, zone: int, zgen: int, zone_off: int, length: int,
                hint: float) -> bytes:
    return _EXTENT.pack(ino, file_off, zone, zgen, zone_off, length, hint)


def unpack_extent(payload) -> tuple:
    return _EXTENT.unpack(payload)


def pack_relocate(ino, file_off, length, old_zone, old_off, new_zone, new_zgen, new_off) -> bytes:
    return _RELOC.pack(ino, file_off, length, old_zone, old_off, new_zone, new_zgen, new_off)


def unpack_relocate(payload) -> tuple:
    return _RELOC.unpack(payload)


def pack_truncate(ino: int, size: int) -> bytes:
    return _TRUNC.pack(ino, size)


def unpack_truncate(payload) -> tuple:
    return _TRUNC.unpack(payload)


def pack_punch(ino: int, start: int, end: int) -> bytes:
    return _PUNCH.pack(ino, start, end)


def unpack_punch(payload) -> tuple:
    return _PUNCH.unpack(payload)


def pack_zone(zone: int) -> bytes:
    return _ZONE.pack(zone)


def unpack_zone(payload) -> int:
    return _ZONE.unpack(payload)[0]


def pack_flushed(upto: int) -> bytes:
    return _U64.pack(upto)


def unpack_flushed(payload) -> int:
    return _U64.unpack(payload)[0]


def pack_mark(t: int) -> bytes:
    """UNMOUNTED / MOUNTED: the time (ns)."""
    return _T.pack(t)


def unpack_mark(payload) -> int:
    return _T.unpack(payload)[0]


def pack_zone_reset(zone: int, gen: int) -> bytes:
    return _ZGEN.pack(zone, gen)


def unpack_zone_reset(payload) -> tuple[int, int]:
    return _ZGEN.unpack(payload)


def pack_csum(zone: int, zgen: int, zone_off: int, length: int, crcs: array) -> bytes:
    return _CSUM.pack(zone, zgen, zone_off, length) + crcs.tobytes()


def unpack_csum(payload) -> tuple[int, int, int, int, array]:
    zone, zgen, zoff, length = _CSUM.unpack_from(payload)
    crcs = array("I")
    crcs.frombytes(bytes(payload[_CSUM.size:]))
    if len(crcs) != -(-length // CSUM_PIECE):
        raise ValueError("csum record: piece count does not match the length")
    return zone, zgen, zoff, length, crcs


def pack_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(payload):
    return json.loads(bytes(payload))


def pack_snapshot(doc: dict) -> bytes:
    """A namespace snapshot: JSON, zlib-compressed (it is rewritten at every roll)."""
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)


def unpack_snapshot(blob: bytes) -> dict:
    return json.loads(zlib.decompress(blob))


# ------------------------------------------------------------------ inodes and snapshots (binary)
#
# INODE_B / DIRENT_B / INODE_DEL_B are the binary forms of INODE / DIRENT_ADD / INODE_DEL
# (written since the namespace went binary; the JSON types are still read, so an image made
# before decodes unchanged).  A namespace snapshot is ``zlib(SNAP_MAGIC + header + zone
# generations + checksum runs + inode entries)``; a JSON snapshot (a blob whose decompressed
# text starts with ``{``) is still read.
#
# One inode entry (the INODE_B payload is the same entry without extents and dirents)::
#
#   fixed  <QIIIIQqqqQQBB  ino, mode, uid, gid, nlink, size, atime, mtime, ctime, rdev, parent,
#                          flags, len(name)
#   name   len(name) bytes (NAME_MAX 255: one byte of length)
#   then, in this order, only the parts whose flag bit is set:
#   F_TARGET   u32 length + symlink target
#   F_XATTRS   u16 count, then per xattr: u8 len(name) + name + u32 len(value) + value
#   F_HINT     <qdq birth, reclaim (inf = anchor), stream + u8 len(source) + source (utf-8)
#   F_PLACED   the same for the hint data already placed were placed with
#   F_POLICY   u32 length + the last valid .retainz text of a directory
#   F_EXTENTS  u32 count, then per extent <QQIQd file offset, length, zone, zone offset, hint
#   F_DIRENTS  u32 count, then per entry: u8 len(name) + name + u64 inode (readdir order)
#
# Snapshot header: ``SNAP_MAGIC`` + <Qq next_ino, now; u32 count + count x <II (zone, reset
# generation) for the zones whose generation is not 0; u32 zone count, per zone <II zone,
# number of runs, per run <QQ zone offset, length + ceil(length / CSUM_PIECE) u32 CRC32C; then
# u64 inode count and the inode entries.  Integrity is the journal's: every snapshot chunk sits
# in a CRC-checked frame, so a damaged byte makes the frame (and the snapshot) invalid before
# this decoder sees it; the decoder still refuses (ValueError) any entry that runs past its
# bounds, an unknown flag, trailing bytes, or a count that does not match.

INODE_B = 15
DIRENT_B = 16
INODE_DEL_B = 17
#: one xattr set or removed, with the inode's new ctime (feature ``xattr_records``): the
#: INODE_B record carries every xattr of the inode, so n sets on one file journaled (and
#: applied) O(n^2) bytes -- 6 ms a set at 4,096 names, stress-ng's ``--xattr`` made no progress
XATTR_B = 18
NAMES.update({INODE_B: "inode_b", DIRENT_B: "dirent_b", INODE_DEL_B: "inode_del_b",
              XATTR_B: "xattr_b"})

SNAP_MAGIC = b"RZS2"
F_TARGET, F_XATTRS, F_HINT, F_PLACED, F_POLICY, F_EXTENTS, F_DIRENTS = 1, 2, 4, 8, 16, 32, 64
_F_ALL = 127

_INO = struct.Struct("<QIIIIQqqqQQBB")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_T = struct.Struct("<q")                  # a time in ns (UNMOUNTED, MOUNTED)
_HINT = struct.Struct("<qdqB")
_EXT = struct.Struct("<QQIQd")
_DIRENT_B = struct.Struct("<QQqB")        # parent, ino, time, len(name); then the name
_XATTR_B = struct.Struct("<QqBBI")        # ino, ctime, op, len(name), len(value); name, value
XATTR_SET, XATTR_REMOVE = 0, 1
_SNAPHDR = struct.Struct("<Qq")
_II = struct.Struct("<II")
_RUN = struct.Struct("<QQ")


class InodeRec:
    """The persistent fields of one inode, as the codec sees them (no behaviour).

    ``fixed`` = (ino, mode, uid, gid, nlink, size, atime, mtime, ctime, rdev, parent); hints are
    (birth, reclaim, stream, source) tuples; ``xattrs`` a list of (name, value); ``extents`` a
    list of (off, length, zone, zoff, hint); ``dirents`` a list of (name, ino)."""
    __slots__ = ("fixed", "name", "target", "xattrs", "hint", "placed", "policy", "extents",
                 "dirents")

    def __init__(self, fixed, name=b"", target=b"", xattrs=(), hint=None, placed=None,
                 policy=b"", extents=(), dirents=()):
        self.fixed, self.name, self.target, self.xattrs = fixed, name, target, xattrs
        self.hint, self.placed, self.policy = hint, placed, policy
        self.extents, self.dirents = extents, dirents

    def __eq__(self, other):
        return isinstance(other, InodeRec) and all(
            _norm(getattr(self, k)) == _norm(getattr(other, k)) for k in self.__slots__)

    def __repr__(self):
        return "InodeRec(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def pack_hint(h) -> bytes:
    """A hint (birth, reclaim, stream, source) as an inode entry holds it."""
    src = h[3].encode("utf-8")
    return _HINT.pack(int(h[0]), float(h[1]), int(h[2]), len(src)) + src


def pack_plain_inode(fixed: tuple, name: bytes, hint: bytes | None, extents) -> bytes:
    """``pack_inode`` of an entry with nothing but its fixed fields, name, hint (packed:
    ``pack_hint``) and extents (objects with ``off, length, zone, zoff, hint``): most files.
    The same bytes, without an InodeRec per inode (a snapshot's fast path)."""
    flags = 0
    tail = []
    if hint is not None:
        flags |= F_HINT
        tail.append(hint)
    if extents:
        flags |= F_EXTENTS
        tail.append(_U32.pack(len(extents)))
        ext = _EXT.pack
        tail += [ext(e.off, e.length, e.zone, e.zoff, e.hint) for e in extents]
    return _entry(fixed, flags, name, tail)


def _entry(fixed: tuple, flags: int, name: bytes, tail: list) -> bytes:
    """An inode entry from its fixed fields, flags, name and packed optional sections."""
    if len(name) > 255:
        raise ValueError("inode name longer than 255 bytes")
    return _INO.pack(*fixed, flags, len(name)) + name + b"".join(tail)


def pack_inode(r: InodeRec, with_tables: bool = True) -> bytes:
    """One inode entry (see above); ``with_tables=False``: the INODE_B record (no extents or
    dirents: those are journaled by their own records)."""
    flags = 0
    tail = []
    if r.target:
        flags |= F_TARGET
        tail += (_U32.pack(len(r.target)), r.target)
    if r.xattrs:
        flags |= F_XATTRS
        tail.append(_U16.pack(len(r.xattrs)))
        for k, v in r.xattrs:
            tail += (_U8.pack(len(k)), k, _U32.pack(len(v)), v)
    if r.hint is not None:
        flags |= F_HINT
        tail.append(pack_hint(r.hint))
    if r.placed is not None:
        flags |= F_PLACED
        tail.append(pack_hint(r.placed))
    if r.policy:
        flags |= F_POLICY
        tail += (_U32.pack(len(r.policy)), r.policy)
    if with_tables and r.extents:
        flags |= F_EXTENTS
        tail.append(_U32.pack(len(r.extents)))
        tail += [_EXT.pack(*e) for e in r.extents]
    if with_tables and r.dirents:
        flags |= F_DIRENTS
        tail.append(_U32.pack(len(r.dirents)))
        for k, i in r.dirents:
            tail += (_U8.pack(len(k)), k, _U64.pack(i))
    return _entry(r.fixed, flags, r.name, tail)


def _unpack_hint(buf, pos):
    b, rc, s, n = _HINT.unpack_from(buf, pos)
    pos += _HINT.size
    src, pos = _take(buf, pos, n, "hint source")
    return (b, rc, s, src.decode("utf-8")), pos


class Short(ValueError):
    """An entry runs past the end of the bytes given (truncated, or a window too small)."""


def _take(buf, pos, n, what):
    end = pos + n
    if end > len(buf):
        raise Short(f"{what} past the end of the entry")
    return bytes(buf[pos:end]), end


def unpack_inode_from(buf, pos: int) -> tuple[InodeRec, int]:
    """(entry, position after it) of the inode entry at ``pos``; ValueError when malformed
    (``Short`` when it runs past the end of ``buf``)."""
    try:
        return _unpack_inode_from(buf, pos)
    except (struct.error, IndexError):
        raise Short("inode entry past the end") from None


def _unpack_inode_from(buf, pos: int) -> tuple[InodeRec, int]:
    f = _INO.unpack_from(buf, pos)
    pos += _INO.size
    flags, nlen = f[11], f[12]
    if not flags:                         # the common case: a plain file without extents
        end = pos + nlen
        if end > len(buf):
            raise Short("name past the end of the entry")
        return InodeRec(f[:11], buf[pos:end] if type(buf) is bytes else bytes(buf[pos:end])), end
    if flags & ~_F_ALL:
        raise ValueError(f"inode entry with unknown flags {flags:#x}")
    name, pos = _take(buf, pos, nlen, "name")
    r = InodeRec(f[:11], name)
    if flags & F_TARGET:
        (n,) = _U32.unpack_from(buf, pos)
        r.target, pos = _take(buf, pos + 4, n, "symlink target")
    if flags & F_XATTRS:
        (cnt,) = _U16.unpack_from(buf, pos)
        pos += 2
        xs = []
        for _ in range(cnt):
            k, pos = _take(buf, pos + 1, buf[pos], "xattr name")
            (n,) = _U32.unpack_from(buf, pos)
            v, pos = _take(buf, pos + 4, n, "xattr value")
            xs.append((k, v))
        r.xattrs = xs
    if flags & F_HINT:
        r.hint, pos = _unpack_hint(buf, pos)
    if flags & F_PLACED:
        r.placed, pos = _unpack_hint(buf, pos)
    if flags & F_POLICY:
        (n,) = _U32.unpack_from(buf, pos)
        r.policy, pos = _take(buf, pos + 4, n, "policy text")
    if flags & F_EXTENTS:
        (cnt,) = _U32.unpack_from(buf, pos)
        pos += 4
        if pos + cnt * _EXT.size > len(buf):
            raise Short("extents past the end of the entry")
        r.extents = list(_EXT.iter_unpack(buf[pos:pos + cnt * _EXT.size]))
        pos += cnt * _EXT.size
    if flags & F_DIRENTS:
        (cnt,) = _U32.unpack_from(buf, pos)
        pos += 4
        ds = []
        for _ in range(cnt):
            k, pos = _take(buf, pos + 1, buf[pos], "dirent name")
            (i,) = _U64.unpack_from(buf, pos)
            pos += 8
            ds.append((k, i))
        r.dirents = ds
    return r, pos


def unpack_inode(payload) -> InodeRec:
    """An INODE_B record; ValueError when malformed or followed by stray bytes."""
    r, pos = unpack_inode_from(payload, 0)
    if pos != len(payload):
        raise ValueError("inode record: bytes after the entry")
    return r


def pack_dirent(parent: int, ino: int, t: int, name: bytes) -> bytes:
    return _DIRENT_B.pack(parent, ino, t, len(name)) + name


def unpack_dirent(payload) -> tuple[int, int, int, bytes]:
    """(parent, ino, time, name) of a DIRENT_B record."""
    p, i, t, n = _DIRENT_B.unpack_from(payload)
    name = bytes(payload[_DIRENT_B.size:])
    if len(name) != n:
        raise ValueError("dirent record: name length does not match")
    return p, i, t, name


def pack_xattr(ino: int, ctime: int, name: bytes, value: bytes | None) -> bytes:
    """An XATTR_B record: ``name`` set to ``value``, or removed (``value`` None)."""
    if not 0 < len(name) <= 255:
        raise ValueError("xattr record: a name of 1-255 bytes")
    if value is None:
        return _XATTR_B.pack(ino, ctime, XATTR_REMOVE, len(name), 0) + name
    return _XATTR_B.pack(ino, ctime, XATTR_SET, len(name), len(value)) + name + value


def unpack_xattr(payload) -> tuple[int, int, bytes, bytes | None]:
    """(ino, ctime, name, value or None: removed) of an XATTR_B record; ValueError if the
    lengths do not match the payload, the op is unknown or a removal carries a value."""
    if len(payload) < _XATTR_B.size:
        raise ValueError("xattr record shorter than its header")
    ino, t, op, n, v = _XATTR_B.unpack_from(payload)
    if op not in (XATTR_SET, XATTR_REMOVE) or n == 0 or (op == XATTR_REMOVE and v):
        raise ValueError("xattr record: bad op, empty name or a value on a removal")
    if len(payload) != _XATTR_B.size + n + v:
        raise ValueError("xattr record: lengths do not match")
    name = bytes(payload[_XATTR_B.size:_XATTR_B.size + n])
    if op == XATTR_REMOVE:
        return ino, t, name, None
    return ino, t, name, bytes(payload[_XATTR_B.size + n:])


def pack_ino(ino: int) -> bytes:
    return _U64.pack(ino)


def unpack_ino(payload) -> int:
    if len(payload) != 8:
        raise ValueError("inode_del record of the wrong size")
    return _U64.unpack(payload)[0]


class SnapshotHeader:
    """What a snapshot holds besides the inodes: next_ino, now, zone generations (zone ->
    generation, non-zero only) and checksum runs (zone -> [(zoff, length, array of CRCs)])."""
    __slots__ = ("next_ino", "now", "zgen", "csums")

    def __init__(self, next_ino: int, now: int = 0, zgen=None, csums=None):
        self.next_ino, self.now = next_ino, now
        self.zgen = zgen or {}
        self.csums = csums or {}


def encode_snapshot(head: SnapshotHeader, count: int, entries) -> bytes:
    """A snapshot blob: ``entries`` yields ``count`` InodeRec; encoded and compressed as they
    come, so neither a list of every entry nor the uncompressed image is ever built."""
    return b"".join(encode_snapshot_parts(head, count, entries))


def encode_snapshot_parts(head: SnapshotHeader, count: int, entries) -> list[bytes]:
    """``encode_snapshot`` as the list of its compressed pieces (a roll cuts them into
    chunks without ever joining them: one copy of a big snapshot in memory, not three).
    An entry may come packed already (``bytes``: ``pack_plain_inode``)."""
    co = zlib.compressobj(1)
    out = []
    buf = [SNAP_MAGIC, _SNAPHDR.pack(head.next_ino, head.now), _U32.pack(len(head.zgen))]
    buf += [_II.pack(z, g) for z, g in sorted(head.zgen.items())]
    buf.append(_U32.pack(len(head.csums)))
    for z, runs in sorted(head.csums.items()):
        buf.append(_II.pack(z, len(runs)))
        for zoff, length, crcs in runs:
            if len(crcs) != -(-length // CSUM_PIECE):
                raise ValueError("checksum run: piece count does not match the length")
            buf += (_RUN.pack(zoff, length), crcs.tobytes() if hasattr(crcs, "tobytes")
                    else array("I", crcs).tobytes())
    buf.append(_U64.pack(count))
    out.append(co.compress(b"".join(buf)))
    buf = []
    size = 0
    n = 0
    for r in entries:
        e = r if type(r) is bytes else pack_inode(r)
        buf.append(e)
        size += len(e)
        n += 1
        if size >= (256 << 10):
            out.append(co.compress(b"".join(buf)))
            buf, size = [], 0
    if n != count:
        raise ValueError(f"snapshot: {n} inode entries for a count of {count}")
    out.append(co.compress(b"".join(buf)))
    out.append(co.flush())
    return out


class _Stream:
    """Decompressed bytes of a snapshot, a window at a time."""

    def __init__(self, blob):
        """``blob``: the compressed bytes, or a list of its pieces in order (the snapshot's
        chunks as read: each is dropped from the list once decompressed, so a mount never
        holds the compressed and the decoded namespace whole at the same time)."""
        self.d = zlib.decompressobj()
        self.parts = blob if isinstance(blob, list) else [blob]
        self.parts.reverse()
        self.src = memoryview(b"")
        self.fed = 0
        self.buf = b""
        self.pos = 0

    def _more_input(self) -> bool:
        while self.fed >= len(self.src):
            if not self.parts:
                return False
            self.src = memoryview(self.parts.pop())
            self.fed = 0
        return True

    def ensure(self, n: int) -> bool:
        """At least ``n`` bytes past ``pos`` in ``buf`` (False: the stream ends first)."""
        while len(self.buf) - self.pos < n:
            if self.d.unconsumed_tail:
                more = self.d.decompress(self.d.unconsumed_tail, 4 << 20)
            elif self._more_input():
                piece = self.src[self.fed:self.fed + (1 << 20)]
                self.fed += len(piece)
                more = self.d.decompress(piece, 4 << 20)
            else:
                return False
            if not more and not self.d.unconsumed_tail and not self._more_input():
                return False
            self.buf = self.buf[self.pos:] + more
            self.pos = 0
        return True

    def take(self, st: struct.Struct):
        if not self.ensure(st.size):
            raise ValueError("snapshot ends inside its header")
        v = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def finished(self) -> bool:
        return not self.ensure(1) and self.d.eof


def decode_snapshot(blob, fast: bool = False) -> tuple[SnapshotHeader, int, object]:
    """(header, inode count, iterator of InodeRec) of a binary snapshot blob (or the list of
    its pieces, consumed).  ``fast``: plain entries come as (fixed, name) tuples, see
    ``_entries_fast``; ``fixed`` then holds flags and name length past the 11 fields.

    The iterator decompresses and decodes as it goes and raises ValueError on anything
    malformed: an entry past the end, fewer or more entries than the count, trailing bytes."""
    s = _Stream(blob)
    if not s.ensure(len(SNAP_MAGIC)) or s.buf[:4] != SNAP_MAGIC:
        raise ValueError("not a binary snapshot")
    s.pos = 4
    next_ino, now = s.take(_SNAPHDR)
    (nz,) = s.take(_U32)
    zgen = dict(s.take(_II) for _ in range(nz))
    (nzones,) = s.take(_U32)
    csums = {}
    for _ in range(nzones):
        z, nruns = s.take(_II)
        runs = []
        for _ in range(nruns):
            zoff, length = s.take(_RUN)
            k = -(-length // CSUM_PIECE) * 4
            if not s.ensure(k):
                raise ValueError("snapshot ends inside a checksum run")
            crcs = array("I")
            crcs.frombytes(s.buf[s.pos:s.pos + k])
            s.pos += k
            runs.append((zoff, length, crcs))
        csums[z] = runs
    (count,) = s.take(_U64)
    return (SnapshotHeader(next_ino, now, zgen, csums), count,
            (_entries_fast if fast else _entries)(s, count))


def _entries_fast(s: _Stream, count: int):
    """Like the entries iterator of ``decode_snapshot``, but a plain entry (no flags: a file
    without extents, xattrs or hint) comes as the 2-tuple (fixed, name) instead of an
    InodeRec — nine in ten inodes of a big namespace, decoded without an object each."""
    ino_size, unpack = _INO.size, _INO.unpack_from
    for _ in range(count):
        while True:
            buf, pos = s.buf, s.pos
            if len(buf) - pos >= ino_size:
                f = unpack(buf, pos)
                if not f[11]:
                    end = pos + ino_size + f[12]
                    if end <= len(buf):
                        s.pos = end
                        yield f, buf[pos + ino_size:end]
                        break
                else:
                    try:
                        r, end = unpack_inode_from(buf, pos)
                        s.pos = end
                        yield r
                        break
                    except Short:
                        pass
            have = len(s.buf) - s.pos
            if not s.ensure(have + (1 << 16)) and len(s.buf) - s.pos == have:
                raise ValueError("snapshot ends inside an inode entry")
    if not s.finished():
        raise ValueError("snapshot: bytes after the last inode entry")


def _entries(s: _Stream, count: int):
    for _ in range(count):
        while True:
            try:
                r, end = unpack_inode_from(s.buf, s.pos)
                break
            except Short:
                # the window ends inside this entry: decompress more, or it is truncated
                have = len(s.buf) - s.pos
                if not s.ensure(have + (1 << 16)) and len(s.buf) - s.pos == have:
                    raise ValueError("snapshot ends inside an inode entry") from None
        s.pos = end
        yield r
    if not s.finished():
        raise ValueError("snapshot: bytes after the last inode entry")


def is_binary_snapshot(blob) -> bool:
    if isinstance(blob, list):
        blob = b"".join(blob[:4]) if blob else b""
    d = zlib.decompressobj()
    out = b""
    try:
        for i in range(0, min(len(blob), 1 << 20), 4096):
            out += d.decompress(bytes(blob[i:i + 4096]), 4 - len(out))
            if len(out) >= 4 or d.eof:
                break
    except zlib.error:
        return False
    return out[:4] == SNAP_MAGIC
