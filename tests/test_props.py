"""Property tests of the codecs and buffers, over sizes around every limit (issue 8).

Limits: the block size (journal padding 0..block, records straddling a boundary), IOV_MAX (one
``pwritev`` takes at most 1024 buffers), the write buffer's small-write threshold, the snapshot
chunk (1 MiB) and the zone capacity.
"""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retainzfs import _journal as J
from retainzfs import writebuf as W
from retainzfs.device import IOV_MAX, create_image, open_device

BS = 4096
MiB = 1 << 20
SLOW = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------ journal framing
def _lengths_near_block():
    """Payload lengths whose framed size ends a batch at every offset of a block."""
    near = [0, 1, 2, 7, 8, 9, 100, BS - J.HEADER_SIZE - 8, BS - J.HEADER_SIZE - 1,
            BS - J.HEADER_SIZE, BS - J.HEADER_SIZE + 1, BS - 1, BS, BS + 1, 3 * BS + 5]
    return st.one_of(st.sampled_from(near), st.integers(0, 3 * BS))


def _flush(records: list[tuple[int, bytes]]) -> bytes:
    """One journal flush: records framed back to back, zero padded to the block size."""
    data = b"".join(J.encode_record(t, p) for t, p in records)
    return data + bytes(-len(data) % BS)


