"""The store: namespace + files -> extents, write buffers, commit, delete, GC and recovery.

Why one class owns all of this: every mutation is expressed as a journal record that is applied
to the in-memory state by the same code at run time and at replay (``_apply``), so what the
mount does and what recovery reconstructs cannot drift apart.  ``fs.py`` (FUSE) and
``replay.py`` (trace replay) both drive this class; neither knows about zones.

Concurrency: ``self.lock`` guards the namespace, allocator summaries and the journal buffer and
is only held for short, CPU-only critical sections.  ``self.io_lock`` serialises device writes,
finishes, resets and journal writes (zones must be written at their write pointer, in order).
The order is always io_lock -> lock, never the reverse.  Reads take neither lock during device
I/O; a zone reset waits until in-flight reads are done (``_readers``).

Durability contract: a file's data and extents are durable when ``fsync`` returns; ``flush``
(close) writes data and journal records without a device flush; namespace changes are durable at
the next journal flush (the mount flushes every second, and always before an fsync returns).
"""
from __future__ import annotations

import bisect
import errno
import gc
import json
import logging
import math
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
import time
import uuid as uuidlib
from dataclasses import dataclass, field

from . import _journal as J
from . import hints as H
from . import records as R
from ._alloc import Allocator, NoSpace
from .csums import ZoneChecksums, crcs_of
from .device import ZoneCond, ZonedDevice
from .extents import ExtentMap
from . import namespace as NS
from .namespace import Inode
from .superblock import FormatError, Superblock, default_meta_zones
from .writebuf import Chunks, WriteBuffer

log = logging.getLogger("retainzfs")

ROOT_INO = 1
INF = math.inf
FLUSH_BYTES = 4 << 20          # per-file write buffer bound before data go to a zone
NAME_MAX = 255


class FsError(OSError):
    """An errno-carrying error the FUSE adapter returns as is."""

    def __init__(self, err: int, msg: str = ""):
        super().__init__(err, msg or os.strerror(err))


def now_ns() -> int:
    return time.time_ns()


@dataclass
class StoreOptions:
    allocator: str = "retainz"
    lam: float = 1.0
    hint_grid: int = 0
    gc_reserve: int = 1
    flush_bytes: int = FLUSH_BYTES
    common_admission: bool = False
    fullscan: bool = False
    readonly: bool = False        # status/fsck of an unmounted target: never write repairs


