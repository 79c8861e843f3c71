"""Prometheus metrics: `-o metrics=127.0.0.1:PORT`, scraped over loopback during a save."""
from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import MOUNT, run

MiB = 1 << 20
NEEDED = {"retainzfs_zones", "retainzfs_live_bytes", "retainzfs_invalid_bytes",
          "retainzfs_tail_bytes", "retainzfs_free_bytes", "retainzfs_reclaimable_bytes",
          "retainzfs_zone_resets",
          "retainzfs_gc_copied_bytes", "retainzfs_host_write_amplification",
          "retainzfs_commit_seconds", "retainzfs_enospc", "retainzfs_checksum_errors",
          "retainzfs_read_errors",
          "retainzfs_gc_aborted", "retainzfs_daemon_peak_resident_bytes",
          "retainzfs_capacity_stop", "retainzfs_metadata_full", "retainzfs_device_error",
          "retainzfs_buffered_bytes",
          "retainzfs_io_buffer_pool_bytes", "retainzfs_io_buffer_live_bytes",
          "retainzfs_io_buffer_peak_live_bytes", "process_resident_memory_bytes",
          "process_cpu_seconds"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        out[fam.name] = fam
    return out


def _listening_on_loopback_only(port: int) -> bool:
    want = f":{port:04X}"
    addrs = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, st = line.split()[1], line.split()[3]
        if st == "0A" and local.endswith(want):              # LISTEN
            addrs.append(local.split(":")[0])
    return addrs == ["0100007F"]


def test_metrics_during_a_save(image, mount_image):
    port = _free_port()
    m = mount_image(image, options=f"metrics={port}")
    assert _listening_on_loopback_only(port)
    stop = threading.Event()

    def saver():
        i = 0
        while not stop.is_set():
            d = m / f"step-{i}"
            d.mkdir()
            with open(d / "shard", "wb") as f:
                f.write(os.urandom(6 * MiB))
                os.fsync(f.fileno())
            if i >= 2:
                import shutil
                shutil.rmtree(m / f"step-{i - 2}")
            i += 1

    t = threading.Thread(target=saver)
    t.start()
    try:
        time.sleep(1.5)
        fams = _scrape(port)                                # while the save runs
    finally:
        stop.set()
        t.join()
    assert NEEDED <= set(fams), NEEDED - set(fams)
    live = fams["retainzfs_live_bytes"].samples[0].value
    assert live > 0
    hist = {s.name: s.value for s in fams["retainzfs_commit_seconds"].samples
            if not s.labels.get("le")}
    assert hist["retainzfs_commit_seconds_count"] > 0
    assert fams["retainzfs_metadata_full"].samples[0].value == 0
    assert fams["retainzfs_device_error"].samples[0].value == 0
    zones = {s.labels["condition"]: s.value for s in fams["retainzfs_zones"].samples}
    assert sum(zones.values()) == 256
    rss = fams["process_resident_memory_bytes"].samples[0].value
    peak = fams["retainzfs_daemon_peak_resident_bytes"].samples[0].value
    assert 10 * MiB < rss <= peak < 1024 * MiB                    # the daemon's, not ours
    fams = _scrape(port)
    assert fams["retainzfs_zone_resets"].samples[0].value > 0      # rmtree emptied zones


def test_status_reports_the_daemon_memory_cpu_and_threads(image, mount_image):
    """``status`` of a mount says how much memory and CPU the daemon has used (found needed in
    stop 13: the daemon grew without bound and nothing an operator looks at showed it); a
    status of an unmounted image opens the store itself and has no daemon to report."""
    import json
    m = mount_image(image)
    with open(m / "f", "wb") as f:
        f.write(os.urandom(8 * MiB))
    d = m.status()["daemon"]
    assert d["pid"] == m.pid
    with open(f"/proc/{m.pid}/status") as f:
        hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    assert 10 * MiB < d["rss_bytes"] <= d["peak_rss_bytes"] <= hwm
    assert d["threads"] >= 2 and d["cpu_seconds"] > 0 and d["io_buffer_pool_bytes"] >= 0
    # the 8 MiB written went through 1 MiB arenas; they are back in the pool or in use
    assert 0 <= d["io_buffer_live_bytes"] <= d["io_buffer_peak_live_bytes"]
    assert d["io_buffer_peak_live_bytes"] >= MiB
    table = run("retainzfs", "status", m).stdout
    assert f"pid {m.pid}, RSS" in table
    m.umount()
    st = json.loads(run("retainzfs", "status", "--json", image).stdout)
    assert st["daemon"] is None


def test_status_of_a_stopped_daemon_says_so_instead_of_hanging(image, mount_image):
    """A stopped daemon (SIGSTOP, a debugger, a frozen cgroup) makes every request on its
    mount wait; ``retainzfs status`` waited with it, forever, telling the operator nothing.
    It now gives up after ``--timeout`` seconds with one line naming the daemon and its
    state, from the mount table and /proc (a stat of the mountpoint would wait too)."""
    import signal
    m = mount_image(image)
    (m / "f").write_bytes(b"x" * 4096)
    os.kill(m.pid, signal.SIGSTOP)
    try:
        for extra, what in (((), "the status request"), (("--zones",), "the zone map request"),
                            (("--json",), "the status request")):
            t = time.monotonic()
            p = run("retainzfs", "status", *extra, "--timeout", "1.5", m, check=False,
                    timeout=60)
            assert p.returncode == 1 and p.stdout == "", (p.stdout, p.stderr)
            line, = p.stderr.strip().splitlines()
            assert f"no answer to {what} within 1.5 s" in line
            assert f"daemon (pid {m.pid}) is stopped; `kill -CONT {m.pid}`" in line, line
            assert time.monotonic() - t < 30
        # the image named instead of the mountpoint finds the same daemon
        p = run("retainzfs", "status", "--timeout", "1", image, check=False, timeout=60)
        assert p.returncode == 1 and f"pid {m.pid}" in p.stderr, p.stderr
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert "files" in run("retainzfs", "status", "--json", m).stdout
    p = run("retainzfs", "status", "--timeout", "0", m, check=False)
    assert p.returncode == 2 and "--timeout" in p.stderr


def test_bad_metrics_option_and_busy_port(image, tmp_path):
    mnt = tmp_path / "m"
    mnt.mkdir()
    p = run(MOUNT, image, mnt, "-o", "metrics=notaport", check=False)
    assert p.returncode != 0 and "metrics" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run(MOUNT, image, mnt, "-o", f"metrics={port},log={tmp_path / 'l'}", check=False)
        assert p.returncode != 0 and "cannot listen" in p.stderr, p.stderr
