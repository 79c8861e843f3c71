"""The store facade: the state of a mounted filesystem, its lock discipline, the journal
(every mutation is a record applied to memory by ``_apply``, at run time and at replay, so what
the mount does and what recovery reconstructs cannot drift apart), commit/fsync/sync ordering,
and mount-time recovery.  ``fs.py`` (FUSE) and ``replay.py`` (trace replay) drive this class;
neither knows about zones.

The work is done by parts, each owning one resource (DESIGN §10), built here and sharing the
store's state through it:

* ``ns``      nsops.NamespaceOps   namespace operations and their POSIX rules
* ``xattrs``  xattrops.XattrOps    user, hint and virtual (computed) extended attributes
* ``hints``   nsops.StoreHints     ``.retainz`` policies in force, hint resolution (hints.py)
* ``files``   openfiles.OpenFiles  open counts, write buffers and their bounds, truncate
* ``flushes`` flushes.Flushes      buffered bytes to zones in order, rz-flush, parked errors
* ``meta_room`` room.MetaRoom     ENOSPC for new names and xattrs while metadata zones are full
* ``falloc``  falloc.Falloc        fallocate(2): room checks, holes (PUNCH records)
* ``data``    datapath.DataPath    placement, THE write loop (data and GC copies)
* ``reads``   readpath.ReadPath    verified reads (lock-free against resets), readahead
* ``reclaim`` reclaim.Reclaim      dead bytes, THE reset sequence, GC
* ``report``  stats.StoreStats     statfs, status, zone map, commit latencies
* ``fsck``    fsck.Fsck            check and scrub

Concurrency (docs/internals.md): ``self.lock`` (RLock) guards the namespace, allocator
summaries, checksums and the journal buffer and is only held for short, CPU-only critical
sections.  ``self.io_lock`` serialises device writes, finishes, resets and journal writes (zones
must be written at their write pointer, in order).  The order is always io_lock -> lock, never
the reverse.  Methods named ``*_locked`` need ``self.lock`` held, ``*_iolocked`` need
``io_lock`` held, and assert it.  Reads take neither lock during device I/O and never wait for
a reset, nor a reset for them: a read takes its zones' generations with its lookup and reads
again if one moved (``ReadPath.read``, a seqlock; a reset moves the generation first).

Durability contract: a file's data and extents are durable when ``fsync`` returns; ``flush``
(close) writes data and journal records without a device flush; namespace changes are durable at
the next journal flush (the mount flushes every second, and always before an fsync returns).
"""
from __future__ import annotations

import errno
import gc
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

from . import _journal as J
from . import hints as H
from . import records as R
from .apply import RecordApplier
from .recovery import MountRecovery
from .csums import ZoneChecksums
from .datapath import DataPath
from .readpath import ReadPath
from .device import ZonedDevice
from .errors import FsError
from .failure import Failure
from .fsck import Fsck
from .lifecycle import format_store, mark_log
from . import namespace as NS
from .namespace import ROOT_INO, Inode
from .nsops import NAME_MAX, NamespaceOps, StoreHints
from .xattrops import XattrOps
from .falloc import Falloc
from .flushes import Flushes
from .openfiles import OpenFiles
from .reclaim import Reclaim
from .room import MetaRoom
from .stats import LatencyHistogram, StoreStats
from .superblock import FormatError

log = logging.getLogger("retainzfs")

INF = math.inf
FLUSH_BYTES = 4 << 20          # per-file write buffer bound before data go to a zone
DIRTY_BYTES = 128 << 20        # all files' write buffers together (OpenFiles)
DIRTY_EXPIRE = 30.0            # seconds a buffered byte may wait for the periodic writeback
__all__ = ["FsError", "Inode", "LatencyHistogram", "NAME_MAX", "ROOT_INO", "Store",
           "StoreOptions"]


class _Via:
    """``Store.lookup = _Via("ns")``: ``store.lookup`` is ``store.ns.lookup`` (the part's bound
    method itself, no wrapper call)."""

    def __init__(self, part: str, name: str | None = None):
        self.part, self.name = part, name

    def __set_name__(self, owner, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)


