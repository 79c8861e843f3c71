#!/usr/bin/env python3
"""The ceiling of any pyfuse3 daemon on this machine: bench_io's figures on a file system that
stores nothing, against a plain file on the same disk.

Why: retainzfs answers every FUSE request on pyfuse3's one trio thread, which also copies
every read reply into the kernel (``fuse_reply_buf``) with the GIL held.  A file system that
does no work at all -- writes are counted and dropped, reads are answered from one static
buffer, no device, no journal, no checksums -- run through the same pyfuse3 loop with the
mount settings retainzfs uses (default_permissions, 1 s entry/attr timeouts, FOPEN_DIRECT_IO
for write-only opens, keep_cache, ``read_ahead_kb`` 4096, st_blksize 128 KiB) shows how far a
pyfuse3 design can go here: a ratio it cannot reach, retainzfs cannot either.

The same null file system in C on libfuse's multi-threaded low-level loop
(``scripts/nullfs_mt.c``, built here with ``cc`` and ``pkg-config fuse3``) is measured beside
it: what a daemon whose requests are not all received and answered on one GIL-holding
thread could reach, and what no FUSE daemon reaches here at all.

    python3 scripts/bench_fuse_ceiling.py                  # 1 GiB, 2 rounds (~2 min)
    python3 scripts/bench_fuse_ceiling.py --size 256M --rounds 1 --json

Ratios are plain time / null-file-system time, as in bench_io (1.0 = as fast as the plain
file); the null side's "sequential write + fsync" writes nothing to any disk, so it is an
upper bound, not a like-for-like figure.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import bench_parser  # noqa: E402  (this directory, put on the path above)

MiB = 1 << 20

#: 1 MiB answered to every read by both Python null file systems
ZEROS = memoryview(bytes(range(256)) * 4096)


class Node:
    """A file or directory of the null file systems: its size and names, no bytes."""
    __slots__ = ("ino", "mode", "size", "nlink", "children", "t", "caps")

    def __init__(self, ino: int, mode: int) -> None:
        self.ino, self.mode, self.size, self.nlink = ino, mode, 0, 1
        self.children: dict[bytes, int] = {}
        self.t = time.time_ns()
        self.caps = False


def serve(mnt: str) -> int:
    """Run the null file system on ``mnt`` in the foreground until unmounted."""
    import pyfuse3
    import trio

    from retainzfs.fs import BLKSIZE, ENTRY_TIMEOUT, _direct_write, fuse_options


    class NullFS(pyfuse3.Operations):
        supports_dot_lookup = True
        enable_writeback_cache = False

        def __init__(self) -> None:
            super().__init__()
            self.nodes = {pyfuse3.ROOT_INODE: Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755)}
            self.nodes[pyfuse3.ROOT_INODE].nlink = 2
            self.next = pyfuse3.ROOT_INODE + 1
            self.inited = False

        def init(self):
            self.inited = True

        def _attr(self, n: Node) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            a.st_ino = n.ino
            a.entry_timeout = a.attr_timeout = ENTRY_TIMEOUT
            a.st_mode, a.st_nlink, a.st_size = n.mode, n.nlink, n.size
            a.st_uid, a.st_gid = os.getuid(), os.getgid()
            a.st_blksize = BLKSIZE
            a.st_blocks = (n.size + 511) // 512
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = n.t
            return a

        def _node(self, ino: int) -> Node:
            try:
                return self.nodes[ino]
            except KeyError:
                raise pyfuse3.FUSEError(errno.ENOENT) from None

        async def lookup(self, parent, name, ctx=None):
            ino = self._node(parent).children.get(name)
            if ino is None:
                a = pyfuse3.EntryAttributes()
                a.st_ino = 0
                a.entry_timeout = ENTRY_TIMEOUT
                return a
            return self._attr(self.nodes[ino])

        async def getattr(self, ino, ctx=None):
            return self._attr(self._node(ino))

        async def setattr(self, ino, attr, fields, fh, ctx):
            n = self._node(ino)
            if fields.update_size:
                n.size = attr.st_size
            if fields.update_mode:
                n.mode = (n.mode & ~0o7777) | (attr.st_mode & 0o7777)
            return self._attr(n)

        def _new(self, parent: int, name: bytes, mode: int) -> Node:
            p = self._node(parent)
            if name in p.children:
                raise pyfuse3.FUSEError(errno.EEXIST)
            n = Node(self.next, mode)
            self.next += 1
            self.nodes[n.ino] = n
            p.children[name] = n.ino
            return n

        async def create(self, parent, name, mode, flags, ctx):
            n = self._new(parent, name, stat.S_IFREG | (mode & 0o7777 & ~ctx.umask))
            return (pyfuse3.FileInfo(fh=n.ino, direct_io=_direct_write(flags, n)),
                    self._attr(n))

        async def mkdir(self, parent, name, mode, ctx):
            n = self._new(parent, name, stat.S_IFDIR | (mode & 0o7777 & ~ctx.umask))
            n.nlink = 2
            return self._attr(n)

        async def open(self, ino, flags, ctx):
            n = self._node(ino)
            if flags & os.O_TRUNC:
                n.size = 0
            return pyfuse3.FileInfo(fh=ino, keep_cache=True, direct_io=_direct_write(flags, n))

        async def read(self, fh, off, size):
            n = self.nodes[fh]
            size = max(0, min(size, n.size - off, len(ZEROS)))
            return ZEROS[:size]

        async def write(self, fh, off, buf):
            n = self.nodes[fh]
            n.size = max(n.size, off + len(buf))
            return len(buf)

        async def flush(self, fh):
            return None

        async def fsync(self, fh, datasync):
            return None

        async def release(self, fh):
            return None

        def _remove(self, parent: int, name: bytes) -> None:
            p = self._node(parent)
            ino = p.children.pop(name, None)
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            self.nodes.pop(ino, None)

        async def unlink(self, parent, name, ctx):
            self._remove(parent, name)

        async def rmdir(self, parent, name, ctx):
            if self.nodes[self._node(parent).children.get(name, 0)].children:
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            self._remove(parent, name)

        async def opendir(self, ino, ctx):
            return ino

        async def readdir(self, fh, start_id, token):
            items = list(self._node(fh).children.items())
            for i in range(start_id, len(items)):
                name, ino = items[i]
                if not pyfuse3.readdir_reply(token, name, self._attr(self.nodes[ino]), i + 1):
                    break

        async def releasedir(self, fh):
            return None

        async def forget(self, inode_list):
            return None

        async def statfs(self, ctx):
            st = pyfuse3.StatvfsData()
            st.f_bsize = st.f_frsize = 4096
            st.f_blocks = st.f_bfree = st.f_bavail = 1 << 30
            st.f_files = st.f_ffree = st.f_favail = 1 << 20
            st.f_namemax = 255
            return st

        async def access(self, ino, mode, ctx):
            return True

    ops = NullFS()
    pyfuse3.init(ops, mnt, fuse_options("nullfs"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def ready() -> None:            # the readahead is set by run_null
                while not ops.inited:
                    await trio.sleep(0.002)
                print("OK", flush=True)
            nursery.start_soon(ready)
            await pyfuse3.main(min_tasks=4, max_tasks=32)
            nursery.cancel_scope.cancel()
    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


def serve_binding(mnt: str) -> int:
    """The same null file system on retainzfs's own binding (``retainzfs._fuse``: libfuse's
    threads, Python handlers taking the GIL per request), in the foreground until unmounted."""
    import threading

    from retainzfs import _fuse
    from retainzfs.errors import FsError      # an answer; any other OSError is logged
    from retainzfs.fs import BLKSIZE, ENTRY_TIMEOUT, _direct_write, fuse_options
    from retainzfs.namespace import Attrs

    uid, gid = os.getuid(), os.getgid()

    class NullOps:
        blksize, timeout, negative_timeout = BLKSIZE, ENTRY_TIMEOUT, ENTRY_TIMEOUT
        want_acl = False                          # as ``-o noacl``: no ACL round trips

        def __init__(self) -> None:
            self.nodes = {1: Node(1, stat.S_IFDIR | 0o755)}
            self.nodes[1].nlink = 2
            self.next = 2
            self.lock = threading.Lock()          # handlers run in parallel here

        def init(self, acl: bool) -> None:
            print("OK", flush=True)              # the readahead is set by run_null

        def _attr(self, n: Node) -> Attrs:
            return Attrs(n.ino, n.mode, n.nlink, uid, gid, 0, n.size, n.t, n.t, n.t, False)

        def _node(self, ino: int) -> Node:
            try:
                return self.nodes[ino]
            except KeyError:
                raise FsError(errno.ENOENT) from None

        def lookup(self, parent, name):
            ino = self._node(parent).children.get(name)
            return None if ino is None else self._attr(self.nodes[ino])

        def getattr(self, ino):
            return self._attr(self._node(ino))

        def setattr(self, ino, changes):
            n = self._node(ino)
            if "size" in changes:
                n.size = changes["size"]
            if "mode" in changes:
                n.mode = (n.mode & ~0o7777) | (changes["mode"] & 0o7777)
            return self._attr(n)

        def _new(self, parent: int, name: bytes, mode: int) -> Node:
            with self.lock:
                p = self._node(parent)
                if name in p.children:
                    raise FsError(errno.EEXIST)
                n = Node(self.next, mode)
                self.next += 1
                self.nodes[n.ino] = n
                p.children[name] = n.ino
                return n

        def create(self, parent, name, mode, flags, ctx):
            n = self._new(parent, name, stat.S_IFREG | (mode & 0o7777 & ~ctx[2]))
            return n.ino, _direct_write(flags, n), True, self._attr(n)

        def mkdir(self, parent, name, mode, ctx):
            n = self._new(parent, name, stat.S_IFDIR | (mode & 0o7777 & ~ctx[2]))
            n.nlink = 2
            return self._attr(n)

        def open(self, ino, flags, ctx=None):
            n = self._node(ino)
            if flags & os.O_TRUNC:
                n.size = 0
            return ino, _direct_write(flags, n), True

        def read(self, fh, off, size):
            n = self.nodes[fh]
            return ZEROS[:max(0, min(size, n.size - off, len(ZEROS)))]

        def write(self, fh, off, buf):
            n = self.nodes[fh]
            n.size = max(n.size, off + len(buf))
            return len(buf)

        def flush(self, fh):
            pass

        def fsync(self, fh, datasync):
            pass

        def write_synced(self, fh):           # a write asking to be durable (RWF_DSYNC)
            pass

        def release(self, fh):
            pass

        def _remove(self, parent: int, name: bytes) -> None:
            with self.lock:
                ino = self._node(parent).children.pop(name, None)
                if ino is None:
                    raise FsError(errno.ENOENT)
                self.nodes.pop(ino, None)

        def unlink(self, parent, name):
            self._remove(parent, name)

        def rmdir(self, parent, name):
            if self.nodes[self._node(parent).children.get(name, 0)].children:
                raise FsError(errno.ENOTEMPTY)
            self._remove(parent, name)

        def opendir(self, ino):
            return ino

        def releasedir(self, fh):
            pass

        def readdir(self, fh, start, limit=None):
            items = list(self._node(fh).children.items())[start:]
            if limit is not None:
                items = items[:limit]
            return [(name, self._attr(self.nodes[ino]), start + i + 1)
                    for i, (name, ino) in enumerate(items)]

        def counted(self, ino):
            pass

        def forget(self, pairs):
            pass

        def statfs(self):
            return {"bsize": 4096, "blocks": 1 << 30, "bfree": 1 << 30, "files": 0,
                    "ffree": 1 << 20}

        def access(self, ino, mask):
            pass

        def getxattr(self, ino, name):        # asked before every cached write, as of any fs
            raise FsError(errno.ENODATA)

        def listxattr(self, ino):
            return []

        def _nosys(self, *args):              # what the figures never ask: libfuse's default
            raise FsError(errno.ENOSYS)

        fallocate = fsyncdir = link = lseek = mknod = readlink = rename = symlink = _nosys
        setxattr = removexattr = _nosys

    _fuse.mount(NullOps(), mnt, sorted(fuse_options("nullfs")))
    try:
        _fuse.serve()
    finally:
        _fuse.close(unmount=True)
    return 0


def build_c(work: str) -> str | None:
    """Compile ``nullfs_mt.c`` into ``work``; None (and why, on stderr) when it cannot be."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nullfs_mt.c")
    exe = os.path.join(work, "nullfs_mt")
    try:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                               capture_output=True, text=True).stdout.split()
        subprocess.run(["cc", "-O2", "-o", exe, src, *flags, "-lpthread"], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"bench_fuse_ceiling: no C null file system ({e})", file=sys.stderr)
        return None
    return exe


