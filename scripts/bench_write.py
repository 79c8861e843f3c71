#!/usr/bin/env python3
"""Write throughput through the mount vs O_DIRECT to a plain file, and the daemon's peak RSS.

Writes SIZE bytes (default 2 GiB) as one checkpoint file with 1 MiB writes through a freshly
mounted retainzfs image, then the same bytes with O_DIRECT into a file beside the image, in one
run, and prints both rates, their ratio and the daemon's VmHWM.  Target (issue 2): ratio >= 0.6,
peak RSS <= 300 MiB.

    python scripts/bench_write.py [--size 2G] [--dir /var/tmp/rzbench] [--json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from retainzfs.cli.common import parse_size  # noqa: E402

CHUNK = 1 << 20
PHASES: list[tuple[float, float]] = []   # (write s, fsync s) per run


def pattern() -> mmap.mmap:
    buf = mmap.mmap(-1, CHUNK)           # page-aligned, usable for O_DIRECT
    buf.write(os.urandom(CHUNK))
    return buf


def write_file(path: str, size: int, direct: bool) -> float:
    buf = pattern()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    t0 = time.perf_counter()
    try:
        for _ in range(size // CHUNK):
            os.write(fd, buf)
        t1 = time.perf_counter()
        os.fsync(fd)
        PHASES.append((t1 - t0, time.perf_counter() - t1))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_mounted(mnt: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mnt):
            return
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        time.sleep(0.05)
    raise SystemExit("mount did not appear")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2G")
    ap.add_argument("--dir", default="/var/tmp/rzbench")
    ap.add_argument("--zone-size", default="64M")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--options", default="", help="mount -o options")
    args = ap.parse_args()
    size = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    img = os.path.join(args.dir, "bench.zns")
    mnt = os.path.join(args.dir, "mnt")
    plain = os.path.join(args.dir, "direct.bin")
    os.makedirs(mnt, exist_ok=True)
    dev_size = max(size * 2, 1 << 30)
    subprocess.run(["mkfs.retainzfs", "-q", "--force", "--size", str(dev_size), "--zone-size",
                    args.zone_size, "--max-open", "14", "--max-active", "14", img], check=True)
    proc = subprocess.Popen(["mount.retainzfs", "-f", img, mnt] + (["-o", args.options] if args.options else []), stderr=subprocess.PIPE)
    try:
        wait_mounted(mnt, proc)
        t_fuse = write_file(os.path.join(mnt, "checkpoint.bin"), size, direct=False)
        rss = vm_hwm(proc.pid)
    finally:
        subprocess.run(["umount", mnt], check=False)
        proc.wait(timeout=60)
    t_direct = write_file(plain, size, direct=True)
    os.unlink(plain)
    os.unlink(img)
    shutil.rmtree(mnt, ignore_errors=True)
    mib = size / (1 << 20)
    res = {"size_bytes": size, "fuse_MiBps": round(mib / t_fuse, 1),
           "odirect_MiBps": round(mib / t_direct, 1), "ratio": round(t_direct / t_fuse, 3),
           "daemon_peak_rss_MiB": round(rss / (1 << 20), 1),
           "fuse_write_s": round(PHASES[0][0], 2), "fuse_fsync_s": round(PHASES[0][1], 2),
           "odirect_write_s": round(PHASES[1][0], 2), "odirect_fsync_s": round(PHASES[1][1], 2)}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"through retainzfs : {res['fuse_MiBps']:8.1f} MiB/s")
        print(f"O_DIRECT file     : {res['odirect_MiBps']:8.1f} MiB/s")
        print(f"ratio             : {res['ratio']:.3f}   (target >= 0.6)")
        print(f"daemon peak RSS   : {res['daemon_peak_rss_MiB']:.1f} MiB (target <= 300)")
        print(f"phases (write/fsync s): mount {res['fuse_write_s']}/{res['fuse_fsync_s']}, "
              f"O_DIRECT {res['odirect_write_s']}/{res['odirect_fsync_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
