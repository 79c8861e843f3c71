"""Zone allocator (retainzfs._alloc): summaries, RetainZ cost model, baselines, ablations."""
import math
import random

import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from retainzfs._alloc import POLICIES, Allocator, NoSpace

INF = math.inf
C = 1000          # small zone capacity: all arithmetic below is by hand


def mk(policy="retainz", nr=10, first=1, **kw):
    kw.setdefault("gc_reserve", 0)
    return Allocator(nr, C, first, policy, **kw)


def put(a, size, hint, birth, now=0, stream=0, save_size=0, **kw):
    """Store-like flow: place until all bytes are written; returns [(zone, nbytes, finish)]."""
    out = []
    rem = size
    while rem:
        z, nb, fin = a.place(rem, hint, birth, now, stream, save_size, **kw)
        assert 0 < nb <= rem
        for f in fin:
            a.note_finish(f)
        a.note_write(z, nb, hint)
        out.append((z, nb, fin))
        rem -= nb
    return out


def fill(a, zone, size, hint, birth=0, stream=0):
    """Write directly into a chosen zone (test set-up)."""
    a.note_write(zone, size, hint, stream=stream, birth=birth)


# ---------------------------------------------------------------------------- API basics
def test_policies_and_api():
    assert POLICIES == ("retainz", "zenfs", "equal-epoch", "retainz-notail", "retainz-nodbt",
                        "retainz-nospan", "retainz-nosize", "isolate")
    with pytest.raises(ValueError):
        Allocator(8, C, 1, "lru")
    a = mk(nr=8, first=3)
    assert a.empty_zones() == 5 and a.active_zones() == []
    with pytest.raises(ValueError):
        a.summary(2)                    # metadata zone
    with pytest.raises(ValueError):
        a.note_write(8, 10, 5)
    s = a.summary(3)
    assert s["cond"] == "empty" and s["W"] == 0 and s["minh"] is None and not s["anchor"]
    assert a.zone_reclaim_epoch(3) == -INF


def test_summary_upkeep_and_conditions():
    a = mk()
    a.note_write(1, 300, 100)
    a.note_write(1, 100, 140)
    a.note_write(1, 50, 999, live=False)          # padding: W only
    s = a.summary(1)
    assert (s["W"], s["L"], s["S"], s["D"]) == (450, 400, 400, 300 * 100 + 100 * 140)
    assert (s["minh"], s["maxh"], s["anchor"], s["cond"]) == (100, 140, False, "active")
    assert a.zone_reclaim_epoch(1) == 140 and a.active_zones() == [1] and a.empty_zones() == 8
    a.note_dead(1, 100, 140)
    s = a.summary(1)
    assert (s["L"], s["S"], s["D"]) == (300, 300, 30000)
    # max/min are kept over all data written since reset (R of trapped data)
    assert (s["minh"], s["maxh"]) == (100, 140)
    with pytest.raises(ValueError):
        a.note_dead(1, 301, 100)
    a.note_write(1, 100, INF)                        # an anchor: R = inf
    assert a.zone_reclaim_epoch(1) == INF and a.summary(1)["anchor"]
    a.note_write(1, 450, INF)                        # exactly fills: full, not active
    assert a.summary(1)["cond"] == "full" and a.active_zones() == []
    with pytest.raises(ValueError):
        a.note_write(1, 1, INF)
    a.note_reset(1)
    assert a.summary(1)["cond"] == "empty" and a.summary(1)["W"] == 0 and a.empty_zones() == 9
    a.note_write(2, 10, 5)
    a.note_finish(2)
    assert a.summary(2)["cond"] == "full" and a.active_zones() == []
    a.note_finish(3)                                 # finishing an empty zone
    assert a.summary(3)["cond"] == "full" and a.empty_zones() == 7


def test_chunk_larger_than_free_space():
    a = mk(span=1000)
    fill(a, 1, 900, 100)
    z, nb, fin = a.place(500, 100, 0, 0)
    assert (z, nb, fin) == (1, 100, [])              # tail filled, caller asks again
    a.note_write(z, nb, 100)
    z, nb, fin = a.place(400, 100, 0, 0)
    assert z != 1 and nb == 400
    z, nb, _ = a.place(2500, 100, 0, 0)              # a fresh zone takes at most C
    assert nb == C


def test_stats_counters():
    a = mk()
    put(a, 1500, 10, 0)
    s = a.stats()
    assert s["places"] == 2 and s["new_zones"] == 2 and s["notes"] == 2
    assert s["ns"] == s["place_ns"] + s["note_ns"] and s["place_ns"] > 0
    assert s["mean_place_us"] > 0


