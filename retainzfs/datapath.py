"""The data path: where bytes go in zones.

Owns placement (the allocator calls, the save-size accounting of ``declare_save``), the open-zone
budget (``Store.open_lru``) and THE write loop (``write``: place, pad, open slot, reserve, write,
checksum, note, journal) used by file data and GC copies alike.  How bytes come back (verified
reads, readahead) is ``readpath.py``'s.

Locks: ``_iolocked`` methods run with ``Store.io_lock`` held (they place data and move write
pointers) and take ``Store.lock`` for the CPU-only bookkeeping; ``_locked`` methods run with
``Store.lock`` held.  File data are written with io_lock held only to place and reserve
(``write``): the device writes of several flushes run in parallel.  Reads take ``Store.lock``
only to look up extents and checksums (``readpath.py``).
"""
from __future__ import annotations

import errno
import logging
from contextlib import nullcontext
from time import perf_counter

from . import hints as H
from . import records as R
from ._alloc import NoSpace
from ._iobuf import PAGE, aligned_parts, assemble, buffer_addresses, gather_crc
from .csums import CSUM_PIECE, crcs_of
from .device import IOV_MAX, ZoneCond
from .errors import FsError
from .writebuf import Chunks

Buffer = bytes | bytearray | memoryview

#: A flush at least this large is staged (``DataPath.stage``) before io_lock: the image's
#: O_DIRECT threshold, below which zone I/O goes through the page cache anyway.
STAGE_MIN = 256 << 10


class Staged:
    """A flush ready for the device, made with no lock held: ``buf`` (``n`` bytes, a multiple
    of the block size) and its checksums.  ``buf`` is the flush's own parts, when each is
    page-aligned and whole blocks long (FUSE write requests land in such buffers, ``_fuse``:
    O_DIRECT takes them as they are, no copy); or a list taking the aligned blocks from the
    parts and copies of the blocks where they meet (``direct_iov``); or one page-aligned,
    block-padded copy of them all.  ``write`` uses it when the bytes go to the device as one run (the usual
    case); a run split where a zone ends falls back to the scatter list."""
    __slots__ = ("buf", "crcs", "n", "direct")

    def __init__(self, buf, crcs, n: int, direct: int = 0) -> None:
        self.buf, self.crcs, self.n = buf, crcs, n
        self.direct = direct            # bytes of ``buf`` that are the requests' own memory


