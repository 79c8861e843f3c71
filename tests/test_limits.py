"""The daemon under a thread limit: the worker threads it can start (``retainzfs.workers``) as a
unit, then a real mount in a real pids cgroup (containers set ``pids.max``; threads count)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import run
from retainzfs.workers import Workers

MiB = 1 << 20


@pytest.fixture
def thread_starts_fail_after(monkeypatch):
    """``n`` more thread starts succeed, then each raises as CPython does when clone() fails."""
    real = threading.Thread.start
    left = {"n": 0}

    def start(self):
        if left["n"] <= 0:
            raise RuntimeError("can't start new thread")
        left["n"] -= 1
        real(self)

    def set_left(n: int) -> None:
        left["n"] = n
        monkeypatch.setattr(threading.Thread, "start", start)
    return set_left


@pytest.mark.parametrize("allowed", [0, 1, 3, 4, 9])
def test_workers_run_with_the_threads_that_started(thread_starts_fail_after, caplog, allowed):
    thread_starts_fail_after(allowed)
    w = Workers(4, "rz-test")
    assert w.size == min(allowed, 4)
    assert w.start() == w.size                        # once: no retry at each call
    assert ("of 4 threads started" in caplog.text) == (allowed < 4)
    futs = [w.submit(lambda i=i: i * i) for i in range(50)]
    if allowed == 0:
        assert futs == [None] * 50                    # the caller does the work itself
    else:
        assert [f.result(5) for f in futs] == [i * i for i in range(50)]
    w.shutdown()


def test_workers_drain_their_queue_at_shutdown_and_pass_errors_on():
    w = Workers(2, "rz-test")
    gate = threading.Event()
    done = []

    def job(i: int) -> int:
        gate.wait(5)
        if i == 7:
            raise ValueError("seven")
        done.append(i)
        return i
    futs = [w.submit(job, i) for i in range(20)]
    gate.set()
    w.shutdown(wait=True)
    assert sorted(done) == [i for i in range(20) if i != 7]
    with pytest.raises(ValueError):
        futs[7].result(0)
    assert w.submit(job, 1) is None                   # shut down: the caller does it
    w.shutdown(wait=True)                             # twice is harmless


def test_a_daemon_under_a_pids_limit_serves_with_the_threads_it_can_start(cgroup, make_image,
                                                                          mount_image):
    """16 writers (fsynced 24 MiB files, then 150 small files each) and readers through a daemon
    whose cgroup allows 12 tasks.  Before, a background flush started its pool thread at a
    client's write; the start failed there and the write answered EIO as an internal error
    (its bytes already queued), and libfuse wrote "error creating thread" at every request that
    found no idle thread: 3,146 lines in 3 s.  Now the pools start at INIT with what the limit
    allows, and libfuse's repeated message is one line with a count."""
    d = cgroup("pids", "pids.max", "pids.max", 12)
    img = make_image("2G", "16M")
    m = mount_image(img, cgroup=d)
    mnt = m.path
    errors: list = []
    datas = {i: os.urandom(MiB) * 24 for i in range(16)}

    def work(i: int) -> None:
        try:
            with open(mnt / f"f{i}", "wb") as f:
                f.write(datas[i])
                f.flush()
                os.fsync(f.fileno())
            for _ in range(2):
                if (mnt / f"f{i}").read_bytes() != datas[i]:
                    errors.append(("read", i))
            for j in range(150):
                (mnt / f"s{i}_{j}").write_bytes(b"%d" % j)
        except OSError as e:
            errors.append((i, e))
    ts = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]
    assert int((d / "pids.current").read_text()) <= 12
    wk = m.status()["tuning"]["workers"]
    assert wk["readahead"] < wk["readahead_wanted"] == 8 and wk["flush_wanted"] == 4
    assert "threads short" in run("retainzfs", "status", mnt).stdout
    m.umount()
    log = m.daemon_log()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]
    assert "threads started" in log                   # the pools said what they have
    creating = [ln for ln in log.splitlines() if "error creating thread" in ln]
    minutes = (time.monotonic() - t0) / 60 + 1
    assert 1 <= len(creating) <= 2 * minutes + 2, creating[:5]
    assert any("more times" in ln for ln in creating) or len(creating) == 1
    m.mount()                                         # outside the cgroup now
    for i in range(16):
        assert (mnt / f"f{i}").read_bytes() == datas[i]
        assert (mnt / f"s{i}_149").read_bytes() == b"149"
    m.umount()
    assert "0 problems" in run("retainzfs", "fsck", img).stdout
