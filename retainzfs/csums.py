"""End-to-end data checksums: CRC32C of every ``CSUM_PIECE`` of every device write, per zone.

Why per zone and per write (not per extent): zone bytes never change until the zone is reset,
so a checksum of a written zone range stays valid however often the files mapped onto it are
overwritten, truncated or relocated — extents may be cut anywhere, the table never changes.
Each device write of ``n`` bytes at ``zoff`` is one *run*: ``ceil(n / CSUM_PIECE)`` CRCs, the
pieces aligned to the run's start.  A read verifies the pieces it touches (at most one extra
piece at either end) and a GC copy verifies what it moves.  A zone's runs go when it is reset.

Pure (no I/O, no locks): the store passes in the bytes; ``verify`` tells which pieces are bad.
"""
from __future__ import annotations

from array import array
from bisect import bisect_right

from ._iobuf import crc32c_pieces
from .records import CSUM_PIECE


def crcs_of(parts, length: int) -> array:
    """CRC32C of each CSUM_PIECE of the first ``length`` bytes of a scatter list (computed in
    ``_iobuf`` without the GIL: the flusher must not hold up the FUSE loop)."""
    try:
        return crc32c_pieces(parts, length, CSUM_PIECE)
    except ValueError:
        raise ValueError("checksummed length does not match the data") from None


class Run:
    __slots__ = ("zoff", "length", "crcs")

    def __init__(self, zoff: int, length: int, crcs: array):
        self.zoff, self.length, self.crcs = zoff, length, crcs

    @property
    def end(self) -> int:
        return self.zoff + self.length


