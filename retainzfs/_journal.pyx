# cython: language_level=3
"""Journal: CRC32C-framed records over the metadata zones.

Why a log in zones: a zoned device only appends, so metadata is a sequence of records
``[crc32c u32][length u32][type u8][payload]`` (crc covers length, type and payload).  A flush
pads the batch to the block size with zeros; a zero length word therefore means "padding, skip
to the next block".  A torn or corrupt record ends replay: it was never acknowledged.

Each metadata zone starts with a SUPER record (the superblock plus a sequence number), then a
full snapshot (SNAP_BEGIN, SNAP_CHUNK..., SNAP_END), then incremental records.  When the active
metadata zone fills, the writer *rolls*: it finishes the old zone (so it needs no active slot),
writes SUPER(seq+1) and a fresh snapshot into the next metadata zone, and only then resets the
old one.  Mount picks the highest sequence number whose snapshot is complete.
"""
import json
import struct

from crc32c import crc32c as _crc32c

MAGIC = "retainzfs"
FORMAT_VERSION = 1

# Record types (stable on-disk numbers).
SUPER = 1
SNAP_BEGIN = 2
SNAP_CHUNK = 3
SNAP_END = 4
INODE = 10          # create/update: full attributes (JSON)
INODE_DEL = 11      # inode freed
DIRENT_ADD = 12
DIRENT_DEL = 13
RENAME = 14
EXTENT = 20         # file range -> zone range (binary, hot path)
TRUNCATE = 21
RELOCATE = 22       # GC moved a live range
ZONE_FINISH = 30
ZONE_RESET = 31

RECORD_NAMES = {SUPER: "super", SNAP_BEGIN: "snap_begin", SNAP_CHUNK: "snap_chunk",
                SNAP_END: "snap_end", INODE: "inode", INODE_DEL: "inode_del",
                DIRENT_ADD: "dirent_add", DIRENT_DEL: "dirent_del", RENAME: "rename",
                EXTENT: "extent", TRUNCATE: "truncate", RELOCATE: "relocate",
                ZONE_FINISH: "zone_finish", ZONE_RESET: "zone_reset"}

_HDR = struct.Struct("<IIB")
_EXTENT = struct.Struct("<QQIQQd")      # ino, file_off, zone, zone_off, length, hint
_RELOC = struct.Struct("<QQQIQIQ")      # ino, file_off, length, old_zone, old_off, new_zone, new_off
_TRUNC = struct.Struct("<QQ")
_ZONE = struct.Struct("<I")
HEADER_SIZE = 9
MAX_RECORD = 1 << 26
SNAP_CHUNK_SIZE = 1 << 20


class JournalError(Exception):
    """A journal that cannot be used (no valid superblock / snapshot)."""


cpdef unsigned int crc32c(data):
    return _crc32c(data)


cpdef bytes encode_record(int rtype, payload):
    """Frame one record."""
    cdef Py_ssize_t n = len(payload)
    if n + 1 > MAX_RECORD:
        raise ValueError("journal record too large")
    body = _HDR.pack(0, n + 1, rtype)[4:] + bytes(payload)
    return struct.pack("<I", _crc32c(body)) + body


