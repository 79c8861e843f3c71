"""Pressure sweep and sensitivity matrix: replays in parallel, a Table-I-style table, figures.

``retainzfs sweep [--loads 0.70,0.76,0.80,0.84,0.88,0.90] [--seeds 1,2,3]
[--policies retainz,zenfs,equal-epoch] [--jobs 2] [--out results/sweep] [--quick]
[--no-sensitivity] [--placement-seeds 1,2,3,4,5] [--resume]``

Every run is one :func:`retainzfs.replay.replay` of a synthetic trace from
:func:`retainzfs.workload.generate` (the same code as ``gen-workload`` + ``replay``; readback
and ``Store.check()`` included), identified by a *case* (group, label, trace parameters,
policy, replay options).  Groups:

``pressure``   (Figure 3) loads x seeds x policies, fixed GC reserve.
``admission``  (Figure 4c) 90% load, common admission, retainz vs zenfs.
``placement``  (Table I, top) 84% load, common admission, retainz vs equal-epoch, the
               ablations, isolate and zenfs, on ``--placement-seeds`` (paper: five inputs).
``sensitivity`` (Table I, bottom and Figure 4b) hint grids 4/16 (84%, fixed reserve); span
               constraint under delayed deletion and extended retention (80%) and at 90%
               (common admission); size adaptation on small checkpoints (70%); zone sizes
               4/16/64 MiB (84%); data-active budgets 6/14/30 (84%).

Outputs in ``--out``: ``runs.jsonl`` (one line per run, appended as runs finish; ``--resume``
skips cases already there), ``results.json`` (all runs + aggregates), ``table.md`` (means and
min-max over seeds, with the paper's numbers where it gives them) and ``pressure.{png,pdf}`` /
``mechanisms.{png,pdf}`` (reserved overhead, host WA and p99 against load with min-max bands;
hint precision and common admission).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from multiprocessing import get_context

from . import workload as wl

MiB = 1 << 20
DEFAULT_LOADS = (0.70, 0.76, 0.80, 0.84, 0.88, 0.90)
DEFAULT_POLICIES = ("retainz", "zenfs", "equal-epoch")
METRICS = ("reserved_overhead_zones", "invalid_zones", "tail_zones", "host_wa", "p99_commit_ms",
           "p99_commit_cpu_ms", "mean_alloc_us", "gc_copied_bytes", "saves_completed")

# The paper's numbers (seed 000, section IV), keyed by (group, label, policy, metric).
PAPER = {
    ("pressure", "load 0.84", "retainz", "reserved_overhead_zones"): 3.80,
    ("pressure", "load 0.84", "zenfs", "reserved_overhead_zones"): 6.53,
    ("pressure", "load 0.84", "retainz", "host_wa"): 1.003,
    ("pressure", "load 0.84", "zenfs", "host_wa"): 1.165,
    ("pressure", "load 0.84", "retainz", "p99_commit_ms"): 44.8,
    ("pressure", "load 0.84", "zenfs", "p99_commit_ms"): 85.3,
    ("admission", "load 0.90, common admission", "retainz", "host_wa"): 1.214,
    ("admission", "load 0.90, common admission", "zenfs", "host_wa"): 1.514,
    ("sensitivity", "hint grid 4 (84%)", "retainz", "reserved_overhead_zones"): 4.53,
    ("sensitivity", "hint grid 16 (84%)", "retainz", "reserved_overhead_zones"): 4.99,
}
PAPER_NOTES = {
    ("pressure", "load 0.90"): "paper: RetainZ completes 250 saves; ZenFS-Alloc stops after 40-49",
    ("admission", "load 0.90, common admission"): "paper: both complete; WA 1.214 vs 1.514",
    ("placement", "84%, common admission"): "paper: RetainZ 34.1% below equal-epoch; no-tail "
        "more tail, no-DBT more invalid, no-span lower total, isolate exhausts capacity",
    ("sensitivity", "small checkpoints (70%)"): "paper: size adaptation -11.5% overhead",
    ("sensitivity", "load 0.90, common admission, span"): "paper: span constraint -4.9% WA",
    ("sensitivity", "delayed deletion (80%)"): "paper: no-span lowers total overhead",
    ("sensitivity", "extended retention (80%)"): "paper: no-span lowers total overhead",
    ("sensitivity", "zone 64 MiB (84%)"): "paper (4-64 MiB): RetainZ overhead -43.4%, p99 -38.2% vs ZenFS",
    ("sensitivity", "active 14 (84%)"): "paper: RetainZ near 3.86 zones at 6/14/30",
    ("sensitivity", "active 30 (84%)"): "paper: RetainZ near 3.86 zones; ZenFS fragments more",
}


# --------------------------------------------------------------------------- cases

def _case(group, label, policy, seed, load, *, trace=None, replay=None, order=0) -> dict:
    return {"group": group, "label": label, "policy": policy, "seed": seed, "load": load,
            "trace": dict(trace or {}), "replay": dict(replay or {}), "order": order}


def case_id(c: dict) -> str:
    return json.dumps([c["group"], c["label"], c["policy"], c["seed"], c["load"],
                       sorted(c["trace"].items()), sorted(c["replay"].items())])


def build_cases(loads, seeds, policies, *, placement_seeds, sensitivity: bool,
                saves: int | None = None, quick: bool = False) -> list[dict]:
    tr0 = {"saves": saves} if saves else {}
    cases = []
    for load in loads:
        for pol in policies:
            for s in seeds:
                cases.append(_case("pressure", f"load {load:.2f}", pol, s, load, trace=tr0))
    top = max(loads) if loads else 0.90
    cad = 0.90 if 0.90 in loads or not quick else top
    for pol in ("retainz", "zenfs"):
        for s in seeds:
            cases.append(_case("admission", f"load {cad:.2f}, common admission", pol, s, cad,
                               trace=tr0, replay={"common_admission": True}))
    if not sensitivity:
        return cases
    ca = {"common_admission": True}
    pl = ("retainz", "equal-epoch", "retainz-notail", "retainz-nodbt", "retainz-nospan",
          "retainz-nosize", "isolate", "zenfs")
    for i, pol in enumerate(pl):
        for s in placement_seeds:
            cases.append(_case("placement", "84%, common admission", pol, s, 0.84, trace=tr0,
                               replay=ca, order=i))
    sens = []
    for g in (4, 16):
        sens.append((f"hint grid {g} (84%)", 0.84, {}, {"hint_grid": g}, ("retainz",)))
    sens.append(("delayed deletion (80%)", 0.80, {"delete_delay": 4}, ca,
                 ("retainz", "retainz-nospan", "zenfs")))
    sens.append(("extended retention (80%)", 0.80, {"extended_retention": 1}, ca,
                 ("retainz", "retainz-nospan", "zenfs")))
    sens.append(("load 0.90, common admission, span", 0.90, {}, ca, ("retainz-nospan",)))
    sens.append(("small checkpoints (70%)", 0.70, {"small": True}, ca,
                 ("retainz", "retainz-nosize", "zenfs")))
    for zs in (16, 64):
        sens.append((f"zone {zs} MiB (84%)", 0.84, {"zone_size": zs}, {}, ("retainz", "zenfs")))
    for ma in (14, 30):
        sens.append((f"active {ma} (84%)", 0.84, {"max_active": ma}, {}, ("retainz", "zenfs")))
    for j, (label, load, trace, rep, pols) in enumerate(sens):
        sd = placement_seeds if label.startswith("small") else seeds
        for pol in pols:
            for s in sd:
                t = dict(tr0)
                t.update(trace)
                cases.append(_case("sensitivity", label, pol, s, load, trace=t, replay=rep,
                                   order=j))
    return cases


# --------------------------------------------------------------------------- worker

def _trace_for(case: dict):
    t = dict(case["trace"])
    if "zone_size" in t:
        t["zone_size"] = int(t["zone_size"]) * MiB
    return wl.generate(case["load"], case["seed"], **t)


def run_case(case: dict) -> dict:
    """Generate the case's trace and replay it (runs in a worker process)."""
    from .replay import replay
    t0 = time.perf_counter()
    out = {"case": case, "id": case_id(case)}
    try:
        dev, events = _trace_for(case)
        res = replay((dev, events), case["policy"], **case["replay"])
        out["result"] = res
    except Exception as e:                      # recorded, shown in the table, never hidden
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=5)
    out["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return out


# --------------------------------------------------------------------------- aggregation

def _num(v):
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (group, label, policy): mean/min/max of each metric over seeds."""
    rows: dict[tuple, dict] = {}
    for r in runs:
        c = r["case"]
        key = (c["group"], c["label"], c["policy"])
        row = rows.setdefault(key, {"group": c["group"], "label": c["label"],
                                    "policy": c["policy"], "load": c["load"],
                                    "order": c.get("order", 0), "seeds": [], "errors": [],
                                    "stops": [], "values": {m: [] for m in METRICS},
                                    "values_stopped": {m: [] for m in METRICS},
                                    "saves_requested": None})
        row["seeds"].append(c["seed"])
        if "error" in r:
            row["errors"].append(f"seed {c['seed']}: {r['error']}")
            continue
        res = r["result"]
        row["saves_requested"] = res.get("saves_requested")
        vals = row["values"]
        if res.get("capacity_stop"):
            row["stops"].append(res.get("stop_after_saves"))
            vals = row["values_stopped"]
        for m in METRICS:
            v = _num(res.get(m))
            if v is not None:
                vals[m].append(v)
    out = []
    for row in rows.values():
        stats = {}
        done, stopped = row.pop("values"), row.pop("values_stopped")
        # metrics of runs that stopped cover only the saves before the stop (and a tiny
        # window): summarize completed runs, fall back to stopped ones only if none completed
        row["stats_from"] = "completed" if any(done.values()) else "stopped"
        for m, vs in (done if row["stats_from"] == "completed" else stopped).items():
            if vs:
                stats[m] = {"mean": sum(vs) / len(vs), "min": min(vs), "max": max(vs),
                            "n": len(vs)}
        row["stats"] = stats
        out.append(row)
    gorder = {"pressure": 0, "admission": 1, "placement": 2, "sensitivity": 3}
    porder = {p: i for i, p in enumerate(("retainz", "zenfs", "equal-epoch", "retainz-notail",
                                          "retainz-nodbt", "retainz-nospan", "retainz-nosize",
                                          "isolate"))}
    out.sort(key=lambda r: (gorder.get(r["group"], 9), r["load"] if r["group"] == "pressure"
                            else 0, r["order"], r["label"],
                            r["order"] if r["group"] == "placement" else
                            porder.get(r["policy"], 99), r["policy"]))
    return out


def _fmt(st: dict | None, m: str) -> str:
    if not st or m not in st:
        return "-"
    s = st[m]
    if m in ("reserved_overhead_zones", "invalid_zones", "tail_zones"):
        f = "{:.2f}"
    elif m == "host_wa":
        f = "{:.3f}"
    elif m in ("p99_commit_ms", "p99_commit_cpu_ms"):
        f = "{:.1f}"
    elif m == "mean_alloc_us":
        f = "{:.0f}"
    else:
        f = "{:.0f}"
    txt = f.format(s["mean"])
    if s["n"] > 1 and s["max"] != s["min"]:
        txt += f" [{f.format(s['min'])}–{f.format(s['max'])}]"
    return txt


def _paper(row: dict, m: str) -> str:
    v = PAPER.get((row["group"], row["label"], row["policy"], m))
    return "" if v is None else f" ({v:g})"


def _completion(row: dict) -> str:
    n = len(row["seeds"]) - len(row["errors"])
    req = row["saves_requested"]
    if row["errors"]:
        return f"ERROR x{len(row['errors'])}"
    if not row["stops"]:
        return f"all {req}" if req else "all"
    stops = sorted(x for x in row["stops"] if x is not None)
    return f"stop {len(row['stops'])}/{n} (after {', '.join(map(str, stops))})"


def relative_lines(rows: list[dict]) -> list[str]:
    """Headline comparisons the paper states as ratios."""
    idx = {(r["group"], r["label"], r["policy"]): r for r in rows}

    def mean(g, l, p, m="reserved_overhead_zones"):
        r = idx.get((g, l, p))
        return r["stats"][m]["mean"] if r and m in r["stats"] else None
    out = []

    def rel(name, a, b, paper):
        if a is None or b is None or b == 0:
            return
        d = (b - a) / b * 100.0
        word = "lower" if d >= 0 else "HIGHER"
        out.append(f"- {name}: {a:.3f} vs {b:.3f} -> {abs(d):.1f}% {word} (paper: {paper})")
    for load in ("load 0.84",):
        a, b = mean("pressure", load, "retainz"), mean("pressure", load, "zenfs")
        if a is not None and b:
            out.append(f"- reserved overhead at 84%, retainz / zenfs = {a / b:.2f} "
                       f"(required <= 0.65; paper 3.80 / 6.53 = 0.58)")
        rel("retainz vs zenfs p99 (wall) at 84%",
            mean("pressure", load, "retainz", "p99_commit_ms"),
            mean("pressure", load, "zenfs", "p99_commit_ms"), "44.8 vs 85.3 ms, 47.5% lower")
        rel("retainz vs zenfs p99 (CPU) at 84%",
            mean("pressure", load, "retainz", "p99_commit_cpu_ms"),
            mean("pressure", load, "zenfs", "p99_commit_cpu_ms"), "44.8 vs 85.3 ms, 47.5% lower")
    pl = "84%, common admission"
    rel("retainz vs equal-epoch reserved overhead (84%, CA)", mean("placement", pl, "retainz"),
        mean("placement", pl, "equal-epoch"), "34.1% lower")
    rel("retainz vs retainz-nosize on small checkpoints (70%)",
        mean("sensitivity", "small checkpoints (70%)", "retainz"),
        mean("sensitivity", "small checkpoints (70%)", "retainz-nosize"), "11.5% lower")
    lab = "load 0.90, common admission"
    a = mean("admission", lab, "retainz", "host_wa")
    b = mean("sensitivity", lab + ", span", "retainz-nospan", "host_wa")
    rel("host WA with vs without span constraint (90%, CA)", a, b, "4.9% lower")
    for zs in ("zone 16 MiB (84%)", "zone 64 MiB (84%)"):
        rel(f"retainz vs zenfs reserved overhead, {zs}", mean("sensitivity", zs, "retainz"),
            mean("sensitivity", zs, "zenfs"), "43.4% lower (4-64 MiB)")
        rel(f"retainz vs zenfs p99 (wall), {zs}",
            mean("sensitivity", zs, "retainz", "p99_commit_ms"),
            mean("sensitivity", zs, "zenfs", "p99_commit_ms"), "38.2% lower (4-64 MiB)")
        rel(f"retainz vs zenfs p99 (CPU), {zs}",
            mean("sensitivity", zs, "retainz", "p99_commit_cpu_ms"),
            mean("sensitivity", zs, "zenfs", "p99_commit_cpu_ms"), "38.2% lower (4-64 MiB)")
    return out


def render_table(rows: list[dict], meta: dict) -> str:
    head = ("| group | case | policy | reserved overhead (zones) | invalid | tail | host WA | "
            "p99 ms (wall) | p99 ms (CPU) | alloc µs/commit | saves |")
    sep = "|" + "---|" * 11
    lines = ["# retainzfs sweep", "",
             f"{meta.get('runs', 0)} runs, {meta.get('elapsed_s', 0):.0f} s, "
             f"{meta.get('jobs', 1)} jobs; mean [min–max] over seeds; the paper's value in "
             "parentheses where it states one.  Metrics summarize the runs that completed every "
             "save; † = every seed hit a capacity stop, metrics cover only the saves before it. "
             "Load = peak live bytes after each save's deletions / data capacity (the paper's "
             "definition).", "", head, sep]
    for r in rows:
        st = r["stats"]
        lines.append(
            f"| {r['group']} | {r['label']} | {r['policy']} | "
            f"{_fmt(st, 'reserved_overhead_zones')}{_paper(r, 'reserved_overhead_zones')} | "
            f"{_fmt(st, 'invalid_zones')} | {_fmt(st, 'tail_zones')} | "
            f"{_fmt(st, 'host_wa')}{_paper(r, 'host_wa')} | "
            f"{_fmt(st, 'p99_commit_ms')}{_paper(r, 'p99_commit_ms')} | "
            f"{_fmt(st, 'p99_commit_cpu_ms')} | {_fmt(st, 'mean_alloc_us')} | "
            f"{_completion(r)} |")
        if r["stats_from"] == "stopped" and r["stops"]:
            lines[-1] = lines[-1].replace(f"| {r['policy']} |", f"| {r['policy']} † |", 1)
    notes = [f"- {k[0]} / {k[1]}: {v}" for k, v in PAPER_NOTES.items()
             if any((r["group"], r["label"]) == k for r in rows)]
    rel = relative_lines(rows)
    if rel:
        lines += ["", "## Headline ratios", ""] + rel
    if notes:
        lines += ["", "## What the paper reports for these rows", ""] + notes
    errs = [f"- {r['group']} / {r['label']} / {r['policy']}: {e}" for r in rows for e in r["errors"]]
    if errs:
        lines += ["", "## Errors", ""] + errs
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- figures

def _series(rows, group, policy, metric, label_prefix="load "):
    pts = []
    for r in rows:
        if r["group"] != group or r["policy"] != policy or metric not in r["stats"]:
            continue
        s = r["stats"][metric]
        if r["stats_from"] == "stopped":
            pts.append((r["load"], None, None, None, True))
            continue
        pts.append((r["load"], s["mean"], s["min"], s["max"], bool(r["stops"])))
    return sorted(pts)


def make_figures(rows: list[dict], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    policies = []
    for r in rows:
        if r["group"] == "pressure" and r["policy"] not in policies:
            policies.append(r["policy"])
    colors = {"retainz": "tab:blue", "zenfs": "tab:red", "equal-epoch": "tab:green"}
    porder = ("retainz", "zenfs", "equal-epoch")
    policies.sort(key=lambda p: (porder.index(p) if p in porder else 9, p))
    metrics = (("reserved_overhead_zones", "reserved overhead (zones)"),
               ("host_wa", "host write amplification"),
               ("p99_commit_cpu_ms", "p99 save latency (ms, thread CPU)"),
               ("p99_commit_ms", "p99 save latency (ms, wall clock)"))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (m, title) in zip(axes, metrics):
        stops = []
        for p in policies:
            pts = _series(rows, "pressure", p, m)
            if not pts:
                continue
            ok = [x for x in pts if x[1] is not None]
            xs = [x[0] * 100 for x in ok]
            line, = ax.plot(xs, [x[1] for x in ok], marker="o", label=p, color=colors.get(p))
            c = line.get_color()
            ax.fill_between(xs, [x[2] for x in ok], [x[3] for x in ok], alpha=0.2, color=c)
            part = [(x[0] * 100, x[1]) for x in ok if x[4]]          # some seeds stopped
            if part:
                ax.scatter([a for a, _ in part], [b for _, b in part], marker="x", s=90,
                           color="k", zorder=6, linewidths=1.5)
            stops += [(x[0] * 100, c) for x in pts if x[1] is None]   # every seed stopped
        y0 = ax.get_ylim()[1]
        for xv, c in stops:
            ax.scatter([xv], [y0], marker="v", s=90, color=c, zorder=6, clip_on=False)
            ax.annotate("stop", (xv, y0), textcoords="offset points", xytext=(-4, -15),
                        ha="right", fontsize=7, color=c)
        ax.set_xlabel("peak live load (% of data capacity)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="center left")
    fig.suptitle("Pressure sweep, fixed GC reserve: mean and min–max band over the seeds that "
                 "completed; x = some seeds hit a capacity stop; ▼ = every seed did", fontsize=9)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        p = os.path.join(out, f"pressure.{ext}")
        fig.savefig(p, dpi=150)
        paths.append(p)
    plt.close(fig)

    # mechanisms: hint precision, common admission, placement table bars
    idx = {(r["group"], r["label"], r["policy"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    ax = axes[0]
    grid = [("exact", idx.get(("pressure", "load 0.84", "retainz"))),
            ("G=4", idx.get(("sensitivity", "hint grid 4 (84%)", "retainz"))),
            ("G=16", idx.get(("sensitivity", "hint grid 16 (84%)", "retainz")))]
    grid = [(n, r) for n, r in grid if r and "reserved_overhead_zones" in r["stats"]]
    if grid:
        _bars(ax, [n for n, _ in grid], [r["stats"]["reserved_overhead_zones"] for _, r in grid],
              "tab:blue")
        ax.plot(range(3)[:len(grid)], [3.80, 4.53, 4.99][:len(grid)], "k*", label="paper")
        ax.legend(fontsize=8)
    ax.set_title("hint precision at 84% (reserved overhead, zones)", fontsize=10)
    ax = axes[1]
    ad = [(p, idx.get(("admission", r["label"], p))) for r in rows if r["group"] == "admission"
          for p in [r["policy"]]]
    ad = [(p, r) for p, r in ad if r and "host_wa" in r["stats"]]
    if ad:
        _bars(ax, [p for p, _ in ad], [r["stats"]["host_wa"] for _, r in ad], "tab:orange")
        paper = {"retainz": 1.214, "zenfs": 1.514}
        ax.plot(range(len(ad)), [paper.get(p, float("nan")) for p, _ in ad], "k*", label="paper")
        ax.legend(fontsize=8)
    ax.set_title("common admission at 90%: host WA", fontsize=10)
    ax = axes[2]
    pl = [r for r in rows if r["group"] == "placement" and "reserved_overhead_zones" in r["stats"]]
    if pl:
        names = [r["policy"].replace("retainz-", "-") for r in pl]
        inv = [r["stats"].get("invalid_zones", {}).get("mean", 0) for r in pl]
        tail = [r["stats"].get("tail_zones", {}).get("mean", 0) for r in pl]
        ax.bar(range(len(pl)), inv, label="invalid", color="tab:purple")
        ax.bar(range(len(pl)), tail, bottom=inv, label="tail", color="tab:gray")
        ax.set_xticks(range(len(pl)), names, rotation=45, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    ax.set_title("placement at 84%, common admission (zones)", fontsize=10)
    for a in axes:
        a.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    for ext in ("png", "pdf"):
        p = os.path.join(out, f"mechanisms.{ext}")
        fig.savefig(p, dpi=150)
        paths.append(p)
    plt.close(fig)
    return paths


def _bars(ax, names, stats, color):
    means = [s["mean"] for s in stats]
    lo = [s["mean"] - s["min"] for s in stats]
    hi = [s["max"] - s["mean"] for s in stats]
    ax.bar(range(len(names)), means, yerr=[lo, hi], capsize=4, color=color, alpha=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=8)


# --------------------------------------------------------------------------- driver

def _floats(s: str) -> list[float]:
    """``--loads``: peak loads in (0, 1), comma-separated (argparse type: a bad one is a
    usage error, not a traceback)."""
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {s!r}")
    if not out or any(not 0 < x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"loads must be in (0, 1): {s!r}")
    return out


def _positive(s: str) -> int:
    """A count of at least 1 (argparse type)."""
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1: {s!r}")
    return n


def _ints(s: str) -> list[int]:
    """``--seeds``, ``--placement-seeds``: comma-separated integers (argparse type)."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}")
    if not out:
        raise argparse.ArgumentTypeError("an empty list")
    return out


