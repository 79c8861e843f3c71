"""Trace format, synthetic generator and metrics arithmetic (retainzfs.workload)."""
import json

import pytest

from retainzfs import workload as wl
from retainzfs.workload import DeviceSpec, MetricsRecorder, SaveEvent

MiB = 1 << 20


def saves_of(events, anchors=None):
    out = [e for e in events if isinstance(e, SaveEvent)]
    if anchors is not None:
        out = [e for e in out if e.is_anchor == anchors]
    return out


def independent_after_peak(events):
    """Peak live bytes after each save's deletions (before the next save), recomputed here."""
    size, live, peak = {}, 0, 0
    for i, e in enumerate(events):
        if e.op == "save":
            size[e.stream, e.gen] = sum(f.size for f in e.files)
            live += size[e.stream, e.gen]
        else:
            live -= size.pop((e.stream, e.gen))
        if i + 1 == len(events) or events[i + 1].op == "save":
            peak = max(peak, live)
    return peak


def independent_peak(events):
    """Peak live bytes, recomputed here: live after each save (before its deletes)."""
    size, live, peak = {}, 0, 0
    for e in events:
        if e.op == "save":
            size[e.stream, e.gen] = sum(f.size for f in e.files)
            live += size[e.stream, e.gen]
            peak = max(peak, live)
        else:
            live -= size.pop((e.stream, e.gen))
    return peak


def stream_params(events):
    """Per stream: (cadence, K) recovered from the events."""
    births, params = {}, {}
    for e in saves_of(events, anchors=False):
        births.setdefault(e.stream, []).append(e.birth)
    for s, b in births.items():
        c = b[1] - b[0]
        assert all(y - x == c for x, y in zip(b, b[1:]))
        first = next(e for e in events if e.op == "save" and e.stream == s)
        params[s] = (c, (first.hint - first.birth) // c)
    return params


def test_deterministic_per_seed():
    assert wl.generate(0.84, 7) == wl.generate(0.84, 7)
    assert wl.generate(0.84, 7)[1] != wl.generate(0.84, 8)[1]


def test_default_shape():
    dev, ev = wl.generate(0.84, 1)
    assert dev == DeviceSpec(4 * MiB, 4 * MiB, 64, 2, 7, 4096)
    assert dev.namespace_bytes == 256 * MiB
    meas = saves_of(ev, anchors=False)
    assert len(meas) == 250
    assert {e.stream for e in meas} == {0, 1, 2, 3}
    # prefill anchors first, on their own stream, never deleted
    n_anchor = len(saves_of(ev, anchors=True))
    assert n_anchor > 0 and all(e.op == "save" and e.is_anchor and e.stream == 4
                                for e in ev[:n_anchor])
    assert not any(e.op == "delete" and e.stream == 4 for e in ev)
    # >= 100 ms start-to-start, time order
    ts = [e.t for e in saves_of(ev)]
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(ts, ts[1:]))
    assert [e.t for e in ev] == sorted(e.t for e in ev)
    # nominal sizes 0.74..2.27 zone capacities, fixed per stream; both ends used
    per_stream = {}
    for e in meas:
        per_stream.setdefault(e.stream, set()).add(e.size)
    assert all(len(v) == 1 for v in per_stream.values())
    fr = sorted(v.pop() / dev.zone_capacity for v in per_stream.values())
    assert fr[0] == pytest.approx(0.74, abs=1e-6) and fr[-1] == pytest.approx(2.27, abs=1e-6)
    # epochs are one shared, non-decreasing timeline
    births = [e.birth for e in meas]
    assert births == sorted(births) and births[0] >= 1


@pytest.mark.parametrize("load", [0.70, 0.76, 0.84, 0.90])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_peak_live_hits_load(load, seed):
    dev, ev = wl.generate(load, seed)                       # default: after deletions (paper)
    cap = (dev.nr_zones - 3) * dev.zone_capacity
    assert independent_after_peak(ev) / cap == pytest.approx(load, abs=1e-6)
    assert wl.peak_live(ev, after_deletes=True) == independent_after_peak(ev)
    assert wl.peak_live(ev) == independent_peak(ev) > independent_after_peak(ev)
    dev, ev = wl.generate(load, seed, peak="in-flight")
    assert independent_peak(ev) / cap == pytest.approx(load, abs=1e-6)
    assert wl.peak_live(ev) == independent_peak(ev)


