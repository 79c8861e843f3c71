#!/usr/bin/env python3
"""The device layer's O_DIRECT block path against dd, side by side, alternating (issue 10).

``--host``: this host has no zoned block device, so the same O_DIRECT code that
``BlockZonedDevice`` runs (``retainzfs.device._DirectIO``: zero copy where the kernel takes the
caller's memory, else aligned bounce buffers) is driven through
``ImageZonedDevice(path, direct=True)`` on a regular file: N MiB written sequentially across
zones with ``dev.write(zone, wp, buf)`` and 1 MiB buffers, then ``dev.flush()``; versus
``dd if=/dev/zero of=FILE bs=1M count=N oflag=direct conv=fsync`` on the same file system.
Then a cold read of everything with ``dev.read`` (1 MiB requests) versus
``dd if=FILE of=/dev/null bs=1M iflag=direct``.  Fresh image / fresh dd file every round.

``--qemu``: the same pair inside the QEMU TCG guest of ``scripts/qemu_zns.py`` on its real
zoned namespace (/dev/nvme0n1): ``BlockZonedDevice`` write/read versus dd ``oflag=direct`` /
``iflag=direct`` on the same namespace, every zone reset (``blkzone reset``) before each
write.  dd writes the whole range in one sequential stream when zone capacity == zone size
(each 1 MiB write lands at its zone's write pointer), else one dd per zone (``seek`` at the
zone start, ``count`` = capacity, ``conv=fsync`` on the last one only; each dd pays its
own first touch of its buffer, which costs real time under TCG).  An untimed warm-up of both sides runs first
(TCG translates each code path on its first run).  ``--guest`` is that inner half (run by
``--qemu``).  Under TCG every CPU instruction of either side is emulated, so the guest
figures weigh CPU work (copies, Python) far more than a real NVMe host would.

Printed: MiB/s of each side (median over ``--rounds`` alternating rounds), the ratio
retainzfs / dd (higher is better, 1.0 = as fast as dd) for write and read, and CPU seconds
per GiB of the Python process (and of dd); whether writes and reads ran zero copy; two
diagnostic rows (the same offsets as raw aligned pwrite/pread, no copy, no zone bookkeeping)
that show what the copies cost.  Then an untimed bit-exact check of the O_DIRECT
path (odd-sized writes, chunk-crossing writes, unaligned reads, a buffered reopen).  The last
line is ``RESULT {json}``.

    python3 scripts/bench_block.py --host                  # 1024 MiB, 2 rounds, /var/tmp
    python3 scripts/bench_block.py --host --size 256 --rounds 3
    python3 scripts/bench_block.py --qemu                  # 192 MiB on a 256 MiB namespace
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from benchutil import drop_caches  # noqa: E402
from retainzfs import device as D  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
REQ = MiB
TARGET = 0.9


# -- measurement helpers -------------------------------------------------------------------

def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Timer:
    """Wall seconds and this process's CPU seconds (all threads), or waited children's."""

    def __init__(self, children: bool = False):
        self.children = children

    def _cpu(self) -> float:
        return _child_cpu() if self.children else time.process_time()

    def __enter__(self):
        self.c0, self.t0 = self._cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = self._cpu() - self.c0


_DD_SECONDS = re.compile(r"copied, ([0-9.]+(?:e-?[0-9]+)?) s")


def run_dd(*args: str) -> float:
    """Run dd; return the seconds dd itself reports (its copy loop incl. conv=fsync, without
    exec and dynamic loading -- seconds of the guest's wall clock under TCG)."""
    p = subprocess.run(["dd", *args], capture_output=True, text=True,
                       env={**os.environ, "LC_ALL": "C"})
    if p.returncode:
        raise RuntimeError(f"dd {' '.join(args)}: rc {p.returncode}: {p.stderr.strip()}")
    m = _DD_SECONDS.search(p.stderr)
    if not m:
        raise RuntimeError(f"dd {' '.join(args)}: no transfer summary in {p.stderr.strip()!r}")
    return float(m.group(1))


def dd_startup() -> dict:
    """Wall and CPU seconds of a dd that copies nothing (exec, loading, exit): the part of a
    dd run that is not its copy loop; median of 3."""
    walls, cpus = [], []
    for _ in range(3):
        with Timer(children=True) as t:
            run_dd("if=/dev/zero", "of=/dev/null", "bs=1M", "count=0")
        walls.append(t.wall)
        cpus.append(t.cpu)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}


