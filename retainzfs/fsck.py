"""Consistency checks of a store (``retainzfs fsck``) and the data scrub (``retainzfs scrub``).

``check`` compares the in-memory state against itself and the device under ``Store.lock``
(CPU only); ``scrub`` snapshots the extent list under the lock, then reads and verifies every
live byte through the data path without holding it.
"""
from __future__ import annotations

from .device import ZoneCond


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