def test_load_too_low_rejected():
    with pytest.raises(ValueError, match="below the streams"):
        wl.generate(0.05, 1)
    with pytest.raises(ValueError):
        wl.generate(1.2, 1)


def test_hints_and_delete_timing():
    _, ev = wl.generate(0.8, 4)
    params = stream_params(ev)
    assert sorted(k for _, k in params.values()) == [2, 3, 3, 4]
    for e in saves_of(ev, anchors=False):
        c, k = params[e.stream]
        assert e.hint == e.birth + c * k
    # gen g is deleted right after gen g+K of its stream is saved
    last_save = None
    for e in ev:
        if e.op == "save":
            last_save = e
        else:
            assert last_save.stream == e.stream
            assert last_save.gen == e.gen + params[e.stream][1]
    n_del = sum(e.op == "delete" for e in ev)
    counts = {}
    for e in saves_of(ev, anchors=False):
        counts[e.stream] = counts.get(e.stream, 0) + 1
    assert n_del == sum(max(0, n - params[s][1]) for s, n in counts.items())


def delete_save_index(events):
    """(stream, gen) -> number of non-anchor saves issued when the delete happened."""
    out, n = {}, 0
    for e in events:
        if e.op == "save" and not e.is_anchor:
            n += 1
        elif e.op == "delete":
            out[e.stream, e.gen] = n
    return out


def test_delete_delay_makes_deletes_later():
    _, base = wl.generate(0.8, 5)
    _, late = wl.generate(0.8, 5, delete_delay=4)
    b, l = delete_save_index(base), delete_save_index(late)
    assert all(l[k] == b[k] + 4 for k in l)
    assert len(l) == len(b) - 4                 # the last four never come
    # same declared hints
    assert [e.hint for e in saves_of(base, False)] == [e.hint for e in saves_of(late, False)]
    assert independent_after_peak(late) / ((64 - 3) * 4 * MiB) == pytest.approx(0.8, abs=1e-6)


def test_extended_retention_deletes_after_hint():
    _, ev = wl.generate(0.8, 5, extended_retention=1)
    params = stream_params(ev)
    hint = {(e.stream, e.gen): e.hint for e in saves_of(ev, False)}
    epoch = 0
    for e in ev:
        if e.op == "save":
            epoch = e.birth
            last = e
        else:
            c, k = params[e.stream]
            assert last.gen == e.gen + k + 1
            assert epoch == hint[e.stream, e.gen] + c > hint[e.stream, e.gen]


def test_milestones_are_never_deleted():
    _, ev = wl.generate(0.85, 2, milestone_every=25)
    ms = [e for e in saves_of(ev) if e.is_anchor and e.stream < 4]
    assert ms and all((e.gen + 1) % 25 == 0 for e in ms)
    deleted = {(e.stream, e.gen) for e in ev if e.op == "delete"}
    assert not deleted & {(e.stream, e.gen) for e in ms}


def test_small_checkpoints():
    dev, ev = wl.generate(0.7, 3, small=True)
    fr = [e.size / dev.zone_capacity for e in saves_of(ev, False)]
    assert min(fr) == pytest.approx(0.10, abs=1e-6) and max(fr) == pytest.approx(0.30, abs=1e-6)
    assert independent_after_peak(ev) / ((64 - 3) * dev.zone_capacity) == \
        pytest.approx(0.7, abs=1e-6)


