"""Shared CLI helpers: size parsing, one-line errors, locating a mount."""
from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from ..device import unescape_mount_field
from ..superblock import MIN_META_ZONES

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4M', '1G', '4096', '1.5G', '4MiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTB]?)(?:i?B)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"bad size {text!r} (use e.g. 4M, 1G, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def die(msg: str, code: int = 1) -> "NoReturn":  # noqa: F821
    print(f"{os.path.basename(sys.argv[0]) or 'retainzfs'}: {msg}", file=sys.stderr)
    raise SystemExit(code)


def find_mount_of(target: str) -> str | None:
    """Mountpoint of a mounted retainzfs whose source is ``target`` (from /proc/mounts)."""
    real = os.path.realpath(target)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                src, mnt, fstype = line.split()[:3]
                if (fstype == "fuse.retainzfs"
                        and os.path.realpath(unescape_mount_field(src)) == real):
                    return unescape_mount_field(mnt)
    except OSError:
        pass
    return None


def is_retainzfs_mount(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            return any(unescape_mount_field(line.split()[1]) == real
                       and line.split()[2] == "fuse.retainzfs" for line in f)
    except OSError:
        return False


def no_superblock_message(dev, target: str, meta_zones: int = MIN_META_ZONES) -> str:
    """Why ``probe_superblock`` found nothing: never formatted, or formatted and corrupt.

    Suggesting mkfs for a filesystem whose superblock record fails its checksum would invite
    the user to destroy recoverable data, so the two cases get different messages.
    """
    marker = b'"magic":"retainzfs"'
    for z in range(min(max(meta_zones, 32), dev.nr_zones)):
        zone = dev.zone(z)
        try:
            head = dev.read(z, 0, min(zone.wp, 1 << 16)) if zone.wp else b""
        except OSError:
            continue
        if marker in head:
            return (f"{target}: retainzfs metadata is corrupt (no superblock record passes its "
                    f"checksum); not touching it (mkfs.retainzfs --force would erase it)")
    used = [z for z in range(dev.nr_zones)
            if dev.zone(z).wp or dev.zone(z).cond.name not in ("EMPTY",)]
    if used:
        # Something is on the device: never advise the command that would erase it.
        meta_used = [z for z in used if z < meta_zones]
        return (f"{target}: no retainzfs superblock found (the first zones are "
                f"{'unreadable' if meta_used else 'empty'}), but {len(used)} of "
                f"{dev.nr_zones} zones hold data; not touching it")
    return f"{target}: not a retainzfs filesystem (blank device; run mkfs.retainzfs first)"


def mount_root(path: str) -> str | None:
    """The retainzfs mountpoint at or above ``path``, or None."""
    p = os.path.realpath(path)
    while True:
        if is_retainzfs_mount(p):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
