"""Reclaim: dead-byte accounting, zone resets and GC.

Owns the set of zones waiting for a reset (``pending``), the zones whose reset has begun
(``resetting``: no placement or GC may choose them) and THE reset sequence, used both for zones
a deletion emptied (``reset_empty_zones``) and for a GC victim (``reset_zones_iolocked``):

1. under ``Store.lock``: keep the zones with nothing live (and not failed); move each zone's
   generation on (a ZONE_RESET record: no extent written before can map onto the zone again;
   a lock-free read that looked the zone up before sees the new generation and reads again);
2. the journal written, then a device flush: the deletions/relocations and the new generations
   are durable before any data is destroyed;
3. reset the zones on the device (``io_lock``: nothing is written to them meanwhile);
4. under ``Store.lock``: allocator summaries, counters, out-of-service marks.

Readers are never waited for (``ReadPath.read`` is a seqlock on the generations).  For zones a
deletion emptied, ``io_lock`` is let go during the device flush of step 2, so writers of other
files never wait for it; a GC victim's reset runs inside the writer's own placement, which is
waiting for that space anyway.

GC picks victims from the allocator's summaries and moves their live extents through the data
path's write loop (``DataPath.write`` with ``copy_from``).  A victim must free at least
``GC_MIN_GAIN`` of a zone beyond its copies: on a device full of nearly-live zones (a few KiB of
padding dead in each) a pass would copy a whole zone to free a few KiB, the writer would use
them at once, and GC would run without end instead of the writer getting ENOSPC.
"""
from __future__ import annotations

import errno
import logging

from . import hints as H
from . import records as R
from .errors import FsError
from .writebuf import Chunks

log = logging.getLogger("retainzfs")

GC_MIN_GAIN = 1 / 8     # of a zone's capacity: at most 7 bytes copied per byte a GC pass frees


