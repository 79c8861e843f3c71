"""The superblock: what a retainzfs device is, in one typed, versioned place.

Why typed and checked: a mount that guesses at an image written by another version (or another
device geometry) serves wrong bytes; refusing with one line naming both versions loses nothing.
The superblock is stored as the first record of every metadata zone pair (format v2).
"""
from __future__ import annotations

import json
import time
import uuid as uuidlib
import zlib
from dataclasses import asdict, dataclass, field

MAGIC = "retainzfs"
FORMAT_VERSION = 2
#: what this version writes and requires; an image naming a feature not listed is refused
FEATURES = ("dup_meta", "batch_seq", "data_crc32c", "zone_gen", "snapshot_zlib", "flush_marks",
            "xattr_records", "rename_exchange", "punch_hole", "rename_whiteout", "unmount_marks")


class FormatError(Exception):
    """The on-disk format cannot be used by this version (one line for the user)."""


@dataclass
class Superblock:
    uuid: str
    block_size: int
    zone_size: int
    zone_capacity: int
    nr_zones: int
    meta_zones: int
    allocator: str = "retainz"
    gc_reserve: int = 1
    created: int = 0
    version: int = FORMAT_VERSION
    features: list = field(default_factory=lambda: list(FEATURES))
    magic: str = MAGIC

    @classmethod
    def new(cls, dev, meta_zones: int, allocator: str, gc_reserve: int) -> "Superblock":
        return cls(uuid=str(uuidlib.uuid4()), block_size=dev.block_size, zone_size=dev.zone_size,
                   zone_capacity=dev.zone_capacity, nr_zones=dev.nr_zones, meta_zones=meta_zones,
                   allocator=allocator, gc_reserve=gc_reserve, created=int(time.time()))

    @property
    def fsid(self) -> int:
        """32-bit tag in every metadata frame: frames of an earlier mkfs never mix in."""
        return zlib.crc32(self.uuid.encode()) or 1

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "Superblock":
        try:
            d = json.loads(bytes(payload))
        except ValueError:
            raise FormatError("superblock is not readable") from None
        if not isinstance(d, dict) or d.get("magic") != MAGIC:
            raise FormatError("not a retainzfs superblock")
        v = d.get("version")
        if v != FORMAT_VERSION:
            raise FormatError(f"retainzfs format version {v} on disk; this retainzfs reads "
                              f"format version {FORMAT_VERSION} only (copy the files to a "
                              f"filesystem made by this version)")
        unknown = [f for f in d.get("features", []) if f not in FEATURES]
        if unknown:
            raise FormatError(f"superblock needs features this version lacks: {', '.join(unknown)}")
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as e:
            raise FormatError(f"superblock is incomplete: {e}") from None

    def compatible_with(self, dev) -> str | None:
        """None when the device matches; else why not (one line)."""
        for name in ("block_size", "zone_size", "nr_zones"):
            if getattr(self, name) != getattr(dev, name):
                return (f"superblock {name} {getattr(self, name)} does not match the device's "
                        f"{getattr(dev, name)}")
        if meta_zones_problem(self.meta_zones) or self.meta_zones >= self.nr_zones:
            return (f"superblock names {self.meta_zones} metadata zones (need an even number "
                    f">= {MIN_META_ZONES}, fewer than the device's zones)")
        return None


#: metadata zones: an even number (mirrored pairs), at least two pairs — the one rule, used by
#: mkfs, ``Store.format``, ``compatible_with`` and replay
MIN_META_ZONES = 4


def meta_zones_problem(n: int) -> str | None:
    """Why ``n`` metadata zones cannot be formatted, or None."""
    if n < MIN_META_ZONES or n % 2:
        return (f"--meta-zones {n}: need an even number >= {MIN_META_ZONES} (metadata is "
                f"written to mirrored zone pairs)")
    return None


def default_meta_zones(nr_zones: int, zone_capacity: int) -> int:
    """Metadata zones for a device: pairs (every frame is written to both zones of a pair).

    Two pairs on small devices (up to 128 zones); otherwise about 1 % of the capacity, at least three pairs and
    at most 16: the ring must hold the previous snapshot, the log since it and the next one."""
    if nr_zones <= 128:
        return MIN_META_ZONES
    pairs = max(3, min(16, -(-(nr_zones * zone_capacity // 100) // (2 * zone_capacity))))
    return 2 * pairs
