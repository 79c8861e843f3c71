"""Inodes and their snapshot codec glue: a namespace that costs a few hundred bytes per file.

Why its own module: at 10^6 files the namespace is the daemon's memory and its snapshot the
mount time.  A plain file (0-1 extents, no xattrs, not open) is one object with 14 slots plus
its name and its entries in two dicts (``Store.inodes`` and the parent's ``entries``); what few
inodes have lives in two side objects created on first use:

* ``_x`` (``Extra``): rdev, symlink target, xattrs, a directory's entries / readdir index
  (``DirIndex``) / policy text, the hint data were placed with;
* ``_rt`` (``RunState``): open-file state (opens, lookups, write buffer, in-flight flush, parked
  error, dirty flags), dropped again when the file is idle (closed, forgotten, nothing
  buffered or in flight).

Attribute names are the ones the store and the FUSE adapter always used (``inode.wbuf``,
``inode.xattrs``, ``inode.entries`` ...): containers of inodes that do not have them read as
shared *immutable* empties, so an accidental mutation fails loudly instead of being shared;
mutations go through ``set_xattr``/``del_xattr``/``link``/``unlink``/``extmap()``, and
``wbuf`` creates the file's WriteBuffer on first access.  Readdir cookies are built on a
directory's first readdir (insertion order, like the snapshot's reload) and maintained from
then on.  The on-disk encoding of an inode is ``records.pack_inode``; this module only maps
Inode <-> ``records.InodeRec``.  Pure: no I/O, no locks.
"""
from __future__ import annotations

import json
import stat
import zlib
from array import array
from bisect import bisect_right
from collections.abc import MutableMapping
from types import MappingProxyType
from typing import NamedTuple

from . import hints as H
from . import records as R
from .extents import ExtentMap
from .writebuf import WriteBuffer

EMPTY_MAP = MappingProxyType({})
ROOT_INO = 1


class _NoExtents(ExtentMap):
    """The shared extent map of every inode without extents: reads only."""
    __slots__ = ()

    def __init__(self):
        self.exts = ()
        self.offs = ()
        self.total = 0

    def add(self, *a):
        raise TypeError("the shared empty extent map is read-only (use Inode.extmap())")

    def clear(self):
        return []

    def relocate(self, *a):
        return False

    def truncate(self, size):
        return []


NO_EXTENTS = _NoExtents()

# interned immutable values shared by many inodes (modes, owner pairs, hints)
_MODES: dict[int, int] = {}
_UG: dict[tuple[int, int], tuple[int, int]] = {}
_HINTS: dict[tuple, H.Hint] = {}
#: distinct hints interned before the table starts afresh: each save brings new ones and the
#: daemon runs for months; the live inodes keep their objects, only sharing restarts
HINTS_MAX = 4096


def intern_hint(h) -> H.Hint | None:
    """A shared Hint for a (birth, reclaim, stream, source) tuple or Hint (they are frozen)."""
    if h is None:
        return None
    key = (h.birth, h.reclaim, h.stream, h.source) if isinstance(h, H.Hint) else tuple(h)
    got = _HINTS.get(key)
    if got is None:
        if len(_HINTS) >= HINTS_MAX:
            _HINTS.clear()
        got = _HINTS[key] = h if isinstance(h, H.Hint) else H.Hint(int(key[0]), float(key[1]),
                                                                   int(key[2]), key[3])
    return got


def _xattr_sums(xattrs) -> tuple[int, int]:
    """``Extra.xattr_bytes`` and ``xattr_list`` of ``xattrs``."""
    if not xattrs:
        return 0, 0
    return (sum(len(k) + len(v) for k, v in xattrs.items()),
            sum(len(k) + 1 for k in xattrs))


class DirIndex:
    """A directory's readdir cookies: name -> a cookie stable while the name stays, and the
    cookies ascending (appended: a new entry gets the next one) with their names, so a
    listing a reply at a time starts by bisection.  Built on the directory's first readdir
    (insertion order, as the snapshot reloads it); an unlinked entry stays as a tombstone
    until half of them are."""
    __slots__ = ("cookies", "next_cookie", "order", "names", "dead")

    def __init__(self, entries) -> None:
        self.cookies = {n: 3 + i for i, n in enumerate(entries)}
        self.next_cookie = 3 + len(self.cookies)
        self.order = array("q", range(3, self.next_cookie))
        self.names = list(entries)
        self.dead = 0

    def add(self, name: bytes) -> None:
        if name in self.cookies:            # replaced (rename over it): the old cookie is dead
            self.dead += 1
        self.cookies[name] = self.next_cookie
        self.order.append(self.next_cookie)
        self.names.append(name)
        self.next_cookie += 1

    def remove(self, name: bytes) -> None:
        if self.cookies.pop(name, None) is None:
            return
        self.dead += 1
        if self.dead > 64 and 2 * self.dead > len(self.order):
            live = [(c, n) for c, n in zip(self.order, self.names) if self.cookies.get(n) == c]
            self.order = array("q", [c for c, _ in live])
            self.names = [n for _, n in live]
            self.dead = 0

    def after(self, start: int, limit: int | None = None) -> list[tuple[bytes, int]]:
        """(name, cookie) of the entries with cookie > ``start``, in cookie order, at most
        ``limit``: O(log n + what it returns), so listing a directory of 10^5 entries a reply
        at a time is not quadratic (it took 150 s for 184,000 entries when every reply
        walked the whole directory)."""
        order, names, cookies = self.order, self.names, self.cookies
        i, n = bisect_right(order, start), len(order)
        want = n if limit is None else limit
        out = []
        while i < n and len(out) < want:
            if cookies.get(names[i]) == order[i]:
                out.append((names[i], order[i]))
            i += 1
        return out


