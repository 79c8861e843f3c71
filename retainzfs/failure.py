"""The store's one-way failed state: once the device failed a flush or a metadata write,
nothing more is written until a remount, as ext4 aborting its journal.

Why one-way: what was written since the last good flush may not be on the medium, and no later
flush can vouch for it -- a host file system reports a writeback error to one fsync, then passes
the next (its pages are clean now).  An image on ext4 over a thin volume that ran out
acknowledged an fsync after a failed one, and the file was gone at the next mount.  From here
every change (write, close of a written file, fsync, create, unlink, rename, setxattr, sync)
fails with EIO, reads still work, ``status`` says why (``device_error``); the remount's recovery
checks the writes no flush proved.  The reason lives in ``Journal.failed`` (the journal refuses
writes after its own failed write too), so there is one flag.
"""
from __future__ import annotations

import errno
import logging

from .errors import FsError

log = logging.getLogger("retainzfs")


class Failure:
    def __init__(self, store) -> None:
        self.s = store
        self.said = False               # logged (once)

    @property
    def why(self) -> str | None:
        """Why nothing more is written, or None."""
        return self.s.journal.failed

    def fail(self, why: str, err: int | None = errno.EIO) -> FsError:
        """Enter the failed state and say so once (the first reason said stays; it replaces
        the journal's own raw one); the error to give the caller that met it (its own
        errno).  Any thread; takes Store.lock."""
        s = self.s
        with s.lock:
            if not self.said or s.journal.failed is None:
                s.journal.failed = why
            first, self.said = not self.said, True
        if first:
            log.error("%s: nothing more is written to %s; reads still work; unmount and "
                      "mount again (recovery checks what no flush proved)", why, s.dev.path)
        return FsError(err or errno.EIO, why)

    def check_locked(self) -> None:
        """EIO in the failed state: a change accepted now could never be made durable.
        Store.lock held."""
        if self.s.journal.failed is not None:
            raise FsError(errno.EIO, f"read-only after a device error: {self.s.journal.failed}")

    def commit_journal(self, plan, sync: bool) -> None:
        """``Journal.commit``: a frame that did not land (the journal refuses writes from
        then on) or a flush that failed is final either way.  io_lock held."""
        s = self.s
        try:
            s.journal.commit(plan, sync=sync)
        except OSError as e:
            what = "write" if s.journal.failed is not None else "flush"   # (its own mark)
            raise self.fail(f"metadata {what} failed: {e.strerror or e}", e.errno) from None

    def flush_device(self) -> None:
        """``ZonedDevice.flush``; a failure is final.  No lock held."""
        try:
            self.s.dev.flush()
        except OSError as e:
            raise self.fail(f"device flush failed: {e.strerror or e}", e.errno) from None