def sweep(cases: list[dict], out: str, jobs: int = 2, resume: bool = False,
          progress: bool = True) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    runs_path = os.path.join(out, "runs.jsonl")
    done: dict[str, dict] = {}
    if resume and os.path.exists(runs_path):
        with open(runs_path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "error" not in r:
                    done[r["id"]] = r
    elif os.path.exists(runs_path):
        os.unlink(runs_path)
    want = {case_id(c) for c in cases}
    runs = [r for k, r in done.items() if k in want]
    todo = [c for c in cases if case_id(c) not in done]
    # the expensive (big-zone) cases first, so the pool does not end on a long tail
    todo.sort(key=lambda c: -c["trace"].get("zone_size", 4))
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(todo), desc="sweep", unit="run", file=sys.stderr,
                       dynamic_ncols=True)
        except ImportError:
            bar = None
    with open(runs_path, "a") as fh:
        if jobs <= 1:
            it = map(run_case, todo)
            pool = None
        else:
            pool = get_context("spawn").Pool(jobs, maxtasksperchild=8)
            it = pool.imap_unordered(run_case, todo)
        try:
            for r in it:
                runs.append(r)
                fh.write(json.dumps(r, default=str) + "\n")
                fh.flush()
                if bar is not None:
                    c = r["case"]
                    bar.set_postfix_str(f"{c['label']} {c['policy']} s{c['seed']}"
                                        + (" ERROR" if "error" in r else ""))
                    bar.update(1)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
            if bar is not None:
                bar.close()
    return runs


