"""One copy of written bytes in the daemon: write arenas, joined views, unstaged O_DIRECT flushes.

A FUSE write's payload is copied out of libfuse's buffer into a page-aligned arena
(``_iobuf.WriteArenas``); a 1 MiB write from unaligned memory arrives as two requests that fill
one arena in turn and ``WriteBuffer`` joins them (``join_views``); a flush whose parts are all
page-aligned whole blocks goes to the O_DIRECT device straight from them (``DataPath.stage``,
``_DirectIO.pwrite``).  Sizes around the limits: 48 bytes (the kernel's split of an unaligned
1 MiB write), the 4 KiB block, 64 KiB (``writebuf.SMALL``), half an arena (a new arena's
threshold), the arena (1 MiB) and past it, and IOV_MAX parts.
"""
from __future__ import annotations

import mmap
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retainzfs import _iobuf as I
from retainzfs import device as D
from retainzfs.writebuf import WriteBuffer

KiB, MiB = 1 << 10, 1 << 20
ARENA = MiB
HALF = ARENA // 2

_sizes = st.one_of(
    st.sampled_from([1, 48, 4095, 4096, 4097, 64 * KiB - 1, 64 * KiB, HALF - 1, HALF, HALF + 1,
                     ARENA - 48, ARENA - 4096, ARENA - 1, ARENA, ARENA + 1]),
    st.integers(1, ARENA + 4096))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["next", "next", "next", "gap", "back", "drop",
                                               "flush"]),
                              _sizes, st.integers(0, 2)), min_size=1, max_size=25),
       max_open=st.sampled_from([1, 2, 64]))
def test_arenas_and_buffers_hold_exactly_what_was_written(ops, max_open):
    """Writes of any size, in order or not, to three files through ``WriteArenas`` and one
    ``WriteBuffer`` per file (a write that does not continue a buffer starts it afresh, as
    the store flushes it): each buffer holds exactly its bytes, though every reserved view
    was filled after the earlier ones (views never overlap), and a file written in order
    from an arena's start has whole-arena parts."""
    arenas = I.WriteArenas(max_open=max_open)
    rnd = random.Random(7)
    bufs = {k: WriteBuffer() for k in range(3)}
    model = {k: bytearray() for k in range(3)}
    pos = {k: 0 for k in range(3)}
    for kind, n, k in ops:
        if kind == "drop":
            arenas.drop(k)
            continue
        if kind == "flush":                  # a flush took the first n bytes to a zone
            n = min(n, len(bufs[k]))
            bufs[k].drop(n)
            del model[k][:n]
            assert bufs[k].slack == I.arena_slack(bufs[k].chunks)
            assert len(bufs[k]) >= 64 * KiB or not bufs[k].slack   # a small rest is copied
            continue
        at = pos[k] + {"next": 0, "gap": 4096, "back": -min(pos[k], 48)}[kind]
        data = rnd.randbytes(n)
        view = arenas.reserve(k, at, n)
        if view is None:
            assert n < HALF
            parts = [data]
        elif type(view) is tuple:            # the rest of the open arena, then a new one
            head, tail = view
            assert len(head) + len(tail) == n and len(head) and len(tail)
            assert I.aligned_parts([memoryview(head.obj)], 4096)   # arenas: page-aligned
            head[:] = data[:len(head)]
            tail[:] = data[len(head):]
            assert (head.obj.__len__() == ARENA and   # head ends its arena, tail starts one
                    I.join_views(head, tail) is None)
            parts = [head, tail]
        else:
            assert len(view) == n and not view.readonly
            view[:] = data
            parts = [view]
        wb = bufs[k]
        pos_k = at
        for part in parts:
            if not wb.append(pos_k, part):   # not contiguous: the store flushes, then starts
                wb.clear()
                model[k] = bytearray()
                assert wb.append(pos_k, part)
            pos_k += len(part)
            # what the buffer keeps alive, kept up as it grows = counted afresh
            assert wb.slack == I.arena_slack(wb.chunks)
        model[k] += data
        pos[k] = at + n
        assert len(arenas) <= max_open
    for k, wb in bufs.items():
        assert wb.take(0, len(wb)).tobytes() == bytes(model[k])


