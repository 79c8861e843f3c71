"""Inodes and their snapshot codec glue: a namespace that costs a few hundred bytes per file.

Why its own module: at 10^6 files the namespace is the daemon's memory and its snapshot the
mount time.  A plain file (0-1 extents, no xattrs, not open) is one object with 14 slots plus
its name and its entries in two dicts (``Store.inodes`` and the parent's ``entries``); what few
inodes have lives in two side objects created on first use:

* ``_x`` (``Extra``): rdev, symlink target, xattrs, a directory's entries / cookies / policy
  text, the hint data were placed with;
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
from types import MappingProxyType

from . import hints as H
from . import records as R
from .extents import ExtentMap
from .writebuf import WriteBuffer

EMPTY_MAP = MappingProxyType({})


class _NoExtents(ExtentMap):
    """The shared extent map of every inode without extents: reads only."""
    __slots__ = ()

    def __init__(self):
        self.exts = ()
        self.offs = ()

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


def intern_hint(h) -> H.Hint | None:
    """A shared Hint for a (birth, reclaim, stream, source) tuple or Hint (they are frozen)."""
    if h is None:
        return None
    key = (h.birth, h.reclaim, h.stream, h.source) if isinstance(h, H.Hint) else tuple(h)
    got = _HINTS.get(key)
    if got is None:
        if len(_HINTS) > 65536:
            _HINTS.clear()
        got = _HINTS[key] = h if isinstance(h, H.Hint) else H.Hint(int(key[0]), float(key[1]),
                                                                   int(key[2]), key[3])
    return got


class Extra:
    __slots__ = ("rdev", "target", "xattrs", "policy_src", "placed_hint", "entries", "cookies",
                 "next_cookie")

    def __init__(self):
        self.rdev = 0
        self.target = b""
        self.xattrs = None
        self.policy_src = b""
        self.placed_hint = None
        self.entries = None
        self.cookies = None
        self.next_cookie = 3


class RunState:
    __slots__ = ("opens", "lookups", "wbuf", "dirty", "policy_dirty", "inflight", "flushing",
                 "flush_err")

    def __init__(self):
        self.opens = 0
        self.lookups = 0
        self.wbuf = None
        self.dirty = False
        self.policy_dirty = False     # a .retainz written/truncated since its last validation
        self.inflight = 0             # buffered bytes a zone write is moving out right now
        self.flushing = None          # Future of the background flush of this file, if any
        self.flush_err = None         # error of a background flush, reported at the next call

    def idle(self) -> bool:
        f = self.flushing
        # (policy_dirty only matters for a .retainz: the caller checks that)
        return (self.opens == 0 and self.lookups == 0 and not self.wbuf and not self.dirty
                and self.inflight == 0 and self.flush_err is None and (f is None or f.done()))


def _x_prop(name: str, default):
    def get(self):
        x = self._x
        return default if x is None else getattr(x, name)

    def set_(self, v):
        x = self._x
        if x is None:
            if v == default and type(v) is type(default):
                return
            x = self._x = Extra()
        setattr(x, name, v)
    return property(get, set_)


def _rt_prop(name: str, default, drop_when_idle: bool = False):
    def get(self):
        r = self._rt
        return default if r is None else getattr(r, name)

    def set_(self, v):
        r = self._rt
        if r is None:
            if v is default or (v == default and type(v) is type(default)):
                return
            r = self._rt = RunState()
        setattr(r, name, v)
        if drop_when_idle and not v and r.idle() and not (r.policy_dirty
                                                           and self.name == H.POLICY_NAME):
            self._rt = None
    return property(get, set_)


class Inode:
    """One file, directory, symlink or device node (see the module docstring)."""
    __slots__ = ("ino", "mode", "nlink", "size", "atime", "mtime", "ctime", "parent", "name",
                 "hint", "_ext", "_ug", "_x", "_rt")

    def __init__(self, ino: int, mode: int, uid: int = 0, gid: int = 0, nlink: int = 1,
                 size: int = 0, atime: int = 0, mtime: int = 0, ctime: int = 0, rdev: int = 0,
                 target: bytes = b"", xattrs: dict | None = None, hint=None,
                 policy_src: bytes = b"", placed_hint=None, parent: int = 0, name: bytes = b""):
        self.ino = ino
        m = _MODES.get(mode)
        if m is None:
            m = _MODES.setdefault(mode, mode)
        self.mode = m
        self.nlink = nlink
        self.size = size
        self.atime, self.mtime, self.ctime = atime, mtime, ctime
        self.parent = parent
        self.name = name
        self.hint = hint
        self._ext = None
        self._ug = None
        self._x = None
        self._rt = None
        if uid or gid:
            self._ug = _UG.setdefault((uid, gid), (uid, gid))
        if stat.S_ISDIR(mode):
            self._x = Extra()
            self._x.entries = {}
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

    # -- owner
    @property
    def uid(self) -> int:
        return self._ug[0] if self._ug is not None else 0

    @uid.setter
    def uid(self, v: int) -> None:
        self._set_ug(v, self.gid)

    @property
    def gid(self) -> int:
        return self._ug[1] if self._ug is not None else 0

    @gid.setter
    def gid(self, v: int) -> None:
        self._set_ug(self.uid, v)

    def _set_ug(self, uid: int, gid: int) -> None:
        self._ug = None if not (uid or gid) else _UG.setdefault((uid, gid), (uid, gid))

    # -- rare persistent attributes
    rdev = _x_prop("rdev", 0)
    target = _x_prop("target", b"")
    policy_src = _x_prop("policy_src", b"")
    placed_hint = _x_prop("placed_hint", None)

    @property
    def xattrs(self):
        x = self._x
        return EMPTY_MAP if x is None or x.xattrs is None else x.xattrs

    @xattrs.setter
    def xattrs(self, d: dict) -> None:
        if not d and self._x is None:
            return
        if self._x is None:
            self._x = Extra()
        self._x.xattrs = dict(d) if d else None

    def set_xattr(self, name: bytes, value: bytes) -> None:
        if self._x is None:
            self._x = Extra()
        if self._x.xattrs is None:
            self._x.xattrs = {}
        self._x.xattrs[name] = value

    def del_xattr(self, name: bytes) -> None:
        xs = self.xattrs
        if name not in xs:
            raise KeyError(name)
        del self._x.xattrs[name]
        if not self._x.xattrs:
            self._x.xattrs = None

    # -- directories
    @property
    def entries(self):
        x = self._x
        return EMPTY_MAP if x is None or x.entries is None else x.entries

    @property
    def cookies(self) -> dict:
        """name -> stable readdir cookie (built on the first readdir, in insertion order)."""
        x = self._x
        if x is None or x.entries is None:
            return EMPTY_MAP
        if x.cookies is None:
            x.cookies = {n: 3 + i for i, n in enumerate(x.entries)}
            x.next_cookie = 3 + len(x.entries)
        return x.cookies

    @property
    def next_cookie(self) -> int:
        x = self._x
        return 3 if x is None else x.next_cookie

    def link(self, name: bytes, ino: int) -> None:
        x = self._x
        if x is None or x.entries is None:
            raise NotADirectoryError(self.ino)
        x.entries[name] = ino
        if x.cookies is not None:
            x.cookies[name] = x.next_cookie
            x.next_cookie += 1

    def unlink(self, name: bytes):
        """Remove an entry; its inode number (KeyError when absent)."""
        x = self._x
        if x is None or x.entries is None:
            raise KeyError(name)
        ino = x.entries.pop(name)
        if x.cookies is not None:
            x.cookies.pop(name, None)
        return ino

    # -- extents
    @property
    def extents(self) -> ExtentMap:
        e = self._ext
        return NO_EXTENTS if e is None else e

    @extents.setter
    def extents(self, m: ExtentMap) -> None:
        self._ext = m if m else None

    def extmap(self) -> ExtentMap:
        """The file's own extent map (created on first use) to add extents to."""
        e = self._ext
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
    flush_err = _rt_prop("flush_err", None)

    @property
    def wbuf(self) -> WriteBuffer:
        r = self._rt
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
        r = self._rt
        b = r.wbuf if r is not None else None
        if not b or b.end < self.size:
            return self.size
        ext = self._ext
        return max(b.off, ext.exts[-1].end if ext else 0)

    def has_buffered(self) -> bool:
        """Buffered bytes or a background flush, without creating the open-file state."""
        r = self._rt
        return r is not None and (bool(r.wbuf) or r.flushing is not None)

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
        x = self._x
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
        (_, mode, uid, gid, self.nlink, self.size, a, m, c, rdev, self.parent) = r.fixed
        mo = _MODES.get(mode)
        self.mode = mo if mo is not None else _MODES.setdefault(mode, mode)
        # equal timestamps share one int object (a created file has three equal times)
        if m == a:
            m = a
        if c == m:
            c = m
        self.atime, self.mtime, self.ctime = a, m, c
        self._ug = None if not (uid or gid) else _UG.setdefault((uid, gid), (uid, gid))
        self.name = r.name
        h = r.hint
        self.hint = None if h is None else intern_hint(h)
        x = self._x
        if x is None and not (rdev or r.target or r.xattrs or r.policy or r.placed is not None):
            return                        # nothing rare to keep (no side object)
        if x is None:
            x = self._x = Extra()
        x.rdev = rdev
        x.target = r.target
        x.xattrs = dict(r.xattrs) if r.xattrs else None
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
    def attrs(self) -> dict:
        d = {"i": self.ino, "m": self.mode, "u": self.uid, "g": self.gid, "n": self.nlink,
             "s": self.durable_size(), "a": self.atime, "mt": self.mtime, "c": self.ctime, "r": self.rdev,
             "p": self.parent, "nm": self.name.decode("latin-1")}
        if self.target:
            d["t"] = self.target.decode("latin-1")
        if self.xattrs:
            d["x"] = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.xattrs.items()}
        if self.hint is not None:
            d["h"] = [self.hint.birth, self.hint.reclaim, self.hint.stream, self.hint.source]
        if self.policy_src:
            d["ps"] = self.policy_src.decode("utf-8")
        if self.placed_hint is not None:
            p = self.placed_hint
            d["hp"] = [p.birth, p.reclaim, p.stream, p.source]
        return d

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
def encode_snapshot(inodes: dict, head: R.SnapshotHeader) -> bytes:
    """The snapshot blob of a namespace (``records.encode_snapshot``), streamed inode by inode."""
    return R.encode_snapshot(head, len(inodes), (i.to_rec() for i in inodes.values()))


