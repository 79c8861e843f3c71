"""Shared CLI helpers: size parsing, one-line errors, locating a mount."""
from __future__ import annotations

import errno
import json
import os
import re
import sys
import threading
from fractions import Fraction
from typing import Callable, NoReturn, TypeVar

from ..device import unescape_mount_field
from ..hints import XATTR_STATUS
from ..superblock import MIN_META_ZONES

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4M', '1G', '4096', '1.5G', '4MiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTB]?)(?:i?B)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"bad size {text!r} (use e.g. 4M, 1G, 4096)")
    # exact (a float of 400 digits is infinity: OverflowError and a traceback before)
    return int(Fraction(m.group(1)) * _UNITS[m.group(2).upper()])


# the commands' names when run as ``python -m retainzfs.cli.X`` (as the mount(8) helper does):
# argv[0] is then the module's file, and "mount.py: ..." named no command a user typed
_PROGS = {"mount.py": "mount.retainzfs", "mkfs.py": "mkfs.retainzfs", "main.py": "retainzfs"}


def prog_name() -> str:
    """The command's name for its messages."""
    base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return _PROGS.get(base, base or "retainzfs")


def die(msg: str, code: int = 1) -> "NoReturn":  # noqa: F821
    print(f"{prog_name()}: {msg}", file=sys.stderr)
    raise SystemExit(code)


def retainzfs_mounts() -> list[tuple[str, str, dict[str, str]]]:
    """(source, mount point, options) of each retainzfs mount in ``/proc/mounts``, fields
    unescaped (a space is ``\\040``), bytes that are not UTF-8 kept as surrogates."""
    rows = []
    try:
        with open("/proc/mounts", errors="surrogateescape") as f:
            for line in f:
                src, where, fstype, opts = line.split()[:4]
                if fstype == "fuse.retainzfs":
                    rows.append((unescape_mount_field(src), unescape_mount_field(where),
                                 dict(o.partition("=")[::2] for o in opts.split(","))))
    except (OSError, ValueError):
        pass
    return rows


def find_mount_of(target: str) -> str | None:
    """Mountpoint of a mounted retainzfs whose source is ``target``."""
    real = os.path.realpath(target)
    return next((mnt for src, mnt, _ in retainzfs_mounts()
                 if os.path.realpath(src) == real), None)


def _retainzfs_mountpoints() -> list[str]:
    return [mnt for _, mnt, _ in retainzfs_mounts()]


def access_hint(mnt: str, err: BaseException) -> str:
    """What to add to a refused request to a mount: FUSE lets no one but the user who
    mounted (not even root) into a mount made without ``allow_other``."""
    if getattr(err, "errno", None) not in (errno.EACCES, errno.EPERM):
        return ""
    want = {os.path.abspath(mnt), os.path.realpath(mnt)}
    for _, where, kv in retainzfs_mounts():
        uid = kv.get("user_id")
        if (where in want and "allow_other" not in kv and uid is not None
                and uid != str(os.geteuid())):
            return f" (mounted by uid {uid} without allow_other: only that user may use it)"
    return ""


def is_retainzfs_mount(path: str) -> bool:
    """Whether ``path`` is a retainzfs mountpoint.  Its plain absolute form is tried first:
    resolving symlinks stats the mountpoint, which waits for the daemon (forever when it is
    stopped)."""
    mounts = _retainzfs_mountpoints()
    return os.path.abspath(path) in mounts or os.path.realpath(path) in mounts


T = TypeVar("T")

#: seconds a CLI command waits for a mounted daemon's answer before saying why it has none
DAEMON_TIMEOUT = 10.0


def mount_source(mnt: str) -> str | None:
    """The device or image mounted at ``mnt`` (a retainzfs mountpoint), or None.  As in
    ``is_retainzfs_mount``, the plain absolute form first (resolving stats the mountpoint)."""
    mounts = {where: src for src, where, _ in retainzfs_mounts()}
    src = mounts.get(os.path.abspath(mnt))
    return src if src is not None else mounts.get(os.path.realpath(mnt))