@contextlib.contextmanager
def null_mounted(cmd: list[str], mnt: str):
    """The file system ``cmd`` starts (it prints OK once mounted on ``mnt``), with the
    readahead retainzfs sets; yields its process, unmounts after.  (bench_dcp's ceiling too.)"""
    from retainzfs.cli.mount import _set_readahead
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        if p.stdout.readline().strip() != "OK":
            raise SystemExit(f"{cmd[0]} did not mount")
        os.stat(mnt)                        # answered after FUSE INIT: the readahead sticks
        _set_readahead(mnt, 4096)
        yield p
    finally:
        subprocess.run(["umount", mnt], check=False)
        p.wait(timeout=30)
        time.sleep(0.5)


def run_null(cmd: list[str], mnt: str, size: int) -> dict:
    """bench_io's figures on the null file system started by ``cmd``."""
    from bench_io import figures
    from benchutil import cpu_seconds, peak_rss
    with null_mounted(cmd, mnt) as p:
        c0 = cpu_seconds(p.pid)
        f = figures(mnt, size)
        f["cpu_s"] = cpu_seconds(p.pid) - c0
        f["peak_rss_mib"] = peak_rss(p.pid) / MiB
        return f


def main() -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--serve", metavar="MNT", help=argparse.SUPPRESS)
    ap.add_argument("--serve-binding", metavar="MNT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    if a.serve_binding:
        return serve_binding(a.serve_binding)
    from bench_io import TARGETS, figures

    from retainzfs.cli.common import parse_size
    size = parse_size(a.size)
    work = tempfile.mkdtemp(prefix="bench_ceiling.", dir=a.workdir)
    mnt, plain = os.path.join(work, "mnt"), os.path.join(work, "plain")
    os.makedirs(mnt)
    os.makedirs(plain)
    cmds = {"pyfuse3": [sys.executable, os.path.abspath(__file__), "--serve", mnt],
            "rz_binding": [sys.executable, os.path.abspath(__file__), "--serve-binding", mnt]}
    exe = build_c(work)
    if exe:
        cmds["c_mt"] = [exe, mnt]
    res: dict[str, list] = {k: [] for k in [*cmds, "plain"]}
    try:
        for r in range(a.rounds):
            order = [*cmds, "plain"]
            for kind in (order if r % 2 == 0 else order[::-1]):
                if kind == "plain":
                    res[kind].append(figures(plain, size))
                else:
                    res[kind].append(run_null(cmds[kind], mnt, size))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in res.items()}
    table = {}
    for k, target in TARGETS.items():
        pl = med["plain"][k]
        row = {"plain_s": pl, "target": target}
        for kind in cmds:
            nl = med[kind][k]
            row[f"{kind}_s"] = nl
            row[f"{kind}_ratio"] = pl / nl if nl else 0.0
        table[k] = row
    daemons = {kind: {"cpu_s": med[kind]["cpu_s"], "peak_rss_mib": med[kind]["peak_rss_mib"]}
               for kind in cmds}
    if a.json:
        print(json.dumps({"size": size, "rounds": a.rounds, "figures": table,
                          "daemons": daemons}, indent=2))
        return 0
    print(f"{size / MiB:.0f} MiB files, 1 MiB requests, {a.rounds} alternating rounds; file "
          f"systems that store nothing against a plain file (ratio = plain / null time):")
    print("  pyfuse3 = one trio thread (what retainzfs ran on until stop 14); rz_binding = "
          "retainzfs's binding (_fuse.pyx: libfuse's threads, Python handlers); c_mt = C, "
          "libfuse's multi-threaded loop")
    for k, v in table.items():
        cols = "  ".join(f"{kind} {v[f'{kind}_s']:6.2f} s = {v[f'{kind}_ratio']:5.2f}"
                         for kind in cmds)
        print(f"  {k:22s} plain {v['plain_s']:6.2f} s  {cols}  (target >= {v['target']})")
    for kind, d in daemons.items():
        print(f"  {kind} daemon: {d['cpu_s']:.1f} CPU s per round, peak RSS "
              f"{d['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
