"""Checkpoint traces, the synthetic pressure workload, and replay metrics.

Trace format (DESIGN §8, fixed)
-------------------------------
JSON Lines.  An optional first line describes the device::

    {"device": {"zone_size": 4194304, "zone_capacity": 4194304, "nr_zones": 64,
                "max_open": 2, "max_active": 7, "block_size": 4096}}

then events in time order (``t`` in seconds, non-decreasing)::

    {"t": 0.0, "op": "save", "stream": 0, "gen": 17, "birth": 170, "hint": 200,
     "files": [{"name": "shard0", "size": 3145728}]}          # hint null = anchor
    {"t": 0.1, "op": "delete", "stream": 0, "gen": 14}

``hint`` is what the runtime declared; deletes are what it actually does.  ``read_trace``
rejects malformed lines with ``TraceError("TRACE:LINE: reason")``: bad JSON, missing or
mistyped fields, unknown ``op``, ``t`` going backwards, a ``device`` line that is not the
first line, a save of a generation that is still live, a delete of one that is not live.
Unknown extra keys are ignored.

Synthetic pressure workload (``generate`` / ``retainzfs gen-workload``)
----------------------------------------------------------------------
Modelled on the RetainZ paper's pressure input.  Every choice below is ours where the paper
is silent.  Defaults (keyword / CLI flag):

Device
  * ``zone_size`` / ``--zone-size MiB``: 4 MiB zones; ``zone_capacity`` / ``--zone-capacity``
    defaults to the zone size.  ``nr_zones`` / ``--nr-zones``: 64, i.e. a 256 MiB namespace
    at 4 MiB (the namespace scales with the zone size: 64 MiB zones -> 4 GiB).
  * ``metadata_zones`` / ``--metadata-zones``: 3 reserved metadata zones (superblock +
    journal rolls, as in ZenFS).  **Data capacity** = ``(nr_zones - 3) * zone_capacity``
    (61 zones by default; the GC reserve zone is part of it -- it is an allocator option).
  * Open/active budgets are given *for data*; ``max_open`` / ``--max-open`` = 1 and
    ``max_active`` / ``--max-active`` = 6 (the paper's variants: 6, 14, 30).  The device line
    adds one slot each for the single metadata (journal) zone that is open at a time, so the
    default trace says ``max_open=2, max_active=7``.  The store must keep at most one metadata
    zone open/active (finish the old one when rolling).  0 = unlimited (no slot added).
  * ``block_size``: 4096.

Streams (``streams`` / ``--streams``, default 4), latest-K retention
  * Nominal checkpoint size per stream, fixed for the whole run: ``streams`` values evenly
    spaced over 0.74..2.27 zone capacities (4 streams: 0.74, 1.25, 1.76, 2.27), rounded to
    bytes (not block aligned, so padding is exercised).  ``small`` / ``--small`` uses
    0.10..0.30 zone capacities instead; ``size_range=(lo, hi)`` overrides both.
  * K per stream from (2, 3, 4, 3) and cadence c (epochs between the stream's saves) from
    (4, 5, 6, 8), cycled for more streams.  The seed shuffles sizes, K and cadences across
    streams independently, so seeds differ in which stream is big / long-lived.
  * Each save is split into 1..4 shard files (``shard0``..; seed-chosen per stream, near
    equal sizes).
  * Staggering: stream s saves at epochs ``1 + o_s + g*c_s`` (g = 0, 1, ...), offsets o_s a
    seed-chosen permutation of 0..max(streams, min c)-1, so streams start staggered.  All
    streams share one logical epoch timeline; saves are ordered by (epoch, stream) and the
    first ``saves`` / ``--saves`` (default 250) are emitted.  birth ``a`` = that epoch.
  * Hint ``d = a + c*K`` (the declared retention).  Generation g is deleted right after the
    save of generation g+K of its stream (a delete event with the same ``t``), i.e. exactly
    at its hint epoch.  Generations whose trigger save lies beyond the trace are never
    deleted.
  * Wall time: one save every ``interval`` / ``--interval`` = 0.1 s start-to-start (the
    paper's minimum); prefill anchors are paced the same way before the first stream save.
    Epochs and seconds are independent clocks: epochs order reclamation, ``t`` paces I/O.

Variants
  * ``delete_delay=N`` / ``--delete-delay N``: every delete is emitted N *saves of any
    stream* later than scheduled (a lagging deleter); hints unchanged.
  * ``extended_retention=E`` / ``--extended-retention E``: the runtime declares K but keeps
    K+E generations: g is deleted after g+K+E is saved; hints still say ``a + c*K``.
  * ``milestone_every=M`` / ``--milestone-every M`` (default 0 = off): every M-th
    generation of each stream (g+1 divisible by M) is a milestone: hint null, never deleted;
    the others keep latest-K retention unchanged.  Milestones accumulate (live data grows
    towards the end), so keep M large: M=25 adds ~2 per stream at the defaults.
  * ``small``, ``zone_size``, ``max_active`` as above.

Resident anchors ("prefill")
  * Written first, as saves of stream ``streams`` (one past the last checkpoint stream),
    gens 0.., birth 0, hint null, one file ``shard0`` each, never deleted.
  * Their total is chosen so that the **peak live occupancy** of the whole trace equals
    ``load`` (0.70..0.90) of the data capacity, in logical bytes.  ``peak`` / ``--peak``
    says where live bytes are sampled:

    - ``after-deletes`` (default; the paper: "resident anchors set the target peak live
      occupancy *after scheduled deletions*"): after each save *and the deletions it
      triggers*, i.e. just before the next save -- the retained set.  The save that triggers
      a deletion is briefly live on top of it, so the instantaneous peak is higher by up to
      one save (2.27 zone capacities at the defaults: 90% -> 93.7% in flight).
    - ``in-flight``: just after each save is written, before the deletions it triggers
      (retained generations plus the in-flight save; the instantaneous peak).  At the same
      nominal load this is the milder workload (84% in-flight = 80.3% after deletes).

    Either way only the deletions the trace actually performs count (delayed/extended
    variants get fewer anchors, not more load).
  * Split into round(total / 1.505 zones) anchors with seed-drawn weights in 0.74..2.27
    (the nominal range, also for ``small``); the last one takes the rounding remainder.
  * A load too small to fit the streams' own peak raises ``ValueError``.

Everything is drawn from ``random.Random(seed)``: same arguments + seed => same trace.

Metrics (``MetricsRecorder``, DESIGN §7 names)
-----------------------------------------------
The replay calls ``start(epoch)`` when prefill is done (epoch = birth of the first stream
save); the measured window starts ``warmup_epochs`` (20) later.  Then, after every event,
``sample(epoch, invalid_bytes, tail_bytes)`` and ``counters(epoch, data_bytes=...,
journal_bytes=..., gc_copied_bytes=..., zone_resets=..., alloc_us=..., commits=...)``
(cumulative device/allocator counters), and per save ``save(epoch, latency_s,
logical_bytes, completed)``.  The delete's epoch is the current epoch (last save's birth).

* Time averages are over epochs: a sample holds from its epoch until the next sample's epoch
  (so of several samples at one epoch only the last one weighs), clipped to the window
  [start + 20, last sample epoch].  ``reserved_overhead_zones`` = avg(invalid + tail) / C,
  split into ``invalid_zones`` and ``tail_zones``.
* Counters are reported as deltas over the window (baseline = last snapshot taken at an
  epoch before the window).  ``host_wa`` = delta data bytes (payload + padding + GC copies) /
  logical bytes of completed saves in the window; ``mean_alloc_us`` = delta alloc_us / delta
  commits (completed saves in the window when no commit counter is fed).
* ``p99_commit_ms``: 99th percentile (linear interpolation, like numpy's default) of the
  latencies of completed saves in the window; None if there are none.
* ``saves_requested`` (the constructor value, else the number of ``save`` calls after
  ``start``), ``saves_completed``, ``capacity_stop`` (any ``save(..., completed=False)``,
  prefill included).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, field

MiB = 1 << 20
NOMINAL_RANGE = (0.74, 2.27)        # checkpoint size, zone capacities
SMALL_RANGE = (0.10, 0.30)
K_CYCLE = (2, 3, 4, 3)
CADENCE_CYCLE = (4, 5, 6, 8)
METADATA_ZONES = 3
WARMUP_EPOCHS = 20
METRIC_NAMES = ("reserved_overhead_zones", "invalid_zones", "tail_zones", "host_wa",
                "journal_bytes", "p99_commit_ms", "saves_requested", "saves_completed",
                "capacity_stop", "mean_alloc_us", "gc_copied_bytes", "zone_resets")


# --------------------------------------------------------------------------- trace format

class TraceError(ValueError):
    """A malformed trace; the message names the file and line."""


@dataclass(frozen=True)
class DeviceSpec:
    zone_size: int
    zone_capacity: int
    nr_zones: int
    max_open: int = 0
    max_active: int = 0
    block_size: int = 4096

    @property
    def namespace_bytes(self) -> int:
        return self.zone_size * self.nr_zones

    def to_json(self) -> dict:
        return {"zone_size": self.zone_size, "zone_capacity": self.zone_capacity,
                "nr_zones": self.nr_zones, "max_open": self.max_open,
                "max_active": self.max_active, "block_size": self.block_size}


@dataclass(frozen=True)
class FileSpec:
    name: str
    size: int


@dataclass(frozen=True)
class SaveEvent:
    t: float
    stream: int
    gen: int
    birth: int
    hint: int | None                 # None = anchor (d = inf)
    files: tuple[FileSpec, ...] = field(default_factory=tuple)
    op = "save"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_anchor(self) -> bool:
        return self.hint is None

    def to_json(self) -> dict:
        return {"t": self.t, "op": "save", "stream": self.stream, "gen": self.gen,
                "birth": self.birth, "hint": self.hint,
                "files": [{"name": f.name, "size": f.size} for f in self.files]}


@dataclass(frozen=True)
class DeleteEvent:
    t: float
    stream: int
    gen: int
    op = "delete"

    def to_json(self) -> dict:
        return {"t": self.t, "op": "delete", "stream": self.stream, "gen": self.gen}


Event = SaveEvent | DeleteEvent


def data_capacity(device: DeviceSpec, metadata_zones: int = METADATA_ZONES) -> int:
    """Bytes available to data: all zones but the metadata zones."""
    return (device.nr_zones - metadata_zones) * device.zone_capacity


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _want_int(obj: dict, key: str, minimum: int | None = 0):
    if key not in obj:
        raise ValueError(f"missing {key!r}")
    v = obj[key]
    if not _is_int(v):
        raise ValueError(f"{key!r} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {v}")
    return v


def _parse_device(obj) -> DeviceSpec:
    if not isinstance(obj, dict):
        raise ValueError("'device' must be an object")
    d = DeviceSpec(zone_size=_want_int(obj, "zone_size", 1),
                   zone_capacity=_want_int(obj, "zone_capacity", 1),
                   nr_zones=_want_int(obj, "nr_zones", 1),
                   max_open=_want_int(obj, "max_open"),
                   max_active=_want_int(obj, "max_active"),
                   block_size=_want_int(obj, "block_size", 1))
    if d.zone_capacity > d.zone_size:
        raise ValueError("zone_capacity exceeds zone_size")
    return d


def _parse_event(obj: dict) -> Event:
    t = obj.get("t")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise ValueError(f"'t' must be a finite number >= 0, got {t!r}")
    op = obj.get("op")
    stream, gen = _want_int(obj, "stream"), _want_int(obj, "gen")
    if op == "delete":
        return DeleteEvent(float(t), stream, gen)
    if op != "save":
        raise ValueError(f"'op' must be 'save' or 'delete', got {op!r}")
    birth = _want_int(obj, "birth", None)
    if "hint" not in obj:
        raise ValueError("missing 'hint' (use null for an anchor)")
    hint = obj["hint"]
    if hint is not None and not _is_int(hint):
        raise ValueError(f"'hint' must be an integer or null, got {hint!r}")
    files = obj.get("files")
    if not isinstance(files, list) or not files:
        raise ValueError("'files' must be a non-empty list")
    specs, names = [], set()
    for f in files:
        if not isinstance(f, dict):
            raise ValueError("each file must be an object with 'name' and 'size'")
        name = f.get("name")
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"bad file name {name!r}")
        if name in names:
            raise ValueError(f"duplicate file name {name!r}")
        names.add(name)
        specs.append(FileSpec(name, _want_int(f, "size")))
    return SaveEvent(float(t), stream, gen, birth, hint, tuple(specs))


def read_trace(path) -> tuple[DeviceSpec | None, list[Event]]:
    """Parse a trace file; raise TraceError naming the line of the first problem (or the file:
    not UTF-8 text, no events at all -- a replay of nothing is a mistake, not a result)."""
    device, events, live, last_t = None, [], set(), 0.0
    with open(path, encoding="utf-8") as fh:
        try:
            text = fh.read()
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not a trace (not UTF-8 text)") from None
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid JSON ({e.msg})") from None
                except RecursionError:
                    raise ValueError("invalid JSON (nested too deeply)") from None
                if not isinstance(obj, dict):
                    raise ValueError("expected a JSON object")
                if "device" in obj:
                    if events or device is not None:
                        raise ValueError("'device' is only allowed on the first line")
                    device = _parse_device(obj["device"])
                    continue
                ev = _parse_event(obj)
                if ev.t < last_t:
                    raise ValueError(f"'t' goes backwards ({ev.t} < {last_t})")
                key = (ev.stream, ev.gen)
                if isinstance(ev, SaveEvent):
                    if key in live:
                        raise ValueError(f"stream {ev.stream} gen {ev.gen} saved while live")
                    live.add(key)
                else:
                    if key not in live:
                        raise ValueError(f"delete of stream {ev.stream} gen {ev.gen}, "
                                         "which is not live")
                    live.remove(key)
            except ValueError as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None
            last_t = ev.t
            events.append(ev)
    if not events:
        raise TraceError(f"{path}: no save or delete events (an empty trace)")
    return device, events


def write_trace(path, device: DeviceSpec | None, events) -> None:
    """Write a trace; path '-' writes to stdout."""
    fh = sys.stdout if str(path) == "-" else open(path, "w", encoding="utf-8")
    try:
        if device is not None:
            fh.write(json.dumps({"device": device.to_json()}) + "\n")
        for ev in events:
            fh.write(json.dumps(ev.to_json()) + "\n")
    finally:
        if fh is not sys.stdout:
            fh.close()


def live_profile(events) -> list[int]:
    """Live logical bytes after each event (anchors included)."""
    sizes, live, out = {}, 0, []
    for ev in events:
        if isinstance(ev, SaveEvent):
            sizes[(ev.stream, ev.gen)] = ev.size
            live += ev.size
        else:
            live -= sizes.pop((ev.stream, ev.gen))
        out.append(live)
    return out


PEAK_MODES = ("after-deletes", "in-flight")


def peak_live(events, after_deletes: bool = False) -> int:
    """Peak live bytes.  Default: the instantaneous peak, always right after a save (in-flight
    save included).  ``after_deletes``: sampled after each save's deletions, i.e. just before
    the next save and at the end (the paper's "peak live occupancy after scheduled
    deletions")."""
    prof = live_profile(events)
    if not after_deletes:
        return max(prof, default=0)
    peak = 0
    for i, live in enumerate(prof):
        if i + 1 == len(prof) or isinstance(events[i + 1], SaveEvent):
            peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------- generator

@dataclass(frozen=True)
class StreamSpec:
    stream: int
    size: int           # bytes per generation
    keep: int           # K
    cadence: int        # epochs between saves
    offset: int         # first save at epoch 1 + offset
    shards: int


def _linspace(lo: float, hi: float, n: int) -> list[float]:
    if n == 1:
        return [(lo + hi) / 2]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _split(total: int, n: int) -> list[int]:
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def generate(load: float, seed: int, *, saves: int = 250, streams: int = 4,
             zone_size: int = 4 * MiB, zone_capacity: int | None = None, nr_zones: int = 64,
             metadata_zones: int = METADATA_ZONES, max_open: int = 1, max_active: int = 6,
             block_size: int = 4096, small: bool = False,
             size_range: tuple[float, float] | None = None, delete_delay: int = 0,
             extended_retention: int = 0, milestone_every: int = 0,
             interval: float = 0.1, peak: str = "after-deletes") -> tuple[DeviceSpec, list[Event]]:
    """Synthetic pressure trace (see the module docstring for every parameter)."""
    cap = zone_capacity or zone_size
    if not 0 < load < 1:
        raise ValueError(f"load must be in (0, 1), got {load}")
    if zone_size <= 0 or zone_size & (zone_size - 1) or zone_size % block_size:
        raise ValueError("zone_size must be a power of two and a multiple of block_size")
    if not 0 < cap <= zone_size or cap % block_size:
        raise ValueError("zone_capacity must be a block multiple in (0, zone_size]")
    if nr_zones <= metadata_zones:
        raise ValueError("nr_zones must exceed metadata_zones")
    if saves < 0 or streams < 1 or min(delete_delay, extended_retention, milestone_every) < 0:
        raise ValueError("saves, delete_delay, extended_retention, milestone_every must be "
                         ">= 0 and streams >= 1")
    if interval <= 0:
        raise ValueError("interval must be > 0")
    if peak not in PEAK_MODES:
        raise ValueError(f"peak must be one of {', '.join(PEAK_MODES)}, got {peak!r}")
    lo, hi = size_range or (SMALL_RANGE if small else NOMINAL_RANGE)
    if not 0 < lo <= hi:
        raise ValueError("size_range must satisfy 0 < lo <= hi")

    rng = random.Random(seed)
    fracs = _linspace(lo, hi, streams)
    keeps = [K_CYCLE[i % len(K_CYCLE)] for i in range(streams)]
    cads = [CADENCE_CYCLE[i % len(CADENCE_CYCLE)] for i in range(streams)]
    rng.shuffle(fracs)
    rng.shuffle(keeps)
    rng.shuffle(cads)
    offsets = rng.sample(range(max(streams, min(cads))), streams)
    specs = [StreamSpec(s, max(1, round(fracs[s] * cap)), keeps[s], cads[s], offsets[s],
                        rng.randint(1, 4)) for s in range(streams)]

    # Shared epoch timeline: merge the streams' save epochs, keep the first `saves`.
    sched = sorted((1 + sp.offset + g * sp.cadence, sp.stream, g)
                   for sp in specs for g in range(saves))[:saves]

    def milestone(g: int) -> bool:
        return milestone_every > 0 and (g + 1) % milestone_every == 0

    body: list[tuple[int, Event]] = []   # (save index, event with t filled in later)
    pending: dict[int, list[tuple[int, int]]] = {}
    for i, (epoch, s, g) in enumerate(sched):
        sp = specs[s]
        files = tuple(FileSpec(f"shard{j}", n) for j, n in enumerate(_split(sp.size, sp.shards)))
        hint = None if milestone(g) else epoch + sp.cadence * sp.keep
        body.append((i, SaveEvent(0.0, s, g, epoch, hint, files)))
        victim = g - sp.keep - extended_retention
        if victim >= 0 and not milestone(victim):
            pending.setdefault(i + delete_delay, []).append((s, victim))
        for s2, g2 in pending.pop(i, ()):
            body.append((i, DeleteEvent(0.0, s2, g2)))

    dev = DeviceSpec(zone_size, cap, nr_zones, max_open + 1 if max_open else 0,
                     max_active + 1 if max_active else 0, block_size)
    target = round(load * data_capacity(dev, metadata_zones))
    stream_peak = peak_live([ev for _, ev in body], after_deletes=(peak == "after-deletes"))
    anchor_total = target - stream_peak
    if anchor_total < 0:
        raise ValueError(f"load {load} is below the streams' own peak "
                         f"({stream_peak / data_capacity(dev, metadata_zones):.3f} of data "
                         "capacity); raise the load or shrink the streams")

    a_lo, a_hi = NOMINAL_RANGE
    n_anchors = 0 if anchor_total == 0 else max(1, round(anchor_total / ((a_lo + a_hi) / 2 * cap)))
    weights = [rng.uniform(a_lo, a_hi) for _ in range(n_anchors)]
    anchor_sizes = [int(anchor_total * w / sum(weights)) for w in weights]
    if anchor_sizes:
        anchor_sizes[-1] += anchor_total - sum(anchor_sizes)

    events: list[Event] = [SaveEvent(round(j * interval, 6), streams, j, 0, None,
                                     (FileSpec("shard0", n),))
                           for j, n in enumerate(anchor_sizes)]
    for i, ev in body:
        t = round((n_anchors + i) * interval, 6)
        events.append(SaveEvent(t, ev.stream, ev.gen, ev.birth, ev.hint, ev.files)
                      if isinstance(ev, SaveEvent) else DeleteEvent(t, ev.stream, ev.gen))
    return dev, events


# --------------------------------------------------------------------------- metrics

def percentile(values, q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation between closest ranks."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


_COUNTERS = ("data_bytes", "journal_bytes", "gc_copied_bytes", "zone_resets", "alloc_us",
             "commits")


class MetricsRecorder:
    """Accumulates replay samples and reduces them to the DESIGN §7 metrics (pure Python)."""

    def __init__(self, zone_capacity: int, *, warmup_epochs: float = WARMUP_EPOCHS,
                 saves_requested: int | None = None):
        self.zone_capacity = zone_capacity
        self.warmup_epochs = warmup_epochs
        self.window_start: float | None = None     # set by start()
        self._requested = saves_requested
        self._samples: list[tuple[float, int, int]] = []
        self._latencies: list[float] = []
        self._logical = 0
        self._attempts = 0
        self._completed = 0
        self._window_completed = 0
        self.capacity_stop = False
        self._base = dict.fromkeys(_COUNTERS, 0)
        self._last = dict.fromkeys(_COUNTERS, 0)

    def start(self, epoch: float) -> None:
        """Prefill is done; the measured timeline begins at `epoch`."""
        self.window_start = epoch + self.warmup_epochs

    def _in_window(self, epoch: float) -> bool:
        return self.window_start is not None and epoch >= self.window_start

    def sample(self, epoch: float, invalid_bytes: int, tail_bytes: int) -> None:
        """Device state after an event (ignored before start())."""
        if self.window_start is None:
            return
        if self._samples and epoch < self._samples[-1][0]:
            raise ValueError("samples must come in epoch order")
        self._samples.append((epoch, invalid_bytes, tail_bytes))

    def counters(self, epoch: float, **cumulative) -> None:
        """Cumulative device/allocator counters after an event (names in _COUNTERS)."""
        unknown = set(cumulative) - set(_COUNTERS)
        if unknown:
            raise TypeError(f"unknown counters: {sorted(unknown)}")
        snap = {**self._last, **cumulative}
        if not self._in_window(epoch):
            self._base = snap
        self._last = snap

    def save(self, epoch: float, latency_s: float, logical_bytes: int,
             completed: bool = True) -> None:
        """One save request; completed=False means it could not be admitted (ENOSPC)."""
        if not completed:
            self.capacity_stop = True
        if self.window_start is None:
            return                                   # prefill
        self._attempts += 1
        if not completed:
            return
        self._completed += 1
        if self._in_window(epoch):
            self._window_completed += 1
            self._latencies.append(latency_s)
            self._logical += logical_bytes

    def _averages(self, end_epoch: float | None) -> tuple[float, float]:
        ws = self.window_start
        if ws is None or not self._samples:
            return 0.0, 0.0
        end = self._samples[-1][0] if end_epoch is None else end_epoch
        inv = tail = dur = 0.0
        for i, (e, iv, tl) in enumerate(self._samples):
            nxt = self._samples[i + 1][0] if i + 1 < len(self._samples) else end
            a, b = max(e, ws), min(nxt, end)
            if b > a:
                inv += iv * (b - a)
                tail += tl * (b - a)
                dur += b - a
        if dur == 0:                     # degenerate window: last in-window sample, if any
            last = [(iv, tl) for e, iv, tl in self._samples if e >= ws]
            return (float(last[-1][0]), float(last[-1][1])) if last else (0.0, 0.0)
        return inv / dur, tail / dur

    def result(self, end_epoch: float | None = None) -> dict:
        """The DESIGN §7 metrics; the window ends at end_epoch (default: last sample)."""
        inv, tail = self._averages(end_epoch)
        c = self.zone_capacity
        d = {k: self._last[k] - self._base[k] for k in _COUNTERS}
        commits = d["commits"] or self._window_completed
        p99 = percentile(self._latencies, 99)
        return {
            "reserved_overhead_zones": (inv + tail) / c,
            "invalid_zones": inv / c,
            "tail_zones": tail / c,
            "host_wa": d["data_bytes"] / self._logical if self._logical else None,
            "journal_bytes": d["journal_bytes"],
            "p99_commit_ms": None if p99 is None else p99 * 1000.0,
            "saves_requested": self._attempts if self._requested is None else self._requested,
            "saves_completed": self._completed,
            "capacity_stop": self.capacity_stop,
            "mean_alloc_us": d["alloc_us"] / commits if commits else None,
            "gc_copied_bytes": d["gc_copied_bytes"],
            "zone_resets": d["zone_resets"],
        }


# --------------------------------------------------------------------------- CLI

def add_gen_workload_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--load", type=float, required=True,
                   help="target peak live occupancy, fraction of data capacity (0.70-0.90)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("-o", "--output", required=True, help="trace file to write ('-' = stdout)")
    p.add_argument("--saves", type=int, default=250, help="checkpoint saves (default 250)")
    p.add_argument("--streams", type=int, default=4, help="checkpoint streams (default 4)")
    p.add_argument("--zone-size", type=int, default=4, metavar="MiB",
                   help="zone size in MiB, power of two (default 4); namespace and "
                        "checkpoint sizes scale with it")
    p.add_argument("--zone-capacity", type=float, default=None, metavar="MiB",
                   help="zone capacity in MiB (default: zone size)")
    p.add_argument("--nr-zones", type=int, default=64, help="zones in the namespace (default 64)")
    p.add_argument("--metadata-zones", type=int, default=METADATA_ZONES,
                   help=f"reserved metadata zones (default {METADATA_ZONES})")
    p.add_argument("--max-open", type=int, default=1,
                   help="data open-zone budget; the device gets +1 for the journal (default 1)")
    p.add_argument("--max-active", type=int, default=6,
                   help="data active-zone budget, e.g. 6/14/30; the device gets +1 for the "
                        "journal (default 6)")
    p.add_argument("--small", action="store_true",
                   help="small checkpoints: 0.10-0.30 zone capacities")
    p.add_argument("--delete-delay", type=int, default=0, metavar="N",
                   help="emit each delete N saves late (delayed deletion)")
    p.add_argument("--extended-retention", type=int, default=0, metavar="E",
                   help="declare latest-K but keep K+E generations")
    p.add_argument("--milestone-every", type=int, default=0, metavar="M",
                   help="every M-th generation of a stream is a never-deleted anchor")
    p.add_argument("--interval", type=float, default=0.1,
                   help="seconds between save starts (default 0.1)")
    p.add_argument("--peak", choices=PEAK_MODES, default="after-deletes",
                   help="where --load is measured: after each save's deletions (default, the "
                        "paper's definition) or in flight, before them")
    return p


def run_gen_workload(args: argparse.Namespace) -> int:
    zs = args.zone_size * MiB
    zc = None
    if args.zone_capacity is not None:
        zc = int(args.zone_capacity * MiB) // 4096 * 4096
    try:
        dev, events = generate(
            args.load, args.seed, saves=args.saves, streams=args.streams, zone_size=zs,
            zone_capacity=zc, nr_zones=args.nr_zones, metadata_zones=args.metadata_zones,
            max_open=args.max_open, max_active=args.max_active, small=args.small,
            delete_delay=args.delete_delay, extended_retention=args.extended_retention,
            milestone_every=args.milestone_every, interval=args.interval, peak=args.peak)
        write_trace(args.output, dev, events)
    except (ValueError, OSError) as e:
        print(f"retainzfs gen-workload: {e}", file=sys.stderr)
        return 1
    saves = [e for e in events if isinstance(e, SaveEvent)]
    anchors = sum(1 for e in saves if e.stream == args.streams)
    cap = data_capacity(dev, args.metadata_zones)
    after, inflight = peak_live(events, True) / cap, peak_live(events) / cap
    print(f"{args.output}: {len(saves) - anchors} saves, {anchors} prefill anchors, "
          f"{len(events) - len(saves)} deletes; peak live {after:.1%} of data capacity after "
          f"deletions, {inflight:.1%} in flight", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="retainzfs gen-workload",
                                description="Generate a synthetic checkpoint trace.")
    return run_gen_workload(add_gen_workload_args(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