# ---------------------------------------------------------------------------- cost model
def test_cost_arithmetic_by_hand():
    a = mk(span=1000)
    fill(a, 1, 300, 100)                 # W=300 S=300 D=30000 R=100 -> DBT = 0
    # s=200, d=120, now=0: R'=120, DBT' = 120*500 - (30000 + 24000) = 6000,
    # tail = (1000 - 500) * 120 = 60000
    assert a.cost(1, 200, 120, 0) == 6000 + 60000
    # d below R: R'=100, DBT' = 100*400 - (30000 + 8000) = 2000, tail = 600 * (100 - 50)
    assert a.cost(1, 100, 80, 50) == 2000 + 600 * 50
    # a new zone: (C - s) * (d - now)
    assert a.new_zone_cost(200, 120, 0) == 800 * 120
    assert a.new_zone_cost(2000, 120, 0) == 0          # s >= C: no tail
    assert a.new_zone_cost(200, 120, 500) == 0         # hint already past: clamp
    z, nb, fin = a.place(200, 120, 0, 0)
    assert (z, nb, fin) == (1, 200, [])
    d = a.last_decision
    assert d["kind"] == "existing" and d["cost"] == 66000
    # lam scales the tail only
    b = mk(span=1000, lam=0.5)
    fill(b, 1, 300, 100)
    assert b.cost(1, 200, 120, 0) == 6000 + 30000
    # ablations
    nt = mk("retainz-notail", span=1000)
    fill(nt, 1, 300, 100)
    assert nt.cost(1, 200, 120, 0) == 6000 and nt.new_zone_cost(200, 120, 0) == 0
    nd = mk("retainz-nodbt", span=1000)
    fill(nd, 1, 300, 100)
    assert nd.cost(1, 200, 120, 0) == 60000


def test_dbt_counts_only_live_trapped_bytes():
    a = mk(span=1000)
    fill(a, 1, 200, 100)
    fill(a, 1, 100, 150)                 # S=300, D=35000, R=150 -> DBT = 150*300-35000 = 10000
    # s=100 d=150: R' = 150, DBT' = 150*400 - 50000 = 10000 -> +0; tail 600*150
    assert a.cost(1, 100, 150, 0) == 600 * 150
    a.note_dead(1, 200, 100)             # S=100, D=15000: DBT = 0
    # s=100 d=200: DBT' = 200*200 - (15000+20000) = 5000; tail = (1000-400)*200
    assert a.cost(1, 100, 200, 0) == 5000 + 600 * 200


def test_new_zone_wins_when_data_retire_much_earlier():
    a = mk(span=10000)
    fill(a, 1, 100, 1000)
    # existing: R'=1000, DBT' = 1000*200 - (100000 + 10000) = 90000; tail 800*1000 -> 890000
    # new zone: 900 * 100 = 90000 -> cheaper
    assert a.cost(1, 100, 100, 0) == 890000
    z, nb, fin = a.place(100, 100, 0, 0)
    assert z == 2 and a.last_decision["kind"] == "new" and a.last_decision["cost"] == 90000


def test_ties_prefer_existing_zone_then_lowest_index():
    a = mk("retainz-notail", span=1000)
    fill(a, 3, 100, 50)
    fill(a, 2, 100, 50)
    # both ΔDBT = 0 == new zone cost 0 -> existing, lowest index
    assert a.place(100, 50, 0, 0)[0] == 2


