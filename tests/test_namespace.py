"""The packed inode table (namespace.InodeTable) against a dict model: rows, pages that come
and go, views that read and write their row, owners packed beside the mode, detached copies,
side objects (extents, xattrs, open-file state).  Page boundaries are exercised by small
pages and inode numbers around them."""
from __future__ import annotations

import stat

from hypothesis import given, settings, strategies as st

from retainzfs.namespace import Inode, InodeTable

FIELDS = ("nlink", "size", "atime", "mtime", "ctime", "parent")
MODES = (stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777, stat.S_IFREG | 0o4755)

ino_s = st.integers(1, 40) | st.sampled_from([1023, 1024, 1025, 2047, 2048, 1 << 40])
op_s = st.one_of(
    st.tuples(st.just("new"), ino_s, st.sampled_from(MODES)),
    st.tuples(st.just("set"), ino_s, st.sampled_from(FIELDS), st.integers(-2**62, 2**62)),
    st.tuples(st.just("own"), ino_s, st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)),
    st.tuples(st.just("chmod"), ino_s, st.sampled_from(MODES)),
    st.tuples(st.just("name"), ino_s, st.binary(max_size=255)),
    st.tuples(st.just("xattr"), ino_s, st.binary(min_size=1, max_size=8), st.binary(max_size=8)),
    st.tuples(st.just("ext"), ino_s, st.integers(0, 1 << 30), st.integers(1, 1 << 20)),
    st.tuples(st.just("pop"), ino_s),
    st.tuples(st.just("adopt"), ino_s, st.sampled_from(MODES), st.integers(0, 99)),
)


def state(v: Inode) -> dict:
    d = {f: getattr(v, f) for f in FIELDS}
    d.update(mode=v.mode, uid=v.uid, gid=v.gid, name=v.name, xattrs=dict(v.xattrs),
             exts=[(e.off, e.length) for e in v.extents])
    return d


def fresh(mode: int) -> dict:
    return {"nlink": 1, "size": 0, "atime": 0, "mtime": 0, "ctime": 0, "parent": 0,
            "mode": mode, "uid": 0, "gid": 0, "name": b"", "xattrs": {}, "exts": []}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([0, 3, 10]), st.lists(op_s, max_size=60))
def test_table_matches_a_dict_model(bits, ops):
    t = InodeTable(bits)
    model: dict[int, dict] = {}
    for op in ops:
        kind, ino = op[0], op[1]
        if kind == "new":
            if ino in model:
                continue
            t.new(ino, op[2])
            model[ino] = fresh(op[2])
        elif ino not in model:
            if kind == "adopt":
                v = Inode(ino, op[2], uid=op[3], gid=op[3] + 1, size=op[3], name=b"a%d" % op[3])
                t[ino] = v
                assert v._t is t                       # rebound to the row
                v.size += 1
                model[ino] = fresh(op[2]) | {"uid": op[3], "gid": op[3] + 1,
                                             "size": op[3] + 1, "name": b"a%d" % op[3]}
            else:
                assert t.get(ino) is None and ino not in t
            continue
        elif kind == "set":
            setattr(t[ino], op[2], op[3])
            model[ino][op[2]] = op[3]
        elif kind == "own":
            v = t[ino]
            v.uid, v.gid = op[2], op[3]
            model[ino].update(uid=op[2], gid=op[3])
        elif kind == "chmod":
            t[ino].mode = op[2]
            model[ino]["mode"] = op[2]
        elif kind == "name":
            t[ino].name = op[2]
            model[ino]["name"] = op[2]
        elif kind == "xattr":
            t[ino].set_xattr(op[2], op[3])
            model[ino]["xattrs"][op[2]] = op[3]
        elif kind == "ext":
            m = t[ino].extmap()
            m.add(op[2], op[3], 5, 0, 1.0)
            model[ino]["exts"] = [(e.off, e.length) for e in m]
        elif kind == "pop":
            d = t.pop(ino)
            assert state(d) == model.pop(ino)          # a detached copy, whole
            assert ino not in t
        elif kind == "adopt":
            continue
        assert len(t) == len(model)
        # the regular-file count ``status`` reports, kept as rows come, go and change type
        assert t.nreg == sum(stat.S_ISREG(m["mode"]) for m in model.values())
    assert sorted(t) == sorted(model)
    assert [v.ino for v in t.values()] == sorted(model)
    for ino, want in model.items():
        assert state(t[ino]) == want, ino
    # pages go with their last inode
    for ino in list(model):
        del t[ino]
    assert not t.pages and len(t) == 0 and t.nreg == 0


