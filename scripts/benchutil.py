"""Helpers the benchmarks share: cold caches and the mount daemon's pid, CPU and peak RSS."""
from __future__ import annotations

import argparse
import os


def drop_caches() -> None:
    """Write back, then drop the page cache, so the next read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def daemon_pid(img: str) -> int | None:
    """The mount.retainzfs daemon holding ``img`` open, if any."""
    want = os.path.realpath(img)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            if not any(b"mount.retainzfs" in a for a in cmd[:3]):
                continue
            if any(os.path.realpath(f"/proc/{d}/fd/{fd}") == want
                   for fd in os.listdir(f"/proc/{d}/fd")):
                return int(d)
        except OSError:
            continue
    return None


def peak_rss(pid: int | None) -> int:
    """VmHWM of ``pid`` in bytes (0 when unknown)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes: file ``--size``, ``--rounds`` (each
    alternating retainzfs and the plain file), ``--workdir`` (on the disk to compare), ``--json``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-o", dest="options", default="",
                    help="mount options for the retainzfs side (mount.retainzfs -o), to compare "
                         "settings: e.g. image_io=buffered")
    return ap
