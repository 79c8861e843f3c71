"""The memory a mount daemon may use, and its buffers sized to fit.

Why: the daemon's buffers were sized for a machine, not for the container it runs in.  Under
a 256 MiB cgroup limit (a common pod limit for a storage sidecar), 16 writers and 8 readers
took it past the limit in 0.7 s: the kernel's OOM killer ended it, the mount answered
ENOTCONN to every process, and what it had buffered was gone.  Its memory is mostly four
bounded pools, each sized here from the limit: write buffers (``dirty_bytes``), readahead
windows (``readahead_files`` files x (``AHEAD`` + 1) windows), the FUSE worker threads' request
buffers (``fuse_threads`` x 1 MiB) and the freed aligned buffers kept for reuse
(``pool_bytes``).  At a limit of ``FULL`` or more (or none) every size is the default.

The limit is the smallest of the host's memory and the memory limits of the daemon's cgroup
and its ancestors (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``).  Pure functions
over a root directory, so the tests give them made-up cgroup trees.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from .readahead import AHEAD, MAX_FILES, WINDOW
from .store import DIRTY_BYTES

MiB = 1 << 20
#: the daemon's own at least: the interpreter and its modules (``mount`` measures what it holds
#: once the metadata is loaded, ~1.3 KiB a file, and takes the larger, plus ``GROWTH``)
BASE = 48 * MiB
#: room for the metadata of files created after the mount
GROWTH = 16 * MiB
#: a limit at or above this leaves every default as it is
FULL = 1 << 30
#: below this the daemon is likely to be killed under load whatever it sizes: said at mount
TIGHT = 128 * MiB
DIRTY_MAX = DIRTY_BYTES
READAHEAD_FILE = (AHEAD + 1) * WINDOW      # one file's windows, the one being served too
READAHEAD_FILES = MAX_FILES
THREADS_MAX = 64               # ``fs.serve``'s default
THREAD_BYTES = 1 * MiB         # a worker's request buffer (max_write + header)
POOL_MAX = 96 * MiB            # what the pool keeps of the 1 MiB class alone (``_iobuf``)


@dataclass(frozen=True)
class Budget:
    limit: int | None       # bytes, None when nothing limits the daemon below FULL
    source: str             # where the limit comes from ("cgroup /x", "host", "none")
    base: int               # bytes counted as the daemon's own (at least BASE)
    dirty_bytes: int
    readahead_files: int
    fuse_threads: int
    pool_bytes: int | None  # None: the pool's own bounds per size class (no limit applies)

    def as_dict(self) -> dict:
        return asdict(self)


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def plan(limit: int | None, source: str = "none", base: int = BASE) -> Budget:
    """The buffer sizes for a daemon limited to ``limit`` bytes that holds ``base`` bytes of
    its own: of what is left, 30% for write buffers, 20% for readahead, 20% for FUSE threads,
    10% for the pool; the rest is slack for what no pool bounds (request objects, malloc's
    arenas)."""
    base = max(base, BASE)
    if limit is None or limit >= FULL:
        return Budget(limit, source, base, DIRTY_MAX, READAHEAD_FILES, THREADS_MAX, None)
    spare = max(0, limit - base)
    return Budget(limit, source, base,
                  dirty_bytes=_clamp(spare * 3 // 10 // MiB * MiB, 4 * MiB, DIRTY_MAX),
                  readahead_files=_clamp(spare // 5 // READAHEAD_FILE, 1, READAHEAD_FILES),
                  fuse_threads=_clamp(spare // 5 // THREAD_BYTES, 8, THREADS_MAX),
                  pool_bytes=_clamp(spare // 10, 4 * MiB, POOL_MAX))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _limit_value(text: str | None) -> int | None:
    """A cgroup file's limit: None for "max", a v1 "no limit" (near 2^63) or garbage."""
    if text is None or not text.isdigit():
        return None
    v = int(text)
    return v if v < 1 << 60 else None


def cgroup_limit(root: str = "/") -> tuple[int, str] | None:
    """The smallest memory limit on the path of this process's cgroup, v2 or v1, with the
    cgroup that sets it; None when no cgroup on the path has one."""
    text = _read(os.path.join(root, "proc/self/cgroup")) or ""
    found: list[tuple[int, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                                  # v2 (unified)
            base, name = os.path.join(root, "sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):               # v1
            base, name = os.path.join(root, "sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        p = path
        while True:
            v = _limit_value(_read(os.path.join(base, p.lstrip("/"), name)))
            if v is not None:
                found.append((v, p))
            if p in ("/", ""):
                break
            p = os.path.dirname(p)
    return min(found) if found else None


def host_memory(root: str = "/") -> int | None:
    for line in (_read(os.path.join(root, "proc/meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def resident() -> int:
    """This process's resident memory now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def detect(root: str = "/", base: int = BASE) -> Budget:
    """The budget of a daemon in this process's cgroup that holds ``base`` bytes itself."""
    best: tuple[int, str] | None = None
    cg = cgroup_limit(root)
    if cg is not None:
        best = (cg[0], f"cgroup {cg[1]}")
    host = host_memory(root)
    if host is not None and (best is None or host < best[0]):
        best = (host, "host memory")
    return plan(*best, base=base) if best else plan(None)
