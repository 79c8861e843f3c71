# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Zone summaries and placement policies (RetainZ, ZenFS-Alloc port, equal-epoch, ablations).

The store asks ``place()`` where the next chunk of a save goes and reports what it actually did
with ``note_write`` / ``note_dead`` / ``note_finish`` / ``note_reset``.  ``place()`` does not
change any zone state (it only updates the per-stream cadence estimate and its counters): the
caller finishes the zones returned in ``finish`` (then calls ``note_finish``), writes, and calls
``note_write`` before the next ``place()``.

Code layout: ``Summaries`` (zone state, its upkeep, the fullscan history), ``Policy`` (the
decisions, on a ``ZView``), ``Streams`` (generations, cadence) and ``Allocator``, the public
composition of the three.

Per-zone cached summary (C arrays, O(1) upkeep per note_*)
-----------------------------------------------------------
``W`` written bytes incl. padding, ``L`` live bytes, ``S`` live finite-hint bytes, ``D`` = sum of
size*hint over live finite bytes, ``minh``/``maxh`` the min/max finite hint, ``anchor`` (an
anchor/unhinted byte was written), ``cond`` (empty / active / full).

*min/max after deletes.*  Exact live min/max would need an ordered multiset per zone (not O(1)).
We keep them over **all finite data written since the last reset** (monotone, so O(1) on write
and untouched by ``note_dead``).  For ``maxh`` that is exactly the zone's reclaim epoch
``R = max hint`` of the design: the zone cannot be reset before the last data written into it is
dead, and deletes normally follow hint order.  Keeping ``minh`` over dead data too is
conservative for the span rule (a zone whose old generation is gone but not yet reset looks as
wide as it was).  ``R`` is ``inf`` as soon as the zone holds an anchor; ``-inf`` if it holds no
hinted data (padding only).  ``anchor`` also stays set until reset.

Padding (``live=False``) counts in ``W`` only.  ``note_dead`` must be given the hint the bytes
were written with (``S``/``D`` would drift otherwise; the call raises ValueError when it cannot
match).  With ``hint_grid=G`` every finite hint (place and note_*) is rounded *up* to a
multiple of G first.

Fullscan mode (``fullscan=True``) keeps the event history of every zone since its reset
(``(kind, nbytes, hint, live, owner, lifetime)``) and, on every ``place()``, rebuilds all the
summaries, the active list and the empty count from it, then runs the very same decision code.
Replaying the events in order performs the same floating point operations as the incremental
upkeep, and every tie is broken by zone index, so decisions are identical (tested).

Policies
--------
retainz (and ablations ``retainz-notail`` lam=0, ``retainz-nodbt`` no DBT term,
``retainz-nospan`` no span rule, ``retainz-nosize`` no size adaptation)
    Finite hint ``d``, chunk ``s`` (bytes that fit: ``min(size, free)``), zone ``R, S, D, W``:
    ``R' = max(R, d)``; ``cost = [R'(S+s) - (D+s d)] - [R S - D] + lam (C - W - s) max(R'-now, 0)``
    (the DBT term is 0 for a zone without live finite bytes).  A new zone costs
    ``lam (C - min(s, C)) max(d - now, 0)``.  Ties prefer the existing zone, then the lowest
    zone index.  Candidates: active zones without anchors whose span ``max(maxh, d) - min(minh, d)``
    is within the window.  If no zone passes and opening a zone would need a finish (active budget
    reached) or no empty zone is available, the span rule is relaxed (anchors still apart) and the
    same cost ranks all non-anchor active zones.  Anchors (``d = inf``): best fit among anchor-only
    active zones (least unused capacity after the write, then the largest chunk, then the lowest
    index), else a new zone.

    *Span window.*  ``span=E`` (epochs) fixes the base step.  By default (``span=0``) the step is
    the stream's cadence, learned online from the gap between consecutive births of that stream
    (a window of one cadence lets two adjacent generations -- whose hints are one cadence apart --
    share a zone, which is what a save that straddles a zone boundary needs), and
    ``(d - birth) / 2`` until the stream's second generation is seen (latest-K with ``K >= 2``
    has ``cadence <= (d - a)/2``).  With ``hint_grid=G`` the step is at least G.  *Size
    adaptation* widens the window to ``step * max(1, n - 1)`` with
    ``n = ceil(C / save_size)`` (``save_size`` or, when 0, ``size``), so the ``n`` consecutive
    generations that fit in a zone may share it.

