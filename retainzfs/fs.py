"""pyfuse3 + trio adapter: POSIX requests <-> Store calls.

Why it is thin: placement, hints and the journal live in the store, which the trace replay drives
directly; this module only translates FUSE requests, keeps file handles, and pushes every call
that may touch the device into a worker thread so one slow write never stalls the event loop.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import threading

import outcome
import pyfuse3
import trio

from .hints import POLICY_NAME, XATTR_PREFIX
from .namespace import Attrs
from .store import FsError, Inode, Store

log = logging.getLogger("retainzfs")

ENTRY_TIMEOUT = 1.0
#: A lookup that finds nothing answers st_ino=0 with this entry timeout, so the kernel keeps a
#: negative dentry instead of asking again for every stat/open of a missing name (pyfuse3's
#: documented way to cache a miss).  Safe because names only appear through this mount: a
#: create, mkdir, link, symlink, mknod or rename through the kernel replaces the negative dentry
#: at once, and O_EXCL opens always look up afresh; the store never adds a name on its own.
NEGATIVE_TIMEOUT = ENTRY_TIMEOUT


class _Workers:
    """Threads for the requests that may touch the device.

    What ``trio.to_thread.run_sync`` did, at about half its cost per call (43 vs 77 us here; a
    small file's close pays one): persistent threads on one queue, the result handed back
    through the trio token.  A thread is added while none is idle, up to ``max_threads``; like
    ``to_thread.run_sync`` by default a call cannot be cancelled, so unmount waits for the
    calls in flight."""

    def __init__(self, max_threads: int = 32):
        self.max_threads = max_threads
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    async def run(self, fn, *args, **kw):
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        with self._lock:
            if self._idle:
                self._idle -= 1
                start = False
            else:
                start = self._threads < self.max_threads
                self._threads += start
        if start:
            threading.Thread(target=self._work, name=f"rz-fuse-{self._threads}",
                             daemon=True).start()
        self._q.put((fn, args, kw, task, token))
        return await trio.lowlevel.wait_task_rescheduled(_no_abort)    # unwraps the outcome

    def _work(self) -> None:
        while True:
            fn, args, kw, task, token = self._q.get()
            result = outcome.capture(fn, *args, **kw)
            del fn, args, kw
            with self._lock:
                self._idle += 1
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:
                pass
            del task, result


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
    by an unprivileged process is done by that cached path (pyfuse3 passes no caller to
    ``write``), and pjdfstest's chmod/12.t checks it."""
    if flags & os.O_ACCMODE != os.O_WRONLY or inode.mode & (stat.S_ISUID | stat.S_ISGID):
        return False
    return not inode.caps


def _no_abort(_raise_cancel):
    return trio.lowlevel.Abort.FAILED


_workers = _Workers()
_run = _workers.run


def _fuse_errors(fn):
    async def wrapper(*args, **kw):
        try:
            return await fn(*args, **kw)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            log.exception("I/O error in %s", fn.__name__)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    wrapper.__name__ = fn.__name__
    return wrapper


_NEGATIVE = pyfuse3.EntryAttributes()
_NEGATIVE.st_ino = 0
_NEGATIVE.entry_timeout = NEGATIVE_TIMEOUT


class RetainzOperations(pyfuse3.Operations):
    """The FUSE operations table."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, store: Store):
        super().__init__()
        self.store = store
        self.handles: dict[int, int] = {}     # fh -> ino
        self.next_fh = 1
        self.initialized = False

    def init(self):
        """FUSE INIT: called before libfuse replies, so settings the kernel derives from the
        reply (the bdi's readahead is lowered to the negotiated ``max_readahead``) must be made
        after this returns — ``serve`` waits for this flag, then runs its ``ready`` hook."""
        self.initialized = True

    # -- attributes --
    # The adapter never reads a live ``Inode`` view, only its number: attributes come as an
    # ``Attrs`` copy taken under Store.lock (``Store.stat``), since a worker thread may change
    # or free the row while the event loop builds the reply.
    def _entry(self, inode: Attrs) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ENTRY_TIMEOUT
        a.st_mode = inode.mode
        a.st_nlink = inode.nlink
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
        a.st_size = inode.size
        a.st_blksize = BLKSIZE
        a.st_blocks = (inode.size + 511) // 512
        a.st_atime_ns = inode.atime
        a.st_mtime_ns = inode.mtime
        a.st_ctime_ns = inode.ctime
        return a

    def _ref(self, inode: Inode) -> pyfuse3.EntryAttributes:
        """The reply that makes the kernel hold ``inode`` (counted in the same lock)."""
        return self._entry(self.store.stat(inode.ino, ref=True))

    @_fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            inode = self.store.lookup(parent_inode, name)
        except FsError as e:
            if e.errno != errno.ENOENT:
                raise
            return _NEGATIVE              # the kernel caches the miss (see NEGATIVE_TIMEOUT)
        return self._ref(inode)

    @_fuse_errors
    async def getattr(self, inode, ctx=None):
        return self._entry(self.store.stat(inode))

    @_fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        kw = {}
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_atime:
            kw["atime"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime"] = attr.st_mtime_ns
        if fields.update_ctime:
            kw["ctime"] = attr.st_ctime_ns
        if fields.update_size:
            kw["size"] = attr.st_size
        await _run(self.store.setattr, inode, **kw)
        return self._entry(self.store.stat(inode))

    async def forget(self, inode_list):
        for ino, n in inode_list:
            try:
                self.store.forget(ino, n)
            except Exception:
                log.exception("forget")

    # -- namespace --
    @_fuse_errors
    async def readlink(self, inode, ctx):
        return self.store.readlink(inode)

    @_fuse_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._ref(self.store.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_fuse_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._ref(self.store.mkdir(parent_inode, name, mode & ~ctx.umask, ctx.uid, ctx.gid))

    @_fuse_errors
    async def symlink(self, parent_inode, name, target, ctx):
        return self._ref(self.store.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_fuse_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._ref(self.store.link(inode, new_parent_inode, new_name))

    @_fuse_errors
    async def unlink(self, parent_inode, name, ctx):
        if name == POLICY_NAME:               # may read and match a policy: not on the loop
            return await _run(self.store.unlink, parent_inode, name)
        self.store.unlink(parent_inode, name, reset=False)
        if self.store.reset_pending:
            await _run(self.store.reset_empty_zones)

    @_fuse_errors
    async def rmdir(self, parent_inode, name, ctx):
        await _run(self.store.rmdir, parent_inode, name)

    @_fuse_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await _run(self.store.rename, parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # -- directories --
    @_fuse_errors
    async def opendir(self, inode, ctx):
        self.store.getattr(inode)
        return inode

    @_fuse_errors
    async def readdir(self, fh, start_id, token):
        for name, inode, cookie in self.store.readdir_stat(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._entry(inode), cookie):
                break
            if name not in (b".", b".."):
                self.store.ref(inode.ino)

    async def releasedir(self, fh):
        return None

    async def fsyncdir(self, fh, datasync):
        await _run(self.store.sync)

    # -- files --
    def _new_fh(self, ino: int) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = ino
        return fh

    def _ino(self, fh: int) -> int:
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    @_fuse_errors
    async def open(self, inode, flags, ctx):
        await _run(self.store.open, inode, truncate=bool(flags & os.O_TRUNC))
        return pyfuse3.FileInfo(fh=self._new_fh(inode), keep_cache=True,
                                direct_io=_direct_write(flags, self.store.stat(inode)))

    @_fuse_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        ino = self.store.create(parent_inode, name, mode & ~ctx.umask, ctx.uid, ctx.gid).ino
        self.store.open(ino)
        entry = self.store.stat(ino, ref=True)
        return (pyfuse3.FileInfo(fh=self._new_fh(ino), direct_io=_direct_write(flags, entry)),
                self._entry(entry))

    @_fuse_errors
    async def read(self, fh, off, size):
        ino = self._ino(fh)
        data = self.store.read_cached(ino, off, size)     # read ahead: on the loop
        if data is not None:
            return data
        return await _run(self.store.read, ino, off, size, True)   # any buffer

    @_fuse_errors
    async def write(self, fh, off, buf):
        ino = self._ino(fh)
        n = self.store.buffer_write(ino, off, buf)
        if n is None:
            n = await _run(self.store.write, ino, off, buf)
        return n

    @_fuse_errors
    async def flush(self, fh):
        ino = self._ino(fh)
        if not self.store.files.flush_clean(ino):     # bytes or attributes to write out
            await _run(self.store.commit, ino, durable=False)

    @_fuse_errors
    async def fsync(self, fh, datasync):
        await _run(self.store.commit, self._ino(fh), durable=True)

    @_fuse_errors
    async def release(self, fh):
        ino = self.handles.pop(fh, None)
        if ino is None:
            return
        if not self.store.files.release_clean(ino):   # its commit has work: not on the loop
            await _run(self.store.release, ino)
        elif self.store.reset_pending:
            await _run(self.store.reset_empty_zones)

    # -- xattrs --
    @_fuse_errors
    async def setxattr(self, inode, name, value, ctx):
        self.store.setxattr(inode, name, value)

    @_fuse_errors
    async def getxattr(self, inode, name, ctx):
        if name.startswith(XATTR_PREFIX):     # may match policy regexes: not on the loop
            return await _run(self.store.getxattr, inode, name)
        return self.store.getxattr(inode, name)

    @_fuse_errors
    async def listxattr(self, inode, ctx):
        return self.store.listxattr(inode)

    @_fuse_errors
    async def removexattr(self, inode, name, ctx):
        self.store.removexattr(inode, name)

    # -- filesystem --
    @_fuse_errors
    async def statfs(self, ctx):
        s = self.store.statfs()
        st = pyfuse3.StatvfsData()
        st.f_bsize = s["bsize"]
        st.f_frsize = s["bsize"]
        st.f_blocks = s["blocks"]
        st.f_bfree = s["bfree"]
        st.f_bavail = s["bfree"]
        st.f_files = s["files"] + s["ffree"]
        st.f_ffree = s["ffree"]
        st.f_favail = s["ffree"]
        st.f_namemax = 255
        return st

    @_fuse_errors
    async def access(self, inode, mode, ctx):
        self.store.getattr(inode)
        return True


async def _periodic_sync(store: Store, interval: float) -> None:
    """Namespace changes become durable within ``interval`` seconds."""
    while True:
        await trio.sleep(interval)
        try:
            await trio.to_thread.run_sync(store.sync)
        except Exception:
            log.exception("periodic journal flush failed")


async def _after_init(ops: RetainzOperations, ready) -> None:
    """Run ``ready`` once the kernel has processed our INIT reply (see ``init``)."""
    while not ops.initialized:
        await trio.sleep(0.002)
    await trio.sleep(0)
    ready()


async def serve(store: Store, sync_interval: float = 1.0, ready=None,
                ops: RetainzOperations | None = None) -> None:
    """Run the FUSE loop until unmounted (pyfuse3.init must have been called).

    ``ready`` runs after FUSE INIT when ``ops`` is given, else before the loop starts."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_periodic_sync, store, sync_interval)
        if ready is not None:
            if ops is not None:
                nursery.start_soon(_after_init, ops, ready)
            else:
                ready()
        try:
            await pyfuse3.main(min_tasks=4, max_tasks=32)
        finally:
            nursery.cancel_scope.cancel()


def fuse_options(fsname: str, extra: list[str] | None = None) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts.discard("default_permissions")
    opts |= {"default_permissions", f"fsname={fsname}", "subtype=retainzfs"}
    for o in extra or []:
        opts.add(o)
    return opts

