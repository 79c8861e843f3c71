"""A device cache that loses data on a power cut, for in-process crash tests.

Why a model of our own: LazyFS (the power-cut campaign) drops every unsynced write at a cut,
in order, so a journal frame never outlives the data it points at.  A real device's volatile
cache keeps no order until a flush: the journal's frames (metadata zones) may reach the medium
and the data zones' writes not.  This keeps the metadata zones as written and rolls the data
zones (and their zone-table entries) back to the last ``flush``.
"""
from __future__ import annotations


class DataCacheLoss:
    """A power cut on a device whose volatile cache kept the metadata zones' writes and lost
    every data zone write since the last flush (a cache keeps no order until a flush).  At
    each ``flush`` the data zones and their zone-table entries are copied; ``crashed_copy``
    writes the image as the cut leaves it: the metadata zones as written, the data zones as
    of the last flush."""

    def __init__(self, path: str, dev, meta_zones: int):
        from retainzfs.device import _ENTRY
        self.path, self.dev, self.meta = path, dev, meta_zones
        self.ent = _ENTRY.size
        self.flushed_image = path + ".flushed"      # the whole image as of the last flush
        self._snapshot()
        real = dev.flush

        def flush():
            real()
            self._snapshot()
        dev.flush = flush

    def _snapshot(self) -> None:
        import shutil
        self.snap = self._data()
        shutil.copyfile(self.path, self.flushed_image)

    def _ranges(self):
        d = self.dev
        yield d._table_off + self.meta * self.ent, (d.nr_zones - self.meta) * self.ent
        yield d._data_off + self.meta * d.zone_size, (d.nr_zones - self.meta) * d.zone_size

    def _data(self) -> list[bytes]:
        with open(self.path, "rb") as f:
            out = []
            for off, n in self._ranges():
                f.seek(off)
                out.append(f.read(n))
            return out

    def crashed_copy(self, to: str) -> None:
        import shutil
        shutil.copyfile(self.path, to)
        with open(to, "r+b") as f:
            for (off, _), b in zip(self._ranges(), self.snap):
                f.seek(off)
                f.write(b)
