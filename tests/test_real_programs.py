"""Programs people keep beside their checkpoints, run whole through a mount: SQLite databases
written by several processes at once (the local stores of experiment trackers and HPO tools:
record locks, a WAL index every process maps shared, fsyncs) and a git repository put through
clone, commits, gc, repack and a worktree -- then an unmount, a remount and each program's own
consistency check.  Found nothing when first run as probes (stop 52); kept because no test
had either shape (the SQLite power-cut test is one writer; git was only run by hand, stop 50).
"""
from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import pytest

from conftest import run

_SQLITE_WRITER = r"""
import os, sqlite3, sys
path, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = sqlite3.connect(path, timeout=120, isolation_level=None)
c.execute("PRAGMA busy_timeout=120000")
for i in range(n):
    c.execute("BEGIN IMMEDIATE")
    c.execute("INSERT INTO t VALUES (?, ?, ?)", (k, i, os.urandom(100 + (i * 613 + k) % 6000)))
    c.execute("COMMIT")
    if i % 40 == 0:                           # readers beside the writers
        c.execute("SELECT count(*), sum(length(b)) FROM t").fetchone()
c.close()
"""


def _table(path) -> tuple[int, str, str]:
    """(rows, digest of every row in key order, integrity_check's answer)."""
    import sqlite3
    c = sqlite3.connect(path)
    try:
        h = hashlib.sha256()
        n = 0
        for k, i, b in c.execute("SELECT k, i, b FROM t ORDER BY k, i"):
            h.update(b"%d.%d." % (k, i) + b)
            n += 1
        return n, h.hexdigest(), c.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["WAL", "DELETE"])
def test_sqlite_written_by_four_processes_at_once_is_whole_after_a_remount(mounted, mode):
    import sqlite3
    db = mounted / "runs.sqlite"
    c = sqlite3.connect(db, isolation_level=None)
    assert c.execute(f"PRAGMA journal_mode={mode}").fetchone()[0].upper() == mode
    c.execute("CREATE TABLE t (k INTEGER, i INTEGER, b BLOB, PRIMARY KEY (k, i))")
    c.close()
    n = 150
    ps = [subprocess.Popen([sys.executable, "-c", _SQLITE_WRITER, str(db), str(k), str(n)])
          for k in range(4)]
    assert [p.wait(timeout=300) for p in ps] == [0, 0, 0, 0]
    rows, digest, ok = _table(db)
    assert (rows, ok) == (4 * n, "ok")
    mounted.remount()
    assert _table(db) == (rows, digest, "ok")


def _git(cwd, *args) -> str:
    return run("git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "gc.auto=0",
               *args, cwd=cwd, timeout=300).stdout


def test_a_git_repository_survives_gc_repack_a_worktree_and_a_remount(mounted, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _git(src, "init", "-q")
    rnd = random.Random(5)
    for c in range(25):                                   # files that grow and change
        for f in range(4):
            with open(src / f"f{f}.txt", "a") as fh:
                fh.write("".join(rnd.choice("abcdefgh\n") for _ in range(rnd.randrange(1, 9000))))
        (src / f"bin{c % 3}").write_bytes(rnd.randbytes(rnd.randrange(1, 300_000)))
        _git(src, "add", "-A")
        _git(src, "commit", "-qm", f"c{c}")
    repo = mounted / "repo"
    _git(tmp_path, "clone", "-q", "--no-hardlinks", str(src), str(repo))
    for c in range(15):                                   # commits made on the mount
        with open(repo / "log.txt", "a") as fh:
            fh.write(f"line {c}\n" * (c + 1))
        _git(repo, "add", "log.txt")
        _git(repo, "commit", "-qm", f"m{c}")
    _git(repo, "gc", "-q", "--aggressive", "--prune=now")
    _git(repo, "repack", "-adfq")
    _git(repo, "worktree", "add", "-q", str(mounted / "wt"), "HEAD~10")
    _git(repo, "fsck", "--full", "--strict", "--no-dangling")
    head = _git(repo, "rev-parse", "HEAD")
    index = _git(repo, "ls-files", "-s")
    mounted.remount()
    _git(repo, "fsck", "--full", "--strict", "--no-dangling")
    assert _git(repo, "rev-parse", "HEAD") == head
    assert _git(repo, "ls-files", "-s") == index
    assert _git(repo, "status", "--porcelain") == ""
    assert _git(mounted / "wt", "status", "--porcelain") == ""
    assert len(_git(repo, "log", "--oneline").splitlines()) == 40
    assert (repo / "f2.txt").read_bytes() == (src / "f2.txt").read_bytes()
