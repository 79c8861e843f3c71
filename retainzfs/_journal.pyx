# cython: language_level=3, boundscheck=True, wraparound=True
"""Metadata log, format v2: checksummed, sequence-numbered frames in mirrored zone pairs.

Why this shape:
* A zoned device only appends, so metadata is a log.  Each flush is one or more *frames*:
  ``[magic 'RZB2'][hcrc u32][seq u64][fsid u32][nbytes u32][nblocks u32][bcrc u32]`` + records +
  explicit zero padding to the block size.  ``hcrc`` covers the header, ``bcrc`` the body *and*
  the padding, so no byte of a metadata zone is unchecked.
* Every frame carries the next sequence number.  A damaged frame followed by valid ones (or a
  gap in the numbers) is corruption in the middle, never "end of log": the reader reports it
  and the store refuses to mount read-write rather than drop acknowledged records (LevelDB's
  log reader reports corruption instead of guessing past it).
* Every frame is written to both zones of a *pair*, at the same offset (btrfs DUP): one damaged
  copy is recovered from the other.
* The log runs through a ring of pairs.  A *roll* writes a fresh snapshot (possibly spanning
  several pairs) starting at a free pair and then resets the pairs before it; rolls happen when
  the log since the last snapshot is at least as large as the snapshot (so the journal costs
  O(records), amortized), or when the ring runs short of free pairs.
* Each pair starts with a SUPER frame (the superblock), so any live pair identifies the device.

This module frames and reads; ``records.py`` says what records mean.
"""
import errno
import struct
import time
from typing import NamedTuple

from crc32c import crc32c as _crc32c

from . import records as R
from .superblock import FormatError, Superblock

FRAME_MAGIC = b"RZB2"
_FH = struct.Struct("<4sIQIIII")         # magic, hcrc, seq, fsid, nbytes, nblocks, bcrc
FRAME_HEADER = _FH.size                  # 32
_REC = struct.Struct("<IB")              # record: length (type + payload), type
REC_HEADER = _REC.size                   # 5
MAX_RECORD = 1 << 26


class JournalError(Exception):
    """A journal that cannot be used (no valid superblock / snapshot)."""


cpdef unsigned int crc32c(data, unsigned int value=0):
    return _crc32c(data, value)


cpdef bytes encode_record(int rtype, payload):
    cdef Py_ssize_t n = len(payload)
    if n + 1 > MAX_RECORD:
        raise ValueError("journal record too large")
    return _REC.pack(n + 1, rtype) + bytes(payload)


def decode_records(body):
    """Records of one verified frame body: [(type, payload)]; ValueError if malformed."""
    out, end = decode_prefix(body)
    if end != len(body):
        raise ValueError(f"record at byte {end} of {len(body)} runs past the frame body")
    return out


def decode_prefix(body):
    """The records of ``body`` up to the first that does not decode, and where that is (the
    body's length when all of them do)."""
    cdef const unsigned char[:] v = memoryview(body).cast("B")
    cdef Py_ssize_t pos = 0, total = v.shape[0], length
    out = []
    mv = memoryview(body)
    while pos + REC_HEADER <= total:
        length = v[pos] | (v[pos + 1] << 8) | (v[pos + 2] << 16) | (<Py_ssize_t>v[pos + 3] << 24)
        if length < 1 or pos + 4 + length > total:
            break
        out.append((v[pos + 4], bytes(mv[pos + 5:pos + 4 + length])))
        pos += 4 + length
    return out, pos


