"""Open files: open counts, write buffers and the bounds on what they hold, truncate.

Owns the per-inode buffer state (``wbuf``, ``dirty``, ``opens``) and the bounds on buffered
bytes that the kernel keeps for its own dirty pages: all files together hold at most
``StoreOptions.dirty_bytes`` (past it a writer writes its own buffer out before it returns: the
daemon's memory does not grow with the number of files being written), and a buffer older than
``StoreOptions.dirty_expire`` seconds is committed by the periodic sync (``writeback``: a file
held open and written slowly, a training log, is on the device within that time, as ext4
writes dirty pages back within 30 s).  Buffered bytes go to zones through ``flushes.Flushes``
(the ``rz-flush`` workers, turns, parked errors); near a full device ``room.Room`` decides
what may stay buffered.  ``buffer_write``, ``flush_clean`` and ``release_clean`` are the
CPU-only fast paths: Store.lock only, no I/O.
"""
from __future__ import annotations

import errno
import stat
import time
from time import time_ns as now_ns

from . import hints as H
from . import records as R
from .errors import FsError
from .readpath import HOLE_BLOCK
from .room import Room

#: a write this far past the end of a file's buffered bytes, over a hole, joins the buffer with
#: zeros between (``OpenFiles.gap_locked``) rather than ending it, unless the gap holds a whole
#: ``HOLE_BLOCK`` (the unit SEEK_HOLE reports): that block stays a hole
GAP_MAX = 64 << 10


class OpenFiles:
    def __init__(self, store):
        self.s = store
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
        freeing an unlinked file.  Store.lock only, no I/O; False: call ``Store.release``.
        A freed file may leave zones to reset (``Store.reset_pending``)."""
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
        write, and the daemon at 868 MB.  A gap that holds a whole 4 KiB block
        (``HOLE_BLOCK``) is not joined: the zeros would be data, and SEEK_DATA / SEEK_HOLE
        (reported in those blocks, as ext4 does) would find no hole where the program left
        one (xfstests' seek_sanity_test 06.14); a gap within two blocks that hold written
        bytes changes no answer.  Store.lock held."""
        if not buf or off == buf.end:
            return 0
        gap = off - buf.end
        if (0 < gap <= GAP_MAX and -(-buf.end // HOLE_BLOCK) * HOLE_BLOCK + HOLE_BLOCK > off
                and not inode.extents.mapped_between(buf.end, off)):
            return gap
        return None

    def _note_locked(self, ino: int, was_empty: bool, n: int) -> None:
        """Count ``n`` more bytes held by the file's buffer: those appended and the change
        in the arena room its parts keep alive (``WriteBuffer.slack``).  Store.lock held."""
        if was_empty:
            self.dirty_since.pop(ino, None)           # re-inserted last: oldest stay first
            self.dirty_since[ino] = time.monotonic()
        self.buffered += n

    def dropped_locked(self, inode, n: int) -> None:
        """A flush wrote the first ``n`` bytes of the file's buffer: drop them and count
        them off.  Store.lock held."""
        assert self.s.lock._is_owned(), "dropped_locked without Store.lock"
        wb = inode.wbuf
        slack = wb.slack
        wb.drop(n)
        self.buffered = max(0, self.buffered - n - slack + wb.slack)
        if not wb and not inode.inflight:
            # holds nothing now: no longer a file that may need a zone of its own
            # (``Room.room_locked`` counts these); left for the periodic writeback, 500 small
            # files closed within its second left no room on a 2 GiB image and every write
            # went through
            self.dirty_since.pop(inode.ino, None)

    def write(self, ino: int, off: int, data: bytes) -> int:
        n = len(data)
        if n == 0:
            return 0
        s, fl = self.s, self.s.flushes
        # An earlier background flush's error (parked) is this write's, reported before its
        # bytes are taken (else the write failed with its bytes kept in the file's size); on
        # a full device, after waiting for that flush.
        if s.capacity_stop:
            fl.wait_flush(ino)
        else:
            fl.check_flush_error(ino)
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
                fl.flush_data(ino, final=True)
                continue
            if through:
                # lands now or fails with ENOSPC itself; its bytes are dropped on failure,
                # and so when an earlier flush failed meanwhile (its error is then this
                # write's)
                landed = self.room.write_through(ino, off, n)
                fl.check_flush_error(ino)
                return landed
            elif over:
                # all buffers together are at the bound: this writer's bytes go out before it
                # returns (throttled to the device, as the kernel throttles a dirtier)
                fl.flush_data(ino, final=False)
            elif full:
                fl.flush_background(ino)
            return n

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
                s.flushes.park(ino, e)

    def truncate(self, ino: int, size: int, grow_only: bool = False,
                 touch: bool = False, kill_priv: bool = False) -> None:
        """Set the size; ``grow_only``: never below the size it has when the locks are held
        (a fallocate racing a writer that extended the file meanwhile must not cut it);
        ``touch``: the modification and change times too when the size stays (O_TRUNC of an
        empty file, as on ext4); ``kill_priv``: clear set-user-ID, and set-group-ID with
        group execute, in the same inode record."""
        s = self.s
        s.flushes.write_out(ino)
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
