"""The mount as a service: ``mount.retainzfs -f`` under systemd's ``Type=notify``.

A platform runs the mount as a unit and starts training ``After=`` it.  With ``Type=simple``
systemd counts the unit started when the process starts, before the kernel has connected, and
a job started then writes into the empty directory under the mount point (those files are
hidden by the mount a moment later: a checkpoint lost in plain sight).  The daemon now says
READY=1 on ``$NOTIFY_SOCKET`` once the mount is up, and STOPPING=1 when it goes down.  No
systemd runs here (PID 1 is not systemd), so the socket is the test's own, receiving what
systemd would.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
from conftest import MOUNT, daemon_pids, is_mounted, mount_daemons, wait_for


def _receiver(tmp_path, abstract: bool):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"rz-notify-{os.getpid()}-{id(s)}"
        s.bind("\0" + name)
        where = "@" + name
    else:
        where = str(tmp_path / "notify.sock")
        s.bind(where)
    s.settimeout(30)
    return s, where


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_only_once_mounted_and_stopping_on_sigterm(image, tmp_path, abstract):
    sock, where = _receiver(tmp_path, abstract)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, NOTIFY_SOCKET=where)
    p = subprocess.Popen([MOUNT, "-f", image, mnt], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        msg = sock.recv(4096).decode()
        fields = dict(ln.split("=", 1) for ln in msg.splitlines())
        assert fields.get("READY") == "1", msg
        assert is_mounted(mnt)                         # up when READY arrives, not after
        assert int(fields["MAINPID"]) == p.pid
        (mnt / "step-1").write_bytes(b"w" * 5000)
        p.send_signal(signal.SIGTERM)                  # what systemd sends to stop the unit
        msg = sock.recv(4096).decode()
        assert "STOPPING=1" in msg.splitlines(), msg
        assert p.wait(timeout=60) == 0, p.stderr.read()
        assert not is_mounted(mnt)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
        sock.close()
    _serve_and_read([MOUNT, "-f", image, mnt], mnt, "step-1", b"w" * 5000)  # no NOTIFY_SOCKET


def _serve_and_read(argv, mnt, name: str, want: bytes) -> None:
    """A foreground daemon from ``argv``: mounted, ``name`` reads back, SIGTERM stops it."""
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: is_mounted(mnt), 30)
        assert (mnt / name).read_bytes() == want
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0


def test_a_mount_that_fails_says_why_and_never_ready(tmp_path):
    sock, where = _receiver(tmp_path, False)
    sock.settimeout(5)
    bad = tmp_path / "not-an-image"
    bad.write_bytes(b"\0" * 65536)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run([MOUNT, "-f", bad, mnt], env=dict(os.environ, NOTIFY_SOCKET=where),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    msg = sock.recv(4096).decode()
    assert msg.startswith("STATUS=") and "READY" not in msg, msg
    sock.close()


def test_an_unreachable_notify_socket_is_logged_not_fatal(image, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "d.log"
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "nobody-listens"))
    subprocess.run([MOUNT, image, mnt, "-o", f"log={log}"], env=env, check=True, timeout=60)
    try:
        (mnt / "f").write_text("x")
    finally:
        subprocess.run(["umount", mnt], check=True)
    assert wait_for(lambda: "unmounted" in log.read_text(), 30)
    assert "cannot notify" in log.read_text()


def test_started_with_its_standard_streams_closed(image, tmp_path):
    """``mount.retainzfs IMG MNT <&- >&- 2>&-`` (a supervisor or init script that closes
    them): the mount's log took fd 0 and its readiness pipe fds 1 and 2, the daemon's own
    redirection closed them, the caller was told "daemon exited" (rc 1) and the log stayed
    empty.  Now it mounts, logs, and in the foreground stops on SIGTERM as usual; mkfs with
    its output closed makes a clean file system."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "d.log"
    p = subprocess.run(["bash", "-c", f'exec "{MOUNT}" "$0" "$1" -o log="$2" <&- >&- 2>&-',
                        image, mnt, log], timeout=60)
    assert p.returncode == 0
    try:
        assert is_mounted(mnt)
        (mnt / "f").write_bytes(b"k" * 9000)
    finally:
        subprocess.run(["umount", mnt], check=True)
    assert wait_for(lambda: "unmounted" in log.read_text(), 30)
    assert "mounted" in log.read_text()
    _serve_and_read(["bash", "-c", f'exec "{MOUNT}" -f "$0" "$1" <&- >&- 2>&-', image, mnt],
                    mnt, "f", b"k" * 9000)
    img2 = tmp_path / "closed-out.zns"
    p = subprocess.run(["bash", "-c", 'exec mkfs.retainzfs --size 64M "$0" <&- >&- 2>&-',
                        img2], timeout=60)
    assert p.returncode == 0
    for target in (image, img2):
        out = subprocess.run(["retainzfs", "fsck", target], capture_output=True, text=True)
        assert out.returncode == 0 and "0 problems" in out.stdout, out