def test_zone_size_scales_everything():
    d4, e4 = wl.generate(0.84, 9)
    d64, e64 = wl.generate(0.84, 9, zone_size=64 * MiB)
    assert d64.zone_size == d64.zone_capacity == 64 * MiB
    assert d64.namespace_bytes == 16 * d4.namespace_bytes == 4096 * MiB
    s4, s64 = saves_of(e4, False), saves_of(e64, False)
    assert [(e.stream, e.gen, e.birth, e.hint) for e in s4] == \
           [(e.stream, e.gen, e.birth, e.hint) for e in s64]
    for a, b in zip(s4, s64):
        assert b.size / a.size == pytest.approx(16, rel=1e-5)
    assert wl.peak_live(e64) == pytest.approx(16 * wl.peak_live(e4), rel=1e-6)


def test_budgets_and_stream_count():
    dev, _ = wl.generate(0.84, 1, max_active=14)
    assert (dev.max_open, dev.max_active) == (2, 15)
    dev, _ = wl.generate(0.84, 1, max_active=30)
    assert dev.max_active == 31
    _, ev = wl.generate(0.85, 1, streams=2, saves=40)
    assert len(saves_of(ev, False)) == 40 and {e.stream for e in saves_of(ev, False)} == {0, 1}
    assert all(e.stream == 2 for e in saves_of(ev, True))


def test_trace_round_trip(tmp_path):
    dev, ev = wl.generate(0.84, 2, delete_delay=2, milestone_every=25)
    p = tmp_path / "t.jsonl"
    wl.write_trace(p, dev, ev)
    assert wl.read_trace(p) == (dev, ev)
    wl.write_trace(p, None, ev[:5])
    assert wl.read_trace(p) == (None, ev[:5])
    first = json.loads(p.read_text().splitlines()[0])
    assert list(first) == ["t", "op", "stream", "gen", "birth", "hint", "files"]


GOOD_SAVE = {"t": 0.0, "op": "save", "stream": 0, "gen": 1, "birth": 10, "hint": 20,
             "files": [{"name": "shard0", "size": 100}]}


