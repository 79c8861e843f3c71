"""What programs that fsync actually do, then a power cut at once (``-m campaign``: LazyFS).

``os.fsync(f.fileno())`` without ``f.flush()`` is how PyTorch DCP ends each shard and its
``.metadata``: Python's buffer (``st_blksize``: 128 KiB here, 8 KiB on ext4) still holds the
tail, which only the close writes.  A close is durable when its descriptor was fsynced before
(``fs.Operations.flush``), so the file is whole after a power cut right after it; before, a cut
just after ``dcp.save`` returned left ``.metadata.tmp`` empty.  Renames are durable at the next
journal flush (the contract, as ext4's commit interval), so ``.metadata`` may still be under its
temporary name: its bytes are whole either way.  About 30 s on 2 cores.
"""
from __future__ import annotations

import hashlib
import os
import random
import subprocess

import pytest
from conftest import lazyfs_target

pytestmark = pytest.mark.campaign

MiB = 1 << 20


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def cut_target(tmp_path):
    """A retainzfs mount on an image inside LazyFS (the fault campaign's power-cut target)."""
    t = lazyfs_target(tmp_path / "pc", pc_size="1G")
    try:
        t.setup()
        t.mount()
        yield t
    finally:
        t.teardown()


def _cut_and_remount(t) -> None:
    idle = subprocess.Popen(["sleep", "60"])     # crash() stops "the writer" too
    t.crash(idle)                                # STOP, cut, KILL, cut, fusermount -uz
    t.fsck("after the power cut")
    t.mount()


def test_files_fsynced_without_flushing_python_s_buffer_are_whole_after_a_cut(cut_target):
    """Sizes around the Python buffer (128 KiB) and ext4's (8 KiB), written in two pieces
    (the second one small: a tail), ``os.fsync(f.fileno())`` without ``f.flush()``; the files
    are closed after all the fsyncs (as DCP's writer threads do), and the cut follows the
    last close at once.  Fails before the durable close: the files under 128 KiB were empty
    (their bytes were all in Python's buffer at the fsync) and the others short."""
    t = cut_target
    rng = random.Random(7)
    want, files = {}, []
    for size in (1, 3000, 8191, 8193, 58_533, 131_071, 131_072, 131_073, 3 * MiB + 5):
        name = f"f{size}"
        data = rng.randbytes(size)
        f = open(os.path.join(t.mnt, name), "wb")
        f.write(data[:size * 7 // 8])
        f.write(data[size * 7 // 8:])
        os.fsync(f.fileno())
        files.append(f)
        want[name] = hashlib.sha256(data).hexdigest()
    for f in files:
        f.close()
    _cut_and_remount(t)
    got = {n: _sha(os.path.join(t.mnt, n)) for n in want}
    bad = {n: os.path.getsize(os.path.join(t.mnt, n)) for n in want if got[n] != want[n]}
    assert bad == {}, f"not whole after the cut (name: size now): {bad}"


def test_a_dcp_save_is_whole_after_a_cut_right_after_it_returns(cut_target):
    """``torch.distributed.checkpoint.save`` (FileSystemWriter, thread_count 2, sync_files):
    the cut comes as save returns.  Every file it wrote is whole after the remount -- the
    ``.metadata`` perhaps still named ``.metadata.tmp`` (its rename is not fsynced by DCP) --
    and, under its final name, the checkpoint loads bit-exact."""
    try:
        import torch
    except ImportError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"torch is not installed ({e}); scripts/setup.sh installs it")
        pytest.skip(f"torch is not installed ({e})")
    import torch.distributed.checkpoint as dcp
    t = cut_target
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.w": torch.randn(int(torch.randint(10, 9000, (1,), generator=g)),
                                        generator=g) for i in range(300)}
    state["embed"] = torch.randn(3 * MiB // 4, generator=g)
    ck = os.path.join(t.mnt, "step-1")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(ck, thread_count=2))
    want = {n: _sha(os.path.join(ck, n)) for n in os.listdir(ck)}
    assert ".metadata" in want and len(want) >= 3, sorted(want)
    _cut_and_remount(t)
    names = set(os.listdir(ck))
    if ".metadata" not in names and ".metadata.tmp" in names:
        os.rename(os.path.join(ck, ".metadata.tmp"), os.path.join(ck, ".metadata"))
    got = {n: _sha(os.path.join(ck, n)) for n in want if os.path.exists(os.path.join(ck, n))}
    assert got == want, {n: os.path.getsize(os.path.join(ck, n)) for n in os.listdir(ck)}
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(ck))
    assert all(torch.equal(back[k], state[k]) for k in state)


_SQLITE_WRITER = r"""
import os, sqlite3, sys
path, mode, sync = sys.argv[1:4]
c = sqlite3.connect(path, isolation_level=None)
c.execute(f"PRAGMA journal_mode={mode}")
c.execute(f"PRAGMA synchronous={sync}")
c.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v BLOB)")
k = 0
while True:
    c.execute("BEGIN")
    for j in range(5):
        c.execute("INSERT INTO t VALUES (?, ?)", (k * 5 + j, os.urandom(1000 + 700 * j)))
    c.execute("COMMIT")
    k += 1
    print(k, flush=True)
"""


@pytest.mark.parametrize("mode,sync", [("WAL", "FULL"), ("DELETE", "EXTRA")])
def test_sqlite_keeps_every_committed_transaction_across_a_cut(cut_target, mode, sync):
    """SQLite (what Optuna, MLflow and W&B keep their runs in) commits in a loop, its process
    printing each transaction once COMMIT returns; the power cut comes mid-loop.  After the
    remount the database passes ``integrity_check`` and holds every printed transaction.
    (Not ``DELETE`` + ``FULL``: there SQLite itself does not fsync the directory after
    unlinking the journal, and documents that a power cut may roll the last commit back.)"""
    import sqlite3
    import time
    t = cut_target
    db = os.path.join(t.mnt, f"runs-{mode}.db")
    w = subprocess.Popen(["python3", "-c", _SQLITE_WRITER, db, mode, sync],
                         stdout=subprocess.PIPE, text=True)
    time.sleep(4)
    assert w.poll() is None, "the SQLite writer stopped by itself"
    _cut_and_remount(t)
    out = w.stdout.read().split()
    acked = int(out[-1]) if out else 0
    assert acked > 20, f"only {acked} commits before the cut"
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    keys = [r[0] for r in c.execute("SELECT k FROM t ORDER BY k")]
    c.close()
    assert len(keys) >= acked * 5 and keys[:acked * 5] == list(range(acked * 5)), (
        f"{acked} transactions committed, {len(keys) // 5} there after the cut")
