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

    python3 scripts/bench_fuse_ceiling.py                  # 1 GiB, 2 rounds (~2 min)
    python3 scripts/bench_fuse_ceiling.py --size 256M --rounds 1 --json

Ratios are plain time / null-file-system time, as in bench_io (1.0 = as fast as the plain
file); the null side's "sequential write + fsync" writes nothing to any disk, so it is an
upper bound, not a like-for-like figure.
"""
from __future__ import annotations

import argparse
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

MiB = 1 << 20


def serve(mnt: str) -> int:
    """Run the null file system on ``mnt`` in the foreground until unmounted."""
    import pyfuse3
    import trio

    from retainzfs.cli.mount import _set_readahead
    from retainzfs.fs import BLKSIZE, ENTRY_TIMEOUT, _direct_write, fuse_options

    zeros = memoryview(bytes(range(256)) * 4096)      # 1 MiB answered to every read

    class Node:
        __slots__ = ("ino", "mode", "size", "nlink", "children", "t", "caps")

        def __init__(self, ino: int, mode: int) -> None:
            self.ino, self.mode, self.size, self.nlink = ino, mode, 0, 1
            self.children: dict[bytes, int] = {}
            self.t = time.time_ns()
            self.caps = False

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
            size = max(0, min(size, n.size - off, len(zeros)))
            return zeros[:size]

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
            async def ready() -> None:
                while not ops.inited:
                    await trio.sleep(0.002)
                await trio.sleep(0)
                _set_readahead(mnt, 4096)
                print("OK", flush=True)
            nursery.start_soon(ready)
            await pyfuse3.main(min_tasks=4, max_tasks=32)
            nursery.cancel_scope.cancel()
    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", metavar="MNT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    from bench_io import TARGETS, figures
    from benchutil import cpu_seconds, peak_rss

    from retainzfs.cli.common import parse_size
    size = parse_size(a.size)
    work = tempfile.mkdtemp(prefix="bench_ceiling.", dir=a.workdir)
    mnt, plain = os.path.join(work, "mnt"), os.path.join(work, "plain")
    os.makedirs(mnt)
    os.makedirs(plain)
    res: dict[str, list] = {"null": [], "plain": []}
    try:
        for r in range(a.rounds):
            for kind in (("null", "plain") if r % 2 == 0 else ("plain", "null")):
                if kind == "plain":
                    res[kind].append(figures(plain, size))
                    continue
                p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", mnt],
                                     stdout=subprocess.PIPE, text=True)
                try:
                    if p.stdout.readline().strip() != "OK":
                        raise SystemExit("bench_fuse_ceiling: the null file system did not mount")
                    c0 = cpu_seconds(p.pid)
                    f = figures(mnt, size)
                    f["cpu_s"] = cpu_seconds(p.pid) - c0
                    f["peak_rss_mib"] = peak_rss(p.pid) / MiB
                    res[kind].append(f)
                finally:
                    subprocess.run(["umount", mnt], check=False)
                    p.wait(timeout=30)
                    time.sleep(0.5)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = {}
    for k, target in TARGETS.items():
        nl = statistics.median(x[k] for x in res["null"])
        pl = statistics.median(x[k] for x in res["plain"])
        table[k] = {"null_s": nl, "plain_s": pl, "ratio": pl / nl if nl else 0.0,
                    "target": target}
    if a.json:
        print(json.dumps({"size": size, "rounds": a.rounds, "figures": table}, indent=2))
        return 0
    print(f"{size / MiB:.0f} MiB files, 1 MiB requests, {a.rounds} alternating rounds; a pyfuse3 "
          f"file system that stores nothing against a plain file (ratio = plain / null time)")
    for k, v in table.items():
        ok = "reachable" if v["ratio"] >= v["target"] else "out of reach for pyfuse3 here"
        print(f"  {k:22s} null {v['null_s']:7.2f} s  plain {v['plain_s']:7.2f} s  "
              f"ceiling {v['ratio']:.2f}  (target >= {v['target']}: {ok})")
    print(f"  null daemon: {statistics.median(x['cpu_s'] for x in res['null']):.1f} CPU s per "
          f"round, peak RSS {statistics.median(x['peak_rss_mib'] for x in res['null']):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