@pytest.fixture
def leftovers():
    """Unmounts and kills what a failing test of this group would leave behind (a daemon
    that mounted after all)."""
    seen = []
    yield seen.append
    for image, mnt in seen:
        for pid in set(daemon_pids(image)) | set(mount_daemons(naming=image)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if wait_for(lambda: is_mounted(mnt), 0.5):
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)


def _holding_the_image(image, seconds: float) -> subprocess.Popen:
    """Another process holds the image's lock (as an exiting daemon does): the new daemon
    waits for it, up to 10 s, before it mounts."""
    h = subprocess.Popen(["flock", image, "sleep", str(seconds)])
    assert wait_for(lambda: _locked(image), 10)
    return h


def _locked(image) -> bool:
    import fcntl
    with open(image, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_a_mount_stops_its_daemon(image, tmp_path, sig, leftovers):
    """Ctrl-C on a mount that is still starting (here: waiting for the image's lock), or
    systemd's SIGTERM when a mount takes too long: the caller printed a KeyboardInterrupt
    traceback (or died), and the daemon went on to mount what the caller had given up on.
    Now the daemon is stopped, the caller says so in one line (128 + signal), nothing is
    mounted after the lock is free, and the image is clean."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    leftovers((image, mnt))
    log = tmp_path / "d.log"
    holder = _holding_the_image(image, 4)
    p = subprocess.Popen([MOUNT, image, mnt, "-o", f"log={log}"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: "daemon" in _children(p.pid) or p.poll() is not None, 10)
        time.sleep(0.5)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "interrupted" in err and "nothing is mounted" in err, err
    holder.wait()
    time.sleep(1.5)                              # (the lock is free: no late mount appears)
    assert not is_mounted(mnt)
    assert "not mounting" in log.read_text(), log.read_text()
    assert "Traceback" not in log.read_text()
    out = subprocess.run(["retainzfs", "fsck", image], capture_output=True, text=True)
    assert "0 problems" in out.stdout, out


def _children(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return "daemon" if f.read().split() else ""
    except OSError:
        return ""


def test_a_foreground_daemon_told_to_stop_while_starting_mounts_nothing(image, tmp_path,
                                                                       leftovers):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    leftovers((image, mnt))
    holder = _holding_the_image(image, 3)
    p = subprocess.Popen([MOUNT, "-f", image, mnt], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "Traceback" not in err, err
    assert "not mounting" in err, err
    holder.wait()
    time.sleep(1)
    assert not is_mounted(mnt)


def test_a_daemon_whose_caller_was_killed_mounts_and_says_so(image, tmp_path, leftovers):
    """The caller SIGKILLed while its daemon waits (no chance to stop it): the daemon mounts
    and serves, and its log says the caller is gone -- before, a BrokenPipeError traceback
    from the thread that reports readiness."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    leftovers((image, mnt))
    log = tmp_path / "d.log"
    holder = _holding_the_image(image, 2)
    p = subprocess.Popen([MOUNT, image, mnt, "-o", f"log={log}"])
    time.sleep(0.5)
    p.kill()
    p.wait()
    holder.wait()
    try:
        assert wait_for(lambda: is_mounted(mnt), 30)
        (mnt / "f").write_text("served")
        assert (mnt / "f").read_text() == "served"
    finally:
        subprocess.run(["umount", mnt], check=True)
    assert wait_for(lambda: "unmounted" in log.read_text(), 30)
    text = log.read_text()
    assert "started this daemon is gone" in text and "Traceback" not in text, text
