"""POSIX ACLs: the kernel enforces them (FUSE_POSIX_ACL), the file system keeps them and the
mode in step, as ext4 does.  Before, ``setfacl`` was refused (EOPNOTSUPP): a shared
checkpoint directory could not give a second user or group access, and ``cp -a`` of files
with ACLs into the mount failed ("preserving permissions ...: Operation not supported")."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retainzfs import acl as A
from retainzfs.errors import FsError

from conftest import missing, on_host_and_mount, run, walkable_mount

NOBODY = 65534


# ---------------------------------------------------------------------- the codec and rules

@st.composite
def acls(draw, mask=None):
    """Valid ACL entries: the three base entries, named users and groups (ascending, distinct
    ids) and a mask whenever a named entry is there (sometimes without)."""
    perm = st.integers(0, 7)
    users = sorted(draw(st.sets(st.integers(0, 2**32 - 2), max_size=6)))
    groups = sorted(draw(st.sets(st.integers(0, 2**32 - 2), max_size=6)))
    with_mask = bool(users or groups) or (draw(st.booleans()) if mask is None else mask)
    out = [(A.USER_OBJ, draw(perm), A.UNDEFINED_ID)]
    out += [(A.USER, draw(perm), u) for u in users]
    out += [(A.GROUP_OBJ, draw(perm), A.UNDEFINED_ID)]
    out += [(A.GROUP, draw(perm), g) for g in groups]
    if with_mask:
        out.append((A.MASK, draw(perm), A.UNDEFINED_ID))
    out.append((A.OTHER, draw(perm), A.UNDEFINED_ID))
    return out


@settings(max_examples=300, deadline=None)
@given(acls())
def test_acl_codec_round_trips_and_cut_values_are_einval(entries):
    value = A.encode(entries)
    assert A.parse(value) == entries
    for cut in {1, 3, 4 + 1, len(value) - 1, len(value) - 7}:   # around header and entry
        if 0 < cut < len(value) and (cut - 4) % 8:
            with pytest.raises(FsError) as ei:
                A.parse(value[:cut])
            assert ei.value.errno == errno.EINVAL


@pytest.mark.parametrize("bad", [
    [(A.GROUP_OBJ, 4, A.UNDEFINED_ID), (A.USER_OBJ, 6, A.UNDEFINED_ID),
     (A.OTHER, 4, A.UNDEFINED_ID)],                                      # out of order
    [(A.USER_OBJ, 6, A.UNDEFINED_ID), (A.OTHER, 4, A.UNDEFINED_ID)],     # no owning group
    [(A.USER_OBJ, 6, A.UNDEFINED_ID), (A.USER, 6, 7), (A.GROUP_OBJ, 4, A.UNDEFINED_ID),
     (A.OTHER, 4, A.UNDEFINED_ID)],                                      # named, no mask
    [(A.USER_OBJ, 6, A.UNDEFINED_ID), (A.USER, 6, 7), (A.USER, 4, 7),
     (A.GROUP_OBJ, 4, A.UNDEFINED_ID), (A.MASK, 6, A.UNDEFINED_ID),
     (A.OTHER, 4, A.UNDEFINED_ID)],                                      # a user twice
    [(A.USER_OBJ, 8, A.UNDEFINED_ID), (A.GROUP_OBJ, 4, A.UNDEFINED_ID),
     (A.OTHER, 4, A.UNDEFINED_ID)],                                      # not rwx
    [(A.USER_OBJ, 6, A.UNDEFINED_ID), (0x40, 4, 0), (A.GROUP_OBJ, 4, A.UNDEFINED_ID),
     (A.OTHER, 4, A.UNDEFINED_ID)],                                      # unknown tag
])
def test_invalid_acls_are_einval(bad):
    with pytest.raises(FsError) as ei:
        A.parse(A.encode(bad))
    assert ei.value.errno == errno.EINVAL
    with pytest.raises(FsError) as ei:                  # and version 1 is not ours
        A.parse(b"\x01\x00\x00\x00" + A.encode(bad)[4:])
    assert ei.value.errno in (errno.EOPNOTSUPP, errno.EINVAL)


@settings(max_examples=300, deadline=None)
@given(acls(), st.integers(0, 0o7777))
def test_chmod_and_the_acl_agree(entries, mode):
    """After chmod the ACL gives exactly the new mode's bits (owner, mask or group, other),
    named entries untouched; setting that ACL back gives the same mode."""
    after = A.parse(A.chmod(A.encode(entries), mode))
    bits, equiv = A.equiv_mode(after)
    assert bits == mode & 0o777
    assert [e for e in after if e[0] in (A.USER, A.GROUP)] == \
        [e for e in entries if e[0] in (A.USER, A.GROUP)]
    new_mode, kept = A.set_access(stat.S_IFREG | mode, A.encode(after))
    assert new_mode == stat.S_IFREG | mode
    assert (kept is None) == equiv


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), acls()), st.integers(0, 0o7777), st.integers(0, 0o777),
       st.sampled_from([stat.S_IFREG, stat.S_IFDIR, stat.S_IFIFO, stat.S_IFLNK]))
def test_a_new_node_never_gets_more_than_it_asked_for(default, mode, umask, kind):
    """``inherit``: without a default ACL the umask applies; with one the umask does not,
    the node never gets a permission its mode did not ask for, a directory inherits the
    default ACL, and an access ACL is kept only when the mode cannot say it."""
    value = None if default is None else A.encode(default)
    got, xattrs = A.inherit(value, kind | mode, umask)
    if kind == stat.S_IFLNK:
        assert (got, xattrs) == (kind | mode, {})
        return
    if default is None:
        assert (got, xattrs) == (kind | (mode & ~umask), {})
        return
    assert got & ~0o777 == (kind | mode) & ~0o777
    assert got & 0o777 & ~mode == 0
    assert (A.DEFAULT in xattrs) == (kind == stat.S_IFDIR)
    if A.ACCESS in xattrs:
        acc = A.parse(xattrs[A.ACCESS])
        assert A.equiv_mode(acc) == (got & 0o777, False)
    else:
        assert all(t not in (A.USER, A.GROUP, A.MASK) for t, _, _ in default)


# ---------------------------------------------------------------------- through the mount

SCRIPT = r"""
set -e
cd "$1"; umask 022
touch f; setfacl -m u:nobody:rw f; getfacl -c f; chmod 640 f; getfacl -c f; stat -c %A f
mkdir d; setfacl -d -m u:nobody:rwx,g::r-x d; getfacl -c d
touch d/new; mkdir d/sub; umask 077; touch d/masked; mkfifo d/fifo; ln -s new d/link
mkdir d/sub2; mkdir -m 700 d/sub3; python3 -c "import os; os.mknod('d/node', 0o660)"
getfacl -c d/new d/sub d/masked d/fifo d/sub2 d/sub3 d/node; stat -c "%A %n" d/*
setfacl -m m::r,u::rwx f; stat -c %A f; setfacl -b f; stat -c %A f; getfacl -c f
touch g; setfacl -m u::rwx,g::r,o::- g; stat -c %A g; getfacl -c g
setfacl -m g::rwx g; chmod g-w g; getfacl -c g
setfacl -k d; getfacl -c d; touch d/after; getfacl -c d/after
setfacl -d -m u::rwx d; getfacl -c d
setfacl -m d:u:nobody:r f 2>/dev/null || echo "default ACL on a file refused"
umask 022; mkdir plain; touch plain/x; mkfifo plain/p; stat -c "%A %n" plain/*
"""


def _acl_host(tmp_path) -> str:
    if shutil.which("setfacl") is None:
        missing("setfacl (the acl package) not installed")
    d = tmp_path / "host"
    d.mkdir()
    probe = d / "probe"
    probe.touch()
    if subprocess.run(["setfacl", "-m", "u:nobody:r", probe], capture_output=True).returncode:
        pytest.skip("the host file system under the tests takes no ACLs to compare with")
    probe.unlink()
    return str(d)


def test_setfacl_getfacl_and_inheritance_answer_as_on_the_host_file_system(
        tmp_path, image):
    """The same session of setfacl, chmod, umask and creates in directories with a default
    ACL, on the host's file system (ext4 here) and on the mount: the same getfacl and mode
    output, line for line; the same again after a remount."""
    _acl_host(tmp_path)
    got = on_host_and_mount(image, SCRIPT, remount_check='cd "$1" && getfacl -R -c .')
    assert "user:nobody:rw-" in got and "default:user:nobody:rwx" in got
    assert "0 problems" in run("retainzfs", "fsck", str(image)).stdout


def _as_nobody(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30)


def test_the_kernel_enforces_the_acl_and_noacl_turns_them_off(image):
    """A root-owned 0600 file: ``nobody`` may not write it, may after ``setfacl -m
    u:nobody:rw``, may only read it under a mask of r; kept across a remount.  ``-o noacl``
    refuses setfacl, hides the stored ACL and leaves the mode's bits to decide."""
    if shutil.which("setfacl") is None or shutil.which("setpriv") is None:
        missing("setfacl (acl) / setpriv (util-linux) not installed")
    with walkable_mount(image) as (m, _):
        assert m.status()["tuning"]["posix_acl"] == "on"
        p = m.path / "s"
        p.write_bytes(b"root's\n")
        os.chmod(p, 0o600)
        q = str(p)
        assert _as_nobody(f"echo x >> {q}").returncode != 0
        run("setfacl", "-m", "u:nobody:rw", q)
        r = _as_nobody(f"echo nobody >> {q}")
        assert r.returncode == 0, r.stderr
        run("setfacl", "-m", "m::r", q)
        r = _as_nobody(f"cat {q}; echo again >> {q}")
        assert r.stdout == "root's\nnobody\n" and "Permission denied" in r.stderr
        assert stat.S_IMODE(os.stat(q).st_mode) == 0o640        # the mask is the group's bits
        m.remount()
        r = _as_nobody(f"cat {q}; echo again >> {q}")
        assert r.stdout == "root's\nnobody\n" and "Permission denied" in r.stderr
        m.umount()
        m.options = "allow_other,noacl"
        m.mount()
        assert m.status()["tuning"]["posix_acl"] == "off (-o noacl)"
        assert "user:nobody" not in run("getfacl", "-c", q).stdout
        assert _as_nobody(f"cat {q}").returncode != 0           # mode 0640: nobody is other
        r = subprocess.run(["setfacl", "-m", "u:nobody:rw", q], capture_output=True, text=True)
        assert r.returncode != 0 and "Operation not supported" in r.stderr
        m.umount()
        m.options = "allow_other"
        m.mount()                                          # stored all along
        assert "user:nobody:rw-\t#effective:r--" in run("getfacl", "-c", q).stdout
        m.umount()
        assert "Traceback" not in m.daemon_log() and "internal error" not in m.daemon_log()


TREE = r"""
set -e
cd "$1"; umask 022
mkdir -p run/step-1/sub run/step-2; echo cfg > run/config.json
head -c 300000 /dev/urandom > run/step-1/shard-0.distcp
printf x | dd of=run/step-1/sparse bs=1 seek=5000000 status=none
ln run/step-1/shard-0.distcp run/step-2/shard-0.link; ln -s ../step-1 run/step-2/prev
mkfifo run/pipe
setfattr -n user.retain -v "epoch=3" run/step-1; setfattr -n user.bin -v 0x00ff10 run/config.json
setfacl -m u:nobody:r run/config.json; setfacl -d -m g:nogroup:rx run/step-2
chown 65534:1000 run/step-1/sub; chmod 2750 run/step-1/sub; chmod 4755 run/step-1/shard-0.distcp
touch -d 2020-02-02 run/config.json
"""

#: what a restore must keep, per entry in a fixed order (readdir orders differ): type, mode,
#: owner, group, links, mtime, symlink target; ACLs; user xattrs; contents
SHOW = r"""
cd "$1"
find run -printf '%p %M %u %g %n %T@ %l\n' | sort
find run -type f -o -type d | sort | while read f; do
  getfacl -c -p "$f" | tr '\n' ' '; echo " $f"
  getfattr -d -m '^user\.' "$f" | grep -v '^#' | tr '\n' ' '; echo
done
find run -type f -exec md5sum {} + | sort
find run -type f -printf '%p %s\n' | sort
"""


def test_a_checkpoint_tree_restored_by_tar_or_cp_a_keeps_everything(tmp_path, mounted):
    """A run directory with xattrs (binary too), access and default ACLs, a hard link, a
    symlink, a fifo, set-user-ID and set-group-ID entries owned by others, a file with a
    hole and an old mtime: ``tar --xattrs --acls -p`` extracted onto the mount, and ``cp
    -a`` onto it, give what the same on ext4 gives (directory sizes and readdir order
    aside), also after a remount.  ``cp -a`` of ACL'd files failed on the mount before
    stop 33 ("preserving permissions for ...: Operation not supported", exit 1)."""
    _acl_host(tmp_path)
    for d in ("src", "ext4", "tar"):
        (tmp_path / d).mkdir()
    run("bash", "-c", TREE, "tree", tmp_path / "src")
    tar = tmp_path / "tar" / "run.tar"
    flags = ("--xattrs", "--xattrs-include=*", "--acls", "-p")
    run("tar", "-C", tmp_path / "src", "-c", *flags, "-f", tar, "run")
    show = lambda d: run("bash", "-c", SHOW, "show", d).stdout     # noqa: E731
    run("tar", "-C", tmp_path / "ext4", "-x", *flags, "-f", tar)
    want = show(tmp_path / "ext4")
    assert "user:nobody:r--" in want and "default:group:nogroup:r-x" in want
    assert "run/step-1/sub drwxr-s--- nobody" in want and "user.bin=0sAP8Q" in want
    run("tar", "-C", mounted.path, "-x", *flags, "-f", tar)
    assert show(mounted.path) == want
    mounted.remount()
    assert show(mounted.path) == want
    shutil.rmtree(mounted / "run")
    r = subprocess.run(["cp", "-a", str(tmp_path / "src" / "run"), str(mounted.path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert show(mounted.path) == show(tmp_path / "src")


#: what a checkpoint sync changes between two runs of rsync: bytes inside a large file, an
#: append, a truncation (of a hard-linked file), a deleted symlink, a new file, a mode, a time
CHANGE = r"""
set -e
cd "$1"
python3 - <<'PY'
import os
with open("run/step-1/big.bin", "r+b") as f:
    f.seek(1_500_000); f.write(os.urandom(4096))
    f.seek(0, 2); f.write(os.urandom(70_000))
with open("run/step-1/shard-0.distcp", "r+b") as f:
    f.truncate(100_000)
PY
echo more >> run/config.json; rm run/step-2/prev; head -c 5000 /dev/urandom > run/step-2/new
chmod 600 run/step-2/new; touch -d 2021-03-03 run/step-1/big.bin
"""


def test_rsync_into_the_mount_and_an_in_place_delta_update_keep_everything(tmp_path, mounted):
    """``rsync -aHAX`` of a run directory (xattrs, ACLs, a hard link, a symlink, a fifo,
    set-ID entries of other owners, a hole) into the mount; then the source changes and
    ``rsync --inplace --no-whole-file --delete`` updates the copy by rsync's delta algorithm
    (writes into the middle of existing files, truncation of a hard-linked file, removal):
    the copy equals the source at each step, after a remount too, a checksum dry run finds
    nothing to send, and a copy back out of the mount equals the source.  (rsync 3.5 left the
    times of entries made within the second before a copy at the time of the copy, on ext4
    as here: the source is a second old before each copy.)"""
    if shutil.which("rsync") is None:
        missing("rsync not installed")
    src = tmp_path / "src"
    src.mkdir()
    run("bash", "-c", TREE + "head -c 3000000 /dev/urandom > run/step-1/big.bin\n", "t", src)
    show = lambda d: run("bash", "-c", SHOW, "show", d).stdout     # noqa: E731
    sync = ("rsync", "-aHAX", "--delete")
    time.sleep(1.1)
    run(*sync, f"{src}/run/", f"{mounted.path}/run/")
    want = show(src)
    assert "user:nobody:r--" in want and "user.bin=0sAP8Q" in want
    assert show(mounted.path) == want
    run("bash", "-c", CHANGE, "change", src)
    time.sleep(1.1)
    r = run(*sync, "--inplace", "--no-whole-file", "--stats", f"{src}/run/",
            f"{mounted.path}/run/")
    assert "Matched data: 0 bytes" not in r.stdout, r.stdout      # rsync's delta ran
    want = show(src)
    assert show(mounted.path) == want
    mounted.remount()
    assert show(mounted.path) == want
    quiet = run(*sync, "-c", "-n", "-i", f"{src}/run/", f"{mounted.path}/run/").stdout
    assert quiet == "", quiet
    back = tmp_path / "back"
    back.mkdir()
    run(*sync, f"{mounted.path}/run/", f"{back}/run/")
    assert show(back).replace(str(back), "") == want.replace(str(src), "")
    mounted.umount()
    assert "0 problems" in run("retainzfs", "fsck", mounted.img).stdout
