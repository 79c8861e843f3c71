"""mount.retainzfs TARGET MOUNTPOINT [-o opt,...] [-f]: serve a retainzfs filesystem over FUSE.

Without -f the command forks a daemon and returns once the mount is visible (or prints the
daemon's one-line error and exits non-zero), like mount(8) helpers do.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import subprocess
import sys
import time

from . import daemonlog, supervise
from .common import die, find_mount_of, is_retainzfs_mount, status_from_mount, store_on

#: mount(8)/fstab options that mean nothing to us and are dropped silently
IGNORED = {"defaults", "auto", "noauto", "user", "nouser", "users", "nofail", "_netdev",
           # the daemon keeps no access times (the kernel never sends a read it serves from
           # its cache, so none could be kept faithfully): every mount behaves as noatime
           "atime", "relatime", "strictatime", "nodiratime", "diratime", "owner", "group",
           "comment",
           # FUSE's own permission checks: always on here (fs.py asks for them), and fstab
           # lines and xfstests' FUSE config pass it, so it is accepted rather than refused
           "default_permissions"}
#: handed to libfuse: its own, and the kernel's mount flags (libfuse mounts nosuid,nodev unless
#: told ``suid``/``dev``; ``noexec`` was ignored here before stop 37, a hardening fstab line
#: silently lost)
FUSE_PASSTHROUGH = {"allow_other", "allow_root", "suid", "nosuid", "dev", "nodev", "exec",
                    "noexec", "sync", "async", "dirsync", "noatime"}


def _number(key: str, val: str, kind=float, lo: float | None = None, lo_open: bool = False,
            hi: float | None = None):
    """One mount option's numeric value, or ValueError naming the option and what it accepts."""
    import math
    what = "an integer" if kind is int else "a number"
    def show(b) -> str:                 # 1048576, not 1.04858e+06
        return str(b) if isinstance(b, int) else f"{b:g}"
    bound = ""
    if lo is not None:
        bound = f" {'>' if lo_open else '>='} {show(lo)}"
    if hi is not None:
        bound += f"{' and' if bound else ''} <= {show(hi)}"
    try:
        x = kind(val)
    except (TypeError, ValueError):
        raise ValueError(f"mount option {key}={val!r}: expected {what}{bound}") from None
    if (isinstance(x, float) and not math.isfinite(x)) or (lo is not None and (
            x < lo or (lo_open and x == lo))) or (hi is not None and x > hi):
        raise ValueError(f"mount option {key}={val!r}: expected {what}{bound}")
    return x


def _flag(key: str, val: str) -> bool:
    v = val.lower()
    if v in ("", "1", "yes", "true", "on"):
        return True
    if v in ("0", "no", "false", "off"):
        return False
    raise ValueError(f"mount option {key}={val!r}: expected on/off")


