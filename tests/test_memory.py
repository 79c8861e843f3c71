"""The daemon's buffers sized to the memory limit it runs under (``retainzfs.memory``): the
cgroup parsing and the plan as units, then a real mount in a real memory cgroup."""
from __future__ import annotations

import pathlib
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run
from retainzfs import memory as M

MiB = 1 << 20


def _tree(root: pathlib.Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


def test_cgroup_v1_limit_is_the_smallest_on_the_path(tmp_path):
    root = _tree(tmp_path, {
        "proc/self/cgroup": "9:name=systemd:/\n4:memory:/pods/a/ctr\n1:cpu:/\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        "sys/fs/cgroup/memory/pods/memory.limit_in_bytes": str(512 * MiB),
        "sys/fs/cgroup/memory/pods/a/memory.limit_in_bytes": str(300 * MiB),
        "sys/fs/cgroup/memory/pods/a/ctr/memory.limit_in_bytes": "9223372036854771712",
        "proc/meminfo": "MemTotal:       24000000 kB\nMemFree: 1 kB\n",
    })
    assert M.cgroup_limit(root) == (300 * MiB, "/pods/a")
    b = M.detect(root)
    assert (b.limit, b.source) == (300 * MiB, "cgroup /pods/a")
    assert b.dirty_bytes < M.DIRTY_MAX and b.pool_bytes is not None


def test_cgroup_v2_max_and_host_memory(tmp_path):
    root = _tree(tmp_path, {
        "proc/self/cgroup": "0::/system.slice/job.service\n",
        "sys/fs/cgroup/system.slice/memory.max": "max",
        "sys/fs/cgroup/system.slice/job.service/memory.max": str(200 * MiB),
        "proc/meminfo": "MemTotal:       24000000 kB\n",
    })
    assert M.cgroup_limit(root) == (200 * MiB, "/system.slice/job.service")
    # no cgroup limit: the host's memory, and at FULL or more every default
    (tmp_path / "sys/fs/cgroup/system.slice/job.service/memory.max").write_text("max\n")
    b = M.detect(root)
    assert (b.limit, b.source) == (24000000 * 1024, "host memory")
    assert b == M.plan(24000000 * 1024, "host memory") and b.pool_bytes is None
    assert (b.dirty_bytes, b.readahead_files, b.fuse_threads) == (
        M.DIRTY_MAX, M.READAHEAD_FILES, M.THREADS_MAX)
    # a small host limits like a cgroup; garbage and missing files are no limit
    (tmp_path / "proc/meminfo").write_text("MemTotal:       262144 kB\n")
    assert M.detect(root).limit == 256 * MiB
    (tmp_path / "sys/fs/cgroup/system.slice/memory.max").write_text("lots\n")
    (tmp_path / "proc/meminfo").unlink()
    assert M.cgroup_limit(root) is None and M.detect(root) == M.plan(None)


@settings(max_examples=200, deadline=None)
@given(st.integers(1 * MiB, 4 << 30), st.integers(1 * MiB, 4 << 30),
       st.integers(0, 512 * MiB), st.integers(0, 512 * MiB))
def test_the_plan_fits_the_limit_and_grows_with_it(a, b, base, more):
    """More memory never gets smaller buffers, nor does a smaller daemon; below FULL the
    pools at their fullest fit the limit with the daemon's own (when that leaves room)."""
    lo, hi = sorted((a, b))
    p, q = M.plan(lo, base=base + more), M.plan(hi, base=base)
    for f in ("dirty_bytes", "readahead_files", "fuse_threads"):
        assert getattr(p, f) <= getattr(q, f), f
    assert 4 * MiB <= p.dirty_bytes <= M.DIRTY_MAX and p.dirty_bytes % MiB == 0
    assert 1 <= p.readahead_files <= M.READAHEAD_FILES and 8 <= p.fuse_threads <= M.THREADS_MAX
    if lo >= M.FULL:
        assert p.pool_bytes is None
        return
    assert 4 * MiB <= p.pool_bytes <= M.POOL_MAX
    if lo >= M.TIGHT and lo - p.base >= 96 * MiB:   # (the minimums alone take ~24 MiB)
        worst = (p.base + p.dirty_bytes + p.readahead_files * M.READAHEAD_FILE
                 + p.fuse_threads * M.THREAD_BYTES + p.pool_bytes)
        assert worst <= lo, (lo, p)


# ------------------------------------------------------------------ a real memory cgroup

def _oom_kills(d: pathlib.Path) -> int:
    for name in ("memory.oom_control", "memory.events"):
        try:
            for line in (d / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except OSError:
            continue
    return 0


def test_a_daemon_under_a_memory_limit_sizes_its_buffers_to_it(cgroup, make_image, mount_image):
    """16 writers and 8 readers of 128 MiB files through a daemon in a 256 MiB memory cgroup.
    Before, the daemon reached ~335 MiB on this load (its buffers were sized for the host):
    the OOM killer ended it within a second and every process got ENOTCONN.  Now it reads the
    limit at mount, sizes write buffers, readahead, FUSE threads and its buffer pool to it,
    says so in ``status``, and the load completes with every byte right."""
    limit = 256 * MiB
    d = cgroup("memory", "memory.limit_in_bytes", "memory.max", limit)
    m = mount_image(make_image("8G", "64M"), cgroup=d)
    mnt = m.path
    assert m.status().get("tuning", {}).get("memory")
    mem = m.status()["tuning"]["memory"]
    assert mem["limit"] == limit and mem["source"].startswith("cgroup /")
    # the daemon's own: what it held with the metadata loaded, and room to grow
    assert M.BASE <= mem["base"] < 128 * MiB
    assert mem == M.plan(limit, mem["source"], mem["base"]).as_dict()
    assert m.status()["tuning"]["dirty_bytes"] == mem["dirty_bytes"] < M.DIRTY_MAX
    kills = _oom_kills(d)
    size = 128
    for i in range(8):                 # the readers' files, then out of every cache
        with open(mnt / f"r{i}", "wb") as f:
            for _ in range(size):
                f.write(bytes([i]) * MiB)
    run("sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches")
    errors: list = []

    def write(i: int) -> None:
        try:
            with open(mnt / f"w{i}", "wb") as f:
                for _ in range(size):
                    f.write(bytes([100 + i]) * MiB)
        except OSError as e:
            errors.append(("write", i, e))

    def read(i: int) -> None:
        try:
            with open(mnt / f"r{i}", "rb") as f:
                n = 0
                while chunk := f.read(MiB):
                    n += chunk.count(bytes([i]))
                if n != size * MiB:
                    errors.append(("read", i, n))
        except OSError as e:
            errors.append(("read", i, e))
    ts = ([threading.Thread(target=write, args=(i,)) for i in range(16)]
          + [threading.Thread(target=read, args=(i,)) for i in range(8)])
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]
    assert _oom_kills(d) == kills, "the daemon's cgroup saw an OOM kill"
    assert m.status()["daemon"]["peak_rss_bytes"] < limit
    assert "memory limit" in run("retainzfs", "status", mnt).stdout
    m.remount()                        # (outside the cgroup now: every byte is there)
    for i in range(16):
        with open(mnt / f"w{i}", "rb") as f:
            assert f.read().count(bytes([100 + i])) == size * MiB
