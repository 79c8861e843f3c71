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
from retainzfs import records as R
from retainzfs.superblock import Superblock
from retainzfs import writebuf as W
from retainzfs.device import IOV_MAX, create_image, open_device

BS = 4096
MiB = 1 << 20
SLOW = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------ journal framing
FSID = 0x1234


def _lengths_near_block():
    """Body lengths whose frame ends at every offset of a block (padding 0..BS-1)."""
    h = J.FRAME_HEADER + J.REC_HEADER
    near = [0, 1, 2, 7, 8, 9, 100, BS - h - 8, BS - h - 1, BS - h, BS - h + 1, BS - 1, BS,
            BS + 1, 3 * BS + 5]
    return st.one_of(st.sampled_from(near), st.integers(0, 3 * BS))


def _frames(batches, rnd):
    """Frames of consecutive flushes (seq 1, 2, ...) and the records they carry."""
    buf, want = bytearray(), []
    for seq, batch in enumerate(batches, 1):
        recs = [(t, rnd.randbytes(n)) for t, n in batch]
        want.append(recs)
        body = b"".join(J.encode_record(t, p) for t, p in recs)
        frame = J.encode_frame(seq, FSID, body, BS)
        assert len(frame) % BS == 0 and len(frame) == J.frame_size(len(body), BS)
        buf += frame
    return bytes(buf), want


def _parse_all(buf):
    out, pos = [], 0
    while pos < len(buf):
        f = J.parse_frame(buf, pos, BS, FSID)
        if f is None:
            break
        out.append((f[0], J.decode_records(f[1])))
        pos += f[2] * BS
    return out, pos