def encode_frame(unsigned long long seq, unsigned int fsid, body, Py_ssize_t bs):
    """One frame: header + body + explicit zero padding, a whole number of blocks."""
    cdef Py_ssize_t nb = len(body)
    cdef Py_ssize_t pad = -(FRAME_HEADER + nb) % bs
    tail = bytes(body) + bytes(pad)
    bcrc = _crc32c(tail)
    rest = struct.pack("<QIIII", seq, fsid, nb, (FRAME_HEADER + nb + pad) // bs, bcrc)
    return FRAME_MAGIC + struct.pack("<I", _crc32c(rest)) + rest + tail


def frame_size(Py_ssize_t nbody, Py_ssize_t bs):
    return FRAME_HEADER + nbody + (-(FRAME_HEADER + nbody) % bs)


cdef bint _zero(const unsigned char[:] v, Py_ssize_t a, Py_ssize_t b):
    cdef Py_ssize_t i
    for i in range(a, b):
        if v[i] != 0:
            return False
    return True


def parse_frame(buf, Py_ssize_t pos, Py_ssize_t bs, unsigned int fsid):
    """(seq, body, nblocks) of a valid frame at ``pos`` of ``buf``, else None."""
    cdef const unsigned char[:] v = memoryview(buf).cast("B")
    cdef Py_ssize_t total = v.shape[0]
    if pos + FRAME_HEADER > total:
        return None
    mv = memoryview(buf)
    if bytes(mv[pos:pos + 4]) != FRAME_MAGIC:
        return None
    magic, hcrc, seq, ffsid, nbytes, nblocks, bcrc = _FH.unpack_from(buf, pos)
    if _crc32c(bytes(mv[pos + 8:pos + FRAME_HEADER])) != hcrc:
        return None
    if fsid and ffsid != fsid:
        return None
    end = pos + nblocks * bs
    if nblocks < 1 or end > total or FRAME_HEADER + nbytes > nblocks * bs:
        return None
    if _crc32c(mv[pos + FRAME_HEADER:end]) != bcrc:
        return None
    if not _zero(v, pos + FRAME_HEADER + nbytes, end):      # padding is explicit: zeros only
        return None
    return seq, bytes(mv[pos + FRAME_HEADER:pos + FRAME_HEADER + nbytes]), nblocks


def is_blank(buf, Py_ssize_t pos):
    cdef const unsigned char[:] v = memoryview(buf).cast("B")
    return _zero(v, pos, v.shape[0])


# ---- reading ----------------------------------------------------------------------------

_WINDOW = 8 << 20                       # bytes of one metadata zone read at a time


class _Copy:
    """One copy (zone) of a pair, read a window at a time: a mount never holds whole
    metadata zones in memory (a ZN540 zone holds a GiB)."""

    def __init__(self, dev, zone):
        self.dev, self.zone = dev, zone
        self.n = dev.zone(zone).wp
        self.base = 0
        self.buf = b""
        self.ok = True
        if self.n:
            try:
                self._fill(0, 1)
            except OSError:
                self.ok = False           # an OFFLINE zone: the mirror has to serve
                self.n = 0

    def _fill(self, pos, n):
        end = min(self.n, pos + max(n, _WINDOW))
        self.buf = self.dev.read(self.zone, pos, end - pos)
        self.base = pos

    def view(self, pos, n):
        """(buffer, offset in it) holding bytes [pos, pos + n) (clipped to the copy)."""
        if pos < self.base or pos + n > self.base + len(self.buf):
            try:
                self._fill(pos, n)
            except OSError:
                self.ok = False
                self.n = pos              # unreadable from here on
                self.buf, self.base = b"", pos
        return self.buf, pos - self.base

    def frame(self, Py_ssize_t pos, Py_ssize_t bs, unsigned int fsid):
        """parse_frame of the frame at ``pos`` of this copy (None: no valid frame there)."""
        if pos + FRAME_HEADER > self.n:
            return None
        buf, r = self.view(pos, FRAME_HEADER)
        if len(buf) < r + FRAME_HEADER or buf[r:r + 4] != FRAME_MAGIC:
            return None
        magic, hcrc, seq, ffsid, nbytes, nblocks, bcrc = _FH.unpack_from(buf, r)
        if _crc32c(buf[r + 8:r + FRAME_HEADER]) != hcrc or nblocks < 1 \
                or pos + nblocks * bs > self.n:
            return None
        buf, r = self.view(pos, nblocks * bs)
        return parse_frame(buf, r, bs, fsid) if len(buf) >= r + nblocks * bs else None

    def blank_from(self, Py_ssize_t pos):
        """Nothing but zeros from ``pos`` to the end of the copy."""
        while pos < self.n:
            buf, r = self.view(pos, min(_WINDOW, self.n - pos))
            if len(buf) <= r:
                return True
            if not is_blank(buf[r:], 0):
                return False
            pos += len(buf) - r
        return True


class Aftermath(str):
    """A problem of the log's end that an unfinished flush leaves when a crash or power cut
    cuts it (a write pointer past the last frame, a mirror short of the last frames): never
    an acknowledged frame, and the mount repairs it.  A plain string where shown; ``fsck``
    tells it from damage by its type (``fsck.Fsck.findings``)."""
    __slots__ = ()


def read_pair(dev, int pair, unsigned int fsid, Py_ssize_t bs):
    """Frames of one pair, each from whichever copy verifies.

    Returns (frames, problems, damage) where frames = [(seq, body, offset)], problems are
    repaired single-copy damages (strings) and damage = [(offset, next_valid_offset|None)] for
    positions where neither copy verifies (None: nothing valid follows — a torn tail)."""
    za, zb = 2 * pair, 2 * pair + 1
    a, b = _Copy(dev, za), _Copy(dev, zb)
    problems = []
    if not a.ok:
        problems.append(f"metadata zone {za} unreadable; using its mirror {zb}")
    if not b.ok:
        problems.append(f"metadata zone {zb} unreadable; using its mirror {za}")
    # copies of unequal length are what a crash between the two writes of a flush leaves (the
    # longer copy's last frame was never acknowledged): not damage; the mount evens them out
    end = max(a.n, b.n)
    frames, damage = [], []
    only_a = only_b = 0               # frames found past the end of the other copy
    cdef Py_ssize_t pos = 0, q
    while pos < end:
        fa = a.frame(pos, bs, fsid)
        fb = b.frame(pos, bs, fsid)
        if fa is not None and fb is not None and fa[0] != fb[0]:
            problems.append(f"metadata zones {za}/{zb} differ at {pos}")
        f = fa if fa is not None else fb
        if f is not None:
            if fa is None and pos < a.n:
                problems.append(f"metadata zone {za} damaged at offset {pos}; mirror {zb} used")
            elif fb is None and pos < b.n:
                problems.append(f"metadata zone {zb} damaged at offset {pos}; mirror {za} used")
            frames.append((f[0], f[1], pos))
            only_a += pos >= b.n
            only_b += pos >= a.n
            pos += f[2] * bs
            continue
        if (pos >= a.n or a.blank_from(pos)) and (pos >= b.n or b.blank_from(pos)):
            break                         # nothing more was written here
        nxt = None
        q = pos + bs
        while q < end:
            if a.frame(q, bs, fsid) is not None or b.frame(q, bs, fsid) is not None:
                nxt = q
                break
            q += bs
        damage.append((pos, nxt))
        if nxt is None:
            break
        pos = nxt
    # A write pointer past the last frame, over bytes never written (finishing a zone moves it
    # to the end, so not a FULL one): frames are written before the pointer moves, so either
    # the zone-table entry is damaged or a power cut kept the entry's write and lost the
    # frames' (an image's page cache writes back in any order; LazyFS torn-seq faults do
    # this).  Never an acknowledged frame: a flush makes both durable.  The mount rolls onto
    # fresh pairs either way.
    for c, z in ((a, za), (b, zb)):
        if c.ok and not damage and pos < c.n and dev.zone(z).cond != 14 and c.blank_from(pos):
            problems.append(Aftermath(
                f"metadata zone {z}: write pointer {c.n} past its last frame (which ends at "
                f"{pos}): frames of an unfinished flush lost by a power cut, or a damaged "
                f"zone-table entry"))
    # A crash between the two writes of a frame leaves one frame in one copy only; more than
    # one means the shorter copy lost frames (a reset or unreadable zone): damage.
    if only_a > 1:
        problems.append(Aftermath(f"metadata zone {zb} lost its last {only_a} frames; mirror "
                                  f"{za} used"))
    if only_b > 1:
        problems.append(Aftermath(f"metadata zone {za} lost its last {only_b} frames; mirror "
                                  f"{zb} used"))
    return frames, problems, damage


def probe_superblock(dev, int max_zones=0):
    """The Superblock of a formatted v2 device, or None; FormatError for another version."""
    cdef int z
    limit = dev.nr_zones if not max_zones else min(max_zones, dev.nr_zones)
    for z in range(limit):
        zi = dev.zone(z)
        if zi.wp == 0:
            continue
        try:
            head = dev.read(z, 0, min(zi.wp, 1 << 16))
        except OSError:
            continue
        f = parse_frame(head, 0, dev.block_size, 0)
        if f is None:
            _raise_if_v1(head)
            continue
        try:
            recs = decode_records(f[1])
        except ValueError:
            continue
        if recs and recs[0][0] == R.SUPER:
            return Superblock.decode(recs[0][1])
    return None


def _raise_if_v1(head):
    """Format v1 started a zone with ``[crc][len][type=1]{json with "version":1}``."""
    if (len(head) > 10 and head[:4] != FRAME_MAGIC and head[8] == 1 and head[9:10] == b"{"
            and b'"magic":"retainzfs"' in head[:4096]):
        import re
        m = re.search(rb'"version":(\d+)', head[:4096])
        v = int(m.group(1)) if m else 1
        raise FormatError(f"retainzfs format version {v} on disk; this retainzfs reads format "
                          f"version 2 only (copy the files to a filesystem made by this version)")


class LogState:
    """What the metadata zones hold, as read at mount."""

    def __init__(self):
        self.sb = None
        self.snapshot = None          # pieces (list of bytes) of the newest complete snapshot
        self.snapshot_partial = False  # only a prefix of it survived (read-only mounts only)
        self.records = Records()      # (type, payload) after it, in order
        self.problems = []            # repaired (single-copy) damage
        self.corrupt = None           # why acknowledged metadata is missing (None: intact)
        self.torn = False             # the last flush was torn (never acknowledged)
        # Feature "unmount_marks": True when the log ends in a clean unmount's frame (R.UNMOUNTED)
        # with nothing torn or lost after it, False when a crash cut it; None for an image made
        # before the feature (no way to tell).  ``unmounted_at``: the time (ns) of the unmount
        # whose frame is the last valid one (set even when something torn or lost follows).
        self.clean = None
        self.unmounted_at = None
        self.next_seq = 1
        self.live = []                # pairs holding the live log, oldest first
        self.active_wp = 0
        self.uneven = False           # the active pair's copies differ in length
        self.snap_bytes = 0
        self.log_bytes = 0


def load(dev, sb):
    """Read the whole log of a v2 device described by ``sb``."""
    cdef Py_ssize_t bs = dev.block_size
    fsid = sb.fsid
    st = LogState()
    st.sb = sb
    pairs = sb.meta_zones // 2
    per_pair = {}
    probs_of = {}                     # pair -> repaired single-copy damage found in it
    frames = []                       # (seq, pair, offset, body)
    for p in range(pairs):
        fr, probs, dmg = read_pair(dev, p, fsid, bs)
        per_pair[p] = dmg
        probs_of[p] = probs
        for seq, body, off in fr:
            frames.append((seq, p, off, body))
    frames.sort()
    if not frames:
        raise JournalError("no metadata frame passes its checksum")
    # the newest snapshot whose frames are all present and contiguous
    snap = None
    i = 0
    n = len(frames)
    while i < n:
        if _first_type(frames[i][3]) == R.SNAP_BEGIN:
            j, parts, ok, done = i, [], True, False
            while j < n and ok and not done:
                if j > i and frames[j][0] != frames[j - 1][0] + 1:
                    ok = False
                    break
                for t, p in _recs(frames[j][3]):
                    if t == R.SNAP_CHUNK:
                        parts.append(p)
                    elif t == R.SNAP_END:
                        done = True
                j += 1
            if ok and done:
                snap = (i, j, parts)
            i = max(j, i + 1)
        else:
            i += 1
    if snap is None:
        snap = _broken_snapshot(frames)
        if snap is None:
            raise JournalError("no complete metadata snapshot found (corrupt journal)")
        first, after, parts, gap = snap
        # The newest snapshot lost frames in both copies.  A read-only mount can still serve
        # what is provable: the snapshot's intact prefix (one zlib stream, so nothing after
        # the gap decodes) and every record logged after the snapshot.
        st.snapshot_partial = True
        st.corrupt = (f"metadata snapshot frames {gap[0]}..{gap[1]} are damaged in both "
                      f"copies")
    else:
        first, after, parts = snap
    st.snapshot = parts                  # (pieces, in order: decoded as a stream)
    del parts, snap
    st.snap_bytes = sum(len(frames[k][3]) for k in range(first, after))
    for k in range(first):               # older frames are not needed any more
        frames[k] = (frames[k][0], frames[k][1], frames[k][2], None)
    for k in range(first, after):
        frames[k] = (frames[k][0], frames[k][1], frames[k][2], None)
    begin_seq = frames[first][0]
    # everything after the snapshot must be there, numbered without gaps
    prev = frames[after - 1][0]
    if st.snapshot_partial and after < n and frames[after][0] != prev + 1:
        prev = frames[after][0] - 1       # the hole in the snapshot ends right before it
    for k in range(after, n):
        seq, p, off, body = frames[k]
        if seq == prev:
            continue                  # the same frame seen twice cannot happen; be safe
        if seq != prev + 1:
            st.corrupt = (f"metadata frames {prev + 1}..{seq - 1} are missing (damaged in both "
                          f"copies)")
            break
        prev = seq
        st.records.bodies.append(body)
        st.records.seqs.append(seq)
        st.log_bytes += len(body)
    st.next_seq = frames[-1][0] + 1
    # live pairs: those holding frames from the snapshot on, in log order
    order = []
    for seq, p, off, body in frames[first:]:
        if p not in order:
            order.append(p)
    st.live = order
    # Only the live pairs matter: a pair holding nothing newer than the snapshot is about to be
    # reset and reused, and a kill between the resets of its two zones (a roll's old pairs,
    # or a pair being started) leaves one copy empty — not damage to anything acknowledged.
    for p in order:
        st.problems += probs_of[p]
    last = order[-1]
    # damage: in the middle of the live log it is corruption; at the very end a torn flush
    for p in order:
        for pos, nxt in per_pair[p]:
            if nxt is not None or p != last:
                if st.corrupt is None:
                    st.corrupt = (f"metadata zones {2 * p}/{2 * p + 1}: both copies damaged at "
                                  f"offset {pos}, with valid frames after it")
            else:
                st.torn = True
    za, zb = dev.zone(2 * last), dev.zone(2 * last + 1)
    st.active_wp = max(za.wp, zb.wp)
    st.uneven = za.wp != zb.wp or st.torn or bool(st.problems)
    if "unmount_marks" in (sb.features or ()):
        body = frames[-1][3]
        for t, p in (_recs(body) if body is not None else ()):
            if t == R.UNMOUNTED:
                st.unmounted_at = R.unpack_mark(p)
        st.clean = (st.unmounted_at is not None and not st.torn
                    and not any(isinstance(q, Aftermath) for q in st.problems))
    return st


def _broken_snapshot(frames):
    """(first, after, prefix_parts, (gap_from, gap_to)) of the newest snapshot whose frames
    have a gap, when its first frame (the header) survived and frames follow the gap; None
    otherwise.  ``after`` indexes the first frame of the records after the snapshot (past
    SNAP_END, or the first frame after the hole that is not a snapshot chunk)."""
    cdef Py_ssize_t n = len(frames), i, j
    for i in range(n - 1, -1, -1):
        if _first_type(frames[i][3]) != R.SNAP_BEGIN:
            continue
        parts, gap = [], None
        j = i
        while j < n:
            if j > i and frames[j][0] != frames[j - 1][0] + 1:
                if gap is not None:
                    return None           # two holes: the log after it is not contiguous
                gap = (frames[j - 1][0] + 1, frames[j][0] - 1)
                if _first_type(frames[j][3]) not in (R.SNAP_CHUNK, R.SNAP_END):
                    return (i, j, parts, gap)    # SNAP_END was in the hole; records follow
            for t, p in _recs(frames[j][3]):
                if t == R.SNAP_CHUNK and gap is None:
                    parts.append(p)
                elif t == R.SNAP_END:
                    return (i, j + 1, parts, gap) if gap is not None else None
            j += 1
        return None
    return None


def _first_type(body):
    return body[4] if len(body) > REC_HEADER else -1


_SKIP = (R.SUPER, R.SNAP_BEGIN, R.SNAP_CHUNK, R.SNAP_END)


class Records:
    """The records after the snapshot, decoded frame by frame as they are iterated (a mount
    never holds a Python object per record).  ``consume()`` iterates once and drops each
    frame body as soon as its records are applied.  SUPER and snapshot records (an
    interrupted later roll) are left out.  ``salvaged``: what ``salvage_records`` said of
    frames that passed their checksum but did not decode (the mount reports them)."""

    def __init__(self):
        self.bodies = []
        self.seqs = []                  # the frame number of each body
        self.salvaged = []              # (frame number, what was done)

    def __iter__(self):
        """A look that keeps the bodies (tests, ``len``, ``==``); it salvages as a mount does
        but records nothing, so looking twice reports nothing twice: ``consume`` reports."""
        for body in self.bodies:
            for t, pl in _recs(body):
                if t not in _SKIP:
                    yield t, pl

    def consume(self):
        for _, recs in self.consume_frames():
            yield from recs

    def consume_frames(self):
        """As ``consume``, frame by frame: (frame number, [(type, payload)])."""
        bodies, self.bodies = self.bodies, []
        seqs, self.seqs = self.seqs, []
        bodies.reverse()
        seqs.reverse()
        while bodies:
            body = bodies.pop()
            seq = seqs.pop() if seqs else -1
            yield seq, [(t, pl) for t, pl in _recs(body, self.salvaged, seq) if t not in _SKIP]

    def __len__(self):
        return sum(1 for _ in self)

    def __eq__(self, other):
        return list(self) == list(other)


def _recs(body, salvaged=None, seq=-1):
    try:
        return decode_records(body)
    except ValueError:
        pass
    recs, what = salvage_records(body)
    if salvaged is not None:
        salvaged.append((seq, what))
    return recs


def salvage_records(body):
    """The records of a frame body that passed its checksum but does not decode: (records,
    what was done).  The one known cause is the journal of stop 26 (format feature
    flush_marks, before this fix): two overlapping device flushes could put a
    FLUSHED(ALL_BEFORE) record inside another record (or inside another such record).
    Those inserted bytes are taken out again, one at a time, each time the one that lets the
    body decode furthest (never less far); if it then decodes whole, every record is back
    (less those proofs, which only makes the mount verify more).  Else the records before
    the first bad one are kept, and the rest of the frame is lost."""
    mark = encode_record(R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))
    ln = len(mark)
    body = bytes(body)
    first = decode_prefix(body)
    cur = body
    removed = 0
    while removed < 64:
        recs, end = decode_prefix(cur)
        if end == len(cur):
            return recs, (f"records decoded whole after taking out {removed} misplaced "
                          f"FLUSHED record(s)")
        best, gain = None, -1
        at = cur.find(mark)
        while at >= 0:
            trial = cur[:at] + cur[at + ln:]
            e2 = decode_prefix(trial)[1]
            g = len(cur) if e2 == len(trial) else e2 - (end - (ln if at < end else 0))
            if g > gain:
                best, gain = trial, g
            at = cur.find(mark, at + 1)
        if best is None:
            break
        cur = best
        removed += 1
    recs, end = first
    return recs, (f"{len(recs)} records kept; the frame's {len(body) - end} bytes from the "
                  f"first that does not decode are lost")