class Extra:
    __slots__ = ("rdev", "target", "xattrs", "xattr_bytes", "xattr_list", "policy_src",
                 "placed_hint", "entries", "index")

    def __init__(self):
        self.rdev = 0
        self.target = b""
        self.xattrs = None
        #: bytes of the names + values of ``xattrs``, and of listxattr's list of the names
        #: (each NUL-terminated), kept with every change: setxattr's limit checks summed
        #: them, O(n) a set (``xattrops.XATTR_TOTAL_MAX``, ``XATTR_LIST_MAX``)
        self.xattr_bytes = 0
        self.xattr_list = 0
        self.policy_src = b""
        self.placed_hint = None
        self.entries = None
        self.index = None                   # DirIndex, on the first readdir


class RunState:
    __slots__ = ("opens", "lookups", "wbuf", "dirty", "policy_dirty", "inflight", "flushing",
                 "flushing_prev", "flush_turn", "flush_epoch", "flush_err")

    def __init__(self):
        self.opens = 0
        self.lookups = 0
        self.wbuf = None
        self.dirty = False
        self.policy_dirty = False     # a .retainz written/truncated since its last validation
        self.inflight = 0             # buffered bytes (a wbuf prefix) taken by flushes in flight
        self.flushing = None          # Future of the latest background flush of this file
        self.flushing_prev = None     # ... and of the one before it (at most two in flight)
        self.flush_turn = None        # Event set when the last flush taken has written
        self.flush_epoch = 0          # bumped when a failed flush drops the buffer
        self.flush_err = None         # error of a background flush, reported at the next call

    def idle(self) -> bool:
        f = self.flushing
        # (policy_dirty only matters for a .retainz: the caller checks that)
        return (self.opens == 0 and self.lookups == 0 and not self.wbuf and not self.dirty
                and self.inflight == 0 and self.flush_err is None and (f is None or f.done()))


# (The getters below read the side dicts themselves, not through ``_x`` / ``_rt`` / ``_ext``:
# one Python call less per attribute read, and a small file's create-write-close-unlink
# reads them ~60 times.)
def _x_prop(name: str, default):
    def get(self):
        x = self._p.x.get(self._r)
        return default if x is None else getattr(x, name)

    def set_(self, v):
        x = self._p.x.get(self._r)
        if x is None:
            if v == default and type(v) is type(default):
                return
            x = self._x = Extra()
        setattr(x, name, v)
    return property(get, set_)


def _rt_prop(name: str, default, drop_when_idle: bool = False):
    def get(self):
        r = self._p.rt.get(self._r)
        return default if r is None else getattr(r, name)

    def set_(self, v):
        r = self._p.rt.get(self._r)
        if r is None:
            if v is default or (v == default and type(v) is type(default)):
                return
            r = self._rt = RunState()
        setattr(r, name, v)
        if drop_when_idle and not v:
            self._drop_rt_if_idle()
    return property(get, set_)


def show_name(name: bytes) -> str:
    """How a name is spelled in reports, JSON and log lines: UTF-8, each byte that is not
    UTF-8 as ``\\xNN``.  Two names that differ only in such bytes read differently (the
    replacement character made them alike), and the text holds no lone surrogate (which the
    log's strict encoder would refuse).  ``retainzfs hints`` spells the paths it walks so."""
    return name.decode("utf-8", "backslashreplace")


# ------------------------------------------------------------------ the inode table
# Columns of a row (int64 each).  A row is free while its first column is 0 (every inode has a
# type); that column holds the mode in its low 32 bits and the owner's uid/gid id above.
C_MODE, C_NLINK, C_SIZE, C_ATIME, C_MTIME, C_CTIME, C_PARENT = range(7)
NCOL = 7
_M32 = 0xFFFFFFFF
PAGE_BITS = 10
_ZERO_PAGE = {}
# uid/gid pairs: an id per distinct pair (id 0 is root:root), shared by every table
_UG_IDS: dict[tuple[int, int], int] = {(0, 0): 0}
_UG_LIST: list[tuple[int, int]] = [(0, 0)]
_new_view = object.__new__


def _ug_id(uid: int, gid: int) -> int:
    k = (uid, gid)
    i = _UG_IDS.get(k)
    if i is None:
        i = _UG_IDS[k] = len(_UG_LIST)
        _UG_LIST.append(k)
    return i


class _Page:
    """``1 << bits`` consecutive inode numbers: fixed fields in one int64 array, the name and
    hint of each row in two lists, side objects (extents, rare attributes, open-file state)
    in dicts keyed by row — only for the rows that have them."""
    __slots__ = ("a", "names", "hints", "ext", "x", "rt", "count")

    def __init__(self, bits: int):
        n = 1 << bits
        z = _ZERO_PAGE.get(bits)
        if z is None:
            z = _ZERO_PAGE[bits] = array("q", bytes(8 * NCOL * n))
        self.a = array("q", z)
        self.names: list = [b""] * n
        self.hints: list = [None] * n
        self.ext: dict = {}
        self.x: dict = {}
        self.rt: dict = {}
        self.count = 0


