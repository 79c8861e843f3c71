"""Flushes: buffered bytes of a file to zones, in the order they were written.

Owns the ``rz-flush`` workers (four; ``workers.Workers``) and, per inode, the state of the
flushes in progress: the bytes taken from the front of the buffer (``Inode.inflight``), the
turn the next flush of the file waits for (``flush_turn``), the background flushes in flight
(``flushing``/``flushing_prev``: at most two), the epoch that tells a flush its bytes were
dropped (``flush_epoch``), and the error a background flush parks for the file's writer
(``flush_err``).  ``OpenFiles`` owns the buffers and their accounting; a flush hands back what
it wrote through ``OpenFiles.dropped_locked``.

Locks (``flush_data``): take bytes and a turn under Store.lock, stage them with no lock, wait
for the turn holding none, then io_lock only inside ``DataPath.write`` to place and reserve,
then Store.lock for the bookkeeping.
"""
from __future__ import annotations

import errno
import logging
import threading

from .errors import FsError
from .workers import Workers

log = logging.getLogger("retainzfs")

FLUSH_WORKERS = 4


class Flushes:
    """A file's buffered bytes to zones, in order: in the background (``flush_background``)
    or in the caller's thread (``flush_data``, ``write_out``)."""

    def __init__(self, store):
        self.s = store
        # Full write buffers go to zones in the background while FUSE keeps accepting writes.
        # Four workers: staging (copy, checksums) and the device write run without locks
        # (io_lock only to place), so several files' 4 MiB writes are on the disk at once:
        # 2.7 in flight on average with 8 writers (1.4 with two workers).
        # (``workers.Workers``: started at INIT; fewer under a pids limit, none: writers flush)
        self.workers = Workers(FLUSH_WORKERS, "rz-flush")
        self._busy = 0                        # background flushes queued or running (Store.lock)

    def flush_background(self, ino: int) -> None:
        """Queue a zone write of the full buffer.  At most two flushes of a file in flight, the
        second only while a flusher is free: then one stages the next chunk while the other
        writes, even for a single file; with many files, each keeps one (bounded RAM).
        With ``StoreOptions.inline_flush`` the caller's thread flushes, in turn."""
        s = self.s
        if s.opts.inline_flush or not self.workers.size:
            self.flush_data(ino, final=False)
            return
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None:
                return
            prev, older = inode.flushing, inode.flushing_prev
        if older is not None:
            older.result()                    # never three chunks of one file in flight
        if prev is not None and self._busy >= self.workers.size:
            prev.result()
        self.check_flush_error(ino)
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is None:
                return
            fut = self.workers.submit(self._bg_flush, ino)
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
            self.park(ino, e)
        except Exception as e:                # never lose an error silently
            log.exception("background flush of inode %d", ino)
            self.park(ino, FsError(errno.EIO, str(e)))
        finally:
            with s.lock:
                self._busy -= 1

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

    def park(self, ino: int, err: OSError) -> None:
        """Keep a flush's error for the file's writer (its next write, fsync or close raises
        it: ``check_flush_error``).  The first one parked wins: a later failure is most often
        a consequence of it, and the writer must hear the cause."""
        s = self.s
        with s.lock:
            inode = s.inodes.get(ino)
            if inode is not None and inode.flush_err is None:
                inode.flush_err = err

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
                        s.files.dropped_locked(inode, n)
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
