"""Room on a nearly full device, so that nothing is acknowledged and then lost: the room
write buffers may take (``Room``; issue 10's full-device finding: a flush that found no room
dropped the buffer it was part of, 8 MiB of acknowledged writes, with a silent close), and the
room the metadata zones have for one more name or xattr (``MetaRoom``).

ext4 reserves blocks at write time (delayed allocation); a zone policy decides where bytes go
only when they are flushed, so ``Room`` bounds what all buffers hold by what surely fits
(``room_locked``), sends every buffer out, partial last blocks too, when a write would pass
that (``drain``), and past it sends writes to a zone at once (``write_through``): they land,
or fail with ENOSPC themselves -- short when the device filled within one.

Locks: the ``_locked`` functions need ``Store.lock``; ``drain`` and ``write_through`` take it
and flush with none held (``Flushes.flush_data``).
"""
from __future__ import annotations

import errno
import logging
import time

from .errors import FsError

log = logging.getLogger("retainzfs")

MiB = 1 << 20
#: the host file system under an image is read again at most this often (a syscall)
MEDIUM_EVERY = 0.2
#: host space kept beyond the buffers: its own metadata for the image's new extents
MEDIUM_MARGIN = 8 * MiB


class Room:
    def __init__(self, store, files) -> None:
        self.s = store
        self.f = files           # OpenFiles: buffered, dirty_since
        # an image's host file system can fill before its zones do: (free bytes read,
        # ``dev.bytes_written`` then) and when, or None on a medium that is the zones
        self.medium: tuple[int, int] | None = None
        self.medium_at = 0.0
        self.watch_medium = store.dev.medium_free() is not None

    def refresh_medium(self) -> None:
        """Read the host file system's free space again when the last reading is older than
        ``MEDIUM_EVERY`` (an image only; no lock held: a syscall).  Between readings
        ``room_locked`` takes off what the device wrote since, so the estimate only errs
        low (a reset's hole punch gives space back) -- except for what other programs
        write to that file system meanwhile.  Any thread; ``medium`` is one tuple, replaced
        whole, read under Store.lock by ``room_locked``."""
        if not self.watch_medium:
            return
        now = time.monotonic()
        if now - self.medium_at < MEDIUM_EVERY:
            return
        dev = self.s.dev
        base = dev.bytes_written
        free = dev.medium_free()
        self.medium = None if free is None else (free, base)
        self.medium_at = now

    def room_locked(self) -> int:
        """Bytes the write buffers may hold and still surely reach a zone: the empty zones
        beyond the GC reserve, less a zone for each file holding buffered bytes and one for
        the writer asking, up to the active-zone limit (each may open a zone of its own for a
        short flush: ZenFS keeps a file in its zone, isolate a generation; no more than that
        limit are open at once); and no more than an image's host file system can still take
        (``refresh_medium``).  The free tails of active zones are not counted (a policy
        may not put these bytes there); they fill by the writes that go through.
        Store.lock held."""
        s = self.s
        spare = len(self.f.dirty_since) + 1
        if s.dev.max_active:
            spare = min(spare, s.dev.max_active)
        room = (s.alloc.empty_zones() - s.opts.gc_reserve - spare) * s.cap
        if self.medium is not None:
            # an image whose host file system has less room than its empty zones: 17 MiB
            # of acknowledged writes were dropped when the host filled (a 512 MiB image on
            # an 80 MiB file system, three files); a padded block per file for the flushes
            free, base = self.medium
            room = min(room, free - (s.dev.bytes_written - base) - MEDIUM_MARGIN
                       - spare * s.bs)
        return room

    def write_through_locked(self, buf, n: int) -> bool:
        """A write that goes to a zone at once, so that it lands or fails with ENOSPC itself
        (as on ext4, whose delayed allocation reserves room at write time) instead of being
        accepted and lost later (``echo x > f`` in a shell never looks at close's error, and
        a failed flush drops the buffer it was part of): every write while the device is
        full (a placement found no room, even after GC, and nothing was freed since), every
        write that would leave the buffers holding more than ``room_locked`` (``write``
        first drains them all, so the bytes already accepted get their room, and goes
        through only if that is still short), and the first write into an empty buffer
        while no empty zone is left beyond the GC reserve.  Not for ``replay``
        (``inline_flush``), whose placement must not depend on it.  Store.lock held."""
        s = self.s
        assert s.lock._is_owned(), "write_through_locked without Store.lock"
        if s.capacity_stop:
            return True
        if s.opts.inline_flush:
            return False
        return self.f.buffered + n > self.room_locked() or (
            not buf and s.alloc.empty_zones() <= s.opts.gc_reserve)

    def drain(self) -> None:
        """Write everything every file holds buffered to zones, oldest first, now -- a partial
        last block too, padded (one block per file, once: past this point writes go through).
        Kept back, such a block was lost: the writes that went through next could take the
        last zone, and the file's own next write then failed with ENOSPC and took the block's
        acknowledged bytes with it.  A failure is parked for that file's writer, as a
        background flush's is.  No lock held; called when the buffers would outgrow the room
        left on the device."""
        s = self.s
        with s.lock:
            inos = list(self.f.dirty_since)
        for ino in inos:
            try:
                s.flushes.write_out(ino)
            except OSError as e:
                s.flushes.park(ino, e)

    def write_through(self, ino: int, off: int, n: int) -> int:
        """Flush the file's buffer, which ends with this write of ``n`` bytes at ``off``: ``n``,
        or, when the device filled after the first of its bytes reached a zone (placed in
        part: ``landed_end`` of the error), that many -- a short write, as ext4 gives when it
        fills mid-write; the caller's next write then gets ENOSPC.  Else the flush's error."""
        try:
            # all of it, a partial last block padded: bytes left buffered would have no room
            # of their own (the next write's flush rewrites that block: the kernel splits a
            # large write where the caller's memory crosses a page, so near a full device
            # about one block per such piece goes to padding, as ext4 gives less than df)
            self.s.flushes.flush_data(ino, final=True)
        except OSError as e:
            end = getattr(e, "landed_end", None)
            if e.errno != errno.ENOSPC or end is None or not off < end < off + n:
                raise
            return end - off
        return n


class MetaRoom:
    """ENOSPC for an operation that adds metadata (a name, an xattr) while the metadata zones
    can take no more (``Journal.tight``): refused, as ext4 refuses a create with no inode left,
    instead of accepted and then lost because no journal flush could write it (600,000 creates
    on a 64 MiB image were all acknowledged; 240,076 were there after a remount)."""

    def __init__(self, store) -> None:
        self.s = store
        self._said_full = False         # the metadata-full warning, once per episode

    def check(self) -> None:
        """No lock held: near the end of the log's last pair a journal flush decides first (it
        rolls if a snapshot fits with room to spare; while tight, throttled)."""
        s = self.s
        with s.lock:
            if s.journal.growth_ok():
                self._said_full = False
                return
        with s.io_lock:             # while tight, a roll is tried again now and then
            try:
                s.journal_flush_iolocked(sync=False)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        if s.journal.tight:
            if not self._said_full:
                self._said_full = True
                log.warning("metadata zones full (%d inodes): new names and xattrs fail with "
                            "ENOSPC until files are deleted (mkfs --meta-zones)", len(s.inodes))
            raise FsError(errno.ENOSPC, "metadata zones full: delete files, or mkfs with more "
                                        "--meta-zones")