def load_snapshot(blob, partial: bool = False) -> tuple[R.SnapshotHeader, dict[int, Inode]]:
    """(header, inodes) of a snapshot blob, binary or (older images) JSON; ValueError when the
    blob does not decode.  Directory entries are linked (sharing the child's name and inode
    number objects); readdir cookies come on the first readdir.

    ``partial``: the blob is the intact prefix of a snapshot whose later frames are lost
    (read-only recovery): the inodes decoded before the cut are returned (the header must be
    whole); a directory keeps only the entries whose inode survived."""
    if not R.is_binary_snapshot(blob):
        if partial:
            raise ValueError("a damaged snapshot in the old JSON form cannot be read in part")
        return _load_json_snapshot(blob)
    head, count, it = R.decode_snapshot(blob)
    inodes: dict[int, Inode] = {}
    dirs = []
    from_rec = Inode.from_rec
    try:
        for r in it:
            ino = from_rec(r)
            inodes[ino.ino] = ino
            if r.dirents:
                dirs.append((ino, r.dirents))
    except (ValueError, zlib.error):
        if not partial:
            raise
    if len(inodes) != count and not partial:
        raise ValueError("snapshot: an inode number appears twice")
    get = inodes.get
    for ino in inodes.values():           # one int object per inode number
        p = get(ino.parent)
        if p is not None:
            ino.parent = p.ino
    for d, ents in dirs:
        e = d._x.entries
        if e is None:
            raise ValueError(f"snapshot: inode {d.ino} has entries but is not a directory")
        dino = d.ino
        for name, i in ents:
            c = get(i)
            if c is not None:
                i = c.ino
                if c.parent == dino and c.name == name:
                    name = c.name
            elif partial:
                continue                  # its inode was in the lost part
            e[name] = i
    return head, inodes


def _load_json_snapshot(blob) -> tuple[R.SnapshotHeader, dict[int, Inode]]:
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
    inodes: dict[int, Inode] = {}
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