# ---------------------------------------------------------------------------- anchors
def test_anchor_best_fit_and_separation():
    a = mk(span=10 ** 9)
    fill(a, 1, 300, INF)
    fill(a, 2, 700, INF)
    fill(a, 3, 100, 50)                  # finite zone with lots of room
    # best fit: least unused after writing 250 -> zone 2 (free 300 -> 50 unused)
    assert a.place(250, INF, 0, 0)[:2] == (2, 250)
    # not written (place() changes nothing): 350 fills zone 2 (0 unused), zone 1 would leave 350
    assert a.place(350, INF, 0, 0)[:2] == (2, 300)
    # 800 fits nowhere whole: both leave 0 unused, the larger chunk wins (zone 1: 700)
    assert a.place(800, None, 0, 0)[:2] == (1, 700)   # None = unhinted = anchor
    # a finite hint never lands in an anchor zone, even with the span rule off
    b = mk("retainz-nospan")
    fill(b, 1, 100, INF)
    assert b.place(100, 50, 0, 0)[0] != 1
    fill(b, 2, 100, 50)
    assert b.place(100, INF, 0, 0)[0] == 1


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "zenfs"])
def test_anchors_never_mix_with_finite_hints(policy):
    rng = random.Random(7)
    a = Allocator(12, C, 1, policy, max_active=3, gc_reserve=1)
    live = []
    for g in range(300):
        hint = INF if rng.random() < 0.3 else g + rng.choice([5, 10, 30])
        size = rng.choice([100, 250, 600, 1400])
        try:
            for z, nb, _ in put(a, size, hint, g, now=g, stream=g % 3):
                live.append((z, nb, hint))
        except NoSpace:
            pass
        while len(live) > 12 or (live and rng.random() < 0.3):
            z, nb, h = live.pop(rng.randrange(len(live)) if rng.random() < 0.2 else 0)
            a.note_dead(z, nb, h)
            s = a.summary(z)
            if s["L"] == 0 and s["W"] > 0:
                a.note_reset(z)
        for z in range(1, 12):
            s = a.summary(z)
            assert not (s["anchor"] and s["maxh"] is not None), (policy, z, s)


# ---------------------------------------------------------------------------- span rule
def test_span_rule_and_fallback():
    # fixed span 10, saves as big as a zone: no size adaptation
    a = mk(span=10, max_active=2)
    assert a.place(100, 100, 0, 0, save_size=C) == (1, 100, [])
    a.note_write(1, 100, 100)
    assert a.place(100, 105, 0, 0, save_size=C) == (1, 100, [])      # span 5 <= 10: share
    a.note_write(1, 100, 105)
    z, nb, fin = a.place(100, 200, 0, 0, save_size=C)                # span 100 > 10: new zone
    assert (z, fin, a.last_decision["kind"]) == (2, [], "new")
    a.note_write(2, 100, 200)
    # hint 300 fits no span; a new zone would need a finish (2 active = budget) -> fallback.
    # zone 1: W=200 S=200 D=20500 R=105: DBT = 500, DBT' = 300*300 - 50500 = 39500,
    #         tail = 700*300 -> 39000 + 210000 = 249000
    # zone 2: W=100 S=100 D=20000 R=200: DBT' = 300*200 - 50000 = 10000, tail 800*300 -> 250000
    assert a.cost(1, 100, 300, 0) == 249000 and a.cost(2, 100, 300, 0) == 250000
    assert a.place(100, 300, 0, 0, save_size=C) == (1, 100, [])
    assert a.last_decision["kind"] == "fallback"
    # below the budget the same request opens a zone instead
    b = mk(span=10, max_active=3)
    put(b, 200, 100, 0, save_size=C)
    put(b, 100, 200, 0, save_size=C)
    assert b.place(100, 300, 0, 0, save_size=C)[0] == 3
    # without the span rule hint 200 would have joined zone 1 (d > R: existing is cheaper)
    c = mk("retainz-nospan", max_active=2)
    put(c, 200, 100, 0, save_size=C)
    assert c.place(100, 200, 0, 0, save_size=C)[0] == 1


def test_fallback_when_only_reserve_left():
    a = Allocator(4, C, 1, "retainz", span=10, gc_reserve=1)   # data zones 1..3
    put(a, 500, 100, 0, save_size=C)
    put(a, 500, 500, 0, save_size=C)
    # zone 3 is the reserve: relax the span instead of failing
    z, _, _ = a.place(100, 900, 0, 0, save_size=C)
    assert z in (1, 2) and a.last_decision["kind"] == "fallback"
    # GC / common admission may borrow the reserve: a span-compatible new zone is cheaper?
    # no span-compatible zone -> with the reserve available the zone opens normally
    z, _, _ = a.place(100, 900, 0, 0, save_size=C, allow_reserve=True)
    assert z == 3 and a.last_decision["kind"] == "new"


def test_span_window_defaults_and_cadence():
    a = mk()
    # unknown cadence: (d - a) / 2
    assert a.span_window(C, 130, 100) == 15
    a.place(C, 130, 100, 100, stream=7)
    a.place(C, 140, 110, 110, stream=7)          # learns cadence 10 for stream 7
    assert a.span_window(C, 150, 120, stream=7) == 10
    assert a.span_window(C, 150, 120, stream=8) == 15
    a.place(C, 140, 110, 110, stream=7)          # same generation again: cadence unchanged
    a.place(C, 90, 60, 110, stream=7)            # an older birth (e.g. GC): ignored
    assert a.span_window(C, 150, 120, stream=7) == 10
    # fixed span, hint grid as a floor
    assert mk(span=4).span_window(C, 150, 120) == 4
    assert mk(span=4, hint_grid=16).span_window(C, 160, 120) == 16


