"""Power cuts that keep the journal's writes and lose the data zones' writes since the last
device flush (``tests/cacheloss.py``), after random sequences of saves (direct, or a temporary
file renamed over the name), deletions and fsyncs, through the ``Store``.

What must hold after the cut, whatever the order the device kept: every name not changed since
the last durable point (an fsync of anything, or a sync: each makes everything before it
durable) reads exactly as then; a name reads only as contents it held since then, or is
missing only if it was deleted or renamed away since; a file written without an fsync may
read as a prefix of what it held (its journal frame outlived its data: the mount drops the
bytes no flush proved, ``MountRecovery.drop_lost_writes``), never one renamed over an older
file (the rename makes its data durable first: ext4's ``auto_da_alloc``); nothing reads EIO,
no zone goes out of service, and the metadata check is clean.  A second kind of cut loses the journal's writes too (what LazyFS
does).
"""
from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from cacheloss import DataCacheLoss
from retainzfs import records as R
from retainzfs.device import create_image, open_device
from retainzfs.errors import FsError
from retainzfs.store import Store

MiB = 1 << 20
ROOT = 1
NAMES = st.sampled_from(["model.pt", "optim.pt", ".metadata", "log"])
SIZES = st.one_of(st.sampled_from([0, 1, 4095, 4096, 4097, 65536, 300_000]),
                  st.integers(0, 200_000))
GONE = None                     # a version of a name: not there


class CutMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="cut")
        self.n = 0
        self.path = self._new_path()
        self.dev = create_image(self.path, 48 * MiB, 1 * MiB, max_open=6, max_active=8)
        Store.format(self.dev)
        self._open_store()
        self.cur: dict[str, bytes] = {}
        self.seed = 0
        self._durable_point()

    def _new_path(self) -> str:
        self.n += 1
        return os.path.join(self.tmp, f"img{self.n}.zns")

    def _open_store(self) -> None:
        self.s = Store(self.dev)
        self.cache = DataCacheLoss(self.path, self.dev, self.s.meta_zones)

    def teardown(self):
        try:
            self.s.flushes.workers.shutdown(wait=True)
            self.dev.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- the model -----------------------------------------------------------------------
    def _durable_point(self) -> None:
        """Everything so far is durable (an fsync of anything, a sync)."""
        self.durable = dict(self.cur)
        self.versions = {n: {v} for n, v in self.cur.items()}
        self.unsynced: set[str] = set()          # written without an fsync since

    def _changed(self, name: str, v) -> None:
        self.versions.setdefault(name, {self.durable.get(name, GONE)}).add(v)

    # --- operations ----------------------------------------------------------------------
    def _write(self, name: str, data: bytes, fsync: bool) -> None:
        s = self.s
        try:
            ino = s.lookup(ROOT, name.encode()).ino
            s.setattr(ino, size=0)
        except FsError:
            ino = s.create(ROOT, name.encode(), 0o644).ino
        s.open(ino)
        try:
            for off in range(0, len(data), 70_000):
                s.write(ino, off, data[off:off + 70_000])
            s.commit(ino, durable=fsync)
        finally:
            s.release(ino)

    @rule(name=NAMES, n=SIZES, fsync=st.booleans(), via_tmp=st.booleans())
    def save(self, name, n, fsync, via_tmp):
        self.seed += 1
        data = random.Random(self.seed).randbytes(n)
        if not via_tmp:
            self._changed(name, b"")               # empty from its create or O_TRUNC on
            self._changed(name, data)
            self._write(name, data, fsync)
            self.cur[name] = data
            if fsync:
                self._durable_point()
            elif data:                             # (an empty file has nothing to lose)
                self.unsynced.add(name)
            return
        tmp = name + ".tmp"
        self._changed(tmp, b"")
        self._changed(tmp, data)
        self._write(tmp, data, fsync)
        self.cur[tmp] = data
        if fsync:
            self._durable_point()
        elif data:
            self.unsynced.add(tmp)
        if name in self.cur and tmp in self.unsynced:
            self._durable_point()                  # replacing: the tmp's data made durable
        self.s.rename(ROOT, tmp.encode(), ROOT, name.encode())
        self._changed(tmp, GONE)
        self._changed(name, data)
        self.cur[name] = self.cur.pop(tmp)
        if tmp in self.unsynced:                     # (the tmp stays: the rename may be lost)
            self.unsynced.add(name)

    @rule(name=NAMES)
    def delete(self, name):
        if name not in self.cur:
            return
        self.s.unlink(ROOT, name.encode())
        self._changed(name, GONE)
        del self.cur[name]

    @rule()
    def sync(self):
        self.s.sync()
        self._durable_point()

    @rule(frames=st.booleans(), lose_journal=st.booleans())
    def power_cut(self, frames, lose_journal):
        s = self.s
        if frames:                           # the periodic flush wrote its frame, no flush yet
            with s.io_lock:
                s.journal_flush_iolocked(sync=False)
        s.flushes.workers.shutdown(wait=True)
        crashed = self._new_path()
        if lose_journal:                     # everything since the last flush lost, in order
            shutil.copyfile(self.cache.flushed_image, crashed)
        else:
            self.cache.crashed_copy(crashed)
        self.dev.close()
        os.unlink(self.path)
        self.path = crashed
        self.dev = open_device(crashed)
        self._open_store()
        s = self.s
        # Bytes the cache lost that no flush covered are dropped at mount (the journal's
        # flush marks tell them from damage): no zone goes out of service, nothing reads EIO,
        # the metadata check is clean.
        assert s.check() == [] and not s.bad_zones, (s.check(), s.bad_zones)
        names = {n.decode() for n, _, _ in s.readdir(ROOT, 0)} - {".", ".."}
        seen: dict[str, bytes] = {}
        for name in names:
            ino = s.lookup(ROOT, name.encode()).ino
            got = s.read(ino, 0, s.getattr(ino).size + 1)
            held = self.versions.get(name, {self.durable.get(name, GONE)})
            # a file written without an fsync since may have lost its tail (cut where the
            # lost bytes began: a prefix of what it held)
            assert got in held or (name in self.unsynced and any(
                v is not GONE and v.startswith(got) for v in held)), \
                f"{name}: {len(got)} bytes it never held"
            seen[name] = got
        for name, v in self.durable.items():
            if name not in names:
                assert GONE in self.versions.get(name, set()), f"{name} lost"
        self.cur = seen
        s.sync()
        self._durable_point()


