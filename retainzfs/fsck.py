"""Consistency checks of a store (``retainzfs fsck``) and the data scrub (``retainzfs scrub``).

``check`` compares the in-memory state against itself and the device under ``Store.lock``
(CPU only); ``findings`` adds what the metadata log's end and the zones say, each a problem
or a repair a mount makes (the lines and exit status of ``fsck``); ``scrub`` snapshots the
extent list under the lock, then reads and verifies every live byte through the data path
without holding it.
"""
from __future__ import annotations

from . import hints as H
from ._journal import Aftermath
from .device import ZoneCond
from .lifecycle import MARKS_FEATURE


class Fsck:
    def __init__(self, store):
        self.s = store

    def check(self) -> list[str]:
        """Consistency check (fsck): per-zone live bytes from the allocator == extent map."""
        s = self.s
        problems = []
        with s.lock:
            per_zone: dict[int, int] = {}
            for i in s.inodes.values():
                for z, n in i.extents.live_by_zone().items():
                    per_zone[z] = per_zone.get(z, 0) + n
                for e in i.extents:
                    if e.zoff + e.length > s.cap:
                        problems.append(f"inode {i.ino}: extent {e!r} beyond zone capacity")
                    if e.end > i.size:
                        problems.append(f"inode {i.ino}: extent {e!r} past the end of the file "
                                        f"({i.size} bytes)")
                    span = s.csums.span(e.zone, e.zoff, e.length)
                    if span is None:
                        problems.append(f"inode {i.ino}: extent {e!r} has no data checksum")
                if i.is_dir:
                    for name, child in i.entries.items():
                        if child not in s.inodes:
                            problems.append(f"dir {i.ino}: entry {name!r} -> missing inode {child}")
            for z in range(s.meta_zones, s.dev.nr_zones):
                sm = s.alloc.summary(z)
                if sm["L"] != per_zone.get(z, 0):
                    problems.append(f"zone {z}: summary live {sm['L']} != extent map "
                                    f"{per_zone.get(z, 0)}")
                if z in s.bad_zones:
                    problems.append(f"zone {z}: out of service ({s.bad_zones[z]['reason']}); "
                                    f"files with data there: {len(s.bad_zones[z]['files'])}")
                    continue
                if s.dev.zone(z).cond != ZoneCond.FULL and sm["W"] != s.dev.zone(z).wp:
                    problems.append(f"zone {z}: summary written {sm['W']} != wp "
                                    f"{s.dev.zone(z).wp}")
        return problems

    def findings(self) -> tuple[list[str], list[str]]:
        """(problems, safe repairs) of a read-only opened store, one line each: what
        ``retainzfs fsck`` prints and exits by."""
        s = self.s
        problems = self.check()
        st = s.status()
        # With mount marks (feature "unmount_marks") an acknowledged frame is never the last of
        # a log: a clean unmount's frame follows it, or a crash cut the log.  So a torn end is a
        # crash's unfinished flush (the mount drops it), and damage before the unmount's frame
        # reads as damage.  Frames lost under a write pointer or from one copy are an
        # unfinished flush unless the log ends in an unmount's frame (a mount makes its own
        # frame durable before any other, so none was lost after it: damage).  Images made
        # before the feature cannot tell: exit 1.
        marks = MARKS_FEATURE in (s.sb.features or ())
        tail = []
        for mp in st.get("metadata_problems") or []:
            if marks and isinstance(mp, Aftermath) and not s.ends_unmounted:
                tail.append(mp)
            else:
                problems.append(f"metadata: {mp}")
        if st.get("metadata_corrupt"):
            problems.append(f"metadata: {st['metadata_corrupt']} (not repairable in place: "
                            f"mount -o ro and copy the files out)")
        if st["journal_truncated"]:
            if marks:
                tail.insert(0, "its last frame is torn")
            else:
                problems.append("journal: the last flush is torn (it was never acknowledged)")
        repairs = []
        if tail:
            repairs.append(f"drop the unfinished last flush a crash or power cut left in the log "
                           f"({'; '.join(tail)})")
        if ((st.get("metadata_problems") or st["journal_truncated"])
                and not st.get("metadata_corrupt")):
            repairs.append("write a fresh metadata snapshot to a free zone pair (two good copies)")
        # What a crash normally leaves (a mount cleans it up) is a repair, not an inconsistency:
        # zones holding only dead bytes, files unlinked while open.
        live = {e.zone for i in s.inodes.values() for e in i.extents}
        stale = [z for z in range(s.meta_zones, s.dev.nr_zones)
                 if z not in live and z not in s.bad_zones
                 and (s.dev.zone(z).wp or s.dev.zone(z).cond != ZoneCond.EMPTY)]
        if stale:
            repairs.append(f"reset {len(stale)} zones with no live data ({_ranges(stale)})")
        orphans = [i.ino for i in s.inodes.values() if i.nlink == 0]
        if orphans:
            repairs.append(f"free {len(orphans)} orphaned inodes (unlinked while open)")
        lost = s.lost_writes
        if lost:
            files = lost["files"]
            repairs.append(f"cut {len(files)} files where a power cut lost {lost['bytes']} bytes "
                           f"written without an fsync ({', '.join(files[:3])}"
                           f"{' ...' if len(files) > 3 else ''})")
        damaged = sorted({f for b in s.bad_zones.values() if b["valid_upto"] is not None
                          for f in b["files"]})
        if damaged:
            repairs.append(f"mark {len(damaged)} files damaged ({H.XATTR_DAMAGED.decode()}): "
                           f"data past a zone's write pointer")
        return problems, repairs

    def scrub(self, progress=None) -> dict:
        """Verify every live extent against its data checksums (``retainzfs scrub``).

        Returns {"bytes": verified, "extents": n, "errors": [{"path", "offset", "zone",
        "error"}]}; ``progress(nbytes)`` is called as bytes are verified."""
        s = self.s
        with s.lock:
            work = [(i.ino, s.inodes.path_of(i.ino), e.off, e.zone, e.zoff, e.length)
                    for i in list(s.inodes.values()) if i.is_reg for e in i.extents]
        done, errors = 0, []
        step = 4 << 20
        for ino, path, off, zone, zoff, length in work:
            pos = 0
            while pos < length:
                n = min(step, length - pos)
                try:
                    s.reads.verified_read(zone, zoff + pos, n, ino, off + pos)
                except OSError as e:
                    errors.append({"path": path, "offset": off + pos, "zone": zone,
                                   "error": e.strerror or str(e)})
                pos += n
                done += n
                if progress is not None:
                    progress(n)
        return {"bytes": done, "extents": len(work), "errors": errors,
                "files_affected": sorted({e["path"] for e in errors})}


def _ranges(zs: list[int]) -> str:
    out, i = [], 0
    while i < len(zs):
        j = i
        while j + 1 < len(zs) and zs[j + 1] == zs[j] + 1:
            j += 1
        out.append(str(zs[i]) if i == j else f"{zs[i]}-{zs[j]}")
        i = j + 1
    return ",".join(out)
