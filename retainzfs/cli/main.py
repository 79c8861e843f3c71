"""retainzfs: status, fsck, scrub, hints, gen-workload, replay, sweep."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .. import hints as H
from .common import (DAEMON_TIMEOUT, ask_daemon, die, find_mount_of, is_retainzfs_mount,
                     mount_source, status_from_mount, store_on)


def _open_offline(target: str, readonly: bool = True):
    """Open an unmounted target (read-only: no repairs written); one-line errors."""
    from ..device import DeviceError, open_device
    from ..store import StoreOptions
    try:
        dev = open_device(target, readonly=readonly)
        store = store_on(dev, target, lambda sb: StoreOptions(
            allocator=sb.allocator, gc_reserve=sb.gc_reserve, readonly=readonly),
            repair=not readonly)
    except DeviceError as e:
        die(str(e))
    return dev, store


def get_status(path: str, timeout: float = DAEMON_TIMEOUT) -> dict:
    # the mount table first: a stat of a mountpoint waits for its daemon
    if is_retainzfs_mount(path):
        return status_from_mount(path, timeout)
    if os.path.isdir(path):
        die(f"{path} is not a retainzfs mountpoint")
    mnt = find_mount_of(path)
    if mnt:
        return status_from_mount(mnt, timeout)
    if not os.path.exists(path):
        die(f"{path}: no such mountpoint, device or image")
    dev, store = _open_offline(path)
    try:
        return store.status()
    finally:
        dev.close()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_status(st: dict, path: str) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"retainzfs {path}", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value")
    t.add_row("allocator", str(st["allocator"]))
    t.add_row("zones", f"{st['nr_zones']} x {_human(st['zone_size'])} "
                       f"(capacity {_human(st['zone_capacity'])}), {st['meta_zones']} metadata")
    t.add_row("limits", f"max_open={st['max_open'] or '-'} max_active={st['max_active'] or '-'}")
    t.add_row("by condition", ", ".join(f"{k}={v}" for k, v in sorted(st["zones"].items())))
    t.add_row("live", _human(st["live_bytes"]))
    t.add_row("invalid (deleted, not reset)", f"{_human(st['invalid_bytes'])} "
                                              f"({st['invalid_zones']:.2f} zones)")
    t.add_row("tail (unused in open zones)", f"{_human(st['tail_bytes'])} ({st['tail_zones']:.2f} zones)")
    t.add_row("reserved overhead", f"{st['reserved_overhead_zones']:.2f} zones")
    t.add_row("free", _human(st["free_bytes"]))
    t.add_row("zone resets", str(st["zone_resets"]))
    t.add_row("host WA", f"{st['host_wa']:.4f} (GC copied {_human(st['gc_copied_bytes'])})")
    t.add_row("journal", _human(st["journal_bytes"]) + {
        True: "; the last unmount was clean", False: "; the last mount ended in a crash or "
        "power cut (its journal is replayed)", None: ""}[st.get("clean_unmount")])
    t.add_row("p99 commit", f"{st['p99_commit_ms']:.2f} ms over {st['commits']} commits")
    t.add_row("mean placement", f"{st['mean_alloc_us']:.2f} us")
    meta = ("damaged beyond the mirror: " + st["metadata_corrupt"]) if st.get("metadata_corrupt") \
        else (f"{len(st['metadata_problems'])} damaged copies recovered"
              if st.get("metadata_problems") else "both copies good")
    t.add_row("integrity", f"format v{st.get('format_version', '?')}, metadata {meta}, "
                           f"{st.get('checksum_errors', 0)} checksum errors, "
                           f"{st.get('read_errors', 0)} read errors",
              style="red" if st.get("checksum_errors") or st.get("read_errors")
              or st.get("metadata_corrupt") else None)
    d = st.get("daemon")
    if d:
        t.add_row("daemon", f"pid {d['pid']}, RSS {_human(d['rss_bytes'])} (peak "
                            f"{_human(d['peak_rss_bytes'])}, I/O buffers in use "
                            f"{_human(d['io_buffer_live_bytes'])} (peak "
                            f"{_human(d['io_buffer_peak_live_bytes'])}), pool "
                            f"{_human(d['io_buffer_pool_bytes'])}), CPU {d['cpu_seconds']:.1f} s, "
                            f"{d['threads']} threads")
    tun = st.get("tuning") or {}
    if tun.get("log"):
        t.add_row("log", tun["log"])
    if "dirty_bytes" in tun:
        t.add_row("write buffers", f"{_human(st.get('buffered_bytes', 0))} of "
                                   f"{_human(tun['dirty_bytes'])} (dirty_bytes), written back "
                                   f"after {tun['dirty_expire']:g} s (dirty_expire)")
    mem = tun.get("memory")
    if mem and mem.get("pool_bytes") is not None:       # a limit below memory.FULL applies
        from ..memory import TIGHT
        t.add_row("memory limit", f"{_human(mem['limit'])} ({mem['source']}): readahead for "
                                  f"{mem['readahead_files']} files, {mem['fuse_threads']} FUSE "
                                  f"threads, pool {_human(mem['pool_bytes'])}",
                  style="yellow" if mem["limit"] < TIGHT else None)
    if str(tun.get("posix_acl", "")).startswith("off (the kernel"):
        t.add_row("POSIX ACLs", "off: this kernel's FUSE does not enforce them, access by mode "
                                "bits only (setfacl refused)", style="yellow")
    if tun.get("read_ahead_kb_problem"):
        t.add_row("readahead", f"kernel readahead {tun.get('read_ahead_kb')} KiB "
                               f"({tun['read_ahead_kb_problem']}): cold sequential reads at about "
                               "half speed", style="yellow")
    wk = tun.get("workers")
    if wk and (wk["flush"] < wk["flush_wanted"] or wk["readahead"] < wk["readahead_wanted"]):
        t.add_row("threads short", f"{wk['flush']} of {wk['flush_wanted']} flush and "
                                   f"{wk['readahead']} of {wk['readahead_wanted']} readahead "
                                   "threads started (a pids or thread limit)", style="yellow")
    if st.get("capacity_stop"):
        t.add_row("capacity stop", f"yes ({st.get('enospc', 0)} ENOSPC)", style="red")
    if st.get("device_error"):
        t.add_row("device error", f"{st['device_error']}: changes fail with EIO until "
                                  "unmounted and mounted again", style="red")
    if st.get("metadata_full"):
        t.add_row("metadata full", "yes: new names fail with ENOSPC until files are deleted "
                                   "(mkfs --meta-zones)", style="red")
    for p, err in (st.get("policy_errors") or {}).items():
        t.add_row("policy error", f"{p}: {err}", style="red")
    for z, bad in (st.get("bad_zones") or {}).items():
        files = bad.get("files") or []
        t.add_row(f"zone {z} out of service", f"{bad['reason']}; {len(files)} files affected"
                  + (f" ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''})" if files else ""),
                  style="red")
    Console().print(t)


def cmd_status(args) -> int:
    if args.zones or args.png:
        from . import zonemap
        path = args.path
        if is_retainzfs_mount(path):
            is_mount = True
        elif os.path.isdir(path):
            die(f"{path} is not a retainzfs mountpoint")
        else:
            mnt = find_mount_of(path)
            if not mnt and not os.path.exists(path):
                die(f"{path}: no such mountpoint, device or image")
            path, is_mount = (mnt, True) if mnt else (path, False)
        zm = (ask_daemon(path, "the zone map request", lambda: zonemap.fetch(path, True),
                         args.timeout) if is_mount else zonemap.fetch(path, False))
        if args.json:
            print(json.dumps(zm))
        elif args.zones:
            zonemap.render(zm, args.path)
        if args.png:
            zonemap.png(zm, args.png, f"retainzfs zone map: {args.path}")
            if not args.json:
                print(f"wrote {args.png}")
        return 0
    st = get_status(args.path, args.timeout)
    if args.json:
        print(json.dumps(st, indent=2, default=lambda x: "inf" if x == math.inf else str(x)))
    else:
        print_status(st, args.path)
    return 0


def cmd_fsck(args) -> int:
    """One line per inconsistency; non-zero exit for any.  --repair: print the plan, then do
    the safe repairs through a read-write open (the same recovery a mount runs)."""
    mnt = find_mount_of(args.target)
    if mnt:
        die(f"{args.target} is mounted at {mnt}; unmount it before fsck (`retainzfs scrub "
            f"{mnt}` checks the data of a mounted one)")
    if is_retainzfs_mount(args.target):      # the mountpoint given for the device
        die(f"{args.target} is a mounted retainzfs; fsck takes its unmounted device or image "
            f"({mount_source(args.target) or 'see mount'}); `retainzfs scrub {args.target}` "
            f"checks the data of a mounted one")
    dev, store = _open_offline(args.target)
    try:
        problems, repairs = store.fsck.findings()
        files, clean = store.inodes.nreg, store.clean_unmount   # (as `status` counts them)
    finally:
        dev.close()
    result = {"target": args.target, "files": files, "problems": problems,
              "clean_unmount": clean,
              "repairs_planned": repairs if args.repair else [], "repaired": False}
    if not args.json:
        for p in problems:
            print(p)
        if not args.repair:
            for r in repairs:
                print(f"note: a mount or fsck --repair would {r}")
    if args.repair and repairs:
        if not args.json:
            print("repair plan:")
            for r in repairs:
                print(f"  - {r}")
        _repair(args.target)
        dev, store = _open_offline(args.target)
        try:
            problems, _ = store.fsck.findings()
            files = store.inodes.nreg
        finally:
            dev.close()
        result.update(problems_after=problems, repaired=True)
        if not args.json:
            for p in problems:
                print(f"after repair: {p}")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.target}: {files} files, {len(problems)} problems"
              + (" after repair" if result["repaired"] else "")
              + ("; not cleanly unmounted (a mount replays the journal)"
                 if clean is False and not result["repaired"] else ""))
    return 1 if problems else 0


def _repair(target: str) -> None:
    """The safe repairs: a read-write open runs the mount's recovery; then mark damaged files."""
    dev, store = _open_offline(target, readonly=False)
    try:
        for b in store.bad_zones.values():
            if b["valid_upto"] is None:
                continue
            for ino in b["inos"]:       # (by inode: a reported path need not resolve back)
                if ino in store.inodes:     # (not an orphan the recovery freed)
                    store.setxattr(ino, H.XATTR_DAMAGED,
                                   f"data past the write pointer of a zone ({b['reason']})".encode())
        store.close()
    finally:
        dev.close()