def decode_records(buf, Py_ssize_t start=0, Py_ssize_t block_size=4096):
    """Parse records from ``buf``; returns (records, end, clean).

    ``records`` is a list of (type, payload, offset); ``end`` the offset just past the last
    good record (block-aligned when followed by padding); ``clean`` is False when parsing stopped
    at a torn/corrupt record rather than at the end of the data.
    """
    cdef const unsigned char[:] view = memoryview(buf).cast("B")
    cdef Py_ssize_t pos = start, total = view.shape[0], length, nxt
    cdef unsigned int crc
    cdef list out = []
    while pos < total:
        nxt = ((pos // block_size) + 1) * block_size
        if pos + HEADER_SIZE <= total:
            crc = view[pos] | (view[pos + 1] << 8) | (view[pos + 2] << 16) | (<unsigned int>view[pos + 3] << 24)
            length = view[pos + 4] | (view[pos + 5] << 8) | (view[pos + 6] << 16) | (<Py_ssize_t>view[pos + 7] << 24)
            if 0 < length <= MAX_RECORD and pos + 8 + length <= total:
                body = bytes(view[pos + 4:pos + 8 + length])
                if _crc32c(body) == crc:
                    out.append((view[pos + 8], body[5:], pos))
                    pos += 8 + length
                    continue
        # Not a valid record here.  A flush pads its batch with zeros to the block boundary, and
        # that padding may be shorter than a record header (1..8 bytes): zeros up to the next
        # block boundary are padding, whatever their length.
        if _all_zero(view, pos, min(nxt, total)):
            pos = nxt
            continue
        return out, pos, False
    return out, min(pos, total), True


cdef bint _all_zero(const unsigned char[:] view, Py_ssize_t a, Py_ssize_t b):
    cdef Py_ssize_t i
    for i in range(a, b):
        if view[i] != 0:
            return False
    return True


def end_is_blank(buf, Py_ssize_t pos):
    """True when everything from ``pos`` on is zero (a finished zone's unwritten part)."""
    cdef const unsigned char[:] view = memoryview(buf).cast("B")
    return _all_zero(view, pos, view.shape[0])


# ---- payload codecs -------------------------------------------------------------------------

cpdef bytes pack_extent(unsigned long long ino, unsigned long long file_off, unsigned int zone,
                        unsigned long long zone_off, unsigned long long length, double hint):
    return _EXTENT.pack(ino, file_off, zone, zone_off, length, hint)


def unpack_extent(payload):
    return _EXTENT.unpack(payload)


def pack_relocate(ino, file_off, length, old_zone, old_off, new_zone, new_off):
    return _RELOC.pack(ino, file_off, length, old_zone, old_off, new_zone, new_off)


def unpack_relocate(payload):
    return _RELOC.unpack(payload)


def pack_truncate(ino, size):
    return _TRUNC.pack(ino, size)


def unpack_truncate(payload):
    return _TRUNC.unpack(payload)


def pack_zone(zone):
    return _ZONE.pack(zone)


def unpack_zone(payload):
    return _ZONE.unpack(payload)[0]


def pack_json(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(payload):
    return json.loads(bytes(payload))


# ---- the log over metadata zones ------------------------------------------------------------

class Journal:
    """Writer and reader of the metadata log on zones ``[0, meta_zones)`` of ``dev``.

    The caller serialises access (the store holds its I/O lock around flush/roll).
    ``snapshot_fn()`` returns the encoded namespace snapshot (bytes) used when rolling.
    """

    def __init__(self, dev, meta_zones, superblock, snapshot_fn):
        self.dev = dev
        self.meta_zones = meta_zones
        self.superblock = dict(superblock)
        self.snapshot_fn = snapshot_fn
        self.active = 0
        self.seq = int(self.superblock.get("seq", 1))
        self.pending = bytearray()
        self.bytes_written = 0
        self.flushes = 0
        self.rolls = 0

    # -- writing --
    def append(self, int rtype, payload):
        self.pending += encode_record(rtype, payload)

    def has_pending(self):
        return len(self.pending) > 0

    def _padded(self, data):
        bs = self.dev.block_size
        rem = len(data) % bs
        if rem:
            data = bytes(data) + bytes(bs - rem)
        return data

    def prepare(self):
        """Detach pending records (caller holds the namespace lock): a plan for ``commit``.

        Returns None, ("append", padded bytes) or ("roll", image) where the image is a full
        snapshot taken now, which already contains every pending record.
        """
        if not self.pending:
            return None
        data = self._padded(self.pending)
        self.pending = bytearray()
        z = self.dev.zone(self.active)
        if z.capacity - z.wp < len(data):
            return ("roll", self._image(self.seq + 1))
        return ("append", data)

    def commit(self, plan, sync=True):
        """Write a prepared plan (caller holds the I/O lock only); optionally flush the device."""
        if plan is not None:
            if plan[0] == "append":
                z = self.dev.zone(self.active)
                self.dev.write(self.active, z.wp, plan[1])
                self.bytes_written += len(plan[1])
            else:
                self._roll_with(plan[1])
        self.flushes += 1
        if sync:
            self.dev.flush()

    def flush(self, sync=True):
        """prepare + commit in one step (single-threaded users: mkfs, tests, recovery)."""
        self.commit(self.prepare(), sync)

    def _image(self, seq):
        sb = dict(self.superblock)
        sb["seq"] = seq
        out = bytearray(encode_record(SUPER, pack_json(sb)))
        snap = self.snapshot_fn()
        out += encode_record(SNAP_BEGIN, pack_json({"seq": seq, "length": len(snap)}))
        for i in range(0, len(snap), SNAP_CHUNK_SIZE):
            out += encode_record(SNAP_CHUNK, snap[i:i + SNAP_CHUNK_SIZE])
        out += encode_record(SNAP_END, pack_json({"seq": seq}))
        return self._padded(out)

    def roll(self):
        """Snapshot into the next metadata zone, then reset the old one (crash-safe order)."""
        self.pending = bytearray()
        self._roll_with(self._image(self.seq + 1))

    def _roll_with(self, data):
        old = self.active
        new = (old + 1) % self.meta_zones
        if len(data) > self.dev.zone(new).capacity:
            raise OSError(28, "metadata snapshot larger than a metadata zone")
        zn = self.dev.zone(new)
        if zn.wp or zn.cond != 1:
            self.dev.reset(new)
        zo = self.dev.zone(old)
        if zo.cond not in (1, 14):         # free the old zone's open/active slot
            self.dev.finish(old)
        self.dev.write(new, 0, data)
        self.dev.flush()
        self.bytes_written += len(data)
        self.seq += 1
        self.active = new
        self.dev.reset(old)
        self.rolls += 1

    def format(self):
        """mkfs: reset every metadata zone and write SUPER(seq=1) + snapshot into zone 0."""
        for z in range(self.meta_zones):
            self.dev.reset(z)
        self.seq = 1
        data = self._image(1)
        self.dev.write(0, 0, data)
        self.dev.flush()
        self.active = 0

    # -- reading --
    @staticmethod
    def read_zone(dev, zone):
        """Parse one metadata zone: (super, snapshot bytes|None, records after it, clean, end)."""
        z = dev.zone(zone)
        if z.wp == 0:
            return None
        buf = dev.read(zone, 0, z.wp)
        recs, end, clean = decode_records(buf, 0, dev.block_size)
        if not clean and end_is_blank(buf, end):
            clean = True
        if not recs or recs[0][0] != SUPER:
            return None
        try:
            sb = unpack_json(recs[0][1])
        except ValueError:
            return None
        if sb.get("magic") != MAGIC:
            return None
        snap = None
        i = 1
        if i < len(recs) and recs[i][0] == SNAP_BEGIN:
            parts = []
            i += 1
            while i < len(recs) and recs[i][0] == SNAP_CHUNK:
                parts.append(recs[i][1])
                i += 1
            if i < len(recs) and recs[i][0] == SNAP_END:
                snap = b"".join(parts)
                i += 1
        return {"zone": zone, "super": sb, "snapshot": snap, "records": recs[i:],
                "clean": clean, "end": end, "wp": z.wp}

    @classmethod
    def find_latest(cls, dev, meta_zones):
        """The newest metadata zone with a complete snapshot, or raise JournalError."""
        best = None
        seen_super = False
        for zone in range(min(meta_zones, dev.nr_zones)):
            info = cls.read_zone(dev, zone)
            if info is None:
                continue
            seen_super = True
            if info["snapshot"] is None:
                continue
            if best is None or info["super"]["seq"] > best["super"]["seq"]:
                best = info
        if best is None:
            if seen_super:
                raise JournalError("no complete metadata snapshot found (corrupt journal)")
            raise JournalError("no retainzfs superblock in the metadata zones")
        return best


def probe_superblock(dev, meta_zones=3):
    """Return the superblock dict of a formatted device, or None."""
    for zone in range(min(meta_zones, dev.nr_zones)):
        info = Journal.read_zone(dev, zone)
        if info is not None:
            return info["super"]
    return None