class Reclaim:
    def __init__(self, store):
        self.s = store
        self.pending: set[int] = set()
        self.resetting: set[int] = set()     # generation moved on, device reset not yet done

    @property
    def min_gain(self) -> int:
        """Bytes a GC victim must free beyond its copies (at least one block)."""
        s = self.s
        return max(s.bs, int(s.cap * GC_MIN_GAIN) // s.bs * s.bs)

    def gain_locked(self, z: int, sm: dict | None = None) -> int:
        """Space a reset of ``z`` frees beyond the copies of its live bytes: the dead bytes
        written (an active zone's unwritten tail is free already).  ``sm``: its summary, if
        the caller has it."""
        if sm is None:
            sm = self.s.alloc.summary(z)
        return (self.s.cap if sm["cond"] == "full" else sm["W"]) - sm["L"]

    def reclaimable_locked(self, z: int, sm: dict) -> int:
        """Bytes a writer can still get from the written part of zone ``z`` (summary ``sm``,
        not empty): all of them once nothing in it is live (it is reset), else the gain of a GC
        of it when that makes it a victim (``min_gain``); 0 for a zone out of service.  What
        ``statfs`` counts free beyond empty zones and open zones' tails."""
        if z in self.s.bad_zones:
            return 0
        gain = self.gain_locked(z, sm)
        return gain if sm["L"] <= 0 or gain >= self.min_gain else 0

    def dead_locked(self, pieces) -> None:
        """Account superseded/freed bytes; queue zones that hold no live data for reset."""
        s = self.s
        assert s.lock._is_owned(), "dead_locked without Store.lock"
        alloc = s.alloc
        for zone, nbytes, hint in pieces:
            alloc.note_dead(zone, nbytes, hint)
            if alloc.summary(zone)["L"] <= 0:
                self.pending.add(zone)

    def note_reset_locked(self, z: int) -> None:
        """Zone ``z`` is about to be reset (lock held): its generation moves on, so no extent
        written before can ever be mapped onto what the zone holds next."""
        s = self.s
        assert s.lock._is_owned(), "note_reset_locked without Store.lock"
        s.zgen[z] += 1
        s.csums.drop_zone(z)
        s._bad_pieces = {bp for bp in s._bad_pieces if bp[0] != z}
        s.do_locked(R.ZONE_RESET, R.pack_zone_reset(z, s.zgen[z]))

    def resettable_locked(self, z: int) -> bool:
        """A failed (READONLY/OFFLINE) zone cannot be reset; one whose write pointer was
        behind its data can, once nothing live is left in it."""
        bad = self.s.bad_zones.get(z)
        return bad is None or bad["valid_upto"] is not None

    def reset_empty_zones(self) -> None:
        """Reset zones whose data are all dead — after the deletion is durable in the journal;
        ``io_lock`` is not held across the device flush (module docstring)."""
        if not self.pending:
            return
        s = self.s
        with s.io_lock:
            zones = self._begin_iolocked(None)
            if not zones:
                return
            s.journal_flush_iolocked(sync=False)
        # outside io_lock: other files keep writing.  If it fails nothing is destroyed: the
        # zones stay in ``resetting`` (out of placement) and the error goes to the caller.
        s.device_flush()
        with s.io_lock:
            self._finish_iolocked(zones)

    def reset_zones_iolocked(self, zones: list[int]) -> list[int]:
        """THE reset sequence for ``zones`` with ``io_lock`` held throughout (a GC victim);
        returns the zones reset (those still holding live data are skipped)."""
        s = self.s
        # The GC copies are durable, and proven so by the records queued after them (a
        # FLUSHED record, ``Journal.note_flushed``), before the frame with their RELOCATE
        # records can reach the medium: a power cut that kept the frame and lost a copy would
        # otherwise lose fsynced data (the frame resets the victim too).
        s.device_flush()
        zones = self._begin_iolocked(zones)
        if zones:
            s.journal_flush_iolocked(sync=True)     # a failure leaves them in ``resetting``
            self._finish_iolocked(zones)
        return zones

    def _begin_iolocked(self, zones: list[int] | None) -> list[int]:
        """Steps 1 of the sequence: choose the zones, move their generations on."""
        s = self.s
        assert s.io_lock._is_owned(), "_begin_iolocked without io_lock"
        with s.lock:
            if zones is None:
                zones, self.pending = self.pending, set()
            alloc = s.alloc
            zones = [z for z in zones if alloc.summary(z)["L"] <= 0
                     and alloc.summary(z)["W"] > 0 and self.resettable_locked(z)
                     and z not in self.resetting]
            # a zone with a write reserved and not yet committed: later (its flush calls
            # ``reset_empty_zones`` when done).  No new one: reservations need io_lock.
            busy = {z for z in zones if s.dev.pending(z)}
            self.pending |= busy
            zones = [z for z in zones if z not in busy]
            for z in zones:
                self.note_reset_locked(z)
            self.resetting.update(zones)
        return zones

    def _finish_iolocked(self, zones: list[int]) -> None:
        """Steps 3-4: the device resets, then the summaries."""
        s = self.s
        assert s.io_lock._is_owned(), "_finish_iolocked without io_lock"
        for z in zones:
            s.dev.reset(z)
            s.open_lru.pop(z, None)
        with s.lock:
            for z in zones:
                s.alloc.note_reset(z)
                s.bad_zones.pop(z, None)
                s.stats["zone_resets"] += 1
                self.resetting.discard(z)
            s.capacity_stop = False

    def gc_once_iolocked(self) -> bool:
        """Copy the live data out of the best victim zone and reset it; False when no zone
        would free ``GC_MIN_GAIN`` of a zone beyond what its copies take (the device is full:
        the caller's ENOSPC)."""
        s = self.s
        assert s.io_lock._is_owned(), "gc_once_iolocked without io_lock"
        with s.lock:
            victims = [z for z in s.alloc.victims(8, self.resetting)
                       if self.gain_locked(z) >= self.min_gain and z not in s.bad_zones
                       and z not in self.resetting and not s.dev.pending(z)]
        for victim in victims:
            with s.lock:
                groups = self.copy_groups_locked(victim)
                cost = sum(-(-sum(g[1] for g in segs) // s.bs) * s.bs
                           for segs in groups.values())
                if s.cap - cost < self.min_gain:
                    continue
                s.stats["gc_runs"] += 1
            if self._copy_out_iolocked(victim, groups) and self.reset_zones_iolocked([victim]):
                return True
        return False

    def copy_groups_locked(self, victim: int) -> dict:
        """The victim's live extents by (inode, extent hint), in file order: each group is
        copied packed, one padded tail per group (a file's many small pieces stay dense)."""
        s = self.s
        groups: dict = {}
        for i, m in s.inodes.extent_maps():          # (files with data only)
            for e in m.in_zone(victim):
                key = (i.ino, e.hint, i.hint or H.UNHINTED)
                groups.setdefault(key, []).append((e.off, e.length, e.zoff))
        # in inode order, as a walk of every inode gave them (the copies' placement, and so
        # the sweep's figures, stay the same); within an inode, file order
        return dict(sorted(groups.items(), key=lambda kv: kv[0][0]))

    def _copy_out_iolocked(self, victim: int, groups: dict) -> bool:
        """Verified reads of each group, written packed through THE write loop in batches of
        at most ``COPY_BATCH`` bytes that end on a block (no padding inside a group)."""
        s = self.s
        for (ino, hint, ih), segs in groups.items():
            for batch in _batches(segs, COPY_BATCH, s.bs):
                try:
                    # verified before it is written elsewhere: GC never launders bad bytes
                    data = Chunks([s.reads.verified_read(victim, vz, ln, ino, off)
                                   for off, ln, vz in batch])
                except OSError as e:
                    # a checksum error, or the device failed the read (a bad spot of a
                    # failing disk: before, its EIO ended the user's write that needed GC)
                    return self._stop_copy(victim, ino, batch[0][0], e)
                try:
                    s.data.write(ino, batch[0][0], data,
                                 H.Hint(ih.birth, hint, ih.stream, "gc"),
                                 copy_from=(victim, batch))
                except FsError as e:    # no room for the copy (the reserve is full too)
                    return self._stop_copy(victim, ino, batch[0][0], e)
        return True

    def _stop_copy(self, victim: int, ino: int, off: int, e: OSError) -> bool:
        """The victim stays as it is, counted and logged, never a user's error."""
        s = self.s
        with s.lock:
            s.stats["gc_aborted"] += 1
        log.warning("GC of zone %d stopped at inode %d offset %d: %s", victim, ino, off,
                    errno.errorcode.get(e.errno, e.errno))
        return False


COPY_BATCH = 8 << 20    # bytes of one GC copy write: bounded memory on zones of a GiB


def _batches(segs: list, limit: int, bs: int):
    """Split segments [(file_off, length, zoff)] into runs of at most ``limit`` bytes; every
    run but the last ends on a multiple of ``bs`` (a segment is cut where needed)."""
    batch, n = [], 0
    for off, ln, zoff in segs:
        while ln:
            take = ln if n + ln <= limit else (limit - n)
            batch.append((off, take, zoff))
            n += take
            off, ln, zoff = off + take, ln - take, zoff + take
            if n >= limit:
                yield batch
                batch, n = [], 0
    if batch:
        yield batch
