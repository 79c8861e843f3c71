"""Power cuts that keep the journal's writes and lose the data zones' writes since the last
device flush (``tests/cacheloss.py``), after random sequences of saves (direct, or a temporary
file renamed over the name), deletions and fsyncs, through the ``Store``.

What must hold after the cut, whatever the order the device kept: every name not changed since
the last durable point (an fsync of anything, or a sync: each makes everything before it
durable) reads exactly as then; a name reads only as contents it held since then, or is
missing only if it was deleted or renamed away since; EIO only for a file written without an
fsync (its journal frame outlived its data), never for one renamed over an older file (the
rename makes its data durable first: ext4's ``auto_da_alloc``); the store mounts and its
metadata check is clean.  A second kind of cut loses the journal's writes too (what LazyFS
does).
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from cacheloss import DataCacheLoss
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
            self.s.files.flusher.shutdown(wait=True)
            self.dev.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- the model -----------------------------------------------------------------------
    def _durable_point(self) -> None:
        """Everything so far is durable (an fsync of anything, a sync)."""
        self.durable = dict(self.cur)
        self.versions = {n: {v} for n, v in self.cur.items()}
        self.eio_ok: set[str] = set()          # written without an fsync since

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
                self.eio_ok.add(name)
            return
        tmp = name + ".tmp"
        self._changed(tmp, b"")
        self._changed(tmp, data)
        self._write(tmp, data, fsync)
        self.cur[tmp] = data
        if fsync:
            self._durable_point()
        elif data:
            self.eio_ok.add(tmp)
        if name in self.cur and tmp in self.eio_ok:
            self._durable_point()                  # replacing: the tmp's data made durable
        self.s.rename(ROOT, tmp.encode(), ROOT, name.encode())
        self._changed(tmp, GONE)
        self._changed(name, data)
        self.cur[name] = self.cur.pop(tmp)
        if tmp in self.eio_ok:                     # (the tmp stays: the rename may be lost)
            self.eio_ok.add(name)

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
        s.files.flusher.shutdown(wait=True)
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
        # a zone whose write pointer is behind committed data (the cache lost a write the
        # journal names) goes out of service until its files are deleted: only then, and
        # only if a file was written without an fsync
        problems = s.check()
        assert all("write pointer" in p and "behind committed data" in p for p in problems), \
            problems
        assert not problems or self.eio_ok, problems
        names = {n.decode() for n, _, _ in s.readdir(ROOT, 0)} - {".", ".."}
        seen: dict[str, bytes] = {}
        for name in names:
            ino = s.lookup(ROOT, name.encode()).ino
            try:
                got = s.read(ino, 0, s.getattr(ino).size + 1)
            except FsError as e:
                assert name in self.eio_ok, f"{name}: {e} (not written without an fsync)"
                s.unlink(ROOT, name.encode())
                continue
            assert got in self.versions.get(name, {self.durable.get(name, GONE)}), \
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
