"""Extended attributes: the user's own (``user.*``, kept in the inode and journalled with it),
the reclaim-hint xattrs (validated here: a bad value is EINVAL with the reason logged; so is
any other ``user.retainz.`` name but fsck's ``.damaged`` mark), and the virtual ones computed
on read (``user.retainz.zones``, ``.hint``, the root's ``.status`` and zone map; EPERM to
set).  Every method takes ``Store.lock`` itself; ``setxattr`` first makes room in the
metadata log (``room.MetaRoom.check``, no lock held).
"""
from __future__ import annotations

import errno
import json
import logging
from time import time_ns as now_ns

from . import acl
from . import hints as H
from . import records as R
from .errors import FsError
from .namespace import ROOT_INO, show_name

log = logging.getLogger("retainzfs")

#: names and values of one inode's xattrs together: ENOSPC past it, as ext4 when they do not
#: fit.  A snapshot's inode entry carries them all (and the INODE_B record did at each change
#: before ``xattr_records``: 1,023 values of 64 KiB made it too large to journal).
XATTR_TOTAL_MAX = 1 << 20
#: and their number: the journal's inode entry counts them in a u16
XATTR_COUNT_MAX = 0xFFFF
#: listxattr's list of a file's names (each NUL-terminated) must fit the kernel's
#: XATTR_LIST_MAX, or every listxattr of the file fails with E2BIG and ``cp -a``,
#: ``rsync -X`` and ``tar --xattrs`` cannot copy it: a new name past it is ENOSPC
XATTR_LIST_MAX = 65536
# POSIX ACLs (``acl.NAMES``): kept only while the kernel enforces them (FUSE_POSIX_ACL,
# ``Store.acls``).  Without it the kernel checks access by the mode bits alone and hands
# these over as plain xattrs: stored, ``setfacl`` succeeded and ``getfacl`` showed an ACL
# that nothing applied (a mask taking write from the group left the group writing); so then
# they are refused, as a file system mounted without ACLs refuses them, and not shown.
#: the namespaces a name may be set in, as on ext4 and XFS: the kernel hands FUSE any name,
#: so ``foo`` or ``system.x`` were stored (EOPNOTSUPP there) and ``user.`` too (EINVAL there)
NAMESPACES = frozenset({b"user", b"trusted", b"security"})