def test_arena_slack_counts_each_arena_once_less_what_its_views_show():
    """The memory a buffer's parts keep alive beyond their bytes: an arena's capacity (or
    another object's length) once per object, less every byte a view of it shows; parts that
    are not views cost nothing."""
    a, b = I.AlignedBuf(ARENA), I.AlignedBuf(ARENA)
    va, vb = memoryview(a), memoryview(b)
    assert I.arena_slack([]) == 0
    assert I.arena_slack([va[:HALF + 1]]) == HALF - 1
    assert I.arena_slack([va[:HALF + 1], b"x" * 100, va[HALF + 1:]]) == 0
    assert I.arena_slack([va[:48], vb[4096:8192], memoryview(b"abc")]) == 2 * ARENA - 48 - 4096
    assert I.arena_slack([va[10:20], va[30:40]]) == ARENA - 20
    big = b"y" * 300_000
    assert I.arena_slack([memoryview(big)[299_008:], b"z" * 10]) == 299_008
    assert I.arena_slack([memoryview(bytearray(100))[:40]]) == 60


def test_an_unaligned_megabyte_write_fills_one_arena_and_flushes_without_a_copy():
    """The kernel's split of an unaligned 1 MiB write (1 MiB - 48, then 48 bytes), four times:
    four whole, page-aligned arena parts that O_DIRECT takes as they are."""
    arenas = I.WriteArenas()
    wb = WriteBuffer()
    payload = os.urandom(4 * MiB)
    off = 0
    for _ in range(4):
        for n in (MiB - 48, 48):
            v = arenas.reserve(9, off, n)
            assert v is not None                  # the 48 bytes continue the arena
            v[:] = payload[off:off + n]
            assert wb.append(off, v)
            off += n
    assert [len(c) for c in wb.chunks] == [MiB] * 4
    parts = wb.take(0, 4 * MiB).parts
    assert I.aligned_parts(parts, 4096)
    assert b"".join(parts) == payload
    assert len(arenas) == 0                       # full arenas are let go
    assert arenas.reserve(9, off, 100) is None    # a small write with no arena: elsewhere
    v = arenas.reserve(9, off, HALF)
    assert v is not None and len(arenas) == 1
    arenas.drop(9)                                # the file's close
    assert len(arenas) == 0
    with pytest.raises(ValueError):
        I.WriteArenas(size=0)


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(st.integers(0, 3 * 4096), st.integers(0, 3 * 4096)),
       b=st.tuples(st.integers(0, 3 * 4096), st.integers(0, 3 * 4096)),
       same=st.booleans(), kind=st.sampled_from(["aligned", "bytes", "bytearray"]))
def test_join_views_joins_exactly_adjacent_views_of_one_object(a, b, same, kind):
    def make():
        if kind == "aligned":
            buf = I.AlignedBuf(4 * 4096)
            memoryview(buf)[:] = os.urandom(4 * 4096)
            return buf
        return (bytes if kind == "bytes" else bytearray)(os.urandom(4 * 4096))
    x = make()
    y = x if same else make()
    va = memoryview(x)[a[0]:a[0] + a[1]]
    vb = memoryview(y)[b[0]:b[0] + b[1]]
    j = I.join_views(va, vb)
    adjacent = same and a[0] + len(va) == b[0]
    if adjacent:
        assert j is not None and j.obj is x and bytes(j) == bytes(va) + bytes(vb)
    else:
        assert j is None
    assert I.join_views(bytes(va), vb) is None          # only views are joined


def test_aligned_parts_names_what_o_direct_takes_as_it_is():
    a = I.AlignedBuf(MiB)
    v = memoryview(a)
    assert I.aligned_parts([v], 4096)
    assert I.aligned_parts([v[:4096], v[4096:MiB]], 4096)
    assert not I.aligned_parts([v[:4095]], 4096)          # not whole blocks
    assert not I.aligned_parts([v[48:4096 + 48]], 4096)   # not on a page
    # a bytes' memory is on a page only by chance (its data follow a 32-byte header): one
    # that is not (the assertion once met one that was)
    b = next(x for x in (bytes(4096) for _ in range(8)) if I.buffer_addresses([x])[0] % 4096)
    assert not I.aligned_parts([b], 4096)
    assert not I.aligned_parts([], 4096)
    assert not I.aligned_parts([v[:0]], 4096)
    many = [v[i * 4096:(i + 1) * 4096] for i in range(256)] * 4
    assert I.aligned_parts(many, 4096)                    # IOV_MAX (1024) parts
    assert not I.aligned_parts(many + [v[:4096]], 4096)   # one more: staged instead