def test_size_adaptation():
    a = mk(span=10)
    nos = mk("retainz-nosize", span=10)
    # n = ceil(C / save_size) generations may share a zone: window = span * (n - 1)
    assert a.span_window(100, 150, 120, save_size=300) == 30        # n = 4
    assert a.span_window(100, 150, 120, save_size=250) == 30        # n = 4
    assert a.span_window(100, 150, 120, save_size=200) == 40        # n = 5
    assert a.span_window(100, 150, 120, save_size=600) == 10        # n = 2: base window
    assert a.span_window(100, 150, 120, save_size=3000) == 10
    assert a.span_window(300, 150, 120) == 30                       # save_size 0: use size
    assert nos.span_window(100, 150, 120, save_size=300) == 10
    # decisions: three 300-byte generations 10 epochs apart share a zone only with adaptation
    for alloc, expect in ((a, [1, 1, 1]), (nos, [1, 1, 2])):
        zones = [put(alloc, 300, 100 + 10 * g, 10 * g, now=10 * g, save_size=300)[0][0]
                 for g in range(3)]
        assert zones == expect


# ---------------------------------------------------------------------------- budget / reserve
def test_finish_returned_when_active_budget_reached():
    a = mk(max_active=2, span=10)
    fill(a, 1, 100, 100)                 # wasted tail 900 * 100 = 90000
    fill(a, 2, 500, 50)                  # wasted tail 500 * 50 = 25000  <- cheapest
    z, nb, fin = a.place(100, INF, 0, 0)  # anchor: needs its own zone
    assert (z, nb, fin) == (3, 100, [2])
    a.note_finish(2)
    a.note_write(3, 100, INF)
    assert a.active_zones() == [1, 3]
    # anchor zones have an infinite wasted tail: finished last.  (Zone 1 excluded as a
    # target, so the finite write cannot fall back into it and needs a new zone.)
    z, nb, fin = a.place(100, 5000, 0, 0, exclude=[1])
    assert (z, fin) == (4, [1])
    # without the exclusion the span rule is relaxed instead of finishing (fallback)
    assert a.place(100, 5000, 0, 0) == (1, 100, [])
    assert a.last_decision["kind"] == "fallback"


def test_finish_prefers_overdue_zones():
    a = mk(max_active=2, span=1)
    fill(a, 1, 100, 10)                  # hint 10 < now: wasted tail costs nothing
    fill(a, 2, 900, 500)
    assert a.place(100, INF, 0, 100)[2] == [1]


def test_reserve_is_respected():
    a = Allocator(5, C, 1, "isolate", gc_reserve=2)         # data zones 1..4
    assert put(a, 100, 10, 0)[0][0] == 1
    assert put(a, 100, 20, 10)[0][0] == 2
    with pytest.raises(NoSpace):                             # only the 2 reserve zones left
        a.place(100, 30, 20, 20)
    assert a.place(100, 30, 20, 20, allow_reserve=True)[0] == 3
    assert a.place(100, 10, 0, 0)[0] == 1                    # existing zones still usable
    assert a.empty_zones() == 2
    # exclude: GC must not relocate into its victim
    b = mk(span=1000)
    fill(b, 1, 100, 10)
    assert b.place(100, 10, 0, 0)[0] == 1
    assert b.place(100, 10, 0, 0, exclude=[1])[0] == 2
    assert b.place(100, 10, 0, 0, exclude=[1, 2])[0] == 3


def test_nospace_when_nothing_fits():
    a = Allocator(3, C, 1, "retainz", gc_reserve=0)
    put(a, 2 * C, 10, 0)
    with pytest.raises(NoSpace) as ei:
        a.place(100, 10, 0, 0)
    assert ei.value.finish == []
    assert a.stats()["nospace"] == 1


