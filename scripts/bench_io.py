#!/usr/bin/env python3
"""Data path against a plain file on the same disk, side by side, alternating (issue 10).

Each round runs every figure on a fresh retainzfs mount (an emulated image on this disk), then
in a plain directory on the same file system (ext4 here), or the other way round (alternating by
round); the ratio (plain time / retainzfs time, higher is better) is taken per round and the
median of the rounds' ratios is printed with each round's, beside the issue's target. Page cache is dropped before every cold read.  Each round
also times the disk itself with O_DIRECT (8 threads into one file, as the daemon does its zone
I/O): plain / that is the best 8-writer and 8-reader ratio an O_DIRECT daemon could show here.

    python3 scripts/bench_io.py                     # 1 GiB files, 2 rounds (~4 min)
    python3 scripts/bench_io.py --size 256M --rounds 1 --json
"""
from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import (bench_parser, cpu_seconds, daemon_pid, drop_caches, odirect_pass,
                       peak_rss)

MiB = 1 << 20
REQ = 1 << 20


def write_file(path: str, size: int, buf: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // REQ):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            b = os.read(fd, REQ)
            if not b:
                return n
            n += len(b)
    finally:
        os.close(fd)


def status(mnt: str) -> dict:
    """``retainzfs status --json`` of the mount."""
    r = subprocess.run(["retainzfs", "status", mnt, "--json"], check=True,
                       capture_output=True, text=True)
    return json.loads(r.stdout)


def parallel(fn, args_list) -> None:
    ts = [threading.Thread(target=fn, args=a) for a in args_list]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class Side:
    """One side of the comparison: a directory, the daemon serving it (None: the plain file),
    and the figures measured there this round."""

    def __init__(self, root: str, pid: int | None = None) -> None:
        self.root, self.pid, self.out = root, pid, {}

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


# The figures, in order.  A round runs them all on one side, then all on the other (which
# side first alternates by round), and a ratio is taken per round, side against side.  Not
# figure by figure, back to back: this VM's disk writes a 1 GiB file in 1.3-2.5 s when the
# file system can reuse blocks just freed, in ~3 s when it must take fresh ones (the host
# allocates them: thin provisioning), so the side that wrote second, while the other side's
# file still existed, lost (one such run: plain's sequential write 2.41 s against 0.94).
# Run whole, each side's files are deleted before the other side writes.

def step_seq_write(side: Side, size: int, buf: bytes) -> None:
    c0 = cpu_seconds(side.pid)
    t = time.perf_counter()
    write_file(side.path("seq"), size, buf)
    side.out["seq_write_fsync"] = time.perf_counter() - t
    side.out["write_cpu_s_per_gib"] = (cpu_seconds(side.pid) - c0) / (size / (1 << 30))


def step_cold_read(side: Side, size: int, buf: bytes) -> None:
    drop_caches(back=2 * size + (256 << 20))
    c0 = cpu_seconds(side.pid)
    t = time.perf_counter()
    read_file(side.path("seq"))
    side.out["cold_seq_read"] = time.perf_counter() - t
    side.out["read_cpu_s_per_gib"] = (cpu_seconds(side.pid) - c0) / (size / (1 << 30))


def step_mmap_read(side: Side, size: int, buf: bytes) -> None:
    """Random 4 KiB reads via mmap, cold."""
    drop_caches(back=2 * size + (256 << 20))
    with open(side.path("seq"), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        rnd = random.Random(1)
        t = time.perf_counter()
        s = 0
        for _ in range(4000):
            o = rnd.randrange(size // 4096) * 4096
            s += mm[o]
        side.out["random_4k_mmap_read"] = time.perf_counter() - t
        mm.close()
    os.unlink(side.path("seq"))


def step_8_writers(side: Side, size: int, buf: bytes) -> None:
    per = max(REQ, size // 8 // REQ * REQ)
    st0 = status(side.root) if side.pid else None
    t = time.perf_counter()
    parallel(write_file, [(side.path(f"w{i}"), per, buf) for i in range(8)])
    side.out["8_writers"] = took = time.perf_counter() - t
    if st0 is not None:                  # io_lock and the device during the 8 writers
        st1 = status(side.root)
        held = st1["data_write_seconds"] - st0["data_write_seconds"]
        dev = st1["device_write_seconds"] - st0["device_write_seconds"]
        side.out["8w_io_lock_share"] = held / took
        side.out["8w_device_writes_in_flight"] = dev / took


def step_8_readers(side: Side, size: int, buf: bytes) -> None:
    drop_caches(back=2 * size + (256 << 20))
    t = time.perf_counter()
    parallel(read_file, [(side.path(f"w{i}"),) for i in range(8)])
    side.out["8_readers"] = time.perf_counter() - t
    for i in range(8):
        os.unlink(side.path(f"w{i}"))


def _small_files_of(d: str, k: int, n: int) -> None:
    """Process ``k``'s share: ``n`` files of 100 bytes created in ``d``, then each stat'ed."""
    for i in range(n):
        with open(os.path.join(d, f"p{k}_{i}"), "wb") as f:
            f.write(b"x" * 100)
    for i in range(n):
        os.stat(os.path.join(d, f"p{k}_{i}"))


def step_small_files(side: Side, size: int, buf: bytes) -> None:
    d = side.path("small")
    t = time.perf_counter()
    os.mkdir(d)
    _small_files_of(d, 0, 2000)
    shutil.rmtree(d)
    side.out["small_files_2000"] = time.perf_counter() - t


def step_small_files_cold_read(side: Side, size: int, buf: bytes) -> None:
    """2,000 files of 100 bytes made and synced (not timed), caches dropped (the kernel
    forgets the mount's inodes too), then each opened and read: a restore that loads many
    small files (configs, tokenizer files, a rank's small shards) after a node restart.  On
    the mount each first open costs a LOOKUP, a GETATTR, with ACLs on a GETXATTR of the
    ACL, an OPEN and a READ (``-o noacl`` to compare)."""
    d = side.path("small_read")
    os.mkdir(d)
    _small_files_of(d, 0, 2000)
    drop_caches()
    t = time.perf_counter()
    for i in range(2000):
        with open(os.path.join(d, f"p0_{i}"), "rb") as f:
            f.read()
    side.out["small_files_2000_cold_read"] = time.perf_counter() - t
    shutil.rmtree(d)


def step_small_files_4procs(side: Side, size: int, buf: bytes) -> None:
    """The same 2,000 files made by 4 processes at once (as ranks write their own small
    files), then one ``rmtree``: a FUSE daemon serves the four concurrently, ext4 takes its
    directory lock for each create."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    d = side.path("small4")
    t = time.perf_counter()
    os.mkdir(d)
    ps = [ctx.Process(target=_small_files_of, args=(d, k, 500)) for k in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    if any(p.exitcode for p in ps):
        raise RuntimeError(f"small-file writers failed: {[p.exitcode for p in ps]}")
    shutil.rmtree(d)
    side.out["small_files_2000_4procs"] = time.perf_counter() - t


STEPS = (step_seq_write, step_cold_read, step_mmap_read, step_8_writers, step_8_readers,
         step_small_files, step_small_files_4procs, step_small_files_cold_read)


def figures(root: str, size: int, pid: int | None = None) -> dict:
    """Every figure in directory ``root`` (served by daemon ``pid``, if any): seconds each,
    and the daemon's CPU per GiB and peak RSS (``bench_fuse_ceiling.py`` measures its null
    file systems with this)."""
    side = Side(root, pid)
    one_side(side, size)
    return side.out


def one_side(side: Side, size: int) -> None:
    """Every figure on ``side``, in order."""
    buf = os.urandom(REQ)
    for step in STEPS:
        step(side, size, buf)
    side.out["peak_rss_mib"] = peak_rss(side.pid) / MiB


def disk_ceiling(root: str, size: int) -> dict | None:
    """What the disk itself gives 8 threads with O_DIRECT into one sparse file, as the daemon
    writes and reads its image (``benchutil.odirect_pass``: 4 MiB requests, thread k every
    8th from the k-th, as flushes append to a zone; fsync after the writes, page cache
    dropped before the reads): the bound for the 8-writer and 8-reader
    figures, since retainzfs does its zone I/O this way while the plain file goes through the
    page cache (and the kernel's writeback and readahead)."""
    p = os.path.join(root, "odirect")
    per = max(4 * MiB, size // 8 // (4 * MiB) * (4 * MiB))
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:                  # no O_DIRECT here (tmpfs): nothing to compare with
        return None
    out = {}
    try:
        os.ftruncate(fd, 8 * per)
        out["8_writers"] = odirect_pass(fd, 8 * per, 8, 4 * MiB, write=True)
        drop_caches()
        out["8_readers"] = odirect_pass(fd, 8 * per, 8, 4 * MiB, write=False)
    finally:
        os.close(fd)
        os.unlink(p)
    return out


TARGETS = {"seq_write_fsync": 0.9, "cold_seq_read": 0.9, "8_writers": 0.9, "8_readers": 0.9,
           "random_4k_mmap_read": 0.8, "small_files_2000": 0.5, "small_files_2000_4procs": 0.5,
           # (issue 10 names no target for reading small files; the small-file one)
           "small_files_2000_cold_read": 0.5}


def main() -> int:
    ap = bench_parser(__doc__)
    a = ap.parse_args()
    from retainzfs.cli.common import parse_size
    size = parse_size(a.size)
    work = tempfile.mkdtemp(prefix="bench_io.", dir=a.workdir)
    img, mnt, plain = (os.path.join(work, n) for n in ("img.zns", "mnt", "plain"))
    os.makedirs(mnt)
    os.makedirs(plain)
    img_size = max(4 << 30, 3 * size)
    res = {"retainzfs": [], "plain": [], "odirect": []}
    try:
        for r in range(a.rounds):
            for kind in (("retainzfs", "plain") if r % 2 == 0 else ("plain", "retainzfs")):
                if kind == "plain":
                    side = Side(plain)
                    one_side(side, size)
                    c = disk_ceiling(plain, size)
                    if c is not None:
                        res["odirect"].append(c)
                else:
                    subprocess.run(["mkfs.retainzfs", "-q", "--force", "--size",
                                    str(img_size), "--zone-size", "64M", img], check=True)
                    subprocess.run(["mount.retainzfs", img, mnt]
                                   + (["-o", a.options] if a.options else []), check=True)
                    side = Side(mnt, daemon_pid(img))
                    try:
                        one_side(side, size)
                    finally:
                        subprocess.run(["umount", mnt], check=True)
                        time.sleep(0.5)
                res[kind].append(side.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = {}
    for k, target in TARGETS.items():
        rz = statistics.median(x[k] for x in res["retainzfs"])
        pl = statistics.median(x[k] for x in res["plain"])
        pairs = [p[k] / z[k] for z, p in zip(res["retainzfs"], res["plain"]) if z[k]]
        table[k] = {"retainzfs_s": rz, "plain_s": pl,
                    "ratio": statistics.median(pairs) if pairs else 0.0,
                    "ratios": pairs, "target": target}
    ceiling = ({k: statistics.median(x[k] for x in res["odirect"])
                for k in ("8_writers", "8_readers")} if res["odirect"] else None)
    daemon = {k: statistics.median(x[k] for x in res["retainzfs"])
              for k in ("write_cpu_s_per_gib", "read_cpu_s_per_gib", "peak_rss_mib",
                        "8w_io_lock_share", "8w_device_writes_in_flight")}
    if a.json:
        print(json.dumps({"size": size, "rounds": a.rounds, "figures": table, "daemon": daemon,
                          "odirect_ceiling_s": ceiling}, indent=2))
    else:
        print(f"{size / MiB:.0f} MiB files, 1 MiB requests, {a.rounds} alternating rounds; "
              f"ratio = plain time / retainzfs time (1.0 = as fast as a plain file)")
        for k, v in table.items():
            ok = "meets" if v["ratio"] >= v["target"] else "below"
            each = "/".join(f"{x:.2f}" for x in v["ratios"])
            print(f"  {k:22s} retainzfs {v['retainzfs_s']:7.2f} s  plain {v['plain_s']:7.2f} s  "
                  f"ratio {v['ratio']:.2f} (rounds {each})  (target >= {v['target']}: {ok})")
        print(f"  daemon: {daemon['write_cpu_s_per_gib']:.2f} CPU s per GiB written, "
              f"{daemon['read_cpu_s_per_gib']:.2f} per GiB read, peak RSS "
              f"{daemon['peak_rss_mib']:.0f} MiB (target 300)")
        print(f"  8 writers: placement held io_lock {daemon['8w_io_lock_share']:.0%} of the "
              f"run; device writes in flight {daemon['8w_device_writes_in_flight']:.2f} on "
              f"average (status: data_write_seconds, device_write_seconds)")
        if ceiling is not None:
            print(f"  the disk with O_DIRECT, 8 threads into one file (how the daemon does its zone "
                  f"I/O): writes {ceiling['8_writers']:.2f} s, reads {ceiling['8_readers']:.2f} s; "
                  f"plain / that = {table['8_writers']['plain_s'] / ceiling['8_writers']:.2f} and "
                  f"{table['8_readers']['plain_s'] / ceiling['8_readers']:.2f}: the best ratio a "
                  f"daemon doing O_DIRECT could show here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
