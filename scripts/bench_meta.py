#!/usr/bin/env python3
"""Metadata scaling benchmark (issue 9 targets): many files, journal cost, remount time, RSS.

Two runs in one invocation by default:

* ``mount``: a real mount of a 1 GiB image with 4 MiB zones; N files (default 60,000) created in
  100 directories with ``open(O_CREAT)`` + ``close`` (and every 10th written with 100 bytes),
  then ``stat`` of all, then a remount: ENOSPC count, journal bytes per file, remount seconds,
  daemon peak RSS.
* ``store``: the same ``Store`` the mount uses, driven directly (no FUSE) on a ZN540-like sparse
  image (904 zones of 2 GiB, capacity 1077 MiB, max active 14) with M files (default 1,000,000),
  then a reopen: the same figures at a million files.

Every figure is printed beside its target, as a ratio (value / target; <= 1 meets it)::

    python3 scripts/bench_meta.py                           # both (~6 min on 2 cores)
    python3 scripts/bench_meta.py --only mount --files 60000
    python3 scripts/bench_meta.py --only store --store-files 200000 --json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from retainzfs.hints import XATTR_STATUS
from benchutil import daemon_pid, peak_rss

MiB = 1 << 20
TARGET_JOURNAL_PER_FILE = 1024          # bytes, amortized
TARGET_REMOUNT_PER_100K = 1.0           # seconds
TARGET_RSS = 300 * MiB


def _status(mnt: str) -> dict:
    return json.loads(os.getxattr(mnt, XATTR_STATUS))


def bench_mount(n: int, work: str) -> dict:
    img, mnt = os.path.join(work, "meta.zns"), os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    subprocess.run(["mkfs.retainzfs", "-q", "--size", "1G", "--zone-size", "4M", "--max-open", "8",
                    "--max-active", "8", img], check=True)
    log = os.path.join(work, "daemon.log")
    subprocess.run(["mount.retainzfs", img, mnt, "-o", f"log={log}"], check=True)
    pid = daemon_pid(img)
    j0 = _status(mnt)["journal_bytes"]
    enospc = 0
    t0 = time.perf_counter()
    for d in range(100):
        os.mkdir(os.path.join(mnt, f"d{d:03d}"))
    created = 0
    for i in range(n):
        p = os.path.join(mnt, f"d{i % 100:03d}", f"file-{i:07d}")
        try:
            fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
            if i % 10 == 0:
                os.write(fd, b"x" * 100)
            os.close(fd)
            created += 1
        except OSError as e:
            if e.errno == 28:
                enospc += 1
                if enospc > 10:
                    break
            else:
                raise
    create_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(created):
        os.stat(os.path.join(mnt, f"d{i % 100:03d}", f"file-{i:07d}"))
    stat_s = time.perf_counter() - t0
    os.sync()
    time.sleep(1.5)
    st = _status(mnt)
    rss = peak_rss(pid) if pid else 0
    subprocess.run(["umount", mnt], check=True)
    while pid and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    t0 = time.perf_counter()
    subprocess.run(["mount.retainzfs", img, mnt, "-o", f"log={log}"], check=True)
    remount_s = time.perf_counter() - t0
    files = _status(mnt)["files"]
    subprocess.run(["umount", mnt], check=True)
    jb = st["journal_bytes"] - j0
    return {"mode": "mount", "image": "1 GiB, 4 MiB zones", "files_requested": n,
            "files_created": created, "files_after_remount": files, "enospc": enospc,
            "create_per_s": created / create_s, "stat_per_s": created / stat_s if stat_s else 0,
            "journal_bytes": jb, "journal_per_file": jb / max(created, 1),
            "journal_rolls": st["journal_rolls"], "remount_s": remount_s,
            "remount_per_100k_s": remount_s * 100_000 / max(created, 1), "daemon_peak_rss": rss}


def _store_create(n: int, img: str) -> dict:
    """Phase 1, in its own process (a daemon that creates ``n`` files): its peak RSS."""
    import resource
    from retainzfs.device import create_image
    from retainzfs.store import Store
    dev = create_image(img, 904 * 2048 * MiB, 2048 * MiB, 1077 * MiB, max_open=14,
                       max_active=14)
    Store.format(dev)
    s = Store(dev)
    j0 = s.journal.bytes_written
    t0 = time.perf_counter()
    dirs = [s.mkdir(1, f"d{d:04d}".encode(), 0o755).ino for d in range(1000)]
    enospc = 0
    created = 0
    for i in range(n):
        try:
            ino = s.create(dirs[i % 1000], f"file-{i:07d}".encode(), 0o644).ino
            s.open(ino)
            if i % 10 == 0:
                s.write(ino, 0, b"x" * 100)
            s.commit(ino, durable=False)
            s.release(ino)
            created += 1
        except OSError as e:
            if e.errno != 28:
                raise
            enospc += 1
            if enospc > 10:
                break
        if i % 20000 == 19999:
            s.sync()
    s.sync()
    create_s = time.perf_counter() - t0
    jb = s.journal.bytes_written - j0
    rolls = s.journal.rolls
    s.close()
    dev.close()
    return {"created": created, "enospc": enospc, "create_s": create_s, "journal_bytes": jb,
            "rolls": rolls, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _store_remount(img: str) -> dict:
    """Phase 2, in a fresh process (the daemon of the next mount): open time, peak RSS."""
    import resource
    from retainzfs.device import open_device
    from retainzfs.store import Store
    t0 = time.perf_counter()
    dev = open_device(img)
    s = Store(dev)
    reopen_s = time.perf_counter() - t0
    files = sum(1 for i in s.inodes.values() if i.is_reg)
    problems = s.check()
    s.close()
    dev.close()
    return {"remount_s": reopen_s, "files": files, "problems": len(problems),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def bench_store(n: int, work: str) -> dict:
    """Each phase runs in a process of its own, as each mount's daemon does: the peak RSS
    of one is not hidden by (or added to) the other's."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    img = os.path.join(work, "zn540.zns")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as ex:
        c = ex.submit(_store_create, n, img).result()
    with ProcessPoolExecutor(1, mp_context=ctx) as ex:
        m = ex.submit(_store_remount, img).result()
    created = c["created"]
    return {"mode": "store", "image": "904 x 2 GiB zones, capacity 1077 MiB, max active 14",
            "files_requested": n, "files_created": created, "files_after_remount": m["files"],
            "enospc": c["enospc"], "create_per_s": created / c["create_s"],
            "journal_bytes": c["journal_bytes"],
            "journal_per_file": c["journal_bytes"] / max(created, 1),
            "journal_rolls": c["rolls"], "remount_s": m["remount_s"],
            "remount_per_100k_s": m["remount_s"] * 100_000 / max(created, 1),
            "create_peak_rss": c["peak_rss"], "remount_peak_rss": m["peak_rss"],
            "process_peak_rss": max(c["peak_rss"], m["peak_rss"]),
            "check_problems": m["problems"]}


