"""The FUSE adapter: POSIX requests <-> Store calls, on libfuse's threads (``_fuse.pyx``).

Why it is thin: placement, hints and the journal live in the store, which the trace replay drives
directly; this module only translates requests and keeps file handles.  Every handler runs in
the libfuse thread that received the request and may block it on the device (the other threads
go on receiving); the store's locks (``Store.lock``, ``io_lock``) make the calls safe from any
thread, as DESIGN §11 and docs/internals.md describe.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import sys
import threading

from . import _fuse
from .namespace import Attrs
from .store import FsError, Store

log = logging.getLogger("retainzfs")

ENTRY_TIMEOUT = 1.0
#: A lookup that finds nothing answers st_ino=0 with this entry timeout, so the kernel keeps a
#: negative dentry instead of asking again for every stat/open of a missing name.  Safe because
#: names only appear through this mount: a create, mkdir, link, symlink, mknod or rename through
#: the kernel replaces the negative dentry at once, and O_EXCL opens always look up afresh; the
#: store never adds a name on its own.
NEGATIVE_TIMEOUT = ENTRY_TIMEOUT

XATTR_CREATE, XATTR_REPLACE = 1, 2
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10

#: st_blksize: the buffer size of stdio and Python's ``open()``.  Not 1 MiB: a reader that
#: seeks to a header and reads a few bytes (``torch.load`` of each DCP item) would refill a
#: 1 MiB buffer each time, so DCP load read 1.5x its checkpoint (1 MiB header reads) and
#: took 0.46-0.58 s for 200 MiB; with 128 KiB 0.34-0.43 s (4 KiB, as ext4: 0.36-0.43 s).
#: Large reads and writes bypass the buffer either way; ``cp`` uses at least 128 KiB.
BLKSIZE = 128 << 10


def _direct_write(flags: int, inode: Attrs) -> bool:
    """Open a write-only file with FOPEN_DIRECT_IO: the kernel then hands each write's user
    pages to the daemon (one copy, into the request) instead of first copying them into page
    cache pages it never reads back through this descriptor, and skips the per-write
    ``security.capability`` lookup of the cached path.  A write-only descriptor cannot be
    mmapped for writing and reads nothing, so only the copy is lost; other descriptors of the
    file keep the page cache, which the kernel invalidates over direct writes.

    Not for a set-user/group-ID file or one with file capabilities: clearing those on a write
    by an unprivileged process is done by that cached path (the FUSE write request names
    no caller to check), and pjdfstest's chmod/12.t checks it.  Not with O_SYNC / O_DSYNC
    either: that path sends an FSYNC after each write, the direct one does not (a write-only
    O_DSYNC file, ``dd oflag=dsync``, was empty after a kill -9 of the daemon)."""
    if (flags & os.O_ACCMODE != os.O_WRONLY or flags & os.O_DSYNC
            or inode.mode & (stat.S_ISUID | stat.S_ISGID)):
        return False
    return not inode.caps



class Operations:
    """The FUSE handlers ``_fuse`` calls (synchronously, from any of its threads).

    Handlers return ``Attrs`` for entries and attributes (``_fuse`` builds the reply), raise
    ``OSError`` (``FsError``) for an errno reply; anything else is logged and answered EIO."""

    blksize = BLKSIZE
    timeout = ENTRY_TIMEOUT
    negative_timeout = NEGATIVE_TIMEOUT

    def __init__(self, store: Store, acl: bool = True):
        self.store = store
        self.want_acl = acl                   # ask the kernel for FUSE_POSIX_ACL (``init``)
        self.handles: dict[int, int] = {}     # fh -> ino (dict operations are atomic)
        self.synced: set[int] = set()         # handles fsynced once: their close is durable
        self.direct: set[int] = set()         # handles opened with FOPEN_DIRECT_IO
        #: directory handle -> [ino, the directory's next cookie when the stream (re)started]
        self.dirs: dict[int, list] = {}
        self._fhs = itertools.count(1)
        self.initialized = threading.Event()

    def init(self, acl: bool = False) -> None:
        """FUSE INIT: runs before libfuse replies, so settings the kernel derives from the reply
        (the bdi's readahead) are made later (``serve``'s ``ready``).  The store's worker
        threads start here, after libfuse's first thread and the periodic sync's, so a tight
        pids limit leaves those two and takes from the pools (``workers.Workers``).  ``acl``:
        the kernel took FUSE_POSIX_ACL (and DONT_MASK: the umask comes to ``create``,
        ``mkdir`` and ``mknod``, which apply it unless a default ACL replaces it)."""
        self.store.acls = acl
        self.store.tuning["posix_acl"] = ("on" if acl else "off (-o noacl)"
                                          if not self.want_acl else "off (the kernel has none)")
        if self.want_acl and not acl:
            log.warning("the kernel offers no POSIX ACLs: access by mode bits only, "
                        "setfacl is refused")
        self.store.start_workers()
        self.initialized.set()

    # -- attributes --
    # The adapter never reads a live ``Inode`` view, only its number: attributes come as an
    # ``Attrs`` copy taken under Store.lock (``Store.stat``), since another thread may change
    # or free the row while this one builds the reply.
    def _ref(self, ino: int) -> Attrs:
        """The reply that makes the kernel hold ``ino`` (counted in the same lock)."""
        return self.store.stat(ino, ref=True)

    def lookup(self, parent: int, name: bytes) -> Attrs | None:
        try:
            ino = self.store.lookup(parent, name).ino
        except FsError as e:
            if e.errno != errno.ENOENT:
                raise
            return None                   # the kernel caches the miss (see NEGATIVE_TIMEOUT)
        return self._ref(ino)

    def getattr(self, ino: int) -> Attrs:
        return self.store.stat(ino)

    def setattr(self, ino: int, changes: dict) -> Attrs:
        self.store.setattr(ino, **changes)
        return self.store.stat(ino)

    def forget(self, pairs) -> None:
        for ino, n in pairs:
            try:
                self.store.forget(ino, n)
            except Exception:
                log.exception("forget")

    def counted(self, ino: int) -> None:
        """A READDIRPLUS reply carried ``ino``: the kernel holds one more reference."""
        self.store.ref(ino)

    # -- namespace --
    def readlink(self, ino: int) -> bytes:
        return self.store.readlink(ino)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx) -> Attrs:
        uid, gid, umask = ctx
        return self._ref(self.store.mknod(parent, name, mode, rdev, uid, gid, umask=umask).ino)

    def mkdir(self, parent: int, name: bytes, mode: int, ctx) -> Attrs:
        uid, gid, umask = ctx
        return self._ref(self.store.mkdir(parent, name, mode, uid, gid, umask=umask).ino)

    def symlink(self, parent: int, name: bytes, target: bytes, ctx) -> Attrs:
        uid, gid, _umask = ctx
        return self._ref(self.store.symlink(parent, name, target, uid, gid).ino)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attrs:
        return self._ref(self.store.link(ino, new_parent, new_name).ino)

    def unlink(self, parent: int, name: bytes) -> None:
        self.store.unlink(parent, name, reset=False)
        if self.store.reset_pending:          # zones emptied: reset them (device I/O)
            self.store.reset_empty_zones()

    def rmdir(self, parent: int, name: bytes) -> None:
        self.store.rmdir(parent, name)

    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
               flags: int, ctx=(0, 0, 0)) -> None:
        uid, gid, _umask = ctx               # (the owner of a RENAME_WHITEOUT's whiteout)
        self.store.rename(parent, name, new_parent, new_name, flags, uid, gid)

    # -- directories --
    def opendir(self, ino: int) -> int:
        self.store.getattr(ino)
        fh = next(self._fhs)
        self.dirs[fh] = [ino, None]
        return fh

    def readdir(self, fh: int, off: int, limit: int | None = None):
        """(name, Attrs, cookie) from cookie ``off`` on, at most ``limit`` (what fits the
        reply); ``_fuse`` stops when the reply is full.  Only entries older than the stream:
        a name renamed away and back while the directory is read gets a new cookie, and a
        program renaming each entry it reads (xfstests' generic/736) read forever.  POSIX
        leaves entries added since opendir/rewinddir unspecified; a read from offset 0 (a
        rewind) takes the directory as it is then."""
        d = self.dirs.get(fh)
        if d is None:
            raise FsError(errno.EBADF)
        out, d[1] = self.store.readdir_stat(d[0], off, limit, below=None if off == 0 else d[1])
        return out

    def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.store.sync()

    # -- files --
    def _new_fh(self, ino: int) -> int:
        fh = next(self._fhs)
        self.handles[fh] = ino
        return fh

    def _ino(self, fh: int) -> int:
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    def open(self, ino: int, flags: int, ctx=None) -> tuple[int, bool, bool]:
        """(fh, direct_io, keep_cache).  O_TRUNC is done here (FUSE_ATOMIC_O_TRUNC), with the
        set-ID bits a caller other than root loses (``OpenFiles.open``)."""
        self.store.open(ino, truncate=bool(flags & os.O_TRUNC),
                        kill_priv=ctx is not None and ctx[0] != 0)
        fh, direct = self._new_fh(ino), _direct_write(flags, self.store.stat(ino))
        if direct:
            self.direct.add(fh)
        return fh, direct, True

    def create(self, parent: int, name: bytes, mode: int, flags: int, ctx):
        """(fh, direct_io, keep_cache, Attrs)."""
        uid, gid, umask = ctx
        ino = self.store.create(parent, name, mode, uid, gid, umask=umask).ino
        self.store.open(ino)
        entry = self.store.stat(ino, ref=True)
        fh, direct = self._new_fh(ino), _direct_write(flags, entry)
        if direct:
            self.direct.add(fh)
        return fh, direct, True, entry

    def read(self, fh: int, off: int, size: int):
        ino = self._ino(fh)
        data = self.store.read_cached(ino, off, size)     # from the readahead windows
        if data is not None:
            return data
        return self.store.read(ino, off, size, True)       # any buffer

    def write(self, fh: int, off: int, buf: bytes) -> int:
        ino = self._ino(fh)
        n = self.store.buffer_write(ino, off, buf)
        if n is None:
            n = self.store.write(ino, off, buf)
        return n

    def write_synced(self, fh: int) -> None:
        """A write that asked to be durable when it returns (``pwritev2`` with RWF_DSYNC or
        RWF_SYNC; the kernel marks the request O_DSYNC) on a descriptor opened for direct
        writes: the kernel sends no FSYNC after it there, as it does on the cached path, so the
        write itself is made durable, as an fsync would.  Before, such a write to a
        write-only file was empty after a kill -9 of the daemon."""
        if fh in self.direct:
            self.fsync(fh, True)

    def flush(self, fh: int) -> None:
        """close(2).  Durable when the descriptor was fsynced before: the program cares, and
        what it wrote since is most likely what its own buffer still held at that fsync.
        ``os.fsync(f.fileno())`` without ``f.flush()`` -- PyTorch DCP's shards and its
        ``.metadata`` -- leaves up to a buffer in Python (``st_blksize``, 128 KiB here; 8 KiB
        on ext4), written only by the close; a power cut after DCP's save returned left
        ``.metadata.tmp`` empty."""
        ino = self._ino(fh)
        if not self.store.files.flush_clean(ino):     # bytes or attributes to write out
            self.store.commit(ino, durable=fh in self.synced)

    def lseek(self, fh: int, off: int, whence: int) -> tuple[int, int, int]:
        """SEEK_DATA / SEEK_HOLE (the kernel answers the other whences itself), from the
        store's extents and buffered bytes (``ReadPath.seek``): (the offset or -ENXIO, and the
        range [lo, hi) the answer calls a hole; hi -1: to the end of the file; lo == hi: none).
        The binding has the kernel write back that range's dirty mapped pages before it
        answers, and asks again."""
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise FsError(errno.EINVAL)
        ino = self._ino(fh)
        try:
            pos = self.store.seek(ino, off, whence)
        except FsError as e:
            if e.errno != errno.ENXIO or whence != os.SEEK_DATA or off < 0:
                raise
            size = self.store.stat(ino).size
            return -errno.ENXIO, off, (-1 if off < size else off)   # [off, EOF) a hole
        if whence == os.SEEK_DATA:
            return pos, off, pos
        try:
            return pos, pos, self.store.seek(ino, pos, os.SEEK_DATA)
        except FsError as e:
            if e.errno != errno.ENXIO:
                raise
        size = self.store.stat(ino).size
        return pos, pos, (-1 if pos < size else pos)     # a hole to the end, or the end

    def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """Modes 0 and KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE (``falloc.Falloc``);
        collapsing or inserting ranges, unsharing: EOPNOTSUPP (ENOSYS would make the kernel
        stop asking for the modes that work)."""
        keep = bool(mode & FALLOC_FL_KEEP_SIZE)
        kind = mode & ~FALLOC_FL_KEEP_SIZE
        if kind not in (0, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE):
            raise FsError(errno.EOPNOTSUPP)
        if off < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        if kind == FALLOC_FL_PUNCH_HOLE and not keep:
            raise FsError(errno.EOPNOTSUPP)            # as vfs_fallocate says
        if kind:
            self.store.punch(self._ino(fh), off, length, kind == FALLOC_FL_ZERO_RANGE, keep)
        else:
            self.store.allocate(self._ino(fh), off, length, keep)

    def fsync(self, fh: int, datasync: bool) -> None:
        self.store.commit(self._ino(fh), durable=True)
        self.synced.add(fh)

    def release(self, fh: int) -> None:
        self.synced.discard(fh)
        self.direct.discard(fh)
        ino = self.handles.pop(fh, None)
        if ino is None:
            return
        if not self.store.files.release_clean(ino):   # its commit has work
            self.store.release(ino)
        elif self.store.reset_pending:
            self.store.reset_empty_zones()

    # -- xattrs --
    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int) -> None:
        if flags & ~(XATTR_CREATE | XATTR_REPLACE):
            raise FsError(errno.EINVAL)
        self.store.setxattr(ino, name, value, create=bool(flags & XATTR_CREATE),
                            replace=bool(flags & XATTR_REPLACE))

    def getxattr(self, ino: int, name: bytes) -> bytes:
        return self.store.getxattr(ino, name)

    def listxattr(self, ino: int) -> list[bytes]:
        return self.store.listxattr(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        self.store.removexattr(ino, name)

    # -- filesystem --
    def statfs(self) -> dict:
        return self.store.statfs()

    def access(self, ino: int, mask: int) -> None:
        self.store.getattr(ino)


def mount(ops: Operations, mountpoint: str, options: set[str]) -> None:
    """Mount (RuntimeError when libfuse refuses); ``serve`` then answers the requests.

    The error carries why: libfuse (our log handler) and, for a user, the setuid
    ``fusermount3`` it runs write their reason to standard error -- the daemon's log -- and
    the caller saw only "fuse_session_mount() failed" (``-o allow_other`` without
    ``user_allow_other``, a container without /dev/fuse or with no-new-privileges).  What
    they write meanwhile is caught and copied to the log as before."""
    sys.stderr.flush()
    try:
        said = os.memfd_create("retainzfs-mount-output", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        said = None                               # (no memfd: the bare error, as before)
    keep = os.dup(2) if said is not None else None
    if said is not None:
        os.dup2(said, 2)
    failed = None
    try:
        _fuse.mount(ops, mountpoint, sorted(options))
    except RuntimeError as e:
        failed = e
    finally:
        if said is not None:
            sys.stderr.flush()
            os.dup2(keep, 2)
            os.close(keep)
            text = rest = os.pread(said, 1 << 16, 0)
            os.close(said)
            while rest:
                rest = rest[os.write(2, rest):]
    if failed is not None:
        why = _mount_reason(text.decode(errors="replace") if said is not None else "")
        raise RuntimeError(f"{failed}: {why}" if why else str(failed)) from None


def _mount_reason(output: str) -> str:
    """The last thing libfuse or fusermount said while mounting, or ""."""
    for line in reversed(output.splitlines()):
        if " libfuse: " in line:
            return line.split(" libfuse: ", 1)[1].strip()
        if line.startswith("fusermount"):
            return line.strip()
    return ""


def serve(store: Store, ops: Operations, mountpoint: str, sync_interval: float = 1.0,
          ready=None, max_threads: int = 64, idle=None) -> int:
    """Answer requests until unmounted or signalled (see ``_fuse.serve``); old write buffers
    are written and the journal made durable every ``sync_interval`` seconds meanwhile
    (``Store.periodic_sync``), then ``idle(store)`` runs (the daemon's heap trim).  ``ready``
    runs once the kernel has processed our INIT reply: a STATFS of the mount waits for that,
    in the kernel."""
    stop = threading.Event()

    def periodic_sync() -> None:
        said = None                 # a failure repeated each interval is said once
        while not stop.wait(sync_interval):
            try:
                store.periodic_sync()
            except OSError as e:
                if str(e) != said:
                    log.error("periodic journal flush failed: %s", e)
                said = str(e)
            except Exception:
                log.exception("periodic journal flush failed")
            else:
                if said is not None:
                    log.info("periodic journal flush succeeded again")
                said = None
            if idle is not None:
                try:
                    idle(store)
                except Exception:
                    log.exception("periodic idle hook")

    def after_init() -> None:
        ops.initialized.wait()
        try:
            os.statvfs(mountpoint)
        except OSError:
            log.exception("statfs of the new mount")
        ready()

    threads = [threading.Thread(target=periodic_sync, name="rz-sync", daemon=True)]
    if ready is not None:
        threads.append(threading.Thread(target=after_init, name="rz-ready", daemon=True))
    for t in threads:
        t.start()
    try:
        return _fuse.serve(max_threads)
    finally:
        stop.set()
        threads[0].join()


def unmount() -> None:
    """Unmount if still mounted and free the session (after ``serve`` returned)."""
    _fuse.close(unmount=True)


def fuse_options(fsname: str, extra: list[str] | None = None) -> set[str]:
    """libfuse's ``-o`` options; the device path escaped for its option parser, which splits
    at commas and takes a backslash as an escape (an image named ``ckpt,1.zns`` failed the
    mount with "fuse_session_new() failed")."""
    name = fsname.replace("\\", "\\\\").replace(",", "\\,")
    opts = {"default_permissions", f"fsname={name}", "subtype=retainzfs"}
    for o in extra or []:
        opts.add(o)
    return opts
