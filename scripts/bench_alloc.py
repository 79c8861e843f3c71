#!/usr/bin/env python3
"""Placement cost: cached zone summaries vs full-history scans, through the real store path.

For each device (the paper's 64 x 4 MiB namespace and a 4096-zone namespace) this generates the
pressure trace at ``--load`` (default 70%, as the paper's Figure 4a), replays it twice through
``retainzfs.replay`` -- i.e. the very ``Store`` the mount uses -- once with the allocator's cached
per-zone summaries and once with ``fullscan`` (every ``place()`` rebuilds all summaries from the
zones' event histories), and prints the mean allocator cost per checkpoint commit
(``mean_alloc_us``: ``place()`` + summary upkeep, thread CPU time, over the measured window) and
the fullscan/cached ratio measured in this run.  Both runs must make identical placement
decisions: the script checks that write traffic, resets, GC copies and the overhead timeline
agree, and exits 1 otherwise.

    python scripts/bench_alloc.py                    # 64 zones and 4096 zones, retainz
    python scripts/bench_alloc.py --policy zenfs --zones 64
    python scripts/bench_alloc.py --json

Paper (C++, FEMU, 64 zones, 70% load): 5.996 ms (full-history scan) vs 0.270 ms (cached) per
commit.  The 4096-zone device uses 1 MiB zones by default (``--big-zone-size``) so that its
prefill stays a few GiB; zone *count* is what the scan cost depends on.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from retainzfs import workload as wl
from retainzfs.replay import replay

MiB = 1 << 20
SAME = ("host_wa", "total_host_wa", "gc_copied_bytes", "zone_resets", "reserved_overhead_zones",
        "alloc_places", "alloc_new_zones", "alloc_fallbacks", "zone_finishes", "saves_completed")


def bench(zones: int, zone_mib: int, load: float, seed: int, policy: str, saves: int,
          verify: bool) -> dict:
    dev, events = wl.generate(load, seed, nr_zones=zones, zone_size=zone_mib * MiB, saves=saves)
    out = {"zones": zones, "zone_mib": zone_mib, "load": load, "seed": seed, "policy": policy,
           "saves": saves}
    for mode in ("cached", "fullscan"):
        t0 = time.perf_counter()
        r = replay((dev, events), policy, fullscan=(mode == "fullscan"), verify=verify)
        out[mode] = {k: r[k] for k in SAME + ("mean_alloc_us", "alloc_total_us", "wall_s")}
        out[mode]["elapsed_s"] = round(time.perf_counter() - t0, 2)
    c, f = out["cached"], out["fullscan"]
    out["ratio"] = f["mean_alloc_us"] / c["mean_alloc_us"] if c["mean_alloc_us"] else None
    out["identical"] = all(c[k] == f[k] for k in SAME)
    out["differences"] = {k: (c[k], f[k]) for k in SAME if c[k] != f[k]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zones", default="64,4096", help="zone counts (default 64,4096)")
    p.add_argument("--big-zone-size", type=int, default=1, metavar="MiB",
                   help="zone size for devices with more than 64 zones (default 1 MiB)")
    p.add_argument("--load", type=float, default=0.70)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--policy", default="retainz")
    p.add_argument("--saves", type=int, default=250)
    p.add_argument("--verify", action="store_true", help="also read back every byte")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    results = []
    for z in [int(x) for x in a.zones.split(",")]:
        zm = 4 if z <= 64 else a.big_zone_size
        r = bench(z, zm, a.load, a.seed, a.policy, a.saves, a.verify)
        results.append(r)
        if not a.json:
            c, f = r["cached"], r["fullscan"]
            print(f"{z:5d} zones x {zm} MiB, {a.policy}, load {a.load:.0%}, seed {a.seed}: "
                  f"cached {c['mean_alloc_us']:.1f} us/commit, fullscan "
                  f"{f['mean_alloc_us']:.1f} us/commit -> fullscan/cached = {r['ratio']:.1f}x; "
                  f"decisions {'identical' if r['identical'] else 'DIFFER ' + str(r['differences'])}"
                  f" (replays {c['elapsed_s']:.0f} s / {f['elapsed_s']:.0f} s)", flush=True)
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print("paper (64 zones, 70% load): 5.996 ms fullscan vs 0.270 ms cached per commit "
              "(22.2x)")
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
