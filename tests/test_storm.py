"""Six threads mutate files at once -- create in odd chunk sizes, truncate (shrink and extend),
overwrite in place, rename over each other, unlink, read back -- fsyncing as they go; the
daemon is killed with -9 in the middle.  After ``fsck`` (must be clean) and a remount, every
file whose last change was acknowledged (fsync, or a directory fsync after a rename) holds
exactly the acknowledged bytes.  The fault campaign's writer is one thread of checkpoint
patterns (whole files, appends, renames, rmtree); this is the mix it never makes: several
threads changing files in place, concurrently, when the crash comes.  ``-m campaign``: ~30 s.

Renames are 6 % of the operations: each is made durable by a directory fsync, which flushes
everything, and more of them left too little un-flushed for a power cut to find: a daemon whose
fsync skipped the device flush passed at 15 %, and failed 2 of 3 power cuts at 6 %.
"""
from __future__ import annotations

import errno
import hashlib
import os
import random
import subprocess
import sys
import threading
import time

import pytest

if __name__ != "__main__":                # the storm process itself needs neither
    from conftest import RETAINZFS, lazyfs_target, run

pytestmark = pytest.mark.campaign

MiB = 1 << 20
THREADS = 6
NAMES = 40                       # per thread: files are renamed over and recreated often
GONE = (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO)   # the mount died under the call


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Storm:
    """The threads and what each acknowledged: ``acked[path]`` = sha256 of the contents its
    last acknowledged change left (None once a change of it may have been cut off)."""

    def __init__(self, root: str, seconds: float, journal: str) -> None:
        self.d = os.path.join(root, "d")
        os.makedirs(self.d)
        self.until = time.monotonic() + seconds
        self.lock = threading.Lock()
        self.acked: dict[str, str | None] = {}
        self.jfd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(self, *fields: str) -> None:
        """One journal line (outside the mount; this process may be killed at any time, the
        host is not): ``A path sha`` acknowledged, ``N path`` in flux, ``D path`` gone,
        ``M path`` read back wrong, ``E text`` an unexpected error."""
        os.write(self.jfd, (" ".join(fields) + "\n").encode())

    def _ack(self, path: str, data: bytes | None) -> None:
        with self.lock:
            self.acked[path] = None if data is None else _sha(data)
            self.note("N", path) if data is None else self.note("A", path, self.acked[path])

    def _dir_fsync(self) -> None:
        fd = os.open(self.d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def worker(self, k: int) -> None:
        rng = random.Random(k)
        mine: list[str] = []
        name = lambda: os.path.join(self.d, f"t{k}_{rng.randrange(NAMES)}")   # noqa: E731
        while time.monotonic() < self.until:
            touched: list[str] = []
            try:
                op = rng.random()
                if op < 0.3 or not mine:                   # create, in odd-sized chunks
                    p = name()
                    touched[:] = [p]
                    self._ack(p, None)
                    data = rng.randbytes(rng.choice([0, 1, 4095, 4097, 65536, MiB + 7,
                                                     3 * MiB - 5]))
                    with open(p, "wb") as f:
                        i = 0
                        while i < len(data):
                            step = rng.choice([1000, 4096, 65536, MiB])
                            f.write(data[i:i + step])
                            i += step
                        f.flush()
                        os.fsync(f.fileno())
                    self._ack(p, data)
                    if p not in mine:
                        mine.append(p)
                elif op < 0.36:                            # rename over another name
                    p, q = rng.choice(mine), name()
                    touched[:] = [p, q]
                    if p == q:
                        continue
                    with self.lock:                        # both names in flux until the
                        h = self.acked.get(p)              # directory fsync returns
                        self.acked[p] = self.acked[q] = None
                        self.note("N", p)
                        self.note("N", q)
                    os.rename(p, q)
                    self._dir_fsync()
                    with self.lock:
                        self.acked.pop(p, None)
                        self.note("D", p)
                        self.acked[q] = h
                        self.note("N", q) if h is None else self.note("A", q, h)
                    mine.remove(p)
                    if q not in mine:
                        mine.append(q)
                elif op < 0.55:                            # unlink
                    p = rng.choice(mine)
                    touched[:] = [p]
                    self._ack(p, None)
                    os.unlink(p)
                    mine.remove(p)
                    with self.lock:
                        self.acked.pop(p, None)
                        self.note("D", p)
                elif op < 0.65:                            # truncate, shrink or extend
                    p = rng.choice(mine)
                    touched[:] = [p]
                    self._ack(p, None)
                    os.truncate(p, rng.randrange(0, 2 * MiB))
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
                        data = f.read()
                    self._ack(p, data)
                elif op < 0.8:                             # read back what was acknowledged
                    p = rng.choice(mine)
                    with self.lock:
                        want = self.acked.get(p)
                    with open(p, "rb") as f:
                        got = _sha(f.read())
                    if want is not None and got != want:
                        self.note("M", p)
                else:                                      # overwrite in place
                    p = rng.choice(mine)
                    touched[:] = [p]
                    self._ack(p, None)
                    with open(p, "r+b") as f:
                        size = os.fstat(f.fileno()).st_size
                        f.seek(rng.randrange(0, max(1, min(size, 3 * MiB))))
                        f.write(rng.randbytes(rng.randrange(1, 300_000)))
                        f.flush()
                        os.fsync(f.fileno())
                        f.seek(0)
                        data = f.read()
                    self._ack(p, data)
            except OSError as e:
                if e.errno in GONE:
                    return                                 # the daemon was killed
                self.note("E", f"thread {k}: {e}".replace("\n", " "))
                for p in touched:
                    self._ack(p, None)
                mine = [p for p in mine if os.path.exists(p)]


def storm_main(root: str, seconds: float, journal: str) -> int:
    """The storm as its own process (``python3 tests/test_storm.py ROOT SECONDS JOURNAL``): the
    test's process must hold no descriptor on the mount, or its own forks (a ``subprocess``
    closing inherited descriptors) would wait on a FLUSH to a frozen daemon."""
    storm = Storm(root, seconds, journal)
    ts = [threading.Thread(target=storm.worker, args=(k,)) for k in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    storm.note("END")
    return 0


def start_storm(root, seconds: float, journal) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, str(root), str(seconds), str(journal)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def read_journal(journal) -> tuple[dict[str, str | None], list[str]]:
    """(path -> acknowledged sha or None, problems the storm saw while it ran)."""
    acked: dict[str, str | None] = {}
    problems = []
    with open(journal) as f:
        for line in f:
            if not line.endswith("\n"):
                break                                      # cut off by the kill
            kind, _, rest = line[:-1].partition(" ")
            if kind == "A":
                path, h = rest.rsplit(" ", 1)
                acked[path] = h
            elif kind == "N":
                acked[rest] = None
            elif kind == "D":
                acked.pop(rest, None)
            elif kind in ("M", "E"):
                problems.append(line.strip())
    return acked, problems


def wait_for_work(journal, proc, at_least_s: float, acked: int, most_s: float) -> float:
    """Wait until the storm has ``acked`` files acknowledged (and ``at_least_s`` have passed),
    so the crash always comes in the middle of real work however slow the machine: CI once got
    29 files in a fixed 4 s where this machine gets 40-54.  Gives up after ``most_s`` (then
    ``verify`` fails on too little work).  Returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        waited = time.monotonic() - t0
        if waited >= most_s or proc.poll() is not None:
            return waited
        if waited >= at_least_s and journal.exists():
            now, _ = read_journal(journal)
            if sum(h is not None for h in now.values()) >= acked:
                return waited
        time.sleep(0.2)


def verify(mnt_desc: str, acked: dict[str, str | None], at_least: int) -> int:
    checked = 0
    for path, h in acked.items():
        if h is None:
            continue
        assert os.path.exists(path), f"{path}: acknowledged, missing after {mnt_desc}"
        with open(path, "rb") as f:
            assert _sha(f.read()) == h, f"{path}: differs from what was acknowledged"
        checked += 1
    assert checked >= at_least, checked                   # the storm did real work first
    return checked


@pytest.mark.parametrize("kill_after,zone_size,limit", [(4.0, "32M", 0), (9.0, "8M", 8)])
def test_threads_changing_files_in_place_survive_kill9(make_image, mount_image, tmp_path,
                                                       kill_after, zone_size, limit):
    """(8 MiB zones with at most 8 open: zones are closed and finished under the threads.)"""
    m = mount_image(make_image(size="2G", zone_size=zone_size, max_open=limit,
                               max_active=limit))
    journal = tmp_path / "storm.journal"
    proc = start_storm(m.path, kill_after + 120, journal)
    try:
        kill_after = wait_for_work(journal, proc, kill_after, 45, kill_after + 90)
        m.kill()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    acked, problems = read_journal(journal)
    assert problems == [], problems[:5]                   # e.g. acknowledged bytes read back wrong
    run("fusermount3", "-uz", m.path, check=False)
    p = run(RETAINZFS, "fsck", m.img, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    m.mount()
    checked = verify("kill -9", acked, 30)
    print(f"storm: {THREADS} threads, kill -9 after {kill_after:.0f} s: {checked} acknowledged "
          f"files verified, fsck clean")


def test_threads_changing_files_in_place_survive_a_power_cut(tmp_path):
    """The same storm on an image inside LazyFS, then the campaign's power cut (freeze the
    daemon, drop every byte the image's file system had not fsynced, kill the daemon and the
    storm, drop again): what was acknowledged is exactly what survives.  Needs
    ``../shared/suites`` (LazyFS)."""
    t = lazyfs_target(tmp_path / "pc")
    journal = tmp_path / "storm.journal"
    try:
        t.setup()
        t.mount()
        proc = start_storm(t.mnt, 150, journal)
        cut_after = wait_for_work(journal, proc, 8, 30, 120)
        t.crash(proc)            # STOP the daemon, cut, KILL it and the storm, cut, fusermount -uz
        acked, problems = read_journal(journal)
        assert problems == [], problems[:5]
        t.fsck("after the power cut")
        t.mount()
        checked = verify("the power cut", acked, 20)
        print(f"storm: {THREADS} threads, power cut after {cut_after:.0f} s: {checked} acknowledged files "
              f"verified, fsck clean")
    finally:
        t.teardown()


if __name__ == "__main__":
    sys.exit(storm_main(sys.argv[1], float(sys.argv[2]), sys.argv[3]))
