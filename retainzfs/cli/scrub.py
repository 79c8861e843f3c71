"""`retainzfs scrub [--json] MOUNTPOINT|TARGET`: verify every live byte against its checksum.

* On a mount (or a directory below one): every regular file is read through the mount in 4 MiB
  reads (no symlinks followed, hard links once), after dropping its cached pages so the bytes
  come from the device and pass the daemon's CRC32C check.  A file whose read fails (EIO: a
  checksum mismatch or a zone out of service) is listed with the offset of its first bad read.
* On an unmounted image or device: opened read-only (nothing is written) and every live extent
  is verified by ``Store.scrub``; errors also name the zone.

Exit status 0 when everything verified, 1 when any error was found (or acknowledged metadata
is missing, ``metadata_corrupt``); a wrong path is one line on stderr.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import sys
import time


from .common import die, find_mount_of, mount_root, status_from_mount

READ = 4 << 20


def add_scrub_args(p) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.add_argument("path", help="mountpoint (or a directory on a mount), or unmounted device/image")


def _mount_root(path: str) -> str | None:
    return mount_root(path)


def _bar(total: int, enabled: bool, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)


def _walk(top: str) -> tuple[list[tuple[str, int]], list[dict]]:
    """Regular files below ``top`` (each inode once) and the directories that could not be
    listed."""
    files, errors, seen = [], [], set()

    def onerror(e: OSError) -> None:
        if e.errno != errno.ENOENT:             # removed while we walked: not an error
            errors.append({"path": e.filename, "offset": None, "zone": None,
                           "error": e.strerror or str(e)})

    for d, _dirs, names in os.walk(top, onerror=onerror, followlinks=False):
        for n in sorted(names):
            p = os.path.join(d, n)
            try:
                st = os.lstat(p)
            except OSError as e:
                onerror(e)
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                files.append((p, min(st.st_size, st.st_blocks * 512)))   # (bytes held)
    return files, errors


def _read_file(path: str, bar) -> tuple[int, dict | None]:
    """Bytes read and the first error (offset of the first failed read), or None."""
    first = None
    done = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ENOENT:
            return 0, None
        return 0, {"offset": 0, "error": e.strerror or str(e)}
    try:
        try:        # cached pages would be served without reaching the daemon's checksum
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        for off, end in _data_ranges(fd, os.fstat(fd).st_size):
            while off < end:
                n = min(READ, end - off)
                try:
                    b = os.pread(fd, n, off)
                except OSError as e:
                    if first is None:
                        first = {"offset": off, "error": e.strerror or str(e)}
                    bar.update(n)
                    off += n                   # the rest of the file is still verified
                    continue
                if not b:
                    return done, first
                done += len(b)
                bar.update(len(b))
                off += len(b)
    finally:
        os.close(fd)
    return done, first


def _data_ranges(fd: int, size: int):
    """(start, end) of each run of a file's data (SEEK_DATA / SEEK_HOLE): holes hold no
    checksummed bytes, and reading them took as long as data (a file made with ``truncate -s
    1T`` kept scrub reading zeros for hours).  The whole file where lseek cannot tell."""
    off = 0
    while off < size:
        try:
            lo = os.lseek(fd, off, os.SEEK_DATA)
            hi = os.lseek(fd, lo, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:         # no data after off
                return
            yield off, size
            return
        if hi <= lo:
            yield lo, size
            return
        yield lo, min(hi, size)
        off = hi


def scrub_mount(root: str, top: str, progress: bool) -> dict:
    t0 = time.monotonic()
    files, errors = _walk(top)
    nbytes = 0
    bar = _bar(sum(s for _, s in files), progress, "scrub")
    try:
        for p, _size in files:
            n, err = _read_file(p, bar)
            nbytes += n
            if err is not None:
                errors.append({"path": "/" + os.path.relpath(p, root), "offset": err["offset"],
                               "zone": None, "error": err["error"]})
    finally:
        bar.close()
    st = status_from_mount(root)
    return {"target": root, "mode": "mount", "bytes_verified": nbytes, "files": len(files),
            "extents": None, "errors": errors,
            "files_affected": sorted({e["path"] for e in errors if e["path"]}),
            "checksum_errors": st.get("checksum_errors", 0),
            "metadata_problems": st.get("metadata_problems") or [],
            "metadata_corrupt": st.get("metadata_corrupt"),
            "seconds": round(time.monotonic() - t0, 3)}


def scrub_offline(target: str, progress: bool) -> dict:
    import logging
    from .main import _open_offline
    t0 = time.monotonic()
    lg = logging.getLogger("retainzfs")
    if not lg.handlers:              # the report lists every error; no stray log lines
        lg.addHandler(logging.NullHandler())
    dev, store = _open_offline(target)
    try:
        with store.lock:
            total = sum(e.length for i in store.inodes.values() if i.is_reg for e in i.extents)
        bar = _bar(total, progress, "scrub")
        try:
            r = store.scrub(bar.update)
        finally:
            bar.close()
        st = store.status()
    finally:
        dev.close()
    return {"target": target, "mode": "offline", "bytes_verified": r["bytes"],
            "files": st["files"], "extents": r["extents"],
            "errors": [{"path": e["path"], "offset": e["offset"], "zone": e["zone"],
                        "error": e["error"]} for e in r["errors"]],
            "files_affected": list(r["files_affected"]),
            "checksum_errors": st.get("checksum_errors", 0),
            "metadata_problems": st.get("metadata_problems") or [],
            "metadata_corrupt": st.get("metadata_corrupt"),
            "seconds": round(time.monotonic() - t0, 3)}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run_scrub(args) -> int:
    path = args.path
    progress = not args.json and sys.stderr.isatty()
    if os.path.isdir(path):
        root = _mount_root(path)
        if root is None:
            die(f"{path} is not on a retainzfs mount")
        rep = scrub_mount(root, path, progress)
    else:
        mnt = find_mount_of(path)
        if mnt:
            rep = scrub_mount(mnt, mnt, progress)
        elif not os.path.exists(path):
            die(f"{path}: no such mountpoint, device or image")
        else:
            rep = scrub_offline(path, progress)
    bad = bool(rep["errors"]) or bool(rep["metadata_corrupt"])
    if args.json:
        print(json.dumps(rep, indent=2))
        return 1 if bad else 0
    for e in rep["errors"]:
        where = f"offset {e['offset']}" if e["offset"] is not None else "listing"
        if e["zone"] is not None:
            where += f", zone {e['zone']}"
        print(f"{e['path']}: {where}: {e['error']}")
    if rep["metadata_corrupt"]:
        print(f"metadata: {rep['metadata_corrupt']}")
    ext = f", {rep['extents']} extents" if rep["extents"] is not None else ""
    print(f"{rep['target']}: {_human(rep['bytes_verified'])} verified in {rep['files']} files"
          f"{ext}; {len(rep['errors'])} errors, {len(rep['files_affected'])} files affected; "
          f"checksum_errors {rep['checksum_errors']}")
    return 1 if bad else 0
