"""Open files: write buffers, the in-flight background flush, the parked flush error.

Owns the ``rz-flush`` workers (four; at most two zone writes of a file in flight,
``Inode.flushing``/``flushing_prev``) and the per-inode buffer state (``wbuf``, ``inflight``,
``flush_turn``, ``flush_err``, ``dirty``), and the bounds on buffered bytes that the kernel
keeps for its own dirty pages: all files together hold at most ``StoreOptions.dirty_bytes``
(past it a writer writes its own buffer out before it returns: the daemon's memory does not
grow with the number of files being written), and a buffer older than
``StoreOptions.dirty_expire`` seconds is committed by the periodic sync (``writeback``: a file
held open and written slowly, a training log, is on the device within that time, as ext4
writes dirty pages back within 30 s).  Buffered bytes go to zones through the data path's
write loop (``flush_data``: take bytes and a turn under Store.lock, stage them with no lock,
wait for the turn, then io_lock, then Store.lock for the bookkeeping).  ``buffer_write``,
``flush_clean`` and ``release_clean`` are the CPU-only fast paths: Store.lock only, no I/O.
"""
from __future__ import annotations

import errno
import logging
import stat
import threading
import time
from time import time_ns as now_ns

from . import hints as H
from . import records as R
from .errors import FsError
from .room import Room
from .workers import Workers

log = logging.getLogger("retainzfs")

FLUSH_WORKERS = 4
#: a write this far past the end of a file's buffered bytes, over a hole, joins the buffer with
#: zeros between (``OpenFiles.gap_locked``) rather than ending it
GAP_MAX = 64 << 10


