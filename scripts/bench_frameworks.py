#!/usr/bin/env python3
"""A TorchTitan-like checkpointing job on a nearly full retainzfs mount, per allocator.

For each allocator (default: retainz, zenfs) this formats a fresh emulated zoned image, mounts it
with ``mount.retainzfs -o allocator=NAME`` and then

1. writes *resident anchors* (milestones kept forever, ``retainzfs.runtime.tag_generation(...,
   reclaim=None)``), sized 0.74-2.27 zone capacities like the paper's inputs, until the anchors
   plus the job's peak latest-K window fill ``--fill`` (default 0.85) of the data capacity;
2. runs the job: a ``TorchTitan``-style ``CheckpointManager`` (tests/fw_common.py, transcribed
   from torchtitan/components/checkpoint.py) saving a state dict with PyTorch DCP into
   ``step-N/`` every ``--interval`` steps, ``keep_latest_k=--keep`` with the purge thread
   ``rmtree``-ing old generations beside the next save.  The only hint input is a `.retainz`
   (``preset = "torchtitan"``, ``keep_latest``, ``cadence``): no code talks to the filesystem;
3. reads ``retainzfs status`` before and after the job and reports, for the job alone: saves
   completed (a save that fails with ENOSPC stops the job: ``capacity_stop``), host write
   amplification (data bytes written incl. padding and GC copies / logical bytes saved), GC
   copies, zone resets, p99 save latency and wall time.

    python3 scripts/bench_frameworks.py                  # 200 saves, 256 MiB, 85 % full
    python3 scripts/bench_frameworks.py --saves 300 --fill 0.9 --json out.json --markdown
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from retainzfs.hints import XATTR_STATUS

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))       # fw_common (TorchTitan reproduction)
sys.path.insert(0, os.path.join(HERE, ".."))

MiB = 1 << 20


def sh(*argv, check=True):
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if check and p.returncode:
        raise SystemExit(f"{' '.join(map(str, argv))}: rc={p.returncode}\n{p.stdout}{p.stderr}")
    return p


def status(mnt: str) -> dict:
    return json.loads(os.getxattr(mnt, XATTR_STATUS))


def make_state(save_bytes: int, seed: int):
    """A TorchTitan-like state dict (model + optimizer moments + train state) of ~save_bytes."""
    import torch
    g = torch.Generator().manual_seed(seed)
    n = save_bytes // 4
    p = n // 3
    return {"model": {f"layers.{i}.weight": torch.randn(p // 4, generator=g) for i in range(4)},
            "optimizer": {"exp_avg": torch.randn(p, generator=g),
                          "exp_avg_sq": torch.rand(n - 2 * p, generator=g)},
            "train_state": {"step": torch.tensor(0)}}


def run_one(allocator: str, args, workdir: str) -> dict:
    import torch
    import fw_common as C
    from retainzfs.runtime import tag_generation

    img = os.path.join(workdir, f"{allocator}.zns")
    mnt = os.path.join(workdir, f"mnt-{allocator}")
    os.makedirs(mnt, exist_ok=True)
    sh("mkfs.retainzfs", "--force", "--size", args.size, "--zone-size", args.zone_size,
       "--max-open", args.max_open, "--max-active", args.max_active, img)
    sh("mount.retainzfs", img, mnt, "-o", f"allocator={allocator},log={workdir}/{allocator}.log")
    try:
        st0 = status(mnt)
        cap = st0["zone_capacity"]
        data_cap = (st0["nr_zones"] - st0["meta_zones"]) * cap
        save_bytes = int(args.save_zones * cap)
        window = (args.keep + 1) * (save_bytes + 64 * 1024)           # + .metadata
        anchors_total = int(args.fill * data_cap) - window
        if anchors_total <= 0:
            raise SystemExit("fill too small for the job's own window")
        # 1. resident anchors, written first
        rng = random.Random(args.seed)
        anchors_written, i = 0, 0
        t0 = time.perf_counter()
        while anchors_written < anchors_total:
            size = min(int(rng.uniform(0.74, 2.27) * cap), anchors_total - anchors_written)
            size = max(size, 4096)
            d = tag_generation(os.path.join(mnt, "anchors", f"milestone-{i}"), birth=0, reclaim=None)
            with open(os.path.join(d, "shard0"), "wb") as f:
                f.write(rng.randbytes(size))
            anchors_written += size
            i += 1
        t_prefill = time.perf_counter() - t0
        st1 = status(mnt)
        # 2. the TorchTitan-like job
        folder = os.path.join(mnt, "job", "checkpoint")
        os.makedirs(folder)
        with open(os.path.join(folder, ".retainz"), "w") as f:
            f.write(f'preset = "torchtitan"\nkeep_latest = {args.keep}\ncadence = {args.interval}\n')
        state = make_state(save_bytes, args.seed)
        mgr = C.TitanCheckpointManager(folder, state, interval=args.interval,
                                       keep_latest_k=args.keep)
        completed, stop_err, lat = 0, None, []
        t0 = time.perf_counter()
        for k in range(1, args.saves + 1):
            step = k * args.interval
            state["train_state"]["step"] = torch.tensor(step)
            state["optimizer"]["exp_avg"][k % 1000::1000] += 1.0          # new contents
            s0 = time.perf_counter()
            try:
                mgr.save(step)
            except OSError as e:                                    # ENOSPC: capacity stop
                stop_err = f"step {step}: {e}"
                break
            except Exception as e:                                  # DCP wraps writer errors
                stop_err = f"step {step}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                break
            lat.append(time.perf_counter() - s0)
            completed += 1
        mgr.close()
        t_job = time.perf_counter() - t0
        st2 = status(mnt)
    finally:
        sh("umount", mnt, check=False)
    logical = st2["logical_bytes"] - st1["logical_bytes"]
    pad = st2["pad_bytes"] - st1["pad_bytes"]
    gc = st2["gc_copied_bytes"] - st1["gc_copied_bytes"]
    lat.sort()
    return {
        "allocator": allocator, "saves_requested": args.saves, "saves_completed": completed,
        "capacity_stop": stop_err is not None or st2["capacity_stop"], "stop": stop_err,
        "host_wa": (logical + pad + gc) / logical if logical else float("nan"),
        "gc_copied_bytes": gc, "zone_resets": st2["zone_resets"] - st1["zone_resets"],
        "logical_bytes": logical, "anchor_bytes": anchors_written, "anchors": i,
        "fill": (anchors_written + window) / data_cap, "save_bytes": save_bytes,
        "p99_save_ms": 1000 * lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] if lat else None,
        "job_seconds": t_job, "prefill_seconds": t_prefill,
        "reserved_overhead_zones_end": st2["reserved_overhead_zones"],
        "data_zones": st0["nr_zones"] - st0["meta_zones"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocators", default="retainz,zenfs")
    ap.add_argument("--saves", type=int, default=200)
    ap.add_argument("--fill", type=float, default=0.85, help="anchors + peak window / data capacity")
    ap.add_argument("--size", default="256M")
    ap.add_argument("--zone-size", default="4M")
    ap.add_argument("--max-open", default="2")
    ap.add_argument("--max-active", default="7")
    ap.add_argument("--keep", type=int, default=3, help="keep_latest_k")
    ap.add_argument("--interval", type=int, default=10, help="steps between saves")
    ap.add_argument("--save-zones", type=float, default=1.3, help="checkpoint size in zone capacities")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where images go (default: a temp dir, removed)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    work = args.workdir or tempfile.mkdtemp(prefix="bench_frameworks.")
    os.makedirs(work, exist_ok=True)
    results = []
    try:
        for alloc in args.allocators.split(","):
            r = run_one(alloc.strip(), args, work)
            results.append(r)
            print(f"{r['allocator']:>8}: {r['saves_completed']}/{r['saves_requested']} saves, "
                  f"host WA {r['host_wa']:.4f}, GC copied {r['gc_copied_bytes'] / MiB:.1f} MiB, "
                  f"zone resets {r['zone_resets']}, fill {r['fill']:.3f}, "
                  f"p99 save {r['p99_save_ms'] or 0:.0f} ms, {r['job_seconds']:.0f} s"
                  + (f"  [stopped: {r['stop']}]" if r["stop"] else ""), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if args.markdown:
        print("\n| allocator | saves completed | host WA | GC copied | zone resets | capacity stop | p99 save |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['allocator']} | {r['saves_completed']}/{r['saves_requested']} | "
                  f"{r['host_wa']:.4f} | {r['gc_copied_bytes'] / MiB:.1f} MiB | {r['zone_resets']} | "
                  f"{'yes' if r['capacity_stop'] else 'no'} | {r['p99_save_ms'] or 0:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