def test_power_cuts_that_keep_the_journal_and_lose_data():
    run_state_machine_as_test(CutMachine, settings=settings(
        max_examples=int(os.environ.get("RETAINZ_CUT_EXAMPLES", "60")),
        stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def _put(s: Store, name: bytes, data: bytes, fsync: bool = False) -> int:
    """Create ``name`` with ``data``; without ``fsync`` a close: its frame goes out with no
    flush first."""
    ino = s.create(ROOT, name, 0o644).ino
    s.open(ino)
    try:
        s.write(ino, 0, data)
        s.commit(ino, durable=fsync)
    finally:
        s.release(ino)
    return ino


def _new_store(tmp_path) -> tuple:
    """(device, Store, DataCacheLoss) of a fresh 24 MiB image of 1 MiB zones."""
    path = str(tmp_path / "img")
    dev = create_image(path, 24 * MiB, 1 * MiB, max_open=6, max_active=8)
    Store.format(dev)
    s = Store(dev)
    return dev, s, DataCacheLoss(path, dev, s.meta_zones)


def _cut(tmp_path, dev, s: Store, cache: DataCacheLoss) -> tuple:
    """The power cut ``cache`` models, then the mount: (device, Store) of the image it left."""
    s.flushes.workers.shutdown(wait=True)
    crashed = str(tmp_path / "crashed")
    cache.crashed_copy(crashed)
    dev.close()
    dev = open_device(crashed)
    return dev, Store(dev)


@pytest.mark.parametrize("flushed", [False, True])
def test_only_bytes_no_flush_covered_are_dropped(tmp_path, flushed):
    """A file closed without an fsync whose data the cut lost: dropped at mount when no flush
    covered it (the file reads empty, nothing out of service); when a device flush *did*
    cover it (a later frame's FLUSHED record says so), the missing bytes are damage: the zone
    goes out of service and the file reads EIO, as a zone table moved back does."""
    dev, s, cache = _new_store(tmp_path)
    before = cache.snap                    # the data zones with nothing written
    a = random.Random(1).randbytes(200_000)
    ino = _put(s, b"a", a)
    zone = s.inodes[ino].extents.exts[0].zone
    if flushed:
        s.sync()                           # covers a's data and frame; no record says so yet
    _put(s, b"b", b"x" * 5000)             # its frame names the flush (when there was one)
    cache.snap = before                    # the medium lost a's data all the same
    dev, s = _cut(tmp_path, dev, s, cache)
    try:
        ino = s.lookup(ROOT, b"a").ino
        if flushed:
            assert zone in s.bad_zones and "behind committed data" in s.bad_zones[zone]["reason"]
            assert any(f"zone {zone}" in p for p in s.check()), s.check()
            with pytest.raises(FsError) as ei:
                s.read(ino, 0, len(a))
            assert ei.value.errno == errno.EIO
        else:
            assert not s.bad_zones and s.check() == []
            assert s.getattr(ino).size == 0 and s.read(ino, 0, len(a)) == b""
            assert s.lost_writes["files"] == ["/a", "/b"] and s.lost_writes["bytes"] == 205_000
    finally:
        s.flushes.workers.shutdown(wait=True)
        dev.close()


def test_a_zone_reset_the_cache_lost_is_not_read_as_the_new_data():
    """Found by the state machine once a lost write had to be dropped rather than read as
    EIO: a file rewritten (O_TRUNC) without an fsync empties its zone, which is reset (after
    a flush) and written again from offset 0; the cut loses the reset and the new write, so
    the zone holds the old bytes up to a write pointer *past* the new data's end.  Mount
    verifies what no flush covered and drops it (the file reads empty), not EIO."""
    m = CutMachine()
    try:
        m.save(name="optim.pt", n=1, fsync=False, via_tmp=False)
        m.save(name="optim.pt", n=1, fsync=False, via_tmp=False)
        m.power_cut(frames=False, lose_journal=False)     # asserts the model (no EIO)
        assert m.s.lost_writes is not None and m.s.lost_writes["files"] == ["/optim.pt"]
    finally:
        m.teardown()


class _Cut(Exception):
    pass


def test_a_power_cut_inside_a_gc_pass_keeps_every_fsynced_file(tmp_path):
    """GC copies live data out of a victim and writes one frame with their RELOCATE records
    and the victim's ZONE_RESET.  A cut right after that frame reached the medium (before the
    flush after it) must not lose a copy: the copies are flushed first, and the records queued
    after them say so (without that, the mount would drop the copies as never proven, or take
    the zone out of service, and the victim's old bytes are gone by generation)."""
    dev, s, cache = _new_store(tmp_path)
    rnd = random.Random(5)
    files: dict[bytes, bytes] = {}

    def put(name: bytes, n: int) -> None:
        data = rnd.randbytes(n)
        _put(s, name, data, fsync=True)
        files[name] = data                 # acknowledged

    for i in range(40):                    # zones half live, half dead
        put(b"f%d" % i, 300_000)
    for i in range(0, 40, 2):
        s.unlink(ROOT, b"f%d" % i)
        del files[b"f%d" % i]
    s.sync()
    real_commit = s.journal.commit
    cut = []

    def commit(plan, sync=True):           # the reset sequence's frame: written, then the cut
        if sync and plan is not None and s.stats["gc_runs"] and not cut:
            real_commit(plan, sync=False)
            cut.append(True)
            raise _Cut()
        return real_commit(plan, sync)
    s.journal.commit = commit
    with pytest.raises(_Cut):
        for i in range(100):
            put(b"g%d" % i, 300_000)
    assert cut, "no GC pass ran"
    dev, s = _cut(tmp_path, dev, s, cache)
    try:
        assert s.check() == [] and not s.bad_zones, (s.check(), s.bad_zones)
        for name, data in files.items():
            ino = s.lookup(ROOT, name).ino
            assert s.read(ino, 0, len(data) + 1) == data, name
    finally:
        s.flushes.workers.shutdown(wait=True)
        dev.close()


# ---------------------------------------------------------------- overlapping device flushes
def _journal(tmp_path):
    from retainzfs import _journal as J
    from retainzfs.superblock import Superblock
    dev = create_image(str(tmp_path / "j.zns"), 64 * MiB, 4 * MiB)
    sb = Superblock.new(dev, 8, "retainz", 1)
    assert "flush_marks" in sb.features
    jr = J.Journal(dev, sb, lambda: b"")
    jr.format()
    return dev, jr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(ops=["rec", "begin", "rec", "begin", "rec", "end_first", "end_first"], sizes=[30])
@example(ops=["rec", "begin", "rec", "begin", "end_first", "end_first"], sizes=[3])
@given(ops=st.lists(st.sampled_from(["rec", "rec", "begin", "end_first", "end_last", "detach"]),
                    max_size=40), sizes=st.lists(st.integers(1, 70), min_size=1, max_size=8))
def test_overlapping_flushes_put_each_proof_between_records(tmp_path_factory, ops, sizes):
    """Device flushes overlap (an fsync's and GC's, two fsyncs'): each takes a flush point as
    it begins and notes it when done, in any order, while records keep coming and frames are
    detached.  Stop 26 put the proof at the byte offset the point named, which an earlier
    proof had shifted: inside a record, and replay lost the whole frame.  Here: pending always
    decodes, holds every record in order, and each proof sits after exactly the records
    queued before its flush began."""
    from retainzfs import _journal as J
    dev, jr = _journal(tmp_path_factory.mktemp("j"))
    try:
        sent = []                 # records appended this epoch, in order
        open_points = []          # (flush point, records queued when it began)
        want = []                 # records-before counts of the proofs put in this epoch
        k = 0
        for o in ops:
            if o == "rec":
                p = bytes([k % 251]) * sizes[k % len(sizes)]
                jr.append(R.INODE, p)
                sent.append(p)
                k += 1
            elif o == "begin":
                open_points.append((jr.flush_point(), len(sent)))
            elif o in ("end_first", "end_last") and open_points:
                point, before = open_points.pop(0 if o == "end_first" else -1)
                same = point[1] == jr.epoch
                jr.note_flushed(point)
                if same and before:
                    want.append(before)
            elif o == "detach":
                jr.flush()
                sent, want = [], []
            recs = J.decode_records(bytes(jr.pending))          # never inside a record
            assert [p for t, p in recs if t == R.INODE] == sent
            marks, n = [], 0
            for t, p in recs:
                if t == R.INODE:
                    n += 1
                elif t == R.FLUSHED and R.unpack_flushed(p) == R.ALL_BEFORE:
                    marks.append(n)
            assert sorted(marks) == sorted(want)
    finally:
        dev.close()


@settings(max_examples=300, deadline=None)
@given(recs=st.lists(st.tuples(st.sampled_from([R.INODE, R.EXTENT, R.CSUM, R.FLUSHED]),
                               st.binary(min_size=1, max_size=90)), min_size=1, max_size=12),
       cuts=st.lists(st.integers(1, 10 ** 6), min_size=1, max_size=2))
def test_a_frame_with_a_misplaced_proof_is_salvaged_whole(recs, cuts):
    """Frames written by stop 26's journal may hold a FLUSHED(ALL_BEFORE) record inside another
    record (they pass their checksum): replay takes the inserted bytes out again and gets
    every record back, where it dropped the whole frame before."""
    from retainzfs import _journal as J
    mark = J.encode_record(R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))
    body = b"".join(J.encode_record(t, p) for t, p in recs)
    bounds, pos = {0, len(body)}, 0
    for t, p in recs:
        pos += J.REC_HEADER + len(p)
        bounds.add(pos)
    mangled = body
    for c in cuts:
        at = c % (len(mangled) + 1)
        mangled = mangled[:at] + mark + mangled[at:]
    try:
        got = J.decode_records(mangled)
    except ValueError:
        got, what = J.salvage_records(mangled)
        assert got == recs or got == _without_marks(got, recs), what
        assert "decoded whole" in what
        return
    # it decoded: every insertion fell on a boundary (a legitimate record in between)
    assert [x for x in got if x != (R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))] == \
        [x for x in recs if x != (R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))]