def test_pool_trim_gives_the_pooled_buffers_back():
    bufs = [I.AlignedBuf(MiB) for _ in range(8)]
    before = I.pooled_bytes()
    del bufs
    assert I.pooled_bytes() >= before + 8 * MiB
    freed = I.pool_trim()
    assert freed >= 8 * MiB and I.pooled_bytes() == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.sampled_from([4096, 8192, 64 * KiB, MiB]), min_size=1, max_size=12),
       unaligned_at=st.one_of(st.none(), st.integers(0, 11)), at=st.integers(0, 8))
def test_direct_writes_of_aligned_parts_and_of_any_parts_land_the_same(tmp_path, lens,
                                                                         unaligned_at, at):
    """``_DirectIO.pwrite`` of a scatter list: straight from the parts when every one is a
    page-aligned whole block, through the scratch buffer otherwise (a ``bytes`` part); the
    file holds the same bytes either way and zero copy stays on."""
    p = tmp_path / "dio"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.ftruncate(fd, 16 * MiB)
        dio = D._DirectIO(fd, str(p), 4096)
        parts, want = [], b""
        for i, n in enumerate(lens):
            data = os.urandom(n)
            if unaligned_at is not None and i == unaligned_at % len(lens):
                parts.append(data)
            else:
                b = I.AlignedBuf(n)
                memoryview(b)[:] = data
                parts.append(memoryview(b))
            want += data
        dio.pwrite(at * 4096, parts, len(want))
        assert dio.zero_copy_write
        with open(p, "rb") as f:
            f.seek(at * 4096)
            assert f.read(len(want)) == want
        with pytest.raises(ValueError):
            dio._pwritev_parts(0, [memoryview(I.AlignedBuf(4096))], 8192)
        dio.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("source", ["bytes", "page_aligned"])
def test_large_writes_reach_the_zone_without_a_staging_copy(make_image, mount_image, source):
    """Through a mount: 24 MiB written 1 MiB at a time from a Python ``bytes`` (unaligned: two
    requests per write) or from page-aligned memory, then a tail of odd length; nearly all
    of it is written from the requests' own buffers (``status`` → ``unstaged_write_bytes``),
    and every byte reads back after a remount."""
    m = mount_image(make_image("1G", "64M"))
    data = os.urandom(24 * MiB + 12345)
    if source == "page_aligned":
        src = mmap.mmap(-1, MiB)
    with open(m / "f", "wb", buffering=0) as f:
        for off in range(0, 24 * MiB, MiB):
            if source == "bytes":
                f.write(data[off:off + MiB])
            else:
                src[:] = data[off:off + MiB]
                f.write(src)
        f.write(data[24 * MiB:])
        os.fsync(f.fileno())
    st = m.status()
    assert st["unstaged_write_bytes"] >= 20 * MiB, st["unstaged_write_bytes"]
    assert st["unstaged_write_bytes"] <= st["logical_bytes"]
    m.remount()
    assert (m / "f").read_bytes() == data


@pytest.mark.parametrize("left", [1, 48, 4048, 4096, 64 * KiB - 1])
def test_what_a_flush_leaves_does_not_keep_its_arena(left):
    """A flush in whole blocks leaves a few bytes of the last request in the buffer; they are
    copied out, so its 1 MiB arena goes back at once (``live_bytes``) instead of waiting for the
    file's next flush: with hundreds of files written in turn, each kept 1 MiB for 4 KiB."""
    arenas = I.WriteArenas()
    wb = WriteBuffer()
    payload = os.urandom(MiB)
    before = I.live_bytes()
    v = arenas.reserve(7, 0, MiB)
    v[:] = payload
    assert wb.append(0, v)
    del v
    arenas.drop(7)                                # (the arena is full: let go anyway)
    assert I.live_bytes() - before == MiB         # held by the buffer alone
    wb.drop(MiB - left)
    assert I.live_bytes() == before
    assert wb.off == MiB - left and len(wb) == left
    assert wb.take(0, left).tobytes() == payload[-left:]
    assert wb.append(MiB, b"xyz") and wb.take(0, left + 3).tobytes() == payload[-left:] + b"xyz"