# ---------------------------------------------------------------------------- hint grid
def test_hint_grid_rounds_up():
    a = mk(hint_grid=4)
    assert a.round_hint(101) == 104 and a.round_hint(104) == 104 and a.round_hint(INF) == INF
    assert a.round_hint(0.5) == 4
    a.note_write(1, 100, 101)
    s = a.summary(1)
    assert s["maxh"] == 104 and s["D"] == 100 * 104
    a.note_dead(1, 100, 103)             # rounds to the same grid point
    assert a.summary(1)["S"] == 0
    # equal-epoch: 101 and 103 become indistinguishable on a grid of 4
    e = mk("equal-epoch", hint_grid=4)
    e0 = mk("equal-epoch")
    for alloc, expect in ((e, [1, 1]), (e0, [1, 2])):
        assert [put(alloc, 100, h, 0)[0][0] for h in (101, 103)] == expect


# ---------------------------------------------------------------------------- equal-epoch
def test_equal_epoch():
    a = mk("equal-epoch", max_active=3)
    fill(a, 1, 600, 100)
    fill(a, 2, 300, 100)
    fill(a, 3, 100, 120)
    assert a.place(300, 100, 0, 0)[:2] == (1, 300)     # best fit among d == 100 zones
    # 500: zone 1 takes 400 leaving 0 unused, zone 2 would leave 200 -> zone 1 (caller loops)
    assert a.place(500, 100, 0, 0)[:2] == (1, 400)
    assert a.place(500, 100, 0, 0, exclude=[1])[:2] == (2, 500)
    assert a.place(100, 120, 0, 0)[0] == 3
    # no zone holds exactly d=110: new zone would need a finish -> fallback best fit (finite)
    z, nb, fin = a.place(50, 110, 0, 0)
    assert (z, fin, a.last_decision["kind"]) == (1, [], "fallback")   # 400 free, tightest
    # below the budget: a new zone
    b = mk("equal-epoch")
    fill(b, 1, 100, 100)
    assert b.place(100, 101, 0, 0)[0] == 2
    # anchors among anchors only, no fallback into finite zones
    c = mk("equal-epoch", max_active=1)
    fill(c, 1, 100, 100)
    assert c.place(100, INF, 0, 0) == (2, 100, [1])


# ---------------------------------------------------------------------------- isolate
def test_isolate_never_shares():
    rng = random.Random(3)
    a = Allocator(40, C, 1, "isolate", max_active=4, gc_reserve=1)
    owners = {}
    live = []
    for g in range(200):
        stream = g % 3
        hint = INF if g % 7 == 0 else g + 20
        size = rng.choice([100, 300, 1200])
        try:
            for z, nb, _ in put(a, size, hint, g, now=g, stream=stream):
                owners.setdefault(z, set()).add((stream, g))
                assert len(owners[z]) == 1, (z, owners[z])
                live.append((z, nb, hint))
        except NoSpace:
            pass
        while len(live) > 20:
            z, nb, h = live.pop(0)
            a.note_dead(z, nb, h)
            if a.summary(z)["L"] == 0:
                a.note_reset(z)
                owners.pop(z, None)
    # the same generation keeps filling its own zone (several files of one save)
    b = mk("isolate")
    assert put(b, 100, 50, 0, stream=1)[0][0] == 1
    assert put(b, 100, 50, 0, stream=2)[0][0] == 2
    assert put(b, 100, 50, 0, stream=1)[0][0] == 1
    assert b.summary(1)["W"] == 200


@pytest.mark.parametrize("policy", ["isolate", "retainz"])
@pytest.mark.parametrize("fullscan", [False, True])
def test_generation_ids_are_bounded_and_decide_the_same(policy, fullscan):
    """A daemon saving for months places a new generation with every save: the allocator
    forgets the ids of generations that own no zone (``max_generations``), and every decision
    is the one an allocator that keeps them all makes (an id only tells owners apart)."""
    rng = random.Random(7)
    kept = Allocator(40, C, 1, policy, max_active=6, gc_reserve=1, fullscan=fullscan)
    bounded = Allocator(40, C, 1, policy, max_active=6, gc_reserve=1, fullscan=fullscan)
    bounded.max_generations = 4
    live = []
    for g in range(400):
        stream = g % 2
        hint = INF if g % 9 == 0 else g + 6
        for _ in range(rng.choice([1, 2, 3])):     # several files of one save
            size = rng.choice([100, 300, 1200])
            try:
                got = put(kept, size, hint, g, now=g, stream=stream)
            except NoSpace:
                with pytest.raises(NoSpace):
                    put(bounded, size, hint, g, now=g, stream=stream)
                continue
            assert put(bounded, size, hint, g, now=g, stream=stream) == got, g
            live += [(z, nb, hint) for z, nb, _ in got]
        while len(live) > 24:                       # old saves deleted, emptied zones reset
            z, nb, h = live.pop(0)
            for a in (kept, bounded):
                a.note_dead(z, nb, h)
                if a.summary(z)["L"] == 0 and a.summary(z)["cond"] == "full":
                    a.note_reset(z)
    assert kept.stats()["generations"] == 400
    # kept at a pass: each zone's owner, the last place()'s and the one placing (39 data
    # zones); the next pass comes at twice that
    assert bounded.stats()["generations"] <= 2 * (39 + 2) + 1
    if fullscan:
        assert bounded.check_summaries() == []
    assert [bounded.summary(z) for z in range(1, 40)] == [kept.summary(z) for z in range(1, 40)]