class Attrs(NamedTuple):
    """A consistent copy of an inode's attributes, taken under ``Store.lock``: what the FUSE
    adapter gets instead of the live ``Inode`` view, whose row another thread may change
    (or free, and give to a new inode) while one builds its reply."""
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    atime: int
    mtime: int
    ctime: int
    caps: bool            # has file capabilities (security.capability)
    #: bytes a regular file holds (extents + buffered, at most its size): ``st_blocks``, so
    #: ``du`` and ``cp --sparse`` see holes; -1: use the size (directories, links, the null
    #: file systems of ``bench_fuse_ceiling``)
    stored: int = -1

    @staticmethod
    def of(inode: "Inode") -> "Attrs":
        """Store.lock held.  (Reads the row itself: every reply with attributes builds one.)"""
        p, r = inode._p, inode._r
        a, o = p.a, r * NCOL
        m, size = a[o], a[o + C_SIZE]
        mode = m & _M32
        x = p.x.get(r)
        xa = x.xattrs if x is not None else None
        stored = -1
        if stat.S_ISREG(mode):
            stored = inode.extents.total
            if inode.has_buffered():         # buffered bytes over stored ones count once
                wb = inode.wbuf
                stored += len(wb) - sum(seg[3] for seg in inode.extents.lookup(wb.off, len(wb)))
            stored = min(stored, size)
        uid, gid = _UG_LIST[m >> 32]
        return Attrs(inode.ino, mode, a[o + C_NLINK], uid, gid, x.rdev if x is not None else 0,
                     size, a[o + C_ATIME], a[o + C_MTIME], a[o + C_CTIME],
                     bool(xa) and b"security.capability" in xa, stored)