@pytest.mark.parametrize("size", [64 * KiB + 1, 300_000, HALF - 1])
def test_what_a_flush_leaves_does_not_keep_a_whole_write_request(size):
    """Same for a request copied into a ``bytes`` of its own (between ``SMALL`` and half an
    arena): what a flush in whole blocks leaves is copied, not a view keeping every byte."""
    wb = WriteBuffer()
    payload = os.urandom(size)
    assert wb.append(0, payload)
    wb.drop(size - size % 4096)
    assert len(wb) == size % 4096 and wb.slack == 0
    assert all(type(p) is not memoryview or len(p.obj) == len(p) for p in wb.chunks)
    assert wb.take(0, len(wb)).tobytes() == payload[size - size % 4096:]


@pytest.mark.parametrize("size", [MiB, HALF + 1])
def test_many_files_written_in_turn_hold_about_dirty_bytes_of_buffers(make_image, mount_image,
                                                                       size):
    """200 files open at once, written ``size`` bytes at a time in turn from Python ``bytes``
    (a 1 MiB write is two requests), past ``dirty_bytes`` (32 MiB here): the aligned buffers
    alive at the worst moment (``status`` → ``daemon.io_buffer_peak_live_bytes``) stay near
    dirty_bytes plus the arenas still open (at most 64), not a 1 MiB arena per file (stop 27:
    371 MiB of buffers for 128 MiB of dirty_bytes), nor, for writes of half an arena and a
    byte (each in an arena of its own once the file's open arena is let go), twice dirty_bytes
    (stop 28: the budget counted bytes, not the arenas they keep alive); every byte reads back
    after a remount."""
    m = mount_image(make_image("2G", "64M"), "dirty_bytes=32M")
    blocks = [os.urandom(size) for _ in range(3)]
    fds = [os.open(m / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644) for i in range(200)]
    try:
        for r in range(2):
            for i, fd in enumerate(fds):
                os.write(fd, blocks[(i + r) % 3])
        peak = m.status()["daemon"]["io_buffer_peak_live_bytes"]
    finally:
        for fd in fds:
            os.close(fd)
    print(f"peak of aligned buffers alive: {peak / MiB:.0f} MiB")
    assert peak <= (32 + 64 + 32) * MiB, peak / MiB
    m.remount()
    for i in (0, 77, 199):
        assert (m / f"f{i}").read_bytes() == blocks[i % 3] + blocks[(i + 1) % 3]


@settings(max_examples=100, deadline=None)
@given(first=st.integers(1, 8192), sizes=st.lists(st.sampled_from([ARENA, ARENA - 48, 48, HALF + 1,
                                                                   ARENA - 4096, 4096]),
                                                  min_size=1, max_size=12))
def test_a_file_written_in_order_fills_its_arenas_whole(first, sizes):
    """Whatever the first write's size (at least half an arena, so arenas start), a file
    written in order gets arenas filled whole: each one a single page-aligned part of
    exactly an arena once the views are joined; only the last may be partial."""
    arenas = I.WriteArenas()
    wb = WriteBuffer()
    data = os.urandom(HALF + first + sum(sizes))
    off = 0
    for n in [HALF + first] + sizes:
        v = arenas.reserve(1, off, n)
        views = list(v) if type(v) is tuple else [v]
        for part in views:
            part[:] = data[off:off + len(part)]
            assert wb.append(off, part)
            off += len(part)
    parts = wb.take(0, len(wb)).parts
    assert b"".join(parts) == data
    assert all(len(p) == ARENA for p in parts[:-1]), [len(p) for p in parts]
    assert I.aligned_parts(parts[:-1], 4096) if len(parts) > 1 else True


