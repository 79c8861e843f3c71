"""fallocate(2) on a zoned log: which modes mean what here, and how a hole is journaled.

Owns no state: the modes are operations on a file's size and extents (``OpenFiles`` owns the
buffered bytes, written out first; ``Reclaim`` the bytes a punch frees).  Space cannot be set
aside on a zoned log -- a later write of a range goes to a new place whatever was done now --
so "allocate" checks room and moves the size (``allocate``).  A hole is a range with no
extent: a PUNCH record drops the range's extents (``punch``), read back as zeros, as after a
truncate that cut a file short and a write that extended it again.  Collapsing and inserting
ranges (moving every extent after them) are not done: EOPNOTSUPP.
"""
from __future__ import annotations

import errno
from time import time_ns as now_ns

from . import records as R
from .errors import FsError

#: superblock feature: the journal may hold PUNCH records (a version without it would refuse
#: them at replay; images made before it answer EOPNOTSUPP, so that version can still mount them)
PUNCH_FEATURE = "punch_hole"


class Falloc:
    """fallocate(2)'s modes 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE[|KEEP_SIZE]."""

    def __init__(self, store) -> None:
        self.s = store

    def _room(self, ino: int, off: int, end: int) -> None:
        """ENOSPC unless the range's bytes that hold no data yet fit in the free space now
        (the promise a successful allocation makes), or EISDIR/ENODEV for what is no file."""
        s = self.s
        with s.lock:
            inode = s.ns.get_locked(ino)
            if not inode.is_reg:
                raise FsError(errno.EISDIR if inode.is_dir else errno.ENODEV)
            need = (end - off) - inode.extents.mapped_between(off, end)
        st = s.report.statfs()
        if need > st["bfree"] * st["bsize"]:
            raise FsError(errno.ENOSPC, f"fallocate of {end - off} bytes: {need} are not "
                                        f"written yet and {st['bfree'] * st['bsize']} are free")

    def allocate(self, ino: int, off: int, length: int, keep_size: bool) -> None:
        """Modes 0 and KEEP_SIZE.  As OpenZFS does for its copy-on-write files, the room is
        checked and mode 0 extends the size; ``st_blocks`` stays what was written.  Why not
        EOPNOTSUPP: ``fallocate -l`` failed outright, and glibc's ``posix_fallocate`` then
        wrote a byte into every 4 KiB block itself (64 MiB in 2 s, 80 MiB of padding through
        the log)."""
        self._room(ino, off, off + length)
        if not keep_size:
            self.s.files.truncate(ino, off + length, grow_only=True)

    def punch(self, ino: int, off: int, length: int, zero: bool, keep_size: bool) -> None:
        """PUNCH_HOLE (``zero`` False; the kernel only sends it with KEEP_SIZE) or ZERO_RANGE:
        the range's extents go in one PUNCH record, its bytes read as zeros, the dead bytes
        count toward their zones' resets.  ZERO_RANGE checks room as ``allocate`` does and,
        without KEEP_SIZE, extends the size.  Like a truncate the record is durable at the
        next fsync (or the periodic sync); the buffered bytes of the file are written first,
        so none of them lands in the hole afterwards."""
        s = self.s
        if PUNCH_FEATURE not in s.sb.features:
            raise FsError(errno.EOPNOTSUPP, "image made before holes could be journaled")
        end = off + length
        if zero:
            self._room(ino, off, end)
        s.flushes.write_out(ino)
        with s.io_lock:
            with s.lock:
                inode = s.ns.get_locked(ino)
                if not inode.is_reg:
                    raise FsError(errno.EISDIR if inode.is_dir else errno.ENODEV)
                if not zero and off >= inode.size:
                    return                       # past the end: nothing to punch (as ext4)
                dead = s.do_locked(R.PUNCH, R.pack_punch(ino, off, end))
                s.reclaim.dead_locked(dead)
                inode.mtime = inode.ctime = now_ns()
                inode.dirty = True               # the next close makes it durable
                s.ns.save_inode_locked(inode)
        s.reclaim.reset_empty_zones()
        if zero and not keep_size:
            s.files.truncate(ino, end, grow_only=True)
