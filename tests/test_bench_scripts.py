"""The side-by-side benchmarks of issue 10 run end to end (small sizes): ``bench_io.py`` and
``bench_dcp.py`` mount, measure both sides, print every figure with a finite ratio, unmount and
leave nothing behind.  The figures themselves are not asserted (they are the machine's); a
benchmark that no longer runs, or drops a figure, fails here."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


def _run(script: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args, "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_bench_io_prints_every_figure_and_the_disk_bound(tmp_path):
    res = _run("bench_io.py", "--size", "32M", "--rounds", "1", "--workdir", str(tmp_path))
    assert set(res["figures"]) == {"seq_write_fsync", "cold_seq_read", "8_writers", "8_readers",
                                   "random_4k_mmap_read", "small_files_2000",
                                   "small_files_2000_4procs", "small_files_2000_cold_read"}
    for k, v in res["figures"].items():
        assert v["retainzfs_s"] > 0 and v["plain_s"] > 0, (k, v)
        assert math.isfinite(v["ratio"]) and v["ratio"] > 0, (k, v)
    d = res["daemon"]
    assert d["peak_rss_mib"] > 0 and d["write_cpu_s_per_gib"] > 0, d
    assert d["8w_device_writes_in_flight"] > 0, d        # status counted the 8 writers' writes
    c = res["odirect_ceiling_s"]                          # /var/tmp-like ext4: O_DIRECT works
    assert c is not None and c["8_writers"] > 0 and c["8_readers"] > 0, c
    assert _mounts_under(tmp_path) == [] and os.listdir(tmp_path) == []


def test_bench_dcp_saves_and_loads_with_real_dcp(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    res = _run("bench_dcp.py", "--size", "24M", "--rounds", "1", "--workdir", str(tmp_path),
               "--ceiling")                 # and the C passthrough: one_round checks its bytes
    assert set(res["figures"]) == {f"dcp_{op}_threads{t}" for op in ("save", "load")
                                   for t in (1, 4)}
    for k, v in res["figures"].items():
        assert v["retainzfs_s"] > 0 and v["plain_s"] > 0, (k, v)
        assert math.isfinite(v["time_ratio"]) and v["time_ratio"] > 0, (k, v)
        for c in ("c_pass", "c_direct"):
            assert v[f"{c}_s"] > 0 and math.isfinite(v[f"{c}_ratio"]), (k, v)
    assert res["daemon_peak_rss"] > 0
    assert _mounts_under(tmp_path) == [] and os.listdir(tmp_path) == []


def test_profile_small_files_runs_the_handlers_and_counts_calls(tmp_path):
    """The in-process small-file profile drives fs.Operations end to end (a file left behind or
    a handler that fails ends it) and reports a cost and a call count per file."""
    res = _run("profile_small_files.py", "--files", "60", "--rounds", "1", "--top", "0",
               "--workdir", str(tmp_path))
    assert res["files"] == 60
    assert res["cpu_us_per_file"] > 0 and res["python_calls_per_file"] > 50, res
    assert os.listdir(tmp_path) == []


def test_profile_small_files_compares_trees_through_real_mounts(tmp_path):
    """``--mount``: the daemon of each tree mounts a fresh image, the files go through it,
    each tree gets a time and a daemon CPU per file per round, nothing stays mounted."""
    res = _run("profile_small_files.py", "--mount", str(REPO), ".", "--files", "40",
               "--rounds", "2", "--workdir", str(tmp_path))
    assert set(res) == {str(REPO), "."}
    for v in res.values():
        assert len(v["wall_us"]) == 2 and min(v["wall_us"]) > 0 and min(v["cpu_us"]) > 0, v
    assert _mounts_under(tmp_path) == [] and os.listdir(tmp_path) == []