@dataclass
class StoreOptions:
    allocator: str = "retainz"
    lam: float = 1.0
    hint_grid: int = 0
    gc_reserve: int = 1
    flush_bytes: int = FLUSH_BYTES
    dirty_bytes: int = DIRTY_BYTES
    dirty_expire: float = DIRTY_EXPIRE
    common_admission: bool = False
    fullscan: bool = False
    readonly: bool = False        # status/fsck of an unmounted target: never write repairs
    #: a full write buffer is flushed in the writer's own thread, not in the background: how
    #: much each flush takes no longer depends on timing (``replay``: repeatable placement)
    inline_flush: bool = False


class Store:
    """A mounted retainzfs filesystem on a ZonedDevice."""

    # ------------------------------------------------------------------ format / open
    format = staticmethod(format_store)     # mkfs (lifecycle.py)

    def __init__(self, dev: ZonedDevice, options: StoreOptions | None = None):
        self.dev = dev
        self.lock = threading.RLock()
        self.io_lock = threading.RLock()     # an RLock for ``_is_owned``: never re-entered
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
        if not opts.readonly:
            err = dev.keep_allocated(range(sb.meta_zones))
            if err and err != errno.EOPNOTSUPP:
                log.warning("metadata zones not preallocated (%s): a journal write may fail "
                            "if the host file system fills", os.strerror(err))
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
                      "zone_finishes": 0, "commits": 0, "enospc": 0, "gc_runs": 0, "gc_aborted": 0,
                      "checksum_errors": 0, "stale_extents": 0, "read_errors": 0,
                      # flushed bytes written from the FUSE requests' own aligned buffers
                      # (no staging copy: ``DataPath.stage``)
                      "unstaged_bytes": 0,
                      # seconds in the write loop (io_lock held) and in its device writes
                      "data_write_s": 0.0, "device_write_s": 0.0}
        self.csums = ZoneChecksums()
        self.zgen = [0] * dev.nr_zones          # reset generation of every zone
        self._bad_pieces: set[tuple[int, int]] = set()
        self.open_lru: dict[int, None] = {}     # open data zones, LRU first (the data path's)
        self._want_journal_flush = False
        self.applier = RecordApplier(self)
        self.ns = NamespaceOps(self)
        self.xattrs = XattrOps(self)
        self.hints = StoreHints(self)
        self.files = OpenFiles(self)
        self.flushes = Flushes(self)
        self.meta_room = MetaRoom(self)
        self.falloc = Falloc(self)
        self.data = DataPath(self)
        self.reads = ReadPath(self)
        self.reclaim = Reclaim(self)
        self.report = StoreStats(self)
        self.fsck = Fsck(self)
        self.failure = Failure(self)      # one-way: a failed flush or metadata write
        self._wgen = 0                    # device writes so far ...
        self._sgen = 0                    # ... of which a device flush covers this many
        #: journal frames detached from the queue (``prepare``) and not yet counted in
        #: ``_wgen`` (Store.lock): ``sync`` must wait for them, not pass for done
        self._frames_in_flight = 0
        #: inode -> ``_wgen`` after its latest data write (Store.lock); entries a device flush
        #: covered are dropped by it.  Tells whether a file's data are durable yet
        #: (``data_durable_locked``: a rename over another file waits for that).
        self.unsynced: dict[int, int] = {}
        self.replayed_records = 0
        #: POSIX ACLs: the kernel negotiated FUSE_POSIX_ACL and enforces them (``acl.py``);
        #: without it they are refused, never stored unenforced
        self.acls = False
        self.journal_truncated = info.torn
        self.clean_unmount = info.clean       # (None: an image made before "unmount_marks")
        self.ends_unmounted = info.unmounted_at is not None    # (the last valid frame's mark)
        self.meta_problems = list(info.problems)
        self.meta_corrupt = info.corrupt
        self.recovered_partial: dict | None = None   # read-only recovery of a damaged snapshot
        self.tuning: dict = {}                  # kernel-side settings the mount made (status)
        # zone -> {"reason", "valid_upto", "files", "inos"}: zones a failure took out of service
        self.bad_zones: dict[int, dict] = {}
        #: data writes a power cut lost that nothing proved durable, dropped at mount
        #: (``MountRecovery.drop_lost_writes``): {"zones", "files", "bytes"}, else None
        self.lost_writes: dict | None = None
        # A placement found no room, even after GC, and nothing was freed since (set by
        # DataPath, cleared by a placement or Reclaim's reset; read by OpenFiles' write-through
        # rule and status).  Store.lock.
        self.capacity_stop = False
        # Building 10^5..10^6 inodes allocates millions of objects and no garbage: the cyclic
        # collector's full passes would otherwise dominate the mount time.
        gc_was = gc.isenabled()
        gc.disable()
        try:
            MountRecovery(self).load(info)
        finally:
            if gc_was:
                gc.enable()
        for z in range(self.meta_zones):       # metadata zones count against max_open too
            if self.dev.zone(z).is_open:
                self.open_lru[z] = None

    def _snapshot(self) -> bytes:
        with self.lock:
            head = R.SnapshotHeader(self.next_ino, self.now,
                                    {z: g for z, g in enumerate(self.zgen) if g},
                                    self.csums.items())
            return NS.encode_snapshot_parts(self.inodes, head)

    # ------------------------------------------------------------------ journal apply
    def do_locked(self, rtype: int, payload: bytes):
        """Apply a record to memory and queue it in the journal (caller holds self.lock)."""
        assert self.lock._is_owned(), "do_locked without Store.lock"
        self.failure.check_locked()         # (the parts' own methods: ~7 records per small
        res = self.applier.apply(rtype, payload)   # file, each past two ``_Via`` lookups)
        self.journal.append(rtype, payload)
        if len(self.journal.pending) > (1 << 20):
            self._want_journal_flush = True
        return res

    # records -> memory, the same code at run time and at replay (apply.RecordApplier)
    _apply = _Via("applier", "apply")

    # ------------------------------------------------------------------ names recovery calls
    # (recovery.py will call the parts directly; until then these take the lock they need)
    def _note_reset(self, z: int) -> None:
        with self.lock:
            self.reclaim.note_reset_locked(z)

    def _free_inode(self, inode: Inode) -> None:
        with self.lock:
            self.ns.free_inode_locked(inode)

    def _load_policy(self, dir_ino: int, quiet: bool = False) -> None:
        with self.lock:
            self.hints.load_policy_locked(dir_ino, quiet)

    def _journal_flush(self, sync: bool) -> None:
        self.journal_flush_iolocked(sync)

    def _reset_empty_zones(self) -> None:
        self.reclaim.reset_empty_zones()

    def _ensure_open_slot(self, zone: int) -> None:
        self.data.ensure_open_slot_iolocked(zone)

    # ------------------------------------------------------------------ the parts' API
    # namespace (POSIX rules), nsops.NamespaceOps
    getattr = _Via("ns")
    stat = _Via("ns")
    readdir_stat = _Via("ns")
    lookup = _Via("ns")
    create = _Via("ns")
    mknod = _Via("ns")
    mkdir = _Via("ns")
    symlink = _Via("ns")
    readlink = _Via("ns")
    link = _Via("ns")
    unlink = _Via("ns")
    rmdir = _Via("ns")
    rename = _Via("ns")
    readdir = _Via("ns")
    setattr = _Via("ns")
    ref = _Via("ns")
    forget = _Via("ns")
    # extended attributes, xattrops.XattrOps
    setxattr = _Via("xattrs")
    getxattr = _Via("xattrs")
    listxattr = _Via("xattrs")
    removexattr = _Via("xattrs")
    path_of = _Via("inodes")
    # open files and write buffers, openfiles.OpenFiles
    open = _Via("files")
    buffer_write = _Via("files")
    write = _Via("files")
    truncate = _Via("files")
    # fallocate(2), falloc.Falloc
    allocate = _Via("falloc")
    punch = _Via("falloc")
    # data path, datapath.DataPath; reads, readpath.ReadPath
    read = _Via("reads")
    read_cached = _Via("reads")
    seek = _Via("reads")
    declare_save = _Via("data")
    # reclaim, reclaim.Reclaim
    reset_empty_zones = _Via("reclaim")
    # observability, stats.StoreStats; checks, fsck.Fsck
    statfs = _Via("report")
    status = _Via("report")
    zone_map = _Via("report")
    check = _Via("fsck")
    scrub = _Via("fsck")

    def root(self) -> Inode:
        return self.inodes[ROOT_INO]

    @property
    def reset_pending(self) -> bool:
        """Zones emptied by a deletion wait for ``reset_empty_zones``."""
        return bool(self.reclaim.pending)

    def start_workers(self) -> None:
        """Start the flush and readahead threads (else at their first use)."""
        self.flushes.workers.start()
        self.reads.ra.pool.start()

    # ------------------------------------------------------------------ commit / sync ordering
    def maybe_flush_journal_iolocked(self) -> None:
        if self._want_journal_flush:
            self._want_journal_flush = False
            self.journal_flush_iolocked(sync=False)

    def journal_flush_iolocked(self, sync: bool, mark: bool = False) -> None:
        """Write queued records (io_lock held; the namespace lock only to detach them).
        ``mark``: with the proof of the last flush even if nothing else is queued."""
        assert self.io_lock._is_owned(), "journal_flush_iolocked without io_lock"
        with self.lock:
            self.check_failed_locked()
            plan = self.journal.prepare(mark=mark)
            if plan is None and not sync:
                return
            g = self._wgen       # data writes completed before the frame (and its flush)
            self._frames_in_flight += plan is not None
        try:
            self.failure.commit_journal(plan, sync)
        except BaseException:
            with self.lock:
                self._frames_in_flight -= plan is not None
            raise
        # Counted only once written: a device flush on another thread (an fsync of another
        # file, a reset, the periodic sync: none holds io_lock) that read the count before
        # the frame was written must not pass for a flush of it.  Counting it first let an
        # fsync return with its INODE/EXTENT records still in the page cache (a power-cut
        # campaign lost an fsynced shard that way).  Data writes complete outside io_lock
        # (``DataPath.write``), so a sync claims only what was counted before it began: a
        # write counted since leaves ``_wgen`` ahead and the next durable commit flushes.
        # Both counts move under Store.lock (a lost increment would pass for a flush).
        with self.lock:
            self._wgen += plan is not None
            self._frames_in_flight -= plan is not None    # (with the count: no gap between)
            if sync:
                self._sgen = max(self._sgen, g + (plan is not None))

    def device_flush(self) -> None:
        """Flush the device; written data and journal frames before it are durable after it.
        Takes Store.lock only around the counts: an fsync and ``Reclaim``'s deletion resets
        call it with ``io_lock`` let go, a GC pass with it held (its copies must be durable
        before their frame).  ``_wgen`` counts writes once they completed, so what it says
        before the flush, the flush covers; so do the records queued before it (the journal
        is told: ``Journal.note_flushed``)."""
        with self.lock:
            self.check_failed_locked()
            g = self._wgen
            point = self.journal.flush_point()    # (the records queued so far: proven after)
        self.failure.flush_device()
        with self.lock:
            self._sgen = max(self._sgen, g)
            self.journal.note_flushed(point)
            if self.unsynced:
                sg = self._sgen
                self.unsynced = {i: w for i, w in self.unsynced.items() if w > sg}

    # the one-way failed state (failure.py)
    failed = property(lambda self: self.failure.why)
    fail = _Via("failure")
    check_failed_locked = _Via("failure", "check_locked")

    def data_durable_locked(self, inode) -> bool:
        """No byte of the file waits in a buffer or for a device flush (Store.lock held)."""
        return (not inode.has_buffered()
                and self.unsynced.get(inode.ino, 0) <= self._sgen)

    def _flush_durably(self) -> None:
        """Data, then the journal records that point at them, made durable in that order.

        The device flushes run outside io_lock, so writers of other files are not stalled
        behind a flush of everything the page cache / device cache holds."""
        if self._wgen != self._sgen:
            self.device_flush()
        with self.io_lock:
            self.journal_flush_iolocked(sync=False)
        if self._wgen != self._sgen:
            self.device_flush()

    def commit(self, ino: int, durable: bool, check_policy: bool = True) -> None:
        """close(2) (durable=False) or fsync (durable=True): data + extents + attributes out."""
        t0 = time.perf_counter()
        self.flushes.write_out(ino)
        policy_error = None
        with self.io_lock:
            with self.lock:
                inode = self.inodes.get(ino)
                wrote = inode is not None and inode.dirty
                if wrote:
                    inode.dirty = False
                    self.ns.save_inode_locked(inode)
                    self.stats["commits"] += 1
                # A .retainz is validated by the flush/fsync of the fd that wrote it, never by a
                # RELEASE: that is asynchronous, cannot report the error, and may run while a
                # new writer has truncated the file but not yet written it.
                if (check_policy and inode is not None and inode.policy_dirty
                        and inode.name == H.POLICY_NAME and inode.parent in self.inodes):
                    inode.policy_dirty = False
                    try:
                        self.hints.load_policy_locked(inode.parent)
                    except H.HintError as e:
                        policy_error = e
            # A close of a file with nothing new (a second close, a release after flush, a
            # file only created) leaves its namespace records to the periodic flush: one
            # block-padded frame per such close would cost 8 KiB of journal per file.
            if wrote or durable:
                self.journal_flush_iolocked(sync=False)
        if durable:
            self._flush_durably()
        self.report.observe_commit(time.perf_counter() - t0)
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
                    self.files.release_locked(inode)
            self.reclaim.reset_empty_zones()

    def sync(self) -> None:
        """Everything queued becomes durable (periodic flush, syncfs, unmount).  Then, if a
        flush covered frames no record says it did, one small frame says so (durable at the
        next flush: the next tick, or unmount's): without it a quiet log's last data writes
        stay unproven, and a damaged zone table under them would pass for a lost cache at
        the next mount (``MountRecovery.drop_lost_writes``)."""
        # A frame another thread detached and is writing is neither pending nor counted in
        # ``_wgen`` yet: without the third test an fsync of a directory (FSYNCDIR) passed
        # while the frame holding its unlink was in flight (a power cut then lost an
        # acknowledged SQLite commit: its journal came back hot).  ``_flush_durably`` takes
        # io_lock, so it waits for that frame and then flushes it.  The three are read under
        # Store.lock, at one instant: a frame that ended between two unlocked reads was in
        # neither (``journal_flush_iolocked`` moves its counts under the lock).
        with self.lock:
            behind = (self.journal.has_pending() or self._wgen != self._sgen
                      or self._frames_in_flight)
        if behind:
            self._flush_durably()
        if self.journal.needs_mark():
            with self.io_lock:
                self.journal_flush_iolocked(sync=False, mark=True)

    def periodic_sync(self) -> None:
        """The mount's periodic tick: buffers past ``dirty_expire`` to the device, then
        everything queued durable."""
        self.files.writeback()
        self.sync()

    def close(self) -> None:
        """Unmount: commit every buffered file, flush the journal, release the device."""
        for ino in [i.ino for i in self.inodes.values() if i.has_buffered()]:
            if self.failed is not None:
                break           # (said once below; a line per file is noise)
            try:
                self.commit(ino, durable=False)
            except OSError as e:
                log.error("unmount: could not commit inode %d: %s", ino, e)
        self.flushes.workers.shutdown(wait=True)
        self.reads.ra.close()
        if self.failed is None:
            try:
                self.sync()
                self.failure.flush_device()
            except OSError:
                if self.failed is None:
                    raise
        if self.failed is None:
            mark_log(self, R.UNMOUNTED)
        if self.failed is not None:
            log.error("unmounted after a device error (%s): what no flush proved is checked "
                      "at the next mount", self.failed)
