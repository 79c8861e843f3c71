"""`retainzfs hints PATH`: per checkpoint generation, the birth, the reclaim hint, where the hint
came from, and the zones its data landed in -- so a user can check that the filesystem understood
their job's layout and retention without reading code.

A *generation* is a directory or file below PATH that either carries hint xattrs itself
(`retainzfs.runtime.tag_generation`) or whose name matches the generation pattern of the nearest
`.retainz` policy (its preset or `generation` regex).  Other regular files (e.g. Megatron's
`latest_checkpointed_iteration.txt`) and symlinks (Lightning's `last.ckpt`) are listed too.
Everything comes from the mount's virtual xattrs (`user.retainz.hint`, `user.retainz.zones`), so
this is exactly what the placement used; a generation with no data yet is predicted by the same
:class:`retainzfs.hints.HintResolver` the store uses, walking the mount's paths.
"""
from __future__ import annotations

import errno
import json
import math
import os

import xattr
import stat

from .. import hints as H
from ..namespace import show_name
from .common import die, mount_root

X_HINT = H.XATTR_HINT.decode()
X_ZONES = H.XATTR_ZONES.decode()


def add_hints_args(p) -> None:
    p.add_argument("path", help="a directory (or file) on a retainzfs mount")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _mount_root(path: str) -> str | None:
    return mount_root(path)


def _getx(path: str, name: str) -> bytes | None:
    try:
        return xattr.getxattr(path, name, symlink=True)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOENT):
            return None
        raise


class _Policies:
    """Nearest `.retainz` of a directory (parsed, cached); malformed ones are reported."""

    def __init__(self, root: str):
        self.root = root
        self.cache: dict[str, tuple[str, H.Policy] | None] = {}
        self.mine: dict[str, H.Policy | None] = {}
        self.found: dict[str, dict] = {}

    def own(self, d: str) -> H.Policy | None:
        """The valid `.retainz` in directory ``d`` itself."""
        d = os.path.realpath(d)
        if d in self.mine:
            return self.mine[d]
        pol = None
        f = os.path.join(d, H.POLICY_NAME.decode())
        if os.path.isfile(f):
            try:
                with open(f, "rb") as fh:
                    pol = H.parse_policy(fh.read())
                self.found[d] = {"preset": pol.preset, "keep_latest": pol.keep_latest,
                                 "cadence": pol.cadence, "generation": pol.generation,
                                 "milestone_every": pol.milestone_every, "rolling": pol.rolling,
                                 "stream": pol.stream}
            except (OSError, H.HintError) as e:
                self.found[d] = {"error": str(e)}
        self.mine[d] = pol
        return pol

    def of(self, d: str) -> tuple[str, H.Policy] | None:
        """The nearest valid `.retainz` at or above ``d``: (its directory, the policy)."""
        d = os.path.realpath(d)
        if d in self.cache:
            return self.cache[d]
        pol = self.own(d)
        res = (d, pol) if pol is not None else None
        if res is None and d != self.root and d.startswith(self.root):
            res = self.of(os.path.dirname(d))
        self.cache[d] = res
        return res


class _PathTree(H.HintResolver):
    """The store's hint resolution (:class:`retainzfs.hints.HintResolver`) over the paths of a
    mount: the same rules, so a prediction is what the store will place with."""

    def __init__(self, root: str, pols: _Policies):
        self.root = root
        self.pols = pols
        self.listing: dict[str, list[str]] = {}

    def parent(self, p: str) -> str | None:
        if p == self.root or not p.startswith(self.root):
            return None
        return os.path.dirname(p)

    def name(self, p: str) -> str:
        return os.path.basename(p)

    def xattrs(self, p: str) -> dict:
        out = {}
        for x in H.HINT_XATTRS:
            v = _getx(p, x.decode())
            if v is not None:
                out[x] = v
        return out

    def policy(self, d: str) -> H.Policy | None:
        return self.pols.own(d)

    def entry_names(self, d: str) -> list[str]:
        if d not in self.listing:
            try:
                self.listing[d] = os.listdir(d)
            except OSError:
                self.listing[d] = []
        return self.listing[d]

    def dir_id(self, d: str) -> int:
        return os.stat(d).st_ino          # the store's inode number (the FUSE st_ino)


def _show(path: str) -> str:
    """A path walked here (``os.fsdecode``'s spelling) as the daemon spells the names it
    reports (``hint_from``, ``scrub``, the log): bytes that are not UTF-8 as ``\\xNN``."""
    return show_name(os.fsencode(path))


def _hint_row(h: H.Hint) -> dict:
    return {"birth": h.birth, "reclaim": "inf" if h.anchor else int(h.reclaim),
            "stream": h.stream, "source": h.source}


def _xattr_hint(tree: _PathTree, path: str) -> dict | None:
    try:
        h = H.hint_from_xattrs(tree.xattrs(path))
    except H.HintError:
        return None
    return _hint_row(h) if h is not None else None


def _file_info(path: str) -> tuple[dict | None, list[int], int]:
    raw = _getx(path, X_HINT)
    hint = json.loads(raw) if raw else None
    if hint is not None and isinstance(hint.get("reclaim"), float) and hint["reclaim"].is_integer():
        hint["reclaim"] = int(hint["reclaim"])
    zraw = _getx(path, X_ZONES)
    zones = [int(z) for z in zraw.decode().split(",") if z.strip()] if zraw else []
    return hint, zones, os.lstat(path).st_size


def _files_below(path: str) -> list[str]:
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return [path]
    out = []
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for f in sorted(filenames):
                p = os.path.join(dirpath, f)
                if stat.S_ISREG(os.lstat(p).st_mode):
                    out.append(p)
    return out


