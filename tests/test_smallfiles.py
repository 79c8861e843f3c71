"""Small-file fast paths of the FUSE adapter (issue 10, small-files figure).

* A lookup that finds nothing is cached by the kernel as a negative dentry (st_ino=0 with an
  entry timeout): a name made through the same mount right after a miss must be visible at once,
  whatever made it.
* FLUSH of a clean file and RELEASE after a close's FLUSH skip the commit (CPU only): the
  file must still be complete, freed when unlinked while open, and its hints/status live.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import time

import pytest
import xattr

from retainzfs import hints as H


def _absent(p) -> None:
    for _ in range(3):                      # the first miss is cached, the next ones hit it
        with pytest.raises(FileNotFoundError):
            os.stat(p)


def test_negative_lookup_does_not_hide_new_names(mounted):
    root = mounted.path
    made = {
        "file": lambda p: open(p, "wb").close(),
        "excl": lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)),
        "dir": lambda p: os.mkdir(p),
        "symlink": lambda p: os.symlink("file", p),
        "fifo": lambda p: os.mkfifo(p),
        "hardlink": lambda p: os.link(os.path.join(root, "file"), p),
        "renamed": lambda p: os.rename(os.path.join(root, "tmp"), p),
    }
    open(os.path.join(root, "tmp"), "wb").close()
    for name, make in made.items():
        p = os.path.join(root, name)
        _absent(p)
        make(p)
        st = os.lstat(p)
        assert st.st_ino, name
        assert name in os.listdir(root)
    assert stat.S_ISDIR(os.stat(os.path.join(root, "dir")).st_mode)
    assert os.readlink(os.path.join(root, "symlink")) == "file"
    assert os.stat(os.path.join(root, "hardlink")).st_nlink == 2
    _absent(os.path.join(root, "tmp"))                # the rename's old name is gone
    # O_EXCL still sees a name that exists, and a removed name is missing again at once
    with pytest.raises(FileExistsError):
        os.open(os.path.join(root, "file"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.unlink(os.path.join(root, "excl"))
    _absent(os.path.join(root, "excl"))
    with open(os.path.join(root, "excl"), "wb") as f:     # and can be made again
        f.write(b"again")
    assert os.stat(os.path.join(root, "excl")).st_size == 5
    # a miss inside a directory, then the directory's new file through a second path
    sub = os.path.join(root, "dir")
    _absent(os.path.join(sub, "late"))
    with open(os.path.join(root, "dir", ".", "late"), "wb") as f:
        f.write(b"x" * 10)
    assert os.stat(os.path.join(sub, "late")).st_size == 10


def test_small_files_sizes_hints_and_release(mounted):
    root = mounted.path
    d = os.path.join(root, "gen")
    os.mkdir(d)
    xattr.setxattr(d, H.XATTR_BIRTH, b"5")
    xattr.setxattr(d, H.XATTR_RECLAIM, b"9")
    for i in range(200):
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            f.write(bytes([i % 251]) * (100 + i))
    for i in range(200):
        p = os.path.join(d, f"f{i}")
        assert os.stat(p).st_size == 100 + i
        with open(p, "rb") as f:                  # a read-only open: its FLUSH is clean
            assert f.read() == bytes([i % 251]) * (100 + i)
    h = json.loads(xattr.getxattr(os.path.join(d, "f7"), H.XATTR_HINT))
    assert (h["birth"], h["reclaim"]) == (5, 9)
    st = json.loads(xattr.getxattr(root, H.XATTR_STATUS))
    assert st["files"] >= 200
    # unlinked while open: freed by the RELEASE of the last close (asynchronous)
    live = json.loads(xattr.getxattr(root, H.XATTR_STATUS))["live_bytes"]
    f = open(os.path.join(d, "f0"), "rb")
    os.unlink(os.path.join(d, "f0"))
    assert f.read() == bytes([0]) * 100
    f.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = json.loads(xattr.getxattr(root, H.XATTR_STATUS))
        if now["live_bytes"] < live and now["files"] == st["files"] - 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"unlinked file not freed after close: {now}")
    # everything survives a remount
    mounted.remount()
    assert sorted(os.listdir(d)) == sorted(f"f{i}" for i in range(1, 200))
    for i in (1, 99, 199):
        assert os.stat(os.path.join(d, f"f{i}")).st_size == 100 + i
    h = json.loads(xattr.getxattr(os.path.join(d, "f7"), H.XATTR_HINT))
    assert (h["birth"], h["reclaim"]) == (5, 9)


def test_close_of_a_malformed_policy_still_fails(mounted):
    """A .retainz is validated by its close's FLUSH: never skipped as 'clean'."""
    p = os.path.join(mounted.path, ".retainz")
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"{ not a policy")
    with pytest.raises(OSError) as ei:
        os.close(fd)
    assert ei.value.errno == errno.EINVAL