def fs_type(path: str) -> str:
    best, typ = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _src, mnt, t = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, typ = mnt, t
    return typ


# -- the device-layer side -------------------------------------------------------------------

def dev_write(dev: D.ZonedDevice, nbytes: int, buf: bytes, first_zone: int = 0) -> None:
    """``nbytes`` sequentially from ``first_zone`` with 1 MiB writes (shorter at a zone's end)."""
    z, wp, left = first_zone, 0, nbytes
    write = dev.write
    while left:
        cap = dev.zone(z).capacity
        while left and wp < cap:
            k = min(REQ, cap - wp, left)
            write(z, wp, buf if k == REQ else buf[:k])
            wp += k
            left -= k
        z, wp = z + 1, 0
    dev.flush()


def dev_read(dev: D.ZonedDevice, nbytes: int, first_zone: int = 0) -> int:
    """Read back what ``dev_write`` wrote, 1 MiB per ``dev.read``; returns bytes read."""
    z, left, got = first_zone, nbytes, 0
    read = dev.read
    while left:
        cap = dev.zone(z).capacity
        off = 0
        while left and off < cap:
            k = min(REQ, cap - off, left)
            got += len(read(z, off, k))
            off += k
            left -= k
        z += 1
    return got


def dev_write_nocopy(dev: D.ZonedDevice, nbytes: int, abuf) -> None:
    """Diagnostic: the same O_DIRECT pwrites as ``dev_write`` (same offsets, same fd, then
    fsync) straight from a page-aligned buffer: no bounce copy, no zone bookkeeping.  Leaves
    the device's zone cache stale; only for a medium that is thrown away or reset next."""
    fd = dev._dio.fd
    base = getattr(dev, "_data_off", 0)
    z, wp, left = 0, 0, nbytes
    while left:
        cap = dev.zone(z).capacity
        while left and wp < cap:
            k = min(REQ, cap - wp, left)
            if os.pwrite(fd, abuf if k == REQ else abuf[:k], base + (z << dev._zshift) + wp) != k:
                raise OSError("short write")
            wp += k
            left -= k
        z, wp = z + 1, 0
    os.fsync(fd)


def dev_read_nocopy(dev: D.ZonedDevice, nbytes: int, first_zone: int = 0) -> int:
    """Diagnostic: the same aligned O_DIRECT preads as ``dev_read`` into the bounce buffer,
    without the copy-out into the ``bytes`` that ``dev.read`` returns (nor its checks)."""
    dio = dev._dio
    base = getattr(dev, "_data_off", 0)
    buf = dio._read_buf()
    z, left, got = first_zone, nbytes, 0
    while left:
        cap = dev.zone(z).capacity
        off = 0
        while left and off < cap:
            k = min(REQ, cap - off, left)
            dio._pread_exact(buf, k, base + (z << dev._zshift) + off)
            got += k
            off += k
            left -= k
        z += 1
    return got


# -- host: ImageZonedDevice(direct=True) on a regular file vs dd on the same file system ------