class InodeTable(MutableMapping):
    """inode number -> Inode, stored packed (≈100 bytes per plain file instead of ≈400 as
    one object per inode).  Rows live in pages of ``1 << PAGE_BITS`` inode numbers; a page
    goes when its last inode does, so a long-lived store that creates and deletes
    checkpoints holds pages for the inode numbers in use, not for every number ever given.
    ``table[i]`` returns a view (an ``Inode``) whose attributes read and write the row;
    assigning an Inode that lives elsewhere (a standalone one, or a row of another table)
    copies it in and rebinds it to the row; ``pop`` returns a detached copy."""

    def __init__(self, page_bits: int = PAGE_BITS):
        self.bits = page_bits
        self.mask = (1 << page_bits) - 1
        self.pages: dict[int, _Page] = {}
        self.n = 0
        # regular files among them, kept as rows come and go (``status`` and every metrics
        # scrape report it: counting them walked every row under Store.lock, 46 ms for
        # 88,000 files, during which each file operation waited)
        self.nreg = 0

    # -- paths (no lock of their own: the caller holds Store.lock or owns the store alone)
    def path_of(self, ino: int) -> str:
        """The path of an inode from the root, for log lines and reports (its first link),
        spelled by ``show_name``."""
        parts = []
        inode = self.get(ino)
        while inode is not None and inode.ino != ROOT_INO:
            parts.append(show_name(inode.name))
            inode = self.get(inode.parent)
        return "/" + "/".join(reversed(parts))

    # -- rows
    def _row(self, ino: int):
        """(page, row) of a live inode, or (None, 0)."""
        p = self.pages.get(ino >> self.bits)
        if p is None:
            return None, 0
        r = ino & self.mask
        if not p.a[r * NCOL]:
            return None, 0
        return p, r

    def _new_row(self, ino: int, mode: int):
        if not mode or ino < 0:
            raise ValueError(f"inode {ino}: mode 0 or a negative number")
        k = ino >> self.bits
        p = self.pages.get(k)
        if p is None:
            p = self.pages[k] = _Page(self.bits)
        r = ino & self.mask
        if p.a[r * NCOL]:
            raise KeyError(f"inode {ino} exists")
        p.a[r * NCOL] = mode
        p.count += 1
        self.n += 1
        if stat.S_ISREG(mode & _M32):
            self.nreg += 1
        return p, r

    def new(self, ino: int, mode: int) -> "Inode":
        """A fresh row (nlink 1, everything else zero/empty) and its view."""
        p, r = self._new_row(ino, mode)
        p.a[r * NCOL + C_NLINK] = 1
        if stat.S_ISDIR(mode):
            x = p.x[r] = Extra()
            x.entries = {}
        return Inode._view(ino, self, p, r)

    # -- Mapping
    # (``__getitem__`` and ``get`` do ``_row`` and ``_view`` inline: a small file's create,
    # write, close and unlink look inodes up ~30 times)
    def __getitem__(self, ino: int) -> "Inode":
        p = self.pages.get(ino >> self.bits)
        r = ino & self.mask
        if p is None or not p.a[r * NCOL]:
            raise KeyError(ino)
        v = _new_view(Inode)
        v.ino, v._t, v._p, v._r = ino, self, p, r
        return v

    def get(self, ino, default=None):
        if type(ino) is not int:
            return default
        p = self.pages.get(ino >> self.bits)
        r = ino & self.mask
        if p is None or not p.a[r * NCOL]:
            return default
        v = _new_view(Inode)
        v.ino, v._t, v._p, v._r = ino, self, p, r
        return v

    def __contains__(self, ino) -> bool:
        return type(ino) is int and self._row(ino)[0] is not None

    def __len__(self) -> int:
        return self.n

    def _live_rows(self):
        """(inode number, page, row) of every inode, in inode-number order."""
        bits = self.bits
        for k in sorted(self.pages):
            p = self.pages.get(k)
            if p is None:
                continue
            a = p.a
            base = k << bits
            for r in range(1 << bits):
                if a[r * NCOL]:
                    yield base + r, p, r

    def __iter__(self):
        for ino, _, _ in self._live_rows():
            yield ino

    def values(self):
        view = Inode._view
        for ino, p, r in self._live_rows():
            yield view(ino, self, p, r)

    def items(self):
        for v in self.values():
            yield v.ino, v

    def extent_maps(self):
        """(inode view, ExtentMap) of every inode with extents (no view for the others)."""
        bits = self.bits
        for k, p in list(self.pages.items()):
            for r, m in list(p.ext.items()):
                yield Inode._view((k << bits) + r, self, p, r), m

    def unlinked(self) -> list["Inode"]:
        """Inodes with no name left (nlink 0: open when the daemon died)."""
        out = []
        for k, p in list(self.pages.items()):
            a = p.a
            for r in range(len(p.names)):
                o = r * NCOL
                if a[o] and not a[o + C_NLINK]:
                    out.append(Inode._view((k << self.bits) + r, self, p, r))
        return out

    def with_extra(self):
        """Views of the inodes that have rare attributes (every directory, symlinks, ...)."""
        bits = self.bits
        for k, p in list(self.pages.items()):
            for r in list(p.x):
                yield Inode._view((k << bits) + r, self, p, r)

    def hints(self):
        """The distinct hint objects in use (they are interned), for the mount's clock."""
        seen = set()
        for p in list(self.pages.values()):
            for h in p.hints:
                if h is not None and id(h) not in seen:
                    seen.add(id(h))
                    yield h

    def __setitem__(self, ino: int, inode: "Inode") -> None:
        if inode._t is self and inode.ino == ino:
            return
        if ino in self:
            self._free(ino)
        p, r = self._new_row(ino, inode.mode)
        sp, sr = inode._p, inode._r
        o, so = r * NCOL, sr * NCOL
        p.a[o:o + NCOL] = sp.a[so:so + NCOL]
        p.names[r], p.hints[r] = sp.names[sr], sp.hints[sr]
        for mine, theirs in ((p.ext, sp.ext), (p.x, sp.x), (p.rt, sp.rt)):
            v = theirs.get(sr)
            if v is not None:
                mine[r] = v
        inode.ino, inode._t, inode._p, inode._r = ino, self, p, r

    def _free(self, ino: int) -> None:
        p, r = self._row(ino)
        if p is None:
            raise KeyError(ino)
        o = r * NCOL
        if stat.S_ISREG(p.a[o] & _M32):
            self.nreg -= 1
        p.a[o:o + NCOL] = _ZERO_PAGE[self.bits][:NCOL]
        p.names[r], p.hints[r] = b"", None
        p.ext.pop(r, None)
        p.x.pop(r, None)
        p.rt.pop(r, None)
        p.count -= 1
        self.n -= 1
        if not p.count:
            del self.pages[ino >> self.bits]

    def __delitem__(self, ino: int) -> None:
        self._free(ino)

    _MISSING = object()

    def pop(self, ino, default=_MISSING):
        """Remove an inode; a detached copy of it (or ``default``)."""
        p, r = self._row(ino) if type(ino) is int else (None, 0)
        if p is None:
            if default is self._MISSING:
                raise KeyError(ino)
            return default
        copy = Inode._detached(ino, p, r)
        self._free(ino)
        return copy

    def clear(self) -> None:
        self.pages.clear()
        self.n = self.nreg = 0


def _col(c: int):
    def get(self):
        return self._p.a[self._r * NCOL + c]

    def set_(self, v):
        self._p.a[self._r * NCOL + c] = v
    return property(get, set_)


def _side(field: str):
    def get(self):
        return getattr(self._p, field).get(self._r)

    def set_(self, v):
        d = getattr(self._p, field)
        if v is None:
            d.pop(self._r, None)
        else:
            d[self._r] = v
    return property(get, set_)