# ---------------------------------------------------------------------------- readdir index
dir_op_s = st.one_of(
    st.tuples(st.just("link"), st.integers(0, 60)),
    st.tuples(st.just("unlink"), st.integers(0, 60)),
    st.tuples(st.just("list"), st.integers(0, 200), st.none() | st.integers(0, 70)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 150), st.lists(dir_op_s, max_size=400))
def test_readdir_index_matches_a_model(first, ops):
    """``entries_after`` (bisect over cookies, tombstones, compaction past 64 dead) against a
    dict of name -> cookie: same entries, cookie order, never more than the limit; a name
    linked again (rename over it) gets a new cookie.  Directories of 0 / some / >64 entries
    before the index is built (the first readdir)."""
    t = InodeTable(4)
    d = t.new(1, stat.S_IFDIR | 0o755)
    for i in range(first):
        d.link(b"p%d" % i, 100 + i)
    model = {b"p%d" % i: 3 + i for i in range(first)}
    assert d.entries_after(0) == sorted(model.items(), key=lambda kv: kv[1])
    for op in ops:
        if op[0] == "link":
            name = b"n%d" % op[1]
            d.link(name, 1000 + op[1])
            model[name] = d.next_cookie - 1
        elif op[0] == "unlink":
            name = b"n%d" % op[1] if op[1] % 3 else b"p%d" % op[1]
            if name in model:
                d.unlink(name)
                del model[name]
        else:
            _, start, limit = op
            want = sorted(((n, c) for n, c in model.items() if c > start), key=lambda kv: kv[1])
            assert d.entries_after(start, limit) == want[:limit], (start, limit)
    assert d.entries_after(0) == sorted(model.items(), key=lambda kv: kv[1])
    assert set(d.entries) == set(model)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFIFO]),
       st.integers(0, 0o7777), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(1, 2**16), st.integers(0, 2**62), st.integers(0, 2**62),
       st.integers(0, 2**40), st.booleans(), st.booleans())
def test_attrs_of_reads_the_row_as_the_view_does(kind, perm, uid, gid, nlink, size, t, rdev,
                                                 caps, other_xattr):
    """``Attrs.of`` reads the row's columns itself (it builds every reply's attributes): the
    same values as the view's properties, for every kind, owner, size and time."""
    from retainzfs.namespace import Attrs
    tab = InodeTable(3)
    v = tab.new(9, kind | perm)
    v.uid, v.gid, v.nlink, v.size = uid, gid, nlink, size
    v.atime, v.mtime, v.ctime = t, t + 1, t + 2
    if rdev:
        v.rdev = rdev
    if caps:
        v.set_xattr(b"security.capability", b"\x01")
    if other_xattr:
        v.set_xattr(b"user.x", b"y")
    a = Attrs.of(tab[9])
    assert (a.ino, a.mode, a.nlink, a.uid, a.gid, a.rdev, a.size, a.atime, a.mtime,
            a.ctime, a.caps) == (9, v.mode, v.nlink, v.uid, v.gid, v.rdev, v.size, v.atime,
                                 v.mtime, v.ctime, caps)
    assert a.stored == (0 if stat.S_ISREG(kind) else -1)