@pytest.mark.parametrize("header", [0, 100, 4095, 4097])
def test_a_large_write_from_unaligned_memory_reaches_the_zone_without_a_copy(make_image,
                                                                            mount_image,
                                                                            header):
    """A small first write of ``header`` bytes (the zip records ``torch.save`` and DCP write
    before a tensor), then one 32 MiB ``write`` of a Python ``bytes`` (unaligned: the kernel
    sends 1 MiB - 48 bytes, then 1 MiB requests), as ``torch.save`` writes a tensor's
    storage: all but a few blocks where parts meet is written from the requests' own arenas.
    (Stop 27's arenas gave each request its own, 48 bytes off the file's blocks: nothing went
    unstaged; stop 28's filled them whole but from the write's offset, so after a header
    every block straddled two bytes of memory's pages: nothing either.)"""
    m = mount_image(make_image("1G", "64M"))
    head = os.urandom(header)
    data = os.urandom(32 * MiB + 777)
    with open(m / "big", "wb", buffering=0) as f:
        assert f.write(head) == header
        assert f.write(data) == len(data)
        os.fsync(f.fileno())
    st = m.status()
    # (a flush split where a zone ends goes out staged: up to one 4 MiB flush, so 26 MiB)
    assert st["unstaged_write_bytes"] >= 26 * MiB, st["unstaged_write_bytes"]
    m.remount()
    assert (m / "big").read_bytes() == head + data


_part_kinds = st.lists(st.tuples(st.sampled_from(["bytes", "arena", "arena_at"]),
                                 st.sampled_from([1, 48, 100, 4095, 4096, 4097, 8192, 12288,
                                                  64 * KiB, HALF + 1, ARENA - 48]),
                                 st.integers(0, 4095)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(kinds=_part_kinds, seed=st.integers(0, 1 << 30))
def test_a_flush_takes_every_aligned_block_as_it_is_and_copies_only_the_seams(kinds, seed):
    """``DataPath.direct_iov``, parts of any kind: ``bytes``, views at the start of an arena,
    views at any offset of one.  The scatter list is the flush padded with zeros to whole
    blocks; every buffer is page-aligned whole blocks (what O_DIRECT takes); the buffers
    counted as taken as they are lie inside the parts' own memory, and every block that lies
    inside one part at a page-aligned address is among them."""
    from retainzfs.datapath import direct_iov
    rnd = random.Random(seed)
    parts, spans, s = [], [], 0
    for kind, n, at in kinds:
        b = rnd.randbytes(n)
        if kind == "bytes":
            p = b
        else:
            at = 0 if kind == "arena" else at
            arena = I.AlignedBuf(at + n)
            p = memoryview(arena)[at:at + n]
            p[:] = b
        parts.append(p)
        spans.append((s, s + n, I.buffer_addresses([p])[0]))
        s += n
    n = s
    data = b"".join(bytes(p) for p in parts)
    bs = 4096
    padded = -(-n // bs) * bs
    want_direct = sum(max(0, (e // bs * bs) - (-(-a // bs) * bs)) for a, e, addr in spans
                      if (addr - a) % 4096 == 0)
    plan = direct_iov(parts, n, bs)
    if 2 * want_direct < n:
        assert plan is None
        return
    iov, direct = plan
    assert direct == want_direct
    assert b"".join(bytes(v) for v in iov) == data + bytes(padded - n)
    assert I.aligned_parts(iov, bs)
    inside = 0
    for v, addr in zip(iov, I.buffer_addresses(iov)):
        if any(pa <= addr and addr + len(v) <= pa + (e - a) for a, e, pa in spans):
            inside += len(v)
    assert inside == direct


def test_an_arena_starts_where_its_write_falls_within_a_page():
    """After a small first write (not in an arena), a file's large writes land in arenas at
    addresses congruent to their file offsets, each arena filled to its end, so a flush from
    the file's start takes all but the first block and the last as they are."""
    arenas = I.WriteArenas()
    wb = WriteBuffer()
    from retainzfs.datapath import direct_iov
    off = 100
    data = os.urandom(100 + 5 * MiB + 300)
    assert arenas.reserve(3, 0, 100) is None
    assert wb.append(0, data[:100])
    for n in (MiB - 48, 48, MiB, MiB, MiB, MiB, 300):
        v = arenas.reserve(3, off, n)
        for part in (list(v) if type(v) is tuple else [v]):
            assert I.buffer_addresses([part])[0] % 4096 == off % 4096
            part[:] = data[off:off + len(part)]
            assert wb.append(off, part)
            off += len(part)
    parts = wb.take(0, len(wb)).parts
    iov, direct = direct_iov(parts, len(data), 4096)
    assert direct == len(data) // 4096 * 4096 - 4096
    assert b"".join(bytes(v) for v in iov)[:len(data)] == data
