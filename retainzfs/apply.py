"""Journal records -> in-memory state: the one ``apply`` that runs at run time (``Store.do_locked``
queues the record and applies it) and at mount-time replay, so the two cannot drift apart.

Pure state change: no I/O, no journal writes.  At run time it runs under ``Store.lock``; at
replay the mount is single-threaded.
"""
from __future__ import annotations

import errno
import logging
import stat

from . import records as R
from .errors import FsError

log = logging.getLogger("retainzfs")


class RecordApplier:
    def __init__(self, store):
        self.s = store
        #: mount-time replay only: the ``recovery.Proofs`` noting which data writes the
        #: journal proves durable (None at run time)
        self.proofs = None

    def _new_inode(self, i: int, mode: int):
        """A record names inode ``i`` for the first time: make it, and keep the next inode
        number past it."""
        s = self.s
        if i >= s.next_ino:
            s.next_ino = i + 1
        return s.inodes.new(i, mode)

    def apply(self, rtype: int, payload: bytes):
        """Apply one journal record to the store's memory; returns what the record made dead
        (a list of (zone, bytes, hint)) or the inode it wrote, depending on the type."""
        s = self.s
        if rtype == R.INODE_B:
            r = R.unpack_inode(payload)
            i = r.fixed[0]
            inode = s.inodes.get(i)
            if inode is None:
                inode = self._new_inode(i, r.fixed[1])
            inode.set_rec(r)
            return inode
        if rtype == R.DIRENT_B:
            p, i, t, name = R.unpack_dirent(payload)
            parent = s.inodes[p]
            child = s.inodes.get(i)
            if child is not None and child.name == name:
                name = child.name          # one bytes object per name
            parent.link(name, i)
            parent.mtime = parent.ctime = t
            return None
        if rtype == R.INODE_DEL_B:
            inode = s.inodes.pop(R.unpack_ino(payload), None)
            return inode.extents.clear() if inode is not None else []
        if rtype == R.XATTR_B:
            ino, t, name, value = R.unpack_xattr(payload)
            inode = s.inodes[ino]
            if value is not None:
                inode.set_xattr(name, value)
            elif name in inode.xattrs:
                inode.del_xattr(name)
            inode.ctime = t
            return None
        if rtype == R.EXTENT:
            ino, off, zone, zgen, zoff, length, hint = R.unpack_extent(payload)
            if zgen != s.zgen[zone]:
                # the zone was reset after this extent was written: never map a file onto
                # what the zone holds now
                s.stats["stale_extents"] += 1
                log.error("journal: extent of inode %d in zone %d generation %d, but the zone "
                          "is at generation %d; ignored", ino, zone, zgen, s.zgen[zone])
                return []
            return s.inodes[ino].extmap().add(off, length, zone, zoff, hint)
        if rtype == R.CSUM:
            zone, zgen, zoff, length, crcs = R.unpack_csum(payload)
            if zgen == s.zgen[zone]:
                s.csums.add(zone, zoff, length, crcs)
                if self.proofs is not None:
                    self.proofs.wrote(zone, zgen, zoff + length)
            return None
        if rtype == R.ZONE_RESET:
            zone, gen = R.unpack_zone_reset(payload)
            s.zgen[zone] = gen
            s.csums.drop_zone(zone)
            if self.proofs is not None:
                self.proofs.reset(zone)
            return None
        if rtype == R.FLUSHED:
            if self.proofs is not None:
                self.proofs.flushed(R.unpack_flushed(payload))
            return None
        if rtype in (R.UNMOUNTED, R.MOUNTED):
            return None                 # (read by ``_journal.load``: LogState.clean)
        if rtype == R.INODE:
            d = R.unpack_json(payload)
            inode = s.inodes.get(d["i"])
            if inode is None:
                inode = self._new_inode(d["i"], d["m"])
            inode.set_attrs(d)
            return inode
        if rtype == R.DIRENT_ADD:
            d = R.unpack_json(payload)
            parent = s.inodes[d["p"]]
            parent.link(d["n"].encode("latin-1"), d["i"])
            parent.mtime = parent.ctime = d["t"]
            return None
        if rtype == R.DIRENT_DEL:
            d = R.unpack_json(payload)
            parent = s.inodes[d["p"]]
            name = d["n"].encode("latin-1")
            if name in parent.entries:
                parent.unlink(name)
            parent.mtime = parent.ctime = d["t"]
            return None
        if rtype == R.RENAME:
            d = R.unpack_json(payload)
            op, np_ = s.inodes[d["op"]], s.inodes[d["np"]]
            on, nn = d["on"].encode("latin-1"), d["nn"].encode("latin-1")
            if d.get("x") and nn not in np_.entries:
                raise FsError(errno.EIO, "exchange record names no second entry")
            ino = op.unlink(on)
            other = np_.unlink(nn) if nn in np_.entries else None
            np_.link(nn, ino)
            child = s.inodes[ino]
            child.parent, child.name = np_.ino, nn
            op.mtime = op.ctime = np_.mtime = np_.ctime = d["t"]
            child.ctime = d["t"]
            if d.get("x"):                 # RENAME_EXCHANGE: the other takes the first name
                op.link(on, other)
                o = s.inodes[other]
                o.parent, o.name = op.ino, on
                o.ctime = d["t"]
            elif d.get("w"):               # RENAME_WHITEOUT: a whiteout (char device 0/0)
                i, uid, gid = d["w"]       # takes the first name
                w = self._new_inode(i, stat.S_IFCHR)
                w.uid, w.gid = uid, gid
                w.atime = w.mtime = w.ctime = d["t"]
                w.parent, w.name = op.ino, on
                op.link(on, i)
            return None
        if rtype == R.INODE_DEL:
            ino = R.unpack_json(payload)["i"]
            inode = s.inodes.pop(ino, None)
            return inode.extents.clear() if inode is not None else []
        if rtype == R.TRUNCATE:
            ino, size = R.unpack_truncate(payload)
            inode = s.inodes[ino]
            dead = inode.extents.truncate(size)
            inode.size = size
            return dead
        if rtype == R.PUNCH:
            ino, start, end = R.unpack_punch(payload)
            return s.inodes[ino].extents.punch(start, end)
        if rtype == R.RELOCATE:
            ino, off, length, oz, ooff, nz, ngen, noff = R.unpack_relocate(payload)
            inode = s.inodes.get(ino)
            if ngen != s.zgen[nz]:
                s.stats["stale_extents"] += 1
                return False
            return inode is not None and inode.extents.relocate(off, length, oz, ooff, nz, noff)
        if rtype in (R.ZONE_FINISH, R.SUPER, R.SNAP_BEGIN, R.SNAP_CHUNK, R.SNAP_END):
            return None
        raise FsError(errno.EIO, f"unknown journal record type {rtype}")
