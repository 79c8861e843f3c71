"""ExtentMap against a model: one list entry per file byte, (zone, zone offset, hint) or None.

Sizes cluster around the 4 KiB block (off-by-one at block edges is where overwrite/truncate
accounting breaks); every operation's dead pieces must add up, per zone, to the bytes the model
lost, and the map must stay sorted and non-overlapping.
"""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from retainzfs.extents import Extent, ExtentMap

BS = 4096
SPAN = 3 * BS + 3                       # the model covers file offsets [0, SPAN)

edge = st.sampled_from([0, 1, BS - 1, BS, BS + 1, 2 * BS - 1, 2 * BS, 2 * BS + 1, 3 * BS])
offset = st.one_of(edge, st.integers(0, SPAN - 1))
length = st.one_of(st.sampled_from([1, 2, BS - 1, BS, BS + 1, 2 * BS]), st.integers(1, SPAN))
hint = st.sampled_from([1.0, 2.0, math.inf])
zone = st.integers(4, 7)

op = st.one_of(
    st.tuples(st.just("add"), offset, length, zone, st.integers(0, 8 * BS), hint),
    st.tuples(st.just("truncate"), offset),
    st.tuples(st.just("punch"), offset, length),       # fallocate PUNCH_HOLE / ZERO_RANGE
    st.tuples(st.just("relocate"), offset, length, zone, st.integers(0, 8 * BS)),
    st.tuples(st.just("clear")),
)


def model_bytes(m: ExtentMap, size: int) -> list:
    out = [None] * size
    for dst, z, zoff, n in m.lookup(0, size):
        for k in range(n):
            out[dst + k] = (z, zoff + k)
    return out


def per_zone(model: list) -> dict:
    out: dict = {}
    for b in model:
        if b is not None:
            out[b[0]] = out.get(b[0], 0) + 1
    return out


def check_invariants(m: ExtentMap) -> None:
    assert m.offs == [e.off for e in m.exts]
    for a, b in zip(m.exts, m.exts[1:]):
        assert a.end <= b.off, (a, b)
    assert all(e.length > 0 for e in m.exts)
    assert m.total == sum(e.length for e in m.exts)        # st_blocks comes from it


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=25))
def test_extent_map_matches_byte_model(ops):
    m = ExtentMap()
    model: list = [None] * (SPAN + 3 * BS)    # (zone, zoff, hint) per file byte
    size = len(model)
    for o in ops:
        before = per_zone([(b[0],) if b else None for b in model])
        if o[0] == "add":
            _, off, n, z, zoff, h = o
            n = min(n, size - off)
            dead = m.add(off, n, z, zoff, h)
            for k in range(n):
                model[off + k] = (z, zoff + k, h)
            gained = {z: n}
        elif o[0] == "truncate":
            dead = m.truncate(o[1])
            for k in range(o[1], size):
                model[k] = None
            gained = {}
        elif o[0] == "punch":
            _, off, n = o
            dead = m.punch(off, off + n)
            for k in range(off, min(off + n, size)):
                model[k] = None
            gained = {}
        elif o[0] == "relocate":
            _, off, n, nz, nzoff = o
            n = min(n, size - off)
            cur = model[off:off + n]
            ok_model = (n > 0 and all(b is not None for b in cur)
                        and all(b[0] == cur[0][0] and b[1] == cur[0][1] + k
                                for k, b in enumerate(cur)))
            # relocate wants exactly one lookup segment: the model's run must also be one extent
            segs = m.lookup(off, n)
            ok = m.relocate(off, n, cur[0][0] if cur and cur[0] else -1,
                            cur[0][1] if cur and cur[0] else -1, nz, nzoff)
            assert ok == (ok_model and len(segs) == 1)
            if ok:
                h = cur[0][2]
                for k in range(n):
                    model[off + k] = (nz, nzoff + k, h)
            dead = []
            gained = {}
            if ok:      # relocation moves bytes between zones; nothing dies
                before = per_zone([(b[0],) if b else None for b in model])
        else:
            dead = m.clear()
            model = [None] * size
            gained = {}
        check_invariants(m)
        got = model_bytes(m, size)
        assert got == [(b[0], b[1]) if b else None for b in model]
        for e in m.exts:            # the hint of every byte is the one it was written with
            assert all(model[e.off + k][2] == e.hint for k in range(e.length))
        after = per_zone([(b[0],) if b else None for b in model])
        lost: dict = {}
        for z, n, _h in dead:
            assert n > 0
            lost[z] = lost.get(z, 0) + n
        for z in set(before) | set(after) | set(lost) | set(gained):
            assert before.get(z, 0) + gained.get(z, 0) - lost.get(z, 0) == after.get(z, 0), z
        assert m.live_by_zone() == after


@settings(max_examples=100, deadline=None)
@given(offset, length, offset, length)
def test_lookup_segments_tile_the_range(off, n, qoff, qn):
    m = ExtentMap()
    m.add(off, n, 5, 0, 1.0)
    segs = m.lookup(qoff, qn)
    lo, hi = max(off, qoff), min(off + n, qoff + qn)
    assert sum(s[3] for s in segs) == max(0, hi - lo)
    for dst, z, zoff, k in segs:
        assert z == 5 and zoff == qoff + dst - off and 0 <= dst and dst + k <= qn


def test_contiguous_appends_merge_and_hint_change_splits():
    m = ExtentMap()
    for k in range(4):
        m.add(k * BS, BS, 4, k * BS, 1.0)
    assert len(m) == 1 and m.exts[0].length == 4 * BS
    m.add(4 * BS, BS, 4, 4 * BS, 2.0)            # same zone, other hint: a new extent
    assert len(m) == 2
    m.add(5 * BS, BS, 5, 0, 2.0)                 # other zone: a new extent
    assert len(m) == 3
    assert m.truncate(BS + 1) == [(4, 3 * BS - 1, 1.0), (4, BS, 2.0), (5, BS, 2.0)]
    assert [e.as_list() for e in m] == [[0, BS + 1, 4, 0, 1.0]]


def test_relocate_refuses_a_moved_or_partial_range():
    m = ExtentMap([Extent(0, 2 * BS, 4, 0, 1.0)])
    assert not m.relocate(0, 2 * BS, 4, BS, 6, 0)        # wrong old offset
    assert not m.relocate(0, 2 * BS, 5, 0, 6, 0)         # wrong old zone
    assert m.relocate(BS, BS, 4, BS, 6, 0)
    assert [e.as_list() for e in m] == [[0, BS, 4, 0, 1.0], [BS, BS, 6, 0, 1.0]]
    assert not m.relocate(0, 2 * BS, 4, 0, 7, 0)         # now spans two extents


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(offset, length, zone, st.integers(0, 8 * BS)), max_size=12),
       st.lists(st.tuples(offset, length), min_size=1, max_size=6))
def test_mapped_between_counts_the_mapped_bytes_of_a_range(adds, queries):
    """``mapped_between`` (what fallocate counts as written already) against a byte model,
    for ranges that start and end inside, before, between and past extents."""
    m = ExtentMap()
    model = [False] * (SPAN + 3 * BS)
    for off, n, z, zoff in adds:
        n = min(n, len(model) - off)
        m.add(off, n, z, zoff, 1.0)
        model[off:off + n] = [True] * n
    for q, n in queries:
        assert m.mapped_between(q, q + n) == sum(model[q:q + n]), (q, n)
    assert m.mapped_between(0, len(model)) == m.total
