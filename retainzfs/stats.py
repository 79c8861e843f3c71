"""Observability: statfs, the ``user.retainz.status`` document, the zone map, commit latencies.

Reads only (under ``Store.lock``); the counters themselves (``Store.stats``) are bumped by the
part that does the work.  Names of the status fields are part of the interface (DESIGN §7).
"""
from __future__ import annotations

import bisect
import math
import os

#: commit latencies kept for ``status``'s p99 (the last 5,000-10,000 commits); the
#: Prometheus histogram counts them all
COMMIT_SAMPLES = 10_000


class LatencyHistogram:
    """Cumulative commit latencies for the Prometheus histogram (buckets in seconds)."""
    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.BUCKETS, seconds)
        self.counts[i] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip(self.BUCKETS, self.counts):
            acc += c
            out.append((repr(b), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


def process_stats() -> dict:
    """This process's memory, CPU and threads (from /proc/self), and the aligned I/O buffers
    its pool keeps: what an operator watches a long-running daemon by."""
    from ._iobuf import live_bytes, live_peak_bytes, pooled_bytes
    out = {"pid": os.getpid(), "rss_bytes": 0, "peak_rss_bytes": 0, "threads": 0}
    keys = {"VmRSS:": "rss_bytes", "VmHWM:": "peak_rss_bytes", "Threads:": "threads"}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k = keys.get(line.split(":", 1)[0] + ":")
                if k:
                    v = int(line.split()[1])
                    out[k] = v * 1024 if k.endswith("_bytes") else v
    except OSError:
        pass
    t = os.times()
    out["cpu_seconds"] = round(t.user + t.system, 3)
    out["io_buffer_pool_bytes"] = pooled_bytes()
    out["io_buffer_live_bytes"] = live_bytes()
    out["io_buffer_peak_live_bytes"] = live_peak_bytes()
    return out


class StoreStats:
    def __init__(self, store):
        self.s = store
        self.commit_ms: list[float] = []
        self.commit_hist = LatencyHistogram()
        #: set by the mount: ``status`` then reports the daemon process (``daemon``); a store
        #: opened by ``retainzfs status TARGET`` itself has no daemon to report
        self.serving = False

    def observe_commit(self, seconds: float) -> None:
        self.commit_ms.append(seconds * 1000.0)
        self.commit_hist.observe(seconds)
        if len(self.commit_ms) > COMMIT_SAMPLES:
            del self.commit_ms[:COMMIT_SAMPLES // 2]

    def statfs(self) -> dict:
        """Free space as a writer can get it: empty zones, the unwritten tails of open ones,
        and the dead bytes that a reset or GC hands back (``Reclaim.reclaimable_locked``),
        less the GC reserve.  Why the dead bytes: after ``rm`` of a checkpoint whose zones also hold live
        data, ``df`` showed no change (0 bytes free on a full device) while the next writes
        succeeded through GC; a job or a monitor checking free space before a save was told
        there was none.  (F2FS counts invalid blocks as free in statfs the same way.)
        An image never shows more than its host file system can take, plus what resets give
        back to it: a sparse image on a nearly full disk showed gigabytes free while every
        write failed with ENOSPC."""
        s = self.s
        medium = s.dev.medium_free()          # a syscall: not under the lock
        with s.lock:
            free = dead = 0
            data_zones = s.dev.nr_zones - s.meta_zones
            for z in range(s.meta_zones, s.dev.nr_zones):
                sm = s.alloc.summary(z)
                if sm["cond"] == "empty":
                    free += s.cap
                    continue
                if sm["cond"] == "active":
                    free += s.cap - sm["W"]
                dead += s.reclaim.reclaimable_locked(z, sm)
            free = max(0, free + dead - s.opts.gc_reserve * s.cap)
            if medium is not None:
                free = min(free, medium + dead)
            return {"bsize": s.bs, "blocks": data_zones * s.cap // s.bs,
                    "bfree": free // s.bs, "files": len(s.inodes),
                    # no new name fits the metadata zones (``df -i``: none free)
                    "ffree": 0 if s.journal.tight else max(0, (1 << 32) - s.next_ino)}

    def status(self) -> dict:
        s = self.s
        path_of = s.inodes.path_of
        daemon = process_stats() if self.serving else None     # /proc reads: not under the lock
        with s.lock:
            cap = s.cap
            conds: dict[str, int] = {}
            live = invalid = tail = free = reclaimable = 0
            for z in range(s.dev.nr_zones):
                c = s.dev.zone(z).cond.name.lower()
                conds[c] = conds.get(c, 0) + 1
            for z in range(s.meta_zones, s.dev.nr_zones):
                sm = s.alloc.summary(z)
                if sm["cond"] == "empty":
                    free += cap
                    continue
                live += sm["L"]
                invalid += sm["W"] - sm["L"]
                tail += cap - sm["W"]
                if sm["cond"] == "active":
                    free += cap - sm["W"]
                reclaimable += s.reclaim.reclaimable_locked(z, sm)
            st = s.stats
            logical = st["payload_bytes"]
            cm = sorted(self.commit_ms)
            p99 = cm[min(len(cm) - 1, int(math.ceil(0.99 * len(cm))) - 1)] if cm else 0.0
            a = s.alloc.stats()
            return {
                "allocator": s.opts.allocator,
                "uuid": s.sb.uuid,
                "zone_size": s.dev.zone_size, "zone_capacity": cap,
                "nr_zones": s.dev.nr_zones, "meta_zones": s.meta_zones,
                "max_open": s.dev.max_open, "max_active": s.dev.max_active,
                "zones": conds,
                "empty_data_zones": s.alloc.empty_zones(),
                "live_bytes": live, "invalid_bytes": invalid, "tail_bytes": tail,
                "free_bytes": free, "reclaimable_bytes": reclaimable,
                "reserved_overhead_zones": (invalid + tail) / cap,
                "invalid_zones": invalid / cap, "tail_zones": tail / cap,
                "zone_resets": st["zone_resets"], "zone_finishes": st["zone_finishes"],
                "host_wa": ((logical + st["pad_bytes"] + st["gc_copied_bytes"]) / logical)
                if logical else 1.0,
                "logical_bytes": logical, "pad_bytes": st["pad_bytes"],
                "gc_copied_bytes": st["gc_copied_bytes"],
                "journal_bytes": s.journal.bytes_written,
                "journal_rolls": s.journal.rolls,
                "metadata_full": s.journal.tight,
                "device_error": s.failed,
                "buffered_bytes": s.files.buffered,
                "commits": st["commits"], "p99_commit_ms": round(p99, 3),
                "mean_alloc_us": (a["ns"] / a["places"] / 1000.0) if a.get("places") else 0.0,
                "capacity_stop": s.capacity_stop, "enospc": st["enospc"],
                "gc_runs": st["gc_runs"], "gc_aborted": st["gc_aborted"],
                "bad_zones": {str(z): {"reason": b["reason"], "files": b["files"]}
                              for z, b in sorted(s.bad_zones.items())},
                "lost_writes": s.lost_writes,
                "files": s.inodes.nreg,
                "policy_errors": {**{path_of(k): p.slow[0] for k, p in s.policies.items()
                                     if p.slow},
                                  **{path_of(k): v for k, v in s.policy_errors.items()}},
                "journal_truncated": s.journal_truncated,
                # how the last mount ended: True a clean unmount, False a crash or power cut,
                # None an image made before the feature "unmount_marks" (as read at open)
                "clean_unmount": s.clean_unmount,
                "checksum_errors": st["checksum_errors"],
                "read_errors": st["read_errors"],
                "stale_extents": st["stale_extents"],
                "metadata_problems": list(s.meta_problems),
                "metadata_corrupt": s.meta_corrupt,
                "metadata_partial": s.recovered_partial,
                "format_version": s.sb.version,
                # mounted read-only: the device is open O_RDONLY (a remount cannot make it rw)
                "readonly": bool(s.opts.readonly),
                "tuning": dict(s.tuning),
                "readahead": {"hits": s.reads.ra.hits, "bytes": s.reads.ra.prefetched},
                # seconds the write loop held io_lock (placing and reserving) and seconds in
                # the device writes, which run outside it (summed over threads)
                "data_write_seconds": round(st["data_write_s"], 6),
                "device_write_seconds": round(st["device_write_s"], 6),
                # bytes the data path wrote straight from the write requests' buffers
                # (page-aligned, whole blocks), with no staging copy in the daemon
                "unstaged_write_bytes": st["unstaged_bytes"],
                "daemon": daemon,
            }

    def zone_map(self, first: int = 0, count: int | None = None) -> dict:
        """Compact per-zone rows for ``retainzfs status --zones``: [condition, written, live,
        reclaim epoch (-1: anchor, None: nothing written), kind] — kind 'm' metadata, 'b' out of
        service, 'd' data."""
        s = self.s
        with s.lock:
            n = s.dev.nr_zones
            last = n if count is None else min(n, first + count)
            rows = []
            for z in range(max(0, first), last):
                zi = s.dev.zone(z)
                if z < s.meta_zones:
                    rows.append([zi.cond.name.lower(), zi.wp, zi.wp, None, "m"])
                    continue
                sm = s.alloc.summary(z)
                r = s.alloc.zone_reclaim_epoch(z) if sm["W"] else None
                rows.append([zi.cond.name.lower(), sm["W"], sm["L"],
                             -1 if r is not None and math.isinf(r) else r,
                             "b" if z in s.bad_zones else "d"])
            return {"first": first, "nr_zones": n, "capacity": s.cap, "rows": rows}
