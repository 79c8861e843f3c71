"""Fixtures that run retainzfs the way a user does: `mkfs.retainzfs`, `mount.retainzfs`, `umount`.

* ``image``      a fresh 1 GiB image (4 MiB zones, max_open=max_active=8) in tmp_path.
* ``make_image`` factory for other geometries (``make_image(size="64M")``).
* ``mounted``    the image mounted through the real, daemonizing ``mount.retainzfs``; yields a
                 :class:`Mount` (path-like: ``mounted / "f"``, ``os.fspath(mounted)``) that can
                 ``remount()``, ``umount()`` and ``kill()`` its daemon.
* ``mount_image`` factory: mount any image (``mount_image(img)``), torn down like ``mounted``.

Teardown is robust: ``umount``, wait for the daemon to exit (it releases the image lock when
done); on failure ``fusermount3 -uz`` and SIGKILL of the daemon we started (by pid).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import shutil
import signal
import subprocess
import time

import pytest
import xattr
from retainzfs import hints as H
from retainzfs.cli.common import daemons_holding

MKFS = shutil.which("mkfs.retainzfs") or "mkfs.retainzfs"
MOUNT = shutil.which("mount.retainzfs") or "mount.retainzfs"
RETAINZFS = shutil.which("retainzfs") or "retainzfs"


def run(*argv, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    """Run a command, capture text output; raise with its output when ``check`` fails."""
    kw.setdefault("errors", "surrogateescape")     # (paths that are not UTF-8: as os.fsdecode)
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} -> rc={p.returncode}\n"
                             f"stdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def mkfs(img, size="1G", zone_size="4M", max_open=8, max_active=8, *extra) -> pathlib.Path:
    run(MKFS, "--size", size, "--zone-size", zone_size, "--max-open", max_open,
        "--max-active", max_active, *extra, img)
    return pathlib.Path(img)


def is_mounted(path) -> bool:
    """``/proc/mounts`` read as the CLI reads it: octal escapes (a space is ``\\040``) decoded,
    bytes that are not UTF-8 kept as surrogates (os.fsdecode's)."""
    from retainzfs.device import unescape_mount_field
    real = os.path.realpath(path)
    with open("/proc/mounts", errors="surrogateescape") as f:
        return any(unescape_mount_field(line.split()[1]) == real for line in f)


def daemon_pids(img, mnt=None) -> list[int]:
    """Pids of live mount.retainzfs daemons holding ``img`` open."""
    return daemons_holding(str(img))


def mount_daemons(uid: int | None = None, naming=None) -> list[int]:
    """Pids of ``mount.retainzfs`` processes (by command line), of user ``uid`` and/or whose
    arguments include ``naming``: a daemon still waiting for its image's lock has no
    descriptor of it open, so ``daemon_pids`` cannot see it."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if uid is not None and os.stat(f"/proc/{p}").st_uid != uid:
                continue
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (any(a.endswith(b"mount.retainzfs") for a in argv)
                and (naming is None or os.fsencode(naming) in argv)):
            out.append(int(p))
    return out


def image_locked(img) -> bool:
    """True while some process (a daemon) holds the image's exclusive flock."""
    fd = os.open(img, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def wait_for(pred, timeout=15.0, interval=0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def missing(why: str):
    """A prerequisite (a tool setup installs, root, a cgroup, LazyFS) is missing: skip for a
    developer, fail under ``CI=true`` (where every test must run)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why} (CI=true: this test must run; scripts/setup.sh installs it)")
    pytest.skip(why)


@contextlib.contextmanager
def walkable_mount(image, options: str = "allow_other"):
    """(mount, top): ``image`` mounted with ``options`` under a fresh 0755 directory ``top``
    in /tmp, which ``nobody`` may walk (pytest's own directories are root's, 0700), for
    tests that run commands as another user; unmounted and removed after."""
    import tempfile
    top = tempfile.mkdtemp(dir="/tmp", prefix="rz-walk-")
    os.chmod(top, 0o755)
    m = Mount(image, os.path.join(top, "mnt"), options)
    try:
        m.mount()
        os.chmod(m.path, 0o755)
        yield m, top
    finally:
        m.teardown()
        shutil.rmtree(top, ignore_errors=True)


def on_host_and_mount(image, session: str, remount_check: str | None = None) -> str:
    """Run a shell ``session`` (``$1``: the directory; ``N``: a prefix running a command as
    ``nobody``) in a directory of the host's file system (ext4 here) and on a mount of
    ``image``, under a path ``nobody`` may walk; assert the same output, and after a remount
    the same output of ``remount_check``; return the output."""
    if shutil.which("setpriv") is None:
        missing("setpriv (util-linux) not installed")
    prelude = 'set -u; umask 022; N="setpriv --reuid=65534 --regid=65534 --clear-groups"\n'
    with walkable_mount(image) as (m, top):
        host = os.path.join(top, "host")
        os.mkdir(host, 0o755)
        want = run("bash", "-c", prelude + session, "s", host).stdout
        got = run("bash", "-c", prelude + session, "s", str(m.path)).stdout
        assert got == want
        if remount_check:
            before = run("bash", "-c", remount_check, "s", str(m.path)).stdout
            m.remount()
            assert run("bash", "-c", remount_check, "s", str(m.path)).stdout == before
        m.umount()
        return got


class Mount:
    """A live retainzfs mount made with the real commands; path-like."""

    def __init__(self, img, mnt, options: str | None = None):
        self.img = pathlib.Path(img)
        self.path = pathlib.Path(mnt)
        self.options = options
        self.log = self.path.parent / f"{self.path.name}.daemon.log"
        self.pid: int | None = None
        self.pids_seen: set[int] = set()

    # path-like conveniences
    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other) -> pathlib.Path:
        return self.path / other

    def __str__(self) -> str:
        return str(self.path)

    def mount(self, cgroup: pathlib.Path | None = None) -> None:
        """Mount; with ``cgroup`` (``make_cgroup``) the daemon starts inside that cgroup."""
        if not is_mounted(self.path):          # (a stale mount after kill -9 fails stat)
            self.path.mkdir(exist_ok=True)
        opts = f"log={self.log}" + (f",{self.options}" if self.options else "")
        argv = [MOUNT, self.img, self.path, "-o", opts]
        if cgroup is not None:                 # the helper forks the daemon: it stays there
            argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup / "cgroup.procs", *argv]
        run(*argv, timeout=60)
        assert is_mounted(self.path), f"{self.path} not mounted after mount.retainzfs returned"
        pids = daemon_pids(self.img, self.path)
        assert len(pids) == 1, f"expected one daemon for {self.img}, found {pids}"
        self.pid = pids[0]
        self.pids_seen.add(self.pid)

    def umount(self, timeout: float = 30.0) -> None:
        """Clean unmount with umount(8); wait for the daemon to exit and release the image."""
        run("umount", self.path, timeout=timeout)
        pid, self.pid = self.pid, None
        if pid is not None:
            assert wait_for(lambda: not _alive(pid), timeout), f"daemon {pid} still running after umount"
        assert wait_for(lambda: not image_locked(self.img), timeout), "image still locked after umount"

    def remount(self) -> None:
        self.umount()
        self.mount()

    def kill(self) -> None:
        """kill -9 the daemon (crash); the mount is left stale (ENOTCONN) like in real life."""
        pid, self.pid = self.pid, None
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not _alive(pid), 10), f"daemon {pid} survived SIGKILL"
        assert wait_for(lambda: not image_locked(self.img), 10)

    def status(self) -> dict:
        import json
        for _ in range(5):     # the live document may grow between getxattr's two calls
            try:
                return json.loads(xattr.getxattr(self.path, H.XATTR_STATUS))
            except OSError as e:
                if e.errno != errno.ERANGE:
                    raise
        return json.loads(xattr.getxattr(self.path, H.XATTR_STATUS))

    def daemon_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def teardown(self) -> None:
        """Best effort: umount; otherwise lazy fusermount + SIGKILL of our daemons."""
        try:
            if is_mounted(self.path):
                self.umount()
        except Exception:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        for pid in self.pids_seen | set(daemon_pids(self.img, self.path)):
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_for(lambda: not _alive(pid), 5)
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)


def _make_cgroup(controller: str, name: str, knob_v1: str, knob_v2: str,
                 value: int) -> pathlib.Path:
    v1 = pathlib.Path("/sys/fs/cgroup") / controller
    v2 = pathlib.Path("/sys/fs/cgroup")
    try:
        if (v1 / "cgroup.procs").exists():
            d, knob = v1 / name, knob_v1
        elif controller in (v2 / "cgroup.controllers").read_text().split():
            if controller not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text(f"+{controller}")
            d, knob = v2 / name, knob_v2
        else:
            raise OSError(f"no {controller} cgroup controller")
        d.mkdir(exist_ok=True)
        (d / knob).write_text(str(value))
        return d
    except OSError as e:
        why = f"cannot make a {controller} cgroup: {e}"
    missing(why)


@pytest.fixture
def cgroup():
    """``cgroup(controller, knob_v1, knob_v2, value)``: a fresh cgroup of ``controller`` (its
    v1 hierarchy, or v2) with one limit written (``knob_v1`` or ``knob_v2``), removed after
    the test (request this fixture before ``mount_image``: its daemons are gone by then).
    Skipped when none can be made (root, a writable cgroup file system, the controller),
    failed under CI=true."""
    made: list[pathlib.Path] = []

    def make(controller: str, knob_v1: str, knob_v2: str, value: int) -> pathlib.Path:
        d = _make_cgroup(controller, f"retainzfs-test-{os.getpid()}-{len(made)}", knob_v1,
                         knob_v2, value)
        made.append(d)
        return d
    yield make
    for d in made:
        try:
            d.rmdir()
        except OSError:
            pass


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (created) for the block: a host file system
    that fills.  Needs root: skipped without it, failed under CI=true."""
    if os.geteuid() != 0:
        missing("a tmpfs mount needs root")
    path = pathlib.Path(path)
    path.mkdir()
    run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def lazyfs_target(wdir, pc_size: str = "2G"):
    """The fault campaign's power-cut target (``scripts/fault_campaign.py``: an image inside
    LazyFS, ``setup``/``mount``/``crash``/``teardown``), not yet set up.  Skips without root
    or ``../shared/suites`` (LazyFS); fails instead under CI=true."""
    import argparse
    import random
    import sys
    repo = pathlib.Path(__file__).resolve().parents[1]
    suites = repo.parent / "shared" / "suites"
    if os.geteuid() != 0 or not (suites / "lazyfs.sh").exists():
        missing(f"needs root and LazyFS (third-party suites) at {suites}")
    sys.path.insert(0, str(repo / "scripts"))
    import fault_campaign as fc
    args = argparse.Namespace(
        suites=str(suites), seed=1, max_file=8 << 20, pc_size=pc_size, kill_size=None,
        suites_out=os.environ.get("RETAINZFS_SUITES_CACHE", "/tmp/retainzfs-suites"))
    fc.ensure_lazyfs(args)
    return fc.Target("powercut", str(wdir), args, random.Random(1))


@pytest.fixture
def make_image(tmp_path):
    n = [0]

    def make(size="1G", zone_size="4M", max_open=8, max_active=8, *extra) -> pathlib.Path:
        n[0] += 1
        return mkfs(tmp_path / f"img{n[0]}.zns", size, zone_size, max_open, max_active, *extra)
    return make


@pytest.fixture
def image(make_image) -> pathlib.Path:
    return make_image()


@pytest.fixture
def loop_host(tmp_path):
    """``loop_host(mkfs_argv, size)``: a file system of ``size`` made by ``mkfs_argv`` on a loop
    device (its backing file on the test's disk), mounted; unmounted and detached after."""
    if os.geteuid() != 0 or not os.path.exists("/dev/loop-control"):
        missing("a loop device needs root and /dev/loop-control")
    made = []

    def make(mkfs_argv: list[str], size: str):
        host = tmp_path / f"host{len(made)}"
        host.mkdir()
        vol = tmp_path / f"vol{len(made)}"
        run("truncate", "-s", size, vol)
        loop = run("losetup", "-f", "--show", vol).stdout.strip()
        made.append((host, loop))
        run(*mkfs_argv, loop)
        run("mount", loop, host)
        return host
    yield make
    for host, loop in made:
        subprocess.run(["umount", "-l", str(host)], capture_output=True)
        subprocess.run(["losetup", "-d", loop], capture_output=True)


@pytest.fixture
def mount_image(tmp_path, request):
    mounts: list[Mount] = []

    def mount(img, options: str | None = None, name: str | None = None,
              cgroup: pathlib.Path | None = None) -> Mount:
        m = Mount(img, tmp_path / (name or f"mnt{len(mounts)}"), options)
        mounts.append(m)
        m.mount(cgroup=cgroup)
        return m
    yield mount
    failed = []
    for m in reversed(mounts):          # (last first: a mount may hold a later one's image)
        m.teardown()
        bad = [ln for ln in m.daemon_log().splitlines()
               if "internal error" in ln or "Traceback" in ln or "FUSE loop failed" in ln]
        if bad:
            failed.append(f"{m.log}: " + " | ".join(bad[:5]))
    if failed and not getattr(request.node, "allow_daemon_errors", False):
        pytest.fail("daemon logged internal errors:\n" + "\n".join(failed))


@pytest.fixture
def mounted(image, mount_image) -> Mount:
    return mount_image(image, name="mnt")


@pytest.fixture
def remount():
    """remount(m): clean umount + mount again of a Mount (also available as m.remount())."""
    return lambda m: m.remount()


@pytest.fixture
def say(capsys):
    """print() that shows in the plain test run (counts of suites and campaigns belong in CI's
    output, not only under -s)."""
    def _say(*args, **kw) -> None:
        with capsys.disabled():
            print(*args, **kw, flush=True)
    return _say


@pytest.fixture(scope="session")
def zns_guest():
    """The one QEMU TCG guest boot the ``qemu`` tests share (tests/zns_guest.py): booted when
    the first of them asks, ~3 min; its sections' results for the rest of the session."""
    import zns_guest as Z
    lacking = Z.missing_prereqs()
    if lacking:
        missing("QEMU ZNS prerequisites missing: " + lacking)
    return Z.boot()
