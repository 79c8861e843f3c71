"""Mount-time recovery (``MountRecovery``), and read-only recovery of a namespace whose
snapshot lost frames in both copies (``PartialReplay``).

Why its own module: what a mount trusts after a crash or damage is decided here, once; and
this is the one place the store serves a namespace it knows to be incomplete, so the rule of
what may be served is written here too.  The snapshot is one
zlib stream: its intact prefix decodes, nothing after the gap does.  What is provable:

* every inode decoded from the prefix (its record is whole: attributes, extents, entries);
* every inode created after the snapshot (number >= the snapshot header's ``next_ino``): its
  whole history is in the records after the snapshot, which are intact;
* records that touch only such inodes.

A record that touches an inode of the lost part (number below ``next_ino``, not decoded) is
skipped: applying it would build a file from some of its extents (wrong bytes, zeros in the
holes) or link a name to an inode nobody can describe.  Known inodes whose directory is lost
are listed under ``/lost+found/<directory inode number>/`` with their own names.  Data still
reads only through the checksums and zone generations of the header and the records, so a
read is either the file's bytes or EIO.  Nothing here writes: the store is read-only.
"""
from __future__ import annotations

import logging
import math
import stat
from collections import deque
from time import time_ns as now_ns

from . import _journal as J
from . import hints as H
from . import namespace as NS
from . import records as R
from ._alloc import Allocator
from .csums import ZoneChecksums
from .device import ZoneCond
from .lifecycle import mark_log
from .namespace import Inode
from .namespace import ROOT_INO

log = logging.getLogger("retainzfs")
INF = math.inf

LOST_FOUND = b"lost+found"


def touched_inodes(rtype: int, payload) -> tuple[int, ...]:
    """The inode numbers a journal record refers to (empty for zone-only records)."""
    if rtype == R.INODE_B:
        return (R.unpack_inode(payload).fixed[0],)
    if rtype == R.DIRENT_B:
        p, i, _, _ = R.unpack_dirent(payload)
        return (p, i)
    if rtype == R.INODE_DEL_B:
        return (R.unpack_ino(payload),)
    if rtype == R.XATTR_B:
        return (R.unpack_xattr(payload)[0],)
    if rtype == R.EXTENT:
        return (R.unpack_extent(payload)[0],)
    if rtype == R.TRUNCATE:
        return (R.unpack_truncate(payload)[0],)
    if rtype == R.PUNCH:
        return (R.unpack_punch(payload)[0],)
    if rtype == R.RELOCATE:
        return (R.unpack_relocate(payload)[0],)
    if rtype in (R.INODE, R.INODE_DEL):
        return (R.unpack_json(payload)["i"],)
    if rtype == R.DIRENT_ADD:
        d = R.unpack_json(payload)
        return (d["p"], d["i"])
    if rtype == R.DIRENT_DEL:
        return (R.unpack_json(payload)["p"],)
    if rtype == R.RENAME:
        d = R.unpack_json(payload)
        return (d["op"], d["np"])
    return ()


