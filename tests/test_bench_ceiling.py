"""scripts/bench_fuse_ceiling.py: the null file systems it measures (on pyfuse3, on retainzfs's
own binding, and in C on libfuse's multi-threaded loop), and a small run.

The ceiling it prints is only worth something if the null file system does the same work a
user's program asks of retainzfs (sizes, directory entries, reads of the whole file, rmtree),
so that is checked on a real mount of it, then the script runs end to end with small files.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "scripts" / "bench_fuse_ceiling.py"


def _mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


@pytest.fixture(params=["pyfuse3", "rz_binding", "c_mt"])
def nullfs(tmp_path, request):
    """Each null file system the script measures, mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if request.param == "pyfuse3":
        cmd = [sys.executable, str(BENCH), "--serve", str(mnt)]
    elif request.param == "rz_binding":
        cmd = [sys.executable, str(BENCH), "--serve-binding", str(mnt)]
    else:
        sys.path.insert(0, str(BENCH.parent))
        from bench_fuse_ceiling import build_c
        exe = build_c(str(tmp_path))
        assert exe, "scripts/nullfs_mt.c did not build (cc, pkg-config fuse3)"
        cmd = [exe, str(mnt)]
    err = tmp_path / "daemon.err"
    with open(err, "w") as errf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True)
    try:
        assert p.stdout.readline().strip() == "OK"
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        p.wait(timeout=30)
    # a handler the null file system lacks is a request never answered (stop 50: releasedir)
    log = err.read_text()
    assert "Exception ignored" not in log and "Traceback" not in log, log[-3000:]


def test_the_null_file_system_answers_what_the_figures_ask(nullfs):
    d = os.path.join(nullfs, "small")
    os.mkdir(d)
    for i in range(50):
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            f.write(b"x" * 100)
    assert sorted(os.listdir(d)) == sorted(f"f{i}" for i in range(50))
    assert all(os.stat(os.path.join(d, f"f{i}")).st_size == 100 for i in range(50))
    big = os.path.join(nullfs, "big")
    n = 5 * (1 << 20) + 4097                      # past the 1 MiB reply buffer, odd tail
    with open(big, "wb") as f:
        for _ in range(5):
            f.write(os.urandom(1 << 20))
        f.write(b"y" * 4097)
        os.fsync(f.fileno())
    assert os.stat(big).st_size == n
    with open(big, "rb") as f:
        assert len(f.read()) == n                 # every byte answered, none past the end
    with open(big, "wb"):                         # O_TRUNC
        pass
    assert os.stat(big).st_size == 0
    shutil.rmtree(d)
    os.unlink(big)
    assert os.listdir(nullfs) == []


def test_the_script_prints_a_ceiling_for_every_bench_io_figure(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--size", "16M", "--rounds", "1", "--json",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert set(res["figures"]) == {"seq_write_fsync", "cold_seq_read", "8_writers", "8_readers",
                                   "random_4k_mmap_read", "small_files_2000",
                                   "small_files_2000_4procs", "small_files_2000_cold_read"}
    assert set(res["daemons"]) == {"pyfuse3", "rz_binding", "c_mt"}
    for k, v in res["figures"].items():
        assert v["plain_s"] > 0, (k, v)
        for kind in ("pyfuse3", "rz_binding", "c_mt"):
            assert math.isfinite(v[f"{kind}_ratio"]) and v[f"{kind}_ratio"] > 0, (k, kind, v)
            assert v[f"{kind}_s"] > 0, (k, kind, v)
    time.sleep(0.2)
    assert not any(_mounted(str(p)) for p in tmp_path.glob("bench_ceiling.*/mnt"))
    assert not list(tmp_path.glob("bench_ceiling.*"))          # its work directory is gone
