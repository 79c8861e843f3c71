"""How a store's metadata log begins and ends: mkfs (``format_store``) and the mount marks
(``mark_log``, format feature "unmount_marks": R.MOUNTED / R.UNMOUNTED frames, so ``fsck``
tells a crash's unfinished flush from damage; ``_journal.load`` reads them)."""
from __future__ import annotations

import errno
import logging
import os
import stat
from time import time_ns as now_ns

from . import _journal as J
from . import namespace as NS
from . import records as R
from .device import ZoneCond, ZonedDevice
from .errors import FsError
from .namespace import ROOT_INO, Inode
from .superblock import Superblock, default_meta_zones, meta_zones_problem

log = logging.getLogger("retainzfs")

MARKS_FEATURE = "unmount_marks"


def format_store(dev: ZonedDevice, *, meta_zones: int | None = None,
                 allocator: str = "retainz", gc_reserve: int = 1,
                 root_owner: tuple[int, int] = (0, 0)) -> Superblock:
    """Write a fresh filesystem: reset every zone, superblock + empty snapshot in pair 0, and
    (a fresh image being a cleanly unmounted one) an unmount mark.  ``root_owner`` (uid, gid)
    owns the root directory: mkfs gives it to whoever runs mkfs, so a user who makes an image
    can write in it when they mount it."""
    if meta_zones is None:
        meta_zones = default_meta_zones(dev.nr_zones, dev.zone_capacity)
    why = meta_zones_problem(meta_zones)
    if why:
        raise FsError(errno.EINVAL, why)
    if dev.nr_zones < meta_zones + 2 + gc_reserve:
        raise FsError(errno.EINVAL, f"device has {dev.nr_zones} zones; need at least "
                                    f"{meta_zones + 2 + gc_reserve}")
    if dev.max_active and dev.max_active < 4:
        raise FsError(errno.EINVAL, f"device allows {dev.max_active} active zones; need at "
                                    f"least 4 (a metadata pair and two data zones)")
    err = dev.keep_allocated(range(meta_zones))
    if err and err != errno.EOPNOTSUPP:
        raise FsError(err, f"cannot allocate the metadata zones: {os.strerror(err)}")
    sb = Superblock.new(dev, meta_zones, allocator, gc_reserve)
    for z in range(meta_zones, dev.nr_zones):
        if dev.zone(z).wp or dev.zone(z).cond != ZoneCond.EMPTY:
            dev.reset(z)
    t = now_ns()
    root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, nlink=2, uid=root_owner[0],
                 gid=root_owner[1], atime=t, mtime=t, ctime=t)
    snap = NS.encode_snapshot({ROOT_INO: root}, R.SnapshotHeader(ROOT_INO + 1))
    journal = J.Journal(dev, sb, lambda: snap)
    journal.format()
    if MARKS_FEATURE in sb.features:
        journal.append(R.UNMOUNTED, R.pack_mark(t))
        journal.flush()
    return sb


def mark_log(s, rtype: int) -> None:
    """A frame with a mount mark, durable before anything after it: R.MOUNTED when a
    read-write mount's recovery is done (after the repairs, which flush what they write;
    before anything the mount serves), R.UNMOUNTED, alone in its frame, at a clean unmount's
    end (after its sync).  Takes io_lock, then Store.lock to queue the record."""
    if s.opts.readonly or MARKS_FEATURE not in (s.sb.features or ()):
        return
    try:
        with s.io_lock:
            with s.lock:
                s.journal.append(rtype, R.pack_mark(now_ns()))
            s.journal_flush_iolocked(sync=True)
    except OSError as e:
        if s.failed is not None:
            raise                     # a failed write or flush: final, as anywhere
        # (metadata zones full: only what the mark tells fsck is lost; the record stays
        # queued for the next flush)
        log.warning("the %s mark was not written (%s): fsck may misread how this mount ended",
                    R.NAMES[rtype], e)
