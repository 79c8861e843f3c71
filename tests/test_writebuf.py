"""WriteBuffer / Chunks against a bytearray model, and the store's 4 MiB buffer bound.

Sizes cluster around the 4 KiB block, the 64 KiB coalescing threshold (``writebuf.SMALL``) and
the 4 MiB per-file buffer (``store.FLUSH_BYTES``): those edges decide whether a write is copied
into the tail, kept as a part, or sends the buffer to a zone.
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retainzfs.device import create_image, open_device
from retainzfs.store import FLUSH_BYTES, Store, StoreOptions
from retainzfs.writebuf import SMALL, Chunks, WriteBuffer

BS = 4096
MiB = 1 << 20


def around(*points: int, spread: int = 1) -> st.SearchStrategy[int]:
    vals = sorted({max(1, p + d) for p in points for d in range(-spread, spread + 1)})
    return st.sampled_from(vals)


small_size = st.one_of(around(1, BS, 2 * BS, SMALL // 2, SMALL), st.integers(1, 3 * BS))
any_size = st.one_of(small_size, around(SMALL, 4 * SMALL), st.integers(1, 2 * SMALL))


def blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


op = st.one_of(
    st.tuples(st.just("append"), any_size, st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 4 * SMALL)),
    st.tuples(st.just("prefix"), st.integers(0, 4 * SMALL)),
    st.tuples(st.just("slice"), st.integers(0, 4 * SMALL), st.integers(0, 4 * SMALL)),
    st.tuples(st.just("clear")),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10 * BS), st.lists(op, max_size=30))
def test_write_buffer_matches_bytearray(start, ops):
    buf = WriteBuffer()
    model = bytearray()
    off = start                 # file offset of model[0]
    large = 0                   # writes of SMALL or more (each may stay a part of its own)
    for k, o in enumerate(ops):
        if o[0] == "append":
            _, n, gap = o
            data = blob(n, k)
            at = off + len(model) + (1 if gap and model else 0)
            ok = buf.append(at, memoryview(data) if n >= SMALL else data)
            assert ok == (not (gap and model))
            if ok:
                if not model:
                    off = at
                model += data
                large += n >= SMALL
        elif o[0] == "drop":
            n = min(o[1], len(model))
            buf.drop(n)
            del model[:n]
            off += n
        elif o[0] == "prefix":
            n = min(o[1], len(model))
            c = buf.prefix(n)
            assert len(c) == n and c.tobytes() == bytes(model[:n])
        elif o[0] == "slice":
            lo, hi = sorted((min(o[1], len(model)), min(o[2], len(model))))
            assert buf.slice(off + lo, off + hi) == bytes(model[lo:hi])
        else:
            buf.clear()
            model.clear()
        assert len(buf) == len(model) and bool(buf) == bool(model)
        if model:
            assert buf.off == off and buf.end == off + len(model)
            assert buf.prefix(len(model)).tobytes() == bytes(model)
        # coalescing bounds the scatter list: parts <= bytes / SMALL + large writes + 1
        assert buf.nparts <= len(model) // SMALL + large + 2


@settings(max_examples=200, deadline=None)
@given(st.lists(any_size, min_size=1, max_size=8), st.integers(0, 9 * SMALL),
       st.integers(0, 9 * SMALL))
def test_chunks_slice_is_the_joined_slice(sizes, a, b):
    parts = [blob(n, k) for k, n in enumerate(sizes)]
    joined = b"".join(parts)
    c = Chunks(parts)
    lo, hi = sorted((min(a, len(joined)), min(b, len(joined))))
    assert len(c) == len(joined)
    assert b"".join(c.slice(lo, hi)) == joined[lo:hi] == c.tobytes(lo, hi)
    assert all(len(p) > 0 for p in c.slice(lo, hi))


# ------------------------------------------------------------------ the store's 4 MiB bound
big_size = st.one_of(around(BS, FLUSH_BYTES - BS, FLUSH_BYTES, FLUSH_BYTES + BS, spread=1),
                     around(FLUSH_BYTES // 2, 2 * FLUSH_BYTES, spread=1),
                     st.integers(1, 3 * BS))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(big_size, st.booleans()), min_size=1, max_size=5), st.booleans())
def test_store_buffers_at_most_4_mib_and_reads_back(tmp_path_factory, writes, durable):
    """Writes of sizes around 4 KiB and 4 MiB, buffered (``buffer_write``, the fast path)
    or not: a file never holds a full 4 MiB of unplaced bytes after a write returns, the
    bytes counted against the buffer bounds are the buffer's, reads see every byte before and
    after commit, and a remount reads the same file."""
    d = tmp_path_factory.mktemp("wb")
    path = str(d / "s.zns")
    dev = create_image(path, 64 * MiB, 2 * MiB, max_open=6, max_active=8)
    Store.format(dev)
    s = Store(dev, StoreOptions())
    ino = s.create(1, b"f", 0o644).ino
    s.open(ino)
    model = bytearray()
    for k, (n, loop) in enumerate(writes):
        data = blob(n, k)
        if not (loop and s.buffer_write(ino, len(model), data) == n):
            assert s.write(ino, len(model), data) == n
        model += data
        s.flushes.wait_flush(ino)
        inode = s.inodes[ino]
        assert len(inode.wbuf) < FLUSH_BYTES and inode.inflight == 0
        # what the bounds count (``OpenFiles.buffered``, ``dirty_since``) is what the buffer
        # holds once its flushes are done (a flush hands back through ``dropped_locked``)
        assert s.files.buffered == (len(inode.wbuf) + inode.wbuf.slack if inode.wbuf else 0)
        assert (ino in s.files.dirty_since) == bool(inode.wbuf)
        assert s.getattr(ino).size == len(model)
        assert s.read(ino, 0, len(model)) == bytes(model)
    s.commit(ino, durable=durable)
    inode = s.inodes[ino]
    assert not inode.wbuf and sum(e.length for e in inode.extents) == len(model)
    assert s.files.buffered == 0 and not s.files.dirty_since
    assert s.read(ino, 0, len(model) + 10) == bytes(model)
    s.release(ino)
    assert s.check() == []
    s.close()
    dev.close()
    dev = open_device(path)
    s = Store(dev)
    assert s.read(ino, 0, len(model) + 10) == bytes(model)
    assert s.check() == []
    s.close()
    dev.close()
