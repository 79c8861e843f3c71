"""Namespace operations with their POSIX rules (names, links, rename), and the store's
side of reclaim hints (``.retainz`` policies in force, hint resolution, re-derivation).

Every method here either takes ``Store.lock`` itself (the public ones, called by the facade) or
needs it held (``_locked``); none does device I/O except what it delegates: a ``.retainz`` is read
through the data path, deletions queue zones for the reclaim part, which resets them after the
caller released the lock, and ``MetaRoom.check`` (before an operation that adds metadata, no lock
held) may flush the journal under ``io_lock`` when its last pair nears full.  State mutations are
journal records applied by ``Store.do_locked``.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import stat
from time import time_ns as now_ns

from . import acl
from . import hints as H
from . import records as R
from .errors import FsError
from .namespace import ROOT_INO, Attrs, Inode

log = logging.getLogger("retainzfs")

NAME_MAX = 255
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
#: the superblock feature under which a RENAME record may swap two names ("x"): an image made
#: before it, which an older version may still mount, answers RENAME_EXCHANGE with EINVAL
EXCHANGE_FEATURE = "rename_exchange"
#: ... and may leave a whiteout at the old name ("w"); RENAME_WHITEOUT is EINVAL without it
WHITEOUT_FEATURE = "rename_whiteout"


def fmt_hint(h: float):
    return "inf" if math.isinf(h) else h


class NamespaceOps:
    def __init__(self, store):
        self.s = store

    # ------------------------------------------------------------------ helpers (lock held)
    def get_locked(self, ino: int) -> Inode:
        inode = self.s.inodes.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT)
        return inode

    def dir_locked(self, ino: int) -> Inode:
        inode = self.get_locked(ino)
        if not inode.is_dir:
            raise FsError(errno.ENOTDIR)
        return inode

    @staticmethod
    def check_name(name: bytes) -> None:
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)

    def save_inode_locked(self, inode: Inode) -> None:
        assert self.s.lock._is_owned(), "save_inode_locked without Store.lock"
        size = inode.size                  # the record carries ``durable_size`` (the size
        self.s.do_locked(R.INODE_B, R.pack_inode(inode.to_rec(False), with_tables=False))
        inode.size = size                  # without buffered bytes); memory keeps them

    def child_locked(self, parent: int, name: bytes) -> tuple[Inode, Inode]:
        """(directory, entry) for a name that must exist."""
        p = self.dir_locked(parent)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        ino = p.entries.get(name)
        if ino is None:
            raise FsError(errno.ENOENT)
        return p, self.s.inodes[ino]

    # ------------------------------------------------------------------ lookups
    def getattr(self, ino: int) -> Inode:
        with self.s.lock:
            return self.get_locked(ino)

    def stat(self, ino: int, ref: bool = False) -> Attrs:
        """The inode's attributes as one consistent copy (the FUSE adapter's only view of an
        inode); ``ref``: the kernel learns of it with this reply (lookup/create)."""
        with self.s.lock:
            inode = self.get_locked(ino)
            if ref:
                inode.lookups += 1
            return Attrs.of(inode)

    def readdir_stat(self, ino: int, start: int, limit: int | None = None,
                     below: int | None = None) -> tuple[list[tuple[bytes, Attrs, int]], int]:
        """``readdir`` with each entry's attributes copied under the same lock, and the bound
        it used: ``below``, or when None the directory's next cookie then (a stream's bound,
        taken with its first entries in one hold of the lock)."""
        with self.s.lock:
            if below is None:
                below = self.next_cookie(ino)
            return ([(n, Attrs.of(i), c) for n, i, c in self.readdir(ino, start, limit, below)],
                    below)

    def next_cookie(self, ino: int) -> int:
        """The cookie the directory's next new entry gets (a bound for ``readdir``)."""
        with self.s.lock:
            d = self.dir_locked(ino)
            return d.next_cookie

    def lookup(self, parent: int, name: bytes) -> Inode:
        s = self.s
        with s.lock:
            if name == b".":     # also how the kernel finds the inode of a file handle
                return self.get_locked(parent)    # (open_by_handle_at, NFS export) of any type
            p = self.dir_locked(parent)
            if name == b"..":
                return s.inodes.get(p.parent or ROOT_INO, p)
            if len(name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            ino = p.entries.get(name)
            if ino is None:
                raise FsError(errno.ENOENT)
            return s.inodes[ino]

    def readlink(self, ino: int) -> bytes:
        with self.s.lock:
            inode = self.get_locked(ino)
            if not stat.S_ISLNK(inode.mode):
                raise FsError(errno.EINVAL)
            return inode.target

    def readdir(self, ino: int, start: int, limit: int | None = None,
                below: int | None = None) -> list[tuple[bytes, Inode, int]]:
        """Entries with cookie > start (and < ``below``), in cookie order: (name, inode,
        cookie); at most ``limit`` (what one reply can carry), found without walking the
        entries before."""
        s = self.s
        with s.lock:
            d = self.dir_locked(ino)
            out = []
            if start < 1:
                out.append((b".", d, 1))
            if start < 2:
                out.append((b"..", s.inodes.get(d.parent or ROOT_INO, d), 2))
            more = None if limit is None else max(0, limit - len(out))
            entries = d.entries
            for name, cookie in d.entries_after(start, more):
                if below is not None and cookie >= below:
                    break
                out.append((name, s.inodes[entries[name]], cookie))
            return out

    # ------------------------------------------------------------------ creation
    def _durable_before_replace(self, old_parent: int, old_name: bytes, new_parent: int,
                                new_name: bytes) -> None:
        """A file renamed over another file gets its data durable first (an fsync of it), as
        ext4's ``auto_da_alloc`` does: the "write a temporary file, rename it over the old one"
        idiom, without an fsync, then leaves the old contents or the new after a power cut.
        Without it the rename's journal frame could reach the medium before the new data (the
        device's cache keeps no order until a flush): the old file gone, the new one failing
        its checksums.  Only renames that replace a regular file with one whose data are not
        yet durable pay (DCP's ``.metadata``: one per save).  No lock held: commits."""
        s = self.s
        with s.lock:
            op, np_ = s.inodes.get(old_parent), s.inodes.get(new_parent)
            if op is None or np_ is None or not op.is_dir or not np_.is_dir:
                return                               # the rename itself gives the error
            ino, vino = op.entries.get(old_name), np_.entries.get(new_name)
            if ino is None or vino is None or ino == vino:
                return
            src, victim = s.inodes[ino], s.inodes[vino]
            if not (src.is_reg and victim.is_reg) or s.data_durable_locked(src):
                return
        s.commit(ino, durable=True, check_policy=False)

    def new_inode_locked(self, parent: Inode, name: bytes, mode: int, uid: int, gid: int,
                         target: bytes = b"", rdev: int = 0, umask: int = 0) -> Inode:
        """A new node; its mode less the ``umask``, or, in a directory with a default ACL
        (ACLs on), the ACL's instead (``acl.inherit``); in a set-group-ID directory, the
        directory's group."""
        s = self.s
        self.check_name(name)
        if name in parent.entries:
            raise FsError(errno.EEXIST)
        t = now_ns()
        default = parent.xattrs.get(acl.DEFAULT) if s.acls else None
        mode, acls = acl.inherit(default, mode, umask)
        if parent.mode & stat.S_ISGID:
            # a set-group-ID directory gives what is made in it its group, and a directory
            # its set-group-ID bit too (as ext4's ``inode_init_owner``): a team's shared
            # checkpoint directory (chgrp team; chmod g+s) kept each writer's own group
            gid = parent.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        ino = Inode(s.next_ino, mode, uid, gid, nlink=2 if stat.S_ISDIR(mode) else 1,
                    atime=t, mtime=t, ctime=t, target=target, rdev=rdev, parent=parent.ino,
                    name=name, size=len(target), xattrs=acls or None)
        # directory hint xattrs are inherited by new children (runtime tags the gen dir)
        self.save_inode_locked(ino)
        s.do_locked(R.DIRENT_B, R.pack_dirent(parent.ino, ino.ino, t, name))
        if stat.S_ISDIR(mode):
            parent.nlink += 1
            self.save_inode_locked(parent)
        return s.inodes[ino.ino]

    def create(self, parent: int, name: bytes, mode: int, uid: int = 0, gid: int = 0,
               umask: int = 0) -> Inode:
        self.s.meta_room.check()
        with self.s.lock:
            p = self.dir_locked(parent)
            return self.new_inode_locked(p, name, stat.S_IFREG | (mode & 0o7777), uid, gid,
                                         umask=umask)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int = 0,
              gid: int = 0, umask: int = 0) -> Inode:
        self.s.meta_room.check()
        with self.s.lock:
            p = self.dir_locked(parent)
            return self.new_inode_locked(p, name, mode, uid, gid, rdev=rdev, umask=umask)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int = 0, gid: int = 0,
              umask: int = 0) -> Inode:
        self.s.meta_room.check()
        with self.s.lock:
            p = self.dir_locked(parent)
            return self.new_inode_locked(p, name, stat.S_IFDIR | (mode & 0o7777), uid, gid,
                                         umask=umask)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int = 0,
                gid: int = 0) -> Inode:
        self.s.meta_room.check()
        with self.s.lock:
            p = self.dir_locked(parent)
            return self.new_inode_locked(p, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        s = self.s
        s.meta_room.check()
        with s.lock:
            inode = self.get_locked(ino)
            if inode.is_dir:
                raise FsError(errno.EPERM)
            p = self.dir_locked(new_parent)
            self.check_name(new_name)
            if new_name in p.entries:
                raise FsError(errno.EEXIST)
            t = now_ns()
            inode.nlink += 1
            inode.ctime = t
            self.save_inode_locked(inode)
            s.do_locked(R.DIRENT_B, R.pack_dirent(p.ino, ino, t, new_name))
            return inode

    # ------------------------------------------------------------------ removal
    def drop_link_locked(self, inode: Inode) -> None:
        inode.nlink -= 1 if not inode.is_dir else inode.nlink
        inode.ctime = now_ns()
        if inode.nlink <= 0:
            inode.nlink = 0
            if inode.opens == 0:
                self.free_inode_locked(inode)
                return
        self.save_inode_locked(inode)

    def free_inode_locked(self, inode: Inode) -> None:
        s = self.s
        assert s.lock._is_owned(), "free_inode_locked without Store.lock"
        if inode.has_buffered():
            inode.wbuf.clear()
        if inode.is_dir:
            s.policies.pop(inode.ino, None)
        s.reclaim.dead_locked(s.do_locked(R.INODE_DEL_B, R.pack_ino(inode.ino)))

    def del_entry_locked(self, p: Inode, name: bytes) -> None:
        self.s.do_locked(R.DIRENT_DEL, R.pack_json({"p": p.ino, "n": name.decode("latin-1"),
                                                    "t": now_ns()}))

    def unlink(self, parent: int, name: bytes, reset: bool = True) -> None:
        """Remove a name; with ``reset=False`` no device I/O (the FUSE adapter then runs
        ``reset_empty_zones`` itself only when zones emptied: ``Store.reset_pending``)."""
        s = self.s
        with s.lock:
            p, inode = self.child_locked(parent, name)
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            self.del_entry_locked(p, name)
            if name == H.POLICY_NAME:
                s.hints.load_policy_locked(p.ino)          # no file: no policy
            self.drop_link_locked(inode)
        if reset:
            s.reclaim.reset_empty_zones()

    def rmdir(self, parent: int, name: bytes) -> None:
        with self.s.lock:
            p, inode = self.child_locked(parent, name)
            if not inode.is_dir:
                raise FsError(errno.ENOTDIR)
            if inode.entries:
                raise FsError(errno.ENOTEMPTY)
            self.del_entry_locked(p, name)
            self.retire_dir_locked(p, inode)

    def retire_dir_locked(self, parent, d) -> None:
        """An (empty) directory lost its name in ``parent``: freed now, or journaled with
        nlink 0 while the kernel still refers to it (freed at its last forget, or as an
        orphan by the next mount)."""
        parent.nlink -= 1
        self.save_inode_locked(parent)
        d.nlink = 0
        if d.opens == 0 and d.lookups == 0:
            self.free_inode_locked(d)
        else:
            self.save_inode_locked(d)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0, uid: int = 0, gid: int = 0) -> None:
        """rename(2) and renameat2's NOREPLACE, EXCHANGE and WHITEOUT.  WHITEOUT (what
        overlayfs does in its upper directory, which it refuses on a FUSE file system
        without it) leaves a whiteout, a character device 0/0 owned by the caller (``uid``,
        ``gid``), at the old name, made by the same RENAME record (``"w"``): a crash leaves
        the move with its whiteout or neither."""
        s = self.s
        if flags == RENAME_EXCHANGE and EXCHANGE_FEATURE in s.sb.features:
            return exchange(self, old_parent, old_name, new_parent, new_name)
        whiteout = bool(flags & RENAME_WHITEOUT) and WHITEOUT_FEATURE in s.sb.features
        if flags & ~(RENAME_NOREPLACE | (RENAME_WHITEOUT if whiteout else 0)):
            raise FsError(errno.EINVAL)   # (before stop 38 a WHITEOUT was EINVAL: overlayfs
        if whiteout:                      # refused the mount as an upper directory)
            self.s.meta_room.check()
        if not flags & RENAME_NOREPLACE:
            self._durable_before_replace(old_parent, old_name, new_parent, new_name)
        with s.lock:
            op, np_ = self.dir_locked(old_parent), self.dir_locked(new_parent)
            if len(old_name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            self.check_name(new_name)
            ino = op.entries.get(old_name)
            if ino is None:
                raise FsError(errno.ENOENT)
            moving = s.inodes[ino]
            if moving.is_dir and _below_locked(s, np_, moving):   # below itself
                raise FsError(errno.EINVAL)
            victim_ino = np_.entries.get(new_name)
            victim = None
            if victim_ino is not None:
                if flags & RENAME_NOREPLACE:
                    raise FsError(errno.EEXIST)
                if victim_ino == ino:
                    return
                victim = s.inodes[victim_ino]
                if victim.is_dir:
                    if not moving.is_dir:
                        raise FsError(errno.EISDIR)
                    if victim.entries:
                        raise FsError(errno.ENOTEMPTY)
                elif moving.is_dir:
                    raise FsError(errno.ENOTDIR)
            if new_name == H.POLICY_NAME and not moving.is_dir and (
                    op.ino != np_.ino or old_name != new_name):
                _refuse_bad_policy_locked(s, np_, moving, "rename")
            rec = {"op": op.ino, "on": old_name.decode("latin-1"), "np": np_.ino,
                   "nn": new_name.decode("latin-1"), "t": now_ns()}
            if whiteout:             # (a set-group-ID directory gives its group, as mknod's)
                rec["w"] = [s.next_ino, uid, op.gid if op.mode & stat.S_ISGID else gid]
            s.do_locked(R.RENAME, R.pack_json(rec))
            if moving.is_dir and op.ino != np_.ino:
                op.nlink -= 1
                np_.nlink += 1
                self.save_inode_locked(op)
                self.save_inode_locked(np_)
            self.save_inode_locked(moving)
            if victim is not None:
                if victim.is_dir:
                    self.retire_dir_locked(np_, victim)
                else:
                    self.drop_link_locked(victim)
            if op.ino != np_.ino or old_name != new_name:
                s.hints.rederive_locked(moving)
            _reload_policies_locked(s, ((op, old_name), (np_, new_name)))
        s.reclaim.reset_empty_zones()

    # ------------------------------------------------------------------ attributes
    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime: int | None = None,
                mtime: int | None = None, ctime: int | None = None) -> Inode:
        if size is not None:
            self.s.files.truncate(ino, size)
        with self.s.lock:
            inode = self.get_locked(ino)
            t = now_ns()
            if mode is not None:
                inode.mode = (inode.mode & ~0o7777) | (mode & 0o7777)
                if acl.ACCESS in inode.xattrs:        # the ACL follows (``acl.chmod``)
                    inode.set_xattr(acl.ACCESS, acl.chmod(inode.xattrs[acl.ACCESS], mode))
            if uid is not None:
                inode.uid = uid
            if gid is not None:
                inode.gid = gid
            if atime is not None:
                inode.atime = atime
            if mtime is not None:
                inode.mtime = mtime
            elif size is not None:      # the kernel sends a truncate's size alone; ext4 sets
                inode.mtime = t         # both times at any size change, even to the same size
            inode.ctime = ctime if ctime is not None else t
            self.save_inode_locked(inode)
            return inode

    def ref(self, ino: int, n: int = 1) -> None:
        """The kernel learned about an inode (lookup/create reply)."""
        with self.s.lock:
            inode = self.s.inodes.get(ino)
            if inode is not None:
                inode.lookups += n

    def forget(self, ino: int, n: int) -> None:
        with self.s.lock:
            inode = self.s.inodes.get(ino)
            if inode is None:
                return
            inode.lookups = max(0, inode.lookups - n)
            if inode.is_dir and inode.nlink == 0 and inode.lookups == 0 and inode.opens == 0:
                self.free_inode_locked(inode)