def parse_options(opts: list[str]) -> tuple[dict, list[str]]:
    """-o values -> (retainzfs options, extra FUSE options); every value is checked here, in the
    parent, so a bad option is a one-line error naming it and no daemon is started."""
    from .._alloc import POLICIES
    ours: dict = {}
    fuse: list[str] = []
    for group in opts:
        for o in filter(None, group.split(",")):
            key, eq, val = o.partition("=")
            if key in IGNORED or key.startswith("x-") or key.startswith("comment="):
                continue
            if key in FUSE_PASSTHROUGH:
                fuse.append(key)
            elif key in ("ro", "rw"):
                ours["readonly"] = key == "ro"
            elif key == "allocator":
                if val not in POLICIES:
                    raise ValueError(f"mount option allocator={val!r}: expected one of "
                                     f"{', '.join(POLICIES)}")
                ours["allocator"] = val
            elif key in ("lambda", "lam"):
                ours["lam"] = _number(key, val, float, 0.0)
            elif key == "hint_grid":
                ours["hint_grid"] = _number(key, val, int, 0)
            elif key == "gc_reserve":
                ours["gc_reserve"] = _number(key, val, int, 0, hi=1 << 20)
            elif key == "common_admission":
                ours["common_admission"] = _flag(key, val)
            elif key == "log":
                if not val:
                    raise ValueError("mount option log=: expected a file path")
                ours["log"] = val
            elif key == "debug":
                ours["debug"] = _flag(key, val)
            elif key in ("acl", "noacl"):             # as ext4's: POSIX ACLs on (default) / off
                if eq:
                    raise ValueError(f"mount option {key} takes no value")
                ours["acl"] = key == "acl"
            elif key == "metrics":
                from ..metrics import parse_listen
                try:
                    parse_listen(val)
                except ValueError:
                    raise ValueError(f"mount option metrics={val!r}: expected PORT or HOST:PORT "
                                     f"(default host 127.0.0.1)") from None
                ours["metrics"] = val
            elif key == "image_io":
                if val not in ("direct", "buffered", "auto"):
                    raise ValueError(f"mount option image_io={val!r}: expected direct, buffered "
                                     f"or auto")
                ours["image_io"] = val
            elif key == "readahead_kb":
                ours["readahead_kb"] = _number(key, val, int, 0, hi=1 << 20)
            elif key == "sync_interval":
                # 0 would busy-loop the periodic flush; more than an hour is surely a typo
                ours["sync_interval"] = _number(key, val, float, 0.01, hi=3600)
            elif key in ("flush_bytes", "dirty_bytes"):
                from .common import parse_size
                lo, hi, span = ((4096, 1 << 30, "4K..1G") if key == "flush_bytes"
                                else (1 << 20, 1 << 40, "1M..1T"))
                try:
                    n = parse_size(val)
                except ValueError:
                    raise ValueError(f"mount option {key}={val!r}: expected a size such "
                                     f"as 4M") from None
                if not lo <= n <= hi:
                    raise ValueError(f"mount option {key}={val!r}: expected {span}")
                ours[key] = n
            elif key == "dirty_expire":
                ours["dirty_expire"] = _number(key, val, float, 0.0, hi=3600)
            else:
                raise ValueError(f"unknown mount option {o!r}")
            if key in ("allocator", "lambda", "lam", "hint_grid", "gc_reserve", "sync_interval",
                       "flush_bytes", "dirty_bytes", "dirty_expire", "image_io") and not eq:
                raise ValueError(f"mount option {key} needs a value ({key}=...)")
    return ours, fuse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mount.retainzfs", description=__doc__)
    p.add_argument("target", help="zoned block device or emulated zoned image")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="allocator=NAME,lambda=X,hint_grid=G,gc_reserve=N,common_admission,"
                        "log=PATH,debug,allow_other,sync_interval=S,dirty_bytes=SIZE,"
                        "dirty_expire=S,image_io=auto|direct|buffered,noacl")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    # flags mount(8) passes to helpers
    p.add_argument("-n", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-s", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", action="store_true", help=argparse.SUPPRESS)
    return p


def _is_stale(mnt: str) -> bool:
    """A retainzfs mount whose daemon died: statfs always reaches the daemon (stat may be
    answered from the kernel's attribute cache for up to a second), so ENOTCONN there means
    nobody serves the mount any more."""
    if not is_retainzfs_mount(mnt):
        return False
    try:
        os.statvfs(mnt)
        return False
    except OSError as e:
        return e.errno == errno.ENOTCONN


def _clear_stale(mnt: str) -> None:
    subprocess.run(["fusermount3", "-u", "-z", mnt], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"mount.retainzfs: cleared stale mount at {mnt}", file=sys.stderr)


def _check_mountpoint(mnt: str) -> None:
    try:
        st = os.stat(mnt)
        if _is_stale(mnt):
            _clear_stale(mnt)
            st = os.stat(mnt)
    except OSError as e:
        if e.errno == errno.ENOTCONN:     # a daemon died (kill -9): clear the stale mount
            _clear_stale(mnt)
            try:
                st = os.stat(mnt)
            except OSError as e2:
                die(f"mountpoint {mnt}: {e2.strerror}")
        elif e.errno == errno.ENOENT:
            die(f"mountpoint {mnt} does not exist")
        else:
            die(f"mountpoint {mnt}: {e.strerror}")
    import stat as _stat
    if not _stat.S_ISDIR(st.st_mode):
        die(f"mountpoint {mnt} is not a directory")
    if os.path.ismount(mnt):
        what = "a retainzfs filesystem" if is_retainzfs_mount(mnt) else "another filesystem"
        die(f"mountpoint {mnt} is in use ({what} is mounted there)")