def write_outputs(runs: list[dict], out: str, meta: dict) -> dict:
    rows = aggregate(runs)
    meta = dict(meta, runs=len(runs))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "runs": runs}, f, indent=1, default=str)
    table = render_table(rows, meta)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    figs = make_figures(rows, out)
    return {"rows": rows, "table": table, "figures": figs}


def add_sweep_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--loads", type=_floats, default=None, help="comma-separated peak loads "
                   f"(default {','.join(map(str, DEFAULT_LOADS))})")
    p.add_argument("--seeds", type=_ints, default=None,
                   help="comma-separated seeds (default 1,2,3)")
    p.add_argument("--policies", default=None,
                   help=f"pressure-sweep policies (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--placement-seeds", type=_ints, default=None,
                   help="seeds of the placement table and small-checkpoint rows "
                        "(default 1,2,3,4,5: the paper's five matched inputs)")
    p.add_argument("--jobs", type=_positive, default=2, help="parallel replays (default 2)")
    p.add_argument("--out", default="results/sweep", help="output directory")
    p.add_argument("--saves", type=_positive, default=None,
                   help="saves per trace (default 250; --quick: 40)")
    p.add_argument("--no-sensitivity", action="store_true",
                   help="only the pressure sweep and the common-admission control")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: loads 0.84,0.90, seed 1, retainz+zenfs, 40 saves, "
                        "one placement/sensitivity seed")
    p.add_argument("--resume", action="store_true",
                   help="keep finished runs of an earlier sweep in --out, run the rest")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="no replays: rebuild table.md, results.json and the figures from "
                        "--out/runs.jsonl")
    return p


