"""Trace replay: drive the mount's own ``Store`` on an emulated zoned device and measure it.

``retainzfs replay TRACE --policy NAME [--json] [--hint-grid G] [--common-admission]
[--lambda X] [--seed-bytes]``

What a replay does (and why it is trustworthy):

* Creates an :class:`~retainzfs.device.ImageZonedDevice` with the trace's geometry (its
  ``device`` line; the paper's 64 x 4 MiB device with 2 open / 7 active zones when absent) in a
  temporary directory (``/dev/shm`` when it exists), formats it with ``Store.format`` and opens
  the very ``Store`` class the FUSE mount uses -- there is no second simulator.  All policies
  therefore share the I/O path, journal, GC, open/active limits and error handling.
* Per **save**: ``mkdir`` ``s<stream>`` (once) and ``g<gen>``, set ``user.retainz.birth``,
  ``user.retainz.reclaim`` (``inf`` for a null hint) and ``user.retainz.stream`` on the
  generation directory (files inherit them), declare the save's padded size
  (``Store.declare_save``, used for size adaptation and common admission), then per file
  ``create`` + ``open``, ``write`` in 1 MiB requests, ``commit(durable=True)`` (fsync) and
  ``release``.  The save's latency runs from the ``mkdir`` to the last durable commit.
* Per **delete**: ``unlink`` every file, ``rmdir`` the generation directory.
* After every event: ``store.status()`` invalid/tail bytes and the device counters go into a
  :class:`~retainzfs.workload.MetricsRecorder` (epoch = birth of the current save; prefill =
  the leading run of anchor saves).
* A save that fails with ENOSPC is a **capacity stop**: it is recorded (``completed=False``),
  its partial files are removed as a runtime would, and no further event is replayed.
* At the end every retained byte is **read back** through ``Store.read`` and compared with its
  pattern, and ``Store.check()`` must be empty; any mismatch raises :class:`ReplayError`.

Pattern bytes: file ``f`` of ``(stream, gen)`` holds little-endian u64 words
``key(stream, gen, f) << 40 | word_index`` (cheap: one ``numpy.arange``); with
``--seed-bytes`` it holds incompressible pseudo-random bytes from a PCG64 generator seeded by
``(stream, gen, f, MiB block)`` instead (slower, but no byte pattern a device could dedupe).

Metrics: the DESIGN §7 names (``reserved_overhead_zones``, ``invalid_zones``, ``tail_zones``,
``host_wa``, ``journal_bytes``, ``p99_commit_ms``, ``saves_requested``, ``saves_completed``,
``capacity_stop``, ``mean_alloc_us``, ``gc_copied_bytes``, ``zone_resets``), all over the
measured window (prefill and the first 20 epochs excluded).  ``mean_alloc_us`` is allocator
time (``place`` + summary upkeep, thread CPU time) per completed save (= per checkpoint
commit).  ``p99_commit_ms`` is wall clock from the ``mkdir`` to the last durable commit with
pattern generation (the runtime's serialization) subtracted; ``p99_commit_cpu_ms`` is the same
in thread CPU time, which shared machines do not distort.  Extra keys describe the run
(``policy``, ``load`` = peak live after deletions / data capacity, ``load_in_flight``,
``stop_after_saves``, ``verified_bytes``, ...).
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from . import hints as H
from . import workload as wl
from ._alloc import POLICIES
from .device import create_image
from .store import FsError, Store, StoreOptions
from .superblock import MIN_META_ZONES

META_PAIR_ZONES = MIN_META_ZONES   # format v2: two mirrored pairs (superblock's rule)

MiB = 1 << 20
IO_SIZE = 1 * MiB                     # bytes per write()/read() request (FUSE-like granularity)
DEFAULT_DEVICE = wl.DeviceSpec(4 * MiB, 4 * MiB, 64, 2, 7, 4096)
X_BIRTH, X_RECLAIM, X_STREAM = H.XATTR_BIRTH, H.XATTR_RECLAIM, H.XATTR_STREAM


class ReplayError(RuntimeError):
    """Readback mismatch, an inconsistent store, or an unexpected store error."""


# --------------------------------------------------------------------------- pattern bytes

def _key(stream: int, gen: int, fidx: int) -> int:
    h = hashlib.blake2b(f"{stream}/{gen}/{fidx}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0xFFFFFF          # 24 bits


_BASE = np.arange(IO_SIZE // 8 + 2, dtype=np.uint64)


def pattern(stream: int, gen: int, fidx: int, off: int, n: int, seeded: bool = False):
    """Expected bytes ``[off, off + n)`` of file ``fidx`` of generation ``(stream, gen)``.

    Returns a fresh, never-reused buffer (bytes or a read-only uint8 memoryview): the store's
    write buffer keeps references to what it is given instead of copying it."""
    if n <= 0:
        return b""
    if seeded:
        out = bytearray()
        blk = off // MiB
        pos = off
        end = off + n
        while pos < end:
            rng = np.random.Generator(np.random.PCG64([stream, gen, fidx, blk]))
            block = rng.bytes(MiB)
            lo = pos - blk * MiB
            hi = min(MiB, end - blk * MiB)
            out += block[lo:hi]
            pos = blk * MiB + hi
            blk += 1
        return bytes(out)
    w0 = off >> 3
    w1 = (off + n + 7) >> 3
    top = np.uint64((_key(stream, gen, fidx) << 40) | w0)
    if w1 - w0 <= len(_BASE):
        words = _BASE[:w1 - w0] + top
    else:
        words = np.arange(w1 - w0, dtype=np.uint64) + top
    if sys.byteorder != "little":
        words = words.byteswap()
    s = off - (w0 << 3)
    raw = words.view(np.uint8)[s:s + n]
    raw.flags.writeable = False
    return memoryview(raw)


# --------------------------------------------------------------------------- replay

@dataclass
class ReplayOptions:
    policy: str = "retainz"
    hint_grid: int = 0
    common_admission: bool = False
    lam: float = 1.0
    gc_reserve: int = 1
    fullscan: bool = False
    seed_bytes: bool = False
    verify: bool = True
    workdir: str | None = None        # where the image lives (default /dev/shm or $TMPDIR)
    keep_image: bool = False
    max_saves: int | None = None      # stop after this many non-prefill saves (benchmarks)
    progress: object = None           # callable(done_events, total_events) or None
    store_kwargs: dict = field(default_factory=dict)


def _default_workdir() -> str | None:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return None


def _padded(n: int, bs: int) -> int:
    return -(-n // bs) * bs


class _Replayer:
    def __init__(self, device: wl.DeviceSpec, events: list, opts: ReplayOptions):
        self.spec = device
        self.events = events
        self.o = opts
        self.live: dict[tuple[int, int], wl.SaveEvent] = {}
        self.stream_dirs: dict[int, int] = {}
        self.gen_dirs: dict[tuple[int, int], int] = {}

    # ---------------------------------------------------------------- setup
    def _open(self, tmp: str) -> None:
        d = self.spec
        img = os.path.join(tmp, "replay.zns")
        # The trace names one metadata zone (and one open/active slot for it) beside the data
        # zones; format v2 writes metadata to a mirrored pair: one more zone and one more slot
        # each, so the data zones and data budgets are exactly the trace's.
        extra = META_PAIR_ZONES - wl.METADATA_ZONES
        self.dev = create_image(img, d.zone_size * (d.nr_zones + extra), d.zone_size,
                                d.zone_capacity, d.max_open + (1 if d.max_open else 0),
                                d.max_active + (1 if d.max_active else 0), d.block_size)
        Store.format(self.dev, meta_zones=META_PAIR_ZONES, allocator=self.o.policy,
                     gc_reserve=self.o.gc_reserve)
        so = StoreOptions(allocator=self.o.policy, lam=self.o.lam, hint_grid=self.o.hint_grid,
                          gc_reserve=self.o.gc_reserve, common_admission=self.o.common_admission,
                          fullscan=self.o.fullscan,
                          **({"inline_flush": True} | self.o.store_kwargs))
        self.store = Store(self.dev, so)
        self.root = self.store.root().ino

    # ---------------------------------------------------------------- events
    def _stream_dir(self, stream: int) -> int:
        ino = self.stream_dirs.get(stream)
        if ino is None:
            ino = self.store.mkdir(self.root, f"s{stream}".encode(), 0o755).ino
            self.stream_dirs[stream] = ino
        return ino

    def _save(self, ev: wl.SaveEvent) -> float:
        """Write one generation; returns the seconds spent generating pattern bytes."""
        st = self.store
        sdir = self._stream_dir(ev.stream)
        gname = f"g{ev.gen}".encode()
        g = st.mkdir(sdir, gname, 0o755).ino
        self.gen_dirs[(ev.stream, ev.gen)] = g
        st.setxattr(g, X_BIRTH, str(ev.birth).encode())
        st.setxattr(g, X_RECLAIM, b"inf" if ev.hint is None else str(ev.hint).encode())
        st.setxattr(g, X_STREAM, str(ev.stream).encode())
        declare = getattr(st, "declare_save", None)
        if declare is not None:
            declare(g, sum(_padded(f.size, self.spec.block_size) for f in ev.files))
        gen_s = 0.0                    # pattern generation is the runtime's serialization:
        self.gen_cpu = 0.0
        for fidx, f in enumerate(ev.files):    # excluded from the save's latency
            ino = st.create(g, f.name.encode(), 0o644).ino
            st.open(ino)
            try:
                off = 0
                while off < f.size:
                    n = min(IO_SIZE, f.size - off)
                    t, tc = time.perf_counter(), time.thread_time()
                    data = pattern(ev.stream, ev.gen, fidx, off, n, self.o.seed_bytes)
                    gen_s += time.perf_counter() - t
                    self.gen_cpu += time.thread_time() - tc
                    st.write(ino, off, data)
                    off += n
                st.commit(ino, durable=True)
            finally:
                st.release(ino)
        return gen_s

    def _abort_save(self, ev: wl.SaveEvent) -> None:
        """Remove what a failed save left behind (the runtime's cleanup)."""
        st = self.store
        g = self.gen_dirs.pop((ev.stream, ev.gen), None)
        if g is None:
            return
        try:
            for name in list(st.getattr(g).entries):
                st.unlink(g, name)
            st.rmdir(self.stream_dirs[ev.stream], f"g{ev.gen}".encode())
        except FsError as e:
            raise ReplayError(f"cleanup of failed save {ev.stream}/{ev.gen}: {e}") from e

    def _delete(self, ev: wl.DeleteEvent) -> None:
        st = self.store
        g = self.gen_dirs.pop((ev.stream, ev.gen))
        for f in self.live.pop((ev.stream, ev.gen)).files:
            st.unlink(g, f.name.encode())
        st.rmdir(self.stream_dirs[ev.stream], f"g{ev.gen}".encode())

    # ---------------------------------------------------------------- metrics
    def _counters(self, rec: wl.MetricsRecorder, epoch: float, completed: int) -> None:
        s = self.store.status()
        rec.sample(epoch, s["invalid_bytes"], s["tail_bytes"])
        a = self.store.alloc.stats()
        rec.counters(epoch, data_bytes=s["logical_bytes"] + s["pad_bytes"] + s["gc_copied_bytes"],
                     journal_bytes=s["journal_bytes"], gc_copied_bytes=s["gc_copied_bytes"],
                     zone_resets=s["zone_resets"], alloc_us=a["ns"] / 1000.0, commits=completed)

    # ---------------------------------------------------------------- verify
    def _verify(self) -> int:
        st = self.store
        total = 0
        for (stream, gen), ev in sorted(self.live.items()):
            g = self.gen_dirs[(stream, gen)]
            for fidx, f in enumerate(ev.files):
                inode = st.lookup(g, f.name.encode())
                if inode.size != f.size:
                    raise ReplayError(f"s{stream}/g{gen}/{f.name}: size {inode.size} != {f.size}")
                off = 0
                while off < f.size:
                    n = min(4 * MiB, f.size - off)
                    got = st.read(inode.ino, off, n)
                    # bytes == bytes is a memcmp; bytes == memoryview compares item by item
                    want = bytes(pattern(stream, gen, fidx, off, n, self.o.seed_bytes))
                    if got != want:
                        bad = next(i for i in range(min(len(got), len(want)))
                                   if got[i] != want[i]) if len(got) == len(want) else 0
                        raise ReplayError(f"readback mismatch in s{stream}/g{gen}/{f.name} at "
                                          f"byte {off + bad} (read {len(got)} of {n} bytes)")
                    off += n
                    total += n
        problems = st.check()
        if problems:
            raise ReplayError("store.check() found problems: " + "; ".join(problems[:10]))
        return total

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict:
        evs = self.events
        n_prefill = 0
        while n_prefill < len(evs) and isinstance(evs[n_prefill], wl.SaveEvent) \
                and evs[n_prefill].hint is None:
            n_prefill += 1
        requested = sum(1 for e in evs[n_prefill:] if isinstance(e, wl.SaveEvent))
        if self.o.max_saves is not None:
            requested = min(requested, self.o.max_saves)
        rec = wl.MetricsRecorder(self.spec.zone_capacity, saves_requested=requested)
        t_wall = time.perf_counter()
        epoch = 0.0
        completed = issued = 0
        stop_event = None
        stopped_at = None
        cpu_lat: list[float] = []
        started = False
        for i, ev in enumerate(evs):
            if i == n_prefill and not started:
                rec.start(float(ev.birth) if isinstance(ev, wl.SaveEvent) else epoch)
                started = True
            if isinstance(ev, wl.SaveEvent):
                if i >= n_prefill:
                    if self.o.max_saves is not None and issued >= self.o.max_saves:
                        break
                    issued += 1
                epoch = float(ev.birth)
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    gen_s = self._save(ev)
                except FsError as e:
                    if e.errno != errno.ENOSPC:
                        raise ReplayError(f"save {ev.stream}/{ev.gen}: {e}") from e
                    rec.save(epoch, time.perf_counter() - t0, ev.size, completed=False)
                    self._abort_save(ev)
                    stop_event = {"stream": ev.stream, "gen": ev.gen, "birth": ev.birth,
                                  "event_index": i, "prefill": i < n_prefill}
                    stopped_at = completed
                    self._counters(rec, epoch, completed)
                    break
                dt = time.perf_counter() - t0 - gen_s
                self.live[(ev.stream, ev.gen)] = ev
                if i >= n_prefill:
                    completed += 1
                    if rec.window_start is not None and epoch >= rec.window_start:
                        cpu_lat.append(time.thread_time() - c0 - self.gen_cpu)
                rec.save(epoch, dt, ev.size, completed=True)
            else:
                self._delete(ev)
            self._counters(rec, epoch, completed)
            if self.o.progress is not None:
                self.o.progress(i + 1, len(evs))
        wall = time.perf_counter() - t_wall
        res = rec.result()
        verified = self._verify() if self.o.verify else 0
        st = self.store.status()
        astats = self.store.alloc.stats()
        d = self.spec
        cap = wl.data_capacity(d)          # the trace's data zones (see _open)
        p99c = wl.percentile(cpu_lat, 99)
        res.update({
            "p99_commit_cpu_ms": None if p99c is None else p99c * 1000.0,
            "policy": self.o.policy, "hint_grid": self.o.hint_grid,
            "common_admission": self.o.common_admission, "lambda": self.o.lam,
            "fullscan": self.o.fullscan, "gc_reserve": self.o.gc_reserve,
            "load": round(wl.peak_live(evs, after_deletes=True) / cap, 4),
            "load_in_flight": round(wl.peak_live(evs) / cap, 4),
            "zone_size": d.zone_size, "zone_capacity": d.zone_capacity, "nr_zones": d.nr_zones,
            "max_open": d.max_open, "max_active": d.max_active,
            "prefill_saves": n_prefill, "stop_after_saves": stopped_at,
            "stop_event": stop_event,
            "total_host_wa": st["host_wa"], "total_gc_copied_bytes": st["gc_copied_bytes"],
            "total_zone_resets": st["zone_resets"], "zone_finishes": st["zone_finishes"],
            "alloc_places": astats["places"], "alloc_fallbacks": astats["fallbacks"],
            "alloc_new_zones": astats["new_zones"], "alloc_total_us": astats["ns"] / 1000.0,
            "verified_bytes": verified, "retained_generations": len(self.live),
            "wall_s": round(wall, 3),
        })
        return res


def load_trace(trace) -> tuple[wl.DeviceSpec, list]:
    if isinstance(trace, tuple):
        dev, events = trace
    else:
        dev, events = wl.read_trace(trace)
    return dev or DEFAULT_DEVICE, list(events)


def replay(trace, policy: str = "retainz", **kw) -> dict:
    """Replay ``trace`` (a path, or a ``(DeviceSpec, events)`` pair) with ``policy``; return
    the metrics dict.  Keyword arguments are :class:`ReplayOptions` fields."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    opts = ReplayOptions(policy=policy, **kw)
    device, events = load_trace(trace)
    base = opts.workdir or _default_workdir()
    tmp = tempfile.mkdtemp(prefix="retainzfs-replay-", dir=base)
    r = _Replayer(device, events, opts)
    try:
        r._open(tmp)
        try:
            out = r.run()
        finally:
            try:
                r.store.close()
            except Exception:
                pass
            r.dev.close()
        if opts.keep_image:
            out["image"] = os.path.join(tmp, "replay.zns")
        return out
    finally:
        if not opts.keep_image:
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- CLI

def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def print_table(res: dict, title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title or f"replay ({res.get('policy')})", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value")
    for k in wl.METRIC_NAMES:
        t.add_row(k, _fmt(res.get(k)))
    for k in ("p99_commit_cpu_ms", "load", "load_in_flight", "stop_after_saves",
              "total_host_wa", "zone_finishes", "alloc_fallbacks", "verified_bytes", "wall_s"):
        t.add_row(k, _fmt(res.get(k)))
    Console().print(t)


def add_replay_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("trace", help="trace file (JSON Lines, DESIGN §8)")
    p.add_argument("--policy", default="retainz", choices=POLICIES,
                   help="allocator policy (default retainz)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("--hint-grid", type=int, default=0, metavar="G",
                   help="round finite hints up to a grid of G epochs (default 0 = exact)")
    p.add_argument("--common-admission", action="store_true",
                   help="common admission: fill compatible tails, borrow the GC reserve zone "
                        "when the rest of the padded save fits in it")
    p.add_argument("--lambda", dest="lam", type=float, default=1.0,
                   help="tail-cost weight of the RetainZ cost (default 1)")
    p.add_argument("--seed-bytes", action="store_true",
                   help="write seeded pseudo-random bytes instead of the counter pattern")
    p.add_argument("--gc-reserve", type=int, default=1, help="empty zones kept for GC (default 1)")
    p.add_argument("--fullscan", action="store_true",
                   help="allocator recomputes zone state from the extent history (slow)")
    p.add_argument("--workdir", default=None,
                   help="directory for the emulated image (default /dev/shm or $TMPDIR)")
    p.add_argument("--max-saves", type=int, default=None,
                   help="stop after this many (non-prefill) saves")
    p.add_argument("--no-verify", action="store_true", help="skip the final readback (faster)")
    return p


def run_replay(args: argparse.Namespace) -> int:
    try:
        res = replay(args.trace, args.policy, hint_grid=args.hint_grid,
                     common_admission=args.common_admission, lam=args.lam,
                     seed_bytes=args.seed_bytes, gc_reserve=args.gc_reserve,
                     fullscan=args.fullscan, workdir=args.workdir, max_saves=args.max_saves,
                     verify=not args.no_verify)
    except OSError as e:                     # the trace or the work directory
        print(f"retainzfs replay: {e.filename + ': ' if e.filename else ''}"
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    except (wl.TraceError, ValueError) as e:
        print(f"retainzfs replay: {e}", file=sys.stderr)
        return 1
    except ReplayError as e:
        print(f"retainzfs replay: VERIFY FAILED: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=2, default=lambda x: "inf" if x == math.inf else str(x)))
    else:
        print_table(res, f"replay {os.path.basename(args.trace)} --policy {args.policy}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="retainzfs replay", description=__doc__.split("\n")[0])
    return run_replay(add_replay_args(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
