#!/usr/bin/env python3
"""Fault campaign: a checkpointing job on a retainzfs mount, crashed again and again, verified.

    python3 scripts/fault_campaign.py --mode kill|powercut|torn|both --iters N [--pc-iters M]
                                      [--seed S] [--workdir DIR] [--suites PATH] [--json]

What one iteration does
  1. starts a *writer* subprocess (this file, ``_writer``) on the mount.  It saves checkpoint
     generations like a training job: ``run/step-N/`` with 2-5 ``shard-i.distcp`` files of
     random sizes (2 KiB .. --max-file, log-uniform) and a small ``.metadata`` written last,
     each written in mixed chunk sizes, given xattrs (``user.campaign`` set twice, another set
     and removed), then fsync'd, the directory fsync'd; ``latest.txt``
     written to ``.latest.txt.G.tmp``, fsync'd and renamed over, root dir fsync'd; ``rmtree`` of
     generations older than the newest 3 followed by an fsync of ``run/`` (plus unlink of old
     session logs); and a session log ``run/logs/session-K.log`` appended one 64-byte line per
     ``write()`` (fsync every 4-16 lines).  ``run/.retainz`` gives the filesystem the retention
     policy (torchtitan preset, keep_latest=3, latest.txt rolling).
     Contents derive from (seed, generation, name) so any file can be regenerated.
  2. after a random delay, crashes it:
       kill:     kill -9 the daemon, kill -9 the writer, ``fusermount3 -uz``;
       powercut: the image lives in a LazyFS mount (shared/suites/lazyfs.sh):
                 kill -STOP daemon, ``lazyfs.sh cut``, kill -9 daemon and writer, cut again,
                 ``fusermount3 -uz`` (the sequence of shared/suites/README.md).
       torn:     the image in LazyFS as for powercut, but the cut is LazyFS's own torn-write
                 faults, injected through its fifo while the daemon runs: ``torn-seq`` persists
                 only some of the image writes issued since the last fsync (say the 3rd and the
                 6th, not the 1st, 2nd, 4th, 5th: a disk's volatile cache written back out of
                 order) and ``torn-op`` persists some parts of one write (a tear inside a
                 journal frame, a zone-table entry or a data block); LazyFS then kills itself,
                 un-fsync'd bytes are gone, the daemon and writer are killed and LazyFS is
                 restarted.  A fault that does not fire within 5 s (the group of writes was
                 shorter) falls back to the powercut sequence; the summary counts both.
  3. ``retainzfs fsck IMG`` (unmounted) must exit 0; remount; verify (below).  When fsck
     notes the unfinished last flush a crash left in the metadata log (a torn last frame, a
     write pointer past the last frame, a mirror short of its last frames), a clean umount
     after the verify and fsck must then show nothing (the mount repaired it).  In torn mode
     fsck may instead exit 1 naming only zone-table entries torn inside (torn-op tears finer
     than a sector), repaired the same way.

Journal (outside the mount, ``<workdir>/<mode>/journal.txt``): the writer appends one line per
event, written + fsync'd *after* the operation it describes returned:
    G g                 generation g started (its directory may exist, complete or not)
    F rel size sha256   file rel acknowledged (fsync + close returned) with these contents
    P rel size sha256   rel is about to be renamed over with these contents (old or new allowed)
    X rel               deletion of rel (a tree) started: may be partly gone
    D rel               deletion durable (rmtree/unlink + fsync of the parent returned)
    O rel session       session log created;  L rel nbytes: its first nbytes acknowledged

Verification after each remount
  * every acknowledged file present, byte-identical (sha256; latest.txt may also be a pending
    rename's contents); files of a deletion in progress may be absent, but if present intact;
  * every acknowledged checkpoint file has exactly its xattrs (``user.campaign`` with its last
    value, not the removed one); an unacknowledged one ``user.campaign`` with either value or none;
  * every session log at least as long as acknowledged, and *all* its bytes (acknowledged or
    not) the expected lines: no garbage, no zeros;
  * no path whose deletion was durable exists;
  * every other entry on the mount is one the writer may have created, and its contents are a
    prefix of what the writer writes there (unacknowledged data may be short, never wrong);
  * ``retainzfs status --json MNT`` live_bytes == sum of st_size of all regular files (live bytes
    count extent payload bytes, no padding; the writer writes no holes, and a remount leaves
    nothing buffered, so the two must be equal);
    A mismatch names the files whose extents reach past their EOF (read offline before the
    remount); ``--allow-eof-extents`` counts exactly that excess instead of failing (a known
    bug: after a crash an unacknowledged file can keep journaled extents beyond its size);
  * the daemon log has no "Traceback" / "internal error" / "FUSE loop failed".

Time on 2 cores: ~2.5 s per kill iteration, ~3 s per power cut (two LazyFS cuts), plus the
writer's random run time (--delay, default 0.3-2 s): 50 kills + 20 cuts take ~3-3.5 min;
a torn-write iteration ~3-4 s (the fault fires within a few writes of being armed).

State accumulates on one image for the whole run (like a long training job); with
``--fresh-every K`` a new image is formatted every K iterations instead.  At the end: clean
umount, fsck, remount, verify once more, umount.

Exit 1 on any failure; the first failure's details are printed and the workdir (image, journal,
daemon log, fsck outputs) is kept.  On success the workdir is removed unless --keep or --workdir.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEP = 3                 # generations kept by the writer's purge (and the .retainz policy)
CADENCE = 100            # step-N numbering: N = g * CADENCE
LOG_KEEP = 4             # session logs kept
LINE_LEN = 64
POLICY = (b'preset = "torchtitan"\nkeep_latest = 3\ncadence = 100\n'
          b"rolling = '^latest\\.txt$'\n")
BAD_LOG = ("Traceback", "internal error", "FUSE loop failed")


def which(name: str) -> str:
    return shutil.which(name) or name


MKFS, MOUNT, RETAINZFS = which("mkfs.retainzfs"), which("mount.retainzfs"), which("retainzfs")


# ================================================================== deterministic contents

def gen_files(seed: int, g: int, max_file: int) -> list[tuple[str, int]]:
    """(name, size) of generation g's files, in write order (.metadata last, like DCP)."""
    r = random.Random(f"{seed}/gen/{g}")
    out = []
    for i in range(r.randint(2, 5)):
        out.append((f"shard-{i}.distcp", int(math.exp(r.uniform(math.log(2048), math.log(max_file))))))
    out.append((".metadata", r.randint(400, 3000)))
    return out