class PartialReplay:
    """Decides, record by record, what a replay over a partial snapshot may apply."""

    def __init__(self, inodes: dict, next_ino: int):
        self.inodes = inodes
        self.next_ino = next_ino          # inodes at or above it were created after the snapshot
        self.skipped = 0

    def provable(self, rtype: int, payload) -> bool:
        inodes, limit = self.inodes, self.next_ino
        for i in touched_inodes(rtype, payload):
            if i not in inodes and i < limit:
                self.skipped += 1
                return False
        if rtype == R.RENAME:
            # the moved entry's inode must be known too
            d = R.unpack_json(payload)
            op = inodes.get(d["op"])
            child = op.entries.get(d["on"].encode("latin-1")) if op is not None else None
            if child is None or child not in inodes:
                self.skipped += 1
                return False
            if d.get("x"):                 # an exchange: the other entry's inode as well
                np_ = inodes.get(d["np"])
                other = np_.entries.get(d["nn"].encode("latin-1")) if np_ is not None else None
                if other is None or other not in inodes:
                    self.skipped += 1
                    return False
        return True

    def adopt_orphans(self, root_ino: int, now: int) -> list[int]:
        """Drop entries naming lost inodes; list known inodes whose directory is lost under
        ``/lost+found/<dir ino>/``.  Returns the adopted inode numbers."""
        inodes = self.inodes
        root = inodes.get(root_ino)
        if root is None:
            root = inodes[root_ino] = Inode(root_ino, stat.S_IFDIR | 0o755, nlink=2, atime=now,
                                            mtime=now, ctime=now)
        for d in list(inodes.values()):
            if d.is_dir:
                for name, i in list(d.entries.items()):
                    if i not in inodes:
                        d.unlink(name)
        linked = {i for d in inodes.values() if d.is_dir for i in d.entries.values()}
        orphans = [i for i in inodes.values() if i.ino != root_ino and i.nlink > 0
                   and i.ino not in linked]
        if not orphans:
            return []
        lf_ino = max(max(inodes) + 1, self.next_ino)
        lf = inodes[lf_ino] = Inode(lf_ino, stat.S_IFDIR | 0o500, nlink=2, atime=now, mtime=now,
                                    ctime=now, parent=root_ino, name=LOST_FOUND)
        if LOST_FOUND in root.entries:     # a user's own lost+found keeps its name
            lf.name = b"lost+found.retainz-%d" % lf_ino
        root.link(lf.name, lf_ino)
        groups: dict[int, Inode] = {}
        nxt = lf_ino + 1
        for o in orphans:
            g = groups.get(o.parent)
            if g is None:
                g = groups[o.parent] = Inode(nxt, stat.S_IFDIR | 0o500, nlink=2, atime=now,
                                             mtime=now, ctime=now, parent=lf_ino,
                                             name=b"%d" % o.parent)
                inodes[nxt] = g
                lf.link(g.name, nxt)
                nxt += 1
            name = o.name or b"inode-%d" % o.ino
            if name in g.entries:
                name = b"%s.%d" % (name, o.ino)
            g.link(name, o.ino)
            o.parent, o.name = g.ino, name
        return [o.ino for o in orphans]


class Proofs:
    """Which data writes the replayed journal proves durable, per zone (format feature
    ``flush_marks``): ``proven[zone]`` = the zone offset up to which a device flush covered
    the checksummed writes, from the snapshot (a roll flushes the data it maps first) and
    the R.FLUSHED records.  Writes not yet proven wait in ``pending`` (in frame order)."""

    def __init__(self, store):
        self.s = store
        self.seq = 0                       # the frame being replayed
        self.proven = {z: store.csums.end(z) for z in store.csums.zones}
        self.pending: deque[tuple[int, int, int, int]] = deque()   # (seq, zone, zgen, end)

    def wrote(self, zone: int, zgen: int, end: int) -> None:
        self.pending.append((self.seq, zone, zgen, end))

    def reset(self, zone: int) -> None:
        self.proven.pop(zone, None)

    def flushed(self, upto: int) -> None:
        p, zgen, proven = self.pending, self.s.zgen, self.proven
        while p and p[0][0] <= upto:
            _, zone, g, end = p.popleft()
            if g == zgen[zone] and end > proven.get(zone, 0):
                proven[zone] = end