# ---- the log writer ----------------------------------------------------------------------

class Plan(NamedTuple):
    """Records detached by ``Journal.prepare`` for ``commit`` to write."""
    kind: str                 # "append", "next" (in a fresh pair) or "roll" (a snapshot)
    bodies: list              # frame bodies
    raw: bytes                # the records detached
    proves: int | None = None  # newest frame its FLUSHED record proves (-1: all before it)


def split_bodies(body, Py_ssize_t body_max):
    """Frame bodies of at most ``body_max`` bytes, cut at record boundaries (a record
    longer than that gets a frame of its own)."""
    out = []
    mv = memoryview(body)
    start = pos = 0
    total = len(body)
    while pos < total:
        length = int.from_bytes(mv[pos:pos + 4], "little")
        nxt = pos + 4 + length
        if nxt - start > body_max and pos > start:
            out.append(bytes(mv[start:pos]))
            start = pos
        pos = nxt
    if total > start:
        out.append(bytes(mv[start:total]))
    return out


def snapshot_bodies(snap, Py_ssize_t chunk, Py_ssize_t body_max):
    """Frame bodies of a whole snapshot: SNAP_BEGIN, chunks, SNAP_END, small records
    packed together (SNAP_BEGIN with the first chunk, SNAP_END with the last).
    ``snap`` is the blob or its compressed pieces; pieces are cut into chunks as they are
    consumed, so a roll holds one copy of the snapshot, not three."""
    parts = snap if isinstance(snap, list) else [snap]
    total = sum(len(p) for p in parts)
    parts.reverse()
    bodies = []
    cur = bytearray(encode_record(R.SNAP_BEGIN, R.pack_json({"length": total})))

    def add(rec):
        nonlocal cur
        if len(cur) + len(rec) > body_max and cur:
            bodies.append(bytes(cur))
            cur = bytearray()
        cur += rec

    pend = bytearray()
    while parts:
        pend += parts.pop()
        while len(pend) >= chunk:
            add(encode_record(R.SNAP_CHUNK, pend[:chunk]))
            del pend[:chunk]
    if pend:
        add(encode_record(R.SNAP_CHUNK, pend))
    add(encode_record(R.SNAP_END, R.pack_json({"length": total})))
    bodies.append(bytes(cur))
    return bodies