def _without_marks(got, recs):
    """``got`` when it equals ``recs`` but for ALL_BEFORE records (one of the inserted marks
    may sit on a boundary and be kept)."""
    a = (R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))
    return got if [x for x in got if x != a] == [x for x in recs if x != a] else None


def _overlapping_flushes(tmp_path) -> tuple[str, dict]:
    """Names are made, flush A begins, more are made, flush B begins, more, A ends, B ends,
    then the log is written and the store closed: (image path, the files' bytes)."""
    import threading
    path = str(tmp_path / "img")
    dev = create_image(path, 24 * MiB, 1 * MiB, max_open=6, max_active=8)
    Store.format(dev)
    s = Store(dev)
    gates = [threading.Event(), threading.Event()]
    entered = [threading.Event(), threading.Event()]
    orig = dev.flush
    calls = [0]

    def slow_flush():
        i = calls[0]
        calls[0] += 1
        if i < 2:
            entered[i].set()
            gates[i].wait(10)
        orig()
    dev.flush = slow_flush
    files = {}

    def put(tag, seed, size):
        """(For "a":) a file with data, whose close writes a frame; then names that only
        queue records (creates, a directory, an xattr: left to the periodic flush, so they
        are still pending when the flushes end)."""
        if tag == "a":
            name = f"{tag}-data".encode()
            files[name] = random.Random(seed).randbytes(size)
            _put(s, name, files[name])
        for i in range(3):
            name = f"{tag}{i}".encode()
            ino = s.create(ROOT, name, 0o644).ino
            s.setxattr(ino, b"user.k", b"v" * (i + 1))
            files[name] = b""
        s.mkdir(ROOT, f"{tag}-dir".encode(), 0o755)
    put("a", 0, 5000)
    ta = threading.Thread(target=s.device_flush)
    ta.start()
    assert entered[0].wait(10)
    put("b", 10, 7000)
    tb = threading.Thread(target=s.device_flush)
    tb.start()
    assert entered[1].wait(10)
    put("c", 20, 9000)
    gates[0].set()
    ta.join(10)
    gates[1].set()
    tb.join(10)
    dev.flush = orig
    s.sync()
    s.close()
    dev.close()
    return path, files