class Store:
    """A mounted retainzfs filesystem on a ZonedDevice."""

    # ------------------------------------------------------------------ format / open
    @staticmethod
    def format(dev: ZonedDevice, *, meta_zones: int | None = None,
               allocator: str = "retainz", gc_reserve: int = 1) -> Superblock:
        """Write a fresh filesystem: reset every zone, superblock + empty snapshot in pair 0."""
        if meta_zones is None:
            meta_zones = default_meta_zones(dev.nr_zones, dev.zone_capacity)
        if meta_zones < 4 or meta_zones % 2:
            raise FsError(errno.EINVAL, f"--meta-zones {meta_zones}: need an even number >= 4 "
                                        f"(metadata is written to zone pairs)")
        if dev.nr_zones < meta_zones + 2 + gc_reserve:
            raise FsError(errno.EINVAL, f"device has {dev.nr_zones} zones; need at least "
                                        f"{meta_zones + 2 + gc_reserve}")
        if dev.max_active and dev.max_active < 4:
            raise FsError(errno.EINVAL, f"device allows {dev.max_active} active zones; need at "
                                        f"least 4 (a metadata pair and two data zones)")
        sb = Superblock.new(dev, meta_zones, allocator, gc_reserve)
        for z in range(meta_zones, dev.nr_zones):
            if dev.zone(z).wp or dev.zone(z).cond != ZoneCond.EMPTY:
                dev.reset(z)
        t = now_ns()
        root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, nlink=2, atime=t, mtime=t, ctime=t)
        snap = NS.encode_snapshot({ROOT_INO: root}, R.SnapshotHeader(ROOT_INO + 1))
        J.Journal(dev, sb, lambda: snap).format()
        return sb

    def __init__(self, dev: ZonedDevice, options: StoreOptions | None = None):
        self.dev = dev
        self.lock = threading.RLock()
        self.io_lock = threading.Lock()
        self._readers = 0
        self._readers_cv = threading.Condition(threading.Lock())
        sb = J.probe_superblock(dev)
        if sb is None:
            raise J.JournalError("no retainzfs superblock in the metadata zones")
        why = sb.compatible_with(dev)
        if why:
            raise FormatError(why)
        self.sb = sb
        opts = options or StoreOptions(allocator=sb.allocator, gc_reserve=sb.gc_reserve)
        self.opts = opts
        info = J.load(dev, sb)
        if info.corrupt and not opts.readonly:
            raise FormatError(f"metadata damaged beyond its mirror ({info.corrupt}); refusing "
                              f"to mount read-write (mount -o ro serves what is provably intact)")
        self.meta_zones = sb.meta_zones
        self.bs = dev.block_size
        self.cap = dev.zone_capacity
        self.inodes: NS.InodeTable = NS.InodeTable()
        self.next_ino = ROOT_INO + 1
        self.policies: dict[int, H.Policy] = {}
        self.policy_errors: dict[int, str] = {}
        self.now = 0
        self.journal = J.Journal(dev, sb, self._snapshot)
        self.journal.resume(info)
        self.journal.ensure_open = self._ensure_open_slot
        self.stats = {"payload_bytes": 0, "pad_bytes": 0, "gc_copied_bytes": 0, "zone_resets": 0,
                      "zone_finishes": 0, "commits": 0, "enospc": 0, "gc_runs": 0,
                      "checksum_errors": 0, "stale_extents": 0}
        self.csums = ZoneChecksums()
        self.zgen = [0] * dev.nr_zones          # reset generation of every zone
        self._bad_pieces: set[tuple[int, int]] = set()
        self.commit_ms: list[float] = []
        self.commit_hist = LatencyHistogram()
        self.open_lru: dict[int, None] = {}
        # per generation (stream, birth): [expected padded bytes (0 = unknown), bytes placed]
        self._saves: dict[tuple[int, int], list[int]] = {}
        self._save_key: dict[int, tuple[int, int]] = {}    # stream -> its current generation
        self._save_est: dict[int, int] = {}               # stream -> previous generation's size
        self._pending_resets: set[int] = set()
        self._want_journal_flush = False
        # full write buffers go to zones in the background while FUSE keeps accepting writes
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rz-flush")
        self._wgen = 0                    # device writes so far ...
        self._sgen = 0                    # ... of which a device flush covers this many
        self.replayed_records = 0
        self.journal_truncated = info.torn
        self.meta_problems = list(info.problems)
        self.meta_corrupt = info.corrupt
        self.recovered_partial: dict | None = None   # read-only recovery of a damaged snapshot
        self.tuning: dict = {}                  # kernel-side settings the mount made (status)
        # zone -> {"reason", "valid_upto", "files"}: zones a failure took out of service
        self.bad_zones: dict[int, dict] = {}
        self._capacity_stop = False
        # Building 10^5..10^6 inodes allocates millions of objects and no garbage: the cyclic
        # collector's full passes would otherwise dominate the mount time.
        gc_was = gc.isenabled()
        gc.disable()
        try:
            self._load(info)
        finally:
            if gc_was:
                gc.enable()
        for z in range(self.meta_zones):       # metadata zones count against max_open too
            if self.dev.zone(z).is_open:
                self.open_lru[z] = None

    # ------------------------------------------------------------------ recovery
    def _load(self, info) -> None:
        partial = getattr(info, "snapshot_partial", False)
        self._load_snapshot(info.snapshot, partial)
        info.snapshot = None                 # (decoded: its memory goes before the replay)
        if partial:
            # read-only only (the constructor refused read-write): serve what is provable
            from .recovery import PartialReplay
            pr = PartialReplay(self.inodes, self.next_ino)
            for rtype, payload in info.records.consume():
                if pr.provable(rtype, payload):
                    self._apply(rtype, payload)
                    self.replayed_records += 1
            adopted = pr.adopt_orphans(ROOT_INO, now_ns())
            self.next_ino = max(self.next_ino, max(self.inodes) + 1)
            self.recovered_partial = {"records_skipped": pr.skipped, "adopted": len(adopted)}
            log.error("metadata snapshot damaged in both copies: serving %d inodes read-only "
                      "(%d records of lost inodes skipped, %d files under /lost+found)",
                      len(self.inodes), pr.skipped, len(adopted))
        else:
            for rtype, payload in info.records.consume():
                self._apply(rtype, payload)
                self.replayed_records += 1
        # A file's size is journaled at close/fsync, its EXTENT records whenever data reach a
        # zone (the periodic flush makes them durable): after a crash a file may have committed
        # extents past the size last journaled.  Those bytes were written by the application
        # (and are checksummed), so the size covers them — never live bytes nobody can read.
        now = self.now
        live: dict[int, list] = {}
        for ino, m in self.inodes.extent_maps():    # (files without extents: no view)
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
        for h in self.inodes.hints():
            if h.birth > now:
                now = h.birth
        self.now = now
        # allocator summaries from the extent map and the device's write pointers; the
        # metadata pair holds two active zones
        data_active = self.dev.max_active - 2 if self.dev.max_active else 0
        self.alloc = Allocator(self.dev.nr_zones, self.cap, self.meta_zones, self.opts.allocator,
                               max_active=data_active, lam=self.opts.lam,
                               hint_grid=self.opts.hint_grid, gc_reserve=self.opts.gc_reserve,
                               fullscan=self.opts.fullscan, block_size=self.bs)
        repaired = []
        damaged = dict(getattr(self.dev, "damaged", {}))
        for z, why in sorted(damaged.items()):
            # (the device reads such a zone as FULL: its bytes stay readable, checked by the
            # metadata mirror or the data checksums; a read-write mount rewrites the entry)
            self.meta_problems.append(f"{why}; read as a full zone" + (
                " (metadata: its mirror is compared)" if z < self.meta_zones else
                " (data: verified by checksum)"))
            log.error("device: %s; the zone is read as full", why)
        for z in range(self.meta_zones, self.dev.nr_zones):
            zone = self.dev.zone(z)
            exts = live.get(z, [])
            if zone.cond in (ZoneCond.READONLY, ZoneCond.OFFLINE):
                # A failed zone costs only the files in it: never written, reset or GC'd; reads
                # of an OFFLINE zone fail with EIO in the device, READONLY data stay readable.
                self._mark_bad(z, zone.cond.name.lower(), exts)
                continue
            if not exts:
                if (zone.wp or zone.cond != ZoneCond.EMPTY) and self.opts.readonly:
                    self.alloc.note_write(z, zone.capacity if zone.cond == ZoneCond.FULL
                                          else zone.wp, INF, False)
                elif zone.wp or zone.cond != ZoneCond.EMPTY:
                    self._note_reset(z)      # nothing live: garbage of an interrupted write
                    self.dev.reset(z)
                    repaired.append(z)
                continue
            if zone.cond != ZoneCond.FULL and any(e.zoff + e.length > zone.wp for e in exts):
                # The zone table says fewer bytes were written than the journal committed (a
                # damaged table or a lost device cache): bytes past wp are not the file's data.
                # Keep the zone out of placement, never write into it, fail reads past wp.
                self._mark_bad(z, f"write pointer {zone.wp} behind committed data", exts,
                               valid_upto=zone.wp)
                continue
            lsum = 0
            for e in exts:
                self.alloc.note_write(z, e.length, e.hint, True)
                lsum += e.length
            written = zone.capacity if zone.cond == ZoneCond.FULL else zone.wp
            if written > lsum:
                self.alloc.note_write(z, written - lsum, INF, False)
            if zone.cond == ZoneCond.FULL:
                self.alloc.note_finish(z)
            elif zone.cond in (ZoneCond.IMP_OPEN, ZoneCond.EXP_OPEN) and not self.opts.readonly:
                self.dev.close(z)            # start with every data zone closed
        if repaired:
            log.info("recovery: reset %d zones with no live data", len(repaired))
        if self.opts.readonly:
            return
        # orphans: unlinked files that were open when the daemon died
        for ino in self.inodes.unlinked():
            self._free_inode(ino)
        for d in list(self.inodes.with_extra()):
            if d.is_dir and (H.POLICY_NAME in d.entries or d.policy_src):
                self._load_policy(d.ino, quiet=True)
        if info.uneven or self.journal_truncated or self.meta_problems:
            # a torn flush, one damaged copy, or copies of unequal length: write a fresh
            # snapshot into a free pair so every acknowledged record has two good copies again
            with self.io_lock:
                self.journal.roll()
        elif repaired:
            with self.io_lock:
                self._journal_flush(sync=True)
        for z in damaged:
            # the roll reset the old pairs (which rewrote their entries); a damaged zone of
            # a free pair holds nothing live: reset it; a data zone keeps its data as FULL
            if z in self.dev.damaged:
                if z < self.meta_zones and z // 2 not in self.journal.live:
                    self.dev.reset(z)
                else:
                    self.dev.repair_entry(z)
        if damaged:
            self.dev.flush()
        self._reset_empty_zones()

    def _mark_bad(self, z: int, why: str, exts: list, valid_upto: int | None = None) -> None:
        """Take zone ``z`` out of service at mount (see ``bad_zones``); its files stay listed.

        The allocator sees the zone as full of live data (it is never chosen, never a GC
        victim); reads of bytes past ``valid_upto`` fail with EIO instead of returning what the
        device holds there."""
        lsum = 0
        for e in exts:
            self.alloc.note_write(z, e.length, e.hint, True)
            lsum += e.length
        if self.cap > lsum:
            self.alloc.note_write(z, self.cap - lsum, INF, False)
        self.alloc.note_finish(z)
        files = sorted({self.path_of(ino.ino) for ino in self.inodes.values()
                        for e in ino.extents.in_zone(z)}) if exts else []
        self.bad_zones[z] = {"reason": why, "valid_upto": valid_upto, "files": files}
        log.error("zone %d out of service (%s); %d files have data there%s", z, why, len(files),
                  (": " + ", ".join(files[:5]) + (" ..." if len(files) > 5 else "")) if files else "")

    def _load_snapshot(self, snap: bytes, partial: bool = False) -> None:
        try:
            head, inodes = NS.load_snapshot(snap, partial)
        except (ValueError, KeyError, TypeError) as e:
            # the frames passed their CRCs, so this is a bug or a forged image: never guess
            raise J.JournalError(f"metadata snapshot does not decode: {e}") from None
        self.inodes = inodes
        self.next_ino = head.next_ino
        self.now = head.now
        for z, g in head.zgen.items():
            self.zgen[z] = g
        self.csums.load(head.csums)

    def _snapshot(self) -> bytes:
        with self.lock:
            head = R.SnapshotHeader(self.next_ino, self.now,
                                    {z: g for z, g in enumerate(self.zgen) if g},
                                    self.csums.items())
            return NS.encode_snapshot(self.inodes, head)

    # ------------------------------------------------------------------ journal apply
    def _do(self, rtype: int, payload: bytes):
        """Apply a record to memory and queue it in the journal (caller holds self.lock)."""
        res = self._apply(rtype, payload)
        self.journal.append(rtype, payload)
        if len(self.journal.pending) > (1 << 20):
            self._want_journal_flush = True
        return res

    def _link_entry(self, parent: Inode, name: bytes, ino: int) -> None:
        parent.link(name, ino)

    def _apply(self, rtype: int, payload: bytes):
        if rtype == R.INODE_B:
            r = R.unpack_inode(payload)
            i = r.fixed[0]
            inode = self.inodes.get(i)
            if inode is None:
                inode = self.inodes.new(i, r.fixed[1])
                if i >= self.next_ino:
                    self.next_ino = i + 1
            inode.set_rec(r)
            return inode
        if rtype == R.DIRENT_B:
            p, i, t, name = R.unpack_dirent(payload)
            parent = self.inodes[p]
            child = self.inodes.get(i)
            if child is not None and child.name == name:
                name = child.name          # one bytes object per name
            parent.link(name, i)
            parent.mtime = parent.ctime = t
            return None
        if rtype == R.INODE_DEL_B:
            inode = self.inodes.pop(R.unpack_ino(payload), None)
            return inode.extents.clear() if inode is not None else []
        if rtype == R.EXTENT:
            ino, off, zone, zgen, zoff, length, hint = R.unpack_extent(payload)
            if zgen != self.zgen[zone]:
                # the zone was reset after this extent was written: never map a file onto
                # what the zone holds now
                self.stats["stale_extents"] += 1
                log.error("journal: extent of inode %d in zone %d generation %d, but the zone "
                          "is at generation %d; ignored", ino, zone, zgen, self.zgen[zone])
                return []
            return self.inodes[ino].extmap().add(off, length, zone, zoff, hint)
        if rtype == R.CSUM:
            zone, zgen, zoff, length, crcs = R.unpack_csum(payload)
            if zgen == self.zgen[zone]:
                self.csums.add(zone, zoff, length, crcs)
            return None
        if rtype == R.ZONE_RESET:
            zone, gen = R.unpack_zone_reset(payload)
            self.zgen[zone] = gen
            self.csums.drop_zone(zone)
            return None
        if rtype == R.INODE:
            d = R.unpack_json(payload)
            inode = self.inodes.get(d["i"])
            if inode is None:
                inode = self.inodes.new(d["i"], d["m"])
                self.next_ino = max(self.next_ino, d["i"] + 1)
            inode.set_attrs(d)
            return inode
        if rtype == R.DIRENT_ADD:
            d = R.unpack_json(payload)
            parent = self.inodes[d["p"]]
            self._link_entry(parent, d["n"].encode("latin-1"), d["i"])
            parent.mtime = parent.ctime = d["t"]
            return None
        if rtype == R.DIRENT_DEL:
            d = R.unpack_json(payload)
            parent = self.inodes[d["p"]]
            name = d["n"].encode("latin-1")
            if name in parent.entries:
                parent.unlink(name)
            parent.mtime = parent.ctime = d["t"]
            return None
        if rtype == R.RENAME:
            d = R.unpack_json(payload)
            op, np_ = self.inodes[d["op"]], self.inodes[d["np"]]
            on, nn = d["on"].encode("latin-1"), d["nn"].encode("latin-1")
            ino = op.unlink(on)
            if nn in np_.entries:
                np_.unlink(nn)
            self._link_entry(np_, nn, ino)
            child = self.inodes[ino]
            child.parent, child.name = np_.ino, nn
            op.mtime = op.ctime = np_.mtime = np_.ctime = d["t"]
            child.ctime = d["t"]
            return None
        if rtype == R.INODE_DEL:
            ino = R.unpack_json(payload)["i"]
            inode = self.inodes.pop(ino, None)
            return inode.extents.clear() if inode is not None else []
        if rtype == R.TRUNCATE:
            ino, size = R.unpack_truncate(payload)
            inode = self.inodes[ino]
            dead = inode.extents.truncate(size)
            inode.size = size
            return dead
        if rtype == R.RELOCATE:
            ino, off, length, oz, ooff, nz, ngen, noff = R.unpack_relocate(payload)
            inode = self.inodes.get(ino)
            if ngen != self.zgen[nz]:
                self.stats["stale_extents"] += 1
                return False
            return inode is not None and inode.extents.relocate(off, length, oz, ooff, nz, noff)
        if rtype in (R.ZONE_FINISH, R.SUPER, R.SNAP_BEGIN, R.SNAP_CHUNK, R.SNAP_END):
            return None
        raise FsError(errno.EIO, f"unknown journal record type {rtype}")

    # ------------------------------------------------------------------ helpers
    def _verified_read(self, zone: int, zoff: int, length: int, ino: int = 0,
                       file_off: int = 0) -> bytes:
        """Read committed bytes and check them against their CRC32C pieces; EIO on a mismatch
        (logged once per piece with file, offset and zone; counted in ``checksum_errors``)."""
        with self.lock:
            span = self.csums.span(zone, zoff, length)
        if span is None:
            self._csum_error(zone, zoff, ino, file_off, "no checksum covers the range")
        if not span:
            return self._dev_read(zone, zoff, length)
        a = ZoneChecksums.piece_range(*span[0])[0]
        b = ZoneChecksums.piece_range(*span[-1])[1]
        data = self._dev_read(zone, a, b - a)
        for run, lo, hi in span:
            bad = ZoneChecksums.bad_pieces(run, lo, hi, data, a)
            if bad:
                self._csum_error(zone, bad[0], ino, file_off + max(0, bad[0] - zoff),
                                 "checksum mismatch")
        if a == zoff and b - a == length:
            return data
        return data[zoff - a:zoff - a + length]

    def _csum_error(self, zone: int, zoff: int, ino: int, file_off: int, what: str) -> None:
        with self.lock:
            self.stats["checksum_errors"] += 1
            key = (zone, zoff)
            first = key not in self._bad_pieces
            self._bad_pieces.add(key)
            path = self.path_of(ino) if ino in self.inodes else f"inode {ino}"
        if first:
            log.error("%s: file %s offset %d, zone %d offset %d: returning EIO", what, path,
                      file_off, zone, zoff)
        raise FsError(errno.EIO, f"{what} in zone {zone}")

    def _dev_read(self, zone: int, zoff: int, length: int) -> bytes:
        """Read committed bytes; EIO for a range a zone failure made untrustworthy."""
        bad = self.bad_zones.get(zone)
        if bad is not None:
            upto = bad["valid_upto"]
            if (upto is not None and zoff + length > upto) or bad["reason"] == "offline":
                if not bad.get("logged"):
                    bad["logged"] = True
                    log.error("read from zone %d refused with EIO: %s", zone, bad["reason"])
                raise FsError(errno.EIO, f"zone {zone}: {bad['reason']}")
        return self.dev.read(zone, zoff, length)

    def _get(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT)
        return inode

    def _dir(self, ino: int) -> Inode:
        inode = self._get(ino)
        if not inode.is_dir:
            raise FsError(errno.ENOTDIR)
        return inode

    @staticmethod
    def _check_name(name: bytes) -> None:
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)

    def _save_inode(self, inode: Inode) -> None:
        size = inode.size                  # the record carries ``durable_size`` (the size
        self._do(R.INODE_B, R.pack_inode(inode.to_rec(False), with_tables=False))
        inode.size = size                  # without buffered bytes); memory keeps them

    def _dead(self, pieces) -> None:
        """Account superseded/freed bytes; queue zones that hold no live data for reset."""
        for zone, nbytes, hint in pieces:
            self.alloc.note_dead(zone, nbytes, hint)
            if self.alloc.summary(zone)["L"] <= 0:
                self._pending_resets.add(zone)


    # ------------------------------------------------------------------ namespace
    def root(self) -> Inode:
        return self.inodes[ROOT_INO]

    def getattr(self, ino: int) -> Inode:
        with self.lock:
            return self._get(ino)

    def lookup(self, parent: int, name: bytes) -> Inode:
        with self.lock:
            p = self._dir(parent)
            if name == b".":
                return p
            if name == b"..":
                return self.inodes.get(p.parent or ROOT_INO, p)
            if len(name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            ino = p.entries.get(name)
            if ino is None:
                raise FsError(errno.ENOENT)
            return self.inodes[ino]

    def _new_inode(self, parent: Inode, name: bytes, mode: int, uid: int, gid: int,
                   target: bytes = b"", rdev: int = 0) -> Inode:
        self._check_name(name)
        if name in parent.entries:
            raise FsError(errno.EEXIST)
        t = now_ns()
        ino = Inode(self.next_ino, mode, uid, gid, nlink=2 if stat.S_ISDIR(mode) else 1,
                    atime=t, mtime=t, ctime=t, target=target, rdev=rdev, parent=parent.ino,
                    name=name, size=len(target))
        # directory hint xattrs are inherited by new children (runtime tags the gen dir)
        self._save_inode(ino)
        self._do(R.DIRENT_B, R.pack_dirent(parent.ino, ino.ino, t, name))
        if stat.S_ISDIR(mode):
            parent.nlink += 1
            self._save_inode(parent)
        return self.inodes[ino.ino]

    def create(self, parent: int, name: bytes, mode: int, uid: int = 0, gid: int = 0) -> Inode:
        with self.lock:
            p = self._dir(parent)
            return self._new_inode(p, name, stat.S_IFREG | (mode & 0o7777), uid, gid)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int = 0, gid: int = 0) -> Inode:
        with self.lock:
            p = self._dir(parent)
            return self._new_inode(p, name, mode, uid, gid, rdev=rdev)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int = 0, gid: int = 0) -> Inode:
        with self.lock:
            p = self._dir(parent)
            return self._new_inode(p, name, stat.S_IFDIR | (mode & 0o7777), uid, gid)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int = 0, gid: int = 0) -> Inode:
        with self.lock:
            p = self._dir(parent)
            return self._new_inode(p, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def readlink(self, ino: int) -> bytes:
        with self.lock:
            inode = self._get(ino)
            if not stat.S_ISLNK(inode.mode):
                raise FsError(errno.EINVAL)
            return inode.target

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        with self.lock:
            inode = self._get(ino)
            if inode.is_dir:
                raise FsError(errno.EPERM)
            p = self._dir(new_parent)
            self._check_name(new_name)
            if new_name in p.entries:
                raise FsError(errno.EEXIST)
            t = now_ns()
            inode.nlink += 1
            inode.ctime = t
            self._save_inode(inode)
            self._do(R.DIRENT_B, R.pack_dirent(p.ino, ino, t, new_name))
            return inode

    def _drop_link(self, inode: Inode) -> None:
        inode.nlink -= 1 if not inode.is_dir else inode.nlink
        inode.ctime = now_ns()
        if inode.nlink <= 0:
            inode.nlink = 0
            if inode.opens == 0:
                self._free_inode(inode)
                return
        self._save_inode(inode)

    def _free_inode(self, inode: Inode) -> None:
        if inode.has_buffered():
            inode.wbuf.clear()
        if inode.is_dir:
            self.policies.pop(inode.ino, None)
        dead = self._do(R.INODE_DEL_B, R.pack_ino(inode.ino))
        self._dead(dead)

    def _child(self, parent: int, name: bytes) -> tuple[Inode, Inode]:
        """(directory, entry) for a name that must exist (lock held)."""
        p = self._dir(parent)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        ino = p.entries.get(name)
        if ino is None:
            raise FsError(errno.ENOENT)
        return p, self.inodes[ino]

    def _del_entry(self, p: Inode, name: bytes) -> None:
        self._do(R.DIRENT_DEL, R.pack_json({"p": p.ino, "n": name.decode("latin-1"),
                                            "t": now_ns()}))

    def unlink(self, parent: int, name: bytes, reset: bool = True) -> None:
        """Remove a name; with ``reset=False`` no device I/O (the FUSE adapter calls it on the
        event loop and runs ``reset_pending`` in a worker thread only when zones emptied)."""
        with self.lock:
            p, inode = self._child(parent, name)
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            self._del_entry(p, name)
            if name == H.POLICY_NAME:
                self._load_policy(p.ino)          # no file: no policy
            self._drop_link(inode)
        if reset:
            self._reset_empty_zones()

    @property
    def reset_pending(self) -> bool:
        """Zones emptied by a deletion wait for ``_reset_empty_zones``."""
        return bool(self._pending_resets)

    def reset_empty_zones(self) -> None:
        self._reset_empty_zones()

    def rmdir(self, parent: int, name: bytes) -> None:
        with self.lock:
            p, inode = self._child(parent, name)
            if not inode.is_dir:
                raise FsError(errno.ENOTDIR)
            if inode.entries:
                raise FsError(errno.ENOTEMPTY)
            self._del_entry(p, name)
            p.nlink -= 1
            self._save_inode(p)
            inode.nlink = 0
            if inode.opens == 0 and inode.lookups == 0:
                self._free_inode(inode)
            else:
                self._save_inode(inode)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
        with self.lock:
            op, np_ = self._dir(old_parent), self._dir(new_parent)
            if len(old_name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            self._check_name(new_name)
            ino = op.entries.get(old_name)
            if ino is None:
                raise FsError(errno.ENOENT)
            if flags & RENAME_EXCHANGE:
                raise FsError(errno.EINVAL)
            moving = self.inodes[ino]
            if moving.is_dir:        # refuse moving a directory below itself
                a = np_
                while True:
                    if a.ino == moving.ino:
                        raise FsError(errno.EINVAL)
                    if a.ino == ROOT_INO or not a.parent:
                        break
                    a = self.inodes[a.parent]
            victim_ino = np_.entries.get(new_name)
            victim = None
            if victim_ino is not None:
                if flags & RENAME_NOREPLACE:
                    raise FsError(errno.EEXIST)
                if victim_ino == ino:
                    return
                victim = self.inodes[victim_ino]
                if victim.is_dir:
                    if not moving.is_dir:
                        raise FsError(errno.EISDIR)
                    if victim.entries:
                        raise FsError(errno.ENOTEMPTY)
                elif moving.is_dir:
                    raise FsError(errno.ENOTDIR)
            if new_name == H.POLICY_NAME and not moving.is_dir and (
                    op.ino != np_.ino or old_name != new_name):
                # refused like a write of a malformed .retainz: the rename does not happen
                try:
                    H.parse_policy(self._read_policy_file(moving))
                except H.HintError as e:
                    log.error("rename onto %s/.retainz refused: %s", self.path_of(np_.ino), e)
                    raise FsError(errno.EINVAL, str(e)) from None
            self._do(R.RENAME, R.pack_json({"op": op.ino, "on": old_name.decode("latin-1"),
                                            "np": np_.ino, "nn": new_name.decode("latin-1"),
                                            "t": now_ns()}))
            if moving.is_dir and op.ino != np_.ino:
                op.nlink -= 1
                np_.nlink += 1
                self._save_inode(op)
                self._save_inode(np_)
            self._save_inode(moving)
            if victim is not None:
                if victim.is_dir:
                    np_.nlink -= 1
                    self._save_inode(np_)
                    victim.nlink = 0
                    if victim.opens == 0 and victim.lookups == 0:
                        self._free_inode(victim)
                else:
                    self._drop_link(victim)
            if op.ino != np_.ino or old_name != new_name:
                self._rederive_hints(moving)
            for d, n in ((op, old_name), (np_, new_name)):
                if n == H.POLICY_NAME and d.ino in self.inodes:
                    try:
                        self._load_policy(d.ino)
                    except H.HintError:
                        pass
        self._reset_empty_zones()

    def readdir(self, ino: int, start: int) -> list[tuple[bytes, Inode, int]]:
        """Entries with cookie > start, in cookie order: (name, inode, cookie)."""
        with self.lock:
            d = self._dir(ino)
            out = []
            if start < 1:
                out.append((b".", d, 1))
            if start < 2:
                out.append((b"..", self.inodes.get(d.parent or ROOT_INO, d), 2))
            for name, cookie in d.cookies.items():
                if cookie > start:
                    out.append((name, self.inodes[d.entries[name]], cookie))
            return out

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime: int | None = None,
                mtime: int | None = None, ctime: int | None = None) -> Inode:
        if size is not None:
            self.truncate(ino, size)
        with self.lock:
            inode = self._get(ino)
            t = now_ns()
            if mode is not None:
                inode.mode = (inode.mode & ~0o7777) | (mode & 0o7777)
            if uid is not None:
                inode.uid = uid
            if gid is not None:
                inode.gid = gid
            if atime is not None:
                inode.atime = atime
            if mtime is not None:
                inode.mtime = mtime
            inode.ctime = ctime if ctime is not None else t
            self._save_inode(inode)
            return inode

    def ref(self, ino: int, n: int = 1) -> None:
        """The kernel learned about an inode (lookup/create reply)."""
        with self.lock:
            inode = self.inodes.get(ino)
            if inode is not None:
                inode.lookups += n

    def forget(self, ino: int, n: int) -> None:
        with self.lock:
            inode = self.inodes.get(ino)
            if inode is None:
                return
            inode.lookups = max(0, inode.lookups - n)
            if inode.is_dir and inode.nlink == 0 and inode.lookups == 0 and inode.opens == 0:
                self._free_inode(inode)

    # ------------------------------------------------------------------ xattrs
    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        with self.lock:
            inode = self._get(ino)
            if name in H.VIRTUAL_XATTRS:
                raise FsError(errno.EPERM)
            if name in H.HINT_XATTRS:
                try:
                    H.validate_xattr(name, value)
                except H.HintError as e:
                    log.warning("setxattr %s on inode %d refused: %s", name.decode(), ino, e)
                    raise FsError(errno.EINVAL, str(e)) from None
            if len(name) > 255 or len(value) > 65536:
                raise FsError(errno.ERANGE)
            inode.set_xattr(name, bytes(value))
            inode.ctime = now_ns()
            self._save_inode(inode)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self.lock:
            inode = self._get(ino)
            if name == H.XATTR_ZONES:
                zones = sorted({e.zone for e in inode.extents})
                return ",".join(map(str, zones)).encode()
            if name == H.XATTR_HINT:
                h = inode.hint if inode.hint is not None else (
                    self._resolve_hint(inode) if inode.is_reg else None)
                if h is None:
                    raise FsError(errno.ENODATA)
                doc = {"birth": h.birth, "reclaim": _fmt_hint(h.reclaim), "stream": h.stream,
                       "source": h.source, "name": self.path_of(ino)}
                p = inode.placed_hint
                if p is not None and (p.birth, p.reclaim) != (h.birth, h.reclaim):
                    doc["placed"] = {"birth": p.birth, "reclaim": _fmt_hint(p.reclaim),
                                     "source": p.source}
                return json.dumps(doc).encode()
            if name == H.XATTR_STATUS and ino == ROOT_INO:
                # getxattr(2) callers ask for the size, then for the value: a live document
                # that grew in between (a counter gained a digit) failed with ERANGE.  Padded
                # with JSON whitespace to a 1 KiB multiple, its size rarely changes.
                v = json.dumps(self.status()).encode()
                return v + b" " * (-len(v) % 1024)
            if name.startswith(H.XATTR_ZONEMAP) and ino == ROOT_INO:
                try:
                    first = int(name[len(H.XATTR_ZONEMAP):])
                except ValueError:
                    raise FsError(errno.ENODATA) from None
                return json.dumps(self.zone_map(first, H.ZONEMAP_ROWS),
                                  separators=(",", ":")).encode()
            try:
                return inode.xattrs[name]
            except KeyError:
                raise FsError(errno.ENODATA) from None

    def listxattr(self, ino: int) -> list[bytes]:
        with self.lock:
            return list(self._get(ino).xattrs)

    def removexattr(self, ino: int, name: bytes) -> None:
        with self.lock:
            inode = self._get(ino)
            if name not in inode.xattrs:
                raise FsError(errno.ENODATA)
            inode.del_xattr(name)
            inode.ctime = now_ns()
            self._save_inode(inode)

    # ------------------------------------------------------------------ hints
    def _load_policy(self, dir_ino: int, quiet: bool = False) -> None:
        """(Re)load the ``.retainz`` of a directory (lock held).

        A valid file becomes the policy and its text is journaled on the directory; a malformed
        or unreadable one is an error (raised unless ``quiet``) and the previous valid policy
        stays in force — also across remounts.  Removing the file removes the policy."""
        d = self.inodes[dir_ino]
        pino = d.entries.get(H.POLICY_NAME)
        if pino is None:
            self.policies.pop(dir_ino, None)
            self.policy_errors.pop(dir_ino, None)
            if d.policy_src:
                d.policy_src = b""
                self._save_inode(d)
            return
        try:
            data = self._read_policy_file(self.inodes[pino])
            pol = H.parse_policy(data)
        except H.HintError as e:
            self.policy_errors[dir_ino] = str(e)
            log.error("%s: %s", self.path_of(pino), e)
            if d.policy_src and dir_ino not in self.policies:
                try:                          # after a remount: the last valid text
                    self.policies[dir_ino] = H.parse_policy(d.policy_src)
                except H.HintError:
                    pass
            if not quiet:
                raise
            return
        self.policies[dir_ino] = pol
        self.policy_errors.pop(dir_ino, None)
        if d.policy_src != data:
            d.policy_src = data
            self._save_inode(d)

    def _read_policy_file(self, inode: Inode) -> bytes:
        if not inode.is_reg:
            raise H.HintError(".retainz: not a regular file")
        if inode.size > H.POLICY_MAX:
            raise H.HintError(f".retainz: {inode.size} bytes; a policy file may hold at most "
                              f"{H.POLICY_MAX} bytes")
        try:
            return self._read_all(inode)
        except OSError as e:
            raise H.HintError(f".retainz: cannot read it: {e.strerror or e}") from None

    def _read_all(self, inode: Inode) -> bytes:
        out = bytearray(inode.size)
        for dst, zone, zoff, length in inode.extents.lookup(0, inode.size):
            out[dst:dst + length] = self._verified_read(zone, zoff, length, inode.ino, dst)
        if inode.wbuf:
            o = inode.wbuf.off
            out[o:o + len(inode.wbuf)] = inode.wbuf.slice(o, inode.wbuf.end)
        return bytes(out[:inode.size])

    def resolve_path(self, path: str) -> int | None:
        """Inode number of an absolute path inside the filesystem, or None."""
        with self.lock:
            cur = self.inodes.get(ROOT_INO)
            for part in filter(None, path.split("/")):
                if cur is None or not cur.is_dir:
                    return None
                nxt = cur.entries.get(part.encode("utf-8", "surrogateescape"))
                cur = self.inodes.get(nxt) if nxt is not None else None
            return cur.ino if cur is not None else None

    def path_of(self, ino: int) -> str:
        parts = []
        inode = self.inodes.get(ino)
        while inode is not None and inode.ino != ROOT_INO:
            parts.append(inode.name.decode("utf-8", "replace"))
            inode = self.inodes.get(inode.parent)
        return "/" + "/".join(reversed(parts))

    def _rederive_hints(self, moved: Inode) -> None:
        """After a rename, hints come from the new name (lock held).

        Frameworks write ``x.dirty.pt`` / ``tmp-checkpoint-N/`` / ``.metadata.tmp`` and rename:
        data not yet placed uses the hint of the final name; data already placed under another
        hint stays where it is and is reported (``placed`` in ``user.retainz.hint``)."""
        todo, files = [moved], []
        while todo:
            i = todo.pop()
            if i.is_reg:
                files.append(i)
            elif i.is_dir:
                todo += [self.inodes[c] for c in i.entries.values() if c in self.inodes]
        for f in files:
            if f.hint is None or H.hint_from_xattrs(f.xattrs) is not None:
                continue                  # nothing placed yet / an explicit tag wins
            new = self._resolve_hint(f)
            if (new.birth, new.reclaim, new.stream) == (f.hint.birth, f.hint.reclaim,
                                                        f.hint.stream):
                continue
            if len(f.extents) or f.wbuf:
                if f.placed_hint is None:
                    f.placed_hint = f.hint
                log.info("%s: hint re-derived after rename (birth %d, reclaim %s); %d bytes "
                         "already placed with reclaim %s", self.path_of(f.ino), new.birth,
                         _fmt_hint(new.reclaim), sum(e.length for e in f.extents),
                         _fmt_hint(f.placed_hint.reclaim))
            f.hint = new
            self._save_inode(f)

    def _resolve_hint(self, inode: Inode) -> H.Hint:
        """Hint of a file: its xattrs, an ancestor's xattrs, an ancestor's .retainz, or none."""
        h = H.hint_from_xattrs(inode.xattrs)
        if h is not None:
            return h
        chain = []          # (dir inode, name of the child on the path below it)
        child = inode
        while child.parent and child.ino != ROOT_INO:
            parent = self.inodes.get(child.parent)
            if parent is None:
                break
            chain.append((parent, child.name))
            child = parent
        names_below: list[str] = []
        for depth, (d, name) in enumerate(chain):
            names_below.insert(0, name.decode("utf-8", "replace"))
            h = H.hint_from_xattrs(d.xattrs)
            if h is not None:
                return H.Hint(h.birth, h.reclaim, h.stream, "xattr-inherited")
            pol = self.policies.get(d.ino)
            if pol is None:
                continue
            # births of the generation siblings: entries of the dir holding the generation
            stream = pol.stream if pol.stream is not None else d.ino
            for k, comp in enumerate(names_below):
                if H.generation_birth(pol, comp) is None:
                    continue
                holder = chain[depth - k][0] if k <= depth else d
                sibs = [b for b in (H.generation_birth(pol, n.decode("utf-8", "replace"))
                                    for n in holder.entries) if b is not None]
                h = H.derive_hint(pol, names_below[k:], sibs, stream)
                if h is not None:
                    return h
                break
            # not in a generation: a rolling file (tracker, last.ckpt) dies at the next save
            sibs = [b for b in (H.generation_birth(pol, n.decode("utf-8", "replace"))
                                for n in chain[0][0].entries) if b is not None]
            return H.nongeneration_hint(pol, names_below, sibs, stream)
        return H.UNHINTED

    # ------------------------------------------------------------------ file data
    def open(self, ino: int, truncate: bool = False) -> Inode:
        if truncate:
            self.truncate(ino, 0)
        with self.lock:
            inode = self._get(ino)
            inode.opens += 1
            return inode

    def buffer_write(self, ino: int, off: int, data: bytes) -> int | None:
        """Append to the file's write buffer if that needs no device I/O; else None.

        Lets the FUSE adapter answer most writes on the event loop without a thread hop; the
        writes that would fill the buffer go through ``write`` in a worker thread."""
        with self.lock:
            inode = self._get(ino)
            buf = inode.wbuf
            n = len(data)
            if (n == 0 or inode.flush_err is not None or (buf and off != buf.end)
                    or len(buf) - inode.inflight + n >= self.opts.flush_bytes):
                return None
            buf.append(off, data)
            inode.mtime = inode.ctime = now_ns()
            if off + n > inode.size:
                inode.size = off + n
            inode.dirty = inode.policy_dirty = True
            return n

    def write(self, ino: int, off: int, data: bytes) -> int:
        n = len(data)
        if n == 0:
            return 0
        while True:
            need_flush = False
            with self.lock:
                inode = self._get(ino)
                buf = inode.wbuf
                need_flush = not buf.append(off, data)
                if not need_flush:
                    t = now_ns()
                    inode.mtime = inode.ctime = t
                    if off + n > inode.size:
                        inode.size = off + n
                    inode.dirty = inode.policy_dirty = True
                    full = len(buf) - inode.inflight >= self.opts.flush_bytes
            if need_flush:
                self._flush_data(ino, final=True)
                continue
            if full:
                self._flush_background(ino)
            return n

    def _flush_background(self, ino: int) -> None:
        """Queue a zone write of the full buffer; at most one in flight per file (bounded RAM)."""
        with self.lock:
            inode = self.inodes.get(ino)
            if inode is None:
                return
            prev = inode.flushing
        if prev is not None:
            prev.result()                     # the previous chunk must be out first
        self._check_flush_error(ino)
        with self.lock:
            inode = self.inodes.get(ino)
            if inode is not None:
                inode.flushing = self._flusher.submit(self._bg_flush, ino)

    def _bg_flush(self, ino: int) -> None:
        try:
            self._flush_data(ino, final=False)
        except OSError as e:
            with self.lock:
                inode = self.inodes.get(ino)
                if inode is not None:
                    inode.flush_err = e
        except Exception as e:                # never lose an error silently
            log.exception("background flush of inode %d", ino)
            with self.lock:
                inode = self.inodes.get(ino)
                if inode is not None:
                    inode.flush_err = FsError(errno.EIO, str(e))

    def _wait_flush(self, ino: int) -> None:
        """Wait for the file's background flush and raise its error, if any."""
        with self.lock:
            inode = self.inodes.get(ino)
            fut = inode.flushing if inode is not None else None
        if fut is not None:
            fut.result()
        self._check_flush_error(ino)

    def _check_flush_error(self, ino: int) -> None:
        with self.lock:
            inode = self.inodes.get(ino)
            err = inode.flush_err if inode is not None else None
            if err is not None:
                inode.flush_err = None
        if err is not None:
            raise FsError(err.errno or errno.EIO, str(err))

    def read(self, ino: int, off: int, size: int) -> bytes:
        with self.lock:
            inode = self._get(ino)
            if off >= inode.size or size <= 0:
                return b""
            size = min(size, inode.size - off)
            segs = inode.extents.lookup(off, size)
            overlay = None
            if inode.wbuf:
                bo, bl = inode.wbuf.off, len(inode.wbuf)
                lo, hi = max(bo, off), min(bo + bl, off + size)
                if hi > lo:
                    overlay = (lo - off, inode.wbuf.slice(lo, hi))
            with self._readers_cv:
                self._readers += 1
        try:
            if len(segs) == 1 and segs[0][0] == 0 and segs[0][3] == size and overlay is None:
                return self._verified_read(segs[0][1], segs[0][2], size, ino, off)
            out = bytearray(size)
            for dst, zone, zoff, length in segs:
                out[dst:dst + length] = self._verified_read(zone, zoff, length, ino, off + dst)
        finally:
            with self._readers_cv:
                self._readers -= 1
                self._readers_cv.notify_all()
        if overlay is not None:
            out[overlay[0]:overlay[0] + len(overlay[1])] = overlay[1]
        return bytes(out)

    def truncate(self, ino: int, size: int) -> None:
        self._wait_flush(ino)
        self._flush_data(ino, final=True)
        with self.io_lock:
            with self.lock:
                inode = self._get(ino)
                if not inode.is_reg:
                    raise FsError(errno.EISDIR if inode.is_dir else errno.EINVAL)
                if size == inode.size:
                    return
                dead = self._do(R.TRUNCATE, R.pack_truncate(ino, size))
                self._dead(dead)
                if size == 0:       # O_TRUNC rewrite: new contents, resolve the hint again
                    inode.hint = None
                    inode.placed_hint = None
                inode.mtime = inode.ctime = now_ns()
                inode.policy_dirty = True
                inode.dirty = True             # the next close makes the truncation durable
                self._save_inode(inode)
        self._reset_empty_zones()

    def _ensure_open_slot(self, zone: int) -> None:
        """Close least-recently-used data zones so a write to ``zone`` stays within max_open."""
        dev = self.dev
        if dev.zone(zone).is_open:
            self.open_lru.pop(zone, None)
            self.open_lru[zone] = None
            return
        if dev.max_open:
            while dev.open_count() >= dev.max_open:
                victim = next((z for z in self.open_lru if z != zone and dev.zone(z).is_open), None)
                if victim is None:
                    break
                self.open_lru.pop(victim)
                dev.close(victim)
        self.open_lru[zone] = None

    # ------------------------------------------------------------------ save sizes
    def declare_save(self, ino: int, nbytes: int) -> None:
        """Announce that the generation of ``ino`` (a generation directory or file; its hint
        names the generation) will hold ``nbytes`` block-padded bytes in all.  Optional: it
        feeds the allocator's size adaptation and the common-admission rule; without it the
        store assumes the size of the stream's previous generation.  Run-time only."""
        with self.lock:
            inode = self._get(ino)
            h = inode.hint or self._resolve_hint(inode)
            self._save_entry(h)[:] = [max(0, int(nbytes)), 0]

    def _save_entry(self, hint: H.Hint) -> list[int]:
        """[expected, placed] of the hint's generation (lock held); one entry per stream."""
        key = (hint.stream, hint.birth)
        ent = self._saves.get(key)
        if ent is None:
            prev = self._save_key.get(hint.stream)
            if prev is not None and prev in self._saves:
                placed = self._saves.pop(prev)[1]
                if placed:
                    self._save_est[hint.stream] = placed
            self._save_key[hint.stream] = key
            ent = self._saves[key] = [self._save_est.get(hint.stream, 0), 0]
        return ent

    def _place(self, size: int, hint: H.Hint, allow_reserve: bool = False, writer=None):
        """Ask the allocator for a zone for ``size`` padded bytes of file ``writer`` (io_lock
        held).

        When the policy finds no room outside the GC reserve: with common admission, first fill
        a compatible tail (``place(tails_only=True)``); then run GC and retry; when GC cannot
        make progress, common admission borrows the reserve if the rest of the padded save
        (``declare_save``) fits in it.  Otherwise ENOSPC (a capacity stop)."""
        gc_stuck = False
        for attempt in range(self.dev.nr_zones + 8):
            zone = None
            with self.lock:
                ent = self._save_entry(hint)
                save_size = max(ent[0], size)
                remaining = max(ent[0] - ent[1], size)
                args = (size, hint.reclaim, hint.birth, self.now, hint.stream, save_size)
                try:
                    zone, nbytes, finish = self.alloc.place(*args, allow_reserve=allow_reserve,
                                                            writer=writer)
                except NoSpace:
                    pass
                if zone is None and self.opts.common_admission:
                    try:
                        zone, nbytes, finish = self.alloc.place(*args, tails_only=True)
                    except NoSpace:
                        if gc_stuck and remaining <= self.cap:
                            try:
                                zone, nbytes, finish = self.alloc.place(*args, allow_reserve=True)
                            except NoSpace:
                                pass
                if zone is not None:
                    ent[1] += nbytes
                    self._capacity_stop = False
            if zone is not None:
                for z in finish:
                    self._finish_zone(z)
                return zone, nbytes
            if gc_stuck or not self._gc_once():
                if not gc_stuck and self.opts.common_admission:
                    gc_stuck = True
                    continue
                with self.lock:
                    self.stats["enospc"] += 1
                    self._capacity_stop = True
                raise FsError(errno.ENOSPC, "no zone can take the data, even after GC")
        with self.lock:
            self.stats["enospc"] += 1
            self._capacity_stop = True
        raise FsError(errno.ENOSPC, "GC made no progress")

    def _finish_zone(self, z: int) -> None:
        if self.dev.zone(z).cond != ZoneCond.FULL:
            self.dev.finish(z)
        self.open_lru.pop(z, None)
        with self.lock:
            self.alloc.note_finish(z)
            self.stats["zone_finishes"] += 1
            self._do(R.ZONE_FINISH, R.pack_zone(z))

    def _write_chunk(self, ino: int, off: int, data: Chunks, hint: H.Hint,
                     allow_reserve: bool = False) -> None:
        """Place and write ``data`` (file offset ``off``), possibly across zones (io_lock held)."""
        bs = self.bs
        pos = 0
        total = len(data)
        while pos < total:
            remaining = total - pos
            padded = -(-remaining // bs) * bs
            zone, nbytes = self._place(padded, hint, allow_reserve, ino)
            payload = min(nbytes, remaining)
            chunk = data.slice(pos, pos + payload)
            if nbytes > payload:
                chunk.append(bytes(nbytes - payload))
            self._ensure_open_slot(zone)
            zoff = self.dev.zone(zone).wp
            crcs = crcs_of(chunk, nbytes)         # on the buffers in hand, before the write
            self.dev.write(zone, zoff, chunk)
            self._wgen += 1
            with self.lock:
                inode = self.inodes.get(ino)
                zg = self.zgen[zone]
                self._do(R.CSUM, R.pack_csum(zone, zg, zoff, nbytes, crcs))
                self.alloc.note_write(zone, payload, hint.reclaim, True)
                if nbytes > payload:
                    self.alloc.note_write(zone, nbytes - payload, hint.reclaim, False)
                self.stats["payload_bytes"] += payload
                self.stats["pad_bytes"] += nbytes - payload
                if inode is None:      # deleted while we wrote: the bytes are dead already
                    self._dead([(zone, payload, hint.reclaim)])
                else:
                    dead = self._do(R.EXTENT, R.pack_extent(ino, off + pos, zone, zg, zoff,
                                                            payload, hint.reclaim))
                    self._dead(dead)
            pos += payload

    def _flush_data(self, ino: int, final: bool) -> None:
        """Move buffered bytes of a file to zones (whole blocks unless ``final``)."""
        with self.io_lock:
            with self.lock:
                inode = self.inodes.get(ino)
                if inode is None or not inode.wbuf:
                    return
                n = len(inode.wbuf)
                if not final:
                    n -= n % self.bs
                    if n == 0:
                        return
                data = inode.wbuf.prefix(n)
                off = inode.wbuf.off
                inode.inflight = n
                if inode.hint is None:
                    inode.hint = self._resolve_hint(inode)
                    if inode.hint.birth > self.now:
                        self.now = inode.hint.birth
                hint = inode.hint
            try:
                self._write_chunk(ino, off, data, hint)
            except FsError:
                with self.lock:      # drop the uncommittable bytes; committed data stay intact
                    inode = self.inodes.get(ino)
                    if inode is not None:
                        inode.wbuf.clear()
                        inode.inflight = 0
                        inode.size = max((e.end for e in inode.extents), default=0)
                raise
            with self.lock:
                inode = self.inodes.get(ino)
                if inode is not None:
                    inode.inflight = 0
                    if inode.wbuf.off == off:
                        inode.wbuf.drop(n)
            self._maybe_flush_journal()
        self._reset_empty_zones()

    def _maybe_flush_journal(self) -> None:
        if self._want_journal_flush:
            self._want_journal_flush = False
            self._journal_flush(sync=False)

    def _journal_flush(self, sync: bool) -> None:
        """Write queued records (io_lock held; the namespace lock only to detach them)."""
        with self.lock:
            plan = self.journal.prepare()
            if plan is None and not sync:
                return
        g = self._wgen = self._wgen + (plan is not None)
        self.journal.commit(plan, sync=sync)
        if sync:
            self._sgen = max(self._sgen, g)

    def _device_flush(self) -> None:
        g = self._wgen
        self.dev.flush()
        self._sgen = max(self._sgen, g)

    def _flush_durably(self) -> None:
        """Data, then the journal records that point at them, made durable in that order.

        The device flushes run outside io_lock, so writers of other files are not stalled
        behind a flush of everything the page cache / device cache holds."""
        if self._wgen != self._sgen:
            self._device_flush()
        with self.io_lock:
            self._journal_flush(sync=False)
        if self._wgen != self._sgen:
            self._device_flush()

    def commit(self, ino: int, durable: bool, check_policy: bool = True) -> None:
        """close(2) (durable=False) or fsync (durable=True): data + extents + attributes out."""
        t0 = time.perf_counter()
        self._wait_flush(ino)
        self._flush_data(ino, final=True)
        policy_error = None
        with self.io_lock:
            with self.lock:
                inode = self.inodes.get(ino)
                wrote = inode is not None and inode.dirty
                if wrote:
                    inode.dirty = False
                    self._save_inode(inode)
                    self.stats["commits"] += 1
                # A .retainz is validated by the flush/fsync of the fd that wrote it, never by a
                # RELEASE: that is asynchronous, cannot report the error, and may run while a
                # new writer has truncated the file but not yet written it.
                if (check_policy and inode is not None and inode.policy_dirty
                        and inode.name == H.POLICY_NAME and inode.parent in self.inodes):
                    inode.policy_dirty = False
                    try:
                        self._load_policy(inode.parent)
                    except H.HintError as e:
                        policy_error = e
            # A close of a file with nothing new (a second close, a release after flush, a
            # file only created) leaves its namespace records to the periodic flush: one
            # block-padded frame per such close would cost 8 KiB of journal per file.
            if wrote or durable:
                self._journal_flush(sync=False)
        if durable:
            self._flush_durably()
        dt = time.perf_counter() - t0
        self.commit_ms.append(dt * 1000.0)
        self.commit_hist.observe(dt)
        if len(self.commit_ms) > 100000:
            del self.commit_ms[:50000]
        if policy_error is not None:
            raise FsError(errno.EINVAL, str(policy_error))

    def release(self, ino: int) -> None:
        """Last close of an open file: commit; free it if it was unlinked meanwhile."""
        try:
            self.commit(ino, durable=False, check_policy=False)
        finally:
            with self.lock:
                inode = self.inodes.get(ino)
                if inode is not None:
                    inode.opens = max(0, inode.opens - 1)
                    if inode.opens == 0:
                        self.alloc.release_writer(ino)
                    if inode.nlink == 0 and inode.opens == 0:
                        self._free_inode(inode)
            self._reset_empty_zones()

    def sync(self) -> None:
        """Everything queued becomes durable (periodic flush, syncfs, unmount)."""
        if self.journal.has_pending() or self._wgen != self._sgen:
            self._flush_durably()

    # ------------------------------------------------------------------ reclaim
    def _reset_empty_zones(self) -> None:
        """Reset zones whose data are all dead — after the deletion is durable in the journal."""
        if not self._pending_resets:
            return
        with self.io_lock:
            with self.lock:
                zones = [z for z in self._pending_resets
                         if self.alloc.summary(z)["L"] <= 0 and self.alloc.summary(z)["W"] > 0
                         and self._resettable(z)]
                self._pending_resets = set()
            if not zones:
                return
            with self.lock:
                for z in zones:
                    self._note_reset(z)
            self._journal_flush(sync=True)       # deletions + new generations durable first
            with self._readers_cv:
                while self._readers:
                    self._readers_cv.wait()
                for z in zones:
                    self.dev.reset(z)
                    self.open_lru.pop(z, None)
            with self.lock:
                for z in zones:
                    self.alloc.note_reset(z)
                    self.bad_zones.pop(z, None)
                    self.stats["zone_resets"] += 1
                self._capacity_stop = False

    def _note_reset(self, z: int) -> None:
        """Zone ``z`` is about to be reset (lock held): its generation moves on, so no extent
        written before can ever be mapped onto what the zone holds next."""
        self.zgen[z] += 1
        self.csums.drop_zone(z)
        self._bad_pieces = {bp for bp in self._bad_pieces if bp[0] != z}
        self._do(R.ZONE_RESET, R.pack_zone_reset(z, self.zgen[z]))

    def _resettable(self, z: int) -> bool:
        """A failed (READONLY/OFFLINE) zone cannot be reset; one whose write pointer was
        behind its data can, once nothing live is left in it."""
        bad = self.bad_zones.get(z)
        return bad is None or bad["valid_upto"] is not None

    def _gc_once(self) -> bool:
        """Copy the live data out of the best victim zone and reset it (io_lock held)."""
        with self.lock:
            victims = [z for z in self.alloc.victims(8) if self.alloc.summary(z)["L"] < self.cap
                       and z not in self.bad_zones]
        for victim in victims:
            with self.lock:
                moves = [(i.ino, e.off, e.length, e.zoff, e.hint, i.hint or H.UNHINTED)
                         for i in self.inodes.values() for e in i.extents.in_zone(victim)]
                live = sum(m[2] for m in moves)
                if live >= self.cap:
                    continue
                self.stats["gc_runs"] += 1
            ok = True
            for ino, off, length, zoff, hint, ih in moves:
                try:
                    # verified before it is written elsewhere: GC never launders bad bytes
                    data = self._verified_read(victim, zoff, length, ino, off)
                    self._relocate(ino, off, length, victim, zoff, data, hint, ih)
                except FsError:
                    ok = False
                    break
            if not ok:
                continue
            with self.lock:
                if self.alloc.summary(victim)["L"] > 0:
                    continue
                self._note_reset(victim)
            self._journal_flush(sync=True)
            with self._readers_cv:
                while self._readers:
                    self._readers_cv.wait()
                self.dev.reset(victim)
            self.open_lru.pop(victim, None)
            with self.lock:
                self.alloc.note_reset(victim)
                self.stats["zone_resets"] += 1
                self._capacity_stop = False
            return True
        return False

    def _relocate(self, ino, off, length, victim, vzoff, data, hint, ih: H.Hint) -> None:
        bs = self.bs
        pos = 0
        h = H.Hint(ih.birth, hint, ih.stream, "gc")
        while pos < length:
            remaining = length - pos
            padded = -(-remaining // bs) * bs
            with self.lock:
                args = (padded, hint, h.birth, self.now, h.stream, 0)
                try:
                    zone, nbytes, finish = self.alloc.place(*args, allow_reserve=True,
                                                            exclude=[victim])
                except NoSpace:
                    if not self.opts.common_admission:
                        raise FsError(errno.ENOSPC) from None
                    try:        # common admission: copies may fill compatible tails too
                        zone, nbytes, finish = self.alloc.place(*args, exclude=[victim],
                                                                tails_only=True)
                    except NoSpace:
                        raise FsError(errno.ENOSPC) from None
            if zone == victim:
                raise FsError(errno.ENOSPC)
            for z in finish:
                self._finish_zone(z)
            payload = min(nbytes, remaining)
            chunk = data[pos:pos + payload]
            if nbytes > payload:
                chunk = bytes(chunk) + bytes(nbytes - payload)
            self._ensure_open_slot(zone)
            zoff = self.dev.zone(zone).wp
            crcs = crcs_of([chunk], nbytes)
            self.dev.write(zone, zoff, chunk)
            self._wgen += 1
            with self.lock:
                zg = self.zgen[zone]
                self._do(R.CSUM, R.pack_csum(zone, zg, zoff, nbytes, crcs))
                self.alloc.note_write(zone, payload, h.reclaim, True)
                if nbytes > payload:
                    self.alloc.note_write(zone, nbytes - payload, h.reclaim, False)
                self.stats["gc_copied_bytes"] += nbytes
                if self._do(R.RELOCATE, R.pack_relocate(ino, off + pos, payload, victim,
                                                        vzoff + pos, zone, zg, zoff)):
                    self.alloc.note_dead(victim, payload, hint)
                else:
                    self._dead([(zone, payload, hint)])
            pos += payload

    # ------------------------------------------------------------------ observability
    def statfs(self) -> dict:
        with self.lock:
            free = 0
            data_zones = self.dev.nr_zones - self.meta_zones
            for z in range(self.meta_zones, self.dev.nr_zones):
                s = self.alloc.summary(z)
                if s["cond"] == "empty":
                    free += self.cap
                elif s["cond"] == "active":
                    free += self.cap - s["W"]
            free = max(0, free - self.opts.gc_reserve * self.cap)
            return {"bsize": self.bs, "blocks": data_zones * self.cap // self.bs,
                    "bfree": free // self.bs, "files": len(self.inodes),
                    "ffree": max(0, (1 << 32) - self.next_ino)}

    def status(self) -> dict:
        with self.lock:
            conds: dict[str, int] = {}
            live = invalid = tail = free = 0
            for z in range(self.dev.nr_zones):
                c = self.dev.zone(z).cond.name.lower()
                conds[c] = conds.get(c, 0) + 1
            for z in range(self.meta_zones, self.dev.nr_zones):
                s = self.alloc.summary(z)
                if s["cond"] == "empty":
                    free += self.cap
                    continue
                live += s["L"]
                invalid += s["W"] - s["L"]
                tail += self.cap - s["W"]
                if s["cond"] == "active":
                    free += self.cap - s["W"]
            st = self.stats
            logical = st["payload_bytes"]
            cm = sorted(self.commit_ms)
            p99 = cm[min(len(cm) - 1, int(math.ceil(0.99 * len(cm))) - 1)] if cm else 0.0
            a = self.alloc.stats()
            return {
                "allocator": self.opts.allocator,
                "uuid": self.sb.uuid,
                "zone_size": self.dev.zone_size, "zone_capacity": self.cap,
                "nr_zones": self.dev.nr_zones, "meta_zones": self.meta_zones,
                "max_open": self.dev.max_open, "max_active": self.dev.max_active,
                "zones": conds,
                "empty_data_zones": self.alloc.empty_zones(),
                "live_bytes": live, "invalid_bytes": invalid, "tail_bytes": tail,
                "free_bytes": free,
                "reserved_overhead_zones": (invalid + tail) / self.cap,
                "invalid_zones": invalid / self.cap, "tail_zones": tail / self.cap,
                "zone_resets": st["zone_resets"], "zone_finishes": st["zone_finishes"],
                "host_wa": ((logical + st["pad_bytes"] + st["gc_copied_bytes"]) / logical)
                if logical else 1.0,
                "logical_bytes": logical, "pad_bytes": st["pad_bytes"],
                "gc_copied_bytes": st["gc_copied_bytes"],
                "journal_bytes": self.journal.bytes_written,
                "journal_rolls": self.journal.rolls,
                "commits": st["commits"], "p99_commit_ms": round(p99, 3),
                "mean_alloc_us": (a["ns"] / a["places"] / 1000.0) if a.get("places") else 0.0,
                "capacity_stop": self._capacity_stop, "enospc": st["enospc"],
                "bad_zones": {str(z): {"reason": b["reason"], "files": b["files"]}
                              for z, b in sorted(self.bad_zones.items())},
                "files": sum(1 for i in self.inodes.values() if i.is_reg),
                "policy_errors": {**{self.path_of(k): p.slow[0] for k, p in self.policies.items()
                                     if p.slow},
                                  **{self.path_of(k): v for k, v in self.policy_errors.items()}},
                "journal_truncated": self.journal_truncated,
                "checksum_errors": st["checksum_errors"],
                "stale_extents": st["stale_extents"],
                "metadata_problems": list(self.meta_problems),
                "metadata_corrupt": self.meta_corrupt,
                "metadata_partial": self.recovered_partial,
                "format_version": self.sb.version,
                "tuning": dict(self.tuning),
            }

    def zone_map(self, first: int = 0, count: int | None = None) -> dict:
        """Compact per-zone rows for ``retainzfs status --zones``: [condition, written, live,
        reclaim epoch (-1: anchor, None: nothing written), kind] — kind 'm' metadata, 'b' out of
        service, 'd' data."""
        with self.lock:
            n = self.dev.nr_zones
            last = n if count is None else min(n, first + count)
            rows = []
            for z in range(max(0, first), last):
                zi = self.dev.zone(z)
                if z < self.meta_zones:
                    rows.append([zi.cond.name.lower(), zi.wp, zi.wp, None, "m"])
                    continue
                s = self.alloc.summary(z)
                r = self.alloc.zone_reclaim_epoch(z) if s["W"] else None
                rows.append([zi.cond.name.lower(), s["W"], s["L"],
                             -1 if r is not None and math.isinf(r) else r,
                             "b" if z in self.bad_zones else "d"])
            return {"first": first, "nr_zones": n, "capacity": self.cap, "rows": rows}

    def scrub(self, progress=None) -> dict:
        """Verify every live extent against its data checksums (``retainzfs scrub``).

        Returns {"bytes": verified, "extents": n, "errors": [{"path", "offset", "zone",
        "error"}]}; ``progress(nbytes)`` is called as bytes are verified."""
        with self.lock:
            work = [(i.ino, self.path_of(i.ino), e.off, e.zone, e.zoff, e.length)
                    for i in list(self.inodes.values()) if i.is_reg for e in i.extents]
        done, errors = 0, []
        step = 4 << 20
        for ino, path, off, zone, zoff, length in work:
            pos = 0
            while pos < length:
                n = min(step, length - pos)
                try:
                    self._verified_read(zone, zoff + pos, n, ino, off + pos)
                except OSError as e:
                    errors.append({"path": path, "offset": off + pos, "zone": zone,
                                   "error": e.strerror or str(e)})
                pos += n
                done += n
                if progress is not None:
                    progress(n)
        return {"bytes": done, "extents": len(work), "errors": errors,
                "files_affected": sorted({e["path"] for e in errors})}

    def check(self) -> list[str]:
        """Consistency check (fsck): per-zone live bytes from the allocator == extent map."""
        problems = []
        with self.lock:
            per_zone: dict[int, int] = {}
            for i in self.inodes.values():
                for z, n in i.extents.live_by_zone().items():
                    per_zone[z] = per_zone.get(z, 0) + n
                for e in i.extents:
                    if e.zoff + e.length > self.cap:
                        problems.append(f"inode {i.ino}: extent {e!r} beyond zone capacity")
                    if e.end > i.size:
                        problems.append(f"inode {i.ino}: extent {e!r} past the end of the file "
                                        f"({i.size} bytes)")
                    span = self.csums.span(e.zone, e.zoff, e.length)
                    if span is None:
                        problems.append(f"inode {i.ino}: extent {e!r} has no data checksum")
                if i.is_dir:
                    for name, child in i.entries.items():
                        if child not in self.inodes:
                            problems.append(f"dir {i.ino}: entry {name!r} -> missing inode {child}")
            for z in range(self.meta_zones, self.dev.nr_zones):
                s = self.alloc.summary(z)
                if s["L"] != per_zone.get(z, 0):
                    problems.append(f"zone {z}: summary live {s['L']} != extent map {per_zone.get(z, 0)}")
                if z in self.bad_zones:
                    problems.append(f"zone {z}: out of service ({self.bad_zones[z]['reason']}); "
                                    f"files with data there: {len(self.bad_zones[z]['files'])}")
                    continue
                if self.dev.zone(z).cond != ZoneCond.FULL and s["W"] != self.dev.zone(z).wp:
                    problems.append(f"zone {z}: summary written {s['W']} != wp {self.dev.zone(z).wp}")
        return problems

    def close(self) -> None:
        """Unmount: commit every buffered file, flush the journal, release the device."""
        for ino in [i.ino for i in self.inodes.values() if i.has_buffered()]:
            try:
                self.commit(ino, durable=False)
            except OSError as e:
                log.error("unmount: could not commit inode %d: %s", ino, e)
        self._flusher.shutdown(wait=True)
        self.sync()
        self.dev.flush()


class LatencyHistogram:
    """Cumulative commit latencies for the Prometheus histogram (buckets in seconds)."""
    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.BUCKETS, seconds)
        self.counts[i] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip(self.BUCKETS, self.counts):
            acc += c
            out.append((repr(b), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


def _fmt_hint(h: float):
    return "inf" if math.isinf(h) else h
