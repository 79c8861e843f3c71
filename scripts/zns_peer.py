#!/usr/bin/env python3
"""retainzfs vs btrfs (zoned mode) on the same ZNS namespace, inside one QEMU guest boot.

Not a CI test (it takes minutes). Run by hand::

    python scripts/qemu_zns.py --size 256M --zone-size 4M --max-open 0 --max-active 0 \\
        --timeout 1500 -- python scripts/zns_peer.py [--gen-mib 6] [--keep 3] [--gens 40]

--max-open 0 --max-active 0: btrfs -O zoned on the guest's 6.1 kernel deadlocks after a few
tens of MB with max_active=8 (scripts/qemu_zns.py notes), so the comparison runs with no
open/active limits for both filesystems (retainzfs reads them from the device either way).

For each filesystem, on a freshly reset device (``blkzone reset``):

1. *steady*: the latest-K loop (generation g = ``step-g/model.bin`` of --gen-mib, fsync,
   then ``rm -r step-(g-K)``) for --gens generations on an otherwise empty filesystem.
   Reports device bytes written per logical byte (sectors written from
   /sys/block/<dev>/stat) and zone resets (zones whose write pointer moved back between
   ``blkzone report`` snapshots taken after every generation: a lower bound, since a zone
   reset and refilled between two snapshots is missed).
2. *full*: remkfs, write a ballast file so that ballast + K generations = --fill of the
   filesystem's initial free space (statvfs), then run the same loop for up to --gens
   generations; reports the generation that first fails with ENOSPC (or none).
   --sync-rm adds sync(2) after every rm (btrfs frees deleted extents at transaction commit).

Prints a Markdown table and ``PEER {json}`` as the last line.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import zns_guest_check as G  # noqa: E402

MiB = 1 << 20


def wps(dev: str) -> list[int]:
    """Relative write pointer per zone (EMPTY 0, FULL = capacity) in sectors."""
    return [0 if z[4] == "EMPTY" else z[2] if z[4] == "FULL" else z[3] - z[0]
            for z in G.blkzone(dev)]


class Fs:
    name = "?"

    def __init__(self, dev: str, mnt: str) -> None:
        self.dev, self.mnt, self.pid = dev, mnt, None

    def mkfs(self) -> None: ...
    def mount(self) -> None: ...
    def umount(self) -> None: ...


class Retainz(Fs):
    name = "retainzfs"

    def mkfs(self) -> None:
        code, out, err = G.call(G.cli_mkfs.main, ["--force", "-q", self.dev])
        if code:
            raise RuntimeError(f"mkfs.retainzfs: {err.strip()}")

    def mount(self) -> None:
        self.pid = G.mount(self.dev, self.mnt)

    def umount(self) -> None:
        G.umount(self.mnt, self.pid)
        self.pid = None

    def policy(self, run_dir: str, keep: int) -> None:
        with open(os.path.join(run_dir, ".retainz"), "w") as f:
            f.write(f"keep_latest = {keep}\ncadence = 1\ngeneration = 'step-(\\d+)'\n")


class Btrfs(Fs):
    name = "btrfs -O zoned"

    def mkfs(self) -> None:
        G.run("mkfs.btrfs", "-f", "-q", "-O", "zoned", "-d", "single", "-m", "single", self.dev)

    def mount(self) -> None:
        subprocess.run(["modprobe", "btrfs"], capture_output=True)
        G.run("mount", "-t", "btrfs", self.dev, self.mnt)

    def umount(self) -> None:
        G.run("umount", self.mnt)

    def policy(self, run_dir: str, keep: int) -> None:
        pass


def loop(fs: Fs, gens: int, gen_bytes: int, keep: int, stop_on_enospc: bool,
         sync_rm: bool = False) -> dict:
    dev, mnt = fs.dev, fs.mnt
    run_dir = os.path.join(mnt, "run")
    os.makedirs(run_dir, exist_ok=True)
    fs.policy(run_dir, keep)
    s0 = G.sectors_written(dev)
    prev = wps(dev)
    resets = 0
    enospc_gen = None
    done = 0
    t = time.monotonic()
    for g in range(gens):
        d = os.path.join(run_dir, f"step-{g}")
        try:
            os.mkdir(d)
            G.write_file(os.path.join(d, "model.bin"), G.payload(g, gen_bytes))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                enospc_gen = g
                G.log(f"{fs.name}: ENOSPC at generation {g}")
                if stop_on_enospc:
                    break
            else:
                raise
        else:
            done += 1
        if g - keep >= 0:
            shutil.rmtree(os.path.join(run_dir, f"step-{g - keep}"), ignore_errors=True)
            if sync_rm:
                os.sync()               # commit the rm (btrfs frees extents at commit)
        cur = wps(dev)
        resets += sum(1 for a, b in zip(prev, cur) if b < a)
        prev = cur
    os.sync()
    cur = wps(dev)
    resets += sum(1 for a, b in zip(prev, cur) if b < a)
    dev_bytes = (G.sectors_written(dev) - s0) * 512
    logical = done * gen_bytes
    return {"gens_ok": done, "logical_MiB": round(logical / MiB, 1),
            "device_MiB": round(dev_bytes / MiB, 1),
            "device_per_logical": round(dev_bytes / logical, 3) if logical else None,
            "zone_resets": resets, "enospc_gen": enospc_gen,
            "seconds": round(time.monotonic() - t, 1)}


def measure(fs: Fs, args) -> dict:
    gen_bytes = int(args.gen_mib * MiB) // 4096 * 4096
    out = {}
    G.run("blkzone", "reset", fs.dev)
    fs.mkfs()
    fs.mount()
    try:
        out["steady"] = loop(fs, args.gens, gen_bytes, args.keep, stop_on_enospc=False,
                              sync_rm=args.sync_rm)
    finally:
        fs.umount()
    G.log(f"{fs.name} steady: {out['steady']}")
    G.run("blkzone", "reset", fs.dev)
    fs.mkfs()
    fs.mount()
    try:
        sv = os.statvfs(fs.mnt)
        free = sv.f_bavail * sv.f_frsize
        ballast = int(free * args.fill) - args.keep * gen_bytes
        ballast = max(ballast // MiB * MiB, 0)
        G.log(f"{fs.name}: free {free >> 20} MiB, ballast {ballast >> 20} MiB "
              f"(+{args.keep} x {gen_bytes >> 20} MiB = {args.fill:.0%})")
        os.makedirs(os.path.join(fs.mnt, "static"), exist_ok=True)
        fd = os.open(os.path.join(fs.mnt, "static", "ballast.bin"), os.O_WRONLY | os.O_CREAT)
        blk = G.payload(99999, MiB)
        written = 0
        try:
            while written < ballast:
                written += os.write(fd, blk)
            os.fsync(fd)
        except OSError as e:
            G.log(f"{fs.name}: ballast stopped at {written >> 20} MiB: {e}")
        finally:
            os.close(fd)
        full = loop(fs, args.gens, gen_bytes, args.keep, stop_on_enospc=True,
                    sync_rm=args.sync_rm)
        full.update(free_MiB=free >> 20, ballast_MiB=written >> 20)
        out["full"] = full
    finally:
        fs.umount()
    G.log(f"{fs.name} at {args.fill:.0%}: {out['full']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dev", default=os.environ.get("RETAINZ_ZNS_DEV"))
    ap.add_argument("--mnt", default="/tmp/peer-mnt")
    ap.add_argument("--gens", type=int, default=40)
    ap.add_argument("--gen-mib", type=float, default=6)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--fill", type=float, default=0.88)
    ap.add_argument("--sync-rm", action="store_true",
                    help="sync(2) after each rm (btrfs frees deleted extents only at commit)")
    ap.add_argument("--only", choices=["retainzfs", "btrfs"], action="append")
    args = ap.parse_args()
    os.makedirs(args.mnt, exist_ok=True)
    res: dict = {"dev": args.dev, "args": vars(args)}
    for cls in (Retainz, Btrfs):
        key = "retainzfs" if cls is Retainz else "btrfs"
        if args.only and key not in args.only:
            continue
        try:
            res[key] = measure(cls(args.dev, args.mnt), args)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            res[key] = {"error": str(e)}
    print(f"\n| filesystem | device B / logical B | zone resets | steady MiB/s "
          f"| ENOSPC generation at {args.fill:.0%} fill |")
    print("|---|---|---|---|---|")
    for key in ("retainzfs", "btrfs"):
        r = res.get(key)
        if not r or "error" in r:
            if r:
                print(f"| {key} | error: {r['error']} | | | |")
            continue
        s, f = r["steady"], r["full"]
        mibs = s["logical_MiB"] / s["seconds"] if s["seconds"] else 0
        eg = f["enospc_gen"] if f["enospc_gen"] is not None else f"none in {args.gens}"
        print(f"| {key} | {s['device_per_logical']} | {s['zone_resets']} | {mibs:.1f} | {eg} |")
    print("PEER " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