HELPER_TEMPLATE = "mount.fuse.retainzfs"


def cmd_install_helper(args) -> int:
    """Install the mount(8) helper so `mount -t fuse.retainzfs` and /etc/fstab work."""
    import importlib.resources
    import sys as _sys
    src = None
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for cand in (os.path.join(here, "mount", HELPER_TEMPLATE),):
        if os.path.exists(cand):
            src = open(cand).read()
    if src is None:
        src = importlib.resources.files("retainzfs").joinpath("data", HELPER_TEMPLATE).read_text()
    dest = os.path.join(args.prefix, HELPER_TEMPLATE)
    try:
        with open(dest + ".tmp", "w") as f:
            f.write(src.replace("@PYTHON@", _sys.executable))
        os.chmod(dest + ".tmp", 0o755)
        os.replace(dest + ".tmp", dest)
    except OSError as e:
        die(f"cannot install {dest}: {e.strerror}")
    print(f"installed {dest} (uses {_sys.executable})")
    return 0


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="retainzfs", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="zone usage, overhead, WA of a mount or an unmounted target")
    s.add_argument("--json", action="store_true")
    s.add_argument("--zones", action="store_true", help="draw one cell per zone (aggregated "
                   "on large devices); with --json: the per-zone rows")
    s.add_argument("--png", metavar="FILE", help="write the zone map as a picture")
    s.add_argument("--timeout", type=_seconds, default=DAEMON_TIMEOUT, metavar="S",
                   help=f"give up on a mount whose daemon does not answer in S seconds "
                        f"(default {DAEMON_TIMEOUT:g}) and say why")
    s.add_argument("path", help="mountpoint, or device/image")
    s.set_defaults(func=cmd_status)
    f = sub.add_parser("fsck", help="check an unmounted filesystem (--repair: the safe fixes)")
    f.add_argument("target")
    f.add_argument("--repair", action="store_true",
                   help="print the plan, then reset empty zones, free orphans, rewrite the "
                        "metadata snapshot, mark damaged files")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_fsck)
    from .scrub import add_scrub_args, run_scrub
    sc = sub.add_parser("scrub", help="verify every live byte against its checksum")
    add_scrub_args(sc)
    sc.set_defaults(func=run_scrub)
    ih = sub.add_parser("install-helper", help="install /sbin/mount.fuse.retainzfs for mount(8)/fstab")
    ih.add_argument("--prefix", default="/sbin")
    ih.set_defaults(func=cmd_install_helper)
    try:
        from .hints_cmd import add_hints_args, run_hints
        h = sub.add_parser("hints", help="per generation: birth, hint and zones")
        add_hints_args(h)
        h.set_defaults(func=run_hints)
    except ImportError:
        pass
    from ..workload import add_gen_workload_args, run_gen_workload
    g = sub.add_parser("gen-workload", help="synthetic pressure trace (the paper's inputs)")
    add_gen_workload_args(g)
    g.set_defaults(func=run_gen_workload)
    try:
        from ..replay import add_replay_args, run_replay
        r = sub.add_parser("replay", help="replay a trace through the store on an emulated device")
        add_replay_args(r)
        r.set_defaults(func=run_replay)
    except ImportError:
        pass
    try:
        from ..sweep import add_sweep_args, run_sweep
        w = sub.add_parser("sweep", help="pressure sweep: loads x seeds x policies, table + figures")
        add_sweep_args(w)
        w.set_defaults(func=run_sweep)
    except ImportError:
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