def run_sweep(args: argparse.Namespace) -> int:
    if args.report_only:
        runs_path = os.path.join(args.out, "runs.jsonl")
        try:
            with open(runs_path) as f:
                runs = [json.loads(line) for line in f if line.strip()]
        except OSError as e:
            print(f"retainzfs sweep: {runs_path}: {e.strerror}", file=sys.stderr)
            return 1
        meta = {"jobs": args.jobs, "report_only": True, "elapsed_s": 0.0}
        try:
            with open(os.path.join(args.out, "results.json")) as f:
                meta = json.load(f).get("meta", meta)
        except (OSError, ValueError):
            pass
        out = write_outputs(runs, args.out, meta)
        print(out["table"])
        print("figures: " + ", ".join(out["figures"]), file=sys.stderr)
        return 0
    if args.quick:
        loads = args.loads or [0.84, 0.90]
        seeds = args.seeds or [1]
        policies = args.policies.split(",") if args.policies else ["retainz", "zenfs"]
        pseeds = args.placement_seeds or [1]
        saves = args.saves or 40
    else:
        loads = args.loads or list(DEFAULT_LOADS)
        seeds = args.seeds or [1, 2, 3]
        policies = args.policies.split(",") if args.policies else list(DEFAULT_POLICIES)
        pseeds = args.placement_seeds or [1, 2, 3, 4, 5]
        saves = args.saves
    from ._alloc import POLICIES
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        print(f"retainzfs sweep: unknown policy {', '.join(bad)}", file=sys.stderr)
        return 1
    sens = not args.no_sensitivity
    if args.quick:
        cases = build_cases(loads, seeds, policies, placement_seeds=pseeds, sensitivity=False,
                            saves=saves, quick=True)
        if sens:   # one cheap row of each kind, so the table and figures have every section
            tr = {"saves": saves}
            cases += [_case("placement", "84%, common admission", p, pseeds[0], 0.84, trace=tr,
                            replay={"common_admission": True}, order=i)
                      for i, p in enumerate(("retainz", "equal-epoch"))]
            cases.append(_case("sensitivity", "hint grid 16 (84%)", "retainz", seeds[0], 0.84,
                               trace=tr, replay={"hint_grid": 16}))
    else:
        cases = build_cases(loads, seeds, policies, placement_seeds=pseeds, sensitivity=sens,
                            saves=saves)
    try:                                     # a bad --out is one line, before any replay
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        print(f"retainzfs sweep: {args.out}: {e.strerror}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    print(f"retainzfs sweep: {len(cases)} runs, {args.jobs} jobs -> {args.out}", file=sys.stderr)
    runs = sweep(cases, args.out, jobs=args.jobs, resume=args.resume,
                 progress=not args.no_progress)
    meta = {"loads": loads, "seeds": seeds, "policies": policies, "placement_seeds": pseeds,
            "saves": saves or 250, "jobs": args.jobs, "quick": bool(args.quick),
            "elapsed_s": time.perf_counter() - t0,
            "command": "retainzfs sweep " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])}
    out = write_outputs(runs, args.out, meta)
    print(out["table"])
    print("figures: " + ", ".join(out["figures"]), file=sys.stderr)
    errors = sum(1 for r in runs if "error" in r)
    if errors:
        print(f"retainzfs sweep: {errors} runs failed (see {args.out}/table.md)", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="retainzfs sweep", description=__doc__.split("\n")[0])
    return run_sweep(add_sweep_args(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