@given(st.lists(st.lists(st.tuples(st.sampled_from([J.INODE, J.EXTENT, J.DIRENT_ADD, J.RENAME]),
                                   _lengths_near_block()), min_size=1, max_size=6),
                min_size=1, max_size=8), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_journal_flushes_decode_exactly(batches, rnd):
    """Every record of every flush comes back, whatever the padding length (0..BS-1)."""
    want, buf = [], bytearray()
    for batch in batches:
        recs = [(t, rnd.randbytes(n)) for t, n in batch]
        want += recs
        buf += _flush(recs)
    got, end, clean = J.decode_records(bytes(buf), 0, BS)
    assert clean and end == len(buf)
    assert [(t, bytes(p)) for t, p, _ in got] == want


@pytest.mark.parametrize("pad", range(0, 64))
def test_every_short_padding_length(pad):
    """Batches whose padding is exactly ``pad`` bytes (and BS - pad): the 1..8 byte cases
    that were read as a corrupt record."""
    for target in (pad, BS - pad if pad else 0):
        # one record of framed length BS - target (or 2*BS - target when too short)
        framed = BS - target if BS - target >= J.HEADER_SIZE else 2 * BS - target
        p1 = bytes(framed - J.HEADER_SIZE)
        batch = _flush([(J.INODE, p1)])
        assert len(batch) - len(J.encode_record(J.INODE, p1)) == target % BS
        buf = batch + _flush([(J.DIRENT_ADD, b"sentinel")])
        got, end, clean = J.decode_records(buf, 0, BS)
        assert clean and [bytes(p) for _, p, _ in got] == [p1, b"sentinel"]


@given(st.lists(_lengths_near_block(), min_size=2, max_size=6), st.data())
@settings(max_examples=200, deadline=None)
def test_journal_damage_is_never_misread(lengths, data):
    """A flipped byte inside a record stops decoding at or before that record: no record is
    ever returned with content other than what was written."""
    recs = [(J.INODE, bytes([i + 1]) * n) for i, n in enumerate(lengths)]
    buf = bytearray(_flush(recs))
    framed_end = sum(J.HEADER_SIZE + n for n in lengths)
    pos = data.draw(st.integers(0, framed_end - 1))
    buf[pos] ^= data.draw(st.integers(1, 255))
    got, end, clean = J.decode_records(bytes(buf), 0, BS)
    for (t, p, off), (wt, wp) in zip(got, recs):
        assert (t, bytes(p)) == (wt, wp)
    starts = [sum(J.HEADER_SIZE + n for n in lengths[:i]) for i in range(len(lengths))]
    hit = max(i for i, s in enumerate(starts) if s <= pos)
    assert len(got) <= hit and not clean          # CRC32C catches every single-byte error


# ------------------------------------------------------------------ snapshot chunking
@pytest.mark.parametrize("n", [0, 1, J.SNAP_CHUNK_SIZE - 1, J.SNAP_CHUNK_SIZE,
                               J.SNAP_CHUNK_SIZE + 1, 2 * J.SNAP_CHUNK_SIZE,
                               2 * J.SNAP_CHUNK_SIZE + J.HEADER_SIZE + 3,
                               3 * J.SNAP_CHUNK_SIZE - 4096])
def test_snapshot_chunks_roundtrip(tmp_path, n):
    dev = create_image(str(tmp_path / "s.zns"), 64 * MiB, 4 * MiB)
    try:
        snap = random.Random(n).randbytes(n)
        sb = {"magic": J.MAGIC, "version": J.FORMAT_VERSION, "seq": 1}
        jr = J.Journal(dev, 3, sb, lambda: snap)
        jr.format()
        jr.append(J.INODE, b"after")
        jr.flush()
        info = J.Journal.read_zone(dev, 0)
        assert info["clean"] and info["snapshot"] == snap
        assert [bytes(p) for _, p, _ in info["records"]] == [b"after"]
        jr.roll()                                         # the same image in the next zone
        info = J.Journal.find_latest(dev, 3)
        assert info["zone"] == 1 and info["snapshot"] == snap
    finally:
        dev.close()


# ------------------------------------------------------------------ write buffer
_SIZES = st.one_of(st.sampled_from([1, 2, 100, BS - 1, BS, BS + 1, W.SMALL - 1, W.SMALL,
                                    W.SMALL + 1, 3 * W.SMALL + 7, MiB]),
                   st.integers(1, 3 * W.SMALL))


@given(st.lists(st.one_of(st.tuples(st.just("w"), _SIZES),
                          st.tuples(st.just("drop"), st.integers(0, 2 * W.SMALL)),
                          st.tuples(st.just("read"), st.integers(0, 10 ** 6))),
                max_size=120), st.randoms(use_true_random=False))
@SLOW
def test_write_buffer_matches_model(ops, rnd):
    buf = W.WriteBuffer()
    model = bytearray()
    base = 0
    large = 0
    for op, n in ops:
        if op == "w":
            data = rnd.randbytes(n)
            assert buf.append(base + len(model), data)
            model += data
            assert not buf.append(base + len(model) + 1, b"x")     # not contiguous: refused
            large += n >= W.SMALL
        elif op == "drop":
            n = min(n, len(model))
            buf.drop(n)
            del model[:n]
            base += n
        else:
            if model:
                lo = base + n % len(model)
                hi = min(base + len(model), lo + 1 + n % 9000)
                assert buf.slice(lo, hi) == bytes(model[lo - base:hi - base])
        assert len(buf) == len(model) and buf.off == base
        pre = buf.prefix(len(model))
        assert pre.tobytes() == bytes(model)
        # bounded parts: what makes one pwritev (IOV_MAX buffers) enough
        assert buf.nparts <= len(model) // W.SMALL + large + 3


@given(st.integers(1, 3 * IOV_MAX), st.sampled_from([1, 7, 512, 4096]))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_scatter_write_of_any_part_count(tmp_path_factory, nparts, part):
    """A scatter list longer than IOV_MAX is written completely, in order."""
    path = str(tmp_path_factory.mktemp("sg") / "d.zns")
    dev = create_image(path, 16 * MiB, 4 * MiB, force=True)
    try:
        rnd = random.Random(nparts)
        parts = [rnd.randbytes(part) for _ in range(nparts)]
        total = nparts * part
        pad = -total % BS
        if pad:
            parts.append(bytes(pad))
        total += pad
        if total > dev.zone_capacity:
            return
        dev.write(1, 0, parts)
        assert dev.read(1, 0, total) == b"".join(parts)
        dev.close()
        dev = open_device(path)
        assert dev.zone(1).wp == total and dev.read(1, 0, total) == b"".join(parts)
    finally:
        dev.close()
