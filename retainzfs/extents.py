"""Per-file extent maps: file ranges -> zone ranges.

Why its own module: overwrite semantics (a write below EOF is a new extent that supersedes the
old range) and truncation are where byte accounting goes wrong; keeping them pure (no I/O, no
locks) lets them be tested exhaustively and reused by the store, replay and fsck alike.
Every operation returns the *dead pieces* (zone, bytes, hint) so the caller can update the
allocator's live-byte summaries.
"""
from __future__ import annotations

from bisect import bisect_right


class Extent:
    """``length`` bytes of the file at ``off`` stored at ``zone``/``zoff`` with reclaim ``hint``."""
    __slots__ = ("off", "length", "zone", "zoff", "hint")

    def __init__(self, off: int, length: int, zone: int, zoff: int, hint: float):
        self.off, self.length, self.zone, self.zoff, self.hint = off, length, zone, zoff, hint

    @property
    def end(self) -> int:
        return self.off + self.length

    def as_list(self) -> list:
        return [self.off, self.length, self.zone, self.zoff, self.hint]

    def __repr__(self) -> str:
        return f"Extent({self.off}+{self.length} -> z{self.zone}@{self.zoff} d={self.hint})"


Dead = tuple[int, int, float]   # (zone, bytes, hint)


class ExtentMap:
    """Sorted, non-overlapping extents of one file; ``total``: the bytes they map (what
    ``st_blocks`` reports, kept here so a stat costs no walk over a file's extents)."""
    __slots__ = ("exts", "offs", "total")

    def __init__(self, exts: list[Extent] | None = None):
        if not exts:                      # the common case (every inode has a map): no sort
            self.exts: list[Extent] = []
            self.offs: list[int] = []
            self.total = 0
            return
        self.exts = sorted(exts, key=lambda e: e.off)
        self.offs = [e.off for e in self.exts]
        self.total = sum(e.length for e in self.exts)

    def __iter__(self):
        return iter(self.exts)

    def __len__(self) -> int:
        return len(self.exts)

    def _cut(self, start: int, end: int) -> list[Dead]:
        """Remove [start, end) from the map, keeping the pieces outside it."""
        dead: list[Dead] = []
        i = max(bisect_right(self.offs, start) - 1, 0)
        keep_before: list[Extent] = []
        j = i
        while j < len(self.exts) and self.exts[j].off < end:
            e = self.exts[j]
            if e.end <= start:
                keep_before.append(e)
                j += 1
                continue
            lo, hi = max(e.off, start), min(e.end, end)
            dead.append((e.zone, hi - lo, e.hint))
            if e.off < start:
                keep_before.append(Extent(e.off, start - e.off, e.zone, e.zoff, e.hint))
            if e.end > end:
                keep_before.append(Extent(end, e.end - end, e.zone, e.zoff + (end - e.off), e.hint))
            j += 1
        if j > i or keep_before:
            self.exts[i:j] = keep_before
            self.offs[i:j] = [e.off for e in keep_before]
        self.total -= sum(d[1] for d in dead)
        return dead

    def add(self, off: int, length: int, zone: int, zoff: int, hint: float) -> list[Dead]:
        """Map [off, off+length) to the zone range; returns the superseded (dead) pieces."""
        if length <= 0:
            return []
        dead = self._cut(off, off + length)
        self.total += length
        i = bisect_right(self.offs, off)
        prev = self.exts[i - 1] if i > 0 else None
        if (prev is not None and prev.end == off and prev.zone == zone
                and prev.zoff + prev.length == zoff and prev.hint == hint):
            prev.length += length            # contiguous append: merge
            i -= 1
        else:
            self.exts.insert(i, Extent(off, length, zone, zoff, hint))
            self.offs.insert(i, off)
        cur = self.exts[i]
        nxt = self.exts[i + 1] if i + 1 < len(self.exts) else None
        if (nxt is not None and cur.end == nxt.off and cur.zone == nxt.zone
                and cur.zoff + cur.length == nxt.zoff and cur.hint == nxt.hint):
            cur.length += nxt.length         # and with what follows: one map, one shape
            del self.exts[i + 1]             # (what a reload of the same records builds)
            del self.offs[i + 1]
        return dead

    def punch(self, start: int, end: int) -> list[Dead]:
        """Unmap [start, end) (a hole: reads as zeros); returns the pieces removed."""
        return self._cut(start, end) if end > start else []

    def truncate(self, size: int) -> list[Dead]:
        """Drop everything at or beyond ``size``."""
        if not self.exts or self.exts[-1].end <= size:
            return []
        return self._cut(size, self.exts[-1].end)

    def clear(self) -> list[Dead]:
        dead = [(e.zone, e.length, e.hint) for e in self.exts]
        self.exts, self.offs = [], []
        self.total = 0
        return dead

    def lookup(self, off: int, size: int) -> list[tuple[int, int, int, int]]:
        """Segments (dst_offset, zone, zoff, length) covering [off, off+size); holes omitted."""
        out = []
        end = off + size
        i = max(bisect_right(self.offs, off) - 1, 0)
        while i < len(self.exts) and self.exts[i].off < end:
            e = self.exts[i]
            lo, hi = max(e.off, off), min(e.end, end)
            if hi > lo:
                out.append((lo - off, e.zone, e.zoff + (lo - e.off), hi - lo))
            i += 1
        return out

    def relocate(self, off: int, length: int, old_zone: int, old_zoff: int,
                 new_zone: int, new_zoff: int) -> bool:
        """Point [off, off+length) (currently at old_zone/old_zoff) at its new home (GC)."""
        segs = self.lookup(off, length)
        if len(segs) != 1 or segs[0][1] != old_zone or segs[0][2] != old_zoff or segs[0][3] != length:
            return False
        hint = self.exts[max(bisect_right(self.offs, off) - 1, 0)].hint
        self._cut(off, off + length)
        self.total += length
        i = bisect_right(self.offs, off)
        self.exts.insert(i, Extent(off, length, new_zone, new_zoff, hint))
        self.offs.insert(i, off)
        return True

    def runs_from(self, off: int):
        """(start, end) of each extent that ends past ``off``, in file order (SEEK_DATA/HOLE)."""
        for e in self.exts[max(bisect_right(self.offs, off) - 1, 0):]:
            if e.end > off:
                yield e.off, e.end

    def mapped_between(self, start: int, end: int) -> int:
        """Bytes of [start, end) that extents map."""
        n = 0
        for e in self.exts[max(bisect_right(self.offs, start) - 1, 0):]:
            if e.off >= end:
                break
            n += max(0, min(e.end, end) - max(e.off, start))
        return n

    def in_zone(self, zone: int) -> list[Extent]:
        return [e for e in self.exts if e.zone == zone]

    def live_by_zone(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for e in self.exts:
            out[e.zone] = out.get(e.zone, 0) + e.length
        return out
