"""mkfs.retainzfs: format a zoned block device or create + format an emulated zoned image."""
from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys

from .. import _journal as J
from ..device import DeviceError, create_image, open_device, unreadable
from ..store import FsError, Store
from ..superblock import meta_zones_problem
from ..superblock import FormatError
from .common import die, find_mount_of, parse_size


def _owner(text: str) -> tuple[int, int]:
    """``UID:GID``, numeric, each below 2^32 - 1 (which means "no owner" to chown)."""
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit() and uid.isascii() and gid.isascii()
            and int(uid) < 0xFFFFFFFF and int(gid) < 0xFFFFFFFF):
        raise argparse.ArgumentTypeError(f"{text!r}: expected UID:GID (numbers, e.g. 1000:1000)")
    return int(uid), int(gid)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mkfs.retainzfs", description=__doc__)
    p.add_argument("target", help="zoned block device (/dev/nvme0n1) or image file")
    p.add_argument("--size", help="create an emulated zoned image of this size (e.g. 1G)")
    p.add_argument("--zone-size", default="4M", help="zone size for a new image (power of two)")
    p.add_argument("--zone-capacity", help="zone capacity (<= zone size) for a new image")
    p.add_argument("--max-open", type=int, default=0, help="open-zone limit of a new image (0 = none)")
    p.add_argument("--max-active", type=int, default=0, help="active-zone limit of a new image (0 = none)")
    p.add_argument("--block-size", default="4096", help="logical block size of a new image")
    p.add_argument("--meta-zones", type=int, default=None,
                   help="metadata zones: an even number >= 4 (they are written in mirrored "
                        "pairs); default about 1%% of the device, 4 on small ones")
    p.add_argument("--allocator", default="retainz", help="default placement policy")
    p.add_argument("--gc-reserve", type=int, default=1, help="empty zones kept for GC")
    p.add_argument("--root-owner", metavar="UID:GID", type=_owner, default=None,
                   help="owner of the root directory (default: who runs mkfs, as mke2fs -E "
                        "root_owner: a user mounting an image of their own can write in it)")
    p.add_argument("--force", "-f", action="store_true", help="overwrite an existing filesystem/image")
    p.add_argument("--quiet", "-q", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .._alloc import POLICIES
    if args.allocator not in POLICIES:
        die(f"unknown allocator {args.allocator!r}; one of {', '.join(POLICIES)}")
    why = meta_zones_problem(args.meta_zones) if args.meta_zones is not None else None
    if why:
        die(why)
    mnt = find_mount_of(args.target)
    if mnt:
        die(f"{args.target} is mounted at {mnt}; unmount it first")
    try:
        if args.size:
            if os.path.exists(args.target) and stat.S_ISBLK(os.stat(args.target).st_mode):
                die("--size creates an image file; it cannot be used with a block device")
            created = not os.path.exists(args.target)
            dev = create_image(args.target, parse_size(args.size), parse_size(args.zone_size),
                               parse_size(args.zone_capacity) if args.zone_capacity else None,
                               args.max_open, args.max_active, parse_size(args.block_size),
                               force=args.force)
        else:
            if not os.path.exists(args.target):
                die(f"{args.target}: no such device or image (use --size to create an image)")
            dev = open_device(args.target)
            try:
                found = J.probe_superblock(dev)
            except FormatError:
                found = True               # another format version: still a filesystem
            if found is not None and not args.force:
                dev.close()
                die(f"{args.target} already holds a retainzfs filesystem; use --force to overwrite")
            if not args.force:
                from .common import no_superblock_message
                msg = no_superblock_message(dev, args.target)
                if "corrupt" in msg:      # a damaged retainzfs: erase it only when told to
                    dev.close()
                    die(f"{args.target} holds a damaged retainzfs filesystem; use --force to overwrite")
                if "hold data" in msg:    # written zones, no superblock: not ours to erase
                    dev.close()
                    die(f"{args.target}: zones hold data but no retainzfs superblock; "
                        f"use --force to erase them")
    except DeviceError as e:
        die(str(e))
    except ValueError as e:
        die(str(e))
    except OSError as e:                    # (a device that fails to read: one line)
        die(unreadable(args.target, e))
    try:
        sb = Store.format(dev, meta_zones=args.meta_zones, allocator=args.allocator,
                          gc_reserve=args.gc_reserve,
                          root_owner=args.root_owner or (os.getuid(), os.getgid()))
    except (FsError, OSError) as e:
        dev.close()
        if args.size and created:          # no half-made image left behind (a full host)
            with contextlib.suppress(OSError):
                os.unlink(args.target)
        die(f"{args.target}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")
    finally:
        dev.close()
    if not args.quiet:
        print(f"retainzfs (format v{sb.version}) on {args.target}: {sb.nr_zones} zones of "
              f"{sb.zone_size >> 20} MiB (capacity {sb.zone_capacity >> 20} MiB), "
              f"{sb.meta_zones} metadata zones ({sb.meta_zones // 2} mirrored pairs), "
              f"max_open={dev.max_open} max_active={dev.max_active}, allocator={sb.allocator}, "
              f"uuid {sb.uuid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
