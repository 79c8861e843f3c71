"""Ordered parallel writes to a zone: reserve, write with no lock, commit in order.

Why: 4 MiB flushes of several files go to one zone (they retire together); each takes the next
offset at once (``reserve``) and writes it in parallel with the others where the medium allows
it (an image file: ``parallel_writes``), and the write pointer moves over them in reservation
order (``commit``), each holding the zone's *turn* until ``pass_turn`` so that what its caller
records in between (extents, checksums) is recorded in zone order.  A failed write is taken
back (``cancel``) or leaves the zone finished behind it (``abandon``).

State per zone (all under the device's ``_lock``; ``_cv`` is its condition): ``_resv`` the
offset the next reservation gets, ``_turn`` the reservation that commits now, ``_pending``
reservations not yet passed.  Management commands (reset, finish, close: ``ZonedDevice``)
``_drain_locked`` first, so none lands between a reservation and its commit.

``ZoneWrites`` is the write half of ``device.ZonedDevice`` (its base): it uses the zone
table (``_wp``, ``_cond``, ``_cap``), the state machine (``_check_resources``,
``_set_cond``, ``_state_error``) and the backend hooks (``_io_write``, ``_io_mgmt``,
``_persist``, ``_after_mgmt``, ``_opening``) that class defines.
"""
from __future__ import annotations

import errno
from typing import Union

from .zonestate import _ACTIVE, _CLOSED, _EMPTY, _FULL, _IMP_OPEN, _NOT_WP, _OP_FINISH, _err

Buffer = Union[bytes, bytearray, memoryview]