def _open_store(target: str, ours: dict):
    """Open device + store; retries briefly while a previous daemon is still exiting."""
    from .._alloc import POLICIES
    from ..device import DeviceError, open_device
    from ..store import StoreOptions

    if not os.path.exists(target):
        raise DeviceError(f"{target}: no such device or image")
    deadline = time.monotonic() + 10
    while True:
        try:
            dev = open_device(target, {"direct": True, "buffered": False}.get(
                ours.get("image_io", "auto")), readonly=ours.get("readonly", False))
            break
        except DeviceError as e:
            if "in use" in str(e) and time.monotonic() < deadline and not supervise.STOP:
                time.sleep(0.2)
                continue
            raise

    def options(sb) -> StoreOptions:
        alloc = ours.get("allocator", sb.allocator)
        if alloc not in POLICIES:
            raise DeviceError(f"unknown allocator {alloc!r}; one of {', '.join(POLICIES)}")
        opts = StoreOptions(allocator=alloc, lam=ours.get("lam", 1.0),
                            hint_grid=ours.get("hint_grid", 0),
                            gc_reserve=ours.get("gc_reserve", sb.gc_reserve),
                            common_admission=ours.get("common_admission", False),
                            readonly=ours.get("readonly", False))
        for key in ("flush_bytes", "dirty_bytes", "dirty_expire"):
            if key in ours:
                setattr(opts, key, ours[key])
        return opts
    store = store_on(dev, target, options)
    return dev, store


def _set_readahead(mnt: str, kb: int) -> tuple[int | None, str | None]:
    """Set the kernel readahead of our FUSE mount (its bdi); returns (the value now in force,
    why it is not ``kb``, or None).

    Why: FUSE mounts get 128 KiB of readahead, which halves a cold sequential read of a
    checkpoint; 4 MiB matches the zones' write size.  Only root may raise it: a daemon run by
    a user keeps the kernel's value, and says so (``status``).  Found via
    /proc/self/mountinfo (a stat of the mountpoint from the daemon itself would wait for the
    daemon)."""
    from ..device import mountinfo
    real = os.path.normpath(mnt)          # no realpath here: an lstat of it would wait for us
    for dev, point, _ in mountinfo():
        if point == real:
            path = f"/sys/class/bdi/{dev}/read_ahead_kb"
            why = None
            if kb:
                try:
                    with open(path, "w") as g:
                        g.write(str(kb))
                except OSError as e:
                    why = f"cannot set {path} to {kb}: {e.strerror}"
            try:
                with open(path) as g:
                    now = int(g.read())
            except (OSError, ValueError) as e:
                return None, why or f"cannot read {path}: {e}"
            if why is None and kb and now != kb:
                why = f"{path} is {now}, not {kb}"
            return now, why
    return None, "the mount is not in /proc/self/mountinfo"


def _user_may_not(fuse_extra: list[str], conf: str = "/etc/fuse.conf") -> str | None:
    """Why a user's mount (not root's) cannot take these FUSE options, or None.  fusermount3
    refuses ``allow_other`` / ``allow_root`` to a user unless ``conf`` says
    ``user_allow_other``; its message went to the daemon's log, the caller saw only
    "fuse_session_mount() failed"."""
    wanted = [o for o in fuse_extra if o in ("allow_other", "allow_root")]
    if not wanted or os.geteuid() == 0:
        return None
    try:
        with open(conf, errors="replace") as f:
            if any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f):
                return None
    except OSError:
        pass
    return (f"-o {wanted[0]}: a mount by a user (not root) may use it only when {conf} has a "
            f"line 'user_allow_other' (fusermount3 refuses it otherwise)")


