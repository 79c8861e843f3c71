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

import base64
from array import array
from bisect import bisect_right

from crc32c import crc32c

from .records import CSUM_PIECE


def crcs_of(parts, length: int) -> array:
    """CRC32C of each CSUM_PIECE of the first ``length`` bytes of a scatter list."""
    out = array("I")
    crc = 0
    fill = 0
    for p in parts:
        mv = p if type(p) is memoryview else memoryview(p)
        if mv.format != "B":
            mv = mv.cast("B")
        pos, n = 0, mv.nbytes
        while pos < n:
            take = min(n - pos, CSUM_PIECE - fill)
            crc = crc32c(mv[pos:pos + take], crc)
            fill += take
            pos += take
            if fill == CSUM_PIECE:
                out.append(crc)
                crc, fill = 0, 0
    if fill:
        out.append(crc)
    if len(out) != -(-length // CSUM_PIECE):
        raise ValueError("checksummed length does not match the data")
    return out


class Run:
    __slots__ = ("zoff", "length", "crcs")

    def __init__(self, zoff: int, length: int, crcs: array):
        self.zoff, self.length, self.crcs = zoff, length, crcs

    @property
    def end(self) -> int:
        return self.zoff + self.length


class ZoneChecksums:
    """zone -> its runs, sorted by zone offset (appends only, like the zone)."""

    def __init__(self) -> None:
        self.runs: dict[int, list[Run]] = {}
        self.starts: dict[int, list[int]] = {}

    def add(self, zone: int, zoff: int, length: int, crcs: array) -> None:
        runs = self.runs.setdefault(zone, [])
        starts = self.starts.setdefault(zone, [])
        i = bisect_right(starts, zoff)
        runs.insert(i, Run(zoff, length, crcs))
        starts.insert(i, zoff)

    def drop_zone(self, zone: int) -> None:
        self.runs.pop(zone, None)
        self.starts.pop(zone, None)

    def span(self, zone: int, zoff: int, length: int) -> list[tuple[Run, int, int]] | None:
        """Pieces covering [zoff, zoff+length): [(run, first piece, last piece + 1)]; None when
        some byte is not covered by a checksum (an inconsistency: nothing unchecked is served)."""
        starts = self.starts.get(zone)
        if not starts or length <= 0:
            return [] if length <= 0 else None
        runs = self.runs[zone]
        end = zoff + length
        i = max(bisect_right(starts, zoff) - 1, 0)
        out = []
        pos = zoff
        while pos < end:
            if i >= len(runs) or runs[i].zoff > pos or runs[i].end <= pos:
                return None
            r = runs[i]
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
        mv = memoryview(data)
        bad = []
        for k in range(lo, hi):
            a, b = run.zoff + k * CSUM_PIECE, min(run.zoff + (k + 1) * CSUM_PIECE, run.end)
            if crc32c(mv[a - base:b - base]) != run.crcs[k]:
                bad.append(a)
        return bad

    # -- snapshot
    def encode(self) -> dict:
        return {str(z): [[r.zoff, r.length, base64.b64encode(r.crcs.tobytes()).decode()]
                         for r in runs] for z, runs in self.runs.items() if runs}

    def load(self, doc: dict) -> None:
        for z, runs in doc.items():
            for zoff, length, b64 in runs:
                crcs = array("I")
                crcs.frombytes(base64.b64decode(b64))
                self.add(int(z), zoff, length, crcs)
