"""A user who is not root makes an image, mounts it, writes, unmounts, mounts again.

FUSE lets any user mount through the setuid ``fusermount3``; an engineer on a shared node (or
in a container without CAP_SYS_ADMIN) runs ``mkfs.retainzfs ~/ckpt.zns && mount.retainzfs
~/ckpt.zns ~/ckpt``.  Every other test runs as root, so three things no one saw: the mount
failed at once ("cannot open log file /var/log/retainzfs/...: Permission denied"), mkfs gave
the root directory to root (the user who made the file system could not create a file in it),
and ``-o allow_other`` failed as "fuse_session_mount() failed" (fusermount3's reason went to
the daemon's log).

The user here is ``nobody``; the commands are the installed console scripts, run by
``setpriv``.  The interpreter may live where ``nobody`` cannot go (pyenv under /root, mode
0700): the script then runs in a private mount namespace in which each such directory on the
way is covered by a tmpfs holding only the next step of the way (bind-mounted from the
original), so nothing on the host changes and the mounts vanish with the namespace.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
from conftest import mount_daemons, run

NOBODY = 65534
#: the user's first steps, as the README gives them (a script line of ``go``)
MADE_AND_MOUNTED = ("cd \"$HOME\"; mkfs.retainzfs -q --size 256M ck.zns; mkdir ck; "
                    "mount.retainzfs ck.zns ck")
CI = os.environ.get("CI") == "true"


def _blocked_steps(path: str) -> list[tuple[str, str]]:
    """(directory, next name) for each directory on the way to ``path`` that others cannot
    search (mode bits only: what ``nobody`` meets)."""
    out = []
    parts = os.path.realpath(path).strip("/").split("/")
    cur = "/"
    for name in parts[:-1] if os.path.isfile(os.path.realpath(path)) else parts:
        st = os.stat(cur)
        if not st.st_mode & stat.S_IXOTH:
            out.append((cur, name))
        cur = os.path.join(cur, name)
    return out


def _uncover_script(targets: list[str], stash: str) -> str:
    """Shell lines (run as root in the new namespace) that make each target reachable."""
    lines, done = [], set()
    for t in targets:
        for i, (d, name) in enumerate(_blocked_steps(t)):
            if (d, name) in done:
                continue
            done.add((d, name))
            keep = os.path.join(stash, str(len(done)))
            lines += [f"mkdir -p {keep}", f"mount --bind {d} {keep}",
                      f"mount -t tmpfs -o mode=0711,size=1M rzcover {d}",
                      f"mkdir -p {os.path.join(d, name)}",
                      f"mount --bind {os.path.join(keep, name)} {os.path.join(d, name)}"]
            if not stat.S_ISDIR(os.stat(os.path.join(d, name)).st_mode):
                raise AssertionError(f"{d}/{name}: not a directory")
    return "\n".join(lines)


def _prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "needs root (to become nobody)"
    for tool in ("setpriv", "unshare", "fusermount3"):
        if not shutil.which(tool):
            return f"no {tool}"
    fm = shutil.which("fusermount3")
    if not os.stat(fm).st_mode & stat.S_ISUID:
        return f"{fm} is not setuid"
    for name in ("mkfs.retainzfs", "mount.retainzfs", "retainzfs"):
        if not os.path.exists(os.path.join(os.path.dirname(sys.executable), name)):
            return f"no {name} beside {sys.executable}"
    return None


@pytest.fixture
def as_nobody():
    """Run a bash script as ``nobody`` in a private mount namespace; yields
    ``(run_script, home)``.  Daemons the script leaves are killed; the namespace goes with
    its last process."""
    why = _prerequisites()
    if why:
        if CI:
            pytest.fail(f"cannot run as an unprivileged user: {why}")
        pytest.skip(why)
    had_root_tmp_log = os.path.exists("/tmp/retainzfs-0")     # (not ours to remove)
    home = tempfile.mkdtemp(prefix="rz-nobody.", dir="/tmp")
    os.chmod(home, 0o755)
    os.chown(home, NOBODY, NOBODY)
    stash = tempfile.mkdtemp(prefix="rz-stash.", dir="/tmp")
    import retainzfs
    cover = _uncover_script([sys.executable, os.path.dirname(retainzfs.__file__)], stash)
    bindir = os.path.dirname(sys.executable)

    def go(script: str, then_as_root: str = "", timeout: float = 180
           ) -> subprocess.CompletedProcess:
        body = os.path.join(home, "script.sh")
        script = textwrap.dedent(script).replace("{MADE_AND_MOUNTED}", MADE_AND_MOUNTED)
        with open(body, "w") as f:
            f.write("set -eu\n" + script)
        os.chmod(body, 0o755)
        outer = (f"set -e\n{cover}\n"
                 f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups "
                 f"env -i HOME={home} PATH={bindir}:/usr/bin:/bin LANG=C.UTF-8 "
                 f"bash {body}\n"
                 f"cd {home}\nexport PATH={bindir}:$PATH\n{textwrap.dedent(then_as_root)}\n")
        return subprocess.run(["unshare", "--mount", "--propagation", "private",
                               "bash", "-c", outer], capture_output=True, text=True,
                              timeout=timeout)

    try:
        yield go, home
    finally:
        for pid in mount_daemons(uid=NOBODY):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(home, ignore_errors=True)
        for uid in (NOBODY, 0):
            if uid == 0 and had_root_tmp_log:
                continue
            shutil.rmtree(f"/tmp/retainzfs-{uid}", ignore_errors=True)
        subprocess.run(["umount", "-R", stash], capture_output=True)
        shutil.rmtree(stash, ignore_errors=True)


def test_a_user_makes_mounts_writes_and_remounts_an_image_of_their_own(as_nobody):
    go, home = as_nobody
    with open("/etc/fuse.conf", errors="replace") if os.path.exists("/etc/fuse.conf") \
            else open(os.devnull) as f:
        user_allow_other = any(ln.split("#", 1)[0].strip() == "user_allow_other" for ln in f)
    p = go(r"""
        {MADE_AND_MOUNTED}
        echo "owner $(stat -c %u:%g ck)"
        echo hello > ck/a
        dd if=/dev/urandom of=ck/big bs=1M count=24 conv=fsync status=none
        mkdir -p ck/run/step-1
        python3 -c 'import os; f = open("ck/run/step-1/shard", "wb"); f.write(os.urandom(3 << 20)); f.flush(); os.fsync(f.fileno()); f.close()'
        sha256sum ck/a ck/big ck/run/step-1/shard > sums
        retainzfs status ck --json > status.json
        echo "logs $(ls .local/state/retainzfs/ | tr '\n' ' ')"
        mkdir ck2
        if mount.retainzfs ck.zns ck2 -o allow_other 2> ao.err; then
            echo "allow_other mounted"; fusermount3 -u ck2
        fi
        echo "allow_other: $(cat ao.err)"
        fusermount3 -u ck
        # the next mount waits for the exiting daemon; HOME unwritable: the log goes to /tmp
        HOME=/ mount.retainzfs ck.zns ck
        sha256sum -c --quiet sums && echo "sums ok"
        echo "ls $(stat -c '%u %n' ck/a ck/big ck/run/step-1/shard | tr '\n' ' ')"
        umount ck || fusermount3 -u ck
        for i in $(seq 100); do retainzfs fsck ck.zns > fsck.out 2>&1 && break; sleep 0.1; done
        echo "fsck $(cat fsck.out)"
        echo "tmplog $(ls /tmp/retainzfs-$(id -u)/ | tr '\n' ' ')"
        echo done
    """)
    out = p.stdout
    assert p.returncode == 0 and "done" in out, (p.returncode, out, p.stderr)
    assert f"owner {NOBODY}:{NOBODY}" in out            # mkfs gave the user their root
    assert "sums ok" in out
    assert f"ls {NOBODY} ck/a {NOBODY} ck/big {NOBODY} ck/run/step-1/shard" in out
    assert "0 problems" in out
    log = home.strip("/").replace("/", "-") + "-ck.log"
    said = {ln.split(" ", 1)[0]: ln.split()[1:] for ln in out.splitlines() if " " in ln}
    assert log in said["logs"], out          # the first mount's log: ~/.local/state/retainzfs
    assert log in said["tmplog"], out        # HOME not writable: /tmp/retainzfs-UID
    st = __import__("json").load(open(os.path.join(home, "status.json")))
    tun = st["tuning"]
    # a user may not raise the bdi's readahead: said, with the value in force
    assert tun["read_ahead_kb"] and tun["read_ahead_kb"] < 4096, tun
    assert "read_ahead_kb" in tun["read_ahead_kb_problem"], tun
    assert tun["log"] == os.path.join(home, ".local/state/retainzfs", log), tun   # status says
    if user_allow_other:
        assert "allow_other mounted" in out
    else:
        line = [ln for ln in out.splitlines() if ln.startswith("allow_other:")][0]
        assert "user_allow_other" in line and "fuse_session_mount" not in line, out


def test_mkfs_root_owner(make_image, mount_image, tmp_path):
    """``--root-owner UID:GID`` (mke2fs' ``-E root_owner``) gives the root directory away
    (root making an image for a user); without it, whoever runs mkfs owns it (root here).
    A malformed value is a one-line error and writes nothing."""
    m = mount_image(make_image("256M", "4M", 8, 8, "--root-owner", "1000:1001"))
    st = os.stat(m)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1001, 0o755)
    m.remount()
    assert (os.stat(m).st_uid, os.stat(m).st_gid) == (1000, 1001)
    m2 = mount_image(make_image("256M"), name="m2")
    assert (os.stat(m2).st_uid, os.stat(m2).st_gid) == (os.getuid(), os.getgid())
    for bad in ("1000", "x:1", "1:", "-1:0", "4294967295:0", "1:2:3", "١:1"):
        img = tmp_path / "bad.zns"
        p = run("mkfs.retainzfs", "--size", "64M", "--root-owner", bad, img, check=False)
        assert p.returncode == 2 and "UID:GID" in p.stderr and not img.exists(), (bad, p)
        last = p.stderr.strip().splitlines()[-1]          # (argparse's usage above it)
        assert last.startswith("mkfs.retainzfs: error: argument --root-owner"), p.stderr
        assert "Traceback" not in p.stderr


def test_a_log_in_shared_tmp_must_be_a_private_directory_of_ours(tmp_path, monkeypatch):
    """The last place a user's daemon logs to is /tmp/retainzfs-UID: a name there someone
    else made (a symlink to a file of the user's, a directory others may write) is refused,
    as is a symlink at the log's own name (O_NOFOLLOW)."""
    from retainzfs.cli import daemonlog as L
    fresh = tmp_path / "fresh"
    assert L.private_tmp_dir(str(fresh))
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    target = tmp_path / "victim"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert not L.private_tmp_dir(str(tmp_path / "link"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert not L.private_tmp_dir(str(shared))
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, NOBODY, NOBODY)
    assert not L.private_tmp_dir(str(other))

    monkeypatch.setattr(L, "log_dirs", lambda: [(str(tmp_path / "state"), False),
                                                (str(fresh), True)])
    (tmp_path / "state").mkdir()
    victim = target / "file"
    victim.write_text("keep\n")
    (tmp_path / "state" / "mnt.log").symlink_to(victim)
    path, fd = L.open_default_log("/mnt")          # the symlinked name: skipped
    os.close(fd)
    assert path == str(fresh / "mnt.log") and victim.read_text() == "keep\n"


def test_allow_other_for_a_user_needs_user_allow_other(tmp_path, monkeypatch):
    from retainzfs.cli import mount as M
    conf = tmp_path / "fuse.conf"
    conf.write_text("# user_allow_other\nmount_max = 1000\n")
    assert M._user_may_not(["allow_other"], str(conf)) is None       # root may
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = M._user_may_not(["allow_root"], str(conf))
    assert "allow_root" in why and "user_allow_other" in why and str(conf) in why
    assert M._user_may_not([], str(conf)) is None
    assert M._user_may_not(["allow_other"], str(tmp_path / "missing")) is not None
    conf.write_text("user_allow_other   # for the checkpoint mount\n")
    assert M._user_may_not(["allow_other"], str(conf)) is None


def test_root_asking_a_users_mount_is_told_why_it_is_refused(as_nobody):
    """FUSE keeps everyone else out of a mount made without ``allow_other``, root too:
    ``status`` said only "Permission denied".  It names the user now; mkfs, fsck and a
    second mount of the image still refuse in one line."""
    go, home = as_nobody
    p = go("""
        {MADE_AND_MOUNTED}
        echo data > ck/f
    """, then_as_root="""
        retainzfs status ck > st.out 2>&1 || echo "status rc=$?"
        cat st.out
        retainzfs fsck ck.zns 2>&1 || true
        mkfs.retainzfs --force ck.zns 2>&1 || true
        mkdir ck3; mount.retainzfs ck.zns ck3 2>&1 || true
        umount ck
        echo done
    """)
    out = p.stdout
    assert p.returncode == 0 and "done" in out, (out, p.stderr)
    assert "status rc=1" in out
    assert f"Permission denied (mounted by uid {NOBODY} without allow_other" in out, out
    assert "is mounted at" in out and "unmount it before fsck" in out
    assert "unmount it first" in out and "already mounted at" in out
    assert "Traceback" not in out


def test_a_refused_mount_says_what_libfuse_or_fusermount3_said(as_nobody):
    """The caller saw "fuse_session_mount() failed" and nothing more; the reason was in the
    daemon's log.  A container run with no-new-privileges (the setuid fusermount3 cannot
    mount: ``setpriv --no-new-privs``) and one without /dev/fuse (a tmpfs over /dev here)."""
    go, home = as_nobody
    p = go("""
        cd "$HOME"
        mkfs.retainzfs -q --size 256M ck.zns
        mkdir ck
        if setpriv --no-new-privs mount.retainzfs ck.zns ck 2> nnp.err; then echo mounted; fi
        echo "nnp: $(cat nnp.err)"
    """, then_as_root="""
        mkdir ck4
        mount -t tmpfs rznodev /dev
        mknod -m 666 /dev/null c 1 3
        if mount.retainzfs -o log=$PWD/root.log ck.zns ck4 2> nodev.err; then echo mounted; fi
        echo "nodev: $(cat nodev.err)"
        echo done
    """)
    out = p.stdout
    assert p.returncode == 0 and "done" in out and "mounted" not in out, (out, p.stderr)
    lines = {ln.split(":", 1)[0]: ln for ln in out.splitlines() if ":" in ln}
    assert "fusermount3: mount failed: Operation not permitted" in lines["nnp"], out
    assert "device not found" in lines["nodev"], out
    for k in ("nnp", "nodev"):
        assert "fuse_session_mount() failed: " in lines[k] and "Traceback" not in lines[k]
    # what they said is in the logs as before
    assert "device not found" in open(os.path.join(home, "root.log")).read()


def test_root_with_a_read_only_var_log_logs_to_a_private_tmp_dir(as_nobody):
    """A container with a read-only root file system (Kubernetes' readOnlyRootFilesystem)
    and a writable /tmp: the mount logs to /tmp/retainzfs-0/; with /tmp read-only too, one
    line names every place tried and ``-o log=``."""
    go, home = as_nobody
    p = go("""
        cd "$HOME"
        mkfs.retainzfs -q --size 256M ck.zns
        mkdir ck
    """, then_as_root="""
        mkdir -p /var/log/retainzfs
        mount --bind /var/log /var/log && mount -o remount,bind,ro /var/log
        export HOME=/var/log                # (its ~/.local/state: read-only as well)
        mount.retainzfs ck.zns ck
        echo data > ck/f
        umount ck
        echo "tmplog $(ls /tmp/retainzfs-0/ | tr '\\n' ' ')"
        mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp
        if mount.retainzfs ck.zns ck 2> rofs.err; then echo mounted; umount ck; fi
        echo "rofs: $(cat rofs.err)"
        echo done
    """)
    out = p.stdout
    assert p.returncode == 0 and "done" in out and "mounted" not in out, (out, p.stderr)
    log = home.strip("/").replace("/", "-") + "-ck.log"
    said = {ln.split(" ", 1)[0]: ln for ln in out.splitlines() if " " in ln}
    assert log in said["tmplog"].split(), out
    rofs = said["rofs:"]
    assert "cannot open a log file" in rofs and "/var/log/retainzfs/" in rofs, rofs
    assert "/tmp/retainzfs-0/" in rofs and "-o log=PATH" in rofs, rofs


def test_root_in_a_user_namespace_makes_and_mounts_an_image(as_nobody):
    """"root" in a user namespace (rootless podman, Apptainer with --fakeroot): uid 0
    there, a plain user outside.  The log went to /var/log/retainzfs (root's) and then to
    /tmp/retainzfs-0, whose owner (the real root) it rightly refused: no mount at all.  It
    now logs in the user's state directory; the bdi readahead is refused as for a user."""
    go, home = as_nobody
    probe = go("unshare --user --map-root-user true && echo userns-ok")
    if "userns-ok" not in probe.stdout:
        why = f"no unprivileged user namespaces here: {probe.stderr.strip()[-200:]}"
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    p = go("""
        cd "$HOME"
        mkdir ck
        unshare --user --map-root-user --mount bash -euc '
            echo "uid $(id -u)"
            mkfs.retainzfs -q --size 256M ck.zns
            mount.retainzfs ck.zns ck
            echo hi > ck/f
            dd if=/dev/urandom of=ck/g bs=1M count=12 conv=fsync status=none
            sha256sum ck/f ck/g > sums
            retainzfs status ck --json > status.json
            umount ck
            mount.retainzfs ck.zns ck
            sha256sum -c --quiet sums && echo "sums ok"
            echo "ls $(stat -c %u ck/f ck/g | tr "\\n" " ")"
            fusermount3 -u ck
            for i in $(seq 100); do retainzfs fsck ck.zns > fsck.out 2>&1 && break; sleep 0.1; done
            cat fsck.out
        '
        echo "logs $(ls .local/state/retainzfs/ | tr '\\n' ' ')"
        echo done
    """)
    out = p.stdout
    assert p.returncode == 0 and "done" in out, (out, p.stderr)
    assert "uid 0" in out and "sums ok" in out and "ls 0 0" in out and "0 problems" in out, out
    assert home.strip("/").replace("/", "-") + "-ck.log" in out, out
    import json
    tun = json.load(open(os.path.join(home, "status.json")))["tuning"]
    assert "read_ahead_kb" in tun.get("read_ahead_kb_problem", ""), tun


def test_an_image_the_user_may_only_read_says_so_and_mounts_read_only(as_nobody):
    """A user's image made read-only (chmod 444, a shared image of another user's): "permission
    denied" alone did not say that ``-o ro`` would mount it."""
    go, home = as_nobody
    p = go("""
        {MADE_AND_MOUNTED}
        echo kept > ck/f
        fusermount3 -u ck
        for i in $(seq 100); do retainzfs fsck ck.zns > /dev/null 2>&1 && break; sleep 0.1; done
        chmod 444 ck.zns
        if mount.retainzfs ck.zns ck 2> rw.err; then echo "mounted rw"; fusermount3 -u ck; fi
        echo "rw: $(cat rw.err)"
        mount.retainzfs -o ro ck.zns ck
        echo "ro: $(cat ck/f)"
        if (echo x > ck/g) 2> w.err; then echo "wrote"; fi
        echo "w: $(cat w.err)"
        fusermount3 -u ck
        echo done
    """)
    out = p.stdout
    assert p.returncode == 0 and "done" in out, (out, p.stderr)
    assert "mounted rw" not in out and "wrote" not in out, out
    rw = [ln for ln in out.splitlines() if ln.startswith("rw:")][0]
    assert "permission denied for writing" in rw and "-o ro" in rw, rw
    assert "ro: kept" in out and "Read-only file system" in out, out