@given(st.lists(st.lists(st.tuples(st.sampled_from([R.INODE, R.EXTENT, R.DIRENT_ADD, R.RENAME]),
                                   _lengths_near_block()), min_size=1, max_size=6),
                min_size=1, max_size=8), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_frames_decode_exactly(batches, rnd):
    """Every record of every flush comes back, in order, whatever the padding length."""
    buf, want = _frames(batches, rnd)
    got, end = _parse_all(buf)
    assert end == len(buf)
    assert [seq for seq, _ in got] == list(range(1, len(batches) + 1))
    assert [[(t, bytes(p)) for t, p in recs] for _, recs in got] == want


@given(st.lists(st.integers(0, 300), max_size=12), st.integers(1, 400),
       st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_a_flush_is_cut_into_bodies_at_record_boundaries(lengths, body_max, rnd):
    """``split_bodies``: the bodies put back together are the flush; each decodes whole;
    each is at most ``body_max`` unless it is one record that alone is longer."""
    recs = [(R.INODE, rnd.randbytes(n)) for n in lengths]
    raw = b"".join(J.encode_record(t, pl) for t, pl in recs)
    bodies = J.split_bodies(raw, body_max)
    assert b"".join(bodies) == raw
    assert [r for b in bodies for r in J.decode_records(b)] == recs
    for b in bodies:
        assert len(b) <= body_max or len(J.decode_records(b)) == 1


@given(st.lists(st.integers(0, 3000), max_size=5), st.integers(1, 1024), st.integers(64, 2048),
       st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_a_snapshot_is_framed_as_begin_chunks_end(pieces, chunk, body_max, rnd):
    """``snapshot_bodies``: SNAP_BEGIN, chunks of exactly ``chunk`` bytes (the last shorter),
    SNAP_END, whether the snapshot comes whole or in pieces; the chunks are the snapshot."""
    parts = [rnd.randbytes(n) for n in pieces]
    blob = b"".join(parts)
    for snap in (list(parts), blob):
        recs = [r for b in J.snapshot_bodies(snap, chunk, body_max) for r in J.decode_records(b)]
        assert recs[0][0] == R.SNAP_BEGIN and recs[-1][0] == R.SNAP_END
        chunks = [pl for t, pl in recs[1:-1]]
        assert all(t == R.SNAP_CHUNK for t, _ in recs[1:-1])
        assert b"".join(chunks) == blob
        assert all(len(c) == chunk for c in chunks[:-1]) and all(0 < len(c) <= chunk for c in chunks)


@given(st.lists(st.tuples(st.integers(1, 255), st.integers(0, 300)), max_size=8),
       st.integers(0, 12), st.binary(max_size=12), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_a_body_decodes_whole_or_raises_where_its_prefix_ends(recs, cut, junk, rnd):
    """``decode_records`` is ``decode_prefix`` that insists on the whole body: cut the last
    record short or add bytes that are no record, and it raises; the prefix is exactly the
    records before the damage (what salvage keeps)."""
    good = [(t, rnd.randbytes(n)) for t, n in recs]
    body = b"".join(J.encode_record(t, pl) for t, pl in good)
    assert J.decode_records(body) == good
    assert J.decode_prefix(body) == (good, len(body))
    bad = body[:len(body) - cut] + junk if cut <= len(body) else junk
    out, end = J.decode_prefix(bad)
    assert bad[:end] == b"".join(J.encode_record(t, pl) for t, pl in out)
    if end == len(bad):
        assert J.decode_records(bad) == out
    else:
        with pytest.raises(ValueError, match="past the frame body"):
            J.decode_records(bad)
        assert len(bad) - end < J.REC_HEADER or \
            int.from_bytes(bad[end:end + 4], "little") + 4 > len(bad) - end or \
            bad[end:end + 4] == bytes(4)


def test_every_padding_length():
    """Frames whose padding is exactly 0, 1, ..., BS-1 bytes (the 1..8 byte cases are what
    format v1 read as a corrupt record), each followed by another frame."""
    for target in range(BS):
        n = (BS - target - J.FRAME_HEADER - J.REC_HEADER) % BS
        body = J.encode_record(R.INODE, bytes(n))
        f1 = J.encode_frame(1, FSID, body, BS)
        assert len(f1) - J.FRAME_HEADER - len(body) == target
        buf = f1 + J.encode_frame(2, FSID, J.encode_record(R.DIRENT_ADD, b"sentinel"), BS)
        got, end = _parse_all(buf)
        assert end == len(buf) and [recs[0][1] for _, recs in got] == [bytes(n), b"sentinel"]


@given(st.lists(_lengths_near_block(), min_size=2, max_size=6), st.data())
@settings(max_examples=300, deadline=None)
def test_any_damaged_byte_is_detected(lengths, data):
    """One flipped byte anywhere in a frame — header, body or padding — makes exactly that
    frame unreadable; the frames before it are intact and the reader finds the ones after."""
    rnd = random.Random(len(lengths))
    buf, want = _frames([[(R.INODE, n)] for n in lengths], rnd)
    starts, pos = [], 0
    while pos < len(buf):
        starts.append(pos)
        pos += J.parse_frame(buf, pos, BS, FSID)[2] * BS
    bad = bytearray(buf)
    at = data.draw(st.integers(0, len(buf) - 1))
    bad[at] ^= data.draw(st.integers(1, 255))
    hit = max(i for i, s0 in enumerate(starts) if s0 <= at)
    for i, s0 in enumerate(starts):
        f = J.parse_frame(bytes(bad), s0, BS, FSID)
        assert (f is None) == (i == hit), (i, hit)


@given(st.integers(1, 6), st.data())
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_pair_reader_uses_the_good_copy(tmp_path_factory, nframes, data):
    """Both zones of a pair hold the frames; damage in one copy anywhere is read past."""
    path = str(tmp_path_factory.mktemp("pair") / "p.zns")
    dev = create_image(path, 32 * MiB, 4 * MiB, force=True)
    try:
        rnd = random.Random(nframes)
        buf, want = _frames([[(R.INODE, rnd.randrange(1, 3 * BS))] for _ in range(nframes)], rnd)
        dev.write(0, 0, buf)
        dev.write(1, 0, buf)
        copy = data.draw(st.integers(0, 1))
        at = data.draw(st.integers(0, len(buf) - 1))
        dev.close()
        with open(path, "r+b") as f:
            d = open_device(path)
            pos = d._data_off + copy * d.zone_size + at
            d.close()
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x80]))
        dev = open_device(path)
        frames, problems, damage = J.read_pair(dev, 0, FSID, BS)
        assert damage == [] and [s0 for s0, _, _ in frames] == list(range(1, nframes + 1))
        assert [J.decode_records(body)[0][1] for _, body, _ in frames] == \
            [recs[0][1] for recs in want]
    finally:
        dev.close()


# ------------------------------------------------------------------ snapshot chunking
@pytest.mark.parametrize("n", [0, 1, R.SNAP_CHUNK_SIZE - 1, R.SNAP_CHUNK_SIZE,
                               R.SNAP_CHUNK_SIZE + 1, 2 * R.SNAP_CHUNK_SIZE,
                               2 * R.SNAP_CHUNK_SIZE + J.REC_HEADER + 3,
                               3 * R.SNAP_CHUNK_SIZE - 4096, 5 * R.SNAP_CHUNK_SIZE + 7])
def test_snapshot_chunks_roundtrip(tmp_path, n):
    """Snapshots of sizes around the chunk, spanning zone pairs, read back exactly."""
    dev = create_image(str(tmp_path / "s.zns"), 64 * MiB, 4 * MiB)
    try:
        snap = random.Random(n).randbytes(n)
        sb = Superblock.new(dev, 8, "retainz", 1)
        jr = J.Journal(dev, sb, lambda: snap)
        jr.format()
        jr.append(R.INODE, b"after")
        jr.flush()
        st_ = J.load(dev, sb)
        assert b"".join(st_.snapshot) == snap and not st_.corrupt and not st_.torn
        assert [bytes(p) for _, p in st_.records] == [b"after"]
        jr.roll()                                         # the same image in the next pairs
        st_ = J.load(dev, sb)
        assert b"".join(st_.snapshot) == snap and st_.records == [] and st_.live[0] != 0
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 * 4096 + 1), st.integers(0, 4096)), min_size=1,
                max_size=40),
       st.sampled_from([4096, 8192, 3 * 4096, 1 << 16]))