class _ZoneRuns:
    """The runs of one zone as parallel arrays (28 bytes a run, not three objects)."""
    __slots__ = ("starts", "lens", "first", "crcs", "hi")

    def __init__(self) -> None:
        self.starts = array("Q")      # zone offset of each run (sorted)
        self.lens = array("Q")        # its length
        self.first = array("Q")       # index of its first CRC in ``crcs``
        self.crcs = array("I")
        self.hi = 0                   # past the last byte any run covers (``end``)

    def add(self, zoff: int, length: int, crcs: array) -> None:
        if zoff + length > self.hi:
            self.hi = zoff + length
        i = len(self.starts)
        if i and zoff < self.starts[-1]:
            i = bisect_right(self.starts, zoff)
        if i == len(self.starts):
            self.starts.append(zoff)
            self.lens.append(length)
            self.first.append(len(self.crcs))
            self.crcs.extend(crcs)
            return
        # out of order (rare): rebuild the CRC table around the new run
        at = self.first[i]
        self.starts.insert(i, zoff)
        self.lens.insert(i, length)
        self.first.insert(i, at)
        self.crcs[at:at] = crcs
        for k in range(i + 1, len(self.first)):
            self.first[k] += len(crcs)

    def end(self) -> int:
        """Zone offset past the last byte any run covers (kept by ``add`` and ``clip``: a
        mount asks it of every zone, twice)."""
        return self.hi

    def clip(self, at: int) -> int:
        """Forget what lies at or past zone offset ``at`` (bytes the medium lost) and return
        where verified bytes now end: ``at``, or lower when a run crosses ``at`` (its piece
        holding ``at`` covers lost bytes too, so that piece goes; pieces wholly below stay)."""
        cut = at
        keep = []
        for i in range(len(self.starts)):
            a, n = self.starts[i], self.lens[i]
            if a >= at:
                continue
            if a + n > at:
                k = (at - a) // CSUM_PIECE
                cut = min(cut, a + k * CSUM_PIECE)
                if not k:
                    continue
                n = k * CSUM_PIECE
            f = self.first[i]
            keep.append((a, n, self.crcs[f:f + -(-n // CSUM_PIECE)]))
        self.starts, self.lens, self.first, self.crcs = array("Q"), array("Q"), array("Q"), array("I")
        self.hi = 0
        for a, n, c in keep:
            self.add(a, n, c)
        return cut

    def run(self, i: int) -> Run:
        a = self.first[i]
        n = -(-self.lens[i] // CSUM_PIECE)
        return Run(self.starts[i], self.lens[i], self.crcs[a:a + n])

    def __len__(self) -> int:
        return len(self.starts)


class ZoneChecksums:
    """zone -> its runs, sorted by zone offset (appends only, like the zone)."""

    def __init__(self) -> None:
        self.zones: dict[int, _ZoneRuns] = {}

    def add(self, zone: int, zoff: int, length: int, crcs: array) -> None:
        zr = self.zones.get(zone)
        if zr is None:
            zr = self.zones[zone] = _ZoneRuns()
        zr.add(zoff, length, crcs)

    def drop_zone(self, zone: int) -> None:
        self.zones.pop(zone, None)

    def end(self, zone: int) -> int:
        """Zone offset past the last checksummed byte of ``zone`` (0: none)."""
        zr = self.zones.get(zone)
        return zr.end() if zr is not None else 0

    def clip(self, zone: int, at: int) -> int:
        """``_ZoneRuns.clip`` of the zone: where its verified bytes end now."""
        zr = self.zones.get(zone)
        if zr is None:
            return at
        cut = zr.clip(at)
        if not len(zr):
            del self.zones[zone]
        return cut

    def runs(self, zone: int) -> list[Run]:
        zr = self.zones.get(zone)
        return [zr.run(i) for i in range(len(zr))] if zr is not None else []

    def items(self) -> dict[int, list[tuple[int, int, array]]]:
        """zone -> [(zoff, length, CRCs)] (the snapshot's table)."""
        out = {}
        for z, zr in self.zones.items():
            if len(zr):
                out[z] = [(r.zoff, r.length, r.crcs) for r in self.runs(z)]
        return out

    def span(self, zone: int, zoff: int, length: int) -> list[tuple[Run, int, int]] | None:
        """Pieces covering [zoff, zoff+length): [(run, first piece, last piece + 1)]; None when
        some byte is not covered by a checksum (an inconsistency: nothing unchecked is served)."""
        zr = self.zones.get(zone)
        if zr is None or not len(zr) or length <= 0:
            return [] if length <= 0 else None
        starts, lens = zr.starts, zr.lens
        end = zoff + length
        i = max(bisect_right(starts, zoff) - 1, 0)
        out = []
        pos = zoff
        n = len(starts)
        while pos < end:
            if i >= n or starts[i] > pos or starts[i] + lens[i] <= pos:
                return None
            r = zr.run(i)
            lo = (pos - r.zoff) // CSUM_PIECE
            hi_byte = min(end, r.end)
            hi = -(-(hi_byte - r.zoff) // CSUM_PIECE)
            out.append((r, lo, hi))
            pos = hi_byte
            i += 1
        return out

    @staticmethod
    def piece_range(run: Run, lo: int, hi: int) -> tuple[int, int]:
        """Zone byte range [a, b) of pieces lo..hi-1 of a run."""
        return run.zoff + lo * CSUM_PIECE, min(run.zoff + hi * CSUM_PIECE, run.end)

    @staticmethod
    def bad_pieces(run: Run, lo: int, hi: int, data, base: int) -> list[int]:
        """Zone offsets of the pieces whose bytes (``data`` starts at zone offset ``base``)
        do not match their CRC."""
        a0, b0 = run.zoff + lo * CSUM_PIECE, min(run.zoff + hi * CSUM_PIECE, run.end)
        got = crc32c_pieces((memoryview(data)[a0 - base:b0 - base],), b0 - a0, CSUM_PIECE)
        want = run.crcs[lo:hi]
        if got == want:
            return []
        return [run.zoff + (lo + k) * CSUM_PIECE for k in range(hi - lo) if got[k] != want[k]]

    # -- snapshot
    def load(self, table: dict) -> None:
        """Take a snapshot's table: zone -> [(zoff, length, CRCs)]."""
        for z, runs in table.items():
            for zoff, length, crcs in runs:
                self.add(int(z), zoff, length, crcs)
