#!/usr/bin/env python3
"""Where a small file's time goes in the daemon's Python, without FUSE (issue 10).

Drives the handlers the mount runs (``fs.Operations`` over a ``Store`` on an emulated image) through
what ``bench_io.py``'s small-file figure asks of them: per file a missed lookup, create, a
100-byte write, flush and release; then a lookup and getattr of each, a readdir, an unlink of
each.  Prints the microseconds per file (CPU, best of ``--rounds``) and, under cProfile, the
Python function calls per file (deterministic: compare two commits by it on a noisy machine)
and the functions that cost most::

    python3 scripts/profile_small_files.py                  # 2,000 files, 5 rounds
    python3 scripts/profile_small_files.py --top 30 --sort cumtime

``--mount TREE ...`` compares source trees (checkouts with their extensions built; ``.``
for this one) through real mounts instead: for each round and tree, in alternating order, a
fresh image is mounted by a daemon running that tree's code, the same sequence runs through
it as files (open/write/close, stat, ``rmtree``) once to warm up and once measured; it prints
the median wall time and daemon CPU per file of each tree::

    git worktree add /tmp/old 1ce0158 && (cd /tmp/old && python3 setup.py build_ext --inplace)
    python3 scripts/profile_small_files.py --mount /tmp/old . --rounds 8
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retainzfs.device import create_image  # noqa: E402
from retainzfs.fs import Operations  # noqa: E402
from retainzfs.store import Store, StoreOptions  # noqa: E402

CTX = (0, 0, 0o022)
FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def one_round(ops: Operations, n: int) -> None:
    d = ops.mkdir(1, b"d", 0o755, CTX).ino
    for i in range(n):
        name = b"p%d" % i
        if ops.lookup(d, name) is not None:
            raise SystemExit(f"{name!r} exists before its create")
        fh = ops.create(d, name, 0o644, FLAGS, CTX)[0]
        ops.write(fh, 0, b"x" * 100)
        ops.flush(fh)
        ops.release(fh)
    for i in range(n):
        ops.getattr(ops.lookup(d, b"p%d" % i).ino)
    list(ops.readdir(ops.opendir(d), 0))
    for i in range(n):
        ops.unlink(d, b"p%d" % i)
    ops.rmdir(1, b"d")


def through_a_mount(path: str, n: int) -> None:
    """The same sequence as files, as ``bench_io.py``'s small-file figure makes them."""
    os.mkdir(path)
    for i in range(n):
        with open(os.path.join(path, f"p{i}"), "wb") as f:
            f.write(b"x" * 100)
    for i in range(n):
        os.stat(os.path.join(path, f"p{i}"))
    shutil.rmtree(path)


def compare_trees(trees: list[str], n: int, rounds: int, workdir: str | None) -> dict:
    """{tree: {"wall_us": [...], "cpu_us": [...]}} per file, one entry per round."""
    from benchutil import cpu_seconds, daemon_pid
    out: dict = {t: {"wall_us": [], "cpu_us": []} for t in trees}
    with tempfile.TemporaryDirectory(prefix="profile_small.", dir=workdir) as work:
        img, mnt = os.path.join(work, "img"), os.path.join(work, "mnt")
        os.mkdir(mnt)
        for r in range(rounds):
            for tree in (trees if r % 2 == 0 else trees[::-1]):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                subprocess.run(["mkfs.retainzfs", "-q", "--force", "--size", "4G", img],
                               check=True, env=env)
                subprocess.run(["mount.retainzfs", img, mnt], check=True, env=env)
                try:
                    pid = daemon_pid(img)
                    through_a_mount(os.path.join(mnt, "d"), n)
                    c, t = cpu_seconds(pid), time.perf_counter()
                    through_a_mount(os.path.join(mnt, "d"), n)
                    out[tree]["wall_us"].append((time.perf_counter() - t) * 1e6 / n)
                    out[tree]["cpu_us"].append((cpu_seconds(pid) - c) * 1e6 / n)
                finally:
                    subprocess.run(["umount", mnt], check=True)
                    time.sleep(0.5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=15, help="functions to list (0: none)")
    ap.add_argument("--sort", default="tottime", help="pstats order: tottime, cumtime, ncalls")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mount", nargs="+", metavar="TREE",
                    help="compare these source trees through real mounts (root)")
    a = ap.parse_args()
    if a.mount:
        res = compare_trees(a.mount, a.files, a.rounds, a.workdir)
        if a.json:
            print(json.dumps(res))
            return 0
        print(f"{a.files} small files through a mount, {a.rounds} alternating rounds "
              f"(median per file; each round's in brackets):")
        for tree, v in res.items():
            print(f"  {tree}: wall {statistics.median(v['wall_us']):.0f} us, daemon CPU "
                  f"{statistics.median(v['cpu_us']):.0f} us  "
                  f"[{' '.join(f'{w:.0f}' for w in v['wall_us'])}]")
        return 0
    with tempfile.TemporaryDirectory(prefix="profile_small.", dir=a.workdir) as work:
        dev = create_image(os.path.join(work, "img"), 1 << 30, 4 << 20)
        Store.format(dev)
        store = Store(dev, StoreOptions())
        ops = Operations(store)
        ops.init(True)
        try:
            one_round(ops, a.files)                       # warm: imports, first zones
            cpu = []
            for _ in range(a.rounds):
                t = time.process_time()
                one_round(ops, a.files)
                cpu.append((time.process_time() - t) * 1e6 / a.files)
            prof = cProfile.Profile()
            prof.enable()
            one_round(ops, a.files)
            prof.disable()
        finally:
            store.close()
            dev.close()
    st = pstats.Stats(prof)
    calls = st.total_calls / a.files
    if a.json:
        print(json.dumps({"files": a.files, "cpu_us_per_file": min(cpu),
                          "python_calls_per_file": calls}))
        return 0
    print(f"{a.files} small files through fs.Operations in process: "
          f"{min(cpu):.0f} us CPU per file (best of {a.rounds}; median "
          f"{sorted(cpu)[len(cpu) // 2]:.0f}), {calls:.0f} Python calls per file")
    if a.top:
        st.sort_stats(a.sort).print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