def _tune_malloc():
    """Keep request buffers on the heap instead of a fresh mmap per FUSE write.

    The FUSE binding allocates a new bytes object for every write request below half a
    megabyte (larger ones go into ``_iobuf``'s pooled write arenas); above glibc's default
    128 KiB mmap threshold each one would cost an mmap, a page fault per page and an munmap,
    which was a third of the per-request time.  Heap reuse is bounded by the write buffers.

    And two malloc arenas, not glibc's eight per core: each of the ~40 threads (FUSE workers,
    flushers, readahead) that frees a request buffer otherwise keeps it in an arena of its
    own: after bench_io's 8 writers then 8 readers the daemon held 229-237 MiB, with two
    207-210 MiB.  (Aligned I/O buffers do not come from the heap at all: ``_iobuf``.)

    Returns (None, None) without glibc, else the periodic tick's hook and ``trim_at``, which
    lowers the trim threshold under a memory budget.  The hook (``fs.serve(idle=...)``) gives
    the heap's free pages
    back (``malloc_trim``, and ``_iobuf.pool_trim`` for the pooled aligned buffers) once a
    burst of writes is over: the buffers' heap is only reused,
    never returned, so a daemon that had written 2,000 files at once stayed at 450 MiB while
    idle; trimmed it holds what it uses."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
        libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
        libc.mallopt(M_ARENA_MAX, 2)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None, None
    from .. import _iobuf
    seen = {"tick": 0, "trim": 0}

    def idle(store) -> None:
        """After the periodic sync: trim when a tick wrote nothing, nothing is buffered, and
        something was written since the last trim (not during a save: the heap would be
        faulted in again; not every second: a trim walks the whole heap)."""
        written = store.stats["payload_bytes"]
        quiet = written == seen["tick"]
        seen["tick"] = written
        if quiet and written != seen["trim"] and store.files.buffered == 0:
            seen["trim"] = written
            trim(0)
            _iobuf.pool_trim()          # the write requests' aligned buffers, too

    def trim_at(n: int) -> None:
        """Free heap above ``n`` bytes goes back at once (a memory budget: ``serve``)."""
        libc.mallopt(M_TRIM_THRESHOLD, n)
    return idle, trim_at


def _memory_budget(store, ours: dict):
    """``memory.detect``: the buffers sized to the memory limit the daemon runs under (its
    cgroup's, the host's) less what it holds with the metadata loaded, applied to the open
    store (write buffers unless ``dirty_bytes`` was given, readahead, the aligned-buffer
    pool; the FUSE threads by ``serve``) and said in the log."""
    from .. import _iobuf
    from .. import memory
    b = memory.detect(base=memory.resident() + memory.GROWTH)
    log = logging.getLogger("retainzfs")
    if "dirty_bytes" not in ours:
        store.opts.dirty_bytes = b.dirty_bytes
    store.reads.ra.resize(b.readahead_files)
    if b.pool_bytes is not None:
        _iobuf.set_pool_limit(b.pool_bytes)
        log.info("memory limit %d MiB (%s): dirty_bytes %d MiB%s, readahead for %d files, "
                 "%d FUSE threads, %d MiB of pooled buffers", b.limit >> 20, b.source,
                 ours.get("dirty_bytes", b.dirty_bytes) >> 20,
                 " (mount option)" if "dirty_bytes" in ours else "", b.readahead_files,
                 b.fuse_threads, b.pool_bytes >> 20)
    if b.limit is not None and b.limit < memory.TIGHT:
        log.warning("memory limit %d MiB (%s) is below %d MiB: under load the kernel may "
                    "kill the daemon (the mount then fails every call)", b.limit >> 20,
                    b.source, memory.TIGHT >> 20)
    return b


def serve(target: str, mnt: str, ours: dict, fuse_extra: list[str], notify_fd: int | None) -> int:
    """Open, mount, serve until unmounted; report readiness (or the error) on notify_fd."""
    from .. import fs
    from ..device import DeviceError

    def notify(msg: str) -> None:
        if notify_fd is not None:
            try:
                os.write(notify_fd, os.fsencode(msg) + b"\n")     # (paths: any bytes)
            except OSError as e:            # (EPIPE: the caller was killed; we go on)
                if not supervise.STOP:      # (else it stopped listening: it interrupted us)
                    log.warning("the mount.retainzfs that started this daemon is gone (%s)",
                                e.strerror or e)
            os.close(notify_fd)
        if supervise.STOP and msg != "OK":
            log.info("signal %d before mounting: not mounting %s (%s)", supervise.STOP[0], mnt,
                     msg[4:])
        if msg == "OK":
            supervise.sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {mnt}")
        else:
            supervise.sd_notify(f"STATUS={msg[4:]}")

    log = logging.getLogger("retainzfs")
    idle, trim_at = _tune_malloc()
    try:
        dev, store = _open_store(target, ours)
    except DeviceError as e:
        notify(f"ERR {e}")
        if notify_fd is None:
            die(str(e))
        return 1
    except Exception as e:      # unexpected: still one line for the user, details in the log
        log.exception("mount failed")
        notify(f"ERR {target}: {e}")
        if notify_fd is None:
            die(f"{target}: {e}")
        return 1
    budget = _memory_budget(store, ours)
    if trim_at is not None and budget.pool_bytes is not None:
        trim_at(max(8 << 20, budget.pool_bytes))
    store.report.serving = True            # status reports this daemon (memory, CPU)
    if ours.get("metrics"):
        from ..metrics import serve_metrics
        try:
            serve_metrics(store, ours["metrics"])        # a daemon thread: lives with us
        except OSError as e:
            store.close()
            dev.close()
            msg = f"metrics={ours['metrics']}: cannot listen: {e.strerror or e}"
            notify(f"ERR {msg}")
            if notify_fd is None:
                die(msg)
            return 1
    ops = fs.Operations(store, acl=ours.get("acl", True))
    if supervise.STOP:              # asked to stop while opening (a caller's Ctrl-C): no mount
        store.close()
        dev.close()
        notify(f"ERR interrupted (signal {supervise.STOP[0]}) before mounting")
        return 1
    try:
        # noatime always: the daemon keeps no access times (IGNORED), and the mount says so
        # rather than showing the kernel's default, relatime
        extra = list(fuse_extra) + (["ro"] if ours.get("readonly") else []) + ["noatime"]
        fs.mount(ops, mnt, fs.fuse_options(os.path.realpath(target), extra))
    except Exception as e:
        store.close()
        dev.close()
        notify(f"ERR cannot mount on {mnt}: {e}")
        if notify_fd is None:
            die(f"cannot mount on {mnt}: {e}")
        return 1

    def ready() -> None:
        # after INIT: the kernel lowers the bdi's readahead to the INIT reply's max_readahead
        # (128 KiB, libfuse's default) when it processes the reply, undoing an earlier write
        ra, why = _set_readahead(mnt, ours.get("readahead_kb", 4096))
        store.tuning["read_ahead_kb"] = ra
        if why:
            store.tuning["read_ahead_kb_problem"] = why
            log.warning("kernel readahead of the mount left at %s KiB (%s; root may): cold "
                        "sequential reads run at about half speed", ra, why)
        store.tuning["image_io"] = ("direct" if getattr(dev, "direct", True) else "buffered")
        store.tuning["log"] = ours.get("log_path", "standard error")    # (it moves: a user's)
        store.tuning["dirty_bytes"] = store.opts.dirty_bytes
        store.tuning["dirty_expire"] = store.opts.dirty_expire
        store.tuning["memory"] = budget.as_dict()
        store.tuning["workers"] = {                     # (started at INIT: fewer under pids.max)
            "flush": store.flushes.workers.size, "flush_wanted": store.flushes.workers.wanted,
            "readahead": store.reads.ra.pool.size, "readahead_wanted": store.reads.ra.pool.wanted}
        log.info("mounted %s on %s (allocator=%s, read_ahead_kb=%s, image_io=%s%s)", target, mnt,
                 store.opts.allocator, ra, store.tuning["image_io"],
                 "; the last mount was not cleanly unmounted: its journal replayed"
                 if store.clean_unmount is False else "")
        if supervise.STOP:          # a signal came while mounting: libfuse's handler now stops
            log.info("signal %d while mounting: unmounting", supervise.STOP[0])
            os.kill(os.getpid(), signal.SIGTERM)
            return
        notify("OK")

    rc = 0                          # (_fuse.serve puts SIG_DFL back, for libfuse's handlers)
    try:
        code = fs.serve(store, ops, mnt, ours.get("sync_interval", 1.0), ready=ready, idle=idle,
                        max_threads=budget.fuse_threads)
        if code > 0:
            log.info("signal %d: unmounting", code)
        elif code == 0 and is_retainzfs_mount(mnt):
            # an unmount takes the mount away first; an abort leaves it, dead (ENOTCONN)
            log.warning("the kernel's connection was aborted (/sys/fs/fuse/connections/*/abort "
                        "or umount -f): writing what was buffered, then unmounting %s", mnt)
        elif code < 0:
            log.error("FUSE loop failed: %s", os.strerror(-code))
            rc = 1
    except Exception:
        log.exception("FUSE loop failed")
        rc = 1
    finally:
        supervise.sd_notify(f"STOPPING=1\nSTATUS=unmounting {mnt}")
        try:
            fs.unmount()
        except Exception:
            log.exception("unmounting")
        try:
            store.close()
        except Exception:
            log.exception("closing store")
            rc = 1
        dev.close()
        daemonlog.flush_repeats()
        log.info("unmounted %s", mnt)
    return rc


#: what /proc/mounts shows of a FUSE mount besides its flags (a remount is handed them back)
FUSE_KERNEL_OPTS = {"user_id", "group_id", "rootmode", "fd", "max_read", "blksize"}
#: the kernel flags a remount may change (mount(2) MS_REMOUNT; the FUSE kernel takes these)
REMOUNT_FLAGS = {"ro", "rw", "suid", "nosuid", "dev", "nodev", "exec", "noexec", "sync",
                 "async", "dirsync", "noatime"}


def remount(mnt: str, opts: list[str]) -> int:
    """``mount -o remount,ro DIR`` (mount(8) runs the helper for it): the kernel's flags move
    with mount(2)'s MS_REMOUNT, done by ``mount -i`` (no helper); the daemon's own options stay
    what they were (libmount hands the fstab line's back on a remount; they are checked, not
    applied).  A mount made read-only has its device open O_RDONLY: no remount makes it rw.
    Before stop 37 a remount was "unknown mount option 'remount'"."""
    # mount(8) hands the mount's current options over too, the FUSE kernel's among them
    keys = [o for g in opts for o in g.split(",")
            if o and o != "remount" and o.partition("=")[0] not in FUSE_KERNEL_OPTS]
    try:
        parse_options([",".join(keys)])
    except ValueError as e:
        die(str(e))
    if not is_retainzfs_mount(mnt):
        die(f"{mnt} is not a retainzfs mount (nothing to remount)")
    flags = [k for k in keys if k in REMOUNT_FLAGS]
    ro = [k for k in flags if k in ("ro", "rw")]
    if ro and ro[-1] == "rw":
        if status_from_mount(mnt).get("readonly"):
            die(f"{mnt} was mounted read-only (its device is open read-only): unmount it and "
                f"mount it again to write")
    if ro and ro[-1] == "ro":             # as ext4's: what was written is durable first (an
        fd = os.open(mnt, os.O_RDONLY)     # fsync of the root reaches the daemon; syncfs
        try:                               # would not)
            os.fsync(fd)
        finally:
            os.close(fd)
    p = subprocess.run(["mount", "-i", "-o", ",".join(["remount"] + flags), mnt],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        die(f"remount of {mnt} failed: {p.stdout.strip().splitlines()[-1] if p.stdout else p.returncode}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if any("remount" in g.split(",") for g in args.options):
        return remount(args.mountpoint, args.options)
    try:
        ours, fuse_extra = parse_options(args.options)
    except ValueError as e:
        die(str(e))
    target, mnt = args.target, args.mountpoint
    _check_mountpoint(mnt)
    why = _user_may_not(fuse_extra)
    if why:
        die(why)
    other = find_mount_of(target)
    if other and not _is_stale(other):    # fail at once (the lock retry is for exiting daemons)
        die(f"{target} is in use: already mounted at {other}")
    level = logging.DEBUG if ours.get("debug") else logging.INFO
    supervise.stop_signals(supervise.asked_to_stop)   # (before the fork: the daemon starts with it)
    if args.foreground:
        daemonlog.log_to(sys.stderr, level)
        return serve(target, os.path.realpath(mnt), ours, fuse_extra, None)

    if ours.get("log"):
        logfile = os.path.abspath(ours["log"])
        try:                                      # in the parent: a bad path is a one-line error
            fd = os.open(logfile, daemonlog.LOG_FLAGS, 0o644)
        except OSError as e:
            die(f"cannot open log file {logfile}: {e.strerror}")
    else:
        logfile, fd = daemonlog.open_default_log(mnt)
    ours["log_path"] = logfile
    # the daemon leaves the caller's directory (so it does not pin it): absolute paths
    target, mnt = os.path.abspath(target), os.path.realpath(mnt)   # (not mounted yet: safe)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                  # daemon: never returns into main()
        code = 1
        try:
            os.close(r)
            os.setsid()
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            daemonlog.log_to(sys.stderr, level)
            code = serve(target, mnt, ours, fuse_extra, w)
        except BaseException:
            logging.getLogger("retainzfs").exception("daemon failed")
        finally:
            os._exit(code)
    os.close(w)
    os.close(fd)
    msg = supervise.wait_or_stop(pid, r, mnt, logfile)
    if msg == "OK":
        return 0
    die(msg[4:] if msg.startswith("ERR ") else f"daemon exited before mounting (see {logfile})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