# ---------------------------------------------------------------------------- zenfs port
def test_zenfs_lifetime_classes():
    z = mk("zenfs", zenfs_base=10)
    assert z.lifetime_class(INF, 0) == "EXTREME"
    assert z.lifetime_class(20, 0) == "SHORT"          # T <= 2B
    assert z.lifetime_class(21, 0) == "MEDIUM"
    assert z.lifetime_class(200, 0) == "MEDIUM"        # T <= 20B
    assert z.lifetime_class(201, 0) == "LONG"
    adaptive = mk("zenfs")
    adaptive.place(100, 130, 100, 100)                 # shortest lifetime seen: 30
    assert adaptive.lifetime_class(160, 100) == "SHORT"
    assert adaptive.lifetime_class(161, 100) == "MEDIUM"


def test_zenfs_scenario_traced_through_upstream():
    """Each expected decision is derived from westerndigitalcorporation/zenfs fs/zbd_zenfs.cc.

    Classes (zenfs_base=10): T<=20 SHORT(2), T<=200 MEDIUM(3), else LONG(4); inf EXTREME(5).
    GetLifeTimeDiff(zone, file): zone > file -> zone - file; equal -> 50 (COULD_BE_WORSE);
    zone < file -> 100 (NOT_GOOD).  Data zones 1..7, max_active = 2 (active tokens)."""
    a = Allocator(8, 100, 1, "zenfs", max_active=2, gc_reserve=0, zenfs_base=10)

    def step(size, hint, birth, expect, lifetime=None):
        got = a.place(size, hint, birth, 0)
        assert got == expect
        for f in got[2]:
            a.note_finish(f)
        a.note_write(got[0], got[1], hint)
        if lifetime:
            assert a.summary(got[0])["lifetime"] == lifetime

    # 1. SHORT: GetBestOpenZoneMatch finds no zone with used_capacity_ > 0 -> best_diff 100;
    #    GetActiveIOZoneTokenIfAvailable (0 < 2) -> AllocateEmptyZone: first empty zone.
    step(60, 10, 0, (1, 60, []), "SHORT")
    # 2. MEDIUM: zone1 SHORT < MEDIUM -> diff 100 (kept as allocated_zone since 100 <= 100);
    #    best_diff >= 50, token available -> allocated zone released, new zone 2 gets MEDIUM.
    step(30, 100, 0, (2, 30, []), "MEDIUM")
    # 3. SHORT: zone1 diff 50, zone2 MEDIUM > SHORT diff 1 -> best_diff 1 < 50: use zone2
    #    without touching the tokens; zone2 keeps lifetime MEDIUM.
    step(30, 15, 5, (2, 30, []), "MEDIUM")
    # 4. LONG: zone1 and zone2 both diff 100; no active token (2 active) -> release;
    #    while (!GetActiveIOZoneTokenIfAvailable()) FinishCheapestIOZone(): zone1 and zone2
    #    both have capacity_ 40, replacement only on strictly larger capacity -> zone1.
    #    AllocateEmptyZone -> zone3 (zone1 is FULL now).  150 bytes: 100 fit.
    step(150, 1000, 0, (3, 100, [1]), "LONG")
    # 5. rest of the LONG file: zone3 is full (token returned on full); zone2 diff 100;
    #    token available (1 active) -> release, AllocateEmptyZone -> zone4.
    step(50, 1000, 0, (4, 50, []), "LONG")
    # 6. EXTREME (anchor): zone2 MEDIUM and zone4 LONG both diff 100 -> ties go to the last
    #    zone walked (diff <= best_diff) = zone4; no token -> release; FinishCheapestIOZone:
    #    zone2 capacity_ 40 < zone4 capacity_ 50 -> finish zone2; new zone5.
    step(20, INF, 0, (5, 20, [2]), "EXTREME")
    # 7. SHORT: zone4 LONG diff 2, zone5 EXTREME diff 3 -> zone4 (best diff < 50).
    step(10, 20, 10, (4, 10, []), "LONG")
    # 8. EXTREME: zone4 diff 100, zone5 diff 50; no token and best_diff == COULD_BE_WORSE ->
    #    keep zone5 ("avoided a finish by relaxing lifetime diff requirement").
    step(20, INF, 0, (5, 20, []))
    assert a.last_decision["kind"] == "fallback"
    # 9. all data in zone4 die: used_capacity_ == 0 -> not a candidate anymore.  SHORT file:
    #    only zone5 (EXTREME, diff 3) -> the finite data join the anchor zone.
    a.note_dead(4, 50, 1000)
    a.note_dead(4, 10, 20)
    step(10, 30, 20, (5, 10, []), "EXTREME")
    # 10. MEDIUM: zone5 diff 2 -> zone5 again; then a file larger than its free space.
    step(100, 150, 0, (5, 50, []))
    assert a.summary(5)["cond"] == "full"
    # 11. rest: no candidate with used data (zone4 L=0); token (1 active: zone4) -> new zone6.
    step(50, 150, 0, (6, 50, []), "MEDIUM")


