"""Sequential readahead inside the daemon: device reads larger and earlier than FUSE's.

Why: a cold read reaches us as 1 MiB READ requests with only a few in flight, and each one
costs an O_DIRECT read of 1 MiB in the requesting thread; ext4 reads ahead in large
requests of its own.  Once a file is read sequentially, the next ``WINDOW`` bytes of it are
read in the background (each contiguous zone range in one O_DIRECT read, checksums verified
there, without the GIL), and the requests that follow are answered from those buffers:
no device call, no copy (the reply is taken from the buffer).  A request that falls in a window still
being read waits for it instead of reading the same bytes again.  Only a reader that has read
``START`` bytes in sequence gets windows: random reads (and mmap page faults, which the kernel
widens to 4 MiB) read only what they ask.  (Starting windows at once where a reader that was
sequential jumps to, for a DCP load's item order, made random mmap reads after a sequential
pass 2x slower, each 4 MiB fault growing 12 MiB of windows: not done.)  Windows never read what
the file's readers were answered lately (``_File.served``, cleared at each open): the kernel's
page cache holds it and will not ask again, so a window that reaches such bytes ends there
instead of reading, say, the DCP item read just before this one (a shard written by 4 threads
is read backwards, item by item).

Why it cannot serve stale bytes: entries are zone ranges keyed by (zone, zone generation).
Zone bytes below the write pointer never change until the zone is reset, and a reset bumps
the generation first (``Reclaim``), so an entry of an old generation is never matched; the
file->zone mapping itself is looked up afresh, under ``Store.lock``, for every request.
Zones out of service (``Store.bad_zones``) are never served from here.  Files with buffered
(unwritten) bytes are not read ahead.

Memory: at most ``ReadAhead.max_files`` files (``MAX_FILES``, fewer under a memory limit),
each with at most ``AHEAD`` windows (plus the one being served) ahead and, while all files
hold less than ``ReadAhead.behind_budget``, ``KEEP_BEHIND`` bytes behind the reader held; the
buffers return to ``_iobuf``'s pool when dropped.

Locks: ``ReadAhead.lock`` (a plain Lock, innermost: taken under ``Store.lock`` or alone, never
around device I/O or another lock).  Prefetches run on the ``rz-readahead`` threads (one per file).
"""
from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections import OrderedDict
from concurrent.futures import Future

from ._iobuf import assemble
from .errors import FsError, StaleRead
from .workers import Workers

log = logging.getLogger("retainzfs")

MiB = 1 << 20
WINDOW = 4 * MiB        # bytes of a file read by one prefetch
AHEAD = 3               # windows kept read (or being read) ahead of the reader
MAX_FILES = 8           # files with readahead state (LRU)
#: bytes of windows kept behind the reader (the furthest behind go first): a DCP load reads
#: items in dictionary order and comes back for bytes just behind where it was; only while
#: all files together hold less than half of what their windows ahead can (``behind_budget``;
#: 8 sequential readers' windows ahead reach it: keeping 8 MiB behind each took the daemon to
#: 319 MiB in bench_io)
KEEP_BEHIND = 2 * WINDOW
#: bytes read in sequence before the windows start: more than the kernel's own readaround of
#: one mmap fault (``read_ahead_kb``, 4 MiB), so random page faults never trigger them.
#: (16 MiB was measured: a DCP load of 4-thread shards, read out of file order, went from
#: ~1.3 to ~1.2 of ext4's time -- inside an item the kernel already has 4-12 requests in flight
#: -- but of 1-thread shards, FileSystemWriter's default, whose items come in file order and
#: get windows across them, from ~1.1 to ~1.2: not changed.)
START = 8 * MiB
#: ranges answered lately remembered per file (windows never read them again)
SERVED = 64
#: ... if at least this long (see ``_clip``)
CLIP_MIN = 1 * MiB


class _Seg:
    """Verified bytes of zone ``zone`` (generation ``zgen``) at [zoff, zoff + len(view)),
    holding file bytes [foff, foff + len(view))."""
    __slots__ = ("zone", "zgen", "zoff", "end", "foff", "view")

    def __init__(self, zone: int, zgen: int, zoff: int, foff: int, view) -> None:
        self.zone, self.zgen, self.zoff, self.foff, self.view = zone, zgen, zoff, foff, view
        self.end = zoff + len(view)


class _File:
    __slots__ = ("last_end", "streak", "served", "segs", "pf_end", "pending")

    def __init__(self) -> None:
        self.last_end = -1                 # end of the previous request (sequential test)
        self.streak = 0                    # bytes read in sequence up to last_end
        self.served: list[list[int]] = []  # file ranges answered lately, sorted, merged
        self.segs: list[_Seg] = []
        self.pf_end = 0                    # end of the file range read ahead (done or pending)
        self.pending: list[tuple[int, int, Future]] = []   # (start, end, future) in flight