@pytest.mark.parametrize("lines,line_no,msg", [
    (["{not json"], 1, "invalid JSON"),
    (["[" * 100_000], 1, "nested too deeply"),           # a RecursionError traceback before
    ([GOOD_SAVE, {"t": 0.1, "op": "move", "stream": 0, "gen": 1}], 2, "'op'"),
    ([{**GOOD_SAVE, "files": []}], 1, "files"),
    ([{**GOOD_SAVE, "hint": "soon"}], 1, "hint"),
    ([{k: v for k, v in GOOD_SAVE.items() if k != "birth"}], 1, "birth"),
    ([{**GOOD_SAVE, "files": [{"name": "a/b", "size": 1}]}], 1, "file name"),
    ([{**GOOD_SAVE, "files": [{"name": "a", "size": -1}]}], 1, "size"),
    ([{**GOOD_SAVE, "t": 1.0}, {**GOOD_SAVE, "gen": 2, "t": 0.5}], 2, "backwards"),
    ([GOOD_SAVE, {"device": {}}], 2, "first line"),
    ([{"device": {"zone_size": 4096}}], 1, "zone_capacity"),
    ([{"t": 0, "op": "delete", "stream": 0, "gen": 3}], 1, "not live"),
    ([GOOD_SAVE, GOOD_SAVE], 2, "while live"),
    ([[1, 2]], 1, "object"),
])
def test_malformed_trace(tmp_path, lines, line_no, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    with pytest.raises(wl.TraceError, match=rf":{line_no}: .*{msg}"):
        wl.read_trace(p)


@pytest.mark.parametrize("content,msg", [
    (b"", "empty trace"), (b"\n\n", "empty trace"),
    (json.dumps({"device": wl.generate(0.84, 1)[0].to_json()}).encode() + b"\n", "empty trace"),
    (b"\xce\x01junk", ": not a trace"), (json.dumps(GOOD_SAVE).encode() + b"\n\xff\n", ": not a"),
])
def test_an_empty_or_binary_trace_is_an_error_naming_the_file(tmp_path, content, msg):
    """``replay`` of an empty file printed an empty table and exit 0; of a binary file,
    Python's "'utf-8' codec can't decode byte 0xce ..." without the file's name."""
    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    with pytest.raises(wl.TraceError, match=rf"^{p}.*{msg}"):
        wl.read_trace(p)


def test_cli(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert wl.main(["--load", "0.8", "--seed", "3", "--small", "--max-active", "14",
                    "--zone-size", "8", "--saves", "50", "-o", str(out)]) == 0
    dev, ev = wl.read_trace(out)
    assert (dev.zone_size, dev.max_active) == (8 * MiB, 15)
    assert (dev, ev) == wl.generate(0.8, 3, small=True, max_active=14, zone_size=8 * MiB,
                                    saves=50)
    assert "50 saves" in capsys.readouterr().err
    assert wl.main(["--load", "0.01", "-o", str(out)]) == 1


# ----------------------------------------------------------------------------- metrics

C = 1000


def test_metrics_time_average_and_window():
    r = MetricsRecorder(C, warmup_epochs=20, saves_requested=250)
    r.sample(0, 99999, 99999)                 # prefill: ignored
    r.start(5)                                # window = [25, last sample]
    r.sample(5, 7000, 7000)                   # before window
    r.sample(20, 1000, 3000)                  # in effect at 25 -> holds 25..30
    r.sample(30, 2000, 0)                     # two samples at 30: first weighs nothing
    r.sample(30, 4000, 2000)                  # holds 30..45
    r.sample(45, 0, 0)                        # end of window, zero weight
    m = r.result()
    inv = (1000 * 5 + 4000 * 15) / 20
    tail = (3000 * 5 + 2000 * 15) / 20
    assert m["invalid_zones"] == pytest.approx(inv / C)
    assert m["tail_zones"] == pytest.approx(tail / C)
    assert m["reserved_overhead_zones"] == pytest.approx((inv + tail) / C)
    assert set(m) == set(wl.METRIC_NAMES)
    assert m["saves_requested"] == 250
    # explicit window end extends the last sample
    assert r.result(end_epoch=65)["invalid_zones"] == pytest.approx(
        (1000 * 5 + 4000 * 15) / 40 / C)


def test_metrics_saves_counters_p99():
    r = MetricsRecorder(C, warmup_epochs=20)
    r.counters(0, data_bytes=5000, journal_bytes=10, gc_copied_bytes=0, zone_resets=0)
    r.save(0, 9.0, 5000)                      # prefill save: not a request
    r.start(1)                                # window starts at 21
    r.save(3, 5.0, 1000)                      # warm-up: counted, not measured
    r.counters(3, data_bytes=6100, journal_bytes=20, alloc_us=50.0, commits=1)
    lat = [0.010 * (i + 1) for i in range(100)]   # 10..1000 ms
    for i, x in enumerate(lat):
        r.save(21 + i, x, 1000)
    r.counters(120, data_bytes=6100 + 110_000, journal_bytes=520, gc_copied_bytes=8000,
               zone_resets=3, alloc_us=50.0 + 400.0, commits=101)
    r.save(121, 0.5, 1000, completed=False)
    r.sample(21, 0, 0)
    m = r.result()
    assert m["saves_requested"] == 102 and m["saves_completed"] == 101
    assert m["capacity_stop"] is True
    assert m["host_wa"] == pytest.approx(110_000 / 100_000)
    assert m["journal_bytes"] == 500 and m["gc_copied_bytes"] == 8000 and m["zone_resets"] == 3
    assert m["mean_alloc_us"] == pytest.approx(4.0)
    # linear interpolation: rank 0.99*99 = 98.01 -> 990 + 0.01*10 ms
    assert m["p99_commit_ms"] == pytest.approx(990.1)


def test_metrics_empty():
    m = MetricsRecorder(C).result()
    assert m["reserved_overhead_zones"] == 0 and m["p99_commit_ms"] is None
    assert m["host_wa"] is None and m["saves_completed"] == 0 and m["capacity_stop"] is False


def test_percentile():
    assert wl.percentile([3, 1, 2], 50) == 2
    assert wl.percentile([1, 2], 99) == pytest.approx(1.99)
    assert wl.percentile([], 99) is None