def test_gc_copy_batches_cover_segments_and_end_on_blocks(spec, limit):
    """GC copies a group's segments packed, in batches of at most ``limit`` bytes that end on
    a block (no padding inside a group): every byte once, in order, offsets carried along."""
    from retainzfs.reclaim import _batches
    segs, off, zoff = [], 0, 0
    for ln, gap in spec:
        segs.append((off, ln, zoff))
        off += ln + gap
        zoff += ln + 4096 - ln % 4096       # never contiguous in both: merging is unique
    batches = list(_batches(segs, limit, 4096))
    flat = [p for b in batches for p in b]
    assert all(sum(p[1] for p in b) <= limit for b in batches)
    assert all(sum(p[1] for p in b) % 4096 == 0 for b in batches[:-1])
    # pieces of one segment are consecutive and continue both offsets
    merged = []
    for o, ln, z in flat:
        assert ln > 0
        if merged and merged[-1][0] + merged[-1][1] == o and merged[-1][2] + merged[-1][1] == z:
            merged[-1] = (merged[-1][0], merged[-1][1] + ln, merged[-1][2])
        else:
            merged.append((o, ln, z))
    assert merged == segs


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(
           st.sampled_from([256 * 1024 - 1, 256 * 1024, 256 * 1024 + 1, 256 * 1024 + BS - 1,
                            MiB - BS, MiB - 1, MiB, MiB + 1, 2 * MiB + 17]),
           st.integers(1, 3 * MiB)), min_size=1, max_size=5),
       piece=st.sampled_from([MiB - 48, 48, 300_000, MiB]),
       flush=st.sampled_from([256 * 1024, MiB, 4 * MiB]))
def test_staged_flushes_land_the_bytes_a_scatter_write_would(tmp_path_factory, sizes, piece,
                                                            flush):
    """A flush staged before io_lock (``DataPath.stage``: copied into aligned memory, CRCs
    taken, written in one run) and one that falls back to the scatter list (a run split
    where a 1 MiB zone ends, or below ``STAGE_MIN``) store the same bytes with checksums that
    verify, after a remount.  Sizes around the stage threshold, the block and the zone."""
    from retainzfs import datapath as DP
    from retainzfs.store import Store, StoreOptions
    path = str(tmp_path_factory.mktemp("stage") / "s.zns")
    dev = create_image(path, 64 * MiB, MiB, max_open=6, max_active=8, force=True)
    Store.format(dev)
    s = Store(dev, StoreOptions(flush_bytes=flush))
    staged = []
    real = s.data.stage
    s.data.stage = lambda data: staged.append(len(data)) or real(data)
    want = {}
    for k, size in enumerate(sizes):
        data = os.urandom(size)
        ino = s.create(1, f"f{k}".encode(), 0o644).ino
        s.open(ino)
        for i in range(0, size, piece):          # 1 MiB - 48: a Python buffer's FUSE split
            s.write(ino, i, data[i:i + piece])
        s.commit(ino, durable=True)
        s.release(ino)
        want[ino] = data
    if any(size >= flush >= DP.STAGE_MIN for size in sizes):
        assert any(n >= DP.STAGE_MIN for n in staged)    # the staged path did run
    s.close()
    dev.close()
    dev = open_device(path)
    s = Store(dev)
    try:
        for ino, data in want.items():
            assert s.read(ino, 0, len(data) + 1) == data
        assert s.check() == []
        assert s.stats["checksum_errors"] == 0
    finally:
        s.close()
        dev.close()


# ---------------------------------------------------------------------------- sizes on the CLI

@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10 ** 500), st.sampled_from(["", "B", "K", "M", "G", "T", "KiB", "GiB"]),
       st.integers(0, 10 ** 6), st.booleans())
def test_sizes_parse_exactly_at_any_length(whole, unit, frac, with_frac):
    """``mkfs --size`` / ``-o dirty_bytes=``: exact bytes (a 400-digit size was a float
    infinity: OverflowError and a traceback); what is not a size is ValueError, one line."""
    from fractions import Fraction
    from retainzfs.cli.common import parse_size
    mult = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
            "KiB": 1 << 10, "GiB": 1 << 30}[unit]
    text = f"{whole}.{frac}" if with_frac else str(whole)
    assert parse_size(text + unit) == int(Fraction(text) * mult)
    for bad in (text + "X", "-" + text + unit, text + unit + "s", "1e9" + unit, ""):
        with pytest.raises(ValueError):
            parse_size(bad)