class ZoneWrites:
    """Writes and reservations of a zoned device (see the module docstring)."""

    def _init_turns(self, wps: list[int]) -> None:
        """Reservation state for a zone table read from the medium (``_set_table``): kept
        (moved up to the new write pointers) while reservations are outstanding."""
        old = getattr(self, "_pending", None)
        if old is not None and len(old) == len(wps) and any(old):   # a report meanwhile
            self._resv = [max(a, b) for a, b in zip(self._resv, wps)]
        else:
            self._pending = [0] * len(wps)  # per zone: reservations not yet passed
            self._resv = list(wps)          # per zone: the offset the next reservation gets
            self._turn = list(wps)          # per zone: the reservation that commits now

    #: True when writes to one zone may be issued in parallel at reserved offsets (an image
    #: file: any offset can be written at any time).  A zoned disk takes a zone's writes
    #: only at its write pointer, so there ``write_reserved`` issues them in order.
    parallel_writes = False

    @staticmethod
    def _nbytes(data: Buffer) -> int:
        t = type(data)
        if t is bytes or t is bytearray:
            return len(data)
        if t is list or t is tuple:         # scatter list: written with one pwritev, no join
            return sum(len(c) if type(c) is bytes else memoryview(c).nbytes for c in data)
        return data.nbytes if t is memoryview else memoryview(data).nbytes  # numpy ...

    def write(self, zone: int, offset: int, data: Buffer) -> int:
        """Append ``data`` at the zone's write pointer; returns the byte count.

        ``offset`` must equal wp (no zone append); implicitly opens an EMPTY/CLOSED zone and
        turns it FULL when wp reaches capacity.  The data is not copied here.  A zone with
        reservations outstanding takes no plain write (its offset is not the next one).
        """
        n = self._nbytes(data)
        with self._lock:
            if not n:
                self._check_write(zone, offset, 0)
                return 0
            self._reserve_locked(zone, offset, n)
        done = False                        # committed, or taken back (``cancel``)
        try:
            self.write_reserved(zone, offset, data, n)
            self.commit(zone, offset, n)
        except BaseException:
            done = self.failed(zone, offset, n)   # usually: as it was (a retry works)
            raise
        finally:
            if not done:
                self.pass_turn(zone, offset, n)
        return n

    def _check_write(self, zone: int, offset: int, n: int) -> int:
        if not 0 <= zone < self.nr_zones:
            raise _err(errno.EINVAL, f"zone {zone} out of range (0..{self.nr_zones - 1})")
        cond = self._cond[zone]
        if cond == _NOT_WP or cond > _CLOSED:
            raise self._state_error(zone, cond, "write")
        if offset != self._resv[zone]:
            raise _err(errno.EINVAL,
                       f"zone {zone}: write at offset {offset} is not at the write pointer "
                       f"{self._resv[zone]}")
        if n % self.block_size:
            raise _err(errno.EINVAL, f"zone {zone}: write length {n} is not a multiple "
                                     f"of the block size {self.block_size}")
        if offset + n > self._cap[zone]:
            raise _err(errno.EINVAL, f"zone {zone}: write of {n} bytes at {offset} passes "
                                     f"the zone capacity {self._cap[zone]}")
        return cond

    def _reserve_locked(self, zone: int, offset: int, n: int) -> None:
        """Claim [offset, offset + n) of the zone for one write (device lock held)."""
        assert self._cv._is_owned(), "_reserve_locked without the device lock"
        cond = self._check_write(zone, offset, n)
        if cond == _EMPTY:
            self._check_resources(zone, 1, 1)
            self._opening(zone)
        elif cond == _CLOSED:
            self._check_resources(zone, 0, 1)
        if cond == _EMPTY or cond == _CLOSED:
            self._set_cond(zone, _IMP_OPEN)     # the open resource is taken now
        self._resv[zone] = offset + n
        self._pending[zone] += 1

    def reserve(self, zone: int, n: int) -> int:
        """Claim the next ``n`` bytes of the zone for one write; returns their offset.

        The write is then ``write_reserved`` (on an image: with no lock, in parallel with
        the zone's other reservations), ``commit`` (in reservation order: the write pointer
        moves over it), and ``pass_turn`` (always, in a ``finally``): what the caller
        records in between is recorded in zone order.  The state checks are ``write``'s;
        a zone with reservations outstanding is not finished, reset or closed before they
        are passed."""
        with self._lock:
            off = self._resv[zone] if 0 <= zone < self.nr_zones else 0
            self._reserve_locked(zone, off, n)
            return off

    def write_reserved(self, zone: int, offset: int, data: Buffer, n: int | None = None) -> int:
        """Write a reservation's bytes (no lock where ``parallel_writes``; else in order)."""
        if n is None:
            n = self._nbytes(data)
        if self.parallel_writes:
            self._io_write(zone, offset, data, n)
        else:
            with self._cv:
                while self._turn[zone] != offset:
                    self._cv.wait()
                self._io_write(zone, offset, data, n)
        return n

    def commit(self, zone: int, offset: int, n: int) -> None:
        """Wait for the reservations before this one to pass their turn, then move the
        write pointer over it (persisted; FULL at capacity).  The turn stays with the caller
        until ``pass_turn``."""
        with self._cv:
            while self._turn[zone] != offset:
                self._cv.wait()
            if self._wp[zone] != offset:        # abandoned (``abandon``): finished past it
                if self._wp[zone] < offset + n:
                    raise _err(errno.EIO, f"zone {zone}: write at {offset} was abandoned")
                return
            end = offset + n
            self._wp[zone] = end
            self.bytes_written += n
            if end == self._cap[zone]:
                self._set_cond(zone, _FULL)
            self._persist(zone)

    def pass_turn(self, zone: int, offset: int, n: int) -> None:
        """Hand the zone's turn to the next reservation (also after a failed write)."""
        with self._cv:
            if self._turn[zone] == offset:
                self._turn[zone] = offset + n
            self._pending[zone] -= 1
            self._cv.notify_all()

    def abandon(self, zone: int, offset: int, n: int) -> None:
        """A reserved write failed: in its turn, finish the zone (nothing more can be written
        in order behind the hole); the reservations after it that wrote keep their bytes,
        which are below the write pointer now."""
        with self._cv:
            while self._turn[zone] != offset:
                self._cv.wait()
            cond = self._cond[zone]
            if cond != _FULL and cond in _ACTIVE:
                try:
                    self._io_mgmt(_OP_FINISH, zone)
                except OSError:
                    pass                          # the device's state is its own then
                else:
                    old = self._wp[zone]
                    self._wp[zone] = self._cap[zone]
                    self._set_cond(zone, _FULL)
                    self._persist(zone)
                    self._after_mgmt(_OP_FINISH, zone, old)
            self._resv[zone] = max(self._resv[zone], self._wp[zone])

    def failed(self, zone: int, offset: int, n: int) -> bool:
        """A reservation's write (or commit) failed: ``cancel`` it when it is the zone's last
        reservation, else ``abandon`` the zone behind it.  True when it was taken back (no
        turn to pass); False when the caller must still ``pass_turn``."""
        if self.cancel(zone, offset, n):
            return True
        self.abandon(zone, offset, n)
        return False

    def cancel(self, zone: int, offset: int, n: int) -> bool:
        """Take back a reservation whose write failed, when no reservation came after it
        (the usual case): the zone's next write goes to ``offset`` again, as if this one had
        not been made, and it needs no ``pass_turn``.  False when another reservation follows
        it (then ``abandon`` and ``pass_turn``)."""
        with self._cv:
            if self._resv[zone] != offset + n:
                return False
            self._resv[zone] = max(offset, self._wp[zone])
            self._pending[zone] -= 1
            if not self._pending[zone]:
                self._settle_locked(zone)
            self._cv.notify_all()
            return True

    def pending(self, zone: int) -> int:
        """Reservations of the zone not yet passed."""
        return self._pending[zone]

    def _drain_locked(self, zone: int) -> None:
        """Wait (device lock held) until the zone's reservations are passed: a management
        command never lands between a reservation and its commit."""
        assert self._cv._is_owned(), "_drain_locked without the device lock"
        while self._pending[zone]:
            self._cv.wait()

    def _settle_locked(self, zone: int) -> None:
        """No reservation outstanding: the next one and the turn are at the write pointer."""
        assert self._cv._is_owned(), "_settle_locked without the device lock"
        self._resv[zone] = self._turn[zone] = self._wp[zone]