def file_bytes(seed: int, g: int, name: str, size: int) -> bytes:
    return random.Random(f"{seed}/data/{g}/{name}").randbytes(size)


#: every checkpoint file carries this xattr (set twice, the second value kept, and another
#: set and removed, before its fsync): after a crash an acknowledged file has exactly it, an
#: unacknowledged one it or nothing (XATTR_B records replayed with the file's)
XATTR, XATTR_TMP = "user.campaign", "user.campaign-tmp"


def xattr_value(seed: int, g: int, name: str) -> bytes:
    return f"{seed}/{g}/{name}".encode()


def xattrs_of(path: str) -> dict[str, bytes]:
    return {n: os.getxattr(path, n) for n in os.listxattr(path)}


def latest_bytes(g: int) -> bytes:
    return f"step-{g * CADENCE}\n".encode()


def log_line(session: int, i: int) -> bytes:
    s = f"s{session:05d} line {i:09d} loss={(i * 7919) % 10007 / 1000:.3f}"
    return (s.ljust(LINE_LEN - 1) + "\n").encode()


def log_bytes(session: int, n: int) -> bytes:
    lines = -(-n // LINE_LEN)
    return b"".join(log_line(session, i) for i in range(lines))[:n]


def sha(b) -> str:
    return hashlib.sha256(b).hexdigest()


# ================================================================== the writer (subprocess)

class HostJournal:
    """Append-only record file on the host fs; every line is written and fsync'd."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def rec(self, *fields) -> None:
        os.write(self.fd, (" ".join(map(str, fields)) + "\n").encode())
        os.fsync(self.fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes, rng: random.Random, between=None) -> None:
    mv = memoryview(data)
    pos = 0
    while pos < len(mv):
        n = rng.choice((4096, 12345, 65536, 262144, MiB))
        pos += os.write(fd, mv[pos:pos + n])
        if between is not None and rng.random() < 0.25:
            between()


class SessionLog:
    """Many small writes to one file: one line per write(), fsync every few lines."""

    def __init__(self, mnt: str, rel: str, session: int, jr: HostJournal, rng: random.Random):
        self.rel, self.session, self.jr, self.rng = rel, session, jr, rng
        jr.rec("O", rel, session)
        self.fd = os.open(os.path.join(mnt, rel), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.n = 0
        self.every = rng.randint(4, 16)

    def lines(self, k: int = 1) -> None:
        for _ in range(k):
            line = log_line(self.session, self.n)
            assert os.write(self.fd, line) == len(line)
            self.n += 1
            if self.n % self.every == 0:
                os.fsync(self.fd)
                self.jr.rec("L", self.rel, self.n * LINE_LEN)

    def burst(self, k: int) -> None:
        """k lines (> IOV_MAX = 1024 buffers) without an fsync in between, then fsync."""
        for _ in range(k):
            line = log_line(self.session, self.n)
            assert os.write(self.fd, line) == len(line)
            self.n += 1
        os.fsync(self.fd)
        self.jr.rec("L", self.rel, self.n * LINE_LEN)


def writer_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fault_campaign.py _writer")
    ap.add_argument("--mnt", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--session", type=int, required=True)
    ap.add_argument("--start-gen", type=int, required=True)
    ap.add_argument("--max-file", type=int, default=8 * MiB)
    ap.add_argument("--max-gens", type=int, default=0, help="stop after this many (0: run until killed)")
    a = ap.parse_args(argv)
    mnt, seed = a.mnt, a.seed
    rng = random.Random(f"{seed}/writer/{a.session}")
    jr = HostJournal(a.journal)
    run = os.path.join(mnt, "run")
    os.makedirs(os.path.join(run, "logs"), exist_ok=True)
    fsync_dir(mnt)
    fsync_dir(run)
    # the retention policy (rewritten when a crash left it missing or partial)
    pol = os.path.join(run, ".retainz")
    try:
        with open(pol, "rb") as f:
            have = f.read()
    except FileNotFoundError:
        have = None
    if have != POLICY:
        fd = os.open(pol, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_all(fd, POLICY, rng)
        os.fsync(fd)
        os.close(fd)
        fsync_dir(run)
        jr.rec("F", "run/.retainz", len(POLICY), sha(POLICY))
    # leftovers of a crashed rename: unlink them durably
    for n in sorted(os.listdir(run)):
        if n.startswith(".latest.txt."):
            jr.rec("X", f"run/{n}")
            os.unlink(os.path.join(run, n))
            fsync_dir(run)
            jr.rec("D", f"run/{n}")
    # old session logs
    logs = sorted(n for n in os.listdir(os.path.join(run, "logs")) if n.startswith("session-"))
    for n in logs[:max(0, len(logs) - (LOG_KEEP - 1))]:
        rel = f"run/logs/{n}"
        jr.rec("X", rel)
        os.unlink(os.path.join(mnt, rel))
        fsync_dir(os.path.join(run, "logs"))
        jr.rec("D", rel)
    slog = SessionLog(mnt, f"run/logs/session-{a.session:05d}.log", a.session, jr, rng)
    g = a.start_gen
    done = 0
    while not a.max_gens or done < a.max_gens:
        jr.rec("G", g)
        step = f"step-{g * CADENCE}"
        d = os.path.join(run, step)
        os.mkdir(d)
        slog.lines(rng.randint(1, 4))
        for name, size in gen_files(seed, g, a.max_file):
            data = file_bytes(seed, g, name, size)
            fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            write_all(fd, data, rng, lambda: slog.lines(rng.randint(1, 3)))
            os.setxattr(fd, XATTR, b"first")
            os.setxattr(fd, XATTR_TMP, bytes(rng.randint(0, 300)))
            os.setxattr(fd, XATTR, xattr_value(seed, g, name))
            os.removexattr(fd, XATTR_TMP)
            os.fsync(fd)
            os.close(fd)
            jr.rec("F", f"run/{step}/{name}", size, sha(data))
            slog.lines(rng.randint(1, 3))
        fsync_dir(d)
        # latest.txt: temp + fsync + rename over + dir fsync
        lb = latest_bytes(g)
        tmp = os.path.join(run, f".latest.txt.{g}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, lb)
        os.fsync(fd)
        os.close(fd)
        jr.rec("P", "run/latest.txt", len(lb), sha(lb))
        os.rename(tmp, os.path.join(run, "latest.txt"))
        fsync_dir(run)
        jr.rec("F", "run/latest.txt", len(lb), sha(lb))
        # purge: everything but the newest KEEP generations (partial ones of crashed sessions too)
        steps = sorted(int(m.group(1)) for m in
                       (re.fullmatch(r"step-(\d+)", n) for n in os.listdir(run)) if m)
        for s in steps[:-KEEP]:
            rel = f"run/step-{s}"
            jr.rec("X", rel)
            shutil.rmtree(os.path.join(mnt, rel))
            fsync_dir(run)
            jr.rec("D", rel)
        if rng.random() < 0.15:
            slog.burst(rng.randint(1100, 1400))
        else:
            slog.lines(rng.randint(1, 5))
        g += 1
        done += 1
    os.fsync(slog.fd)
    jr.rec("L", slog.rel, slog.n * LINE_LEN)
    os.close(slog.fd)
    return 0


# ================================================================== expectations from the journal

class Expect:
    def __init__(self):
        self.files: dict[str, tuple[int, str]] = {}
        self.alts: dict[str, list[tuple[int, str]]] = {}
        self.deleting: set[str] = set()
        self.deleted: set[str] = set()
        self.logs: dict[str, list[int]] = {}       # rel -> [session, acknowledged bytes]
        self.gens: set[int] = set()

    @classmethod
    def load(cls, path: str) -> "Expect":
        e = cls()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return e
        lines = data.split(b"\n")
        for raw in lines[:-1]:                      # the last piece has no newline: torn, ignore
            p = raw.decode().split(" ")
            t = p[0]
            if t == "G":
                e.gens.add(int(p[1]))
            elif t == "F":
                e.files[p[1]] = (int(p[2]), p[3])
                e.alts.pop(p[1], None)
            elif t == "P":
                e.alts.setdefault(p[1], []).append((int(p[2]), p[3]))
            elif t == "X":
                e.deleting.add(p[1])
            elif t == "D":
                rel = p[1]
                e.deleting.discard(rel)
                e.deleted.add(rel)
                for k in [k for k in e.files if k == rel or k.startswith(rel + "/")]:
                    del e.files[k]
                for k in [k for k in e.logs if k == rel or k.startswith(rel + "/")]:
                    del e.logs[k]
            elif t == "O":
                e.logs.setdefault(p[1], [int(p[2]), 0])
            elif t == "L":
                e.logs[p[1]][1] = max(e.logs[p[1]][1], int(p[2]))
        return e

    def next_gen(self) -> int:
        return max(self.gens, default=0) + 1

    def next_session(self) -> int:
        return max((s for s, _ in self.logs.values()), default=-1) + 1

    def under(self, rel: str, roots: set[str]) -> bool:
        return any(rel == r or rel.startswith(r + "/") for r in roots)


class Failure(Exception):
    pass


def eof_extents(img: str) -> dict[str, int]:
    """Offline (unmounted): bytes of extents that lie past their file's EOF, per path.

    Diagnostics for the live-bytes check: data a zone holds for a file beyond its size are
    counted as live but can never be read."""
    from retainzfs.cli.main import _open_offline
    try:
        dev, store = _open_offline(img)
    except SystemExit as e:
        raise Failure(f"cannot open {img} offline: {e}") from None
    try:
        out = {}
        for i in store.inodes.values():
            if not i.is_reg or i.nlink == 0:
                continue
            past = sum(e.end - max(e.off, i.size) for e in i.extents if e.end > i.size)
            if past:
                out[store.path_of(i.ino)] = past
        return out
    finally:
        dev.close()


def verify(mnt: str, jpath: str, seed: int, max_file: int, counts: dict,
           eof: dict[str, int] | None = None, allow_eof: bool = False) -> None:
    """Check the mount against the journal; raises Failure with the first problem.

    ``eof``: extents past EOF found offline before this mount (see eof_extents); with
    ``allow_eof`` a live-bytes excess of exactly those bytes is counted, not failed."""
    e = Expect.load(jpath)
    problems: list[str] = []

    def read(rel: str) -> bytes:
        with open(os.path.join(mnt, rel), "rb") as f:
            return f.read()

    checked: set[str] = set()
    # 1. acknowledged files
    for rel, (size, digest) in sorted(e.files.items()):
        optional = e.under(rel, e.deleting)
        path = os.path.join(mnt, rel)
        if not os.path.lexists(path):
            if not optional:
                problems.append(f"acknowledged file {rel} ({size} B) is missing")
            continue
        data = read(rel)
        if (m := re.fullmatch(r"run/step-(\d+)/(.+)", rel)):
            xs = xattrs_of(path)
            want = {XATTR: xattr_value(seed, int(m.group(1)) // CADENCE, m.group(2))}
            if xs != want:
                problems.append(f"acknowledged file {rel}: xattrs {xs}, expected {want}")
        ok = {(size, digest)} | set(e.alts.get(rel, []))
        if (len(data), sha(data)) not in ok:
            problems.append(f"acknowledged file {rel}: {len(data)} B sha {sha(data)[:16]}, expected "
                            f"{size} B sha {digest[:16]}" + (f" or one of {len(ok) - 1} pending"
                                                               if len(ok) > 1 else ""))
        checked.add(rel)
        counts["files_verified"] += 1
        counts["bytes_verified"] += len(data)
    # 2. durable deletions stay deleted
    for rel in sorted(e.deleted):
        if os.path.lexists(os.path.join(mnt, rel)):
            problems.append(f"{rel} was durably deleted but exists again")
        counts["deletions_verified"] += 1
    # 3. session logs: acknowledged prefix, and nothing but expected bytes
    for rel, (session, acked) in sorted(e.logs.items()):
        path = os.path.join(mnt, rel)
        if not os.path.lexists(path):
            if acked and not e.under(rel, e.deleting):
                problems.append(f"log {rel} missing ({acked} B acknowledged)")
            continue
        data = read(rel)
        checked.add(rel)
        if len(data) < acked and not e.under(rel, e.deleting):
            problems.append(f"log {rel}: {len(data)} B < {acked} B acknowledged")
        want = log_bytes(session, len(data))
        if data != want:
            bad = next(i for i in range(len(data)) if data[i] != want[i])
            problems.append(f"log {rel}: wrong byte at {bad} of {len(data)} (acknowledged {acked}): "
                            f"{data[bad:bad + 16]!r} != {want[bad:bad + 16]!r}")
        counts["files_verified"] += 1
        counts["bytes_verified"] += len(data)
    # 4. every other entry must be one the writer may have made, with a prefix of its contents
    total = 0
    nfiles = 0
    for dirpath, dirnames, filenames in os.walk(mnt):
        rdir = os.path.relpath(dirpath, mnt)
        for n in dirnames:
            rel = os.path.normpath(os.path.join(rdir, n))
            m = re.fullmatch(r"run/step-(\d+)", rel)
            if rel in ("run", "run/logs"):
                continue
            if m and int(m.group(1)) % CADENCE == 0 and int(m.group(1)) // CADENCE in e.gens:
                continue
            problems.append(f"unexpected directory {rel}")
        for n in filenames:
            rel = os.path.normpath(os.path.join(rdir, n))
            st = os.lstat(os.path.join(mnt, rel))
            if not os.path.isfile(os.path.join(mnt, rel)) or os.path.islink(os.path.join(mnt, rel)):
                problems.append(f"unexpected non-regular file {rel}")
                continue
            nfiles += 1
            total += st.st_size
            if rel in checked:
                continue
            want = None
            m = re.fullmatch(r"run/step-(\d+)/(.+)", rel)
            if rel == "run/.retainz":
                want = POLICY
            elif rel == "run/latest.txt":
                # never acknowledged yet (else checked above): a pending rename's contents only
                data = read(rel)
                if (len(data), sha(data)) not in set(e.alts.get(rel, [])):
                    problems.append(f"latest.txt {data!r} without an acknowledgement or a pending rename")
                counts["partial_files_verified"] += 1
                continue
            elif (mt := re.fullmatch(r"run/\.latest\.txt\.(\d+)\.tmp", rel)) and int(mt.group(1)) in e.gens:
                want = latest_bytes(int(mt.group(1)))
            elif m and int(m.group(1)) // CADENCE in e.gens:
                g = int(m.group(1)) // CADENCE
                sizes = dict(gen_files(seed, g, max_file))
                if m.group(2) in sizes:
                    want = file_bytes(seed, g, m.group(2), sizes[m.group(2)])
                    xv = xattrs_of(os.path.join(mnt, rel)).get(XATTR)
                    if xv not in (None, b"first", xattr_value(seed, g, m.group(2))):
                        problems.append(f"unacknowledged file {rel}: xattr {XATTR} = {xv!r}")
            if want is None:
                problems.append(f"unexpected file {rel} ({st.st_size} B)")
                continue
            data = read(rel)
            if len(data) > len(want) or data != want[:len(data)]:
                bad = next((i for i in range(min(len(data), len(want))) if data[i] != want[i]),
                           min(len(data), len(want)))
                zeros = data[bad:].count(0) == len(data) - bad
                problems.append(f"unacknowledged file {rel}: {len(data)} B (expected a prefix of "
                                f"{len(want)} B) differs at byte {bad}"
                                + (" (zeros from there on)" if zeros else ""))
            counts["partial_files_verified"] += 1
            counts["bytes_verified"] += len(data)
    # 5. accounting
    st = json.loads(run_cmd([RETAINZFS, "status", "--json", mnt]).stdout)
    eof = eof or {}
    if st["live_bytes"] != total:
        excess = sum(eof.values())
        if allow_eof and st["live_bytes"] == total + excess:
            counts["eof_leak_iterations"] += 1
            counts["eof_leak_bytes"] += excess
        else:
            problems.append(
                f"status live_bytes {st['live_bytes']} != sum of file sizes {total} ({nfiles} "
                f"files; diff {st['live_bytes'] - total:+d})" + (
                    "; extents past EOF (offline, before remount): "
                    + ", ".join(f"{k} +{v} B" for k, v in sorted(eof.items())) if eof else ""))
    if st.get("files") is not None and st["files"] != nfiles:
        problems.append(f"status files {st['files']} != regular files found {nfiles}")
    if problems:
        raise Failure("verification: " + "; ".join(problems[:8])
                      + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


# ================================================================== process / mount helpers

#: fsck's note on the unfinished last flush a crash left in the metadata log (a torn last
#: frame, a write pointer past the last frame, a mirror short of its last frames): exit 0, the
#: next mount drops it (format feature "unmount_marks": damage before a clean unmount's frame is
#: a problem instead).
UNFINISHED = "note: a mount or fsck --repair would drop the unfinished last flush"
#: the one fsck problem torn mode accepts (once, then the mount must have repaired it): a
#: zone-table entry torn inside by ``torn-op``, which splits even a 16-byte write into parts,
#: finer than a disk's sector (the entry reads as corrupt, its zone as full, its data by checksum)
TORN_ENTRY = re.compile(r"metadata: zone table entry \d+ is corrupt")


def run_cmd(argv, check=True, timeout=120, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise Failure(f"{' '.join(map(str, argv))} -> rc={p.returncode}\n{p.stdout}{p.stderr}")
    return p


def is_mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == real for line in f)


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def all_threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):
                    return False
        except OSError:
            pass
    return True


def wait_for(pred, timeout=15.0, interval=0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def daemon_pids(img: str) -> list[int]:
    """Live mount.retainzfs daemons holding img open."""
    from retainzfs.cli.common import daemons_holding
    return daemons_holding(img)


def image_locked(img: str) -> bool:
    import fcntl
    fd = os.open(img, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class Target:
    """One image + mountpoint + daemon, the writer journal and logs (kill or powercut)."""

    def __init__(self, mode: str, wdir: str, args, rng: random.Random):
        self.mode, self.wdir, self.args, self.rng = mode, wdir, args, rng
        self.mnt = os.path.join(wdir, "mnt")
        self.log = os.path.join(wdir, "daemon.log")
        self.log_off = 0
        self.pid: int | None = None
        self.pids: set[int] = set()
        self.lazy = None
        self.journal = os.path.join(wdir, "journal.txt")
        self.failed = False                  # keep a short-path LazyFS root for the post-mortem
        if mode in ("powercut", "torn"):
            fifo = os.path.join(wdir, "faults.fifo")
            root = os.path.join(wdir, "root")
            if "-o" in fifo.lower() or mode == "torn":
                # LazyFS ignores --config-path when the path contains "-o" (case-insensitive:
                # main.cpp takes it for a FUSE option), e.g. pytest's /tmp/pytest-of-root/...;
                # and it reads a fault command in one 100-byte read, so the torn-write faults,
                # which name the image by its backing path, need that path short.
                short = tempfile.mkdtemp(prefix="rzfslazy.")
                fifo = os.path.join(short, "faults.fifo")
                if mode == "torn":
                    root = os.path.join(short, "root")
            self.lazy = {"out": args.suites_out, "root": root,
                         "mnt": os.path.join(wdir, "lazy"), "fifo": fifo}
            self.img = os.path.join(self.lazy["mnt"], "img.zns")
        else:
            self.img = os.path.join(wdir, "img.zns")

    # -- LazyFS --
    def lazyfs(self, *a, timeout=180) -> subprocess.CompletedProcess:
        return run_cmd(["bash", os.path.join(self.args.suites, "lazyfs.sh"), *a], timeout=timeout)

    def cut(self) -> None:
        self.lazyfs("cut", self.lazy["fifo"], "60")

    def setup(self) -> None:
        os.makedirs(self.wdir, exist_ok=True)
        if self.lazy:
            # mkfs on the backing dir before LazyFS serves it (through LazyFS mkfs takes ~15 s)
            if is_mounted(self.lazy["mnt"]):
                raise Failure(f"{self.lazy['mnt']} is already mounted")
            os.makedirs(self.lazy["root"], exist_ok=True)
            run_cmd([MKFS, "--force", "--size", self.args.pc_size or "2G", "--zone-size", "16M",
                     "--max-open", 8, "--max-active", 12, os.path.join(self.lazy["root"], "img.zns")])
            os.sync()
            self.lazyfs("mount", self.lazy["out"], self.lazy["root"], self.lazy["mnt"],
                        self.lazy["fifo"])
        else:
            run_cmd([MKFS, "--force", "--size", self.args.kill_size or "1G", "--zone-size", "4M",
                     "--max-open", 8, "--max-active", 8, self.img])
        for f in (self.journal,):
            if os.path.exists(f):
                os.unlink(f)

    def teardown(self) -> None:
        try:
            if is_mounted(self.mnt):
                subprocess.run(["umount", self.mnt], capture_output=True, timeout=60)
        except Exception:
            pass
        for pid in self.pids | set(daemon_pids(self.img) if os.path.exists(self.img) else []):
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    if not wait_for(lambda: not alive(pid), 20):
                        os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_for(lambda: not alive(pid), 10)
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        if self.lazy and is_mounted(self.lazy["mnt"]):
            subprocess.run(["bash", os.path.join(self.args.suites, "lazyfs.sh"), "umount",
                            self.lazy["mnt"]], capture_output=True, timeout=120)
        if (self.lazy and not self.failed
                and os.path.basename(os.path.dirname(self.lazy["fifo"])).startswith("rzfslazy.")):
            shutil.rmtree(os.path.dirname(self.lazy["fifo"]), ignore_errors=True)

    # -- retainzfs --
    def mount(self) -> None:
        os.makedirs(self.mnt, exist_ok=True)
        run_cmd([MOUNT, self.img, self.mnt, "-o", f"allow_other,log={self.log}"], timeout=120)
        if not is_mounted(self.mnt):
            raise Failure(f"{self.mnt} not mounted after mount.retainzfs returned")
        wait_for(lambda: len(daemon_pids(self.img)) == 1, 10)
        pids = daemon_pids(self.img)
        if len(pids) != 1:
            raise Failure(f"expected one daemon for {self.img}, found {pids}")
        self.pid = pids[0]
        self.pids.add(self.pid)

    def umount(self) -> None:
        run_cmd(["umount", self.mnt], timeout=120)
        pid, self.pid = self.pid, None
        if pid is not None and not wait_for(lambda: not alive(pid), 60):
            raise Failure(f"daemon {pid} still running 60 s after umount")
        if not wait_for(lambda: not image_locked(self.img), 30):
            raise Failure("image still locked after umount")

    def fsck(self, tag: str, torn: bool = False) -> bool:
        """``retainzfs fsck`` must exit 0; True when it noted an unfinished flush a crash left
        (``UNFINISHED``: the caller checks the mount repaired it).  ``torn`` (after a torn-write
        cut): exit 1 is accepted when every problem it names is a zone-table entry torn inside
        (``TORN_ENTRY``); True then too."""
        p = run_cmd([RETAINZFS, "fsck", self.img], check=False, timeout=300)
        out = p.stdout + p.stderr
        with open(os.path.join(self.wdir, "fsck.txt"), "a") as f:
            f.write(f"--- {tag}: rc={p.returncode}\n{out}")
        if p.returncode == 0:
            return UNFINISHED in p.stdout
        probs = [ln for ln in p.stdout.splitlines()
                 if ln.strip() and not ln.startswith("note:") and not ln.startswith(self.img + ":")]
        if torn and p.returncode == 1 and probs and all(TORN_ENTRY.match(ln) for ln in probs):
            return True
        raise Failure(f"retainzfs fsck {self.img} ({tag}) -> rc={p.returncode}:\n{out.strip()}")

    def check_daemon_log(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_off)
                new = f.read().decode(errors="replace")
                self.log_off = f.tell()
        except FileNotFoundError:
            return
        bad = [ln for ln in new.splitlines() if any(b in ln for b in BAD_LOG)]
        if bad:
            raise Failure("daemon log: " + " | ".join(bad[:5]))

    def start_writer(self, session: int, start_gen: int, max_gens: int = 0) -> subprocess.Popen:
        err = open(os.path.join(self.wdir, "writer.err"), "a")
        err.write(f"--- session {session} (start gen {start_gen})\n")
        err.flush()
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_writer", "--mnt", self.mnt,
                              "--journal", self.journal, "--seed", str(self.args.seed),
                              "--session", str(session), "--start-gen", str(start_gen),
                              "--max-file", str(self.args.max_file), "--max-gens", str(max_gens)],
                             stdout=err, stderr=err, stdin=subprocess.DEVNULL)
        err.close()
        return p

    def writer_error(self) -> str:
        try:
            with open(os.path.join(self.wdir, "writer.err")) as f:
                return "".join(f.readlines()[-12:])
        except OSError:
            return ""

    def torn_fault(self) -> str:
        """A random LazyFS torn-write command for the backing image file."""
        rng, back = self.rng, os.path.join(self.lazy["root"], "img.zns")
        if rng.random() < 0.6:
            depth = max(1, self.args.torn_depth)
            persist = sorted(rng.sample(range(1, depth + 1), rng.randint(1, min(3, depth))))
            cmd = (f"lazyfs::torn-seq::op=write::file={back}::"
                   f"persist={','.join(map(str, persist))}")
        else:
            parts = rng.randint(2, 4)
            persist = sorted(rng.sample(range(1, parts + 1), rng.randint(1, parts - 1)))
            cmd = (f"lazyfs::torn-op::file={back}::parts={parts}::"
                   f"persist={','.join(map(str, persist))}")
        if len(cmd) + 1 > 100:               # LazyFS reads a command in one 100-byte read
            raise Failure(f"torn-write fault command over LazyFS's 100 bytes: {cmd}")
        return cmd

    def torn_crash(self, pid: int, writer: subprocess.Popen, counts: dict) -> None:
        """Inject a torn-write fault and wait for LazyFS to kill itself over it; if it does
        not within 5 s, the powercut sequence.  Then kill the daemon and the writer and
        restart LazyFS (a fault left armed would fire in the next iteration)."""
        self.check_daemon_log()                  # what the daemon said before the fault
        with open(self.lazy["fifo"] + ".pid") as f:
            lpid = int(f.read().split()[0])
        cmd = self.torn_fault()
        # LazyFS's fault worker opens the completion fifo for writing before it reads a
        # command: hold it open (as lazyfs.sh cut does) or the command is never read.
        done = os.open(self.lazy["fifo"] + ".done", os.O_RDWR | os.O_NONBLOCK)
        try:
            fd = os.open(self.lazy["fifo"], os.O_WRONLY)
            try:
                os.write(fd, (cmd + "\n").encode())
            finally:
                os.close(fd)
            fired = wait_for(lambda: not alive(lpid), 5.0)
        finally:
            os.close(done)
        if fired:
            counts["torn_fired"] += 1
            counts["torn_kinds"][cmd.split("::")[1]] += 1
        with open(os.path.join(self.wdir, "torn.txt"), "a") as f:
            f.write(f"{cmd} fired={fired}\n")
        self.kill_all(pid, writer, cut=not fired)
        run_cmd(["fusermount3", "-uz", self.mnt], check=False)
        if fired:
            run_cmd(["fusermount3", "-uz", self.lazy["mnt"]], check=False)
        else:
            self.lazyfs("umount", self.lazy["mnt"])
        self.lazyfs("mount", self.lazy["out"], self.lazy["root"], self.lazy["mnt"],
                    self.lazy["fifo"])
        try:                                     # the dead daemon's last words are not checked
            self.log_off = os.path.getsize(self.log)
        except OSError:
            pass

    def kill_all(self, pid: int, writer: subprocess.Popen, cut: bool) -> None:
        """kill -9 the daemon and the writer; ``cut``: the power cut around it (kill -STOP,
        ``lazyfs.sh cut``, the kills, cut again to drop what was still in flight)."""
        if cut:
            os.kill(pid, signal.SIGSTOP)
            if not wait_for(lambda: all_threads_stopped(pid), 10):
                raise Failure(f"daemon {pid} did not stop")
            self.cut()                               # the power cut
        os.kill(pid, signal.SIGKILL)
        if not wait_for(lambda: not alive(pid), 20):
            raise Failure(f"daemon {pid} survived SIGKILL")
        writer.kill()
        writer.wait(30)
        if cut:
            self.cut()                               # drop what was still in flight

    def crash(self, writer: subprocess.Popen, counts: dict | None = None) -> None:
        pid = self.pid
        self.pid = None
        if self.mode == "torn":
            self.torn_crash(pid, writer, counts if counts is not None else _torn_counts())
            return
        self.kill_all(pid, writer, cut=self.mode == "powercut")
        run_cmd(["fusermount3", "-uz", self.mnt], check=False)
        if not wait_for(lambda: not image_locked(self.img), 30):
            raise Failure("image still locked after the daemon died")


# ================================================================== the campaign

def _torn_counts() -> dict:
    return {"torn_fired": 0, "torn_kinds": {"torn-seq": 0, "torn-op": 0}}


def retire(t: Target, counts: dict) -> None:
    """Tear a target down and add its journal's totals to the counts."""
    t.teardown()
    try:
        with open(t.journal) as f:
            recs = [ln.split(" ", 1)[0] for ln in f if ln.endswith("\n")]
    except OSError:
        return
    counts["distinct_acked_files"] += recs.count("F")
    counts["distinct_durable_deletions"] += recs.count("D")
    counts["generations_started"] += recs.count("G")


def campaign(mode: str, iters: int, args, counts: dict, log) -> None:
    rng = random.Random(f"{args.seed}/{mode}")
    base = os.path.join(args.workdir, mode)
    t = None
    image_no = 0
    try:
        it = 0
        while it < iters:
            if t is None or (args.fresh_every and it and it % args.fresh_every == 0):
                if t is not None:
                    t.umount()
                    t.fsck("before fresh image")
                    retire(t, counts)
                    t = None
                image_no += 1
                t = Target(mode, base if image_no == 1 else f"{base}-{image_no}", args, rng)
                t.setup()
                t.mount()
            e = Expect.load(t.journal)
            delay = rng.uniform(0.0, 0.3) if rng.random() < 0.1 else rng.uniform(*args.delay)
            w = t.start_writer(e.next_session(), e.next_gen())
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and w.poll() is None:
                time.sleep(0.01)
            if w.poll() is not None:
                t.crash(w)
                raise Failure(f"writer exited by itself (rc={w.returncode}) before the crash:\n"
                              f"{t.writer_error()}")
            t.crash(w, counts)
            counts["kills" if mode == "kill" else "power_cuts"] += 1
            noted = t.fsck(f"iteration {it} after {'kill' if mode == 'kill' else 'power cut'}",
                           torn=mode == "torn")
            eof = eof_extents(t.img)
            t.mount()
            verify(t.mnt, t.journal, args.seed, args.max_file, counts, eof, args.allow_eof_extents)
            t.check_daemon_log()
            if noted:                    # the mount must have repaired what fsck named
                counts["fsck_unfinished"] += 1
                t.umount()
                if t.fsck(f"iteration {it}: after the mount that followed an unfinished flush"):
                    raise Failure(f"iteration {it}: fsck still notes an unfinished flush after "
                                  f"a mount and a clean umount")
                t.mount()
            counts["iterations"] += 1
            it += 1
            e = Expect.load(t.journal)
            log(f"{mode} {it}/{iters}: crash at {delay:.2f}s, gens {len(e.gens)}, "
                f"acked files {len(e.files)}, deletions {len(e.deleted)}, "
                f"verified {counts['files_verified']} files / {counts['bytes_verified'] / MiB:.0f} MiB")
        # the end: a clean umount must leave a clean image, and a remount the same data
        t.umount()
        t.fsck("final clean umount")
        t.mount()
        w = t.start_writer(Expect.load(t.journal).next_session(), Expect.load(t.journal).next_gen(),
                           max_gens=2)
        if w.wait(300) != 0:
            raise Failure(f"final writer failed (rc={w.returncode}):\n{t.writer_error()}")
        t.umount()
        t.fsck("after final writer")
        eof = eof_extents(t.img)
        t.mount()
        verify(t.mnt, t.journal, args.seed, args.max_file, counts, eof, args.allow_eof_extents)
        t.check_daemon_log()
        t.umount()
        t.fsck("final")
    except Exception as ex:
        counts["failures"] += 1
        if not isinstance(ex, Failure):
            import traceback
            ex = "campaign error: " + "".join(traceback.format_exception(ex)).strip()
        msg = f"{mode} iteration {counts['iterations'] + 1}: {ex}"
        if t is not None:
            try:
                with open(t.log, errors="replace") as f:
                    tail = f.readlines()[-25:]
                msg += "\n  daemon log tail (" + t.log + "):\n    " + "    ".join(tail)
            except OSError:
                pass
            msg += f"\n  image kept: {t.img}" + (f" (backing file {t.lazy['root']}/img.zns)"
                                                  if t.lazy else "")
            msg += f"\n  journal: {t.journal}"
        counts.setdefault("first_failure", msg)
        if t is not None:
            t.failed = True
    finally:
        if t is not None:
            retire(t, counts)


def ensure_lazyfs(args) -> None:
    lazy = os.path.join(args.suites_out, "lazyfs", "lazyfs", "build", "lazyfs")
    if not os.path.exists(os.path.join(args.suites, "lazyfs.sh")):
        raise SystemExit(f"fault_campaign: no LazyFS helper in {args.suites} (--suites)")
    if not os.access(lazy, os.X_OK):
        p = subprocess.run(["bash", os.path.join(args.suites, "build.sh"), args.suites_out],
                           capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not os.access(lazy, os.X_OK):
            raise SystemExit(f"fault_campaign: building LazyFS failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_writer"]:
        return writer_main(argv[1:])
    ap = argparse.ArgumentParser(description="kill -9 / power-cut campaign against a retainzfs mount "
                                             "(see the module docstring)")
    ap.add_argument("--mode", choices=("kill", "powercut", "torn", "both"), default="kill")
    ap.add_argument("--iters", type=int, default=20, help="iterations (per mode)")
    ap.add_argument("--pc-iters", type=int, default=None,
                    help="power-cut iterations with --mode both (default: --iters)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="kept afterwards (default: a temp dir, removed on success)")
    ap.add_argument("--suites", default=os.path.join(os.path.dirname(REPO), "shared", "suites"))
    ap.add_argument("--suites-out", default=os.environ.get("RETAINZFS_SUITES_CACHE", "/tmp/retainzfs-suites"),
                    help="build dir of the suites (LazyFS binary cache)")
    ap.add_argument("--max-file", type=lambda s: int(float(s.rstrip("Mm")) * MiB) if s[-1] in "Mm"
                    else int(s), default=8 * MiB, help="largest shard (bytes or NM)")
    ap.add_argument("--delay", type=lambda s: tuple(map(float, s.split(","))), default=(0.3, 2.0),
                    help="MIN,MAX seconds between writer start and the crash")
    ap.add_argument("--kill-size", default=None, help="image size in kill mode (default 1G; 4M zones)")
    ap.add_argument("--pc-size", default=None,
                    help="image size in powercut and torn modes (default 2G; 16M zones)")
    ap.add_argument("--torn-depth", type=int, default=8,
                    help="torn mode: torn-seq keeps writes among the first N since the last fsync "
                         "(larger reaches the journal frames after a big shard's data, and fires "
                         "less often: a shorter group falls back to a plain cut)")
    ap.add_argument("--fresh-every", type=int, default=0,
                    help="format a fresh image every K iterations (0: one image for the whole run)")
    ap.add_argument("--allow-eof-extents", action="store_true",
                    help="known bug: after a crash an unacknowledged file may keep extents past its "
                         "EOF (counted live, never readable); count such iterations instead of failing")
    ap.add_argument("--keep", action="store_true", help="keep the workdir on success")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-iteration lines")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("fault_campaign: needs root (FUSE allow_other, umount)", file=sys.stderr)
        return 2
    modes = ["kill", "powercut"] if args.mode == "both" else [args.mode]
    if "powercut" in modes or "torn" in modes:
        ensure_lazyfs(args)
    made_tmp = args.workdir is None
    args.workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="retainzfs-campaign-"))
    os.makedirs(args.workdir, exist_ok=True)
    counts = {"iterations": 0, "kills": 0, "power_cuts": 0, "files_verified": 0,
              "partial_files_verified": 0, "bytes_verified": 0, "deletions_verified": 0,
              "distinct_acked_files": 0, "distinct_durable_deletions": 0, "generations_started": 0,
              "eof_leak_iterations": 0, "eof_leak_bytes": 0, "failures": 0, "fsck_unfinished": 0,
              **_torn_counts()}
    t0 = time.monotonic()

    def log(msg):
        if not args.quiet:
            print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    for m in modes:
        n = args.pc_iters if (m != "kill" and args.pc_iters is not None) else args.iters
        campaign(m, n, args, counts, log)
    counts["seconds"] = round(time.monotonic() - t0, 1)
    counts["workdir"] = args.workdir
    if args.json:
        print(json.dumps(counts))
    else:
        print(f"fault campaign ({args.mode}, seed {args.seed}): {counts['iterations']} iterations, "
              f"{counts['kills']} kills, {counts['power_cuts']} power cuts, "
              f"{counts['files_verified']} files verified (+{counts['partial_files_verified']} "
              f"unacknowledged), {counts['bytes_verified']} bytes verified, "
              f"{counts['deletions_verified']} deletions verified "
              f"({counts['distinct_acked_files']} files acknowledged, "
              f"{counts['distinct_durable_deletions']} durable deletions, "
              f"{counts['generations_started']} generations), "
              + (f"{counts['eof_leak_iterations']} iterations with extents past EOF "
                 f"({counts['eof_leak_bytes']} B, tolerated), " if counts['eof_leak_iterations'] else "")
              + (f"{counts['torn_fired']} torn-write faults fired ({counts['torn_kinds']}), "
                 if args.mode == "torn" else "")
              + f"fsck noted an unfinished flush {counts['fsck_unfinished']} times (each "
                f"repaired by the mount), "
              + f"{counts['failures']} failures, {counts['seconds']} s")
    if counts["failures"]:
        with open(os.path.join(args.workdir, "FAILURE.txt"), "w") as f:
            f.write(counts["first_failure"] + "\n")
        print("FIRST FAILURE: " + counts["first_failure"], file=sys.stderr)
        print(f"workdir kept: {args.workdir}", file=sys.stderr)
        return 1
    if made_tmp and not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
