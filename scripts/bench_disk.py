#!/usr/bin/env python3
"""How fast the disk under an image takes O_DIRECT writes, by threads and request size.

The question behind it (issue 10, 8 parallel writers): would writing several zones at once
help?  Only if the file system under the image takes parallel O_DIRECT writes faster than
one stream of them.  Each run writes ``--size`` bytes into a fresh sparse file (or a
preallocated one with ``--prealloc``) with T threads, each writing every T-th chunk, then
fsyncs; prints GB/s per (threads, chunk).

    python3 scripts/bench_disk.py                       # 1 GiB, threads 1/2/4, chunks 1/4 MiB
    python3 scripts/bench_disk.py --dir /var/tmp --prealloc
"""
from __future__ import annotations

import argparse
import os

from benchutil import odirect_pass

MiB = 1 << 20


def run(path: str, size: int, threads: int, chunk: int, prealloc: bool) -> float:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.ftruncate(fd, size)
        if prealloc:
            os.posix_fallocate(fd, 0, size)
        return size / odirect_pass(fd, size, threads, chunk, write=True) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--size", type=int, default=1024, help="MiB per run")
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--chunks", default="1,4", help="request sizes in MiB")
    ap.add_argument("--prealloc", action="store_true")
    a = ap.parse_args()
    path = os.path.join(a.dir, f"bench_disk.{os.getpid()}")
    for c in (int(x) for x in a.chunks.split(",")):
        for t in (int(x) for x in a.threads.split(",")):
            gbs = run(path, a.size * MiB, t, c * MiB, a.prealloc)
            print(f"threads {t}  chunk {c} MiB  {'prealloc' if a.prealloc else 'sparse  '}  "
                  f"{gbs:.2f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