def host_round(work: str, nbytes: int, zone_size: int, buf: bytes, order: tuple[str, str],
               startup: dict) -> dict:
    out: dict = {}
    abuf = aligned_copy(buf)
    img, ddf = os.path.join(work, "img.zns"), os.path.join(work, "dd.raw")
    nzones = max(4, -(-nbytes // zone_size))
    for side in order:
        if side == "retainzfs":
            D.create_image(img, nzones * zone_size, zone_size, force=True).close()
            drop_caches()
            with D.ImageZonedDevice(img, direct=True) as dev:
                with Timer() as w:
                    dev_write(dev, nbytes, buf)
                zc_write = dev._dio.zero_copy_write
            drop_caches()
            with D.ImageZonedDevice(img, direct=True) as dev:
                with Timer() as r:
                    got = dev_read(dev, nbytes)
                zc_read = dev._dio.zero_copy_read
                drop_caches()
                with Timer() as nc:
                    dev_read_nocopy(dev, nbytes)
            assert got == nbytes, (got, nbytes)
            D.create_image(img, nzones * zone_size, zone_size, force=True).close()
            drop_caches()
            with D.ImageZonedDevice(img, direct=True) as dev:
                with Timer() as wnc:
                    dev_write_nocopy(dev, nbytes, abuf)
            os.unlink(img)
            out[side] = {"write_s": w.wall, "write_cpu": w.cpu, "read_s": r.wall,
                         "read_cpu": r.cpu, "read_nocopy_s": nc.wall, "read_nocopy_cpu": nc.cpu,
                         "write_nocopy_s": wnc.wall, "write_nocopy_cpu": wnc.cpu,
                         "zero_copy": {"write": zc_write, "read": zc_read}}
        else:
            drop_caches()
            with Timer(children=True) as w:
                ws = run_dd("if=/dev/zero", f"of={ddf}", "bs=1M", f"count={nbytes // MiB}",
                            "oflag=direct", "conv=fsync")
            drop_caches()
            with Timer(children=True) as r:
                rs = run_dd(f"if={ddf}", "of=/dev/null", "bs=1M", "iflag=direct")
            os.unlink(ddf)
            out[side] = dd_figures(w, ws, r, rs, 1, startup)
    return out


def aligned_copy(buf: bytes) -> memoryview:
    """``buf`` in page-aligned memory (an anonymous mmap), as O_DIRECT can take it directly."""
    import mmap
    mm = mmap.mmap(-1, len(buf))
    mm[:] = buf
    return memoryview(mm)


def dd_figures(w: Timer, ws: float, r: Timer, rs: float, procs: int, startup: dict) -> dict:
    """dd's figures: seconds as dd reports them (the ratio's basis), wall seconds including
    process start, and CPU net of ``procs`` process starts (gross kept too)."""
    return {"write_s": ws, "write_wall": w.wall, "write_cpu": max(0.0, w.cpu - procs * startup["cpu"]),
            "write_cpu_gross": w.cpu, "read_s": rs, "read_wall": r.wall,
            "read_cpu": max(0.0, r.cpu - procs * startup["cpu"]), "read_cpu_gross": r.cpu,
            "procs": procs}


# -- correctness of the O_DIRECT path (untimed) ------------------------------------------------

# Write sizes (bytes): one block, odd block counts, 1 MiB + blocks, one past the bounce buffer
# (_DIO_CHUNK, 8 MiB), so not a multiple of 1 MiB in most places.  Sizes above the zone
# capacity are left out (the guest's 4 MiB zones; it shrinks the bounce buffer instead).
VERIFY_WRITES = [4096, 3 * 4096, MiB, MiB + 8192, 3 * MiB + 4096, 5 * MiB - 4096,
                 8 * MiB + 4096, 12288]
VERIFY_READS = [(0, 1), (1, 4095), (4095, 2), (4096 * 3 + 17, MiB + 5), (MiB - 3, 8 * MiB + 7)]


def pattern(n: int, seed: int) -> bytes:
    blk = hashlib.sha256(seed.to_bytes(8, "little")).digest() * 2048      # 64 KiB
    reps = -(-n // len(blk))
    out = bytearray(blk * reps)
    for i in range(0, n, 4096):                                         # every block distinct
        out[i:i + 8] = (seed * 1_000_003 + i).to_bytes(8, "little")
    return bytes(out[:n])


def verify_direct(dev_open, first_zone: int = 0, reopen_buffered=None,
                  chunk: int | None = None) -> dict:
    """Write VERIFY_WRITES back to back from zone ``first_zone`` (moving to the next zone when
    one would not fit), then through a fresh open (cold) read every write back, each zone
    whole and at unaligned offsets, and a block past the write pointer (zeros); the same
    through ``reopen_buffered`` (the medium without O_DIRECT) when given.
    ``chunk`` shrinks the bounce buffer (``_DIO_CHUNK``) for these opens.
    Returns {"ok", "bytes", "writes", "sha256", "problems"}.
    """
    saved = D._DIO_CHUNK
    if chunk:
        D._DIO_CHUNK = chunk
    try:
        return _verify(dev_open, first_zone, reopen_buffered)
    finally:
        D._DIO_CHUNK = saved


def _verify(dev_open, first_zone: int, reopen_buffered) -> dict:
    problems: list[str] = []
    pieces: list[tuple[int, int, bytes]] = []            # (zone, offset, data)
    with dev_open() as dev:
        sizes = [n for n in VERIFY_WRITES if n <= dev.zone(first_zone).capacity]
        z, wp = first_zone, 0
        for i, n in enumerate(sizes):
            if wp + n > dev.zone(z).capacity:
                z, wp = z + 1, 0
            data = pattern(n, i + 1)
            src = data if i % 2 else memoryview(b"\0" + data)[1:]    # unaligned source memory
            if dev.write(z, wp, src) != n:
                problems.append(f"write {i} ({n} bytes) short")
            pieces.append((z, wp, data))
            wp += n
            if dev.zone(z).wp != wp:
                problems.append(f"zone {z} wp {dev.zone(z).wp} != {wp} after write {i}")
        dev.flush()
    zones: dict[int, bytes] = {}
    for z, _off, data in pieces:
        zones[z] = zones.get(z, b"") + data
    expect = b"".join(p[2] for p in pieces)

    def check(dev, how: str) -> list:
        for k, (z, off, data) in enumerate(pieces):
            if dev.read(z, off, len(data)) != data:
                problems.append(f"{how}: write {k} ({len(data)} bytes at zone {z} + {off}) "
                                f"reads back different bytes")
        for z, data in zones.items():
            if dev.read(z, 0, len(data)) != data:            # one read across bounce chunks
                problems.append(f"{how}: whole-zone read of zone {z} ({len(data)} bytes) differs")
            for off, n in VERIFY_READS:
                if off + n <= len(data) and dev.read(z, off, n) != data[off:off + n]:
                    problems.append(f"{how}: read zone {z} offset {off} length {n} differs")
            if len(data) + 4096 <= dev.zone(z).capacity and dev.read(z, len(data), 4096).strip(b"\0"):
                problems.append(f"{how}: zone {z}: bytes past the write pointer are not zero")
        return [(dev.zone(z).wp, int(dev.zone(z).cond)) for z in zones]

    with dev_open() as dev:
        states = check(dev, "O_DIRECT")
    if reopen_buffered is not None:
        with reopen_buffered() as dev:
            if getattr(dev, "direct", False):
                problems.append("buffered reopen is still O_DIRECT")
            if check(dev, "buffered reopen") != states:
                problems.append("zone table differs between the O_DIRECT and buffered opens")
    return {"ok": not problems, "bytes": len(expect), "writes": len(pieces),
            "chunk": D._DIO_CHUNK, "sizes": [len(p[2]) for p in pieces],
            "sha256": hashlib.sha256(expect).hexdigest()[:16], "problems": problems}


# -- summary ---------------------------------------------------------------------------------

def summarise(rounds: list[dict], nbytes: int) -> dict:
    figs = {}
    for op in ("write", "read"):
        rz = statistics.median(r["retainzfs"][f"{op}_s"] for r in rounds)
        dd = statistics.median(r["dd"][f"{op}_s"] for r in rounds)
        rzc = statistics.median(r["retainzfs"][f"{op}_cpu"] for r in rounds)
        ddc = statistics.median(r["dd"][f"{op}_cpu"] for r in rounds)
        ddw = statistics.median(r["dd"][f"{op}_wall"] for r in rounds)
        figs[op] = {"retainzfs_MiBps": nbytes / MiB / rz, "dd_MiBps": nbytes / MiB / dd,
                    "ratio": dd / rz, "retainzfs_cpu_s_per_GiB": rzc * GiB / nbytes,
                    "dd_cpu_s_per_GiB": ddc * GiB / nbytes,
                    "dd_wall_MiBps": nbytes / MiB / ddw, "ratio_vs_dd_wall": ddw / rz,
                    "target": TARGET}
    for op in ("write", "read"):
        nc = statistics.median(r["retainzfs"][f"{op}_nocopy_s"] for r in rounds)
        ncc = statistics.median(r["retainzfs"][f"{op}_nocopy_cpu"] for r in rounds)
        dd = statistics.median(r["dd"][f"{op}_s"] for r in rounds)
        figs[f"{op}_nocopy"] = {"retainzfs_MiBps": nbytes / MiB / nc,
                                "dd_MiBps": nbytes / MiB / dd, "ratio": dd / nc,
                                "retainzfs_cpu_s_per_GiB": ncc * GiB / nbytes, "diagnostic": True}
    return figs


def print_table(title: str, figs: dict, rounds: list[dict], nbytes: int) -> None:
    print(title)
    zc = rounds[-1]["retainzfs"]["zero_copy"]
    print(f"  O_DIRECT memory: writes {'zero copy (from the caller' + chr(39) + 's buffer)' if zc['write'] else 'via the bounce buffer'}, "
          f"reads {'zero copy (into the returned bytes)' if zc['read'] else 'via the bounce buffer'}"
          f"{'' if zc['write'] and zc['read'] else ' (the kernel refused the caller' + chr(39) + 's memory alignment)'}")
    for i, r in enumerate(rounds):
        print(f"  round {i + 1} ({r['order']}): " + ", ".join(
            f"{side} w {nbytes / MiB / r[side]['write_s']:.0f} r {nbytes / MiB / r[side]['read_s']:.0f} MiB/s"
            for side in ("retainzfs", "dd")))
    for op, v in figs.items():
        if v.get("diagnostic"):
            what = ("the same O_DIRECT pwrites from a page-aligned buffer (no bounce copy, no "
                    "zone bookkeeping)" if op.startswith("write") else
                    "the same O_DIRECT preads without read()'s copy-out into bytes")
            print(f"  diagnostic, {what}: {v['retainzfs_MiBps']:.1f} MiB/s, ratio "
                  f"{v['ratio']:.2f}, CPU s/GiB {v['retainzfs_cpu_s_per_GiB']:.3f}")
            continue
        ok = "meets" if v["ratio"] >= v["target"] else "below"
        print(f"  {op:5s} retainzfs {v['retainzfs_MiBps']:8.1f} MiB/s   dd {v['dd_MiBps']:8.1f} MiB/s"
              f"   ratio {v['ratio']:.2f} (target >= {v['target']}: {ok})"
              f"   CPU s/GiB retainzfs {v['retainzfs_cpu_s_per_GiB']:.3f} dd {v['dd_cpu_s_per_GiB']:.3f}"
              f"   [dd incl. process start {v['dd_wall_MiBps']:.1f} MiB/s, ratio "
              f"{v['ratio_vs_dd_wall']:.2f}]", flush=True)
    print("  (retainzfs: timed around the device calls; dd: the seconds dd reports for its copy "
          "loop incl. conv=fsync; dd CPU net of a do-nothing dd's; CPU = user+sys)")


def parse_mib(text: str) -> int:
    """'64' (MiB), '64M', '1G' -> bytes; a whole number of MiB."""
    t = str(text).strip()
    if t.isdigit():
        n = int(t) * MiB
    else:
        from retainzfs.cli.common import parse_size
        n = parse_size(t)
    if n <= 0 or n % MiB:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive whole number of MiB")
    return n


def host_main(a) -> int:
    nbytes, zone_size = a.size, a.zone_size
    work = tempfile.mkdtemp(prefix="bench_block.", dir=a.workdir)
    buf = os.urandom(REQ)
    rounds: list[dict] = []
    startup = dd_startup()
    try:
        for i in range(a.rounds):
            order = ("retainzfs", "dd") if i % 2 == 0 else ("dd", "retainzfs")
            r = host_round(work, nbytes, zone_size, buf, order, startup)
            r["order"] = " then ".join(order)
            rounds.append(r)
        img = os.path.join(work, "verify.zns")
        vz = 16 * MiB
        D.create_image(img, 8 * vz, vz).close()
        ver = verify_direct(lambda: D.ImageZonedDevice(img, direct=True),
                            reopen_buffered=lambda: D.ImageZonedDevice(img))
    finally:
        for n in os.listdir(work):
            os.unlink(os.path.join(work, n))
        os.rmdir(work)
    figs = summarise(rounds, nbytes)
    title = (f"host: {nbytes // MiB} MiB, 1 MiB requests, {a.rounds} alternating rounds, "
             f"{a.workdir} ({fs_type(a.workdir)}), kernel {os.uname().release}; retainzfs = "
             f"ImageZonedDevice(direct=True), {zone_size // MiB} MiB zones; ratio = retainzfs/dd")
    print_table(title, figs, rounds, nbytes)
    print(f"verify (O_DIRECT image, {ver['writes']} writes of {ver['sizes']} bytes, bounce "
          f"buffer {ver['chunk'] // MiB} MiB, cold reopen + buffered reopen): "
          f"{'ok' if ver['ok'] else 'FAILED ' + '; '.join(ver['problems'])}")
    res = {"mode": "host", "size": nbytes, "rounds": rounds, "figures": figs, "verify": ver,
           "dd_startup": startup,
           "zone_size": zone_size, "fs": fs_type(a.workdir), "kernel": os.uname().release}
    print("RESULT " + json.dumps(res), flush=True)
    return 0 if ver["ok"] else 1


# -- guest: BlockZonedDevice on the real zoned namespace vs dd on the same namespace ----------

def blkzone_reset(dev: str) -> None:
    p = subprocess.run(["blkzone", "reset", dev], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"blkzone reset {dev}: {p.stderr.strip()}")


def dd_zoned_write(dev: str, nbytes: int, zsize: int, zcap: int, mode: str) -> tuple[float, int]:
    """dd onto the zoned device from zone 0 (all zones reset): (dd's seconds, dd processes).

    ``whole``: one sequential stream (each 1 MiB write is at its zone's write pointer as long
    as capacity == zone size); ``zones``: one dd per zone, from its start, capacity bytes,
    the last with conv=fsync (one device flush in all, as dev_write's single flush).
    """
    if mode == "whole":
        return run_dd("if=/dev/zero", f"of={dev}", "bs=1M", f"count={nbytes // MiB}",
                      "oflag=direct", "conv=fsync"), 1
    left, z, secs = nbytes, 0, 0.0
    while left:
        k = min(left, zcap)
        last = k == left                    # one device flush at the end, like dev.flush()
        secs += run_dd("if=/dev/zero", f"of={dev}", "bs=1M", f"seek={z * zsize // MiB}",
                       f"count={k // MiB}", "oflag=direct", *(["conv=fsync"] if last else []))
        left -= k
        z += 1
    return secs, z


def dd_zoned_read(dev: str, nbytes: int, zsize: int, zcap: int, mode: str) -> tuple[float, int]:
    if mode == "whole":
        return run_dd(f"if={dev}", "of=/dev/null", "bs=1M", f"count={nbytes // MiB}",
                      "iflag=direct"), 1
    left, z, secs = nbytes, 0, 0.0
    while left:
        k = min(left, zcap)
        secs += run_dd(f"if={dev}", "of=/dev/null", "bs=1M", f"skip={z * zsize // MiB}",
                       f"count={k // MiB}", "iflag=direct")
        left -= k
        z += 1
    return secs, z


def guest_main(a) -> int:
    path = a.dev or os.environ.get("RETAINZ_ZNS_DEV")
    if not path:
        print("bench_block: --guest needs --dev or RETAINZ_ZNS_DEV", file=sys.stderr)
        return 2
    with D.BlockZonedDevice(path) as dev:
        zsize, zcap, nz = dev.zone_size, dev.zone_capacity, dev.nr_zones
        geom = {"zone_size": zsize, "zone_capacity": zcap, "nr_zones": nz,
                "max_open": dev.max_open, "max_active": dev.max_active,
                "block_size": dev.block_size}
    if zcap % MiB:
        print(f"bench_block: zone capacity {zcap} is not a whole number of MiB", file=sys.stderr)
        return 2
    nbytes = min(a.size, nz * zcap)           # clamped to the namespace (printed below)
    mode = a.dd_mode if a.dd_mode != "auto" else ("whole" if zcap == zsize else "zones")
    buf = os.urandom(REQ)
    abuf = aligned_copy(buf)
    rounds: list[dict] = []
    notes: list[str] = []
    startup = dd_startup()
    # Untimed warm-up of both sides: under TCG the first run of any code path (the
    # interpreter's loop, ctypes, the kernel's direct-I/O path) pays for its translation.
    warm = min(nbytes, 8 * zcap, 8 * MiB)
    blkzone_reset(path)
    with D.BlockZonedDevice(path) as dev:
        dev_write(dev, warm, buf)
        dev_read(dev, warm)
        dev_read_nocopy(dev, warm)
    blkzone_reset(path)
    with D.BlockZonedDevice(path) as dev:
        dev_write_nocopy(dev, warm, abuf)
    blkzone_reset(path)
    try:
        dd_zoned_write(path, warm, zsize, zcap, mode)
    except RuntimeError as e:
        if mode != "whole":
            raise
        notes.append(f"one sequential dd over the zones failed ({' | '.join(str(e).splitlines())}); "
                     f"one dd per zone instead")
        mode = "zones"
        blkzone_reset(path)
        dd_zoned_write(path, warm, zsize, zcap, mode)
    dd_zoned_read(path, warm, zsize, zcap, mode)
    for i in range(a.rounds):
        order = ("retainzfs", "dd") if i % 2 == 0 else ("dd", "retainzfs")
        r: dict = {"order": " then ".join(order)}
        for side in order:
            blkzone_reset(path)
            drop_caches()
            if side == "retainzfs":
                with D.BlockZonedDevice(path) as dev:
                    with Timer() as w:
                        dev_write(dev, nbytes, buf)
                    zc_write = dev._dio.zero_copy_write
                drop_caches()
                with D.BlockZonedDevice(path) as dev:
                    with Timer() as rd:
                        got = dev_read(dev, nbytes)
                    zc_read = dev._dio.zero_copy_read
                    drop_caches()
                    with Timer() as nc:
                        dev_read_nocopy(dev, nbytes)
                assert got == nbytes
                blkzone_reset(path)
                drop_caches()
                with D.BlockZonedDevice(path) as dev:
                    with Timer() as wnc:
                        dev_write_nocopy(dev, nbytes, abuf)
                r[side] = {"write_s": w.wall, "write_cpu": w.cpu, "read_s": rd.wall,
                           "read_cpu": rd.cpu, "read_nocopy_s": nc.wall,
                           "read_nocopy_cpu": nc.cpu, "write_nocopy_s": wnc.wall,
                           "write_nocopy_cpu": wnc.cpu,
                           "zero_copy": {"write": zc_write, "read": zc_read}}
            else:
                try:
                    with Timer(children=True) as w:
                        ws, procs = dd_zoned_write(path, nbytes, zsize, zcap, mode)
                except RuntimeError as e:
                    if mode != "whole":
                        raise
                    notes.append(f"one sequential dd over the zones failed "
                                 f"({' | '.join(str(e).splitlines())}); one dd per zone instead")
                    mode = "zones"
                    blkzone_reset(path)
                    with Timer(children=True) as w:
                        ws, procs = dd_zoned_write(path, nbytes, zsize, zcap, mode)
                drop_caches()
                with Timer(children=True) as rd:
                    rs, _ = dd_zoned_read(path, nbytes, zsize, zcap, mode)
                r[side] = dd_figures(w, ws, rd, rs, procs, startup)
        rounds.append(r)
    blkzone_reset(path)
    ver = verify_direct(lambda: D.BlockZonedDevice(path), chunk=MiB)
    blkzone_reset(path)
    figs = summarise(rounds, nbytes)
    title = (f"guest ({path}, kernel {os.uname().release}, QEMU TCG ZNS): {nbytes // MiB} MiB, "
             f"1 MiB requests, {a.rounds} alternating rounds, {nz} zones of {zsize // MiB} MiB "
             f"(cap {zcap / MiB:g} MiB); dd mode {mode}; retainzfs = BlockZonedDevice; "
             f"ratio = retainzfs/dd")
    print_table(title, figs, rounds, nbytes)
    for n in notes:
        print("  note: " + n)
    print(f"verify (BlockZonedDevice O_DIRECT, {ver['writes']} writes of {ver['sizes']} bytes, "
          f"bounce buffer {ver['chunk'] // MiB} MiB, cold reopen): "
          f"{'ok' if ver['ok'] else 'FAILED ' + '; '.join(ver['problems'])}")
    res = {"mode": "guest", "dev": path, "size": nbytes, "dd_mode": mode, "geometry": geom,
           "rounds": rounds, "figures": figs, "verify": ver, "notes": notes,
           "dd_startup": startup,
           "kernel": os.uname().release}
    print("RESULT " + json.dumps(res), flush=True)
    return 0 if ver["ok"] else 1


def qemu_main(a) -> int:
    """Boot one guest with scripts/qemu_zns.py and run ``--guest`` inside it."""
    ns = a.ns_size
    inner = (f"python3 scripts/bench_block.py --guest --size {a.size // MiB} "
             f"--rounds {a.rounds} --dd-mode {a.dd_mode}")
    cmd = [sys.executable, os.path.join(HERE, "qemu_zns.py"), "--size", f"{ns // MiB}M",
           "--zone-size", f"{a.zone_size // MiB}M", "--max-open", str(a.max_open),
           "--max-active", str(a.max_active), "--timeout", str(a.timeout)]
    if a.zone_capacity:
        cmd += ["--zone-capacity", f"{a.zone_capacity // MiB}M"]
    cmd += ["--", inner]
    print("+ " + shlex.join(cmd), flush=True)
    got_result = False
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) as p:
        for line in p.stdout:               # streamed: the guest's table as it is printed
            sys.stdout.write(line)
            sys.stdout.flush()
            got_result |= line.startswith("RESULT ")
    if not got_result:
        print(f"bench_block: no result from the guest (qemu_zns.py exited {p.returncode})",
              file=sys.stderr)
        return p.returncode or 1
    return p.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = ap.add_mutually_exclusive_group(required=True)
    m.add_argument("--host", action="store_true", help="O_DIRECT image on this file system vs dd")
    m.add_argument("--qemu", action="store_true", help="BlockZonedDevice vs dd in a QEMU ZNS guest")
    m.add_argument("--guest", action="store_true", help="(inside the guest) the --qemu measurement")
    ap.add_argument("--size", type=parse_mib, default=None,
                    help="MiB to write and read (default 1024 on the host, 192 in the guest)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/var/tmp", help="--host: file system to measure")
    ap.add_argument("--zone-size", type=parse_mib, default=None,
                    help="zone size (default 64M on the host image, 4M for the guest namespace)")
    ap.add_argument("--zone-capacity", type=parse_mib, default=None, help="--qemu: zone capacity")
    ap.add_argument("--ns-size", type=parse_mib, default=256 * MiB, help="--qemu: namespace size")
    ap.add_argument("--max-open", type=int, default=8, help="--qemu")
    ap.add_argument("--max-active", type=int, default=8, help="--qemu")
    ap.add_argument("--timeout", type=float, default=900, help="--qemu: seconds incl. boot")
    ap.add_argument("--dd-mode", choices=("auto", "whole", "zones"), default="auto",
                    help="guest dd: one sequential stream, or one dd per zone (auto: whole "
                         "when capacity == zone size)")
    ap.add_argument("--dev", default=None, help="--guest: zoned device (default $RETAINZ_ZNS_DEV)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if a.host:
        a.size = a.size or 1024 * MiB
        a.zone_size = a.zone_size or 64 * MiB
        return host_main(a)
    a.size = a.size or 192 * MiB
    if a.guest:
        return guest_main(a)
    a.zone_size = a.zone_size or 4 * MiB
    if a.size > a.ns_size:
        ap.error(f"--size must be at most --ns-size ({a.ns_size // MiB} MiB)")
    return qemu_main(a)


if __name__ == "__main__":
    sys.exit(main())