class Journal:
    """Writer of the metadata log over the pairs of zones ``[0, meta_zones)``.

    The caller serialises ``prepare``/``commit`` (the store holds its I/O lock), and holds the
    namespace lock around ``prepare`` only.  ``snapshot_fn()`` returns the snapshot blob.
    """

    def __init__(self, dev, sb, snapshot_fn):
        self.dev = dev
        self.sb = sb
        self.fsid = sb.fsid
        self.bs = dev.block_size
        self.pairs = sb.meta_zones // 2
        self.cap = min(dev.zone(z).capacity for z in range(sb.meta_zones))
        self.chunk = max(self.bs, min(R.SNAP_CHUNK_SIZE, (self.cap // 4) // self.bs * self.bs))
        self.body_max = max(self.chunk + 64, 64 << 10)
        self.roll_floor = min(self.cap // 4, 64 << 20)   # never roll for less log than this
        self.snapshot_fn = snapshot_fn
        self.pending = bytearray()
        self.seq = 1
        self.live = [0]
        self.wp = 0
        self.snap_bytes = 0
        self.log_bytes = 0
        self.bytes_written = 0          # device bytes (both copies)
        self.flushes = 0
        self.rolls = 0
        self.failed = None
        self.ensure_open = None         # store callback: make room within max_open for a zone
        # Room kept at the end of the active pair for records of operations already accepted
        # (and deletions) once neither a next pair nor a fresh snapshot is possible: while
        # ``tight``, the store refuses whatever adds metadata (ENOSPC, as ext4 out of inodes)
        # instead of accepting creates that no flush could ever write.
        self.reserve = min(self.cap // 4, max(self.cap // 8, 32 * self.bs), 64 << 20)
        self.tight = False
        self._tight_log = -1            # log_bytes at the last roll that did not fit
        self._tight_at = 0.0
        # Durability proofs (R.FLUSHED, feature "flush_marks"): ``flushed`` is the newest frame
        # a completed device flush covered (the store notes its flushes: ``note_flushed``),
        # ``marked`` the newest one a FLUSHED record already named.
        self.marks = "flush_marks" in (sb.features or ())
        self.flushed = 0
        self.marked = 0
        self._all_marked = False        # pending holds a FLUSHED(ALL_BEFORE) (``note_flushed``)
        self.epoch = 0                  # times pending records were detached
        # FLUSHED(ALL_BEFORE) records put into pending this epoch: (position in appended
        # bytes, length).  Flush points are taken in appended bytes, not in pending's bytes,
        # which those insertions shift: two overlapping device flushes (A begins, records
        # come, B begins, A ends, B ends) put B's record inside a record otherwise (stop 26:
        # the frame passed its checksum and replay dropped all of it)
        self._inserted = []

    # -- state after mount
    def resume(self, st):
        self.seq = st.next_seq
        self.live = list(st.live)
        self.wp = st.active_wp
        self.snap_bytes = st.snap_bytes
        self.log_bytes = st.log_bytes

    @property
    def active(self):
        return self.live[-1]

    def zones(self, pair):
        return (2 * pair, 2 * pair + 1)

    # -- writing
    def append(self, int rtype, payload):
        self.pending += encode_record(rtype, payload)

    def has_pending(self):
        return len(self.pending) > 0

    def _size(self, bodies):
        return sum(frame_size(len(b), self.bs) for b in bodies)

    def _super_body(self):
        """The SUPER record starting each pair; kept per superblock object (none changes while
        mounted), as the room checks ask for its length and ran ``json.dumps`` each time."""
        c = getattr(self, "_super", None)
        if c is None or c[0] is not self.sb:
            c = self._super = (self.sb, encode_record(R.SUPER, self.sb.encode()))
        return c[1]

    def _free_pairs(self):
        return [p for p in ((self.active + k) % self.pairs for k in range(1, self.pairs))
                if p not in self.live]

    def _pairs_for(self, nbytes):
        return -(-nbytes // max(self.cap - 2 * self.bs - frame_size(len(self._super_body()), self.bs), self.bs))

    def written(self):
        """The number of the newest frame written (a flush begun now covers it and those
        before it)."""
        return self.seq - 1

    def flush_point(self):
        """Where the log stands as a device flush begins: (the newest frame written, the
        pending records' epoch, and their length in appended bytes: ``note_flushed`` adds
        the FLUSHED records put in since).  Taken with the namespace lock held (records
        are queued under it, after the data writes they name completed)."""
        return (self.written(), self.epoch,
                len(self.pending) - sum(n for _, n in self._inserted))

    def _new_epoch(self):
        """Pending records were detached (or put back before others): flush points taken
        before no longer name positions in them."""
        self.epoch += 1
        self._inserted = []

    def note_flushed(self, point):
        """The device flush that began at ``point`` (``flush_point``) completed: it covered
        the frames written then and every data write named by the records queued before it
        began.  The latter are proven by a FLUSHED(ALL_BEFORE) record put right after them,
        if they are still pending (not yet in a frame being written: those frames are proven
        by the next FLUSHED(upto) instead).  Namespace lock held."""
        upto, epoch, pos = point
        self._frames_flushed(upto)
        if self.marks and pos and epoch == self.epoch:
            rec = encode_record(R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))
            at = pos + sum(n for q, n in self._inserted if q <= pos)   # a record boundary
            self.pending[at:at] = rec
            self._inserted.append((pos, len(rec)))
            self._all_marked = True

    def _frames_flushed(self, upto):
        """A device flush covered every frame up to ``upto`` (the log's own flushes)."""
        if upto > self.flushed:
            self.flushed = upto

    def needs_mark(self):
        """A flush covered frames no FLUSHED record names yet (``Store.sync`` then writes
        one on its own, so a quiet log still proves its last data writes)."""
        return self.marks and self.flushed > self.marked

    def _mark(self, force):
        """Before pending records are detached: what they prove once written (the plan's
        ``proves``; ``commit`` moves ``marked``): an ALL_BEFORE record inside them proves
        every frame before; and they end with FLUSHED(newest frame a flush covered) if no
        record named it yet.  That only when records are pending anyway, or ``force``: an
        idle log never grows for a proof.  -1: a frame holding only the proof, which has
        nothing to prove itself."""
        proves = None
        if not self.marks:
            return proves
        if self._all_marked:
            proves = self.written()
            self._all_marked = False
        if (self.pending or force) and self.flushed > max(self.marked, proves or 0):
            alone = not self.pending
            self.pending += encode_record(R.FLUSHED, R.pack_flushed(self.flushed))
            proves = -1 if alone else self.flushed
        return proves

    def prepare(self, mark=False):
        """Detach pending records (caller holds the namespace lock): a plan for ``commit``.

        None, or a ``Plan`` of kind "append", "next" or "roll" where a roll's bodies are a
        whole snapshot taken now (it already holds every pending record).  ``mark``: write the
        proof (R.FLUSHED) even with nothing else pending (``_mark``).  What the plan proves
        travels in it: no state waits on the journal between ``prepare`` and ``commit``."""
        if self.failed is not None:
            raise OSError(errno.EIO, f"metadata log unusable after an earlier write error: "
                                     f"{self.failed}")
        proves = self._mark(mark and self.needs_mark())
        plan = self._detach()
        return None if plan is None else plan._replace(proves=proves)

    def _detach(self):
        if not self.pending:
            if self.tight and self._retry_due():     # deletions may have made room
                return self._roll_if_room(b"")
            return None
        raw = bytes(self.pending)
        self.pending = bytearray()
        self._new_epoch()
        bodies = split_bodies(raw, self.body_max)
        size = self._size(bodies)
        if (self.log_bytes >= max(self.snap_bytes, self.roll_floor)
                and len(self._free_pairs()) >= self._pairs_for(self.snap_bytes * 5 // 4 + self.chunk)):
            # the log since the snapshot outgrew it: a fresh snapshot bounds mount time, and
            # its cost (<= the log it replaces) keeps the journal O(records)
            return self._roll_plan(raw)
        if self.wp + size <= self.cap:
            if self.cap - self.wp - size < self.reserve and not self._next_pair_ok():
                plan = self._roll_if_room(raw, size)    # into the reserve: roll now, if it fits
                if plan is not None:
                    return plan
            return Plan("append", bodies, raw)
        if (self.log_bytes + size >= self.snap_bytes or not self._next_pair_ok()
                or frame_size(len(self._super_body()), self.bs) + size > self.cap):
            return self._roll_plan(raw)
        return Plan("next", bodies, raw)

    def _roll_plan(self, raw):
        bodies = snapshot_bodies(self.snapshot_fn(), self.chunk, self.body_max)
        if len(self._free_pairs()) < self._pairs_for(self._size(bodies)):
            self.pending = bytearray(raw) + self.pending
            self._new_epoch()
            self._set_tight(0)
            raise OSError(errno.ENOSPC, f"metadata zones full: the snapshot needs "
                                        f"{self._pairs_for(self._size(bodies))} free zone pairs, "
                                        f"{len(self._free_pairs())} are free (mkfs --meta-zones)")
        self.tight = False
        return Plan("roll", bodies, raw)

    def _next_pair_ok(self):
        """The log can go on in a fresh pair (``prepare``'s "next") when the active one fills."""
        est = self._pairs_for(max(self.snap_bytes, 1) * 5 // 4 + self.chunk)
        return len(self._free_pairs()) >= est + 2

    def _roll_if_room(self, raw, adding=0):
        """A roll plan if a snapshot taken now fits the free pairs, else None and ``tight``.
        Taking a snapshot costs a pass over the namespace (under its lock): while tight it is
        tried again only when ``_retry_due``."""
        if self.tight and not self._retry_due(adding):
            return None
        bodies = snapshot_bodies(self.snapshot_fn(), self.chunk, self.body_max)
        # room past the reserve (half as much again), so growth goes on for a while before
        # the next snapshot is tried
        if len(self._free_pairs()) >= self._pairs_for(self._size(bodies) + self.reserve * 3 // 2):
            self.tight = False
            return Plan("roll", bodies, raw)
        self._set_tight(adding)           # it would not fit, or leave no room past its end
        return None

    def _set_tight(self, adding):
        """No snapshot fits: refuse growth, and note when it was tried (``_retry_due``)."""
        self.tight = True
        self._tight_log = self.log_bytes + adding
        self._tight_at = time.monotonic()

    def _retry_due(self, adding=0):
        """A tight journal tries a snapshot again: the log (with ``adding`` bytes about to be
        appended: deletions not yet flushed count too) grew by a quarter of the reserve since
        the last try, or five seconds passed."""
        return (self.log_bytes + adding - self._tight_log >= self.reserve // 4
                or time.monotonic() - self._tight_at >= 5.0)

    def growth_ok(self):
        """Records that add metadata (a new name, an xattr) may be accepted without a flush
        deciding first: the log has room beyond the reserve for what is pending, or can go on
        in a fresh pair.  False: ``tight``, or a flush must look (``prepare`` rolls or sets
        ``tight``).  The caller holds the namespace lock."""
        if self.tight:
            return False
        n = len(self.pending)
        pending = n + self.bs * (1 + n // self.body_max)      # frame headers and padding
        return self.wp + pending + self.reserve <= self.cap or self._next_pair_ok()

    def _write_frame(self, body):
        frame = encode_frame(self.seq, self.fsid, body, self.bs)
        za, zb = self.zones(self.active)
        for z in (za, zb):
            if self.ensure_open is not None:
                self.ensure_open(z)
            self.dev.write(z, self.wp, frame)
        self.seq += 1
        self.wp += len(frame)
        self.bytes_written += 2 * len(frame)
        return len(body)

    def _start_pair(self, pair, fresh=False):
        """Begin writing into ``pair`` (``fresh``: a new log starts there, the old pairs are
        no longer live).  ``live`` changes in one assignment: threads holding only the
        namespace lock read it (``growth_ok``) while device calls here let the GIL go."""
        for z in self.zones(pair):
            zi = self.dev.zone(z)
            if zi.wp or zi.cond != 1:
                self.dev.reset(z)
        self.live = [pair] if fresh else self.live + [pair]
        self.wp = 0
        self._write_frame(self._super_body())

    def _release_slots(self):
        """Finish the zones of the active pair so they hold no open/active slot."""
        for z in self.zones(self.active):
            if self.dev.zone(z).cond not in (1, 14):
                self.dev.finish(z)

    def commit(self, plan, sync=True):
        """Write a prepared plan (I/O lock only); optionally flush the device."""
        if plan is not None:
            try:
                self._commit(plan)
            except OSError as e:
                self.failed = str(e)
                raise
            # frames the plan's FLUSHED record proves (a roll: its snapshot maps only data
            # flushed before it, and holds no CSUM record)
            proves = -1 if plan.kind == "roll" else plan.proves
            if proves == -1:
                self.marked = self.written()
            elif proves is not None and proves > self.marked:
                self.marked = proves
        self.flushes += 1
        if sync:
            upto = self.written()
            self.dev.flush()
            self._frames_flushed(upto)

    def _commit(self, plan):
        kind, bodies, raw, _ = plan
        if kind == "roll":
            self._roll_with(bodies)
            return
        for body in bodies:
            if self.wp + frame_size(len(body), self.bs) > self.cap:
                free = self._free_pairs()
                if not free:
                    raise OSError(errno.ENOSPC, "metadata zones full")
                self._release_slots()
                self._start_pair(free[0])
            self.log_bytes += self._write_frame(body)

    def _roll_with(self, bodies):
        # The data the snapshot maps were written before it was taken: durable before it is
        # (recovery takes a snapshot's extents as proven, ``recovery.Proofs``).
        self.dev.flush()
        old = list(self.live)
        free = self._free_pairs()
        self._release_slots()
        size = self._write_spanning(bodies, free)
        upto = self.written()
        self.dev.flush()                  # the new snapshot is durable before the old goes
        self._frames_flushed(upto)
        for p in old:
            for z in self.zones(p):
                if self.dev.zone(z).wp or self.dev.zone(z).cond != 1:
                    self.dev.reset(z)
        self.snap_bytes = size
        self.log_bytes = 0
        self.rolls += 1

    def _write_spanning(self, bodies, free):
        """Write frames from a fresh pair on, moving to the next free pair when one fills."""
        self._start_pair(free.pop(0), fresh=True)
        size = 0
        for body in bodies:
            if self.wp + frame_size(len(body), self.bs) > self.cap:
                if not free:
                    raise OSError(errno.ENOSPC, "metadata zones too small for the snapshot")
                self._release_slots()
                self._start_pair(free.pop(0))
            size += self._write_frame(body)
        return size

    def flush(self, sync=True):
        """prepare + commit in one step (single-threaded users: mkfs, tests, recovery)."""
        self.commit(self.prepare(), sync)

    def roll(self):
        """Write a fresh snapshot now (after mount-time repairs, or to restore redundancy)."""
        raw = bytes(self.pending)
        self.pending = bytearray()
        self._new_epoch()
        self.commit(self._roll_plan(raw), sync=True)

    def format(self):
        """mkfs: reset every metadata zone; SUPER + snapshot into pair 0."""
        for z in range(2 * self.pairs):
            self.dev.reset(z)
        self.seq = 1
        self.live = []
        bodies = snapshot_bodies(self.snapshot_fn(), self.chunk, self.body_max)
        size = self._write_spanning(bodies, list(range(self.pairs)))
        self.snap_bytes = size
        self.dev.flush()