class XattrOps:
    def __init__(self, store):
        self.s = store

    def setxattr(self, ino: int, name: bytes, value: bytes, create: bool = False,
                 replace: bool = False) -> None:
        """Set an xattr; ``create`` (XATTR_CREATE): EEXIST if it exists, ``replace``
        (XATTR_REPLACE): ENODATA if not, decided under the lock with the change (two racing
        XATTR_CREATEs: one wins)."""
        if name in acl.NAMES:
            self._set_acl(ino, name, value, create, replace)
            return
        space, dot, rest = name.partition(b".")
        if space not in NAMESPACES or not dot:
            raise FsError(errno.EOPNOTSUPP, "xattrs are user., trusted. or security. names")
        if not rest:
            raise FsError(errno.EINVAL)
        # the name alone decides these: before making room in the log or taking the lock
        if name in H.VIRTUAL_XATTRS or name.startswith(H.XATTR_ZONEMAP):
            raise FsError(errno.EPERM)
        if name.startswith(H.XATTR_PREFIX) and name not in H.SETTABLE_XATTRS:
            known = ", ".join(n.decode() for n in H.SETTABLE_XATTRS)
            log.warning("setxattr %s on inode %d refused: not a retainzfs xattr (%s)",
                        show_name(name), ino, known)
            raise FsError(errno.EINVAL, f"not a retainzfs xattr (one of {known})")
        self.s.meta_room.check()
        with self.s.lock:
            inode = self.s.ns.get_locked(ino)
            if create and name in inode.xattrs:
                raise FsError(errno.EEXIST)
            if replace and name not in inode.xattrs:
                raise FsError(errno.ENODATA)
            if name in H.HINT_XATTRS:
                try:
                    H.validate_xattr(name, value)
                except H.HintError as e:
                    log.warning("setxattr %s on inode %d refused: %s", name.decode(), ino, e)
                    raise FsError(errno.EINVAL, str(e)) from None
            self._check_fits_locked(inode, name, value)
            self._save_locked(inode, name, bytes(value))

    @staticmethod
    def _check_fits_locked(inode, name: bytes, value: bytes) -> None:
        """ERANGE past the kernel's bounds for one xattr; ENOSPC past one inode's."""
        if len(name) > 255 or len(value) > 65536:
            raise FsError(errno.ERANGE)
        old = inode.xattrs.get(name)
        total, listed = inode.xattr_sums          # kept with each change: O(1) a set
        if old is None:                           # a new name: room for one more in the list?
            no_room = (len(inode.xattrs) >= XATTR_COUNT_MAX
                       or listed + len(name) + 1 > XATTR_LIST_MAX)
        else:                                     # a replace: the old value's bytes come back
            no_room, total = False, total - len(name) - len(old)
        if no_room or total + len(name) + len(value) > XATTR_TOTAL_MAX:
            raise FsError(errno.ENOSPC, f"xattrs of one file are limited to "
                                        f"{XATTR_TOTAL_MAX} bytes, {XATTR_COUNT_MAX} names "
                                        f"and a name list of {XATTR_LIST_MAX} bytes")

    def _set_acl(self, ino: int, name: bytes, value: bytes, create: bool,
                 replace: bool) -> None:
        """An access ACL sets the mode's permission bits with it, in the same journal record
        (none is kept when the mode says it all); a default ACL is for directories."""
        s = self.s
        if not s.acls:
            raise FsError(errno.EOPNOTSUPP, "POSIX ACLs are off (mount -o noacl, or a "
                                            "kernel without FUSE_POSIX_ACL)")
        self.s.meta_room.check()
        with s.lock:
            inode = s.ns.get_locked(ino)
            if create and name in inode.xattrs:
                raise FsError(errno.EEXIST)
            if replace and name not in inode.xattrs:
                raise FsError(errno.ENODATA)
            mode = inode.mode
            if name == acl.ACCESS:
                mode, keep = acl.set_access(mode, value)
            else:
                keep = acl.set_default(mode, value)
            if keep is None:
                if name in inode.xattrs:
                    inode.del_xattr(name)
            else:
                self._check_fits_locked(inode, name, keep)
                inode.set_xattr(name, keep)
            inode.mode = mode
            inode.ctime = now_ns()
            s.ns.save_inode_locked(inode)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        s = self.s
        with s.lock:
            inode = self.s.ns.get_locked(ino)
            if name == H.XATTR_ZONES:
                zones = sorted({e.zone for e in inode.extents})
                return ",".join(map(str, zones)).encode()
            if name == H.XATTR_HINT:
                return s.hints.hint_doc_locked(inode)
            if name == H.XATTR_STATUS and ino == ROOT_INO:
                # getxattr(2) callers ask for the size, then for the value: a live document
                # that grew in between (a counter gained a digit) failed with ERANGE.  Padded
                # with JSON whitespace to a 1 KiB multiple, its size rarely changes.
                v = json.dumps(s.report.status()).encode()
                return v + b" " * (-len(v) % 1024)
            if name.startswith(H.XATTR_ZONEMAP) and ino == ROOT_INO:
                try:
                    first = int(name[len(H.XATTR_ZONEMAP):])
                except ValueError:
                    raise FsError(errno.ENODATA) from None
                return json.dumps(s.report.zone_map(first, H.ZONEMAP_ROWS),
                                  separators=(",", ":")).encode()
            if name in acl.NAMES and not s.acls:
                raise FsError(errno.ENODATA)          # kept from an ACL mount: not applied
            try:
                return inode.xattrs[name]
            except KeyError:
                raise FsError(errno.ENODATA) from None

    def listxattr(self, ino: int) -> list[bytes]:
        with self.s.lock:
            names = list(self.s.ns.get_locked(ino).xattrs)
            if not self.s.acls:
                names = [n for n in names if n not in acl.NAMES]
            return names

    def removexattr(self, ino: int, name: bytes) -> None:
        with self.s.lock:
            inode = self.s.ns.get_locked(ino)
            if name not in inode.xattrs:
                raise FsError(errno.ENODATA)
            self._save_locked(inode, name, None)

    def _save_locked(self, inode, name: bytes, value: bytes | None) -> None:
        """Set (``value`` None: remove) one xattr and the ctime, journalled.  On an image with
        the feature ``xattr_records``: one XATTR_B record of this xattr alone.  Else (an image
        of an older version, which that version must still mount) the whole inode: INODE_B
        carries every xattr, O(n) bytes per change."""
        s = self.s
        if "xattr_records" in s.sb.features:
            s.do_locked(R.XATTR_B, R.pack_xattr(inode.ino, now_ns(), name, value))
            return
        if value is None:
            inode.del_xattr(name)
        else:
            inode.set_xattr(name, value)
        inode.ctime = now_ns()
        s.ns.save_inode_locked(inode)