def _read_back(path: str, files: dict) -> list:
    """Open the image, check every file and the store; its metadata problems."""
    dev = open_device(path)
    try:
        s = Store(dev)
        for name, data in files.items():
            ino = s.lookup(ROOT, name).ino
            assert s.read(ino, 0, len(data) + 10) == data, name
        assert s.check() == []
        problems = list(s.meta_problems)
        s.close()
        return problems
    finally:
        dev.close()


def test_two_overlapping_device_flushes_lose_no_files_at_remount(tmp_path):
    """The store-level case (found at 1 run in 5 by
    ``test_store.py::test_parallel_zone_writes_with_deletes_resets_and_gc_keep_every_byte``):
    the frame holding the records queued around two overlapping flushes must replay whole.
    On stop 26's code the remount lost files."""
    path, files = _overlapping_flushes(tmp_path)
    assert _read_back(path, files) == []


def test_a_log_written_by_stop_26_is_salvaged_at_mount(tmp_path, monkeypatch):
    """Images written by stop 26's journal may hold such frames: the mount takes the
    misplaced proof out again, replays every record, says so (``metadata_problems``) and
    rolls a fresh snapshot, after which the next mount has nothing to report."""
    from retainzfs import _journal as J

    def stop26_flush_point(self):
        return self.written(), self.epoch, len(self.pending)

    def stop26_note_flushed(self, point):
        upto, epoch, pos = point if isinstance(point, tuple) else (point, -1, 0)
        if upto > self.flushed:
            self.flushed = upto
        if self.marks and pos and epoch == self.epoch:
            self.pending[pos:pos] = J.encode_record(R.FLUSHED, R.pack_flushed(R.ALL_BEFORE))
            self._all_marked = True
    with monkeypatch.context() as mp:
        mp.setattr(J.Journal, "flush_point", stop26_flush_point)
        mp.setattr(J.Journal, "note_flushed", stop26_note_flushed)
        path, files = _overlapping_flushes(tmp_path)
    problems = _read_back(path, files)
    assert len(problems) == 1 and "decoded whole" in problems[0], problems
    assert _read_back(path, files) == []