equal-epoch
    Best fit among active zones all of whose data have exactly hint ``d`` (anchors: anchor
    zones), else a new zone.  Like RetainZ (the paper's "during normal placement"), when that
    would need a finish or no empty zone is left, it falls back to best fit among all zones of
    the same class (finite / anchor-free); anchors have no fallback.

isolate
    Every generation ``(stream, birth)`` in its own zones: best fit among active zones owned by
    that generation only, else a new zone.  The owner of a zone is the generation of its first
    write: ``note_write(..., stream=, birth=)`` if given, else the generation of the last
    ``place()`` that returned this zone.

Retainz-family finish victim (active budget reached): the active zone with the cheapest wasted
tail ``(C - W) * max(R - now, 0)`` (anchor zones: infinite), then the smallest free space, then
the lowest index.

zenfs -- port of upstream ZenFS (westerndigitalcorporation/zenfs, fs/zbd_zenfs.cc)
----------------------------------------------------------------------------------
* ``ZonedBlockDevice::AllocateIOZone`` (non-WAL data file)  -> ``Policy._d_zenfs``:
  ApplyFinishThreshold; take an open token; GetBestOpenZoneMatch; if ``best_diff >=
  LIFETIME_DIFF_COULD_BE_WORSE`` try an active token; keep the match only when no token was
  available and the diff is exactly COULD_BE_WORSE; otherwise open an empty zone, finishing the
  cheapest zones until an active token is available; the new zone gets the file's lifetime.
* ``GetLifeTimeDiff`` (constants ``LIFETIME_DIFF_NOT_GOOD = 100``,
  ``LIFETIME_DIFF_COULD_BE_WORSE = 50``) -> ``_lifetime_diff``.
* ``GetBestOpenZoneMatch`` -> candidates are zones with ``used_capacity_ > 0`` (``L > 0``) and
  free space, the lowest diff wins and, since upstream replaces on ``diff <= best_diff`` while
  walking ``io_zones`` in order, ties go to the *highest* zone index.
* ``AllocateEmptyZone`` -> the lowest-index empty zone (our GC reserve is honoured: the last
  ``gc_reserve`` empty zones are invisible unless ``allow_reserve``).
* ``GetActiveIOZoneTokenIfAvailable`` -> ``active < max_active`` (``max_active=0``: unlimited, as
  upstream sets the limit to the zone count); the token is "returned" when the zone becomes full,
  is finished or reset, i.e. the active count is the number of active zones.
* ``ZoneFile::Append`` / ``ZoneFile::active_zone_`` -> ``place(..., writer=ino)``: a file keeps
  appending to its current zone while it is active and has room (no ``AllocateIOZone`` call);
  ``release_writer`` on close mirrors ``ZoneFile::CloseWR``.
* ``WaitForOpenIOZoneToken`` -> a no-op: the store writes one chunk at a time and manages open
  zones itself (it closes zones to stay under max_open), so the token is always available.
* ``FinishCheapestIOZone`` -> the active zone with the least remaining capacity, ties to the
  lowest index (upstream replaces only on strictly larger ``capacity_``).
* ``ApplyFinishThreshold`` / ``finish_threshold_`` -> kwarg ``finish_threshold`` (percent, 0 =
  off): before every allocation, finish every active zone with
  ``free < C * finish_threshold // 100``.
* ``Zone::lifetime_`` -> the max lifetime class of the data written since reset (equal to
  upstream's value set at allocation, since upstream only adds data of a lower or equal class to
  an open zone).  Zones whose data were written without a known generation (mount-time
  rebuild) get ``WLTH_NOT_SET`` like upstream's zones after ``Open``.
Upstream finishes zones before it finds out that no empty zone exists; we do the same and attach
those zones to the ``NoSpace`` exception (``exc.finish``) -- the caller may apply or ignore them.

Hint -> write-lifetime class: anchors/unhinted (``inf``) are ``WLTH_EXTREME``; a finite hint
uses its lifetime ``T = d - birth`` against a base ``B`` (kwarg ``zenfs_base``; 0 = the shortest
positive lifetime seen by ``place()`` so far): ``T <= 2B`` SHORT, ``T <= 20B`` MEDIUM, else LONG.
Class boundaries a factor 10 apart mirror RocksDB's level size multiplier (RocksDB gives WAL
SHORT, L0/L1 MEDIUM, L2 LONG, deeper EXTREME); the factor 2 on the first boundary keeps
retention windows of the same order (e.g. keep 3 vs keep 5 at one cadence) in one class, as all
WAL files share one class upstream.
"""

cimport cython
from libc.stdlib cimport calloc, free
from libc.stdint cimport int64_t, int32_t, int8_t, uint8_t, uint32_t, uint64_t
from libc.math cimport INFINITY, ceil as c_ceil

import math

cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec *tp)
    int CLOCK_MONOTONIC
    int CLOCK_THREAD_CPUTIME_ID

cdef extern from *:
    int __builtin_ctzll(unsigned long long x) nogil


cdef inline int64_t _now_ns() noexcept nogil:
    """Thread CPU time: placement cost without the time the thread waited for a CPU (the
    benchmark machines are shared; wall time would measure the neighbours)."""
    cdef timespec ts
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


POLICIES = ("retainz", "zenfs", "equal-epoch", "retainz-notail", "retainz-nodbt",
            "retainz-nospan", "retainz-nosize", "isolate")

# RocksDB Env::WriteLifeTimeHint
WLTH_NOT_SET = 0
WLTH_NONE = 1
WLTH_SHORT = 2
WLTH_MEDIUM = 3
WLTH_LONG = 4
WLTH_EXTREME = 5
WLTH_NAMES = {0: "NOT_SET", 1: "NONE", 2: "SHORT", 3: "MEDIUM", 4: "LONG", 5: "EXTREME"}
LIFETIME_DIFF_NOT_GOOD = 100
LIFETIME_DIFF_COULD_BE_WORSE = 50

cdef enum:
    C_EMPTY = 0
    C_ACTIVE = 1
    C_FULL = 2
    C_META = 3

cdef enum:
    M_RETAINZ = 0
    M_EQUAL = 1
    M_ISOLATE = 2
    M_ZENFS = 3

cdef enum:
    K_EXISTING = 0
    K_NEW = 1
    K_FALLBACK = 2

cdef enum:
    F_ANCHOR = 0
    F_EXACT = 1
    F_FINITE = 2
    F_OWNER = 3

cdef enum:
    L_NOT_SET = 0
    L_NONE = 1
    L_SHORT = 2
    L_MEDIUM = 3
    L_LONG = 4
    L_EXTREME = 5
    DIFF_NOT_GOOD = 100
    DIFF_COULD_BE_WORSE = 50

_COND_NAMES = ("empty", "active", "full", "meta")
_KIND_NAMES = ("existing", "new", "fallback")


class NoSpace(Exception):
    """No zone can take any byte of the chunk.

    ``finish``: zones the policy decided to finish before it found out (zenfs only, mirroring
    upstream, which finishes the cheapest zone before looking for an empty one); usually [].
    """

    def __init__(self, msg="no zone can take the write", finish=()):
        super().__init__(msg)
        self.finish = list(finish)


cdef struct ZView:
    int64_t *W
    int64_t *L
    int64_t *S
    double *D
    double *minh
    double *maxh
    uint8_t *anchor
    uint8_t *cond
    int32_t *owner
    int8_t *life
    int32_t *act
    int n_act
    int n_empty
    int first_empty


cdef int _view_alloc(ZView *v, int n) except -1:
    v.W = <int64_t *>calloc(n, sizeof(int64_t))
    v.L = <int64_t *>calloc(n, sizeof(int64_t))
    v.S = <int64_t *>calloc(n, sizeof(int64_t))
    v.D = <double *>calloc(n, sizeof(double))
    v.minh = <double *>calloc(n, sizeof(double))
    v.maxh = <double *>calloc(n, sizeof(double))
    v.anchor = <uint8_t *>calloc(n, sizeof(uint8_t))
    v.cond = <uint8_t *>calloc(n, sizeof(uint8_t))
    v.owner = <int32_t *>calloc(n, sizeof(int32_t))
    v.life = <int8_t *>calloc(n, sizeof(int8_t))
    v.act = <int32_t *>calloc(n, sizeof(int32_t))
    v.n_act = 0
    v.n_empty = 0
    v.first_empty = -1
    if (v.W == NULL or v.L == NULL or v.S == NULL or v.D == NULL or v.minh == NULL
            or v.maxh == NULL or v.anchor == NULL or v.cond == NULL or v.owner == NULL
            or v.life == NULL or v.act == NULL):
        raise MemoryError()
    return 0


cdef void _view_free(ZView *v) noexcept:
    free(v.W); free(v.L); free(v.S); free(v.D); free(v.minh); free(v.maxh)
    free(v.anchor); free(v.cond); free(v.owner); free(v.life); free(v.act)
    v.W = NULL; v.L = NULL; v.S = NULL; v.D = NULL; v.minh = NULL; v.maxh = NULL
    v.anchor = NULL; v.cond = NULL; v.owner = NULL; v.life = NULL; v.act = NULL


cdef inline void _sum_clear(ZView *v, int z) noexcept nogil:
    v.W[z] = 0
    v.L[z] = 0
    v.S[z] = 0
    v.D[z] = 0.0
    v.minh[z] = INFINITY
    v.maxh[z] = -INFINITY
    v.anchor[z] = 0
    v.owner[z] = -1
    v.life[z] = L_NOT_SET


cdef inline void _sum_write(ZView *v, int z, int64_t n, double d, bint live, int32_t gid,
                            int8_t life) noexcept nogil:
    """Summary part of a write (conditions / indexes are the caller's business)."""
    if v.W[z] == 0:
        v.owner[z] = gid
        v.life[z] = life
    else:
        if v.owner[z] != gid:
            v.owner[z] = -2          # mixed generations
        if life > v.life[z]:
            v.life[z] = life
    v.W[z] += n
    if live:
        v.L[z] += n
        if d == INFINITY:
            v.anchor[z] = 1
        else:
            v.S[z] += n
            v.D[z] += <double>n * d
            if d < v.minh[z]:
                v.minh[z] = d
            if d > v.maxh[z]:
                v.maxh[z] = d


cdef inline void _sum_dead(ZView *v, int z, int64_t n, double d) noexcept nogil:
    v.L[z] -= n
    if d != INFINITY:
        v.S[z] -= n
        v.D[z] -= <double>n * d


cdef inline int _lifetime_diff(int zone_lt, int file_lt) noexcept nogil:
    """Port of upstream GetLifeTimeDiff(zone_lifetime, file_lifetime)."""
    if file_lt == L_NOT_SET or file_lt == L_NONE:
        if file_lt == zone_lt:
            return 0
        return DIFF_NOT_GOOD
    if zone_lt > file_lt:
        return zone_lt - file_lt
    if zone_lt == file_lt:
        return DIFF_COULD_BE_WORSE
    return DIFF_NOT_GOOD


@cython.final
cdef class Summaries:
    """Per-zone summaries plus the condition indexes the decisions scan (active list, empty-zone
    bitmap), with their O(1) upkeep, and in fullscan mode the event history they are rebuilt
    from.

    Kept apart from the policies so that the decision code only ever sees a ``ZView``: the
    cached one, or (fullscan) the scratch one rebuilt from the history -- same code, same
    decisions.  ``Allocator`` validates zone numbers and hints before calling in here.
    """
    cdef int nr_zones
    cdef int first_data_zone
    cdef int64_t C
    cdef bint fullscan
    cdef ZView cv            # cached summaries
    cdef ZView fv            # fullscan scratch (rebuilt from history on every place())
    cdef int32_t *pos        # index of a zone in cv.act, -1 if not active
    cdef uint64_t *emap      # bitmap of empty data zones (cached mode)
    cdef int nwords
    cdef int ehint           # lowest bitmap word that may hold a set bit
    cdef uint32_t *rgen      # per-zone reset counter (validates zenfs writer entries)
    cdef list hist           # fullscan: per-zone events since the last reset

    def __cinit__(self, int nr_zones, int64_t zone_capacity, int first_data_zone, bint fullscan):
        self.nr_zones = nr_zones
        self.first_data_zone = first_data_zone
        self.C = zone_capacity
        self.fullscan = fullscan
        cdef int n = nr_zones
        _view_alloc(&self.cv, n)
        if fullscan:
            _view_alloc(&self.fv, n)
        self.pos = <int32_t *>calloc(n, sizeof(int32_t))
        self.rgen = <uint32_t *>calloc(n, sizeof(uint32_t))
        self.nwords = (n + 63) // 64
        self.emap = <uint64_t *>calloc(self.nwords, sizeof(uint64_t))
        if self.pos == NULL or self.emap == NULL or self.rgen == NULL:
            raise MemoryError()
        cdef int z
        for z in range(n):
            self.pos[z] = -1
            _sum_clear(&self.cv, z)
            if z < first_data_zone:
                self.cv.cond[z] = C_META
            else:
                self.cv.cond[z] = C_EMPTY
                self.emap[z >> 6] |= (<uint64_t>1) << (z & 63)
                self.cv.n_empty += 1
        self.ehint = 0
        self.hist = [[] for _ in range(n)] if fullscan else []

    def __dealloc__(self):
        _view_free(&self.cv)
        _view_free(&self.fv)
        free(self.pos)
        free(self.emap)
        free(self.rgen)

    # ------------------------------------------------------------------ indexes
    cdef int _first_empty_cached(self) noexcept:
        cdef int w = self.ehint
        while w < self.nwords:
            if self.emap[w] != 0:
                self.ehint = w
                return w * 64 + __builtin_ctzll(self.emap[w])
            w += 1
        self.ehint = self.nwords
        return -1

    cdef inline void _emap_set(self, int z) noexcept:
        self.emap[z >> 6] |= (<uint64_t>1) << (z & 63)
        if (z >> 6) < self.ehint:
            self.ehint = z >> 6

    cdef inline void _emap_clear(self, int z) noexcept:
        self.emap[z >> 6] &= ~((<uint64_t>1) << (z & 63))

    cdef inline void _act_add(self, int z) noexcept:
        self.pos[z] = self.cv.n_act
        self.cv.act[self.cv.n_act] = z
        self.cv.n_act += 1

    cdef inline void _act_remove(self, int z) noexcept:
        cdef int i = self.pos[z]
        cdef int last
        if i < 0:
            return
        self.cv.n_act -= 1
        last = self.cv.act[self.cv.n_act]
        self.cv.act[i] = last
        self.pos[last] = i
        self.pos[z] = -1

    cdef void _rebuild(self):
        """Fullscan: recompute every data zone's summary from its event history."""
        cdef ZView *v = &self.fv
        cdef int z
        cdef bint finished
        cdef list h
        cdef tuple ev
        v.n_act = 0
        v.n_empty = 0
        v.first_empty = -1
        for z in range(self.nr_zones):
            _sum_clear(v, z)
            if z < self.first_data_zone:
                v.cond[z] = C_META
                continue
            finished = False
            h = <list>self.hist[z]
            for ev in h:
                k = ev[0]
                if k == 0:
                    _sum_write(v, z, ev[1], ev[2], ev[3], ev[4], ev[5])
                elif k == 1:
                    _sum_dead(v, z, ev[1], ev[2])
                else:
                    finished = True
            if finished or v.W[z] >= self.C:
                v.cond[z] = C_FULL
            elif v.W[z] > 0:
                v.cond[z] = C_ACTIVE
                v.act[v.n_act] = z
                v.n_act += 1
            else:
                v.cond[z] = C_EMPTY
                v.n_empty += 1
                if v.first_empty < 0:
                    v.first_empty = z

    cdef ZView *view(self) except NULL:
        """The view a place() decides on, with ``first_empty`` set: rebuilt from the history
        (fullscan) or the cached one."""
        if self.fullscan:
            self._rebuild()
            return &self.fv
        self.cv.first_empty = self._first_empty_cached()
        return &self.cv

    # ------------------------------------------------------------------ upkeep (note_*)
    cdef int check_write(self, int z, int64_t n) except -1:
        """Validate a note_write before anything changes; 0: nothing to write (n == 0)."""
        if n < 0:
            raise ValueError("note_write(): negative size")
        if n == 0:
            return 0
        if self.cv.cond[z] == C_FULL:
            raise ValueError(f"note_write(): zone {z} is full/finished")
        if self.cv.W[z] + n > self.C:
            raise ValueError(f"note_write(): zone {z}: {self.cv.W[z]} + {n} bytes exceed "
                             f"capacity {self.C}")
        return 1

    cdef void write(self, int z, int64_t n, double d, bint live, int32_t gid, int8_t life):
        """A checked write (``check_write``) of ``n`` bytes with rounded hint ``d``."""
        _sum_write(&self.cv, z, n, d, live, gid, life)
        if self.cv.cond[z] == C_EMPTY:
            self.cv.cond[z] = C_ACTIVE
            self._emap_clear(z)
            self.cv.n_empty -= 1
            self._act_add(z)
        if self.cv.W[z] >= self.C:
            self.cv.cond[z] = C_FULL
            self._act_remove(z)
        if self.fullscan:
            self.hist[z].append((0, n, d, bool(live), gid, life))

    cdef int dead(self, int z, int64_t n, double d, hint) except -1:
        """``hint``: the caller's unrounded hint, for the error message only."""
        if n < 0:
            raise ValueError("note_dead(): negative size")
        if n == 0:
            return 0
        if self.cv.L[z] < n:
            raise ValueError(f"note_dead(): zone {z} has {self.cv.L[z]} live bytes < {n}")
        if d != INFINITY and self.cv.S[z] < n:
            raise ValueError(f"note_dead(): zone {z} has {self.cv.S[z]} live finite-hint "
                             f"bytes < {n} (hint {hint!r} differs from the written one?)")
        _sum_dead(&self.cv, z, n, d)
        if self.fullscan:
            self.hist[z].append((1, n, d))
        return 0

    cdef void finish(self, int z):
        if self.cv.cond[z] == C_EMPTY:
            self._emap_clear(z)
            self.cv.n_empty -= 1
        elif self.cv.cond[z] == C_ACTIVE:
            self._act_remove(z)
        elif self.cv.cond[z] == C_FULL:
            return
        self.cv.cond[z] = C_FULL
        if self.fullscan:
            self.hist[z].append((2,))

    cdef void reset(self, int z):
        if self.cv.cond[z] == C_ACTIVE:
            self._act_remove(z)
        if self.cv.cond[z] != C_EMPTY:
            self.cv.cond[z] = C_EMPTY
            self._emap_set(z)
            self.cv.n_empty += 1
        _sum_clear(&self.cv, z)
        self.rgen[z] += 1
        if self.fullscan:
            self.hist[z] = []

    # ------------------------------------------------------------------ queries
    cdef list check(self):
        """Zones whose cached summary or index entry differs from the history (-1: counts)."""
        self._rebuild()
        cdef ZView *a = &self.cv
        cdef ZView *b = &self.fv
        cdef int z
        bad = []
        for z in range(self.first_data_zone, self.nr_zones):
            if (a.W[z] != b.W[z] or a.L[z] != b.L[z] or a.S[z] != b.S[z] or a.D[z] != b.D[z]
                    or a.minh[z] != b.minh[z] or a.maxh[z] != b.maxh[z]
                    or a.anchor[z] != b.anchor[z] or a.cond[z] != b.cond[z]
                    or a.owner[z] != b.owner[z] or a.life[z] != b.life[z]
                    or (a.cond[z] == C_ACTIVE) != (self.pos[z] >= 0)
                    or (a.cond[z] == C_EMPTY) != bool((self.emap[z >> 6] >> (z & 63)) & 1)):
                bad.append(z)
        if a.n_act != b.n_act or a.n_empty != b.n_empty:
            bad.append(-1)
        return bad

    cdef inline int64_t free_bytes(self, int z) noexcept:
        if self.cv.cond[z] != C_ACTIVE and self.cv.cond[z] != C_EMPTY:
            return 0
        return self.C - self.cv.W[z]

    cdef double reclaim(self, int z) noexcept:
        if self.cv.anchor[z]:
            return INFINITY
        return self.cv.maxh[z]

    cdef dict summary(self, int z):
        cdef ZView *v = &self.cv
        has = v.maxh[z] != -INFINITY
        return {"W": v.W[z], "L": v.L[z], "S": v.S[z], "D": v.D[z],
                "minh": v.minh[z] if has else None, "maxh": v.maxh[z] if has else None,
                "anchor": bool(v.anchor[z]), "cond": _COND_NAMES[v.cond[z]],
                "R": self.reclaim(z), "free": self.free_bytes(z),
                "owner": v.owner[z], "lifetime": WLTH_NAMES[v.life[z]]}

    cdef list empty_list(self):
        return [z for z in range(self.first_data_zone, self.nr_zones)
                if self.cv.cond[z] == C_EMPTY]

    cdef list active_list(self):
        return sorted(self.cv.act[i] for i in range(self.cv.n_act))

    cdef list victims(self, n, exclude):
        """GC victims (see ``Allocator.victims``): an order on the summaries, no policy."""
        ex = set(exclude)
        cdef ZView *v = &self.cv
        cands = []
        cdef int z
        for z in range(self.first_data_zone, self.nr_zones):
            if v.cond[z] == C_FULL:
                gain = self.C - v.L[z]
            elif v.cond[z] == C_ACTIVE and z not in ex:
                gain = v.W[z] - v.L[z]
            else:
                continue
            if gain > 0:
                cands.append((-gain, v.L[z], -self.reclaim(z), z))
        cands.sort()
        return [c[3] for c in cands[:n]]


@cython.final
cdef class Policy:
    """The placement decisions (module docstring, "Policies"): one ``decide()`` on a ``ZView``.

    Holds only the policy parameters and the scratch of one decision (virtually finished and
    excluded zones, the zones to finish, the result); zone state comes in as the view, so the
    cached and the fullscan summaries run the very same code.  Never changes the view.
    """
    cdef int nr_zones
    cdef int first_data_zone
    cdef int64_t C
    cdef int mode
    cdef bint use_dbt, use_span
    cdef double lam
    cdef int max_active
    cdef int finish_threshold
    cdef uint8_t *vfin       # zones finished virtually during the current decision
    cdef uint8_t *skip       # zones excluded from the current decision
    cdef int32_t *fin        # zones to finish, in decision order
    cdef int nfin
    cdef int out_zone
    cdef int64_t out_nbytes
    cdef int out_kind
    cdef double out_cost

    def __cinit__(self, int nr_zones, int64_t zone_capacity, int first_data_zone, int mode,
                  bint use_dbt, bint use_span, double lam, int max_active, int finish_threshold):
        self.nr_zones = nr_zones
        self.first_data_zone = first_data_zone
        self.C = zone_capacity
        self.mode = mode
        self.use_dbt = use_dbt
        self.use_span = use_span
        self.lam = lam
        self.max_active = max_active
        self.finish_threshold = finish_threshold
        self.vfin = <uint8_t *>calloc(nr_zones, sizeof(uint8_t))
        self.skip = <uint8_t *>calloc(nr_zones, sizeof(uint8_t))
        self.fin = <int32_t *>calloc(nr_zones + 1, sizeof(int32_t))
        if self.vfin == NULL or self.skip == NULL or self.fin == NULL:
            raise MemoryError()
        self.out_zone = -1

    def __dealloc__(self):
        free(self.vfin)
        free(self.skip)
        free(self.fin)

    # ------------------------------------------------------------------ one decision
    cdef int decide(self, ZView *v, int64_t s, double d, double now, double window,
                    int life, int32_t gid, bint can_new, bint tails_only, int wzone) noexcept:
        """Result in ``out_*`` and ``fin[:nfin]``; -1: no zone can take any byte.  ``wzone``
        >= 0: the zenfs writer's current zone, taken without a decision.  The caller sets
        ``skip`` before and calls ``done()`` after."""
        self.nfin = 0
        self.out_zone = -1
        self.out_nbytes = 0
        self.out_kind = K_EXISTING
        self.out_cost = 0.0
        # an excluded empty zone cannot be opened: look for the next one
        if v.first_empty >= 0 and self.skip[v.first_empty]:
            v.first_empty = self._next_empty(v, 0)
        if wzone >= 0:
            self._take(v, wzone, s, K_EXISTING, 0.0)
            return 0
        if tails_only:
            return self._d_tails(v, s, d, now, life)
        if self.mode == M_ZENFS:
            return self._d_zenfs(v, s, life, can_new)
        if self.mode == M_EQUAL:
            return self._d_equal(v, s, d, now, can_new)
        if self.mode == M_ISOLATE:
            return self._d_isolate(v, s, d, now, gid, can_new)
        return self._d_retainz(v, s, d, now, window, can_new)

    cdef list done(self, list excl):
        """The zones to finish, as a list; clears the per-decision marks."""
        cdef int i, z
        fin = [self.fin[i] for i in range(self.nfin)]
        for z in fin:
            self.vfin[z] = 0
        for z in excl:
            self.skip[z] = 0
        return fin

    cdef int _next_empty(self, ZView *v, int start) noexcept:
        """Lowest-index empty, non-excluded data zone (slow path, only with ``exclude``)."""
        cdef int z
        for z in range(max(start, self.first_data_zone), self.nr_zones):
            if v.cond[z] == C_EMPTY and not self.skip[z]:
                return z
        return -1

    # ------------------------------------------------------------------ decision core
    cdef inline bint _need_finish(self, ZView *v) noexcept:
        return self.max_active > 0 and (v.n_act - self.nfin) >= self.max_active

    cdef inline double _rz_cost(self, ZView *v, int z, int64_t s, double d, double now) noexcept:
        cdef double R = v.maxh[z]
        cdef double Rn = R if R > d else d
        cdef int64_t S = v.S[z]
        cdef double D = v.D[z]
        cdef double cost = 0.0
        cdef double old, rem
        if self.use_dbt:
            old = (R * S - D) if S > 0 else 0.0
            cost = (Rn * (S + s) - (D + <double>s * d)) - old
        if self.lam != 0.0:
            rem = Rn - now
            if rem < 0:
                rem = 0.0
            cost += self.lam * <double>(self.C - v.W[z] - s) * rem
        return cost

    cdef inline double _new_cost(self, int64_t s, double d, double now) noexcept:
        cdef int64_t nb = s if s < self.C else self.C
        cdef double rem = d - now
        if rem < 0 or self.lam == 0.0:
            return 0.0
        return self.lam * <double>(self.C - nb) * rem

    cdef int _rz_scan(self, ZView *v, int64_t s, double d, double now, double window,
                      bint span, double *outcost) noexcept:
        cdef int best = -1
        cdef double bc = INFINITY
        cdef int i, z
        cdef int64_t fr, nb
        cdef double lo, hi, c
        for i in range(v.n_act):
            z = v.act[i]
            if self.vfin[z] or self.skip[z] or v.anchor[z]:
                continue
            fr = self.C - v.W[z]
            if fr <= 0:
                continue
            if span and v.maxh[z] != -INFINITY:
                lo = v.minh[z] if v.minh[z] < d else d
                hi = v.maxh[z] if v.maxh[z] > d else d
                if hi - lo > window:
                    continue
            nb = s if s < fr else fr
            c = self._rz_cost(v, z, nb, d, now)
            if best < 0 or c < bc or (c == bc and z < best):
                best = z
                bc = c
        outcost[0] = bc
        return best

    cdef int _bestfit(self, ZView *v, int64_t s, int filt, int32_t gid, double d) noexcept:
        cdef int best = -1
        cdef int64_t bu = 0, bnb = 0, fr, nb, un
        cdef int i, z
        for i in range(v.n_act):
            z = v.act[i]
            if self.vfin[z] or self.skip[z]:
                continue
            if filt == F_ANCHOR:
                if not v.anchor[z] or v.maxh[z] != -INFINITY:
                    continue
            elif filt == F_EXACT:
                if v.anchor[z]:
                    continue
                if v.maxh[z] != -INFINITY and (v.minh[z] != d or v.maxh[z] != d):
                    continue
            elif filt == F_FINITE:
                if v.anchor[z]:
                    continue
            else:
                if v.owner[z] != gid:
                    continue
            fr = self.C - v.W[z]
            if fr <= 0:
                continue
            nb = s if s < fr else fr
            un = fr - nb
            if (best < 0 or un < bu or (un == bu and (nb > bnb or (nb == bnb and z < best)))):
                best = z
                bu = un
                bnb = nb
        return best

    cdef int _rz_victim(self, ZView *v, double now) noexcept:
        """Active zone with the cheapest wasted tail (C - W) * max(R - now, 0)."""
        cdef int best = -1
        cdef double bc = 0.0, c, R, rem
        cdef int64_t bfr = 0, fr
        cdef int i, z
        for i in range(v.n_act):
            z = v.act[i]
            if self.vfin[z]:
                continue
            fr = self.C - v.W[z]
            if v.anchor[z]:
                c = INFINITY
            else:
                R = v.maxh[z]
                rem = R - now
                if rem <= 0:          # also R = -inf (no hinted data)
                    c = 0.0
                else:
                    c = <double>fr * rem
            if best < 0 or c < bc or (c == bc and (fr < bfr or (fr == bfr and z < best))):
                best = z
                bc = c
                bfr = fr
        return best

    cdef int _zen_victim(self, ZView *v) noexcept:
        """Port of FinishCheapestIOZone: least remaining capacity, ties to the lowest index."""
        cdef int best = -1
        cdef int64_t bfr = 0, fr
        cdef int i, z
        for i in range(v.n_act):
            z = v.act[i]
            if self.vfin[z]:
                continue
            fr = self.C - v.W[z]
            if best < 0 or fr < bfr or (fr == bfr and z < best):
                best = z
                bfr = fr
        return best

    cdef inline void _mark_fin(self, int z) noexcept:
        self.vfin[z] = 1
        self.fin[self.nfin] = z
        self.nfin += 1

    cdef int _open_new(self, ZView *v, int64_t s, double now, bint can_new) noexcept:
        """Open the lowest-index empty zone, finishing active zones first if the budget says so."""
        cdef int victim
        cdef int n0 = self.nfin
        if not can_new or v.first_empty < 0:
            return -1
        while self._need_finish(v):
            victim = self._zen_victim(v) if self.mode == M_ZENFS else self._rz_victim(v, now)
            if victim < 0:
                while self.nfin > n0:          # undo: nothing is opened after all
                    self.nfin -= 1
                    self.vfin[self.fin[self.nfin]] = 0
                return -1
            self._mark_fin(victim)
        self.out_zone = v.first_empty
        self.out_nbytes = s if s < self.C else self.C
        self.out_kind = K_NEW
        return 0

    cdef inline void _take(self, ZView *v, int z, int64_t s, int kind, double cost) noexcept:
        cdef int64_t fr = self.C - v.W[z]
        self.out_zone = z
        self.out_nbytes = s if s < fr else fr
        self.out_kind = kind
        self.out_cost = cost

    cdef int _d_retainz(self, ZView *v, int64_t s, double d, double now, double window,
                        bint can_new) noexcept:
        cdef int z
        cdef double bc = INFINITY, nc
        if d == INFINITY:
            z = self._bestfit(v, s, F_ANCHOR, -1, d)
            if z >= 0:
                self._take(v, z, s, K_EXISTING, 0.0)
                return 0
            return self._open_new(v, s, now, can_new)
        z = self._rz_scan(v, s, d, now, window, self.use_span, &bc)
        if z >= 0:
            if can_new and v.first_empty >= 0:
                nc = self._new_cost(s, d, now)
                if nc < bc and self._open_new(v, s, now, can_new) == 0:
                    self.out_cost = nc
                    return 0
            self._take(v, z, s, K_EXISTING, bc)
            return 0
        if can_new and v.first_empty >= 0 and not self._need_finish(v):
            if self._open_new(v, s, now, can_new) == 0:
                self.out_cost = self._new_cost(s, d, now)
                return 0
        if self.use_span:
            z = self._rz_scan(v, s, d, now, window, False, &bc)
            if z >= 0:
                self._take(v, z, s, K_FALLBACK, bc)
                return 0
        if self._open_new(v, s, now, can_new) == 0:
            self.out_cost = self._new_cost(s, d, now)
            return 0
        return -1

    cdef int _d_equal(self, ZView *v, int64_t s, double d, double now, bint can_new) noexcept:
        cdef int z = self._bestfit(v, s, F_ANCHOR if d == INFINITY else F_EXACT, -1, d)
        if z >= 0:
            self._take(v, z, s, K_EXISTING, 0.0)
            return 0
        if can_new and v.first_empty >= 0 and not self._need_finish(v):
            return self._open_new(v, s, now, can_new)
        if d != INFINITY:
            z = self._bestfit(v, s, F_FINITE, -1, d)
            if z >= 0:
                self._take(v, z, s, K_FALLBACK, 0.0)
                return 0
        return self._open_new(v, s, now, can_new)

    cdef int _d_isolate(self, ZView *v, int64_t s, double d, double now, int32_t gid,
                        bint can_new) noexcept:
        cdef int z = self._bestfit(v, s, F_OWNER, gid, d)
        if z >= 0:
            self._take(v, z, s, K_EXISTING, 0.0)
            return 0
        return self._open_new(v, s, now, can_new)

    cdef int _d_tails(self, ZView *v, int64_t s, double d, double now, int file_lt) noexcept:
        """Compatible tails only (see ``place(tails_only=True)``); never a new zone."""
        cdef int i, z, diff, best = -1
        cdef int best_diff = DIFF_NOT_GOOD
        cdef double bc = INFINITY
        if self.mode == M_ZENFS:
            for i in range(v.n_act):
                z = v.act[i]
                if self.vfin[z] or self.skip[z] or self.C - v.W[z] <= 0:
                    continue
                diff = _lifetime_diff(v.life[z], file_lt)
                if diff < DIFF_NOT_GOOD and (diff < best_diff or (diff == best_diff and z > best)):
                    best = z
                    best_diff = diff
            if best < 0:
                return -1
            self._take(v, best, s, K_FALLBACK, <double>best_diff)
            return 0
        if d == INFINITY:
            z = self._bestfit(v, s, F_ANCHOR, -1, d)
        elif self.mode == M_RETAINZ:
            z = self._rz_scan(v, s, d, now, 0.0, False, &bc)
        else:
            z = self._bestfit(v, s, F_FINITE, -1, d)
        if z < 0:
            return -1
        self._take(v, z, s, K_FALLBACK, 0.0 if bc == INFINITY else bc)
        return 0

    cdef int _d_zenfs(self, ZView *v, int64_t s, int file_lt, bint can_new) noexcept:
        """Port of ZonedBlockDevice::AllocateIOZone for a non-WAL file (see module docstring)."""
        cdef int i, z, diff
        cdef int64_t fr, limit
        cdef int best = -1
        cdef int best_diff = DIFF_NOT_GOOD
        cdef bint got_token
        # ApplyFinishThreshold()
        if self.finish_threshold > 0:
            limit = self.C * self.finish_threshold // 100
            for i in range(v.n_act):
                z = v.act[i]
                if not self.vfin[z] and self.C - v.W[z] < limit:
                    self._mark_fin(z)
        # WaitForOpenIOZoneToken(false): always available here (single writer).
        # GetBestOpenZoneMatch(file_lifetime, &best_diff, &allocated_zone)
        for i in range(v.n_act):
            z = v.act[i]
            if self.vfin[z] or self.skip[z]:
                continue
            fr = self.C - v.W[z]
            if v.L[z] > 0 and fr > 0:
                diff = _lifetime_diff(v.life[z], file_lt)
                if diff < best_diff or (diff == best_diff and (best < 0 or z > best)):
                    best = z
                    best_diff = diff
        if best_diff >= DIFF_COULD_BE_WORSE:
            # GetActiveIOZoneTokenIfAvailable()
            got_token = self.max_active == 0 or (v.n_act - self.nfin) < self.max_active
            if best >= 0 and not (not got_token and best_diff == DIFF_COULD_BE_WORSE):
                best = -1
            if best < 0:
                # while (!got_token && !GetActiveIOZoneTokenIfAvailable()) FinishCheapestIOZone();
                while self._need_finish(v):
                    z = self._zen_victim(v)
                    if z < 0:
                        return -1
                    self._mark_fin(z)
                # AllocateEmptyZone(); the new zone takes the file's lifetime (note_write)
                if not can_new or v.first_empty < 0:
                    return -1
                self.out_zone = v.first_empty
                self.out_nbytes = s if s < self.C else self.C
                self.out_kind = K_NEW
                self.out_cost = 0.0
                return 0
            self._take(v, best, s, K_FALLBACK, <double>best_diff)
            return 0
        self._take(v, best, s, K_EXISTING, <double>best_diff)
        return 0

@cython.final
cdef class Streams:
    """What ``place()`` learns about the data it is asked to place: generation ids (zone owner,
    ``isolate``), each stream's cadence (the RetainZ span window) and the shortest lifetime
    seen (the zenfs lifetime-class base).

    Python-level state keyed by the caller's stream / birth objects, touched once per call
    (never in a scan loop); apart so that the zone state and the decisions stay C-only.
    """
    cdef int64_t C
    cdef double hint_grid
    cdef double span
    cdef double zenfs_base
    cdef bint use_size
    cdef dict gen_ids        # (stream, birth) -> generation id (``Allocator._bound_gens``)
    cdef int32_t next_gid    # ids are never reused: a forgotten generation gets a new one
    cdef dict cad            # stream -> [last birth, cadence]
    cdef double zbase_seen

    def __cinit__(self, int64_t zone_capacity, double hint_grid, double span, double zenfs_base,
                  bint use_size):
        self.C = zone_capacity
        self.hint_grid = hint_grid
        self.span = span
        self.zenfs_base = zenfs_base
        self.use_size = use_size
        self.gen_ids = {}
        self.next_gid = 0
        self.cad = {}
        self.zbase_seen = 0.0

    cdef int learn(self, stream, double a, double d) except -1:
        """A place() of a generation born at ``a`` (hint ``d``): per-stream cadence (gap
        between consecutive births of the stream) and the shortest lifetime seen."""
        st = self.cad.get(stream)
        if st is None:
            self.cad[stream] = [a, 0.0]
        elif a > st[0]:
            st[1] = a - st[0]
            st[0] = a
        if d != INFINITY and d > a and (self.zbase_seen == 0 or d - a < self.zbase_seen):
            self.zbase_seen = d - a
        return 0

    cdef int8_t life_class(self, double d, double a):
        if d == INFINITY:
            return L_EXTREME
        cdef double base = self.zenfs_base if self.zenfs_base > 0 else self.zbase_seen
        cdef double t = d - a
        if base <= 0 or t <= 2.0 * base:
            return L_SHORT
        if t <= 20.0 * base:
            return L_MEDIUM
        return L_LONG

    cdef int32_t gen(self, stream, birth):
        key = (stream, birth)
        g = self.gen_ids.get(key)
        if g is None:
            g = self.next_gid
            self.next_gid += 1
            self.gen_ids[key] = g
        return g

    cdef double window(self, double d, double a, stream, int64_t size, int64_t save_size):
        cdef double step
        if self.span > 0:
            step = self.span
        else:
            st = self.cad.get(stream)
            if st is not None and st[1] > 0:
                step = st[1]
            else:
                step = (d - a) / 2.0 if d > a else 0.0
        if self.hint_grid > step:
            step = self.hint_grid
        cdef int64_t ss, n
        if self.use_size:
            ss = save_size if save_size > 0 else size
            n = (self.C + ss - 1) // ss
            if n > 2:
                return step * (n - 1)
        return step


cdef class Allocator:
    """Zone allocator; see the module docstring.

    ``Allocator(nr_zones, zone_capacity, first_data_zone, policy="retainz", *, max_active=0,
    lam=1.0, hint_grid=0, gc_reserve=1, fullscan=False, block_size=4096, span=0,
    finish_threshold=0, zenfs_base=0)``

    The public face, composed of a ``Summaries`` (zone state), a ``Policy`` (decisions) and a
    ``Streams`` (generations, cadence); it checks and converts the arguments, keeps the zenfs
    writers and the last decision, and counts and times every call.
    """
    cdef readonly int nr_zones
    cdef readonly int first_data_zone
    cdef readonly int64_t zone_capacity
    cdef readonly int64_t block_size
    cdef readonly str policy
    cdef readonly int max_active
    cdef readonly int gc_reserve
    cdef readonly double lam
    cdef readonly double hint_grid
    cdef readonly double span
    cdef readonly int finish_threshold
    cdef readonly double zenfs_base
    cdef readonly bint fullscan
    #: generation ids kept before those owning no zone are forgotten (``_bound_gens``)
    cdef public Py_ssize_t max_generations
    cdef Py_ssize_t gen_kept       # generation ids kept by the last ``_bound_gens``

    cdef Summaries s
    cdef Policy p
    cdef Streams st
    cdef int mode
    cdef dict writers        # zenfs: writer -> (zone, reset generation), ZoneFile::active_zone_

    cdef double last_window
    cdef int last_life
    cdef int pend_zone
    cdef int32_t pend_gen
    cdef int8_t pend_life

    cdef int64_t n_places, place_ns, n_notes, note_ns
    cdef int64_t n_new, n_finish, n_fallback, n_nospace

    def __init__(self, nr_zones, zone_capacity, first_data_zone, policy="retainz", *,
                 max_active=0, lam=1.0, hint_grid=0, gc_reserve=1, fullscan=False,
                 block_size=4096, span=0, finish_threshold=0, zenfs_base=0):
        if policy not in POLICIES:
            raise ValueError(f"unknown allocator policy {policy!r} (one of {', '.join(POLICIES)})")
        if nr_zones <= 0 or zone_capacity <= 0:
            raise ValueError("nr_zones and zone_capacity must be positive")
        if not 0 <= first_data_zone <= nr_zones:
            raise ValueError("first_data_zone out of range")
        if max_active < 0 or gc_reserve < 0 or hint_grid < 0 or span < 0 or lam < 0:
            raise ValueError("max_active, gc_reserve, hint_grid, span and lam must be >= 0")
        if not 0 <= finish_threshold <= 100:
            raise ValueError("finish_threshold is a percentage (0..100)")
        if self.s is not None:
            raise RuntimeError("Allocator already initialised")
        self.nr_zones = nr_zones
        self.first_data_zone = first_data_zone
        self.zone_capacity = zone_capacity
        self.block_size = block_size
        self.policy = policy
        self.max_active = max_active
        self.gc_reserve = gc_reserve
        self.lam = lam
        self.hint_grid = hint_grid
        self.span = span
        self.finish_threshold = finish_threshold
        self.zenfs_base = zenfs_base
        self.fullscan = bool(fullscan)
        cdef bint use_dbt = True, use_span = True, use_size = True
        self.mode = M_RETAINZ
        if policy == "zenfs":
            self.mode = M_ZENFS
        elif policy == "equal-epoch":
            self.mode = M_EQUAL
        elif policy == "isolate":
            self.mode = M_ISOLATE
        elif policy == "retainz-notail":
            self.lam = 0.0
        elif policy == "retainz-nodbt":
            use_dbt = False
        elif policy == "retainz-nospan":
            use_span = False
        elif policy == "retainz-nosize":
            use_size = False
        self.s = Summaries(nr_zones, zone_capacity, first_data_zone, self.fullscan)
        self.p = Policy(nr_zones, zone_capacity, first_data_zone, self.mode, use_dbt, use_span,
                        self.lam, max_active, finish_threshold)
        self.st = Streams(zone_capacity, self.hint_grid, self.span, self.zenfs_base, use_size)
        self.writers = {}
        self.max_generations = 4096
        self.gen_kept = 0
        self.pend_zone = -1
        self.pend_gen = -1
        self.pend_life = L_NOT_SET
        self.last_window = 0.0
        self.last_life = L_NOT_SET

    # ------------------------------------------------------------------ argument conversion
    cdef double _hint(self, hint) except? -1.0:
        """Python hint -> double: None/inf -> inf; finite rounded up to the hint grid."""
        if hint is None:
            return INFINITY
        cdef double d = float(hint)
        if d != d:
            raise ValueError("hint is NaN")
        if d == INFINITY:
            return INFINITY
        if d == -INFINITY:
            raise ValueError("hint is -inf")
        if self.hint_grid > 0:
            d = c_ceil(d / self.hint_grid) * self.hint_grid
        return d

    cdef int _zone(self, zone) except -1:
        cdef int z = zone
        if z < self.first_data_zone or z >= self.nr_zones:
            raise ValueError(f"zone {zone} is not a data zone "
                             f"[{self.first_data_zone}, {self.nr_zones})")
        return z

    # ------------------------------------------------------------------ public API
    def place(self, size, hint, birth, now, stream=0, save_size=0, *, allow_reserve=False,
              exclude=None, tails_only=False, writer=None):
        """Where to put the next chunk: ``(zone, nbytes, finish)``.

        ``size`` block-padded bytes still to place; ``hint`` reclaim epoch (``inf``/None for
        anchors and unhinted data); ``birth`` the generation's birth epoch; ``now`` the current
        epoch; ``stream`` the stream id; ``save_size`` total padded size of the save (size
        adaptation; 0 = use ``size``).  ``nbytes = min(size, free space of zone)``; call again for
        the rest.  ``finish``: zones to finish (then ``note_finish``) before writing.
        ``allow_reserve`` lets the call open one of the last ``gc_reserve`` empty zones (GC
        relocation, common admission); ``exclude`` zones that must not be chosen (e.g. the GC
        victim).  ``writer`` (any hashable, e.g. the inode; zenfs only): upstream ZenFS keeps
        appending a file to its current zone (``ZoneFile::active_zone_``) and calls
        ``AllocateIOZone`` only when that zone is full, so while the writer's last zone is still
        active with free space it is returned without a new decision (``release_writer`` when
        the file is closed, like ``ZoneFile::CloseWR``).  Other policies place every chunk.
        ``tails_only`` (common admission): only the free tails
        of active zones that are *compatible* with the data -- for zenfs the zones its
        ``GetLifeTimeDiff`` does not rate NOT_GOOD (lowest diff, ties to the highest index, as
        ``GetBestOpenZoneMatch``), for every other policy the zones of the same class (anchors
        with anchor-only zones, finite hints with zones without anchors), ranked by the policy's
        fallback order (retainz family: the cost with the span rule relaxed; equal-epoch and
        isolate: best fit); never opens or finishes a zone.  Raises ``NoSpace``.
        """
        cdef int64_t t0 = _now_ns()
        try:
            return self._place(size, hint, birth, now, stream, save_size, allow_reserve,
                               exclude, tails_only, writer)
        finally:
            self.n_places += 1
            self.place_ns += _now_ns() - t0

    cdef tuple _place(self, size, hint, birth, now, stream, save_size, bint allow_reserve,
                      exclude, bint tails_only=False, writer=None):
        cdef int64_t s = size
        cdef int64_t ss = save_size if save_size else 0
        if s <= 0:
            raise ValueError("place(): size must be positive")
        cdef double d = self._hint(hint)
        cdef double fnow = float(now)
        cdef double a = fnow if birth is None else float(birth)
        if birth is not None:
            self.st.learn(stream, a, d)
        cdef int32_t gid = self.st.gen(stream, birth)
        self._bound_gens(gid)
        cdef int8_t life = self.st.life_class(d, a)
        cdef double window = self.st.window(d, a, stream, s, ss)
        self.last_window = window
        self.last_life = life

        cdef ZView *v = self.s.view()
        cdef bint can_new = v.n_empty > self.gc_reserve or (allow_reserve and v.n_empty > 0)
        cdef Policy p = self.p
        cdef list excl = []
        cdef int z
        if exclude is not None:
            for x in exclude:
                z = x
                if 0 <= z < self.nr_zones:
                    p.skip[z] = 1
                    excl.append(z)
        # zenfs ZoneFile::active_zone_: the writer's zone while it is active with room
        cdef int wz = -1
        if self.mode == M_ZENFS and writer is not None and not tails_only:
            w = self.writers.get(writer)
            if w is not None:
                z = w[0]
                if not (w[1] != self.s.rgen[z] or v.cond[z] != C_ACTIVE or p.skip[z]
                        or v.W[z] >= self.zone_capacity):
                    wz = z
        cdef int rc = p.decide(v, s, d, fnow, window, life, gid, can_new, tails_only, wz)
        fin = p.done(excl)
        if rc < 0:
            self.n_nospace += 1
            raise NoSpace(f"no zone can take {s} bytes (policy {self.policy}, "
                          f"{v.n_empty} empty, reserve {self.gc_reserve})", fin)
        self.n_finish += p.nfin
        if p.out_kind == K_NEW:
            self.n_new += 1
        elif p.out_kind == K_FALLBACK:
            self.n_fallback += 1
        self.pend_zone = p.out_zone
        self.pend_gen = gid
        self.pend_life = life
        if self.mode == M_ZENFS and writer is not None:
            self.writers.pop(writer, None)
            self.writers[writer] = (p.out_zone, self.s.rgen[p.out_zone])
            if len(self.writers) > 4096:          # writers that were never released
                del self.writers[next(iter(self.writers))]
        return (p.out_zone, p.out_nbytes, fin)

    cdef int _bound_gens(self, int32_t keep) except -1:
        """Forget the ids of generations that own no zone once there are ``max_generations``:
        a daemon that saves a checkpoint every few minutes for months would otherwise keep one
        per save.  An id only tells a zone's owner apart (``isolate``'s best fit, the mixed
        mark), so a generation that owns no zone loses nothing by getting a new id when it
        writes again (ids are never reused).  Kept: the owners of every zone (the cached
        summaries hold them in fullscan mode too), the last place()'s and ``keep``.  The next
        pass waits for twice what this one kept, so a device of many single-owner zones is
        not rescanned on every call."""
        if len(self.st.gen_ids) <= max(self.max_generations, 2 * self.gen_kept):
            return 0
        cdef int32_t *owner = self.s.cv.owner
        cdef int z
        live = {keep, self.pend_gen}
        for z in range(self.first_data_zone, self.nr_zones):
            if owner[z] >= 0:
                live.add(owner[z])
        self.st.gen_ids = {k: g for k, g in self.st.gen_ids.items() if g in live}
        self.gen_kept = len(self.st.gen_ids)
        return 0

    def release_writer(self, writer):
        """The writer (file) was closed: its next write allocates afresh (zenfs)."""
        self.writers.pop(writer, None)

    def note_write(self, zone, nbytes, hint, live=True, *, stream=None, birth=None):
        """``nbytes`` were appended to ``zone`` (``live=False``: padding, counts in W only).

        The generation (for ``isolate`` and the zenfs lifetime class) is ``(stream, birth)`` if
        ``birth`` is given, else the one of the last ``place()`` if it returned this zone, else
        unknown."""
        cdef int64_t t0 = _now_ns()
        cdef int z = self._zone(zone)
        cdef int64_t n = nbytes
        cdef double d = self._hint(hint)
        cdef int32_t gid
        cdef int8_t life
        try:
            if not self.s.check_write(z, n):
                return
            if birth is not None:
                gid = self.st.gen(0 if stream is None else stream, birth)
                self._bound_gens(gid)
                life = self.st.life_class(d, float(birth))
            elif z == self.pend_zone:
                gid = self.pend_gen
                life = self.pend_life
            else:
                gid = -1
                life = L_NOT_SET
            self.s.write(z, n, d, live, gid, life)
        finally:
            self.n_notes += 1
            self.note_ns += _now_ns() - t0

    def note_dead(self, zone, nbytes, hint):
        """``nbytes`` live bytes of ``zone`` written with ``hint`` became invalid."""
        cdef int64_t t0 = _now_ns()
        cdef int z = self._zone(zone)
        cdef int64_t n = nbytes
        cdef double d = self._hint(hint)
        try:
            self.s.dead(z, n, d, hint)
        finally:
            self.n_notes += 1
            self.note_ns += _now_ns() - t0

    def note_finish(self, zone):
        """``zone`` was finished (FULL); idempotent."""
        cdef int64_t t0 = _now_ns()
        cdef int z = self._zone(zone)
        try:
            self.s.finish(z)
        finally:
            self.n_notes += 1
            self.note_ns += _now_ns() - t0

    def note_reset(self, zone):
        """``zone`` was reset (EMPTY)."""
        cdef int64_t t0 = _now_ns()
        cdef int z = self._zone(zone)
        try:
            self.s.reset(z)
            if self.pend_zone == z:
                self.pend_zone = -1
        finally:
            self.n_notes += 1
            self.note_ns += _now_ns() - t0

    def check_summaries(self):
        """Fullscan mode only: rebuild from the history and list the zones whose cached
        summary (or condition / active / empty bookkeeping) differs.  [] when consistent."""
        if not self.fullscan:
            raise RuntimeError("check_summaries() needs fullscan=True (it uses the history)")
        return self.s.check()

    def summary(self, zone):
        """Cached summary of a data zone: dict(W, L, S, D, minh, maxh, anchor, cond, R, free,
        owner, lifetime).  minh/maxh are None without finite data; R see zone_reclaim_epoch."""
        return self.s.summary(self._zone(zone))

    def zone_reclaim_epoch(self, zone):
        """R of a zone: max finite hint written since reset, inf with an anchor, -inf if it
        holds no hinted data (e.g. empty)."""
        return self.s.reclaim(self._zone(zone))

    def empty_zones(self):
        """Number of empty data zones (the GC reserve included)."""
        return self.s.cv.n_empty

    def empty_zone_list(self):
        return self.s.empty_list()

    def active_zones(self):
        """Active data zones (0 < W < C, not finished), ascending."""
        return self.s.active_list()

    def victims(self, n, exclude=()):
        """Up to ``n`` GC victim candidates: full zones and active zones not in ``exclude``
        whose reset would gain space (full: C - L > 0; active: dead bytes W - L > 0), ordered by
        most space gained (greedy: the gain is what the reset frees beyond the copies), then
        least live bytes (copy cost), then *latest* reclaim epoch first (a zone that empties
        soon on its own is the worse victim), then zone index."""
        return self.s.victims(n, exclude)

    def cost(self, zone, size, hint, now):
        """RetainZ cost of placing ``min(size, free)`` bytes with ``hint`` into ``zone``
        (cached summary, this policy's lam / DBT switch)."""
        cdef int z = self._zone(zone)
        cdef int64_t s = size
        cdef int64_t fr = self.s.free_bytes(z)
        return self.p._rz_cost(&self.s.cv, z, s if s < fr else fr, self._hint(hint), float(now))

    def new_zone_cost(self, size, hint, now):
        return self.p._new_cost(size, self._hint(hint), float(now))

    def span_window(self, size, hint, birth, stream=0, save_size=0):
        """Span window a place() with these arguments would use (does not learn the cadence)."""
        return self.st.window(self._hint(hint), float(birth), stream, size, save_size)

    def lifetime_class(self, hint, birth):
        """ZenFS write-lifetime class name of data with this hint and birth."""
        return WLTH_NAMES[self.st.life_class(self._hint(hint), float(birth))]

    def round_hint(self, hint):
        return self._hint(hint)

    @property
    def last_decision(self):
        """What the last successful place() did: kind existing|new|fallback, cost, window,
        lifetime class."""
        return {"zone": self.p.out_zone, "nbytes": self.p.out_nbytes,
                "kind": _KIND_NAMES[self.p.out_kind], "cost": self.p.out_cost,
                "window": self.last_window, "lifetime": WLTH_NAMES[self.last_life]}

    def stats(self):
        """Counters; ``ns`` = total time in place() plus summary upkeep (note_*), in thread CPU
        nanoseconds."""
        return {"policy": self.policy, "fullscan": bool(self.fullscan),
                "places": self.n_places, "place_ns": self.place_ns,
                "notes": self.n_notes, "note_ns": self.note_ns,
                "ns": self.place_ns + self.note_ns,
                "mean_place_us": (self.place_ns / self.n_places / 1000.0) if self.n_places else 0.0,
                "new_zones": self.n_new, "finishes": self.n_finish,
                "fallbacks": self.n_fallback, "nospace": self.n_nospace,
                "active": self.s.cv.n_act, "empty": self.s.cv.n_empty,
                "generations": len(self.st.gen_ids)}