def direct_iov(parts: list, n: int, bs: int) -> tuple[list, int] | None:
    """The scatter list of a flush of ``n`` bytes (``parts``) padded to whole blocks, taking
    every block that lies inside one part at a page-aligned address straight from that part
    and copying only the others (where two parts meet off a block boundary, and the last
    partial block) into small page-aligned buffers.  Returns (buffers, bytes taken as they
    are), or None when less than half the flush could be taken as it is, or the list would
    pass IOV_MAX.

    Why: a file whose first bytes are a small write (the zip header ``torch.save`` and DCP
    write before a tensor) has its large writes at offsets off the file's blocks; their
    arenas hold them at addresses congruent to their offsets (``WriteArenas``), so all but
    the blocks at the seams between parts can go to O_DIRECT with no staging copy."""
    padded = -(-n // bs) * bs
    runs = []                       # (flush lo, flush hi, part, offset in the part)
    s = 0
    for i, (p, a) in enumerate(zip(parts, buffer_addresses(parts))):
        ln = len(p)
        if (a - s) % PAGE == 0:
            lo, hi = -(-s // bs) * bs, (s + ln) // bs * bs
            if hi > lo:
                runs.append((lo, hi, i, lo - s))
        s += ln
    direct = sum(hi - lo for lo, hi, _, _ in runs)
    if 2 * direct < n or 2 * len(runs) + 1 > IOV_MAX:
        return None
    src = Chunks(parts)
    iov: list = []
    pos = 0
    for lo, hi, i, at in runs + [(padded, padded, -1, 0)]:
        if lo > pos:                # blocks no part holds aligned: copied, zeros past n
            pieces, dst = [], 0
            for piece in src.slice(pos, min(lo, n)):
                pieces.append((dst, piece))
                dst += len(piece)
            iov.append(memoryview(assemble(pieces, lo - pos)))
        if hi > lo:
            iov.append(memoryview(parts[i])[at:at + hi - lo])
        pos = hi
    return iov, direct

log = logging.getLogger("retainzfs")


class DataPath:
    def __init__(self, store):
        self.s = store
        # per generation (stream, birth): [expected padded bytes (0 = unknown), bytes placed]
        self.saves: dict[tuple[int, int], list[int]] = {}
        self.save_key: dict[int, tuple[int, int]] = {}    # stream -> its current generation
        self.save_est: dict[int, int] = {}               # stream -> previous generation's size

    # ------------------------------------------------------------------ zones
    def ensure_open_slot_iolocked(self, zone: int) -> None:
        """Close least-recently-used data zones so a write to ``zone`` stays within max_open
        (also the journal's ``ensure_open`` callback, called by its frame writes)."""
        s = self.s
        dev = s.dev
        lru = s.open_lru
        if dev.zone(zone).is_open:
            lru.pop(zone, None)
            lru[zone] = None
            return
        if dev.max_open:
            while dev.open_count() >= dev.max_open:
                # a zone with writes reserved is closed last (the close waits for them)
                victim = next((z for z in lru if z != zone and dev.zone(z).is_open
                               and not dev.pending(z)), None)
                if victim is None:
                    victim = next((z for z in lru if z != zone and dev.zone(z).is_open), None)
                if victim is None:
                    break
                lru.pop(victim)
                dev.close(victim)
        lru[zone] = None

    def ensure_active_slot_iolocked(self, zone: int) -> None:
        """Before a write opens an empty zone at the device's active-zone limit, wait for the
        zones whose last bytes are still being written: the allocator counts a zone full
        once its last bytes are placed, the device only once they land (outside io_lock, on
        another thread).  Without the wait a GC copy opened a zone meanwhile and the
        device refused it (EOVERFLOW, "too many active zones"), which reached a user's write
        (ZenFS, a 64 MiB device kept nearly full while files were overwritten in place)."""
        s = self.s
        dev = s.dev
        if not dev.max_active or dev.active_count() < dev.max_active:
            return
        if dev.zone(zone).cond != ZoneCond.EMPTY:
            return
        for z in range(s.meta_zones, dev.nr_zones):
            if dev.active_count() < dev.max_active:
                return
            if dev.zone(z).is_active:
                with s.lock:
                    full = s.alloc.summary(z)["cond"] == "full"
                if full:
                    self.finish_zone_iolocked(z)    # waits for its writes; FULL by then

    def finish_zone_iolocked(self, z: int) -> None:
        s = self.s
        assert s.io_lock._is_owned(), "finish_zone_iolocked without io_lock"
        if s.dev.zone(z).cond != ZoneCond.FULL:
            s.dev.finish(z)
        s.open_lru.pop(z, None)
        with s.lock:
            s.alloc.note_finish(z)
            s.stats["zone_finishes"] += 1
            s.do_locked(R.ZONE_FINISH, R.pack_zone(z))

    # ------------------------------------------------------------------ placement
    def declare_save(self, ino: int, nbytes: int) -> None:
        """Announce that the generation of ``ino`` (a generation directory or file; its hint
        names the generation) will hold ``nbytes`` block-padded bytes in all.  Optional: it
        feeds the allocator's size adaptation and the common-admission rule; without it the
        store assumes the size of the stream's previous generation.  Run-time only."""
        s = self.s
        with s.lock:
            inode = s.ns.get_locked(ino)
            h = inode.hint or s.hints.resolve_locked(inode)
            self.save_entry_locked(h)[:] = [max(0, int(nbytes)), 0]

    def save_entry_locked(self, hint: H.Hint) -> list[int]:
        """[expected, placed] of the hint's generation (lock held); one entry per stream."""
        assert self.s.lock._is_owned(), "save_entry_locked without Store.lock"
        key = (hint.stream, hint.birth)
        ent = self.saves.get(key)
        if ent is None:
            prev = self.save_key.get(hint.stream)
            if prev is not None and prev in self.saves:
                placed = self.saves.pop(prev)[1]
                if placed:
                    self.save_est[hint.stream] = placed
            self.save_key[hint.stream] = key
            ent = self.saves[key] = [self.save_est.get(hint.stream, 0), 0]
        return ent

    def place_iolocked(self, size: int, hint: H.Hint, allow_reserve: bool = False,
                       writer=None) -> tuple[int, int]:
        """Ask the allocator for a zone for ``size`` padded bytes of file ``writer``.

        When the policy finds no room outside the GC reserve: with common admission, first fill
        a compatible tail (``place(tails_only=True)``); then run GC and retry; when GC cannot
        make progress, common admission borrows the reserve if the rest of the padded save
        (``declare_save``) fits in it.  Otherwise ENOSPC (a capacity stop)."""
        s = self.s
        assert s.io_lock._is_owned(), "place_iolocked without io_lock"
        gc_stuck = False
        for attempt in range(s.dev.nr_zones + 8):
            zone = None
            with s.lock:
                ent = self.save_entry_locked(hint)
                save_size = max(ent[0], size)
                remaining = max(ent[0] - ent[1], size)
                args = (size, hint.reclaim, hint.birth, s.now, hint.stream, save_size)
                ex = s.reclaim.resetting or None    # their generation moved on already
                try:
                    zone, nbytes, finish = s.alloc.place(*args, allow_reserve=allow_reserve,
                                                         writer=writer, exclude=ex)
                except NoSpace:
                    pass
                if zone is None and s.opts.common_admission:
                    try:
                        zone, nbytes, finish = s.alloc.place(*args, tails_only=True,
                                                             exclude=ex)
                    except NoSpace:
                        if gc_stuck and remaining <= s.cap:
                            try:
                                zone, nbytes, finish = s.alloc.place(*args, allow_reserve=True,
                                                                     exclude=ex)
                            except NoSpace:
                                pass
                if zone is not None:
                    ent[1] += nbytes
                    s.capacity_stop = False
            if zone is not None:
                for z in finish:
                    self.finish_zone_iolocked(z)
                return zone, nbytes
            if gc_stuck or not s.reclaim.gc_once_iolocked():
                if not gc_stuck and s.opts.common_admission:
                    gc_stuck = True
                    continue
                self._stop_capacity()
                raise FsError(errno.ENOSPC, "no zone can take the data, even after GC")
        self._stop_capacity()
        raise FsError(errno.ENOSPC, "GC made no progress")

    def _stop_capacity(self) -> None:
        s = self.s
        with s.lock:
            s.stats["enospc"] += 1
            s.capacity_stop = True

    def place_copy_iolocked(self, size: int, hint: H.Hint, victim: int) -> tuple[int, int]:
        """A zone for ``size`` padded bytes of a GC copy out of ``victim``: the GC reserve may
        be used, the victim never; no GC of its own, no save accounting, and a failure is the
        GC pass's (the caller tries another victim), not a capacity stop."""
        s = self.s
        assert s.io_lock._is_owned(), "place_copy_iolocked without io_lock"
        with s.lock:
            args = (size, hint.reclaim, hint.birth, s.now, hint.stream, 0)
            ex = [victim, *s.reclaim.resetting]
            try:
                zone, nbytes, finish = s.alloc.place(*args, allow_reserve=True, exclude=ex)
            except NoSpace:
                if not s.opts.common_admission:
                    raise FsError(errno.ENOSPC) from None
                try:        # common admission: copies may fill compatible tails too
                    zone, nbytes, finish = s.alloc.place(*args, exclude=ex,
                                                         tails_only=True)
                except NoSpace:
                    raise FsError(errno.ENOSPC) from None
        if zone == victim:
            raise FsError(errno.ENOSPC)
        for z in finish:
            self.finish_zone_iolocked(z)
        return zone, nbytes

    def _relocate_locked(self, ino: int, copy_from, pos: int, payload: int, zone: int,
                         zg: int, zoff: int, reclaim) -> None:
        """RELOCATE records for bytes [pos, pos+payload) of a GC copy's packed segments, now
        at ``zone``/``zoff``: the victim's bytes die where the extent moved, the copy's where
        the file changed meanwhile."""
        s = self.s
        victim, segs = copy_from
        dstart = 0
        end = pos + payload
        for foff, length, vzoff in segs:
            a, b = max(pos, dstart), min(end, dstart + length)
            if a < b:
                d = a - dstart
                if s.do_locked(R.RELOCATE, R.pack_relocate(ino, foff + d, b - a, victim,
                                                           vzoff + d, zone, zg,
                                                           zoff + a - pos)):
                    s.alloc.note_dead(victim, b - a, reclaim)
                else:
                    s.reclaim.dead_locked([(zone, b - a, reclaim)])
            dstart += length
            if dstart >= end:
                break

    # ------------------------------------------------------------------ THE write loop
    def stage(self, data: Chunks) -> Staged | None:
        """The CPU half of a write, done before io_lock so it overlaps the device write of
        another file: the CRC32C pieces, and the copy into aligned memory that O_DIRECT needs
        (then written with no further copy) unless the parts are page-aligned whole blocks
        already, as large FUSE writes are (their arenas: ``_fuse``, ``WriteArenas``).  None below
        ``STAGE_MIN``.  No lock needed: ``data`` is a file's in-flight prefix, which only its
        own flush touches, and its parts are never changed once appended."""
        n = len(data)
        if n < STAGE_MIN:
            return None
        bs = self.s.bs
        parts = data.parts
        if not n % bs and aligned_parts(parts, bs):
            return Staged(parts, crcs_of(parts, n), n, n)
        padded = -(-n // bs) * bs
        if bs % PAGE == 0:
            plan = direct_iov(parts, n, bs)
            if plan is not None:
                iov, direct = plan
                return Staged(iov, crcs_of(iov, padded), padded, direct)
        return Staged(*gather_crc(parts, n, padded, CSUM_PIECE), padded)

    def write(self, ino: int, off: int, data: Chunks, hint: H.Hint,
              copy_from: tuple[int, list] | None = None,
              staged: Staged | None = None) -> None:
        """Place and write ``data`` (file offset ``off`` of inode ``ino``), across zones as
        needed: place, pad to blocks, reserve, checksum, write, commit, note, journal.

        ``copy_from=None``: file data, placed by ``place_iolocked``; each piece becomes an
        EXTENT record (what it overwrites is dead).  Called *without* io_lock: it is held
        only to place and reserve each piece; the device write runs with no lock, in
        parallel with other flushes (of other files or of the same zone: the device orders
        their commits, ``ZonedDevice.reserve``), and the piece is recorded in its zone's
        turn, so records stay in zone order.  ``copy_from=(victim, segs)``: a GC copy, with
        io_lock held by the caller throughout, placed by ``place_copy_iolocked``, where
        ``data`` is the concatenation of the segments ``segs`` = [(file_off, length,
        victim_zoff)] of inode ``ino`` (``off`` unused) packed with no padding between them,
        so a file written in many small pieces is not copied block-padded piece by piece
        (which would free nothing).  Each segment (split where a zone ends) becomes a
        RELOCATE record that moves the extent if it still maps those bytes (else that part
        of the copy is dead at once).

        A zone with a reservation outstanding is never reset, finished or closed before it
        is committed (the device waits; ``Reclaim`` skips it), so ``zgen`` taken at the
        reservation is the one the bytes land in.

        ``staged``: ``data`` already copied and checksummed by ``stage``."""
        s = self.s
        gc = copy_from is not None
        assert s.io_lock._is_owned() == gc, "write: io_lock must be held for GC copies only"
        bs = s.bs
        dev = s.dev
        stats = s.stats
        reclaim = hint.reclaim
        pos = 0
        total = len(data)
        while pos < total:
            remaining = total - pos
            padded = -(-remaining // bs) * bs
            t_lock = perf_counter()
            with (nullcontext() if gc else s.io_lock):
                if gc:
                    zone, nbytes = self.place_copy_iolocked(padded, hint, copy_from[0])
                else:
                    try:
                        zone, nbytes = self.place_iolocked(padded, hint, False, ino)
                    except FsError as e:
                        e.landed_end = off + pos    # the file bytes before it are in zones
                        raise
                self.ensure_active_slot_iolocked(zone)
                self.ensure_open_slot_iolocked(zone)
                zoff = dev.reserve(zone, nbytes)
                payload = min(nbytes, remaining)
                pad = nbytes - payload
                with s.lock:          # noted with the placement: the next one comes after
                    zg = s.zgen[zone]
                    s.alloc.note_write(zone, payload, reclaim, True)
                    if pad:
                        s.alloc.note_write(zone, pad, reclaim, False)
                    stats["data_write_s"] += perf_counter() - t_lock
            done = False                  # the turn passed (or the reservation taken back)
            unstaged = 0                  # bytes written from the FUSE requests' own buffers
            try:
                if staged is not None and pos == 0 and nbytes == staged.n:
                    chunk, crcs = staged.buf, staged.crcs     # one run: as staged
                    unstaged = staged.direct
                else:
                    chunk = data.slice(pos, pos + payload)
                    if pad:
                        chunk.append(bytes(pad))
                    crcs = crcs_of(chunk, nbytes)   # on the buffers in hand, before the write
                t_dev = perf_counter()
                dev.write_reserved(zone, zoff, chunk, nbytes)
                t_dev = perf_counter() - t_dev
                dev.commit(zone, zoff, nbytes)       # in the zone's turn from here
                with s.lock:
                    assert s.zgen[zone] == zg, "zone reset under a reservation"
                    s._wgen += 1
                    s.unsynced[ino] = s._wgen
                    stats["device_write_s"] += t_dev
                    stats["unstaged_bytes"] += unstaged
                    s.do_locked(R.CSUM, R.pack_csum(zone, zg, zoff, nbytes, crcs))
                    if not gc:
                        stats["payload_bytes"] += payload
                        stats["pad_bytes"] += pad
                        if ino not in s.inodes:   # deleted while we wrote: dead already
                            s.reclaim.dead_locked([(zone, payload, reclaim)])
                        else:
                            s.reclaim.dead_locked(s.do_locked(R.EXTENT, R.pack_extent(
                                ino, off + pos, zone, zg, zoff, payload, reclaim)))
                    else:
                        stats["gc_copied_bytes"] += nbytes
                        self._relocate_locked(ino, copy_from, pos, payload, zone, zg, zoff,
                                              reclaim)
            except BaseException:
                done = dev.failed(zone, zoff, nbytes)     # taken back: no turn to pass
                self._note_failed(zone, payload, reclaim, done)
                raise
            finally:
                if not done:
                    dev.pass_turn(zone, zoff, nbytes)
            pos += payload

    def _note_failed(self, zone: int, payload: int, reclaim, taken_back: bool) -> None:
        """After ``ZonedDevice.failed``: the payload noted live with the placement is dead,
        and a zone the device finished behind the failed write is finished here too."""
        s = self.s
        with s.lock:
            s.reclaim.dead_locked([(zone, payload, reclaim)])
            if not taken_back:
                s.alloc.note_finish(zone)
                s.stats["zone_finishes"] += 1
                s.do_locked(R.ZONE_FINISH, R.pack_zone(zone))
