"""Zone states and the errors of the zoned-device layer: the vocabulary ``device.py``'s
backends and ``zonewrites.py``'s write ordering share (re-exported by ``device``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class DeviceError(Exception):
    """One-line, user-facing problem with the target (missing, foreign, in use, unsupported).

    Distinct from OSError so the CLI can print it verbatim instead of a traceback, while
    zone-rule violations keep their errno for the store.
    """


class ZoneCond(enum.IntEnum):
    """Zone condition; values are those of ``enum blk_zone_cond`` (and NVMe ZNS states)."""

    NOT_WP = 0x0
    EMPTY = 0x1
    IMP_OPEN = 0x2
    EXP_OPEN = 0x3
    CLOSED = 0x4
    READONLY = 0xD
    FULL = 0xE
    OFFLINE = 0xF


# Plain ints on the hot path: IntEnum attribute lookups and comparisons are slower.
_NOT_WP, _EMPTY, _IMP_OPEN, _EXP_OPEN, _CLOSED = 0x0, 0x1, 0x2, 0x3, 0x4
_READONLY, _FULL, _OFFLINE = 0xD, 0xE, 0xF
_OPEN = frozenset((_IMP_OPEN, _EXP_OPEN))
_ACTIVE = frozenset((_IMP_OPEN, _EXP_OPEN, _CLOSED))
_VALID_COND = frozenset(int(c) for c in ZoneCond)
_COND_OF = {int(c): c for c in ZoneCond}     # faster than ZoneCond(x) in zone()


@dataclass(slots=True)
class Zone:
    """A snapshot of one zone.  ``start`` is the device byte address; ``wp`` is relative."""

    index: int
    start: int
    size: int
    capacity: int
    wp: int
    cond: ZoneCond

    @property
    def is_open(self) -> bool:
        """Holds an open resource (implicitly or explicitly opened)."""
        return self.cond in _OPEN

    @property
    def is_active(self) -> bool:
        """Holds an active resource (open or closed-but-partially-written)."""
        return self.cond in _ACTIVE

    @property
    def free(self) -> int:
        """Bytes still writable before the zone becomes FULL."""
        return self.capacity - self.wp


def _err(code: int, msg: str) -> OSError:
    return OSError(code, msg)


_OP_RESET, _OP_FINISH, _OP_OPEN, _OP_CLOSE = "reset", "finish", "open", "close"
