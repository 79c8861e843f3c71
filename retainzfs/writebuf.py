"""Per-file write buffer: the chunks FUSE handed us, never joined into one big buffer.

Why not a bytearray: appending 1 MiB FUSE writes to a bytearray, slicing and deleting its front
copies every byte three or four times.  Here large chunks stay as they arrived and go to the
device as one scatter list (``os.pwritev``), so each byte is copied only by the kernel.

Why small writes are coalesced: a file written a line at a time (a training log, fio's 4 KiB
random layout) would otherwise become thousands of tiny parts, and one ``pwritev`` takes at most
IOV_MAX (1024) of them.  Writes below ``SMALL`` are copied into a tail bytearray that is sealed
(made an immutable part) when it reaches ``SMALL`` or when the buffer is sliced, so the number of
parts is bounded by ``len / SMALL + (number of large writes)``.
"""
from __future__ import annotations

from bisect import bisect_right

from ._iobuf import arena_slack, join_views, starts_its_object

SMALL = 64 << 10        # writes below this are copied into the tail instead of kept as parts


class Chunks:
    """A read-only byte range made of several buffers; sliced without copying."""
    __slots__ = ("parts", "starts", "length")

    def __init__(self, parts: list):
        self.parts = [p if type(p) is memoryview else memoryview(p) for p in parts]
        self.starts = []
        pos = 0
        for p in self.parts:
            self.starts.append(pos)
            pos += p.nbytes
        self.length = pos

    def __len__(self) -> int:
        return self.length

    def slice(self, lo: int, hi: int) -> list:
        """Buffers covering bytes [lo, hi)."""
        out = []
        i = max(bisect_right(self.starts, lo) - 1, 0)
        while i < len(self.parts) and self.starts[i] < hi:
            s = self.starts[i]
            p = self.parts[i]
            a, b = max(lo - s, 0), min(hi - s, p.nbytes)
            if b > a:
                out.append(p if (a == 0 and b == p.nbytes) else p[a:b])
            i += 1
        return out

    def tobytes(self, lo: int = 0, hi: int | None = None) -> bytes:
        return b"".join(self.slice(lo, self.length if hi is None else hi))


class WriteBuffer:
    """Bytes of one file range [off, off + len) not yet placed in a zone."""
    __slots__ = ("off", "chunks", "length", "_tail", "slack", "size0")

    def __init__(self) -> None:
        self.off = 0
        self.chunks: list = []          # immutable parts (bytes / memoryviews)
        self.length = 0
        self._tail = bytearray()        # small writes being coalesced (after ``chunks``)
        # bytes of write arenas the parts keep alive beyond their own (``arena_slack``): what
        # the buffer costs in memory is ``length + slack``, and that is what ``dirty_bytes``
        # bounds (OpenFiles)
        self.slack = 0
        # the file's size when the buffer was last empty (set by OpenFiles): what a failed
        # flush, which drops the buffer, puts the size back to
        self.size0 = 0

    def __len__(self) -> int:
        return self.length

    def __bool__(self) -> bool:
        return self.length > 0

    @property
    def end(self) -> int:
        return self.off + self.length

    @property
    def nparts(self) -> int:
        return len(self.chunks) + (1 if self._tail else 0)

    def _seal(self) -> None:
        """Make the tail an immutable part; a small last part absorbs it (copying < 2*SMALL
        bytes), so a file fsynced after every line does not grow a part per fsync."""
        if self._tail:
            last = self.chunks[-1] if self.chunks else None
            if last is not None and len(last) < SMALL:
                self.chunks[-1] = bytes(last) + self._tail
                if type(last) is memoryview:        # an arena's first bytes, let go
                    self.slack = arena_slack(self.chunks)
            else:
                self.chunks.append(bytes(self._tail))
            self._tail = bytearray()

    def append(self, off: int, data) -> bool:
        """Add ``data`` at file offset ``off``; False when it is not contiguous with the buffer."""
        if self.length == 0:
            self.off = off
        elif off != self.off + self.length:
            return False
        n = len(data)
        if not self._tail and self.chunks:
            joined = join_views(self.chunks[-1], data)      # the rest of the same arena
            if joined is not None:
                self.chunks[-1] = joined
                self.length += n
                self.slack = max(0, self.slack - n)     # the same arena, more of it shown
                return True
        if n < SMALL and not starts_its_object(data):
            # (the first bytes of a write arena stay a part of their own: the file's next
            # write continues that arena and joins them, and the part stays page-aligned.
            # Any other small piece is copied: a view would keep its whole arena alive)
            self._tail += data
            if len(self._tail) >= SMALL:
                self._seal()
        else:
            self._seal()
            self.chunks.append(data)
            if type(data) is memoryview:
                self.slack = arena_slack(self.chunks)
        self.length += n
        return True

    def prefix(self, n: int) -> Chunks:
        """The first ``n`` bytes, as a zero-copy view."""
        return self.take(0, n)

    def take(self, lo: int, n: int) -> Chunks:
        """Bytes [lo, lo + n) of the buffer (offsets from its start), as a zero-copy view;
        the parts are immutable, so the view stays right while more is appended."""
        self._seal()
        c = Chunks(self.chunks)
        return Chunks(c.slice(lo, lo + n))

    def drop(self, n: int) -> None:
        """Forget the first ``n`` bytes (they now live in a zone)."""
        if n >= self.length:
            self.off += self.length
            self.clear()
            return
        self._seal()
        c = Chunks(self.chunks)
        self.chunks = c.slice(n, c.length)
        self.off += n
        self.length -= n
        self.slack = arena_slack(self.chunks)
        if self.length < SMALL and self.slack:
            # What a flush in whole blocks leaves is at most a few KiB, but as a view it keeps
            # the whole 1 MiB arena of its write request alive (``_iobuf.WriteArenas``) until
            # the file's next flush: 300 files written in turn past ``dirty_bytes`` (128 MiB)
            # held 371 MiB of arenas for 4 KiB each.  Copied, the arena goes back at once.
            self.chunks = [b"".join(self.chunks)]
            self.slack = 0

    def slice(self, lo: int, hi: int) -> bytes:
        """Bytes of file range [lo, hi) (caller clips to the buffered range)."""
        self._seal()
        return Chunks(self.chunks).tobytes(lo - self.off, hi - self.off)

    def clear(self) -> None:
        self.chunks = []
        self._tail = bytearray()
        self.length = 0
        self.slack = 0
