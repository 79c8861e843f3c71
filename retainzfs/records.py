"""The metadata record vocabulary and its payload codecs: the on-disk format, in one place.

``_journal.pyx`` frames records into checksummed, sequence-numbered batches; this module says
what a record means.  Numbers are stable on disk (format v2).
"""
from __future__ import annotations

import json
import struct
import zlib
from array import array

SUPER = 1
SNAP_BEGIN = 2
SNAP_CHUNK = 3
SNAP_END = 4
INODE = 10          # create/update: full attributes (JSON)
INODE_DEL = 11      # inode freed
DIRENT_ADD = 12
DIRENT_DEL = 13
RENAME = 14
EXTENT = 20         # file range -> zone range, with the zone's reset generation
TRUNCATE = 21
RELOCATE = 22       # GC moved a live range
CSUM = 23           # CRC32C of each piece of one device write
ZONE_FINISH = 30
ZONE_RESET = 31     # the zone was reset: its generation is now ``gen``

NAMES = {SUPER: "super", SNAP_BEGIN: "snap_begin", SNAP_CHUNK: "snap_chunk", SNAP_END: "snap_end",
         INODE: "inode", INODE_DEL: "inode_del", DIRENT_ADD: "dirent_add",
         DIRENT_DEL: "dirent_del", RENAME: "rename", EXTENT: "extent", TRUNCATE: "truncate",
         RELOCATE: "relocate", CSUM: "csum", ZONE_FINISH: "zone_finish", ZONE_RESET: "zone_reset"}

#: bytes covered by one data checksum: small enough that a 4 KiB random read verifies at most
#: two pieces, large enough that the table costs 0.025 % of the data (in RAM and journal)
CSUM_PIECE = 16 << 10
SNAP_CHUNK_SIZE = 1 << 20

_EXTENT = struct.Struct("<QQIIQQd")      # ino, file_off, zone, zgen, zone_off, length, hint
_RELOC = struct.Struct("<QQQIQIIQ")      # ino, file_off, length, old_zone, old_off, new_zone, new_zgen, new_off
_TRUNC = struct.Struct("<QQ")
_ZONE = struct.Struct("<I")
_ZGEN = struct.Struct("<II")             # zone, generation
_CSUM = struct.Struct("<IIQQ")           # zone, zgen, zone_off, length; then one u32 per piece


def pack_extent(ino: int, file_off: int, zone: int, zgen: int, zone_off: int, length: int,
                hint: float) -> bytes:
    return _EXTENT.pack(ino, file_off, zone, zgen, zone_off, length, hint)


def unpack_extent(payload) -> tuple:
    return _EXTENT.unpack(payload)


def pack_relocate(ino, file_off, length, old_zone, old_off, new_zone, new_zgen, new_off) -> bytes:
    return _RELOC.pack(ino, file_off, length, old_zone, old_off, new_zone, new_zgen, new_off)


def unpack_relocate(payload) -> tuple:
    return _RELOC.unpack(payload)


def pack_truncate(ino: int, size: int) -> bytes:
    return _TRUNC.pack(ino, size)


def unpack_truncate(payload) -> tuple:
    return _TRUNC.unpack(payload)


def pack_zone(zone: int) -> bytes:
    return _ZONE.pack(zone)


def unpack_zone(payload) -> int:
    return _ZONE.unpack(payload)[0]


def pack_zone_reset(zone: int, gen: int) -> bytes:
    return _ZGEN.pack(zone, gen)


def unpack_zone_reset(payload) -> tuple[int, int]:
    return _ZGEN.unpack(payload)


def pack_csum(zone: int, zgen: int, zone_off: int, length: int, crcs: array) -> bytes:
    return _CSUM.pack(zone, zgen, zone_off, length) + crcs.tobytes()


def unpack_csum(payload) -> tuple[int, int, int, int, array]:
    zone, zgen, zoff, length = _CSUM.unpack_from(payload)
    crcs = array("I")
    crcs.frombytes(bytes(payload[_CSUM.size:]))
    if len(crcs) != -(-length // CSUM_PIECE):
        raise ValueError("csum record: piece count does not match the length")
    return zone, zgen, zoff, length, crcs


def pack_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(payload):
    return json.loads(bytes(payload))


def pack_snapshot(doc: dict) -> bytes:
    """A namespace snapshot: JSON, zlib-compressed (it is rewritten at every roll)."""
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)


def unpack_snapshot(blob: bytes) -> dict:
    return json.loads(zlib.decompress(blob))
