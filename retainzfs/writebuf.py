"""Per-file write buffer: a list of the chunks FUSE handed us, never joined.

Why not a bytearray: appending 1 MiB FUSE writes to a bytearray, slicing and deleting its front
copies every byte three or four times.  Here the chunks stay as they arrived and go to the
device as one scatter list (``os.pwritev``), so each byte is copied only by the kernel — which
is what keeps the mount close to raw device speed.
"""
from __future__ import annotations

from bisect import bisect_right


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
    __slots__ = ("off", "chunks", "length")

    def __init__(self) -> None:
        self.off = 0
        self.chunks: list = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __bool__(self) -> bool:
        return self.length > 0

    @property
    def end(self) -> int:
        return self.off + self.length

    def append(self, off: int, data) -> bool:
        """Add ``data`` at file offset ``off``; False when it is not contiguous with the buffer."""
        if self.length == 0:
            self.off = off
        elif off != self.off + self.length:
            return False
        self.chunks.append(data)
        self.length += len(data)
        return True

    def prefix(self, n: int) -> Chunks:
        """The first ``n`` bytes, as a zero-copy view."""
        c = Chunks(self.chunks)
        return Chunks(c.slice(0, n))

    def drop(self, n: int) -> None:
        """Forget the first ``n`` bytes (they now live in a zone)."""
        if n >= self.length:
            self.off += self.length
            self.clear()
            return
        c = Chunks(self.chunks)
        self.chunks = c.slice(n, c.length)
        self.off += n
        self.length -= n

    def slice(self, lo: int, hi: int) -> bytes:
        """Bytes of file range [lo, hi) (caller clips to the buffered range)."""
        return Chunks(self.chunks).tobytes(lo - self.off, hi - self.off)

    def clear(self) -> None:
        self.chunks = []
        self.length = 0
