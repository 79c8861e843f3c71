"""POSIX ACLs: the xattr codec and the rules a file system keeps when the kernel enforces them.

With FUSE_POSIX_ACL the kernel checks access against ACLs and caches them, but the file
system owns the rest (libfuse: "updating the ACLs in the filesystem, keeping the file mode in
sync with the ACL, and ensuring inheritance of default ACLs"): setting an access ACL sets the
mode's permission bits, ``chmod`` rewrites the ACL's owner, mask (or group) and other entries,
and a new node in a directory with a default ACL gets it instead of the umask.  These are the
kernel's own rules (``posix_acl_update_mode``, ``__posix_acl_chmod``,
``posix_acl_create_masq``), as ext4 applies them; here on the xattr bytes, which is what is
stored (in the inode's xattrs, journaled with its mode in one record).

Pure functions, no store state: the callers hold Store.lock.
"""
from __future__ import annotations

import errno
import stat
import struct

from .errors import FsError

ACCESS = b"system.posix_acl_access"
DEFAULT = b"system.posix_acl_default"
NAMES = frozenset({ACCESS, DEFAULT})

VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
_HEAD = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
#: entries kept per ACL: ext4 keeps what fits in a block (~500 in 4 KiB); the kernel's own
#: bound for the xattr is 64 KiB (8,191 entries)
MAX_ENTRIES = 8191

Entries = list[tuple[int, int, int]]     # (tag, perm, id), in the kernel's order


def parse(value: bytes) -> Entries:
    """The entries of an ACL xattr, validated as ``posix_acl_valid`` does (EINVAL if not):
    version 2, whole entries, one owner, owning group and other entry, a mask when any named
    entry is there, named ids ascending and distinct, permissions rwx only."""
    if len(value) < _HEAD.size or (len(value) - _HEAD.size) % _ENTRY.size:
        raise FsError(errno.EINVAL, "malformed POSIX ACL")
    if _HEAD.unpack_from(value)[0] != VERSION:
        raise FsError(errno.EOPNOTSUPP, "POSIX ACL version other than 2")
    n = (len(value) - _HEAD.size) // _ENTRY.size
    if n > MAX_ENTRIES:
        raise FsError(errno.EINVAL, "POSIX ACL of more than %d entries" % MAX_ENTRIES)
    out = [_ENTRY.unpack_from(value, _HEAD.size + i * _ENTRY.size) for i in range(n)]
    if out:
        check(out)
    return out


def check(entries: Entries) -> None:
    """EINVAL unless ``entries`` form a valid ACL (in order)."""
    state, seen_named, last_id = 0, False, -1
    order = {USER_OBJ: 0, USER: 1, GROUP_OBJ: 2, GROUP: 3, MASK: 4, OTHER: 5}
    counts = dict.fromkeys(order, 0)
    for tag, perm, ident in entries:
        if tag not in order or perm & ~0o7:
            raise FsError(errno.EINVAL, "malformed POSIX ACL entry")
        rank = order[tag]
        if rank < state:
            raise FsError(errno.EINVAL, "POSIX ACL entries out of order")
        if rank != state:
            last_id = -1
        state = rank
        counts[tag] += 1
        if tag in (USER, GROUP):
            seen_named = True
            if ident == UNDEFINED_ID or ident <= last_id:
                raise FsError(errno.EINVAL, "POSIX ACL named entries out of order or twice")
            last_id = ident
    if (counts[USER_OBJ] != 1 or counts[GROUP_OBJ] != 1 or counts[OTHER] != 1
            or counts[MASK] > 1 or (seen_named and not counts[MASK])):
        raise FsError(errno.EINVAL, "POSIX ACL without its owner, group, other or mask entry")


def encode(entries: Entries) -> bytes:
    return _HEAD.pack(VERSION) + b"".join(_ENTRY.pack(t, p, i) for t, p, i in entries)


def equiv_mode(entries: Entries) -> tuple[int, bool]:
    """(the permission bits the ACL gives the mode, whether the mode says all of it):
    ``posix_acl_equiv_mode``.  A mask or a named entry is more than mode bits can say."""
    mode, equiv = 0, True
    for tag, perm, _ in entries:
        if tag == USER_OBJ:
            mode |= perm << 6
        elif tag == GROUP_OBJ:
            mode |= perm << 3
        elif tag == OTHER:
            mode |= perm
        elif tag == MASK:
            mode = (mode & ~0o070) | (perm << 3)
            equiv = False
        else:
            equiv = False
    return mode, equiv


def set_access(mode: int, value: bytes) -> tuple[int, bytes | None]:
    """setxattr of the access ACL: (the new mode, the xattr to keep, None when the mode says
    it all and none is kept, as ext4 keeps none)."""
    entries = parse(value)
    if not entries:
        return mode, None
    bits, equiv = equiv_mode(entries)
    mode = (mode & ~0o777) | bits
    return mode, None if equiv else encode(entries)


def set_default(mode: int, value: bytes) -> bytes | None:
    """setxattr of the default ACL: only directories have one (EACCES otherwise, as the
    kernel answers); an empty one removes it."""
    if not stat.S_ISDIR(mode):
        raise FsError(errno.EACCES, "a default ACL is for directories")
    entries = parse(value)
    return encode(entries) if entries else None


def chmod(value: bytes, mode: int) -> bytes:
    """The access ACL after ``chmod(mode)``: owner, other, and the mask (the owning group
    without one) take the new bits; named entries stay."""
    entries = parse(value)
    out, has_mask = [], any(t == MASK for t, _, _ in entries)
    for tag, perm, ident in entries:
        if tag == USER_OBJ:
            perm = (mode >> 6) & 7
        elif tag == OTHER:
            perm = mode & 7
        elif tag == MASK or (tag == GROUP_OBJ and not has_mask):
            perm = (mode >> 3) & 7
        out.append((tag, perm, ident))
    return encode(out)


def inherit(parent_default: bytes | None, mode: int, umask: int) -> tuple[int, dict]:
    """A new node's mode and ACL xattrs in a directory: without a default ACL the umask
    applies; with one, it replaces the umask (``posix_acl_create``): the access ACL is the
    default ACL narrowed by the mode asked for, a directory inherits the default ACL too.
    Symlinks get neither (their mode is fixed)."""
    if stat.S_ISLNK(mode):
        return mode, {}
    if parent_default is None:
        return mode & ~(umask & 0o777), {}
    entries = parse(parent_default)
    if not entries:
        return mode & ~(umask & 0o777), {}
    xattrs = {DEFAULT: parent_default} if stat.S_ISDIR(mode) else {}
    m = mode & 0o777
    out, not_equiv, group_i, mask_i = [], False, None, None
    for tag, perm, ident in entries:
        if tag == USER_OBJ:
            perm &= (m >> 6) & 7
            m &= (perm << 6) | ~0o700
        elif tag in (USER, GROUP):
            not_equiv = True
        elif tag == GROUP_OBJ:
            group_i = len(out)
        elif tag == OTHER:
            perm &= m & 7
            m &= perm | ~0o007
        elif tag == MASK:
            mask_i = len(out)
            not_equiv = True
        out.append([tag, perm, ident])
    g = out[mask_i if mask_i is not None else group_i]
    g[1] &= (m >> 3) & 7
    m &= (g[1] << 3) | ~0o070
    if not_equiv:
        xattrs[ACCESS] = encode([tuple(e) for e in out])
    return (mode & ~0o777) | (m & 0o777), xattrs