class MountRecovery:
    """Mount-time recovery of a ``Store``: the snapshot, the records after it (through the
    same ``apply`` as run time), summaries rebuilt from the extents and the write pointers,
    zones a failure took out of service, damaged zone-table entries, orphans, and the roll
    that restores two good metadata copies.  Runs once, single-threaded, before the store
    serves anything (so it takes no locks of its own beyond what the calls it makes take)."""

    def __init__(self, store):
        self.s = store

    def load(self, info) -> None:
        s = self.s
        partial = getattr(info, "snapshot_partial", False)
        self.load_snapshot(info.snapshot, partial)
        info.snapshot = None                 # (decoded: its memory goes before the replay)
        if partial:
            # read-only only (the constructor refused read-write): serve what is provable
            pr = PartialReplay(s.inodes, s.next_ino)
            for rtype, payload in info.records.consume():
                if pr.provable(rtype, payload):
                    s._apply(rtype, payload)
                    s.replayed_records += 1
            adopted = pr.adopt_orphans(ROOT_INO, now_ns())
            s.next_ino = max(s.next_ino, max(s.inodes) + 1)
            s.recovered_partial = {"records_skipped": pr.skipped, "adopted": len(adopted)}
            log.error("metadata snapshot damaged in both copies: serving %d inodes read-only "
                      "(%d records of lost inodes skipped, %d files under /lost+found)",
                      len(s.inodes), pr.skipped, len(adopted))
        else:
            proofs = Proofs(s) if "flush_marks" in (s.sb.features or ()) else None
            s.applier.proofs = proofs
            try:
                for seq, recs in info.records.consume_frames():
                    if proofs is not None:
                        proofs.seq = seq
                    for rtype, payload in recs:
                        s._apply(rtype, payload)
                    s.replayed_records += len(recs)
            finally:
                s.applier.proofs = None
            for seq, what in info.records.salvaged:
                # passed its checksum, did not decode: a writer's bug (stop 26's journal);
                # reported, and the mount rolls a fresh snapshot of what it recovered
                msg = f"metadata log frame {seq} did not decode: {what}"
                log.error("%s", msg)
                s.meta_problems.append(msg)
            if proofs is not None:
                self.drop_lost_writes(proofs)
        # A file's size is journaled at close/fsync, its EXTENT records whenever data reach a
        # zone (the periodic flush makes them durable): after a crash a file may have committed
        # extents past the size last journaled.  Those bytes were written by the application
        # (and are checksummed), so the size covers them — never live bytes nobody can read.
        now = s.now
        live: dict[int, list] = {}
        for ino, m in s.inodes.extent_maps():    # (files without extents: no view)
            if m:
                end = m.exts[-1].end
                if end > ino.size:
                    ino.size = end
                for e in m.exts:
                    z = live.get(e.zone)
                    if z is None:
                        live[e.zone] = [e]
                    else:
                        z.append(e)
        for h in s.inodes.hints():
            if h.birth > now:
                now = h.birth
        s.now = now
        # allocator summaries from the extent map and the device's write pointers; the
        # metadata pair holds two active zones
        data_active = s.dev.max_active - 2 if s.dev.max_active else 0
        s.alloc = Allocator(s.dev.nr_zones, s.cap, s.meta_zones, s.opts.allocator,
                               max_active=data_active, lam=s.opts.lam,
                               hint_grid=s.opts.hint_grid, gc_reserve=s.opts.gc_reserve,
                               fullscan=s.opts.fullscan, block_size=s.bs)
        repaired = []
        damaged = dict(getattr(s.dev, "damaged", {}))
        for z, why in sorted(damaged.items()):
            # (the device reads such a zone as FULL: its bytes stay readable, checked by the
            # metadata mirror or the data checksums; a read-write mount rewrites the entry)
            s.meta_problems.append(f"{why}; read as a full zone" + (
                " (metadata: its mirror is compared)" if z < s.meta_zones else
                " (data: verified by checksum)"))
            log.error("device: %s; the zone is read as full", why)
        for z in range(s.meta_zones, s.dev.nr_zones):
            zone = s.dev.zone(z)
            exts = live.get(z, [])
            if zone.cond in (ZoneCond.READONLY, ZoneCond.OFFLINE):
                # A failed zone costs only the files in it: never written, reset or GC'd; reads
                # of an OFFLINE zone fail with EIO in the device, READONLY data stay readable.
                self.mark_bad(z, zone.cond.name.lower(), exts)
                continue
            if not exts:
                if (zone.wp or zone.cond != ZoneCond.EMPTY) and s.opts.readonly:
                    s.alloc.note_write(z, zone.capacity if zone.cond == ZoneCond.FULL
                                          else zone.wp, INF, False)
                elif zone.wp or zone.cond != ZoneCond.EMPTY:
                    s._note_reset(z)      # nothing live: garbage of an interrupted write
                    s.dev.reset(z)
                    repaired.append(z)
                continue
            if zone.cond != ZoneCond.FULL and any(e.zoff + e.length > zone.wp for e in exts):
                # The zone table says fewer bytes were written than the journal committed (a
                # damaged table or a lost device cache): bytes past wp are not the file's data.
                # Keep the zone out of placement, never write into it, fail reads past wp.
                self.mark_bad(z, f"write pointer {zone.wp} behind committed data (a damaged "
                                 f"zone table, or a power cut lost writes not yet fsynced)",
                              exts, valid_upto=zone.wp)
                continue
            lsum = 0
            for e in exts:
                s.alloc.note_write(z, e.length, e.hint, True)
                lsum += e.length
            written = zone.capacity if zone.cond == ZoneCond.FULL else zone.wp
            if written > lsum:
                s.alloc.note_write(z, written - lsum, INF, False)
            if zone.cond == ZoneCond.FULL:
                s.alloc.note_finish(z)
            elif zone.cond in (ZoneCond.IMP_OPEN, ZoneCond.EXP_OPEN) and not s.opts.readonly:
                s.dev.close(z)            # start with every data zone closed
        if repaired:
            log.info("recovery: reset %d zones with no live data", len(repaired))
        if s.opts.readonly:
            return
        # orphans: unlinked files that were open when the daemon died
        for ino in s.inodes.unlinked():
            s._free_inode(ino)
        for d in list(s.inodes.with_extra()):
            if d.is_dir and (H.POLICY_NAME in d.entries or d.policy_src):
                s._load_policy(d.ino, quiet=True)
        if info.uneven or s.journal_truncated or s.meta_problems or s.lost_writes:
            # (lost writes: the journal still names them; a fresh snapshot without them goes
            # before anything is written where they were)
            # a torn flush, one damaged copy, or copies of unequal length: write a fresh
            # snapshot into a free pair so every acknowledged record has two good copies again
            with s.io_lock:
                s.journal.roll()
        elif repaired:
            with s.io_lock:
                s._journal_flush(sync=True)
        for z in damaged:
            # the roll reset the old pairs (which rewrote their entries); a damaged zone of
            # a free pair holds nothing live: reset it; a data zone keeps its data as FULL
            if z in s.dev.damaged:
                if z < s.meta_zones and z // 2 not in s.journal.live:
                    s.dev.reset(z)
                else:
                    s.dev.repair_entry(z)
        if damaged:
            s.dev.flush()
        s._reset_empty_zones()
        # after the repairs (which flush what they write), before anything the mount serves
        mark_log(s, R.MOUNTED)

    def drop_lost_writes(self, proofs: "Proofs") -> None:
        """Forget data writes a power cut took from the device's cache, when nothing proves
        they were durable (a device cache keeps no order until a flush, so a journal frame
        can outlive the data it names, or a zone reset).  For each zone, the checksummed
        writes no flush covered (past ``proofs.proven``) are read back and verified: from
        the first piece that is missing (past the write pointer) or does not match (a reset
        the cache lost left the old bytes) on, they are dropped.  Those files lose bytes they
        had not fsynced: a file whose lost bytes were its last is cut where they began (what
        an application sees of a write cut short), lost bytes before kept ones read as zeros.
        A zone missing bytes a flush *did* cover is left to the out-of-service rule
        (``load``): that is damage, not a lost cache.  Nothing is written here (``load``
        rolls a fresh snapshot before anything is written where the lost bytes were)."""
        s = self.s
        cuts: dict[int, int] = {}
        for z in list(s.csums.zones):
            if z < s.meta_zones:
                continue
            zone = s.dev.zone(z)
            if zone.cond in (ZoneCond.READONLY, ZoneCond.OFFLINE):
                continue
            p, e = proofs.proven.get(z, 0), s.csums.end(z)
            wp = zone.capacity if zone.cond == ZoneCond.FULL else zone.wp
            if e <= p or p > wp:
                continue                  # all proven, or proven bytes missing: damage
            lost = self._first_unverified(z, p, min(e, wp))
            if lost < e:
                cuts[z] = s.csums.clip(z, lost)
        if not cuts:
            return
        nbytes = 0
        files = []
        for ino, m in s.inodes.extent_maps():
            lost = [(e.off + max(0, cuts[e.zone] - e.zoff), e.end) for e in m
                    if e.zone in cuts and e.zoff + e.length > cuts[e.zone]]
            if not lost:
                continue
            for a, b in lost:
                m.punch(a, b)
                nbytes += b - a
            first = min(a for a, _ in lost)
            if not len(m) or m.exts[-1].end <= first:
                ino.size = min(ino.size, first)
            files.append(s.path_of(ino.ino))
        s.lost_writes = {"zones": sorted(cuts), "files": sorted(files), "bytes": nbytes}
        log.warning("power cut: %d bytes written without an fsync never reached the device "
                    "(zones %s); %d files lost them%s", nbytes,
                    ", ".join(map(str, sorted(cuts))), len(files),
                    (": " + ", ".join(files[:5]) + (" ..." if len(files) > 5 else ""))
                    if files else "")

    def _first_unverified(self, z: int, lo: int, hi: int) -> int:
        """Zone offset of the first checksum piece at or past ``lo`` that is not wholly below
        ``hi`` (the write pointer) or whose bytes on the device do not match; the end of the
        zone's checksummed bytes if none."""
        s = self.s
        step = 64 * R.CSUM_PIECE
        for run in s.csums.runs(z):
            if run.end <= lo:
                continue
            k = max(0, (lo - run.zoff) // R.CSUM_PIECE)
            n = len(run.crcs)
            while k < n:
                a = run.zoff + k * R.CSUM_PIECE
                if min(a + R.CSUM_PIECE, run.end) > hi:
                    return a
                b = min(a + step, run.end)
                if b > hi:                # only whole pieces below the write pointer
                    b = a + (hi - a) // R.CSUM_PIECE * R.CSUM_PIECE
                k2 = n if b == run.end else (b - run.zoff) // R.CSUM_PIECE
                try:
                    data = s.dev.read(z, a, b - a)
                except OSError as e:
                    bad = self._verify_pieces_readable(z, run, k, k2, e)
                else:
                    bad = ZoneChecksums.bad_pieces(run, k, k2, data, a)
                if bad:
                    return bad[0]
                k = k2
        return s.csums.end(z)

    def _verify_pieces_readable(self, z: int, run, k: int, k2: int, err: OSError) -> list[int]:
        """``bad_pieces`` for pieces ``k:k2`` read one by one after their read together
        failed: a piece the device cannot read is kept, not dropped -- a read error is the
        medium (or the image's host) failing, not a power cut, and dropping the bytes lost
        unfsynced data for good on a transient error (found at stop 53, where such a file was
        cut and the log said "power cut").  Its reads fail with EIO while the device fails
        them; the checksums still check whatever it returns later."""
        s = self.s
        unreadable = 0
        for j in range(k, k2):
            a = run.zoff + j * R.CSUM_PIECE
            b = min(a + R.CSUM_PIECE, run.end)
            try:
                data = s.dev.read(z, a, b - a)
            except OSError:
                unreadable += b - a
                continue
            bad = ZoneChecksums.bad_pieces(run, j, j + 1, data, a)
            if bad:
                return bad
        if unreadable:
            log.error("zone %d: %d bytes written without an fsync could not be read back at "
                      "mount (%s): kept; their reads fail while the device fails them", z,
                      unreadable, err.strerror or err)
        return []

    def mark_bad(self, z: int, why: str, exts: list, valid_upto: int | None = None) -> None:
        """Take zone ``z`` out of service at mount (see ``bad_zones``); its files stay listed.

        The allocator sees the zone as full of live data (it is never chosen, never a GC
        victim); reads of bytes past ``valid_upto`` fail with EIO instead of returning what the
        device holds there."""
        s = self.s
        lsum = 0
        for e in exts:
            s.alloc.note_write(z, e.length, e.hint, True)
            lsum += e.length
        if s.cap > lsum:
            s.alloc.note_write(z, s.cap - lsum, INF, False)
        s.alloc.note_finish(z)
        inos = sorted({ino.ino for ino in s.inodes.values()
                       for e in ino.extents.in_zone(z)}) if exts else []
        files = sorted(s.path_of(i) for i in inos)
        # "inos" for ``fsck --repair``'s marks: a reported path need not resolve back
        s.bad_zones[z] = {"reason": why, "valid_upto": valid_upto, "files": files, "inos": inos}
        log.error("zone %d out of service (%s); %d files have data there%s", z, why, len(files),
                  (": " + ", ".join(files[:5]) + (" ..." if len(files) > 5 else "")) if files else "")

    def load_snapshot(self, snap, partial: bool = False) -> None:
        s = self.s
        try:
            head, inodes = NS.load_snapshot(snap, partial)
        except (ValueError, KeyError, TypeError) as e:
            # the frames passed their CRCs, so this is a bug or a forged image: never guess
            raise J.JournalError(f"metadata snapshot does not decode: {e}") from None
        s.inodes = inodes
        s.next_ino = head.next_ino
        s.now = head.now
        for z, g in head.zgen.items():
            s.zgen[z] = g
        s.csums.load(head.csums)

