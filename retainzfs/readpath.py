"""Verified reads: file bytes back from zones, checked against their checksums.

Owns the read side of the data path (``datapath.py`` owns placement and the write loop):
reads of file data (``read``, lock-free against resets: a seqlock on the zone generations),
reads answered from the readahead windows (``read_cached``, ``readahead.py``, which this
class owns), the checksum check of every byte served (``verified_read``: EIO on a mismatch,
logged once per piece), and zones out of service (``dev_read``).

Locks: ``Store.lock`` only to look up extents, checksums and zone generations; the device is
read with no lock.  ``read_all_locked`` runs with ``Store.lock`` held (small policy files).
"""
from __future__ import annotations

import errno
import logging

from ._iobuf import assemble
from .csums import ZoneChecksums
from .errors import FsError, StaleRead
from .readahead import ReadAhead

Buffer = bytes | bytearray | memoryview

SEEK_DATA, SEEK_HOLE = 3, 4      # (os.SEEK_DATA / os.SEEK_HOLE on Linux)
#: the unit holes are reported in (ext4's block); ``OpenFiles.gap_locked`` never fills one
HOLE_BLOCK = 4096

log = logging.getLogger("retainzfs")


class ReadPath:
    def __init__(self, store):
        self.s = store
        self.ra = ReadAhead(self)

    def read(self, ino: int, off: int, size: int, view: bool = False) -> Buffer:
        """Bytes of a file; with ``view`` any buffer (the FUSE reply: on the O_DIRECT path the
        device's own read buffer, no copy), else ``bytes``.

        Lock-free against resets (a seqlock on the zone generations): the extents' zones and
        their generations are taken under ``Store.lock``, the device is read with no lock, and
        the read is done again from the lookup if a zone's generation moved meanwhile (a reset
        began: what was read may be the zone's next contents).  So a reset never waits for
        readers and readers never wait for a reset."""
        s = self.s
        ra = self.ra
        while True:
            for attempt in (0, 1):
                with s.lock:
                    inode = s.ns.get_locked(ino)
                    if off >= inode.size or size <= 0:
                        return b""
                    size = min(size, inode.size - off)
                    segs = inode.extents.lookup(off, size)
                    overlay = None
                    if inode.has_buffered():
                        bo, bl = inode.wbuf.off, len(inode.wbuf)
                        lo, hi = max(bo, off), min(bo + bl, off + size)
                        if hi > lo:
                            overlay = (lo - off, inode.wbuf.slice(lo, hi))
                    else:
                        hit = ra.hit_locked(ino, off, size, segs)
                        if hit is not None:
                            return hit if view else bytes(hit)
                    fut = ra.pending_for(ino, off, size) if attempt == 0 else None
                    if fut is None:
                        gens = self.gens_locked(segs)
                        break
                fut.result()              # a window being read covers it: wait, look again
            ra.note_miss(ino, off, size)
            try:
                if len(segs) == 1 and segs[0][0] == 0 and segs[0][3] == size and overlay is None:
                    data = self.verified_read(segs[0][1], segs[0][2], size, ino, off, gens)
                    out = data if view or type(data) is bytes else bytes(data)
                else:
                    parts = [(dst, self.verified_read(zone, zoff, length, ino, off + dst, gens))
                             for dst, zone, zoff, length in segs]
                    if overlay is not None:
                        parts.append(overlay)      # buffered bytes over the zones'
                    out = assemble(parts, size)    # holes read as zeros
            except StaleRead:
                continue
            if not self.gens_hold(gens):
                continue
            return out if view or type(out) is bytes else bytes(out)

    def gens_locked(self, segs) -> dict[int, int]:
        """The generations of the zones under ``segs`` (lookup results), for ``gens_hold``."""
        zgen = self.s.zgen
        return {seg[1]: zgen[seg[1]] for seg in segs}

    def gens_hold(self, gens: dict[int, int]) -> bool:
        """No zone of ``gens`` began a reset since they were taken: bytes read from them are
        the bytes the lookup meant (a reset moves the generation on before it destroys)."""
        s = self.s
        with s.lock:
            zgen = s.zgen
            return all(zgen[z] == g for z, g in gens.items())

    def read_cached(self, ino: int, off: int, size: int) -> Buffer | None:
        """A read answered from the readahead windows (CPU only), or None: then ``read``."""
        s = self.s
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None or off >= inode.size or size <= 0 or inode.has_buffered():
                return None
            size = min(size, inode.size - off)
            return self.ra.hit_locked(ino, off, size, inode.extents.lookup(off, size))

    def seek(self, ino: int, off: int, whence: int) -> int:
        """lseek(2)'s SEEK_DATA / SEEK_HOLE: the next offset at or after ``off`` in data / in a
        hole, counting the extents and the buffered bytes (what ``read`` serves) in whole
        blocks, as ext4 does: a block holding any written byte is data, a hole is whole blocks
        that read as zeros, and the end of the file is a hole.  ENXIO at or past the end, and
        for SEEK_DATA with no data after ``off``.  Without it the kernel answered as if every
        file were dense: ``cp``, ``tar`` and ``scrub`` read every hole of a sparse file."""
        s = self.s
        with s.lock:
            inode = s.ns.get_locked(ino)
            size = inode.size
            if off < 0 or off >= size:
                raise FsError(errno.ENXIO)
            runs = inode.extents.runs_from(off - off % HOLE_BLOCK)    # (off's block may be data)
            if inode.has_buffered() and len(inode.wbuf):
                bo = inode.wbuf.off
                runs = _merged(runs, (bo, bo + len(inode.wbuf)))
            if whence == SEEK_DATA:
                for lo, hi in _blocks(runs, size):
                    if hi > off:
                        return max(lo, off)
                raise FsError(errno.ENXIO)
            pos = off
            for lo, hi in _blocks(runs, size):
                if lo > pos:
                    break
                pos = max(pos, hi)
            return min(pos, size)

    def read_all_locked(self, inode) -> bytes:
        """All of a (small) file: committed extents and buffered bytes (lock held)."""
        assert self.s.lock._is_owned(), "read_all_locked without Store.lock"
        out = bytearray(inode.size)
        for dst, zone, zoff, length in inode.extents.lookup(0, inode.size):
            out[dst:dst + length] = self.verified_read(zone, zoff, length, inode.ino, dst)
        if inode.wbuf:
            o = inode.wbuf.off
            out[o:o + len(inode.wbuf)] = inode.wbuf.slice(o, inode.wbuf.end)
        return bytes(out[:inode.size])

    def verified_read(self, zone: int, zoff: int, length: int, ino: int = 0,
                      file_off: int = 0, gens: dict[int, int] | None = None) -> Buffer:
        """Read committed bytes and check them against their CRC32C pieces; EIO on a mismatch
        (logged once per piece with file, offset and zone; counted in ``checksum_errors``).
        Any buffer (``bytes`` or a view of the device's read buffer): nothing copies it.
        With ``gens`` (a lock-free read, see ``read``): a failure in a zone whose reset began
        meanwhile is ``StaleRead`` (look up again), never an error or a log line."""
        s = self.s
        try:
            with s.lock:
                span = s.csums.span(zone, zoff, length)
            if span is None:
                self._csum_error(zone, zoff, ino, file_off, "no checksum covers the range", gens)
            if not span:
                return self.dev_read(zone, zoff, length)
            a = ZoneChecksums.piece_range(*span[0])[0]
            b = ZoneChecksums.piece_range(*span[-1])[1]
            data = self.dev_read(zone, a, b - a, view=True)
        except (FsError, OSError) as e:
            if gens is not None and not self.gens_hold({zone: gens[zone]}):
                raise StaleRead() from None
            if not isinstance(e, FsError):  # the device (or the image's host) failed it:
                with s.lock:                # a failing disk (``status``, a metric)
                    s.stats["read_errors"] += 1
            raise
        for run, lo, hi in span:
            bad = ZoneChecksums.bad_pieces(run, lo, hi, data, a)
            if bad:
                self._csum_error(zone, bad[0], ino, file_off + max(0, bad[0] - zoff),
                                 "checksum mismatch", gens)
        if a == zoff and b - a == length:
            return data
        return memoryview(data)[zoff - a:zoff - a + length]

    def _csum_error(self, zone: int, zoff: int, ino: int, file_off: int, what: str,
                    gens: dict[int, int] | None = None) -> None:
        s = self.s
        with s.lock:
            if gens is not None and s.zgen[zone] != gens[zone]:
                raise StaleRead()         # the zone was reset under the read: not corruption
            s.stats["checksum_errors"] += 1
            key = (zone, zoff)
            first = key not in s._bad_pieces
            s._bad_pieces.add(key)
            path = s.inodes.path_of(ino) if ino in s.inodes else f"inode {ino}"
        if first:
            log.error("%s: file %s offset %d, zone %d offset %d: returning EIO", what, path,
                      file_off, zone, zoff)
        raise FsError(errno.EIO, f"{what} in zone {zone}")

    def dev_read(self, zone: int, zoff: int, length: int, view: bool = False) -> Buffer:
        """Read committed bytes; EIO for a range a zone failure made untrustworthy.  With
        ``view`` any buffer (``ZonedDevice.read_view``), else ``bytes``."""
        bad = self.s.bad_zones.get(zone)
        if bad is not None:
            upto = bad["valid_upto"]
            if (upto is not None and zoff + length > upto) or bad["reason"] == "offline":
                if not bad.get("logged"):
                    bad["logged"] = True
                    log.error("read from zone %d refused with EIO: %s", zone, bad["reason"])
                raise FsError(errno.EIO, f"zone {zone}: {bad['reason']}")
        dev = self.s.dev
        return dev.read_view(zone, zoff, length) if view else dev.read(zone, zoff, length)


def _merged(runs, extra: tuple[int, int]):
    """``runs`` (sorted (start, end)) with one more run put in its place."""
    pending = True
    for r in runs:
        if pending and extra[0] <= r[0]:
            yield extra
            pending = False
        yield r
    if pending:
        yield extra


def _blocks(runs, size: int):
    """Sorted runs widened to whole blocks (clipped to ``size``), touching ones joined."""
    cur = None
    for lo, hi in runs:
        lo, hi = lo - lo % HOLE_BLOCK, min(-(-hi // HOLE_BLOCK) * HOLE_BLOCK, size)
        if cur is not None and lo <= cur[1]:
            cur = (cur[0], max(cur[1], hi))
            continue
        if cur is not None:
            yield cur
        cur = (lo, hi)
    if cur is not None:
        yield cur