class Inode:
    """One file, directory, symlink or device node: a view of its row in an ``InodeTable``
    (see the module docstring).  Built directly (``Inode(ino, mode, ...)``) it lives in a
    private one-row table until it is assigned into a store's table."""
    __slots__ = ("ino", "_t", "_p", "_r")

    def __init__(self, ino: int, mode: int, uid: int = 0, gid: int = 0, nlink: int = 1,
                 size: int = 0, atime: int = 0, mtime: int = 0, ctime: int = 0, rdev: int = 0,
                 target: bytes = b"", xattrs: dict | None = None, hint=None,
                 policy_src: bytes = b"", placed_hint=None, parent: int = 0, name: bytes = b""):
        t = InodeTable(0)
        v = t.new(ino, mode)
        self.ino, self._t, self._p, self._r = ino, t, v._p, v._r
        self.nlink = nlink
        self.size = size
        self.atime, self.mtime, self.ctime = atime, mtime, ctime
        self.parent = parent
        self.name = name
        self.hint = hint
        if uid or gid:
            self._set_ug(uid, gid)
        if rdev:
            self.rdev = rdev
        if target:
            self.target = target
        if xattrs:
            self.xattrs = xattrs
        if policy_src:
            self.policy_src = policy_src
        if placed_hint is not None:
            self.placed_hint = placed_hint

    @classmethod
    def _view(cls, ino: int, t: InodeTable, p: _Page, r: int) -> "Inode":
        v = cls.__new__(cls)
        v.ino, v._t, v._p, v._r = ino, t, p, r
        return v

    @classmethod
    def _detached(cls, ino: int, p: _Page, r: int) -> "Inode":
        t = InodeTable(0)
        q, _ = t._new_row(ino, p.a[r * NCOL])
        q.a[0:NCOL] = p.a[r * NCOL:(r + 1) * NCOL]
        q.names[0], q.hints[0] = p.names[r], p.hints[r]
        for mine, theirs in ((q.ext, p.ext), (q.x, p.x), (q.rt, p.rt)):
            v = theirs.get(r)
            if v is not None:
                mine[0] = v
        return cls._view(ino, t, q, 0)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Inode) and other.ino == self.ino and other._p is self._p
                and other._r == self._r)

    def __hash__(self) -> int:
        return hash(self.ino)

    @property
    def mode(self) -> int:
        return self._p.a[self._r * NCOL] & _M32

    @mode.setter
    def mode(self, v: int) -> None:
        a, o = self._p.a, self._r * NCOL
        was = stat.S_ISREG(a[o] & _M32)
        a[o] = (a[o] >> 32 << 32) | v
        if stat.S_ISREG(v) != was:               # (a replayed record may change the type)
            self._t.nreg += 1 if not was else -1
    nlink = _col(C_NLINK)
    size = _col(C_SIZE)
    atime = _col(C_ATIME)
    mtime = _col(C_MTIME)
    ctime = _col(C_CTIME)
    parent = _col(C_PARENT)
    _ext = _side("ext")
    _x = _side("x")
    _rt = _side("rt")

    @property
    def name(self) -> bytes:
        return self._p.names[self._r]

    @name.setter
    def name(self, v: bytes) -> None:
        self._p.names[self._r] = v

    @property
    def hint(self):
        return self._p.hints[self._r]

    @hint.setter
    def hint(self, v) -> None:
        self._p.hints[self._r] = v

    # -- owner
    @property
    def _ug(self):
        i = self._p.a[self._r * NCOL] >> 32
        return _UG_LIST[i] if i else None

    @property
    def uid(self) -> int:
        return _UG_LIST[self._p.a[self._r * NCOL] >> 32][0]

    @uid.setter
    def uid(self, v: int) -> None:
        self._set_ug(v, self.gid)

    @property
    def gid(self) -> int:
        return _UG_LIST[self._p.a[self._r * NCOL] >> 32][1]

    @gid.setter
    def gid(self, v: int) -> None:
        self._set_ug(self.uid, v)

    def _set_ug(self, uid: int, gid: int) -> None:
        a, o = self._p.a, self._r * NCOL
        a[o] = (_ug_id(uid, gid) << 32) | (a[o] & _M32)

    # -- rare persistent attributes
    rdev = _x_prop("rdev", 0)
    target = _x_prop("target", b"")
    policy_src = _x_prop("policy_src", b"")
    placed_hint = _x_prop("placed_hint", None)

    @property
    def xattrs(self):
        x = self._p.x.get(self._r)
        return EMPTY_MAP if x is None or x.xattrs is None else x.xattrs

    @xattrs.setter
    def xattrs(self, d: dict) -> None:
        if not d and self._x is None:
            return
        if self._x is None:
            self._x = Extra()
        self._x.xattrs = dict(d) if d else None
        self._x.xattr_bytes, self._x.xattr_list = _xattr_sums(d)

    @property
    def xattr_sums(self) -> tuple[int, int]:
        """(bytes of the names and values of ``xattrs``, bytes of listxattr's name list)."""
        x = self._p.x.get(self._r)
        return (0, 0) if x is None else (x.xattr_bytes, x.xattr_list)

    def set_xattr(self, name: bytes, value: bytes) -> None:
        x = self._x
        if x is None:
            x = self._x = Extra()
        if x.xattrs is None:
            x.xattrs = {}
        old = x.xattrs.get(name)
        if old is None:
            x.xattr_bytes += len(name) + len(value)
            x.xattr_list += len(name) + 1
        else:
            x.xattr_bytes += len(value) - len(old)
        x.xattrs[name] = value

    def del_xattr(self, name: bytes) -> None:
        xs = self.xattrs
        if name not in xs:
            raise KeyError(name)
        x = self._x
        x.xattr_bytes -= len(name) + len(x.xattrs.pop(name))
        x.xattr_list -= len(name) + 1
        if not x.xattrs:
            x.xattrs = None

    # -- directories
    @property
    def entries(self):
        x = self._p.x.get(self._r)
        return EMPTY_MAP if x is None or x.entries is None else x.entries

    def _index(self) -> DirIndex | None:
        x = self._p.x.get(self._r)
        if x is None or x.entries is None:
            return None
        if x.index is None:
            x.index = DirIndex(x.entries)
        return x.index

    def entries_after(self, start: int, limit: int | None = None) -> list[tuple[bytes, int]]:
        """``DirIndex.after``: the entries past cookie ``start``, at most ``limit``."""
        ix = self._index()
        return [] if ix is None else ix.after(start, limit)

    @property
    def next_cookie(self) -> int:
        """The cookie the directory's next new entry gets."""
        ix = self._index()
        return 3 if ix is None else ix.next_cookie

    def link(self, name: bytes, ino: int) -> None:
        x = self._p.x.get(self._r)
        if x is None or x.entries is None:
            raise NotADirectoryError(self.ino)
        x.entries[name] = ino
        if x.index is not None:
            x.index.add(name)

    def unlink(self, name: bytes):
        """Remove an entry; its inode number (KeyError when absent)."""
        x = self._p.x.get(self._r)
        if x is None or x.entries is None:
            raise KeyError(name)
        ino = x.entries.pop(name)
        if x.index is not None:
            x.index.remove(name)
        return ino

    # -- extents
    @property
    def extents(self) -> ExtentMap:
        e = self._p.ext.get(self._r)
        return NO_EXTENTS if e is None else e

    @extents.setter
    def extents(self, m: ExtentMap) -> None:
        self._ext = m if m else None

    def extmap(self) -> ExtentMap:
        """The file's own extent map (created on first use) to add extents to."""
        e = self._p.ext.get(self._r)
        if e is None:
            e = self._ext = ExtentMap()
        return e

    # -- open-file state
    opens = _rt_prop("opens", 0, drop_when_idle=True)
    lookups = _rt_prop("lookups", 0, drop_when_idle=True)
    dirty = _rt_prop("dirty", False)
    policy_dirty = _rt_prop("policy_dirty", False)
    inflight = _rt_prop("inflight", 0)
    flushing = _rt_prop("flushing", None)
    flushing_prev = _rt_prop("flushing_prev", None)
    flush_turn = _rt_prop("flush_turn", None)
    flush_epoch = _rt_prop("flush_epoch", 0)
    flush_err = _rt_prop("flush_err", None)

    @property
    def wbuf(self) -> WriteBuffer:
        r = self._p.rt.get(self._r)
        if r is None:
            r = self._rt = RunState()
        if r.wbuf is None:
            r.wbuf = WriteBuffer()
        return r.wbuf

    @wbuf.setter
    def wbuf(self, b: WriteBuffer) -> None:
        if self._rt is None:
            self._rt = RunState()
        self._rt.wbuf = b

    def durable_size(self) -> int:
        """The size a journal record may carry: never past bytes that are only in the write
        buffer.  A snapshot or an INODE record written by another operation (a rename, a
        chmod, a roll) while a file's tail is still buffered would otherwise make a crash
        leave a size whose last bytes read as zeros — wrong bytes, not a short file (the
        fault campaign found it).  A size set by truncate past the buffer is kept."""
        r = self._p.rt.get(self._r)
        b = r.wbuf if r is not None else None
        if not b or b.end < self.size:
            return self.size
        ext = self._p.ext.get(self._r)
        return max(b.off, ext.exts[-1].end if ext else 0)

    def has_buffered(self) -> bool:
        """Buffered bytes or a background flush not yet done, without creating the open-file
        state.  (A done flush's bytes are in extents: counting it too kept the daemon's
        readahead off for every file written in the background until the kernel forgot it,
        the restore read right after a save among them.)"""
        r = self._p.rt.get(self._r)
        if r is None:
            return False
        f = r.flushing
        return bool(r.wbuf) or (f is not None and not f.done())

    def shed_finished(self) -> None:
        """Let go of the open-file state a closed file no longer needs: an empty write buffer,
        done flush futures, a flush turn already passed; all of it when nothing is left.
        Without this, each file ever written kept ~1.5 KiB (an Event, a buffer, futures)
        while the kernel held its name: 100,000 files created took the daemon from 23 to
        288 MiB.  Store.lock held."""
        r = self._p.rt.get(self._r)
        if r is None:
            return
        if r.wbuf is not None and not r.wbuf and r.inflight == 0:
            r.wbuf = None
        if r.flushing_prev is not None and r.flushing_prev.done():
            r.flushing_prev = None
        if r.flushing is not None and r.flushing.done() and r.flushing_prev is None:
            r.flushing = None
        if r.flush_turn is not None and r.flush_turn.is_set():
            r.flush_turn = None
        self._drop_rt_if_idle()

    def _drop_rt_if_idle(self) -> None:
        """Let go of the open-file state when nothing is left in it (a ``.retainz`` waiting
        for validation keeps it)."""
        r = self._p.rt.get(self._r)
        if r is not None and r.idle() and not (r.policy_dirty and self.name == H.POLICY_NAME):
            self._rt = None

    # -- kinds
    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    def __repr__(self) -> str:
        return f"Inode({self.ino}, {self.mode:o}, name={self.name!r}, size={self.size})"

    # -- codec glue
    def to_rec(self, tables: bool = True) -> R.InodeRec:
        x = self._p.x.get(self._r)
        h, p = self.hint, (x.placed_hint if x is not None else None)
        r = R.InodeRec((self.ino, self.mode, self.uid, self.gid, self.nlink, self.durable_size(),
                        self.atime, self.mtime, self.ctime, x.rdev if x is not None else 0,
                        self.parent), self.name)
        if h is not None:
            r.hint = (h.birth, h.reclaim, h.stream, h.source)
        if x is not None:
            r.target, r.policy = x.target, x.policy_src
            if x.xattrs:
                r.xattrs = list(x.xattrs.items())
            if p is not None:
                r.placed = (p.birth, p.reclaim, p.stream, p.source)
            if tables and x.entries:
                r.dirents = list(x.entries.items())
        if tables and self._ext is not None:
            r.extents = [(e.off, e.length, e.zone, e.zoff, e.hint) for e in self._ext]
        return r

    def set_rec(self, r: R.InodeRec) -> None:
        """Take the persistent attributes of an entry (not its extents or dirents)."""
        (_, mode, uid, gid, nlink, size, at, mt, ct, rdev, parent) = r.fixed
        a, o = self._p.a, self._r * NCOL
        a[o] = mode | ((_ug_id(uid, gid) << 32) if (uid or gid) else 0)
        a[o + C_NLINK] = nlink
        a[o + C_SIZE] = size
        a[o + C_ATIME] = at
        a[o + C_MTIME] = mt
        a[o + C_CTIME] = ct
        a[o + C_PARENT] = parent
        if self.name != r.name:
            self.name = r.name
        h = r.hint
        self.hint = None if h is None else intern_hint(h)
        x = self._p.x.get(self._r)
        if x is None and not (rdev or r.target or r.xattrs or r.policy or r.placed is not None):
            return                        # nothing rare to keep (no side object)
        if x is None:
            x = self._x = Extra()
        x.rdev = rdev
        x.target = r.target
        x.xattrs = dict(r.xattrs) if r.xattrs else None
        x.xattr_bytes, x.xattr_list = _xattr_sums(x.xattrs)
        x.policy_src = r.policy
        x.placed_hint = intern_hint(r.placed)

    @classmethod
    def from_rec(cls, r: R.InodeRec) -> "Inode":
        f = r.fixed
        ino = cls(f[0], f[1])
        ino.set_rec(r)
        if r.extents:
            m = ino.extmap()
            for off, length, zone, zoff, hint in r.extents:
                m.add(off, length, zone, zoff, hint)
        return ino

    # -- the JSON form (format v2 images written before the binary records; still read)
    def set_attrs(self, d: dict) -> None:
        self.mode, self.nlink = d["m"], d["n"]
        self._set_ug(d["u"], d["g"])
        self.size, self.atime, self.mtime, self.ctime = d["s"], d["a"], d["mt"], d["c"]
        self.rdev = d["r"]
        self.parent, self.name = d.get("p", 0), d.get("nm", "").encode("latin-1")
        self.target = d.get("t", "").encode("latin-1")
        self.xattrs = {k.encode("latin-1"): v.encode("latin-1") for k, v in d.get("x", {}).items()}
        h = d.get("h")
        self.hint = intern_hint((int(h[0]), float(h[1]), int(h[2]), h[3])) if h else None
        self.policy_src = d.get("ps", "").encode("utf-8")
        hp = d.get("hp")
        self.placed_hint = intern_hint((int(hp[0]), float(hp[1]), int(hp[2]), hp[3])) if hp else None