class _InodeTree(H.HintResolver):
    """:class:`hints.HintResolver` over the store's inodes (Store.lock held)."""

    def __init__(self, store):
        self.s = store

    def parent(self, node):
        if not node.parent or node.ino == ROOT_INO:
            return None
        return self.s.inodes.get(node.parent)

    def name(self, node) -> str:
        return node.name.decode("utf-8", "replace")

    def xattrs(self, node) -> dict:
        return node.xattrs

    def policy(self, d):
        return self.s.policies.get(d.ino)

    def entry_names(self, d):
        return (n.decode("utf-8", "replace") for n in d.entries)

    def dir_id(self, d) -> int:
        return d.ino


class StoreHints:
    """The ``.retainz`` policies in force (``Store.policies``/``policy_errors``) and the hints
    of files (resolution through :class:`hints.HintResolver`, re-derivation after a rename)."""

    def __init__(self, store):
        self.s = store
        self.resolver = _InodeTree(store)

    def resolve_locked(self, inode: Inode) -> H.Hint:
        """Hint of a file: its xattrs, an ancestor's xattrs, an ancestor's .retainz, or none."""
        assert self.s.lock._is_owned(), "resolve_locked without Store.lock"
        return self.resolver.resolve(inode)

    def hint_doc_locked(self, inode: Inode) -> bytes:
        """The ``user.retainz.hint`` document of a file."""
        h = inode.hint if inode.hint is not None else (
            self.resolve_locked(inode) if inode.is_reg else None)
        if h is None:
            raise FsError(errno.ENODATA)
        doc = {"birth": h.birth, "reclaim": fmt_hint(h.reclaim), "stream": h.stream,
               "source": h.source, "name": self.s.inodes.path_of(inode.ino)}
        p = inode.placed_hint
        if p is not None and (p.birth, p.reclaim) != (h.birth, h.reclaim):
            doc["placed"] = {"birth": p.birth, "reclaim": fmt_hint(p.reclaim),
                             "source": p.source}
        return json.dumps(doc).encode()

    def load_policy_locked(self, dir_ino: int, quiet: bool = False) -> None:
        """(Re)load the ``.retainz`` of a directory.

        A valid file becomes the policy and its text is journaled on the directory; a malformed
        or unreadable one is an error (raised unless ``quiet``) and the previous valid policy
        stays in force — also across remounts.  Removing the file removes the policy."""
        s = self.s
        assert s.lock._is_owned(), "load_policy_locked without Store.lock"
        d = s.inodes[dir_ino]
        pino = d.entries.get(H.POLICY_NAME)
        if pino is None:
            s.policies.pop(dir_ino, None)
            s.policy_errors.pop(dir_ino, None)
            if d.policy_src:
                d.policy_src = b""
                s.ns.save_inode_locked(d)
            return
        try:
            data = self.read_policy_file_locked(s.inodes[pino])
            pol = H.parse_policy(data)
        except H.HintError as e:
            s.policy_errors[dir_ino] = str(e)
            log.error("%s: %s", s.inodes.path_of(pino), e)
            if d.policy_src and dir_ino not in s.policies:
                try:                          # after a remount: the last valid text
                    s.policies[dir_ino] = H.parse_policy(d.policy_src)
                except H.HintError:
                    pass
            if not quiet:
                raise
            return
        s.policies[dir_ino] = pol
        s.policy_errors.pop(dir_ino, None)
        if d.policy_src != data:
            d.policy_src = data
            s.ns.save_inode_locked(d)

    def read_policy_file_locked(self, inode: Inode) -> bytes:
        if not inode.is_reg:
            raise H.HintError(".retainz: not a regular file")
        if inode.size > H.POLICY_MAX:
            raise H.HintError(f".retainz: {inode.size} bytes; a policy file may hold at most "
                              f"{H.POLICY_MAX} bytes")
        try:
            return self.s.reads.read_all_locked(inode)
        except OSError as e:
            raise H.HintError(f".retainz: cannot read it: {e.strerror or e}") from None

    def rederive_locked(self, moved: Inode) -> None:
        """After a rename, hints come from the new name.

        Frameworks write ``x.dirty.pt`` / ``tmp-checkpoint-N/`` / ``.metadata.tmp`` and rename:
        data not yet placed uses the hint of the final name; data already placed under another
        hint stays where it is and is reported (``placed`` in ``user.retainz.hint``)."""
        s = self.s
        todo, files = [moved], []
        while todo:
            i = todo.pop()
            if i.is_reg:
                files.append(i)
            elif i.is_dir:
                todo += [s.inodes[c] for c in i.entries.values() if c in s.inodes]
        for f in files:
            if f.hint is None or H.hint_from_xattrs(f.xattrs) is not None:
                continue                  # nothing placed yet / an explicit tag wins
            new = self.resolve_locked(f)
            if (new.birth, new.reclaim, new.stream) == (f.hint.birth, f.hint.reclaim,
                                                        f.hint.stream):
                continue
            if len(f.extents) or f.wbuf:
                if f.placed_hint is None:
                    f.placed_hint = f.hint
                log.info("%s: hint re-derived after rename (birth %d, reclaim %s); %d bytes "
                         "already placed with reclaim %s", s.inodes.path_of(f.ino), new.birth,
                         fmt_hint(new.reclaim), sum(e.length for e in f.extents),
                         fmt_hint(f.placed_hint.reclaim))
            f.hint = new
            s.ns.save_inode_locked(f)


