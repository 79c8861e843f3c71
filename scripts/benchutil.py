"""Helpers the benchmarks share: cold caches and the mount daemon's pid, CPU and peak RSS."""
from __future__ import annotations

import argparse
import mmap
import os
import threading
import time


def drop_caches(back: int = 0) -> None:
    """Write back, then drop the page cache, so the next read comes from the disk.

    ``back``: then touch and free that many bytes of anonymous memory, so that the pages the
    next reads get for their page cache are backed by the host.  Why: this VM's balloon
    reports free pages to the host (virtio-balloon free page reporting), which takes them
    back, and the first write to such a page faults in the host.  The kernel's own I/O fills
    page cache by DMA, at no cost to the guest, but FUSE fills it by a memcpy in the daemon's
    reply: a DCP load right after a save spent 75 % of the daemon's CPU in that memcpy and
    took 1.5-1.8 s, against 0.95-1.0 s with 2 GiB touched and freed first (the plain file's
    loads reuse the pages its own buffered save had just used).  Both sides of a benchmark
    get the same, so the figure is the file system's, not the hypervisor's."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    if back > 0:
        page = mmap.PAGESIZE
        n = -(-back // page) * page
        m = mmap.mmap(-1, n)
        try:
            m[::page] = b"\1" * (n // page)           # one write per page faults it in
        finally:
            m.close()


def daemon_pid(img: str) -> int | None:
    """The mount.retainzfs daemon holding ``img`` open, if any."""
    want = os.path.realpath(img)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            if not any(b"mount.retainzfs" in a for a in cmd[:3]):
                continue
            if any(os.path.realpath(f"/proc/{d}/fd/{fd}") == want
                   for fd in os.listdir(f"/proc/{d}/fd")):
                return int(d)
        except OSError:
            continue
    return None


def peak_rss(pid: int | None) -> int:
    """VmHWM of ``pid`` in bytes (0 when unknown)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes: file ``--size``, ``--rounds`` (each
    alternating retainzfs and the plain file), ``--workdir`` (on the disk to compare), ``--json``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-o", dest="options", default="",
                    help="mount options for the retainzfs side (mount.retainzfs -o), to compare "
                         "settings: e.g. image_io=buffered")
    return ap


def odirect_pass(fd: int, size: int, threads: int, chunk: int, write: bool) -> float:
    """Seconds for ``threads`` threads to write (or read) ``size`` bytes of ``fd`` (opened
    O_DIRECT) in ``chunk``-byte requests, thread k taking every ``threads``-th chunk from
    chunk k, as the daemon's flushes append to a zone; writes end with an fsync."""
    def one(k: int) -> None:
        buf = mmap.mmap(-1, chunk)                # page-aligned, as O_DIRECT wants
        try:
            if write:
                buf.write(os.urandom(chunk))
            for off in range(k * chunk, size, threads * chunk):
                (os.pwritev if write else os.preadv)(fd, [buf], off)
        finally:
            buf.close()
    t = time.perf_counter()
    ts = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    if write:
        os.fsync(fd)
    return time.perf_counter() - t