def _fmt_epoch(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return str(v)


def _row(path: str, rel: str, kind: str, predicted: dict | None) -> dict:
    files = _files_below(path)
    hints, zones, nbytes = [], set(), 0
    for f in files:
        h, z, n = _file_info(f)
        if h is not None:
            hints.append(h)
        zones.update(z)
        nbytes += n
    row = {"path": rel, "kind": kind, "files": len(files), "bytes": nbytes,
           "zones": sorted(zones)}
    if hints:
        for key in ("birth", "reclaim", "stream", "source"):
            vals = sorted({str(h.get(key)) for h in hints})
            row[key] = hints[0].get(key) if len(vals) == 1 else "mixed:" + "|".join(vals)
        placed = sorted({str(h["placed"]["reclaim"]) for h in hints if h.get("placed")})
        row["placed_mismatch"] = bool(placed)
        if placed:     # a rename re-derived the hint after some data were placed
            row["source"] = f"{row['source']} (renamed; placed with reclaim {'|'.join(placed)})"
        row["hint_from"] = sorted({h.get("name", "") for h in hints})[:3]
    elif predicted is not None:
        row.update(predicted)
        row["source"] = predicted["source"] + " (no data yet)"
    else:
        row.update(birth=None, reclaim=None, stream=None, source="none")
    return row


def _predict(tree: _PathTree, path: str) -> dict | None:
    """The hint the store will give data written below ``path`` (a generation)."""
    h = tree.resolve(path)
    return None if h.source == "none" else _hint_row(h)


def collect(path: str) -> dict:
    """The report for PATH (also used by tests and scripts)."""
    root = _mount_root(path)
    if root is None:
        die(f"{path} is not on a retainzfs mount")
    top = os.path.realpath(path)
    pols = _Policies(root)
    tree = _PathTree(root, pols)
    rows: list[dict] = []

    def rel(p: str) -> str:
        r = os.path.relpath(p, top)
        return _show(os.path.basename(top) if r == "." else r)

    def classify(d: str, name: str):
        p = os.path.join(d, name)
        xh = _xattr_hint(tree, p)
        if xh is not None:
            return "generation", xh
        pe = pols.of(d)
        if pe is not None and name != ".retainz":
            b = H.generation_birth(pe[1], name)
            if b is not None:
                return "generation", _predict(tree, p)
        return None, None

    def visit(d: str) -> None:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            return
        subdirs = []
        for name in names:
            p = os.path.join(d, name)
            st = os.lstat(p)
            kind, pred = classify(d, name)
            if kind:
                rows.append(_row(p, rel(p), kind, pred))
            elif stat.S_ISLNK(st.st_mode):
                rows.append({"path": rel(p), "kind": "link", "target": _show(os.readlink(p)),
                             "files": 0, "bytes": 0, "zones": [], "birth": None,
                             "reclaim": None, "stream": None, "source": "symlink"})
            elif stat.S_ISDIR(st.st_mode):
                subdirs.append(p)
            elif stat.S_ISREG(st.st_mode) and name != ".retainz":
                r = _row(p, rel(p), "file", None)
                if str(r.get("source", "")).startswith("policy-rolling"):
                    r["kind"] = "rolling"
                rows.append(r)
        for s in subdirs:
            visit(s)

    st = os.lstat(top)
    kind, pred = (None, None)
    if top != root:
        kind, pred = classify(os.path.dirname(top), os.path.basename(top))
    if kind:
        rows.append(_row(top, rel(top), kind, pred))
    elif stat.S_ISDIR(st.st_mode):
        visit(top)
    else:
        rows.append(_row(top, rel(top), "file", None))
    pols.of(top if stat.S_ISDIR(st.st_mode) else os.path.dirname(top))
    policies = {_show(os.path.relpath(k, root)) if k != root else ".": v
                for k, v in pols.found.items()}
    return {"path": _show(top), "mount": _show(root), "policies": policies, "generations": rows}


def _zones_text(zones: list[int]) -> str:
    if not zones:
        return "-"
    out, start, prev = [], zones[0], zones[0]
    for z in zones[1:] + [None]:
        if z is not None and z == prev + 1:
            prev = z
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if z is not None:
            start = prev = z
    return ",".join(out)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run_hints(args) -> int:
    if not os.path.exists(args.path):
        die(f"{args.path}: no such file or directory")
    rep = collect(args.path)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    con = Console()
    if not con.is_terminal:          # piped / captured: do not squeeze the table into 80 columns
        con = Console(width=200)
    for p, pol in rep["policies"].items():
        if "error" in pol:
            con.print(f"[red]policy {p}/.retainz: {pol['error']}[/red]")
        else:
            desc = ", ".join(f"{k}={v}" for k, v in pol.items() if v is not None)
            con.print(f"policy {p}/.retainz: {desc}")
    t = Table(title=f"retainzfs hints {rep['path']}")
    for col in ("generation", "kind", "birth", "reclaim", "source", "files", "size", "zones"):
        t.add_column(col, justify="right" if col in ("birth", "reclaim", "files", "size") else "left",
                     no_wrap=col != "generation", overflow="fold")
    for r in rep["generations"]:
        name = r["path"] + (f" -> {r['target']}" if r.get("target") else "")
        t.add_row(name, r["kind"], _fmt_epoch(r.get("birth")), _fmt_epoch(r.get("reclaim")),
                  str(r.get("source")), str(r["files"]), _human(r["bytes"]), _zones_text(r["zones"]))
    con.print(t)
    return 0