def _refuse_bad_policy_locked(s, dest: Inode, incoming: Inode, what: str) -> None:
    """A file arriving at ``dest/.retainz`` by a rename or an exchange must hold a valid
    policy: refused (EINVAL) like a write of a malformed one, and no name changes."""
    try:
        H.parse_policy(s.hints.read_policy_file_locked(incoming))
    except H.HintError as e:
        log.error("%s onto %s/.retainz refused: %s", what, s.inodes.path_of(dest.ino), e)
        raise FsError(errno.EINVAL, str(e)) from None


def _reload_policies_locked(s, places) -> None:
    """After a rename or an exchange: the directories of [(dir, name)] whose name was
    ``.retainz`` read their policy again (gone, new, or a directory now)."""
    for d, n in places:
        if n == H.POLICY_NAME and d.ino in s.inodes:
            try:
                s.hints.load_policy_locked(d.ino)
            except H.HintError:
                pass


def _below_locked(s, d: Inode, top: Inode) -> bool:
    """``d`` is ``top`` or inside it (Store.lock held)."""
    while True:
        if d.ino == top.ino:
            return True
        if d.ino == ROOT_INO or not d.parent:
            return False
        d = s.inodes[d.parent]


def exchange(ns: NamespaceOps, pa: int, a: bytes, pb: int, b: bytes) -> None:
    """renameat2(RENAME_EXCHANGE): the two names swap their inodes, in one RENAME record
    (``"x": 1``), so a crash leaves them swapped or not.  Both must exist; a directory may
    not end up inside itself; a file arriving at a ``.retainz`` name must hold a valid
    policy (EINVAL, nothing swapped), and the policies of both directories are read again."""
    s = ns.s
    with s.lock:
        da, db = ns.dir_locked(pa), ns.dir_locked(pb)
        for n in (a, b):
            ns.check_name(n)
        ia, ib = da.entries.get(a), db.entries.get(b)
        if ia is None or ib is None:
            raise FsError(errno.ENOENT)
        if ia == ib:
            return                                # two links of one inode: nothing changes
        x, y = s.inodes[ia], s.inodes[ib]
        if (x.is_dir and _below_locked(s, db, x)) or (y.is_dir and _below_locked(s, da, y)):
            raise FsError(errno.EINVAL)
        for d, n, incoming in ((da, a, y), (db, b, x)):
            if n == H.POLICY_NAME and not incoming.is_dir:
                _refuse_bad_policy_locked(s, d, incoming, "exchange")
        s.do_locked(R.RENAME, R.pack_json({"op": da.ino, "on": a.decode("latin-1"),
                                           "np": db.ino, "nn": b.decode("latin-1"),
                                           "t": now_ns(), "x": 1}))
        if da.ino != db.ino and x.is_dir != y.is_dir:     # a subdirectory changed parent
            src, dst = (da, db) if x.is_dir else (db, da)
            src.nlink -= 1
            dst.nlink += 1
            ns.save_inode_locked(da)
            ns.save_inode_locked(db)
        ns.save_inode_locked(x)
        ns.save_inode_locked(y)
        s.hints.rederive_locked(x)
        s.hints.rederive_locked(y)
        _reload_policies_locked(s, ((da, a), (db, b)))
