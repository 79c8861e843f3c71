#!/usr/bin/env python3
"""Cost of the end-to-end data checksums on the data path (format v2).

Measures, on the buffers the write path really hands over (1 MiB FUSE chunks, 4 MiB flushes):
computing the CRC32C pieces of a write (``csums.crcs_of``) and verifying a read
(``ZoneChecksums.bad_pieces``), in MiB/s, and what that costs per GiB beside the time a GiB
takes through the mount at the measured write speed (``--mount-mibs``, default 400)::

    python3 scripts/bench_csum.py
"""
from __future__ import annotations

import argparse
import os
import time

from retainzfs.csums import Run, ZoneChecksums, crcs_of

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--mount-mibs", type=float, default=400.0,
                    help="write/read speed through the mount to compare with (MiB/s)")
    a = ap.parse_args()
    parts = [os.urandom(MiB) for _ in range(4)]          # one 4 MiB flush as FUSE delivers it
    rounds = int(a.gib * 1024 / 4)
    t = time.perf_counter()
    for _ in range(rounds):
        crcs = crcs_of(parts, 4 * MiB)
    w = rounds * 4 / (time.perf_counter() - t)
    data = b"".join(parts)
    run = Run(0, len(data), crcs)
    t = time.perf_counter()
    for _ in range(rounds):
        assert not ZoneChecksums.bad_pieces(run, 0, len(crcs), data, 0)
    r = rounds * 4 / (time.perf_counter() - t)
    for what, speed in (("write (compute)", w), ("read (verify)", r)):
        cost = 1024 / speed
        share = cost / (1024 / a.mount_mibs)
        print(f"{what:16s} {speed:8.0f} MiB/s  = {cost * 1000:6.1f} ms per GiB, "
              f"{share * 100:4.1f} % of a GiB at {a.mount_mibs:.0f} MiB/s through the mount")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