def report(r: dict) -> None:
    rss = r.get("daemon_peak_rss") or r.get("process_peak_rss") or 0
    print(f"[{r['mode']}] {r['image']}: {r['files_created']:,} of {r['files_requested']:,} files "
          f"created ({r['create_per_s']:,.0f}/s), {r['files_after_remount']:,} after remount, "
          f"ENOSPC {r['enospc']}")
    print(f"  journal   {r['journal_per_file']:8.0f} B/file (both copies)  target "
          f"{TARGET_JOURNAL_PER_FILE} B   ratio {r['journal_per_file'] / TARGET_JOURNAL_PER_FILE:.2f}"
          f"   ({r['journal_bytes'] / MiB:.1f} MiB, {r['journal_rolls']} rolls)")
    print(f"  remount   {r['remount_per_100k_s']:8.2f} s/100k files     target "
          f"{TARGET_REMOUNT_PER_100K:.1f} s   ratio {r['remount_per_100k_s'] / TARGET_REMOUNT_PER_100K:.2f}"
          f"   ({r['remount_s']:.2f} s)")
    print(f"  peak RSS  {rss / MiB:8.0f} MiB                target {TARGET_RSS // MiB} MiB "
          f"ratio {rss / TARGET_RSS:.2f}" + (
              f"   (creating: {r['create_peak_rss'] / MiB:.0f} MiB, remount in a fresh "
              f"process: {r['remount_peak_rss'] / MiB:.0f} MiB)" if "create_peak_rss" in r
              else ""))
    if r.get("check_problems"):
        print(f"  fsck      {r['check_problems']} problems after remount")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("mount", "store"))
    ap.add_argument("--files", type=int, default=60_000, help="files through the mount")
    ap.add_argument("--store-files", type=int, default=1_000_000, help="files via the store")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="bench_meta.", dir="/var/tmp")
    out = []
    try:
        if a.only in (None, "mount"):
            out.append(bench_mount(a.files, work))
            report(out[-1])
        if a.only in (None, "store"):
            out.append(bench_store(a.store_files, work))
            report(out[-1])
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