class OpenFiles:
    def __init__(self, store):
        self.s = store
        # Full write buffers go to zones in the background while FUSE keeps accepting writes.
        # Four workers: staging (copy, checksums) and the device write run without locks
        # (io_lock only to place), so several files' 4 MiB writes are on the disk at once:
        # 2.7 in flight on average with 8 writers (1.4 with two workers).
        # (``workers.Workers``: started at INIT; fewer under a pids limit, none: writers flush)
        self.flusher = Workers(FLUSH_WORKERS, "rz-flush")
        self._busy = 0                        # background flushes queued or running (Store.lock)
        # Store.lock: memory in write buffers, their bytes and the arena room their parts
        # keep alive (``WriteBuffer.slack``; added on append, taken off when a flush drops
        # them; a buffer cleared otherwise is taken off at the next ``writeback`` recount, so
        # this may be high for a moment, never low for long), and the files with buffered
        # bytes, oldest first, with the monotonic time their buffer was last empty.
        self.buffered = 0
        self.dirty_since: dict[int, float] = {}
        self.room = Room(store, self)

    def open(self, ino: int, truncate: bool = False, kill_priv: bool = False):
        """``truncate``: O_TRUNC (an empty file's times change too, as POSIX asks);
        ``kill_priv``: by a caller other than root, which takes the set-ID bits as the
        kernel's truncate would (FUSE_ATOMIC_O_TRUNC: the kernel sends no truncate of its own,
        and ``: > f`` by a user kept a world-writable setuid file setuid; ext4 clears it)."""
        if truncate:
            self.truncate(ino, 0, touch=True, kill_priv=kill_priv)
        s = self.s
        with s.lock:
            inode = s.ns.get_locked(ino)
            inode.opens += 1
            s.reads.ra.opened(ino)
            return inode

    @staticmethod
    def clean_locked(inode) -> bool:
        """Nothing for a commit to do: no buffered bytes, no background flush (in flight or
        done: ``flushing`` is kept), no parked error, attributes saved, no ``.retainz`` waiting
        for validation.  Store.lock held."""
        return not (inode.has_buffered() or inode.dirty or inode.inflight
                    or inode.flush_err is not None
                    or (inode.policy_dirty and inode.name == H.POLICY_NAME))

    def flush_clean(self, ino: int) -> bool:
        """True when a close's ``Store.commit(durable=False)`` would do nothing (a file opened
        only to read, a second close): the FUSE adapter then skips the commit.
        Store.lock only, no I/O."""
        s = self.s
        with s.lock:
            inode = s.inodes.get(ino)
            return inode is None or self.clean_locked(inode)

    def release_clean(self, ino: int) -> bool:
        """``Store.release`` without its commit when that has nothing to do (the usual
        RELEASE after a close's FLUSH wrote the file): the open count, the allocator's writer,
        freeing an unlinked file.  Store.lock only, no I/O; False: call ``Store.release``.  A freed file may leave zones to reset (``Store.reset_pending``)."""
        s = self.s
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None:
                return True
            if not self.clean_locked(inode):
                return False
            self.release_locked(inode)
            return True

    def release_locked(self, inode) -> None:
        """One close less: at the last one the allocator forgets the writer, and a file
        unlinked meanwhile is freed (Store.lock held; the tail of every RELEASE)."""
        assert self.s.lock._is_owned(), "release_locked without Store.lock"
        s = self.s
        inode.opens = max(0, inode.opens - 1)
        if inode.opens == 0:
            s.alloc.release_writer(inode.ino)
            if inode.nlink == 0:
                s.ns.free_inode_locked(inode)
            else:
                inode.shed_finished()

    def buffer_write(self, ino: int, off: int, data: bytes) -> int | None:
        """Append to the file's write buffer if that needs no device I/O; else None.

        Most writes take this path (one lock, an append); the writes that would fill the
        buffer, and those ``Room.write_through_locked`` names, go through ``write``, which may
        flush."""
        s = self.s
        self.room.refresh_medium()
        with s.lock:
            inode = s.ns.get_locked(ino)
            buf = inode.wbuf
            n = len(data)
            gap = self.gap_locked(inode, buf, off) if n else None
            if (gap is None or inode.flush_err is not None or s.failed is not None
                    or len(buf) - inode.inflight + gap + n >= s.opts.flush_bytes
                    or self.buffered + gap + n > s.opts.dirty_bytes
                    or self.room.write_through_locked(buf, gap + n)):
                return None
            was_empty, slack = not buf, buf.slack
            if was_empty:
                buf.size0 = inode.size
            if gap:
                buf.append(buf.end, bytes(gap))
            buf.append(off, data)
            self._note_locked(ino, was_empty, gap + n + buf.slack - slack)
            inode.mtime = inode.ctime = now_ns()
            if off + n > inode.size:
                inode.size = off + n
            inode.dirty = inode.policy_dirty = True
            return n

    @staticmethod
    def gap_locked(inode, buf, off: int) -> int | None:
        """Zero bytes that join a write at ``off`` to the file's buffer: 0 when it continues
        the buffer (or starts one), the distance when it lands at most ``GAP_MAX`` past the
        buffer's end over a hole (nothing mapped there: the zeros are what a read of it
        gives), else None (the buffer is written out first).  Writes that skip ahead, such
        as every other 512-byte block of a new file (xfstests' fstest -F), each ended the
        buffer and padded its last block: 8.4 GB of padding for 1.3 GB written, an extent a
        write, and the daemon at 868 MB.  Store.lock held."""
        if not buf or off == buf.end:
            return 0
        gap = off - buf.end
        if 0 < gap <= GAP_MAX and not inode.extents.mapped_between(buf.end, off):
            return gap
        return None

    def _note_locked(self, ino: int, was_empty: bool, n: int) -> None:
        """Count ``n`` more bytes held by the file's buffer: those appended and the change
        in the arena room its parts keep alive (``WriteBuffer.slack``).  Store.lock held."""
        if was_empty:
            self.dirty_since.pop(ino, None)           # re-inserted last: oldest stay first
            self.dirty_since[ino] = time.monotonic()
        self.buffered += n

    def write(self, ino: int, off: int, data: bytes) -> int:
        n = len(data)
        if n == 0:
            return 0
        s = self.s
        # An earlier background flush's error (parked) is this write's, reported before its
        # bytes are taken (else the write failed with its bytes kept in the file's size); on
        # a full device, after waiting for that flush.
        if s.capacity_stop:
            self.wait_flush(ino)
        else:
            self.check_flush_error(ino)
        drained = False
        while True:
            need_flush = False
            self.room.refresh_medium()
            with s.lock:
                s.check_failed_locked()
                inode = s.ns.get_locked(ino)
                buf = inode.wbuf
                through = self.room.write_through_locked(buf, n)
                drain = through and not drained and not s.capacity_stop and self.buffered > 0
                if not drain:
                    was_empty, slack = not buf, buf.slack
                    if was_empty:
                        buf.size0 = inode.size
                    gap = self.gap_locked(inode, buf, off)
                    if gap:
                        buf.append(buf.end, bytes(gap))
                    need_flush = gap is None or not buf.append(off, data)
                if not drain and not need_flush:
                    self._note_locked(ino, was_empty, gap + n + buf.slack - slack)
                    over = (self.buffered > s.opts.dirty_bytes and not s.opts.inline_flush)
                    t = now_ns()
                    inode.mtime = inode.ctime = t
                    if off + n > inode.size:
                        inode.size = off + n
                    inode.dirty = inode.policy_dirty = True
                    full = len(buf) - inode.inflight >= s.opts.flush_bytes
            if drain:
                # the buffers would outgrow the room left: what they hold was accepted, so
                # it goes out first, while there is room for it; this write then buffers if
                # that made room, else it goes through
                self.room.drain()
                drained = True
                continue
            if need_flush:
                self.flush_data(ino, final=True)
                continue
            if through:
                # lands now or fails with ENOSPC itself; its bytes are dropped on failure,
                # and so when an earlier flush failed meanwhile (its error is then this
                # write's)
                landed = self.room.write_through(ino, off, n)
                self.check_flush_error(ino)
                return landed
            elif over:
                # all buffers together are at the bound: this writer's bytes go out before it
                # returns (throttled to the device, as the kernel throttles a dirtier)
                self.flush_data(ino, final=False)
            elif full:
                self.flush_background(ino)
            return n

    def flush_background(self, ino: int) -> None:
        """Queue a zone write of the full buffer.  At most two flushes of a file in flight, the
        second only while a flusher is free: then one stages the next chunk while the other
        writes, even for a single file; with many files, each keeps one (bounded RAM).
        With ``StoreOptions.inline_flush`` the caller's thread flushes, in turn."""
        s = self.s
        if s.opts.inline_flush or not self.flusher.size:
            self.flush_data(ino, final=False)
            return
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None:
                return
            prev, older = inode.flushing, inode.flushing_prev
        if older is not None:
            older.result()                    # never three chunks of one file in flight
        if prev is not None and self._busy >= self.flusher.size:
            prev.result()
        self.check_flush_error(ino)
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None:
                return
            fut = self.flusher.submit(self._bg_flush, ino)
            if fut is not None:
                self._busy += 1
                inode.flushing_prev = inode.flushing
                inode.flushing = fut
                return
        self.flush_data(ino, final=False)         # shut down (unmount): this thread flushes

    def _bg_flush(self, ino: int) -> None:
        s = self.s
        try:
            self.flush_data(ino, final=False)
        except OSError as e:
            with s.lock:
                inode = s.inodes.get(ino)
                if inode is not None:
                    inode.flush_err = e
        except Exception as e:                # never lose an error silently
            log.exception("background flush of inode %d", ino)
            with s.lock:
                inode = s.inodes.get(ino)
                if inode is not None:
                    inode.flush_err = FsError(errno.EIO, str(e))
        finally:
            with s.lock:
                self._busy -= 1

    def writeback(self) -> None:
        """Commit the files whose buffered bytes are older than ``dirty_expire`` (the periodic
        sync calls this before it makes the journal durable); recount ``buffered``.  An error
        is parked for the file's writer (its next write, fsync or close reports it), as a
        background flush's is.  No lock held."""
        s = self.s
        now = time.monotonic()
        due = []
        with s.lock:
            total = 0
            for ino, since in list(self.dirty_since.items()):
                inode = s.inodes.get(ino)
                n = len(inode.wbuf) if inode is not None and inode.has_buffered() else 0
                if not n:                   # (a flush future kept after it was done: clean)
                    del self.dirty_since[ino]
                    continue
                n += inode.wbuf.slack
                total += n
                if now - since >= s.opts.dirty_expire:
                    due.append(ino)
            self.buffered = total
        for ino in due:
            try:
                s.commit(ino, durable=False, check_policy=False)
            except OSError as e:
                with s.lock:
                    inode = s.inodes.get(ino)
                    if inode is not None and inode.flush_err is None:
                        inode.flush_err = e

    def wait_flush(self, ino: int) -> None:
        """Wait for the file's background flushes and raise their error, if any.  Both of
        them: the one before the latest has written (its turn passed) but its future may not
        be marked done yet, and a close that left it so kept both futures (``shed_finished``
        drops only done ones) until the kernel forgot the file."""
        s = self.s
        with s.lock:
            inode = s.inodes.get(ino)
            futs = (inode.flushing_prev, inode.flushing) if inode is not None else ()
        for fut in futs:
            if fut is not None:
                fut.result()
        self.check_flush_error(ino)

    def write_out(self, ino: int) -> None:
        """All of the file's bytes in zones: its background flushes waited for (their error
        raised) and the rest of its buffer written, a partial last block padded.  What a
        close, an fsync, a truncate, a hole punched and a device near full need first."""
        self.wait_flush(ino)
        self.flush_data(ino, final=True)

    def check_flush_error(self, ino: int) -> None:
        s = self.s
        with s.lock:
            inode = s.inodes.get(ino)
            err = inode.flush_err if inode is not None else None
            if err is not None:
                inode.flush_err = None
        if err is not None:
            raise FsError(err.errno or errno.EIO, str(err))

    def flush_data(self, ino: int, final: bool) -> None:
        """Move buffered bytes of a file to zones (whole blocks unless ``final``).

        A flush *takes* the buffered bytes after those earlier flushes took (``inflight``)
        and its turn (``flush_turn``) under Store.lock, stages them with no lock (copied for
        O_DIRECT, checksummed) so that overlaps another device write, even one of the same
        file, then waits for the flush before it to finish and writes under io_lock.  So the
        flushes of a file write, and drop their bytes from the buffer's front, in the order
        they took them; a ``final`` flush returns after all earlier ones.  A flush whose bytes
        were dropped meanwhile (an earlier one failed, the file was freed) writes nothing.
        Lock order: io_lock, then Store.lock; turns are waited for holding neither."""
        s = self.s
        assert not s.io_lock._is_owned(), "flush_data under io_lock (it may wait for a turn)"
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None:
                return
            wb = inode.wbuf
            lo = inode.inflight
            n = len(wb) - lo
            if not final:
                n -= n % s.bs
            prev = inode.flush_turn
            if n <= 0:
                data = None
            else:
                if inode.hint is None:
                    inode.hint = s.hints.resolve_locked(inode)
                    if inode.hint.birth > s.now:
                        s.now = inode.hint.birth
                hint = inode.hint
                data = wb.take(lo, n)
                off = wb.off + lo
                epoch = inode.flush_epoch
                inode.inflight = lo + n                    # taken: from here on, written or
                mine = inode.flush_turn = threading.Event()  # dropped, never left behind
        if data is None:                      # nothing new: just be after the earlier ones
            if prev is not None:
                prev.wait()
            return
        done = False
        try:
            try:
                staged = s.data.stage(data)
            except MemoryError:
                staged = None                 # written from the scatter list instead
            if prev is not None:
                prev.wait()
            with s.lock:
                inode = s.inodes.get(ino)
                if (inode is None or inode.wbuf is not wb or inode.flush_epoch != epoch
                        or wb.off != off):
                    done = True               # dropped meanwhile: nothing of ours to write
                    return
            # io_lock only to place: the device write runs in parallel with other flushes
            s.data.write(ino, off, data, hint, staged=staged)
            done = True
            with s.lock:
                inode = s.inodes.get(ino)
                if inode is not None and inode.wbuf is wb:
                    inode.inflight = max(0, inode.inflight - n)
                    if wb.off == off:
                        slack = wb.slack
                        wb.drop(n)
                        self.buffered = max(0, self.buffered - n - slack + wb.slack)
                        if not wb and not inode.inflight:
                            # holds nothing now: no longer a file that may need a zone of
                            # its own (``Room.room_locked`` counts these); left for the
                            # periodic writeback, 500 small files closed within its second
                            # left no room on a 2 GiB image and every write went through
                            self.dirty_since.pop(ino, None)
            if s._want_journal_flush:
                with s.io_lock:
                    s.maybe_flush_journal_iolocked()
        except BaseException:
            if not done:          # drop the uncommittable bytes; committed data stay intact
                with s.lock:
                    inode = s.inodes.get(ino)
                    if inode is not None and inode.wbuf is wb:
                        wb.clear()
                        inode.inflight = 0
                        inode.flush_epoch += 1
                        # back to the size before the dropped bytes (a size set by
                        # truncate stays: a sparse file does not shrink to its extents)
                        inode.size = max(wb.size0,
                                         max((e.end for e in inode.extents), default=0))
            raise
        finally:
            mine.set()
            with s.lock:                # passed: nothing after it waits for it (memory)
                inode = s.inodes.get(ino)
                if inode is not None and inode.flush_turn is mine:
                    inode.flush_turn = None
        s.reclaim.reset_empty_zones()

    def truncate(self, ino: int, size: int, grow_only: bool = False,
                 touch: bool = False, kill_priv: bool = False) -> None:
        """Set the size; ``grow_only``: never below the size it has when the locks are held
        (a fallocate racing a writer that extended the file meanwhile must not cut it);
        ``touch``: the modification and change times too when the size stays (O_TRUNC of an
        empty file, as on ext4); ``kill_priv``: clear set-user-ID, and set-group-ID with
        group execute, in the same inode record."""
        s = self.s
        self.write_out(ino)
        with s.io_lock:
            with s.lock:
                inode = s.ns.get_locked(ino)
                if not inode.is_reg:
                    raise FsError(errno.EISDIR if inode.is_dir else errno.EINVAL)
                killed = _kill_priv_locked(inode) if kill_priv else False
                if size == inode.size or (grow_only and size < inode.size):
                    if touch or killed:
                        inode.mtime = inode.ctime = now_ns()
                        s.ns.save_inode_locked(inode)
                    return
                dead = s.do_locked(R.TRUNCATE, R.pack_truncate(ino, size))
                s.reclaim.dead_locked(dead)
                if size == 0:       # O_TRUNC rewrite: new contents, resolve the hint again
                    inode.hint = None
                    inode.placed_hint = None
                inode.mtime = inode.ctime = now_ns()
                inode.policy_dirty = True
                inode.dirty = True             # the next close makes the truncation durable
                s.ns.save_inode_locked(inode)
        s.reclaim.reset_empty_zones()


def _kill_priv_locked(inode) -> bool:
    """Clear the bits a truncate by a caller other than root takes (Store.lock held)."""
    kill = inode.mode & stat.S_ISUID
    if inode.mode & (stat.S_ISGID | stat.S_IXGRP) == stat.S_ISGID | stat.S_IXGRP:
        kill |= stat.S_ISGID
    inode.mode &= ~kill
    return bool(kill)