def test_zenfs_finish_threshold():
    # ApplyFinishThreshold: before allocating, finish active zones with
    # capacity_ < max_capacity_ * finish_threshold_ / 100 (here 100 * 50 / 100 = 50).
    a = Allocator(6, 100, 1, "zenfs", max_active=3, gc_reserve=0, zenfs_base=10,
                  finish_threshold=50)
    assert a.place(60, 10, 0, 0) == (1, 60, [])
    a.note_write(1, 60, 10)
    # zone1 has 40 < 50 left -> finished first, then no match -> new zone2
    assert a.place(10, 10, 0, 0) == (2, 10, [1])
    a.note_finish(1)
    a.note_write(2, 10, 10)
    # zone2 has 90 left: not finished; same class -> diff 50, token available -> new zone3
    assert a.place(10, 10, 0, 0) == (3, 10, [])


def test_zenfs_nospace_carries_upstream_finish():
    # Upstream finishes the cheapest zone before AllocateEmptyZone finds nothing.
    a = Allocator(3, 100, 1, "zenfs", max_active=1, gc_reserve=0, zenfs_base=10)
    assert a.place(50, 10, 0, 0) == (1, 50, [])
    a.note_write(1, 50, 10)
    assert a.place(50, 1000, 0, 0) == (2, 50, [1])       # LONG: diff 100, no token
    a.note_finish(1)
    a.note_write(2, 50, 1000)
    assert a.place(10, 10, 0, 0) == (2, 10, [])          # SHORT into LONG zone: diff 2
    a.note_write(2, 10, 10)
    with pytest.raises(NoSpace) as ei:                   # EXTREME: diff 100, no token
        a.place(10, INF, 0, 0)
    assert ei.value.finish == [2]


def test_zenfs_unknown_lifetime_after_rebuild():
    # zones rebuilt at mount without generation info are WLTH_NOT_SET (as upstream after Open):
    # GetLifeTimeDiff(NOT_SET, SHORT) = NOT_GOOD, so they are not reused.
    a = mk("zenfs", zenfs_base=10)
    a.note_write(1, 100, 10)
    assert a.summary(1)["lifetime"] == "NOT_SET"
    assert a.place(100, 10, 0, 0)[0] == 2


# ---------------------------------------------------------------------------- victims
def test_victims_order():
    a = mk(nr=8)
    fill(a, 1, 1000, 100)
    a.note_dead(1, 600, 100)             # full, L=400, R=100
    fill(a, 2, 1000, 500)
    a.note_dead(2, 600, 500)             # full, L=400, R=500
    fill(a, 3, 1000, INF)
    a.note_dead(3, 900, INF)             # full, L=100, R=inf
    fill(a, 4, 500, 50)
    a.note_dead(4, 200, 50)              # active, L=300, 200 dead
    fill(a, 5, 500, 50)                  # active, nothing dead: nothing to gain
    fill(a, 6, 1000, 70)                 # full and all live: nothing to gain
    # most gained (C - L full, W - L active); then least live; then latest reclaim epoch
    assert a.victims(10) == [3, 2, 1, 4]
    assert a.victims(2) == [3, 2]
    assert a.victims(10, exclude=[4]) == [3, 2, 1]