def _trim(f: _File, off: int, keep) -> None:
    """Drop windows wholly behind ``off``, the furthest behind first, beyond ``keep()``
    bytes (asked only when something is behind: it sums every file's windows).  Dropping all
    of them at once made a 200 MiB DCP load read 246 MiB from the device (items come in
    dictionary order, not file order); keeping 8 MiB, 213 MiB."""
    behind = [g for g in f.segs if g.foff + len(g.view) <= off]
    if not behind:
        return
    held = sum(len(g.view) for g in behind)
    keep = keep()
    if held <= keep:
        return
    behind.sort(key=lambda g: g.foff)
    drop = set()
    for g in behind:
        if held <= keep:
            break
        drop.add(id(g))
        held -= len(g.view)
    f.segs = [g for g in f.segs if id(g) not in drop]


def _note_served(f: _File, a: int, b: int) -> None:
    """Add [a, b) to the ranges answered lately (the kernel's page cache holds them: it will
    not ask again, so no window reads them again).  At most SERVED ranges are kept (the one
    farthest from the newest goes)."""
    r = f.served
    i = bisect_left(r, [a])
    if i and r[i - 1][1] >= a:
        i -= 1
    j = i
    while j < len(r) and r[j][0] <= b:
        a, b = min(a, r[j][0]), max(b, r[j][1])
        j += 1
    r[i:j] = [[a, b]]
    if len(r) > SERVED:                 # forget the range farthest from this one
        del r[0 if a - r[0][1] > r[-1][0] - b else -1]


def _clip(f: _File, start: int, end: int, min_len: int = CLIP_MIN) -> int:
    """``end`` cut where a range of at least ``min_len`` answered lately begins (``start`` if
    inside one).  Shorter ranges are read again: a DCP load read forwards reads each item's
    zip records (128 KiB at its end) before its data, and the windows must run on past
    them into the next item; read backwards, the item after is a large range."""
    for a, b in f.served:
        if b <= start or b - a < min_len:
            continue
        if a >= end:
            break
        return max(start, a)
    return end


