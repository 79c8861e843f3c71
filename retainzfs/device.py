"""Zoned devices: the bottom layer of retainzfs.

Two backends behind one ABC:

* ``ImageZonedDevice`` emulates a zoned device on a regular (sparse) file -- the embedded
  default, and what every test above this layer runs on.
* ``BlockZonedDevice`` drives a Linux host-managed zoned block device (a ZNS namespace)
  through the ``linux/blkzoned.h`` ioctls, with O_DIRECT data I/O (``_DirectIO``: aligned
  bounce buffers).  ``ImageZonedDevice(path, direct=True)`` runs that same O_DIRECT data
  path on an image file (benchmarks and tests of the block path on hosts without a zoned
  device); the image format and the zone rules do not change.

Both run the *same* zone state machine and open/active accounting locally (in the ABC), so
the store sees identical errors on an image and on hardware.  Errors are ``OSError`` with
the errno Linux uses (EINVAL, ETOOMANYREFS, EOVERFLOW, EIO); problems with the target itself
(missing, foreign, in use, unsupported) are ``DeviceError`` with a one-line message.

Thread safety: state-changing calls (write, reset, finish, open, close, report) are
serialised by a per-device lock; ``read`` may run concurrently from any number of threads.
The write half (reservations, parallel writes committed in zone order) is ``ZoneWrites``
(``zonewrites.py``), the base class; zone states and errors are ``zonestate.py``'s.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
import threading
from abc import ABC, abstractmethod
from typing import NamedTuple, Union

import crc32c as _crc32c

from . import _iobuf
from .errors import FsError
from .zonestate import (_ACTIVE, _CLOSED, _COND_OF, _EMPTY, _EXP_OPEN, _FULL, _IMP_OPEN,  # noqa: F401
                        _NOT_WP, _OFFLINE, _OP_CLOSE, _OP_FINISH, _OP_OPEN, _OP_RESET, _OPEN,
                        _READONLY, _VALID_COND, DeviceError, Zone, ZoneCond, _err)
from .zonewrites import ZoneWrites

log = logging.getLogger("retainzfs")

__all__ = [
    "DeviceError", "ZoneCond", "Zone", "ZonedDevice", "ImageZonedDevice", "BlockZonedDevice",
    "open_device", "create_image",
]

Buffer = Union[bytes, bytearray, memoryview]

MiB = 1 << 20


class ZonedDevice(ZoneWrites, ABC):
    """A zoned device: equal power-of-two zones, sequential writes at each zone's wp.

    The zone state machine and the open/active limits (0 = unlimited) are enforced here, in
    one place, so both backends fail identically.  Limits are strict like QEMU's ZNS model
    with auto-transition off: no implicit auto-close; the caller closes zones itself.
    Backends supply the medium I/O through the ``_io_*`` / ``_persist`` hooks.
    """

    path: str
    readonly = False            # opened O_RDONLY (open_device(readonly=True)): never written
    block_size: int
    zone_size: int
    zone_capacity: int
    nr_zones: int
    max_open: int
    max_active: int
    bytes_written: int
    resets: int
    #: zone -> why its state as read from the medium was not valid (image backend only)
    damaged: dict[int, str] = {}

    # -- setup -------------------------------------------------------------------------

    def _init_state(self, path: str, block_size: int, zone_size: int, zone_capacity: int,
                    nr_zones: int, max_open: int, max_active: int, wps: list[int],
                    conds: list[int], caps: list[int], sizes: list[int]) -> None:
        self.path = path
        self.block_size = block_size
        self.zone_size = zone_size
        self.zone_capacity = zone_capacity
        self.nr_zones = nr_zones
        self.max_open = max_open
        self.max_active = max_active
        self.bytes_written = 0
        self.resets = 0
        self._zshift = zone_size.bit_length() - 1
        self._lock = threading.Lock()
        # reservations (``reserve``) wait on this for their turn; management commands for a
        # zone's reservations to be committed
        self._cv = threading.Condition(self._lock)
        self._set_table(wps, conds, caps, sizes)

    def _set_table(self, wps: list[int], conds: list[int], caps: list[int],
                   sizes: list[int]) -> None:
        self._wp = wps
        self._cond = conds
        self._cap = caps
        self._size = sizes
        self._init_turns(wps)
        self._nopen = sum(1 for c in conds if c in _OPEN)
        self._nactive = sum(1 for c in conds if c in _ACTIVE)

    # -- backend hooks ---------------------------------------------------------------------

    @abstractmethod
    def _io_write(self, zone: int, wp: int, data: Buffer, n: int) -> None:
        """Write all ``n`` bytes of ``data`` at ``wp`` of ``zone`` (rules already checked)."""

    @abstractmethod
    def _io_read(self, zone: int, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset`` of ``zone`` (bounds already checked)."""

    #: True when ``_io_read_view`` has a cheaper buffer than ``_io_read``'s bytes
    _view_reads = False

    def _io_read_view(self, zone: int, offset: int, length: int) -> Buffer:
        """``_io_read`` into whatever buffer is cheapest (only called when ``_view_reads``)."""
        return self._io_read(zone, offset, length)

    @abstractmethod
    def _io_mgmt(self, op: str, zone: int) -> None:
        """Issue a zone-management command on the medium before the cached state changes."""

    @abstractmethod
    def _persist(self, zone: int) -> None:
        """Record the cached wp/cond of ``zone`` on the medium (no-op for real devices)."""

    @abstractmethod
    def _reload(self) -> None:
        """Re-read the whole zone table from the medium into the cache."""

    def _after_mgmt(self, op: str, zone: int, old_wp: int) -> None:
        """Hook after a management command updated the cache (images: discard data)."""

    def _opening(self, zone: int) -> None:
        """Hook as an EMPTY zone opens, before its first write (device lock held; images:
        allocate its blocks)."""

    def keep_allocated(self, zones: range) -> int:
        """Keep the medium's space for ``zones`` (the metadata zones) allocated, so their
        writes cannot fail for want of room below the device: 0, or the errno that stopped
        it.  Only an image, on a host file system that can fill, needs it."""
        return 0

    def medium_free(self) -> int | None:
        """Bytes the medium below the zones can still take, when that can be less than the
        empty zones (an image's host file system); None: the zones are the medium."""
        return None

    @abstractmethod
    def flush(self) -> None:
        """Make written data and the zone table durable (survives power loss)."""

    @abstractmethod
    def _release(self) -> None:
        """Close the medium and drop the exclusive lock; idempotent."""

    # -- queries -----------------------------------------------------------------------

    def zone(self, i: int) -> Zone:
        """A copy of the cached state of zone ``i`` (cheap; no I/O)."""
        if not 0 <= i < self.nr_zones:
            raise IndexError(f"zone {i} out of range (0..{self.nr_zones - 1})")
        return Zone(i, i << self._zshift, self._size[i], self._cap[i], self._wp[i],
                    _COND_OF[self._cond[i]])

    def zones(self) -> list[Zone]:
        """Copies of all cached zones."""
        return [self.zone(i) for i in range(self.nr_zones)]

    def report(self) -> list[Zone]:
        """Re-read zone states from the medium (the truth after an error), then ``zones()``."""
        with self._lock:
            self._reload()
        return self.zones()

    def open_count(self) -> int:
        """Zones holding an open resource (IMP_OPEN + EXP_OPEN)."""
        return self._nopen

    def active_count(self) -> int:
        """Zones holding an active resource (open + CLOSED)."""
        return self._nactive

    # -- state machine -----------------------------------------------------------------

    def _check_zone(self, zone: int) -> None:
        if not 0 <= zone < self.nr_zones:
            raise _err(errno.EINVAL, f"zone {zone} out of range (0..{self.nr_zones - 1})")

    def _state_error(self, zone: int, cond: int, op: str) -> OSError:
        if cond == _READONLY or cond == _OFFLINE:
            return _err(errno.EIO, f"zone {zone} is {ZoneCond(cond).name}: cannot {op}")
        if cond == _FULL:
            return _err(errno.EINVAL, f"zone {zone} is FULL: cannot {op}")
        return _err(errno.EINVAL, f"zone {zone} is conventional (NOT_WP): cannot {op}")

    def _check_resources(self, zone: int, act: int, opn: int) -> None:
        # Same order as QEMU (nvme_zns_check_resources): active first, then open.
        if act and self.max_active and self._nactive + act > self.max_active:
            raise _err(errno.EOVERFLOW,
                       f"zone {zone}: too many active zones (max_active={self.max_active})")
        if opn and self.max_open and self._nopen + opn > self.max_open:
            raise _err(errno.ETOOMANYREFS,
                       f"zone {zone}: too many open zones (max_open={self.max_open})")

    def _set_cond(self, zone: int, new: int) -> None:
        old = self._cond[zone]
        if old != new:
            self._nopen += (new in _OPEN) - (old in _OPEN)
            self._nactive += (new in _ACTIVE) - (old in _ACTIVE)
            self._cond[zone] = new

    def read(self, zone: int, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset`` within the zone; any range inside capacity.

        Bytes past the write pointer read as zeros on an image (a real device may differ).
        """
        self._check_read(zone, offset, length)
        return self._io_read(zone, offset, length) if length else b""

    def read_view(self, zone: int, offset: int, length: int) -> Buffer:
        """``read``, as any buffer: on the O_DIRECT path the aligned buffer the device read
        into, with no copy to a ``bytes`` (the FUSE reply is taken from it)."""
        if not self._view_reads:
            return self.read(zone, offset, length)
        self._check_read(zone, offset, length)
        return self._io_read_view(zone, offset, length) if length else b""

    def _check_read(self, zone: int, offset: int, length: int) -> None:
        if not 0 <= zone < self.nr_zones:
            raise _err(errno.EINVAL, f"zone {zone} out of range (0..{self.nr_zones - 1})")
        if self._cond[zone] == _OFFLINE:
            raise _err(errno.EIO, f"zone {zone} is OFFLINE: cannot read")
        if offset < 0 or length < 0 or offset + length > self._cap[zone]:
            raise _err(errno.EINVAL, f"zone {zone}: read of {length} bytes at {offset} is "
                                     f"outside the zone capacity {self._cap[zone]}")

    def reset(self, zone: int) -> None:
        """Rewind the zone: wp = 0, EMPTY, resources released.  Resetting EMPTY is a no-op."""
        with self._lock:
            self._check_zone(zone)
            cond = self._cond[zone]
            if cond == _NOT_WP or cond == _READONLY or cond == _OFFLINE:
                raise self._state_error(zone, cond, "reset")
            if cond == _EMPTY:
                return
            self._drain_locked(zone)
            self._io_mgmt(_OP_RESET, zone)
            old_wp = self._wp[zone]
            self._wp[zone] = 0
            self._settle_locked(zone)
            self._set_cond(zone, _EMPTY)
            self.resets += 1
            self._persist(zone)
            if self.damaged:
                self.damaged.pop(zone, None)        # the entry is rewritten
            self._after_mgmt(_OP_RESET, zone, old_wp)

    def finish(self, zone: int) -> None:
        """Make the zone FULL (wp = capacity), releasing its resources.

        Like NVMe and QEMU, an EMPTY zone may be finished and needs no free resource.
        """
        with self._lock:
            self._check_zone(zone)
            cond = self._cond[zone]
            if cond == _FULL:
                return
            if cond == _NOT_WP or cond == _READONLY or cond == _OFFLINE:
                raise self._state_error(zone, cond, "finish")
            self._drain_locked(zone)
            if self._cond[zone] == _FULL:
                return
            self._io_mgmt(_OP_FINISH, zone)
            old_wp = self._wp[zone]
            self._wp[zone] = self._cap[zone]
            self._settle_locked(zone)
            self._set_cond(zone, _FULL)
            self._persist(zone)
            self._after_mgmt(_OP_FINISH, zone, old_wp)

    def open(self, zone: int) -> None:
        """Explicitly open the zone (EXP_OPEN); same limit errors as an implicit open."""
        with self._lock:
            self._check_zone(zone)
            cond = self._cond[zone]
            if cond == _EXP_OPEN:
                return
            if cond == _EMPTY:
                self._check_resources(zone, 1, 1)
                self._opening(zone)
            elif cond == _CLOSED:
                self._check_resources(zone, 0, 1)
            elif cond != _IMP_OPEN:
                raise self._state_error(zone, cond, "open")
            self._io_mgmt(_OP_OPEN, zone)
            self._set_cond(zone, _EXP_OPEN)
            self._persist(zone)
            self._after_mgmt(_OP_OPEN, zone, self._wp[zone])

    def close(self, zone: int | None = None) -> None:
        """``close(zone)``: release the zone's open resource (CLOSED, or EMPTY if wp == 0).
        ``close()``: release the device itself and its exclusive lock.

        Closing a zone that is not open (EMPTY/CLOSED/FULL) is a no-op, so callers can close
        defensively without tracking auto-FULL transitions.
        """
        if zone is None:
            self._release()
            return
        with self._lock:
            self._check_zone(zone)
            self._drain_locked(zone)
            cond = self._cond[zone]
            if cond == _IMP_OPEN or cond == _EXP_OPEN:
                self._io_mgmt(_OP_CLOSE, zone)
                self._set_cond(zone, _CLOSED if self._wp[zone] else _EMPTY)
                self._persist(zone)
                self._after_mgmt(_OP_CLOSE, zone, self._wp[zone])
            elif cond == _NOT_WP or cond == _READONLY or cond == _OFFLINE:
                raise self._state_error(zone, cond, "close")

    # -- misc ------------------------------------------------------------------------------

    def __enter__(self) -> "ZonedDevice":
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {getattr(self, 'path', '?')!r} "
                f"zones={getattr(self, 'nr_zones', '?')} zone_size={getattr(self, 'zone_size', '?')}>")


# ======================================================================================
# O_DIRECT data path (shared by BlockZonedDevice and ImageZonedDevice(direct=True))
# ======================================================================================

_DIO_CHUNK = 8 * MiB                     # bounce buffer size (tests shrink it to force chunking)
_DIO_ZERO_COPY_MIN = 64 * 1024           # below this a copy is cheaper than a failed try
#: An image's zone writes below this go through the page cache even with ``direct=True``: a
#: small file's close writes one padded block, and a synchronous disk write per close would
#: cost a millisecond each; ``flush()`` (fsync of the one inode) makes both kinds durable, and
#: the kernel keeps the two coherent (a direct read writes back dirty pages it overlaps).
_IMAGE_DIRECT_MIN = 256 * 1024


def _bytes_filler():
    """(new_bytes(n), pread_into(fd, obj, got, n, off)) to read straight into a fresh ``bytes``
    object (``PyBytes_FromStringAndSize(NULL, n)``, filled before anyone else sees it), or
    None when this interpreter's layout does not check out.  pread_into returns bytes read or
    -errno; the GIL is released during the pread."""
    try:
        import ctypes
        new = ctypes.pythonapi.PyBytes_FromStringAndSize
        new.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
        new.restype = ctypes.py_object
        libc = ctypes.CDLL(None, use_errno=True)
        pread = libc.pread
        pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
        pread.restype = ctypes.c_ssize_t
        hdr = bytes.__basicsize__ - 1                    # offset of ob_sval (CPython)
        probe = new(b"retainz!", 8)
        if ctypes.string_at(id(probe) + hdr, 8) != b"retainz!":
            return None
    except (ImportError, OSError, AttributeError, TypeError, ValueError):
        return None
    get_errno = ctypes.get_errno

    def new_bytes(n: int) -> bytes:
        return new(None, n)

    def pread_into(fd: int, obj: bytes, got: int, n: int, off: int) -> int:
        r = pread(fd, id(obj) + hdr + got, n, off)
        return r if r >= 0 else -get_errno()
    return new_bytes, pread_into


_BYTES_FILLER: "tuple | None | bool" = False   # resolved on first use


class _DirectIO:
    """Aligned bounce-buffer pwrite/pread on a file descriptor opened with O_DIRECT.

    O_DIRECT wants the memory, the file offset and the length aligned (to the logical block
    size); callers' buffers are arbitrary Python objects, so data is copied through
    page-aligned anonymous mmaps of ``_DIO_CHUNK`` bytes: one for writes (writes are
    serialised by the device lock) and one per reading thread (reads run concurrently).
    Reads may start and end anywhere: the aligned span around them is read and sliced.
    The fd belongs to the caller; ``close()`` only drops the buffers.

    Zero copy where the kernel allows it: since Linux 6.0 O_DIRECT memory only needs the
    queue's DMA alignment (NVMe: 4 bytes; virtio-blk: 512), so large block-aligned writes are
    first tried straight from the caller's buffer and large block-aligned reads straight
    into the returned ``bytes``; the first EINVAL (memory not aligned enough, older kernel)
    turns that direction back to the bounce buffers for good on this descriptor.
    """

    def __init__(self, fd: int, path: str, align: int) -> None:
        self.fd = fd
        self.path = path
        self.align = align
        self._scratch: _iobuf.AlignedBuf | None = _iobuf.AlignedBuf(_DIO_CHUNK)
        self._scratch_lock = threading.Lock()    # writes of an image may run in parallel
        self._tls = threading.local()
        self.zero_copy_write = True          # False after the kernel refused once
        global _BYTES_FILLER
        if _BYTES_FILLER is False:           # once per process, here rather than in a read
            _BYTES_FILLER = _bytes_filler()
        self.zero_copy_read = _BYTES_FILLER is not None

    def pwrite(self, off: int, data: Buffer, n: int) -> None:
        """Write all ``n`` bytes of ``data`` (a buffer or a scatter list) at ``off``.

        ``off`` and ``n`` must be multiples of ``align`` (the zone rules guarantee it).  A
        scatter list is copied once into the aligned scratch buffer, without the GIL.
        """
        single = not (type(data) is list or type(data) is tuple)
        if (not single and self.zero_copy_write and n >= _DIO_ZERO_COPY_MIN
                and _iobuf.aligned_parts(data, self.align)):
            if self._pwritev_parts(off, data, n):
                return
        elif single and self.zero_copy_write and n >= _DIO_ZERO_COPY_MIN:
            src = data if type(data) is memoryview and data.format == "B" else memoryview(data).cast("B")
            done = 0
            try:
                while done < n:
                    w = os.pwrite(self.fd, src[done:n], off + done)
                    if w <= 0 or w % self.align:
                        raise _err(errno.EIO, f"{self.path}: short direct write ({w} of "
                                              f"{n - done} bytes)")
                    done += w
                return
            except OSError as e:
                if e.errno != errno.EINVAL or done:
                    raise
                self.zero_copy_write = False    # memory alignment refused: bounce from now on
        try:
            with self._scratch_lock:
                w = _iobuf.gather_pwrite(self.fd, off, [data] if single else data, n,
                                         self._scratch)
        except OSError as e:
            raise _err(e.errno or errno.EIO, f"{self.path}: {e.strerror}") from None
        if w != n:
            raise _err(errno.EIO, f"{self.path}: short direct write ({w} of {n} bytes)")

    def _pwritev_parts(self, off: int, parts, n: int) -> bool:
        """``pwritev`` of a scatter list whose buffers are all page-aligned whole blocks,
        straight from them (a flush of FUSE write requests); False (nothing written) when the
        kernel refuses the memory, which turns zero copy off on this descriptor."""
        views = [p if type(p) is memoryview else memoryview(p) for p in parts]
        total = sum(v.nbytes for v in views)
        if total != n:
            raise ValueError(f"direct write: {total} bytes in the parts, {n} expected")
        done = 0
        while done < n:
            try:
                w = os.pwritev(self.fd, views, off + done)
            except OSError as e:
                if e.errno == errno.EINVAL and not done:
                    self.zero_copy_write = False    # memory alignment refused: bounce
                    return False
                raise _err(e.errno or errno.EIO, f"{self.path}: {e.strerror}") from None
            if w <= 0 or w % self.align:
                raise _err(errno.EIO, f"{self.path}: short direct write ({w} of {n - done} "
                                      f"bytes)")
            done += w
            while w:                            # drop what was written (rare: short write)
                k = views[0].nbytes
                if w >= k:
                    views.pop(0)
                    w -= k
                else:
                    views[0] = views[0][w:]
                    w = 0
        return True

    def pread_view(self, off: int, length: int) -> memoryview:
        """Read ``length`` bytes at ``off`` into a pooled page-aligned buffer (one DMA, no
        copy); the view keeps the buffer, which returns to the pool when the view dies."""
        try:
            return memoryview(_iobuf.pread_aligned(self.fd, off, length, self.align))
        except OSError as e:
            raise _err(e.errno or errno.EIO, f"{self.path}: {e.strerror}") from None

    def _read_buf(self) -> memoryview:
        mv = getattr(self._tls, "mv", None)
        if mv is None:
            self._tls.mm = mmap.mmap(-1, _DIO_CHUNK)
            mv = self._tls.mv = memoryview(self._tls.mm)
        return mv

    def pread(self, off: int, length: int) -> bytes:
        """Read ``length`` bytes at ``off`` (any alignment; ``length`` > 0)."""
        a = self.align
        if (self.zero_copy_read and length >= _DIO_ZERO_COPY_MIN and not (off | length) % a):
            out = self._pread_bytes(off, length)
            if out is not None:
                return out
        start = off - off % a
        end = _align_up(off + length, a)
        buf = self._read_buf()
        chunk = len(buf)
        if end - start <= chunk:
            self._pread_exact(buf, end - start, start)
            skip = off - start
            return bytes(buf[skip:skip + length])
        out = bytearray(length)
        pos = start
        filled = 0
        while pos < end:
            k = min(end - pos, chunk)
            self._pread_exact(buf, k, pos)
            lo = max(off, pos) - pos
            hi = min(off + length, pos + k) - pos
            out[filled:filled + hi - lo] = buf[lo:hi]
            filled += hi - lo
            pos += k
        return bytes(out)

    def _pread_bytes(self, off: int, length: int) -> bytes | None:
        """Aligned read straight into a new ``bytes``; None when not possible here."""
        if not _BYTES_FILLER:
            self.zero_copy_read = False
            return None
        new_bytes, pread_into = _BYTES_FILLER
        out = new_bytes(length)
        got = 0
        while got < length:
            r = pread_into(self.fd, out, got, length - got, off + got)
            if r > 0:
                got += r
            elif r == -errno.EINTR:
                continue
            elif r == -errno.EINVAL and not got:
                self.zero_copy_read = False     # memory alignment refused: bounce from now on
                return None
            elif r == 0:
                raise _err(errno.EIO, f"{self.path}: short direct read at {off + got}")
            else:
                raise OSError(-r, f"{self.path}: direct read at {off + got}: {os.strerror(-r)}")
        return out

    def _pread_exact(self, buf: memoryview, k: int, off: int) -> None:
        got = 0
        while got < k:
            r = os.preadv(self.fd, [buf[got:k]], off + got)
            if r <= 0:
                raise _err(errno.EIO, f"{self.path}: short direct read at {off + got}")
            got += r

    def close(self) -> None:
        """Drop the write buffer (the per-thread read buffers go with their threads)."""
        self._scratch = None


# ======================================================================================
# Emulated zoned device on a regular file
# ======================================================================================

IMAGE_MAGIC = b"RZIMG001"
IMAGE_VERSION = 1
_HDR = struct.Struct("<8sIIQQIIIQ")      # magic ver bs zsize zcap nr max_open max_active data_off
_CRC = struct.Struct("<I")
_HEADER_BLOCK = 4096                     # header block; the zone table starts right after it
_ENTRY = struct.Struct("<QB7x")          # per-zone: wp (bytes, relative), cond; 16 bytes
_MIN_DATA_ALIGN = 1 * MiB
_MIN_ZONES = 4


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _image_layout(nr_zones: int, zone_size: int) -> tuple[int, int]:
    """(table_offset, data_offset): data aligned to max(zone_size, 1 MiB)."""
    table_end = _HEADER_BLOCK + _align_up(nr_zones * _ENTRY.size, _HEADER_BLOCK)
    return _HEADER_BLOCK, _align_up(table_end, max(zone_size, _MIN_DATA_ALIGN))


def _access(readonly: bool) -> int:
    """O_RDONLY for a target opened read-only (``open_device(readonly=True)``), else O_RDWR."""
    return os.O_RDONLY if readonly else os.O_RDWR


def _read_only_hint(path: str, flags: int) -> str:
    """When writing was refused but reading is allowed: say that ``-o ro`` mounts it (an image
    or device the user may only read: another user's, chmod 444, a disk group with r--)."""
    if flags & os.O_ACCMODE != os.O_RDONLY and os.access(path, os.R_OK):
        return " for writing (this user may only read it; mount.retainzfs -o ro mounts it so)"
    return ""


def _close_released(fd: int, path: str) -> None:
    """close(2) of a device or image descriptor at release, whose error is said, not raised:
    the descriptor is gone either way (Linux), and what it reports -- a write the host had
    not stored, as an image on a file system that failed (found at stop 53: a FUSE host in
    its failed state answered the close EIO, and the unmount ended in "daemon failed" with a
    traceback before saying it was done) -- is for the next mount's recovery, which checks
    what no flush proved."""
    try:
        os.close(fd)
    except OSError as e:
        log.warning("closing %s: %s (a write its host had not stored may be lost; the next "
                    "mount checks what no flush proved)", path, e.strerror or e)


def _open_locked(path: str, flags: int, what: str = "zoned image") -> int:
    """Open ``path`` and take an exclusive flock, mapping failures to DeviceError."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DeviceError(f"{path}: no such file or device") from None
    except IsADirectoryError:
        raise DeviceError(f"{path} is a directory, not a {what}") from None
    except PermissionError:
        raise DeviceError(f"{path}: permission denied{_read_only_hint(path, flags)}") from None
    except OSError as e:
        raise DeviceError(f"{path}: cannot open: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DeviceError(f"{path} is in use by another process") from None
    except OSError as e:
        os.close(fd)
        raise DeviceError(f"{path}: cannot lock: {e.strerror}") from None
    return fd


_libc_fallocate = None


def _fallocate(fd: int, mode: int, off: int, length: int) -> int:
    """fallocate(2): 0, or the errno (EOPNOTSUPP where libc has none)."""
    global _libc_fallocate
    if _libc_fallocate is None:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            f = libc.fallocate
            f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            f.restype = ctypes.c_int
            _libc_fallocate = f
        except (OSError, AttributeError):
            _libc_fallocate = False
    if not _libc_fallocate:
        return errno.EOPNOTSUPP
    import ctypes
    return 0 if _libc_fallocate(fd, mode, off, length) == 0 else ctypes.get_errno()


_FALLOC_KEEP_SIZE, _FALLOC_PUNCH_HOLE, _FALLOC_ZERO_RANGE = 0x01, 0x02, 0x10


def _punch_hole(fd: int, off: int, length: int) -> bool:
    """Deallocate a file range (FALLOC_FL_PUNCH_HOLE|KEEP_SIZE); False when unsupported."""
    return _fallocate(fd, _FALLOC_PUNCH_HOLE | _FALLOC_KEEP_SIZE, off, length) == 0


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_NOCOW_FL = 0x80086601, 0x40086602, 0x00800000


def _set_nocow(fd: int) -> None:
    """``chattr +C`` on a new (empty) image: on a copy-on-write host (btrfs) an overwrite of
    the blocks the image holds (the metadata zones', fallocated to be sure of their room)
    takes new space unless the file is NOCOW, so a full host failed the journal and every
    unlink after it with EIO.  Ignored where there is no such flag (ext4, xfs, tmpfs)."""
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 4))[0]
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | _FS_NOCOW_FL))
    except OSError:
        pass


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _pwritev_all(fd: int, parts, off: int, n: int, path: str) -> None:
    """Write a scatter list completely: at most IOV_MAX buffers per call, short writes resumed.

    Why: one ``pwritev`` accepts at most IOV_MAX buffers (EINVAL beyond) and may write less
    than asked; a file written in many small pieces must never fail or lose bytes for either.
    """
    views = [p if type(p) is memoryview else memoryview(p) for p in parts]
    i = 0
    done = 0
    while i < len(views):
        batch = views[i:i + IOV_MAX]
        want = sum(v.nbytes for v in batch)
        w = os.pwritev(fd, batch, off + done)
        if w <= 0 and want:
            raise _err(errno.EIO, f"{path}: short write")
        done += w
        if w == want:
            i += len(batch)
            continue
        # short: skip the fully written buffers, trim the partly written one
        while w and views[i].nbytes <= w:
            w -= views[i].nbytes
            i += 1
        if w:
            views[i] = views[i].cast("B")[w:]
    if done != n:
        raise _err(errno.EIO, f"{path}: wrote {done} of {n} bytes")


class ImageZonedDevice(ZonedDevice):
    """A zoned device emulated on a regular file (sparse; may exceed 4 GiB).

    Layout: a 4 KiB header block (magic RZIMG001, geometry, limits, crc32c), the zone table
    (16 bytes per zone: wp u64, cond u8), then the data area aligned to max(zone_size,
    1 MiB): zone i's data is at data_off + i*zone_size.

    Every wp/cond change is written to the table with pwrite (no fsync), so a killed process
    -- whose page cache survives -- reopens with the exact write pointers; ``flush()`` adds
    the fsync needed for power loss.  Zone conditions persist across reopen exactly as on a
    real device (reopening does not close open zones).  An exclusive flock marks the image in
    use.

    ``direct=True`` moves zone data reads and writes of ``_IMAGE_DIRECT_MIN`` bytes or more to
    a second descriptor opened with O_DIRECT and the aligned path of ``BlockZonedDevice``
    (the mount's default: one copy less and the disk busy during a save, not after it; and
    the block path's I/O measured and tested on a regular file); small ones, header, zone
    table and flock stay on the buffered descriptor, and the image format and zone
    semantics are the same either way.
    Needs a file system with O_DIRECT whose alignment the image's block size satisfies.
    """

    _dio: "_DirectIO | None" = None
    _dfd = -1
    _kept: frozenset = frozenset()      # zones whose blocks stay allocated (keep_allocated)
    _alloc: set                         # data zones whose whole capacity the image holds
    _host_full = False                  # the last zone write found the host file system full
    _host_ro = False                    # a zone write found the host file system read-only
    _host_ro_reads = False              # a direct read was refused (EROFS): read buffered
    parallel_writes = True      # a file takes writes anywhere, at any time

    def __init__(self, path: str | os.PathLike[str], direct: bool = False,
                 readonly: bool = False) -> None:
        self._fd = -1
        path = os.fspath(path)
        self.readonly = readonly
        fd = _open_locked(path, _access(readonly))
        try:
            self._attach(path, fd)
            if direct:
                self._open_direct()
        except BaseException:
            self._release_direct()
            self._fd = -1                   # so __del__ never closes a reused fd number
            os.close(fd)
            raise

    @property
    def direct(self) -> bool:
        """True when zone data goes through O_DIRECT."""
        return self._dio is not None

    def _open_direct(self) -> None:
        path = self.path
        try:
            dfd = os.open(path, _access(self.readonly) | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise DeviceError(f"{path}: the file system does not support O_DIRECT") from None
            raise DeviceError(f"{path}: cannot open with O_DIRECT: {e.strerror}") from None
        self._dfd = dfd
        a, b = os.fstat(self._fd), os.fstat(dfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            raise DeviceError(f"{path} was replaced while being opened")
        self._dio = _DirectIO(dfd, path, self.block_size)
        try:                                # probe: the first block through the aligned path
            self._dio.pread(self._data_off, self.block_size)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            raise DeviceError(f"{path}: O_DIRECT here needs a larger alignment than the "
                              f"image block size {self.block_size}") from None

    def _release_direct(self) -> None:
        dio, self._dio = self._dio, None
        if dio is not None:
            dio.close()
        dfd, self._dfd = self._dfd, -1
        if dfd >= 0:
            _close_released(dfd, getattr(self, "path", "the image"))

    def _attach(self, path: str, fd: int) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DeviceError(f"{path} is not a regular file")
        raw = os.pread(fd, _HDR.size + _CRC.size, 0)
        if len(raw) < _HDR.size + _CRC.size or raw[:8] != IMAGE_MAGIC:
            raise DeviceError(f"{path} is not a retainzfs zoned image (no {IMAGE_MAGIC.decode()} header)")
        body = raw[:_HDR.size]
        (crc,) = _CRC.unpack_from(raw, _HDR.size)
        if _crc32c.crc32c(body) != crc:
            raise DeviceError(f"{path}: zoned image header is corrupt (checksum mismatch)")
        (_, ver, bs, zsize, zcap, nr, max_open, max_active, data_off) = _HDR.unpack(body)
        if ver != IMAGE_VERSION:
            raise DeviceError(f"{path}: unsupported zoned image version {ver} (expected {IMAGE_VERSION})")
        table_off, min_data_off = _image_layout(nr, zsize)
        if (not _is_pow2(bs) or bs < 512 or not _is_pow2(zsize) or zsize % bs
                or not 0 < zcap <= zsize or zcap % bs or nr < 1
                or data_off < min_data_off or data_off % bs):
            raise DeviceError(f"{path}: zoned image header has an invalid geometry")
        if st.st_size < data_off + nr * zsize:
            raise DeviceError(f"{path}: zoned image is truncated ({st.st_size} bytes, "
                              f"expected {data_off + nr * zsize})")
        self._fd = fd
        self._alloc = set()                 # zones written before this open: unknown, holes
        self._table_off = table_off
        self._data_off = data_off
        wps, conds, self.damaged = self._read_table(path, fd, table_off, nr, zcap)
        self._init_state(path, bs, zsize, zcap, nr, max_open, max_active, wps, conds,
                         [zcap] * nr, [zsize] * nr)

    @staticmethod
    def _read_table(path: str, fd: int, table_off: int, nr: int,
                    zcap: int) -> tuple[list[int], list[int], dict[int, str]]:
        """(write pointers, conditions, damaged entries).  An entry that is not a valid zone
        state (a flipped byte in the image) reads as FULL: every byte of the zone stays
        readable — the store checks what it reads against its checksums and its metadata
        mirror — nothing is written into it, and a reset or ``repair_entry`` rewrites it."""
        raw = os.pread(fd, nr * _ENTRY.size, table_off)
        if len(raw) != nr * _ENTRY.size:
            raise DeviceError(f"{path}: zoned image is truncated (zone table)")
        wps: list[int] = []
        conds: list[int] = []
        damaged: dict[int, str] = {}
        for i, (wp, cond) in enumerate(_ENTRY.iter_unpack(raw)):
            if (cond not in _VALID_COND or cond == _NOT_WP or wp > zcap
                    or (cond == _EMPTY and wp) or (cond == _FULL and wp != zcap)):
                damaged[i] = f"zone table entry {i} is corrupt (wp={wp}, cond={cond:#x})"
                wp, cond = zcap, _FULL
            wps.append(wp)
            conds.append(cond)
        return wps, conds, damaged

    def repair_entry(self, zone: int) -> None:
        """Rewrite a damaged table entry with the state the zone is used in now."""
        with self._lock:
            self._persist(zone)
            self.damaged.pop(zone, None)

    # -- hooks -------------------------------------------------------------------------

    def _io_write(self, zone: int, wp: int, data: Buffer, n: int) -> None:
        try:
            try:
                self._io_write_host(zone, wp, data, n)
            except OSError as e:
                # the host filled before ``medium_free`` saw it: the empty zones' blocks the
                # image held go back, and the write is tried once more
                if e.errno != errno.ENOSPC or isinstance(e, FsError) or not self._give_back():
                    raise
                self._io_write_host(zone, wp, data, n)
        except OSError as e:
            if e.errno == errno.EROFS and not isinstance(e, FsError):
                # the host file system turned read-only under the image (ext4 with
                # errors=remount-ro after a disk error): the writer's EIO, as for every change
                # after it (fsync(2) and write(2) have no EROFS), said once, not a traceback
                # per request
                if not self._host_ro:
                    self._host_ro = True
                    log.error("%s: the host file system under the image is read-only (remounted "
                              "after an error?); changes fail with EIO, reads still work; "
                              "unmount, check the host, mount again", self.path)
                raise FsError(errno.EIO, f"{self.path}: host file system read-only") from None
            if e.errno != errno.ENOSPC or isinstance(e, FsError):
                raise
            # the host file system under the image is full: the writer's ENOSPC (the zone
            # write is taken back), said once per episode, not an I/O error with a traceback
            if not self._host_full:
                self._host_full = True
                log.warning("%s: the host file system is full; writes fail with ENOSPC "
                            "until space is freed there or files are deleted here", self.path)
            raise FsError(errno.ENOSPC, f"{self.path}: host file system full") from None
        self._host_full = False

    def _io_write_host(self, zone: int, wp: int, data: Buffer, n: int) -> None:
        off = self._zone_off(zone) + wp
        if self._dio is not None and n >= _IMAGE_DIRECT_MIN:
            self._dio.pwrite(off, data, n)
            return
        if type(data) is list or type(data) is tuple:
            _pwritev_all(self._fd, data, off, n, self.path)
            return
        done = os.pwrite(self._fd, data, off)
        if done != n:                       # short write (rare): finish it, or raise
            mv = memoryview(data).cast("B")
            while done < n:
                w = os.pwrite(self._fd, mv[done:], off + done)
                if w <= 0:
                    raise _err(errno.EIO, f"{self.path}: short write")
                done += w

    def _io_read(self, zone: int, offset: int, length: int) -> bytes:
        off = self._zone_off(zone) + offset
        if self._dio is not None and length >= _IMAGE_DIRECT_MIN and not self._host_ro_reads:
            try:
                return self._dio.pread(off, length)
            except OSError as e:
                if e.errno != errno.EROFS:
                    raise
                self._direct_reads_refused()
        data = os.pread(self._fd, length, off)
        if len(data) == length:
            return data
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(self._fd, length - got, off + got)
            if not more:
                raise _err(errno.EIO, f"{self.path}: short read (image truncated?)")
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    @property
    def _view_reads(self) -> bool:
        return self._dio is not None

    def _io_read_view(self, zone: int, offset: int, length: int) -> Buffer:
        if length < _IMAGE_DIRECT_MIN or self._host_ro_reads:
            return self._io_read(zone, offset, length)   # small (the page cache may hold
        try:                                             # it), or direct reads refused
            return self._dio.pread_view(self._zone_off(zone) + offset, length)
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            self._direct_reads_refused()
            return self._io_read(zone, offset, length)

    def _direct_reads_refused(self) -> None:
        """An aborted ext4 (errors=remount-ro after a disk error) answers O_DIRECT reads with
        EROFS while buffered reads still work: every read goes through the host's page cache
        from then on, for this mount's life (the host stays read-only until it is mounted
        again; the checksums still check every byte), said once."""
        if not self._host_ro_reads:
            self._host_ro_reads = True
            log.error("%s: the host file system refuses direct reads (read-only after an "
                      "error?); reading through its page cache", self.path)

    def _io_mgmt(self, op: str, zone: int) -> None:
        pass                                # the table entry written by _persist is the command

    def _persist(self, zone: int) -> None:
        os.pwrite(self._fd, _ENTRY.pack(self._wp[zone], self._cond[zone]),
                  self._table_off + zone * _ENTRY.size)

    def _after_mgmt(self, op: str, zone: int, old_wp: int) -> None:
        # A reset zone reads back as zeros and gives its space back to the host filesystem.
        # Done after the table entry so a crash in between leaves stale bytes past wp = 0,
        # never a zone whose committed data vanished.
        if op == _OP_RESET:
            off = self._zone_off(zone)
            if (zone in self._kept or self._host_roomy()) and _fallocate(
                    self._fd, _FALLOC_ZERO_RANGE | _FALLOC_KEEP_SIZE, off, self.zone_size) == 0:
                # zeros in the image's own blocks, kept as a device keeps its flash: the
                # next checkpoint's writes go to blocks the host has, not to space it just
                # discarded (this VM's disk, ext4 with ``discard`` over thin provisioning:
                # bench_io's 8 writers of 1 GiB right after a 1 GiB file was deleted took
                # 1.05-1.15 s into punched zones, 0.60-0.70 s into kept ones)
                if zone not in self._kept:
                    self._alloc.add(zone)
                return
            self._alloc.discard(zone)
            if not _punch_hole(self._fd, off, self.zone_size):
                # (a host that punches no holes, a FUSE one: zeros over what the zone held;
                # nothing for a zone opened and reset before any write -- found on LazyFS)
                zeros = bytes(min(old_wp, 4 * MiB))
                for pos in range(0, old_wp, max(len(zeros), 1)):
                    os.pwrite(self._fd, zeros[:old_wp - pos], off + pos)
            elif zone in self._kept:        # zeros again, still the image's own blocks
                _fallocate(self._fd, _FALLOC_KEEP_SIZE, off, self.zone_size)

    def _host_stat(self):
        """``fstatvfs`` of the host file system, or None when it cannot be read."""
        try:
            return os.fstatvfs(self._fd)
        except OSError:
            return None

    @staticmethod
    def _roomy(st) -> bool:
        """A tenth of the host file system is free: a reset zone keeps its blocks, and the
        empty zones the image holds may stay held (below that they go back)."""
        return st.f_bavail * 10 >= st.f_blocks

    def _host_roomy(self) -> bool:
        st = self._host_stat()
        return st is not None and self._roomy(st)

    def _zone_off(self, zone: int) -> int:
        """Where the zone's data start in the image file."""
        return self._data_off + (zone << self._zshift)

    def _opening(self, zone: int) -> None:
        # Its blocks allocated (unwritten: they read as zeros) before the writes come, and
        # noted (``_alloc``: a tight host gets them back once the zone is empty).  ext4
        # takes the inode lock exclusively for an O_DIRECT write into a hole until it
        # completes (8 x 128 MiB of 4 MiB writes from 8 threads into one file: 0.68-0.74 s
        # into holes, 0.37-0.49 s into allocated blocks).  A host that cannot allocate them
        # says so at the write, as before; what a failed fallocate did allocate (ext4 keeps
        # it) goes back at once, so a nearly full host's last blocks are not held by a zone
        # that may never need them (it holds no data yet).
        if zone in self._kept or zone in self._alloc:
            return
        off = self._zone_off(zone)
        if _fallocate(self._fd, _FALLOC_KEEP_SIZE, off, self._cap[zone]) == 0:
            self._alloc.add(zone)
        else:
            _punch_hole(self._fd, off, self.zone_size)

    def medium_free(self) -> int | None:
        """The host file system's free space.  Below a tenth of its size, the empty zones'
        blocks the image held (``_opening``, a reset while roomy) go back to it first, so
        that what is counted here is what the next zone's writes can take (held zones are
        not where the allocator must write next: counting them let a file system filled,
        emptied and filled again take a tenth as much the second time)."""
        st = self._host_stat()
        if st is not None and not self._roomy(st) and self._give_back():
            st = self._host_stat()
        return None if st is None else st.f_bavail * st.f_frsize

    def _give_back(self) -> bool:
        """Punch the empty zones whose blocks the image holds (the device lock keeps them
        empty meanwhile: an opening takes it); True when there were any.  Not called with
        the device lock held (zone writes on an image take none)."""
        if not self._alloc:
            return False
        n = 0
        with self._lock:
            for z in list(self._alloc):
                if self._cond[z] == _EMPTY and not self._pending[z]:
                    self._alloc.discard(z)
                    _punch_hole(self._fd, self._zone_off(z), self.zone_size)
                    n += 1
        return n > 0

    def keep_allocated(self, zones: range) -> int:
        """The metadata zones' blocks stay allocated in the image (``fallocate``; a reset
        zeroes them in place, or punches and allocates them again): on a host file system that fills up, a journal frame would
        otherwise fail for want of host space, and the journal refuses every write after a
        failed one (a 512 MiB image on an 80 MiB tmpfs: every unlink then failed with EIO)."""
        self._kept = frozenset(zones)
        for z in zones:
            err = _fallocate(self._fd, _FALLOC_KEEP_SIZE, self._zone_off(z),
                             self.zone_size)
            if err:
                return err
        return 0

    def _reload(self) -> None:
        wps, conds, self.damaged = self._read_table(self.path, self._fd, self._table_off,
                                                    self.nr_zones, self.zone_capacity)
        self._set_table(wps, conds, self._cap, self._size)

    def flush(self) -> None:
        os.fsync(self._fd)                  # per inode: covers the O_DIRECT descriptor's data too

    def _release(self) -> None:
        self._release_direct()
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            _close_released(fd, getattr(self, "path", "the image"))   # drops the flock

    # -- emulator-only -------------------------------------------------------------------

    def inject_fault(self, zone: int, cond: ZoneCond = ZoneCond.OFFLINE) -> None:
        """Put a zone READONLY or OFFLINE, as a failing device would (for fault tests)."""
        if cond not in (ZoneCond.READONLY, ZoneCond.OFFLINE):
            raise ValueError("inject_fault: cond must be READONLY or OFFLINE")
        with self._lock:
            self._check_zone(zone)
            self._set_cond(zone, int(cond))
            self._persist(zone)


def create_image(path: str | os.PathLike[str], size: int, zone_size: int,
                 zone_capacity: int | None = None, max_open: int = 0, max_active: int = 0,
                 block_size: int = 4096, force: bool = False) -> ImageZonedDevice:
    """Create a zoned image of ``size`` bytes (rounded down to whole zones) and open it.

    Refuses to replace an existing file unless ``force``; never replaces one that is in use.
    """
    path = os.fspath(path)
    if not _is_pow2(block_size) or block_size < 512:
        raise DeviceError(f"block size {block_size} must be a power of two >= 512")
    if not _is_pow2(zone_size) or zone_size < block_size:
        raise DeviceError(f"zone size {zone_size} must be a power of two and a multiple of "
                          f"the block size {block_size}")
    cap = zone_size if zone_capacity is None else zone_capacity
    if not 0 < cap <= zone_size or cap % block_size:
        raise DeviceError(f"zone capacity {cap} must be a positive multiple of the block "
                          f"size {block_size} and at most the zone size {zone_size}")
    if max_open < 0 or max_active < 0:
        raise DeviceError("max_open and max_active must be >= 0 (0 = unlimited)")
    if max_open and max_active and max_open > max_active:
        raise DeviceError(f"max_open ({max_open}) cannot exceed max_active ({max_active})")
    nr = size // zone_size
    if nr < _MIN_ZONES:
        raise DeviceError(f"size {size} holds {nr} zone(s) of {zone_size} bytes; "
                          f"at least {_MIN_ZONES} are needed")
    if nr >= 1 << 32:
        raise DeviceError(f"too many zones ({nr})")

    if force:
        fd = _open_locked(path, os.O_RDWR | os.O_CREAT)
        created = False
    else:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise DeviceError(f"{path} already exists; refusing to overwrite it without force") from None
        except OSError as e:
            raise DeviceError(f"{path}: cannot create: {e.strerror}") from None
        created = True
    dev = None
    try:
        if created:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DeviceError(f"{path} is not a regular file; refusing to overwrite it")
        table_off, data_off = _image_layout(nr, zone_size)
        hdr = _HDR.pack(IMAGE_MAGIC, IMAGE_VERSION, block_size, zone_size, cap, nr,
                        max_open, max_active, data_off)
        hdr += _CRC.pack(_crc32c.crc32c(hdr))
        try:
            os.ftruncate(fd, 0)
            _set_nocow(fd)
            os.ftruncate(fd, data_off + nr * zone_size)      # sparse
            os.pwrite(fd, hdr.ljust(_HEADER_BLOCK, b"\0"), 0)
            os.pwrite(fd, _ENTRY.pack(0, _EMPTY) * nr, table_off)
            os.fsync(fd)
        except OSError as e:
            raise DeviceError(f"{path}: cannot create image: {e.strerror}") from None
        if created:
            try:
                dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError:
                pass
        dev = ImageZonedDevice.__new__(ImageZonedDevice)
        dev._fd = -1
        dev._attach(path, fd)
        return dev
    except BaseException:
        if dev is not None:
            dev._fd = -1
        os.close(fd)
        if created:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise


# ======================================================================================
# Linux host-managed zoned block device
# ======================================================================================

# linux/blkzoned.h, x86-64 encodings (_IOWR/_IOW/_IOR on type 0x12).
BLKREPORTZONE = 0xC0101282
BLKRESETZONE = 0x40101283
BLKGETZONESZ = 0x80041284
BLKGETNRZONES = 0x80041285
BLKOPENZONE = 0x40101286
BLKCLOSEZONE = 0x40101287
BLKFINISHZONE = 0x40101288
BLK_ZONE_REP_CAPACITY = 1 << 0
BLK_ZONE_TYPE_CONVENTIONAL = 0x1

_REPORT_HDR = struct.Struct("<QII")              # sector, nr_zones, flags
_BLK_ZONE = struct.Struct("<QQQBBBB4xQ24x")      # start len wp type cond non_seq reset cap
_ZONE_RANGE = struct.Struct("<QQ")               # sector, nr_sectors
_SECTOR = 512
_REPORT_BATCH = 256
_SYSFS = "/sys"                                  # tests point this at a fake tree

_MGMT_IOCTL = {_OP_RESET: BLKRESETZONE, _OP_FINISH: BLKFINISHZONE,
               _OP_OPEN: BLKOPENZONE, _OP_CLOSE: BLKCLOSEZONE}

assert _REPORT_HDR.size == 16 and _BLK_ZONE.size == 64


class BlkZone(NamedTuple):
    """One ``struct blk_zone`` in 512-byte sectors; ``capacity`` already defaulted to len."""

    start: int
    len: int
    wp: int
    type: int
    cond: int
    capacity: int


def pack_report_header(sector: int, nr_zones: int) -> bytearray:
    """A BLKREPORTZONE argument buffer asking for ``nr_zones`` zones from ``sector``."""
    buf = bytearray(_REPORT_HDR.size + nr_zones * _BLK_ZONE.size)
    _REPORT_HDR.pack_into(buf, 0, sector, nr_zones, 0)
    return buf


def parse_report(buf: Buffer) -> tuple[int, list[BlkZone]]:
    """Parse a filled ``struct blk_zone_report``: (flags, zones)."""
    _, n, flags = _REPORT_HDR.unpack_from(buf, 0)
    n = min(n, (len(buf) - _REPORT_HDR.size) // _BLK_ZONE.size)
    has_cap = flags & BLK_ZONE_REP_CAPACITY
    out = []
    for i in range(n):
        start, ln, wp, ztype, cond, _ns, _rs, cap = _BLK_ZONE.unpack_from(
            buf, _REPORT_HDR.size + i * _BLK_ZONE.size)
        out.append(BlkZone(start, ln, wp, ztype, cond, cap if has_cap else ln))
    return flags, out


def blk_zone_state(z: BlkZone) -> tuple[int, int, int, int]:
    """(size, capacity, wp, cond) in bytes / wp relative to the zone, from a blk_zone.

    The kernel's wp is meaningless for FULL/EMPTY/OFFLINE/conventional zones; normalise it.
    """
    size = z.len * _SECTOR
    cap = z.capacity * _SECTOR
    cond = z.cond if z.cond in _VALID_COND else _OFFLINE
    if z.type == BLK_ZONE_TYPE_CONVENTIONAL or cond == _NOT_WP:
        return size, size, 0, _NOT_WP
    if cond == _FULL:
        wp = cap
    elif cond == _EMPTY or cond == _OFFLINE:
        wp = 0
    else:
        wp = min(max((z.wp - z.start) * _SECTOR, 0), cap)
    return size, cap, wp, cond


def _kernel_version(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def needs_mq_deadline(release: str, scheduler: str) -> bool:
    """True when zoned writes on this kernel need mq-deadline and it is not selected.

    Before 6.10 only mq-deadline serialised writes per zone; 6.10+ plugs zone writes itself.
    """
    return _kernel_version(release) < (6, 10) and "[mq-deadline]" not in scheduler


def _read_sysfs(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


class BlockZonedDevice(ZonedDevice):
    """A Linux host-managed zoned block device (e.g. a ZNS namespace ``/dev/nvme0n1``).

    Opened O_EXCL (a mounted or otherwise claimed device is refused) and O_DIRECT: data is
    copied into a page-aligned bounce buffer and written exactly at the cached write pointer.
    The zone table is read with BLKREPORTZONE once and then kept up to date by our own
    operations; limits are checked locally first so errors match the image backend, and any
    error from the device itself propagates as OSError after resyncing that zone.
    """

    def __init__(self, path: str | os.PathLike[str], readonly: bool = False) -> None:
        self._fd = -1
        path = os.fspath(path)
        self.readonly = readonly
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise DeviceError(f"{path}: no such file or device") from None
        except OSError as e:
            raise DeviceError(f"{path}: {e.strerror}") from None
        if not stat.S_ISBLK(st.st_mode):
            raise DeviceError(f"{path} is not a block device")
        sysdir = os.path.join(_SYSFS, "dev", "block",
                              f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        zoned = _read_sysfs(os.path.join(sysdir, "queue", "zoned"))
        if zoned is None:
            raise DeviceError(f"{path}: no zoned queue attributes in sysfs "
                              f"(a partition? use the whole zoned device)")
        if zoned != "host-managed":
            raise DeviceError(f"{path} is not a host-managed zoned device "
                              f"(queue/zoned is {zoned!r}; host-aware and regular disks are not supported)")

        def num(name: str, default: int | None = None) -> int:
            v = _read_sysfs(os.path.join(sysdir, "queue", name))
            try:
                return int(v) if v is not None else int(default)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise DeviceError(f"{path}: cannot read queue/{name} from sysfs") from None

        zone_size = num("chunk_sectors") * _SECTOR
        nr_zones = num("nr_zones")
        max_open = num("max_open_zones", 0)
        max_active = num("max_active_zones", 0)
        lbs = num("logical_block_size")
        self._ensure_scheduler(path, os.path.join(sysdir, "queue", "scheduler"))
        try:
            fd = os.open(path, _access(readonly) | os.O_DIRECT | os.O_EXCL | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.EBUSY:
                raise DeviceError(f"{path} is in use (mounted or opened by another process)") from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise DeviceError(f"{path}: permission denied"
                                  f"{_read_only_hint(path, _access(readonly))}") from None
            raise DeviceError(f"{path}: cannot open: {e.strerror}") from None
        try:
            self._setup(path, fd, lbs, zone_size, nr_zones, max_open, max_active)
        except BaseException:
            os.close(fd)
            self._fd = -1
            raise

    @staticmethod
    def _ensure_scheduler(path: str, sched_path: str) -> None:
        release = os.uname().release
        text = _read_sysfs(sched_path)
        if text is None or not needs_mq_deadline(release, text):
            return
        try:
            with open(sched_path, "w") as f:
                f.write("mq-deadline")
        except OSError:
            pass
        if needs_mq_deadline(release, _read_sysfs(sched_path) or ""):
            raise DeviceError(f"{path}: kernel {release} needs the mq-deadline I/O scheduler "
                              f"for zoned writes (echo mq-deadline > {sched_path})")

    def _setup(self, path: str, fd: int, block_size: int, zone_size: int, nr_zones: int,
               max_open: int, max_active: int) -> None:
        """Finish opening from an fd and geometry (split from __init__ so tests can fake it)."""
        if not _is_pow2(block_size) or not _is_pow2(zone_size) or zone_size % block_size:
            raise DeviceError(f"{path}: unsupported zone geometry (zone size {zone_size}, "
                              f"block size {block_size})")
        if nr_zones < 1:
            raise DeviceError(f"{path}: device reports no zones")
        self._fd = fd
        self._sectors_per_zone = zone_size // _SECTOR
        self._dio = _DirectIO(fd, path, block_size)   # aligned bounce buffers for O_DIRECT
        self.path = path
        self.nr_zones = nr_zones
        sizes, caps, wps, conds = self._report_all(nr_zones)
        seq = [c for c, s, cd in zip(caps, sizes, conds) if s == zone_size and cd != _NOT_WP]
        zcap = min(seq) if seq else zone_size
        self._init_state(path, block_size, zone_size, zcap, nr_zones, max_open, max_active,
                         wps, conds, caps, sizes)

    # -- ioctls --------------------------------------------------------------------------

    def _ioctl(self, request: int, arg: bytes | bytearray) -> None:
        """The single ioctl seam (overridden by tests to emulate a device)."""
        if isinstance(arg, bytearray):
            fcntl.ioctl(self._fd, request, arg, True)
        else:
            fcntl.ioctl(self._fd, request, arg)

    def _report(self, sector: int, count: int) -> list[BlkZone]:
        out: list[BlkZone] = []
        while len(out) < count:
            buf = pack_report_header(sector, min(count - len(out), _REPORT_BATCH))
            self._ioctl(BLKREPORTZONE, buf)
            _, zones = parse_report(buf)
            if not zones:
                break
            out.extend(zones)
            sector = zones[-1].start + zones[-1].len
        return out[:count]

    def _report_all(self, nr_zones: int) -> tuple[list[int], list[int], list[int], list[int]]:
        zones = self._report(0, nr_zones)
        if len(zones) != nr_zones:
            raise DeviceError(f"{self.path}: zone report returned {len(zones)} zones, "
                              f"sysfs says {nr_zones}")
        sizes, caps, wps, conds = [], [], [], []
        for z in zones:
            s, c, w, cd = blk_zone_state(z)
            sizes.append(s)
            caps.append(c)
            wps.append(w)
            conds.append(cd)
        return sizes, caps, wps, conds

    def _resync(self, zone: int) -> None:
        """Refresh one zone from the device (after an error, or to adopt its transitions)."""
        try:
            zs = self._report(zone * self._sectors_per_zone, 1)
        except OSError:
            return
        if zs:
            size, cap, wp, cond = blk_zone_state(zs[0])
            self._size[zone] = size
            self._cap[zone] = cap
            self._wp[zone] = wp
            if not self._pending[zone]:
                self._settle_locked(zone)
            else:
                self._resv[zone] = max(self._resv[zone], wp)
            self._set_cond(zone, cond)

    # -- hooks -------------------------------------------------------------------------

    def _io_write(self, zone: int, wp: int, data: Buffer, n: int) -> None:
        try:
            self._dio.pwrite((zone << self._zshift) + wp, data, n)
        except OSError:
            self._resync(zone)              # the device's wp is the truth after a failure
            raise

    def _io_read(self, zone: int, offset: int, length: int) -> bytes:
        return self._dio.pread((zone << self._zshift) + offset, length)

    _view_reads = True

    def _io_read_view(self, zone: int, offset: int, length: int) -> Buffer:
        return self._dio.pread_view((zone << self._zshift) + offset, length)

    def _io_mgmt(self, op: str, zone: int) -> None:
        arg = _ZONE_RANGE.pack(zone * self._sectors_per_zone, self._size[zone] // _SECTOR)
        try:
            self._ioctl(_MGMT_IOCTL[op], arg)
        except OSError:
            self._resync(zone)
            raise

    def _persist(self, zone: int) -> None:
        pass                                # the device keeps its own zone state

    def _after_mgmt(self, op: str, zone: int, old_wp: int) -> None:
        # Adopt the device's own transition (e.g. QEMU closes a wp == 0 zone to CLOSED).
        self._resync(zone)

    def _reload(self) -> None:
        sizes, caps, wps, conds = self._report_all(self.nr_zones)
        self._set_table(wps, conds, caps, sizes)

    def flush(self) -> None:
        os.fsync(self._fd)                  # issues a device cache flush

    def _release(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            _close_released(fd, getattr(self, "path", "the device"))
            dio = getattr(self, "_dio", None)
            if dio is not None:
                dio.close()


# ======================================================================================

def unescape_mount_field(field: str) -> str:
    """A path as ``/proc/mounts`` and ``mountinfo`` print it, octal escapes (``\\040`` a
    space, ``\\011``, ``\\012``, ``\\134`` a backslash) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mountinfo() -> list[tuple[str, str, str]]:
    """(``major:minor``, mount point, file system type) of each mount this process sees
    (``/proc/self/mountinfo``; mount points unescaped); [] when it cannot be read."""
    rows = []
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts = left.split()
                if len(parts) > 4 and right:
                    rows.append((parts[2], unescape_mount_field(parts[4]), right.split()[0]))
    except OSError:
        pass
    return rows


def host_fs_type(path: str) -> str:
    """The type of the file system that holds, or would hold, ``path`` (its mount, found by
    the device number of ``path`` or of its nearest existing parent), or ""."""
    p = os.path.abspath(path)
    while True:
        try:
            st = os.stat(p)
            break
        except FileNotFoundError:
            if p == os.path.dirname(p):
                return ""
            p = os.path.dirname(p)
        except OSError:
            return ""
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    return next((kind for d, _, kind in mountinfo() if d == dev), "")


def open_device(path: str | os.PathLike[str], direct: bool | None = False,
                readonly: bool = False) -> ZonedDevice:
    """Open a zoned target: a block device or an image file (chosen by file type).

    ``readonly`` opens it O_RDONLY (a read-only mount, ``status`` and ``fsck`` without
    ``--repair``, which never write): an image on read-only media, a backup or a snapshot, or a
    device set read-only can still be read, and nothing can be written by mistake.

    ``direct`` is for an image: True opens its zone data with O_DIRECT, False through the page
    cache, None tries O_DIRECT and falls back where the host file system has none — and never
    tries it on a FUSE host: there O_DIRECT is what the server makes of it (LazyFS, under the
    power-cut campaign, sometimes took the O_DIRECT open and then served O_DIRECT reads of
    the metadata zones that failed their checksums: the mount refused a sound image).  The mount
    asks for O_DIRECT: through the page cache every byte is copied once more (into the image's
    pages, which nobody reads back: FUSE caches the file) and reaches the disk only at fsync,
    after the whole save instead of during it."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DeviceError(f"{path}: no such file or device") from None
    except OSError as e:
        raise DeviceError(f"{path}: {e.strerror}") from None
    try:
        return _open_by_type(path, st, direct, readonly)
    except OSError as e:                    # (not DeviceError: what opening it said already)
        raise DeviceError(unreadable(path, e)) from None


def unreadable(path: str, e: OSError) -> str:
    """One line for a target whose I/O failed while opening it (EIO: a failing disk, or the
    file system holding the image failing); before, ``fsck`` and ``mkfs`` printed a
    traceback and a mount logged one."""
    if e.errno in (errno.EIO, errno.ENXIO, errno.ENODATA, errno.EBADMSG, errno.EREMOTEIO):
        return (f"{path}: reading it failed: {e.strerror} (the device, or the file system "
                f"holding the image, reports an error; see dmesg)")
    return f"{path}: {e.strerror or e}"


def _open_by_type(path: str, st: os.stat_result, direct: bool | None,
                  readonly: bool) -> ZonedDevice:
    if stat.S_ISBLK(st.st_mode):
        return BlockZonedDevice(path, readonly=readonly)
    if stat.S_ISREG(st.st_mode):
        if direct is None and host_fs_type(path).startswith("fuse"):
            direct = False                  # O_DIRECT on a FUSE host is whatever its server does
        if direct is None:                  # O_DIRECT where the host file system allows it
            try:
                return ImageZonedDevice(path, direct=True, readonly=readonly)
            except DeviceError as e:
                if "O_DIRECT" not in str(e):
                    raise
            return ImageZonedDevice(path, readonly=readonly)
        return ImageZonedDevice(path, direct=direct, readonly=readonly)
    if stat.S_ISDIR(st.st_mode):
        raise DeviceError(f"{path} is a directory, not a zoned device or image")
    raise DeviceError(f"{path} is neither a block device nor a zoned image file")
