#!/usr/bin/env python3
"""Data path against a plain file on the same disk, side by side, alternating (issue 10).

For each figure the same work runs on a fresh retainzfs mount (an emulated image on this disk)
and in a plain directory on the same file system (ext4 here), alternating ``--rounds`` times;
the ratio (retainzfs / plain, higher is better; for times plain / retainzfs) of the medians is
printed beside the issue's target. Page cache is dropped before every cold read.  Each round
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


def figures(root: str, size: int, pid: int | None = None) -> dict:
    """Seconds for each figure in directory ``root``; with the daemon's ``pid`` also its CPU
    seconds per GiB of the sequential write and read (``*_cpu_s_per_gib``) and peak RSS."""
    buf = os.urandom(REQ)
    out = {}
    p = os.path.join(root, "seq")
    c0 = cpu_seconds(pid)
    t = time.perf_counter()
    write_file(p, size, buf)
    out["seq_write_fsync"] = time.perf_counter() - t
    c1 = cpu_seconds(pid)
    drop_caches(back=2 * size + (256 << 20))
    c2 = cpu_seconds(pid)
    t = time.perf_counter()
    read_file(p)
    out["cold_seq_read"] = time.perf_counter() - t
    c3 = cpu_seconds(pid)
    gib = size / (1 << 30)
    out["write_cpu_s_per_gib"] = (c1 - c0) / gib
    out["read_cpu_s_per_gib"] = (c3 - c2) / gib
    drop_caches(back=2 * size + (256 << 20))
    with open(p, "rb") as f:                              # random 4 KiB reads via mmap
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        rnd = random.Random(1)
        t = time.perf_counter()
        s = 0
        for _ in range(4000):
            o = rnd.randrange(size // 4096) * 4096
            s += mm[o]
        out["random_4k_mmap_read"] = time.perf_counter() - t
        mm.close()
    os.unlink(p)
    per = max(REQ, size // 8 // REQ * REQ)
    st0 = status(root) if pid else None
    t = time.perf_counter()
    parallel(write_file, [(os.path.join(root, f"w{i}"), per, buf) for i in range(8)])
    out["8_writers"] = time.perf_counter() - t
    if st0 is not None:                  # io_lock and the device during the 8 writers
        st1 = status(root)
        held = st1["data_write_seconds"] - st0["data_write_seconds"]
        dev = st1["device_write_seconds"] - st0["device_write_seconds"]
        out["8w_io_lock_share"] = held / out["8_writers"]
        out["8w_device_writes_in_flight"] = dev / out["8_writers"]
    drop_caches(back=2 * size + (256 << 20))
    t = time.perf_counter()
    parallel(read_file, [(os.path.join(root, f"w{i}"),) for i in range(8)])
    out["8_readers"] = time.perf_counter() - t
    for i in range(8):
        os.unlink(os.path.join(root, f"w{i}"))
    d = os.path.join(root, "small")
    t = time.perf_counter()
    os.mkdir(d)
    for i in range(2000):
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            f.write(b"x" * 100)
    for i in range(2000):
        os.stat(os.path.join(d, f"f{i}"))
    shutil.rmtree(d)
    out["small_files_2000"] = time.perf_counter() - t
    out["peak_rss_mib"] = peak_rss(pid) / MiB
    return out


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
           "random_4k_mmap_read": 0.8, "small_files_2000": 0.5}


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
                    res[kind].append(figures(plain, size))
                    c = disk_ceiling(plain, size)
                    if c is not None:
                        res["odirect"].append(c)
                    continue
                subprocess.run(["mkfs.retainzfs", "-q", "--force", "--size", str(img_size),
                                "--zone-size", "64M", img], check=True)
                subprocess.run(["mount.retainzfs", img, mnt]
                               + (["-o", a.options] if a.options else []), check=True)
                try:
                    res[kind].append(figures(mnt, size, daemon_pid(img)))
                finally:
                    subprocess.run(["umount", mnt], check=True)
                    time.sleep(0.5)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = {}
    for k, target in TARGETS.items():
        rz = statistics.median(x[k] for x in res["retainzfs"])
        pl = statistics.median(x[k] for x in res["plain"])
        table[k] = {"retainzfs_s": rz, "plain_s": pl, "ratio": pl / rz if rz else 0.0,
                    "target": target}
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
            print(f"  {k:22s} retainzfs {v['retainzfs_s']:7.2f} s  plain {v['plain_s']:7.2f} s  "
                  f"ratio {v['ratio']:.2f}  (target >= {v['target']}: {ok})")
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