# ------------------------------------------------------------------ snapshots
def snapshot_entries(inodes: InodeTable):
    """Each inode's snapshot entry in inode order: packed straight from its row
    (``records.pack_plain_inode``) when it has nothing rare and no bytes only in a write
    buffer (most files), else its ``InodeRec``.  A roll encodes every inode under Store.lock,
    so this is the time every file operation waits: through ``to_rec`` 3.5 us an inode
    (128,000 files: 542 ms)."""
    if not isinstance(inodes, InodeTable):
        yield from (i.to_rec() for i in inodes.values())
        return
    bits = inodes.bits
    plain = R.pack_plain_inode
    packed_hints: dict[int, bytes] = {}       # hints are interned: pack each once
    for k in sorted(inodes.pages):
        p = inodes.pages[k]
        a, names, hints, exts, xs, rts = p.a, p.names, p.hints, p.ext, p.x, p.rt
        base = k << bits
        for r in range(1 << bits):
            o = r * NCOL
            m = a[o]
            if not m:
                continue
            rt = rts.get(r)
            if r in xs or (rt is not None and rt.wbuf):
                yield Inode._view(base + r, inodes, p, r).to_rec()
                continue
            h = hints[r]
            hb = None
            if h is not None:
                hb = packed_hints.get(id(h))
                if hb is None:
                    hb = packed_hints[id(h)] = R.pack_hint((h.birth, h.reclaim, h.stream,
                                                            h.source))
            uid, gid = _UG_LIST[m >> 32]
            yield plain((base + r, m & _M32, uid, gid, a[o + C_NLINK], a[o + C_SIZE],
                         a[o + C_ATIME], a[o + C_MTIME], a[o + C_CTIME], 0, a[o + C_PARENT]),
                        names[r], hb, exts.get(r))


