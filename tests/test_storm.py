"""Six threads mutate files at once -- create in odd chunk sizes, truncate (shrink and extend),
overwrite in place, rename over each other, unlink, read back -- fsyncing as they go; the
daemon is killed with -9 in the middle.  After ``fsck`` (must be clean) and a remount, every
file whose last change was acknowledged (fsync, or a directory fsync after a rename) holds
exactly the acknowledged bytes.  The fault campaign's writer is one thread of checkpoint
patterns (whole files, appends, renames, rmtree); this is the mix it never makes: several
threads changing files in place, concurrently, when the crash comes.  ``-m campaign``: ~1 min.
"""
from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import time

import pytest

from conftest import RETAINZFS, run

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

    def __init__(self, root: str, seconds: float) -> None:
        self.d = os.path.join(root, "d")
        os.makedirs(self.d)
        self.until = time.monotonic() + seconds
        self.lock = threading.Lock()
        self.acked: dict[str, str | None] = {}
        self.misread: list[str] = []
        self.errors: list[str] = []
        self.current: dict[int, tuple] = {}        # thread -> (op, paths) it was last in

    def _ack(self, path: str, data: bytes | None) -> None:
        with self.lock:
            self.acked[path] = None if data is None else _sha(data)

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
                self.current[k] = (round(op, 3), touched)
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
                elif op < 0.45:                            # rename over another name
                    p, q = rng.choice(mine), name()
                    touched[:] = [p, q]
                    if p == q:
                        continue
                    with self.lock:                        # both names in flux until the
                        h = self.acked.get(p)              # directory fsync returns
                        self.acked[p] = self.acked[q] = None
                    os.rename(p, q)
                    self._dir_fsync()
                    with self.lock:
                        self.acked.pop(p, None)
                        self.acked[q] = h
                    mine.remove(p)
                    if q not in mine:
                        mine.append(q)
                elif op < 0.55:                            # unlink
                    p = rng.choice(mine)
                    touched[:] = [p]
                    with self.lock:
                        self.acked[p] = None
                    os.unlink(p)
                    mine.remove(p)
                    with self.lock:
                        self.acked.pop(p, None)
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
                        self.misread.append(p)
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
                self.errors.append(f"thread {k}: {e}")
                for p in touched:
                    self._ack(p, None)
                mine = [p for p in mine if os.path.exists(p)]


@pytest.mark.parametrize("kill_after,zone_size,limit", [(4.0, "32M", 0), (9.0, "8M", 8)])
def test_threads_changing_files_in_place_survive_kill9(make_image, mount_image, kill_after,
                                                       zone_size, limit):
    """(8 MiB zones with at most 8 open: zones are closed and finished under the threads.)"""
    m = mount_image(make_image(size="2G", zone_size=zone_size, max_open=limit,
                               max_active=limit))
    storm = Storm(str(m.path), seconds=kill_after + 6)
    ts = [threading.Thread(target=storm.worker, args=(k,)) for k in range(THREADS)]
    for t in ts:
        t.start()
    time.sleep(kill_after)
    m.kill()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert storm.misread == [], storm.misread[:5]          # acknowledged bytes, read back
    assert storm.errors == [], storm.errors[:5]
    run("fusermount3", "-uz", m.path, check=False)
    p = run(RETAINZFS, "fsck", m.img, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    m.mount()
    checked = 0
    for path, h in storm.acked.items():
        if h is None:
            continue
        assert os.path.exists(path), (f"{path}: acknowledged, missing after kill -9 "
                                      f"(in flight: {storm.current})")
        with open(path, "rb") as f:
            assert _sha(f.read()) == h, f"{path}: differs from what was acknowledged"
        checked += 1
    assert checked >= 50, checked                         # the storm did real work first
    print(f"storm: {THREADS} threads, kill -9 after {kill_after:.0f} s: {checked} acknowledged "
          f"files verified, fsck clean")