# ---------------------------------------------------------------------------- fullscan
def _random_run(policy, seed, fullscan):
    """Drive an allocator like the store would; record every decision."""
    rng = random.Random(seed)
    kw = dict(max_active=rng.choice([0, 2, 3, 5]), gc_reserve=rng.choice([0, 1, 2]),
              hint_grid=rng.choice([0, 0, 4]), lam=rng.choice([1.0, 0.5]))
    if policy == "zenfs":
        kw["finish_threshold"] = rng.choice([0, 0, 20])
    nr = rng.choice([8, 12, 20])
    a = Allocator(nr, C, 2, policy, fullscan=fullscan, **kw)
    log = []
    gens = []                            # [(stream, birth, hint, [(zone, nbytes)])]
    births = {s: 0 for s in range(3)}
    cad = {0: 10, 1: 15, 2: 25}
    for step in range(120):
        now = step * 5
        r = rng.random()
        if r < 0.6 or not gens:
            s = rng.randrange(3)
            births[s] += cad[s]
            birth = births[s]
            hint = INF if rng.random() < 0.15 else birth + cad[s] * rng.choice([1, 2, 3])
            size = rng.choice([4, 30, 60, 150, 250]) * 4
            ext = []
            rem = size
            while rem:
                act = a.active_zones()
                excl = [rng.choice(act)] if act and rng.random() < 0.1 else None
                try:
                    z, nb, fin = a.place(rem, hint, birth, now, s, size,
                                         allow_reserve=rng.random() < 0.1, exclude=excl)
                except NoSpace as e:
                    log.append(("nospace", tuple(e.finish)))
                    for f in e.finish:
                        a.note_finish(f)
                    break
                log.append((z, nb, tuple(fin), a.last_decision["kind"], a.last_decision["cost"]))
                for f in fin:
                    a.note_finish(f)
                pay = nb if rng.random() < 0.8 else max(1, nb - rng.randrange(4))
                a.note_write(z, pay, hint)
                if nb > pay:
                    a.note_write(z, nb - pay, hint, live=False)
                ext.append((z, pay))
                rem -= nb
            gens.append((s, birth, hint, ext))
        elif r < 0.9:
            i = 0 if rng.random() < 0.7 else rng.randrange(len(gens))
            _, _, hint, ext = gens.pop(i)
            for z, n in ext:
                a.note_dead(z, n, hint)
        else:
            active = a.active_zones()
            if active and rng.random() < 0.5:
                a.note_finish(rng.choice(active))
        for z in range(2, nr):
            s_ = a.summary(z)
            if s_["W"] > 0 and s_["L"] == 0 and rng.random() < 0.8:
                a.note_reset(z)
    if fullscan:
        assert a.check_summaries() == []
    return log


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), seed=st.integers(0, 2 ** 32 - 1))
def test_fullscan_makes_identical_decisions(policy, seed):
    cached = _random_run(policy, seed, False)
    full = _random_run(policy, seed, True)
    assert cached == full
    assert len(cached) > 20


def test_fullscan_is_slower_but_equal():
    cached = Allocator(256, C, 3, "retainz", max_active=6)
    full = Allocator(256, C, 3, "retainz", max_active=6, fullscan=True)
    for alloc in (cached, full):
        for g in range(300):
            for z, nb, _ in put(alloc, 700, g + 30, g, now=g, stream=g % 4):
                pass
    assert cached.stats()["places"] == full.stats()["places"]
    assert full.stats()["place_ns"] > cached.stats()["place_ns"]
    assert [cached.summary(z) for z in range(3, 256)] == [full.summary(z) for z in range(3, 256)]


# ---------------------------------------------------------------------------- speed
def test_place_is_fast_on_large_devices():
    import time
    for nr in (64, 4096):
        a = Allocator(nr, 4 << 20, 3, "retainz", max_active=6, gc_reserve=1)
        live = []
        t0 = time.perf_counter()
        n = 0
        for g in range(3000):
            size = (3 << 20) if g % 2 else (1 << 20)
            for z, nb, _ in put(a, size, g + 30, g, now=g, stream=g % 4):
                live.append((z, nb, g + 30))
                n += 1
            while len(live) > 30:
                z, nb, h = live.pop(0)
                a.note_dead(z, nb, h)
                if a.summary(z)["L"] == 0:
                    a.note_reset(z)
        s = a.stats()
        assert s["mean_place_us"] < 50, (nr, s)          # typically 1-3 us
        assert time.perf_counter() - t0 < 10