def daemons_holding(path: str) -> list[int]:
    """Live mount daemons (not zombies) holding ``path`` (a device or image) open: a daemon
    chdirs to / and may have been given relative paths, so not by its arguments.  Also what
    the tests and the fault campaign use to find a mount's daemon."""
    want, pids = os.path.realpath(path), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:3]]
            if not any("mount.retainzfs" in a or a == "retainzfs.cli.mount"
                       or a.endswith("retainzfs/cli/mount.py") for a in argv):
                continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            fds = os.listdir(f"/proc/{d}/fd")
        except (OSError, IndexError):
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{d}/fd/{fd}") == want:
                    pids.append(int(d))
                    break
            except OSError:
                continue
    return pids


def daemon_pids(mnt: str) -> list[int]:
    """The mount daemons serving ``mnt`` (no stat of the mount)."""
    src = mount_source(mnt)
    return [] if src is None else daemons_holding(src)


def _daemon_state(mnt: str) -> str:
    """Why a mount may not answer, from the daemons' /proc state."""
    said = []
    for pid in daemon_pids(mnt):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in "Tt":
            said.append(f"its daemon (pid {pid}) is stopped; `kill -CONT {pid}` resumes it")
        else:
            said.append(f"its daemon (pid {pid}, state {state}) is busy or hung")
    return "; ".join(said) or "no daemon process for it was found"


def ask_daemon(mnt: str, what: str, fn: Callable[[], T],
               timeout: float = DAEMON_TIMEOUT) -> T:
    """``fn()`` (a request to the mounted daemon) with a deadline: a stopped or hung daemon
    makes every request on its mount wait in the kernel, and ``retainzfs status`` hung with
    it, telling the operator nothing.  Past ``timeout`` seconds: a one-line error naming the
    daemon and its state.  The waiting thread is left behind; the process exit ends it."""
    out: list = []

    def call() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:       # handed to the caller's thread
            out.append((False, e))

    t = threading.Thread(target=call, name="ask-daemon", daemon=True)
    t.start()
    t.join(timeout)
    if not out:
        die(f"{mnt}: no answer to {what} within {timeout:g} s: {_daemon_state(mnt)}")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def status_from_mount(mnt: str, timeout: float = DAEMON_TIMEOUT) -> dict:
    """The mounted daemon's status JSON (the ``retainz.status`` xattr of its root), with the
    deadline of ``ask_daemon``; a one-line error when the mount cannot answer."""
    import xattr        # here: ``mount.retainzfs`` imports this module and never needs it
    try:
        return json.loads(ask_daemon(mnt, "the status request",
                                     lambda: xattr.getxattr(mnt, XATTR_STATUS.decode()), timeout))
    except (OSError, ValueError) as e:
        die(f"{mnt}: cannot read status from the mount: {getattr(e, 'strerror', None) or e}"
            f"{access_hint(mnt, e)}")


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


def store_on(dev, target: str, options: Callable, repair: bool = False):
    """The store on an opened device (mount, fsck, status, scrub, zonemap), every way it can
    fail one ``DeviceError`` line, the device closed: no superblock, a format this version
    does not know, a journal it cannot replay, a read the device (or the image's host) fails.
    ``options(superblock)`` gives the ``StoreOptions`` (it may raise ``DeviceError`` too)."""
    from .. import _journal as J
    from ..device import DeviceError, unreadable
    from ..store import Store
    from ..superblock import FormatError
    try:
        try:
            sb = J.probe_superblock(dev)
            why = no_superblock_message(dev, target) if sb is None else ""   # (reads it)
        except FormatError as e:
            raise DeviceError(f"{target}: {e}") from None
        except OSError as e:
            raise DeviceError(unreadable(target, e)) from None
        if sb is None:
            raise DeviceError(why)
        opts = options(sb)
        try:
            return Store(dev, opts)
        except (J.JournalError, FormatError) as e:
            raise DeviceError(f"{target}: {'cannot repair: ' if repair else ''}{e}") from None
        except OSError as e:
            raise DeviceError(unreadable(target, e)) from None
    except BaseException:
        dev.close()
        raise


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
