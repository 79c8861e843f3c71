"""Read-only recovery of a namespace whose snapshot lost frames in both copies.

Why its own module: this is the one place the store serves a namespace it knows to be
incomplete, so the rule of what may be served is written once, here.  The snapshot is one
zlib stream: its intact prefix decodes, nothing after the gap does.  What is provable:

* every inode decoded from the prefix (its record is whole: attributes, extents, entries);
* every inode created after the snapshot (number >= the snapshot header's ``next_ino``): its
  whole history is in the records after the snapshot, which are intact;
* records that touch only such inodes.

A record that touches an inode of the lost part (number below ``next_ino``, not decoded) is
skipped: applying it would build a file from some of its extents (wrong bytes, zeros in the
holes) or link a name to an inode nobody can describe.  Known inodes whose directory is lost
are listed under ``/lost+found/<directory inode number>/`` with their own names.  Data still
reads only through the checksums and zone generations of the header and the records, so a
read is either the file's bytes or EIO.  Nothing here writes: the store is read-only.
"""
from __future__ import annotations

import stat

from . import records as R
from .namespace import Inode

LOST_FOUND = b"lost+found"


def touched_inodes(rtype: int, payload) -> tuple[int, ...]:
    """The inode numbers a journal record refers to (empty for zone-only records)."""
    if rtype == R.INODE_B:
        return (R.unpack_inode(payload).fixed[0],)
    if rtype == R.DIRENT_B:
        p, i, _, _ = R.unpack_dirent(payload)
        return (p, i)
    if rtype == R.INODE_DEL_B:
        return (R.unpack_ino(payload),)
    if rtype == R.EXTENT:
        return (R.unpack_extent(payload)[0],)
    if rtype == R.TRUNCATE:
        return (R.unpack_truncate(payload)[0],)
    if rtype == R.RELOCATE:
        return (R.unpack_relocate(payload)[0],)
    if rtype in (R.INODE, R.INODE_DEL):
        return (R.unpack_json(payload)["i"],)
    if rtype == R.DIRENT_ADD:
        d = R.unpack_json(payload)
        return (d["p"], d["i"])
    if rtype == R.DIRENT_DEL:
        return (R.unpack_json(payload)["p"],)
    if rtype == R.RENAME:
        d = R.unpack_json(payload)
        return (d["op"], d["np"])
    return ()


class PartialReplay:
    """Decides, record by record, what a replay over a partial snapshot may apply."""

    def __init__(self, inodes: dict, next_ino: int):
        self.inodes = inodes
        self.next_ino = next_ino          # inodes at or above it were created after the snapshot
        self.skipped = 0

    def provable(self, rtype: int, payload) -> bool:
        inodes, limit = self.inodes, self.next_ino
        for i in touched_inodes(rtype, payload):
            if i not in inodes and i < limit:
                self.skipped += 1
                return False
        if rtype == R.RENAME:
            # the moved entry's inode must be known too
            d = R.unpack_json(payload)
            op = inodes.get(d["op"])
            child = op.entries.get(d["on"].encode("latin-1")) if op is not None else None
            if child is None or child not in inodes:
                self.skipped += 1
                return False
        return True

    def adopt_orphans(self, root_ino: int, now: int) -> list[int]:
        """Drop entries naming lost inodes; list known inodes whose directory is lost under
        ``/lost+found/<dir ino>/``.  Returns the adopted inode numbers."""
        inodes = self.inodes
        root = inodes.get(root_ino)
        if root is None:
            root = inodes[root_ino] = Inode(root_ino, stat.S_IFDIR | 0o755, nlink=2, atime=now,
                                            mtime=now, ctime=now)
        for d in list(inodes.values()):
            if d.is_dir:
                for name, i in list(d.entries.items()):
                    if i not in inodes:
                        d.unlink(name)
        linked = {i for d in inodes.values() if d.is_dir for i in d.entries.values()}
        orphans = [i for i in inodes.values() if i.ino != root_ino and i.nlink > 0
                   and i.ino not in linked]
        if not orphans:
            return []
        lf_ino = max(max(inodes) + 1, self.next_ino)
        lf = inodes[lf_ino] = Inode(lf_ino, stat.S_IFDIR | 0o500, nlink=2, atime=now, mtime=now,
                                    ctime=now, parent=root_ino, name=LOST_FOUND)
        if LOST_FOUND in root.entries:     # a user's own lost+found keeps its name
            lf.name = b"lost+found.retainz-%d" % lf_ino
        root.link(lf.name, lf_ino)
        groups: dict[int, Inode] = {}
        nxt = lf_ino + 1
        for o in orphans:
            g = groups.get(o.parent)
            if g is None:
                g = groups[o.parent] = Inode(nxt, stat.S_IFDIR | 0o500, nlink=2, atime=now,
                                             mtime=now, ctime=now, parent=lf_ino,
                                             name=b"%d" % o.parent)
                inodes[nxt] = g
                lf.link(g.name, nxt)
                nxt += 1
            name = o.name or b"inode-%d" % o.ino
            if name in g.entries:
                name = b"%s.%d" % (name, o.ino)
            g.link(name, o.ino)
            o.parent, o.name = g.ino, name
        return [o.ino for o in orphans]