def encode_snapshot(inodes, head: R.SnapshotHeader) -> bytes:
    """The snapshot blob of a namespace (``records.encode_snapshot``), streamed inode by inode."""
    return R.encode_snapshot(head, len(inodes), snapshot_entries(inodes))


def encode_snapshot_parts(inodes, head: R.SnapshotHeader) -> list[bytes]:
    """The same as compressed pieces in order (what a journal roll writes)."""
    return R.encode_snapshot_parts(head, len(inodes), snapshot_entries(inodes))


def load_snapshot(blob, partial: bool = False) -> tuple[R.SnapshotHeader, InodeTable]:
    """(header, inodes) of a snapshot blob, binary or (older images) JSON; ValueError when the
    blob does not decode.  Directory entries are linked as each directory is decoded; a
    child decoded later takes the entry's name object (one bytes object per name, not two);
    readdir cookies come on the first readdir.

    ``partial``: the blob is the intact prefix of a snapshot whose later frames are lost
    (read-only recovery): the inodes decoded before the cut are returned (the header must be
    whole); a directory keeps only the entries whose inode survived."""
    if not R.is_binary_snapshot(blob):
        if partial:
            raise ValueError("a damaged snapshot in the old JSON form cannot be read in part")
        return _load_json_snapshot(b"".join(blob) if isinstance(blob, list) else blob)
    head, count, it = R.decode_snapshot(blob, fast=True)
    t = InodeTable()
    pend = []                     # (partial) directories whose entries may name lost inodes
    bits, mask = t.bits, t.mask
    pages = t.pages
    new_row = t._new_row

    def fill(f, name):
        """A new row from an entry's fixed fields; (page, row)."""
        try:
            p, row = new_row(f[0], f[1])
        except KeyError:
            raise ValueError("snapshot: an inode number appears twice") from None
        a, o = p.a, row * NCOL
        a[o + C_NLINK] = f[4]
        a[o + C_SIZE] = f[5]
        a[o + C_ATIME] = f[6]
        a[o + C_MTIME] = f[7]
        a[o + C_CTIME] = f[8]
        a[o + C_PARENT] = f[10]
        if f[2] or f[3]:
            a[o] |= _ug_id(f[2], f[3]) << 32
        if p.names[row] != name:          # (else keep the parent's entry's name object)
            p.names[row] = name
        return p, row

    try:
        for r in it:
            if type(r) is tuple:
                # a plain entry (nine in ten): (fixed fields, name), no object built for it
                f, name = r
                ino = f[0]
                p, row = fill(f, name)
                if stat.S_ISDIR(f[1]) or f[9]:
                    v = Inode._view(ino, t, p, row)
                    if stat.S_ISDIR(f[1]):
                        x = p.x[row] = Extra()
                        x.entries = {}
                    if f[9]:
                        v.rdev = f[9]
                continue
            f = r.fixed
            ino = f[0]
            p, row = fill(f, r.name)
            if r.hint is not None:
                p.hints[row] = intern_hint(r.hint)
            isdir = stat.S_ISDIR(f[1])
            if isdir or f[9] or r.target or r.xattrs or r.policy or r.placed is not None:
                v = Inode._view(ino, t, p, row)
                if isdir:
                    x = p.x[row] = Extra()
                    x.entries = {}
                v.set_rec(r)
            if r.extents:
                m = p.ext[row] = ExtentMap()
                for off, length, zone, zoff, hint in r.extents:
                    m.add(off, length, zone, zoff, hint)
            if r.dirents:
                if not isdir:
                    raise ValueError(f"snapshot: inode {ino} has entries but is not a directory")
                e = p.x[row].entries
                for nm, i in r.dirents:
                    # one bytes object per name: the child's row takes the entry's name (a
                    # child decoded later keeps it when its own name is equal); a child
                    # decoded first lends its own
                    k = i >> bits
                    cp = pages.get(k)
                    if cp is None:
                        cp = pages[k] = _Page(bits)
                    cr = i & mask
                    have = cp.names[cr]
                    if have == nm:
                        nm = have
                    elif not cp.a[cr * NCOL]:
                        cp.names[cr] = nm
                    e[nm] = i
                if partial:
                    pend.append(e)
    except (ValueError, zlib.error):
        if not partial:
            raise
    if len(t) != count and not partial:
        raise ValueError(f"snapshot: {len(t)} inodes for a count of {count}")
    for e in pend:                        # (partial only)
        for nm, i in list(e.items()):
            if i not in t:
                del e[nm]                     # its inode was in the lost part
    for k in [k for k, p in pages.items() if not p.count]:
        del pages[k]                          # pages only entries of lost inodes named
    return head, t


def _load_json_snapshot(blob) -> tuple[R.SnapshotHeader, InodeTable]:
    from array import array
    import base64
    doc = json.loads(__import__("zlib").decompress(blob))
    cs = {}
    for z, runs in doc.get("cs", {}).items():
        out = []
        for zoff, length, b64 in runs:
            crcs = array("I")
            crcs.frombytes(base64.b64decode(b64))
            out.append((zoff, length, crcs))
        cs[int(z)] = out
    head = R.SnapshotHeader(doc["next_ino"], doc.get("now", 0),
                            {int(z): g for z, g in doc.get("zg", {}).items()}, cs)
    inodes = InodeTable()
    for d in doc["inodes"]:
        ino = Inode(d["i"], d["m"])
        ino.set_attrs(d)
        if d.get("e"):
            m = ino.extmap()
            for off, length, zone, zoff, hint in d["e"]:
                m.add(off, length, zone, zoff, float(hint))
        inodes[ino.ino] = ino
    for d in doc["inodes"]:
        parent = inodes[d["i"]]
        for name, child in d.get("d", {}).items():
            parent.link(name.encode("latin-1"), child)
    return head, inodes