class ReadAhead:
    def __init__(self, data, max_files: int = MAX_FILES) -> None:
        """``max_files``: files with windows at once (``MAX_FILES``; fewer under a memory
        limit, ``retainzfs.memory``)."""
        self.data = data
        self.resize(max_files)
        self.s = data.s
        self.lock = threading.Lock()
        self.files: OrderedDict[int, _File] = OrderedDict()
        # one per file: the disk serves parallel reads faster (8 readers of 128 MiB here:
        # 3 threads 2.0 s, 8 threads 1.3 s, 16 threads 1.1 s, a plain file 0.84 s); 16 took
        # the daemon to 280 MiB peak in bench_io, too close to the 300 MiB target
        # (``workers.Workers``: started at INIT; fewer under a pids limit, none: no readahead)
        self.pool = Workers(max_files, "rz-readahead")
        self.hits = 0
        self.prefetched = 0

    def resize(self, max_files: int) -> None:
        """Files with windows at most from now on (the mount's memory budget, known once the
        metadata is loaded); the least recently read lose theirs at their next miss."""
        self.max_files = max_files
        self.behind_budget = max_files * AHEAD * WINDOW // 2

    # ------------------------------------------------------------------ serving
    def hit_locked(self, ino: int, off: int, size: int, segs: list) -> object | None:
        """The bytes of [off, off+size) (``segs`` = its extent lookup) from the windows read
        ahead, or None.  Store.lock held; CPU only.  Schedules the next window when the
        reader is past the middle of what is held."""
        s = self.s
        with self.lock:
            f = self.files.get(ino)
            if f is None:
                return None
            parts = []
            for dst, zone, zoff, length in segs:
                if zone in s.bad_zones:
                    return None
                zg = s.zgen[zone]
                for g in f.segs:
                    if g.zone == zone and g.zgen == zg and g.zoff <= zoff and zoff + length <= g.end:
                        parts.append((dst, g.view[zoff - g.zoff:zoff - g.zoff + length]))
                        break
                else:
                    return None
            if not parts:
                return None
            self.files.move_to_end(ino)
            f.streak = f.streak + size if off == f.last_end else size
            f.last_end = off + size
            _note_served(f, off, off + size)
            _trim(f, off, self._keep_behind_locked)
            self.hits += 1
            nxt = self._windows(f, off + size)
        for w in nxt:
            self._submit(ino, *w)
        if len(parts) == 1 and parts[0][0] == 0 and len(parts[0][1]) == size:
            return parts[0][1]
        return assemble(parts, size)       # a hole reads as zeros, as in ReadPath.read

    def _keep_behind_locked(self) -> int:
        """``KEEP_BEHIND`` while all files' windows hold less than ``behind_budget``, else 0
        (self.lock held)."""
        held = sum(len(g.view) for f in self.files.values() for g in f.segs)
        return KEEP_BEHIND if held < self.behind_budget else 0

    def pending_for(self, ino: int, off: int, size: int) -> Future | None:
        """A window being read that covers the start of [off, off+size), to wait for."""
        with self.lock:
            f = self.files.get(ino)
            if f is not None:
                for a, b, fut in f.pending:
                    if a <= off < b:
                        return fut
        return None

    def note_miss(self, ino: int, off: int, size: int) -> None:
        """A request the windows did not answer (it reads the device itself): once ``START``
        bytes were read in sequence, the windows start behind it."""
        with self.lock:
            f = self.files.get(ino)
            if f is None:
                f = self.files[ino] = _File()
                while len(self.files) > self.max_files:
                    self.files.popitem(last=False)
            f.streak = f.streak + size if off == f.last_end else size
            f.last_end = off + size
            _note_served(f, off, off + size)
            nxt = []
            if f.streak >= START:
                pos = off + size
                # requests arrive out of order (the kernel has several in flight): a miss
                # behind or inside what is held or coming keeps it; only a reader that left
                # it (a jump) starts the windows again where it is now
                lo = min([a for a, _, _ in f.pending] + [g.foff for g in f.segs],
                         default=None)
                if lo is None or not lo - WINDOW <= pos <= f.pf_end:
                    f.pf_end = pos
                    f.segs = []
                nxt = self._windows(f, pos)
        for w in nxt:
            self._submit(ino, *w)

    def opened(self, ino: int) -> None:
        """A new open of the file: what it read before may have left the page cache since
        (a restore after ``drop_caches``, memory pressure), so windows may read it again."""
        with self.lock:
            f = self.files.get(ino)
            if f is not None:
                f.served.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self.lock:
            self.files.clear()

    # ------------------------------------------------------------------ windows
    def _windows(self, f: _File, pos: int) -> list[tuple[int, int]]:
        """(start, end) of the windows to read so that ``AHEAD`` windows are held or being
        read ahead of ``pos`` (each its own prefetch: the disk gets a queue).  self.lock
        held; the caller submits them."""
        out = []
        while f.pf_end - pos < AHEAD * WINDOW and len(f.pending) + len(out) < AHEAD:
            start = max(f.pf_end, pos)
            end = _clip(f, start, start + WINDOW)
            if end <= start:
                break                      # read before: the kernel has it
            f.pf_end = end
            out.append((start, end))
        return out

    def _submit(self, ino: int, start: int, end: int) -> None:
        fut: Future = Future()
        with self.lock:
            f = self.files.get(ino)
            if f is None:
                return
            f.pending.append((start, end, fut))
        if self.pool.submit(self._prefetch, ino, start, end, fut) is None:
            self._done(ino, fut)           # no reader thread (shut down, or none started)
            fut.set_result(None)

    def _done(self, ino: int, fut: Future) -> None:
        with self.lock:
            f = self.files.get(ino)
            if f is not None:
                f.pending = [p for p in f.pending if p[2] is not fut]

    def _prefetch(self, ino: int, start: int, end: int, fut: Future) -> None:
        s = self.s
        d = self.data
        try:
            with s.lock:
                inode = s.inodes.get(ino)
                if inode is None or inode.has_buffered() or start >= inode.size:
                    return
                end = min(end, inode.size)
                segs = inode.extents.lookup(start, end - start)
                gens = d.gens_locked(segs)
            got = []
            for dst, zone, zoff, length in segs:
                if zone in s.bad_zones:
                    break
                try:
                    v = d.verified_read(zone, zoff, length, ino, start + dst, gens)
                except (FsError, OSError, StaleRead):
                    break              # the request itself will read it and report it
                got.append(_Seg(zone, gens[zone], zoff, start + dst, memoryview(v)))
            if not d.gens_hold(gens):  # a reset began under the read (ReadPath.read)
                return
            with self.lock:
                f = self.files.get(ino)
                if f is not None:
                    f.segs.extend(got)
                    self.prefetched += sum(len(g.view) for g in got)
        except Exception:                  # readahead is an optimisation: never fail a read
            log.exception("readahead of inode %d", ino)
        finally:
            self._done(ino, fut)
            fut.set_result(None)
