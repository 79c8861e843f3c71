"""A metadata snapshot damaged in both copies: refused read-write with one line, served
read-only with only what is provable (retainzfs/recovery.py).

The image is built through a real mount (dirs of files, journal rolls, files created after the
last roll, renames and unlinks after it).  Then one frame of the newest snapshot — any but its
first, which holds the header — is damaged at the same offset in both metadata copies.
Expected: fsck exits non-zero naming the snapshot; a read-write mount is refused with one line
that offers ``-o ro``; ``-o ro`` mounts and every file it serves has exactly the bytes it was
written with (at its own path, or under ``/lost+found/<dir ino>/`` when its directory was in
the lost part), nothing served is extra, and every file created after the snapshot in a known
directory is there.  In-process (the mount's own open), every snapshot frame is tried.
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct

import pytest

from conftest import MOUNT, RETAINZFS, run

MiB = 1 << 20
_FH = struct.Struct("<4sIQIIII")


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def snapshot_frames(img) -> list[tuple[int, int, int]]:
    """(pair, offset, end) of every frame of the newest snapshot, in log order."""
    from retainzfs import _journal as J
    from retainzfs import records as R
    from retainzfs.device import open_device
    dev = open_device(os.fspath(img))
    try:
        sb = J.probe_superblock(dev)
        frames = []
        for pair in range(sb.meta_zones // 2):
            fr, probs, dmg = J.read_pair(dev, pair, sb.fsid, dev.block_size)
            assert not probs and not dmg
            raw = dev.read(2 * pair, 0, dev.zone(2 * pair).wp) if fr else b""
            for seq, body, off in fr:
                nblocks = _FH.unpack_from(raw, off)[5]
                types = set()
                pos = 0
                while pos < len(body):
                    length = int.from_bytes(body[pos:pos + 4], "little")
                    types.add(body[pos + 4])
                    pos += 4 + length
                frames.append((seq, pair, off, off + nblocks * dev.block_size, types))
        frames.sort()
        begins = [k for k, f in enumerate(frames) if R.SNAP_BEGIN in f[4]]
        k = begins[-1]
        out = []
        for f in frames[k:]:
            out.append((f[1], f[2], f[3]))
            if R.SNAP_END in f[4]:
                break
        return out, dev.zone_size, dev._data_off
    finally:
        dev.close()


def damage_both(img, pair: int, off: int, end: int, zs: int, doff: int, seed: int) -> None:
    rng = random.Random(seed)
    pos = rng.randrange(off + 64, end)          # inside the frame's body: its CRC fails
    with open(img, "r+b") as f:
        for z in (2 * pair, 2 * pair + 1):
            f.seek(doff + z * zs + pos)
            b = f.read(1)
            f.seek(doff + z * zs + pos)
            f.write(bytes([b[0] ^ 0x5A]))


def build(mount_image, make_image):
    """An image with a multi-frame snapshot and records after it; the expected tree."""
    img = make_image("128M", "256K", 16, 16)
    m = mount_image(img)
    rng = random.Random(7)
    want: dict[str, str] = {}
    for d in range(16):
        os.mkdir(m / f"d{d:02d}")
        for i in range(300):
            p = f"d{d:02d}/f{d:02d}-{i:04d}"
            data = rng.randbytes(rng.choice((0, 1, 100, 4096, 5000)))
            with open(m / p, "wb") as f:
                f.write(data)
            want["/" + p] = sha(data)
    rolls = m.status()["journal_rolls"]
    assert rolls >= 1, "the build must roll the journal (a snapshot with the files)"
    # after the last roll: new files, renames and unlinks (records only)
    for d in range(16):
        p = f"d{d:02d}/late-{d:02d}"
        data = rng.randbytes(20000)
        with open(m / p, "wb") as f:
            f.write(data)
        want["/" + p] = sha(data)
        os.rename(m / f"d{d:02d}/f{d:02d}-0000", m / f"d{d:02d}/moved-{d:02d}")
        want[f"/d{d:02d}/moved-{d:02d}"] = want.pop(f"/d{d:02d}/f{d:02d}-0000")
        os.unlink(m / f"d{d:02d}/f{d:02d}-0001")
        del want[f"/d{d:02d}/f{d:02d}-0001"]
    from retainzfs.cli.mount import _open_store
    for attempt in range(3):
        for d in range(16):                      # small records after any roll above
            os.chmod(m / f"d{d:02d}/late-{d:02d}", 0o600 + attempt)
        m.umount()
        dev, s = _open_store(os.fspath(img), {"readonly": True})
        nrec = s.replayed_records
        dev.close()
        if nrec:                                 # (the last flush may have been a roll)
            return img, want, nrec
        m.mount()
    raise AssertionError(f"the build left no records after the last snapshot {img}")


def tree(root) -> dict[str, bytes | str]:
    out = {}
    for dp, dns, fns in os.walk(root):
        for fn in fns:
            p = os.path.join(dp, fn)
            try:
                with open(p, "rb") as f:
                    out["/" + os.path.relpath(p, root)] = sha(f.read())
            except OSError as e:
                out["/" + os.path.relpath(p, root)] = f"errno {e.errno}"
    return out


def check_served(served: dict, want: dict) -> tuple[int, int]:
    """Every served file is exact; returns (at own path, under lost+found)."""
    by_name: dict[str, set] = {}
    for p, h in want.items():
        by_name.setdefault(p.rsplit("/", 1)[1], set()).add(h)
    own = lost = 0
    for p, h in served.items():
        if p.startswith("/lost+found/"):
            name = p.rsplit("/", 1)[1]
            assert h in by_name.get(name, ()), f"{p}: not the bytes of any file named {name}"
            lost += 1
        else:
            assert p in want, f"served a file that does not exist: {p}"
            assert h == want[p], f"{p}: wrong bytes ({h})"
            own += 1
    return own, lost


def test_snapshot_damaged_in_both_copies_serves_provable_read_only(mount_image, make_image,
                                                                      tmp_path):
    img, want, nrec = build(mount_image, make_image)
    frames, zs, doff = snapshot_frames(img)
    assert len(frames) >= 3, f"snapshot in {len(frames)} frames: too small for the test"
    pristine = tmp_path / "pristine.zns"
    shutil.copyfile(img, pristine)
    pair, off, end = frames[len(frames) // 2]
    damage_both(img, pair, off, end, zs, doff, 1)

    p = run(RETAINZFS, "fsck", img, check=False)
    assert p.returncode != 0 and "snapshot" in (p.stdout + p.stderr), p
    mnt = tmp_path / "rw"
    mnt.mkdir()
    p = run(MOUNT, img, mnt, check=False, timeout=60)
    err = p.stderr.strip()
    assert p.returncode != 0 and len(err.splitlines()) == 1, p
    assert "-o ro" in err and "snapshot" in err, err

    m = mount_image(img, "ro", name="ro")
    served = tree(m)
    st = m.status()
    assert st["metadata_partial"] and st["metadata_corrupt"], st
    own, lost = check_served(served, want)
    late = [p for p in want if "/late-" in p]
    late_seen = [p for p in late if p in served]
    assert own > len(want) // 4 and own + lost < len(want), (own, lost, len(want))
    print(f"\nsnapshot frame {len(frames) // 2} of {len(frames)} damaged in both copies: "
          f"{own} files at their paths, {lost} under lost+found, {len(late_seen)}/{len(late)} "
          f"late files, of {len(want)}")
    with pytest.raises(OSError):
        open(m / "new-file", "wb")
    m.umount()
    # the read-only mount wrote nothing: the image is still the damaged one, byte for byte
    p = run(RETAINZFS, "fsck", img, check=False)
    assert p.returncode != 0


def test_every_snapshot_frame_damaged_in_both_copies(mount_image, make_image, tmp_path):
    """The mount's own open, in process, for each frame of the snapshot: the first (header)
    is refused read-only too; every other one serves only exact files."""
    from retainzfs.cli.mount import _open_store
    from retainzfs.device import DeviceError
    img, want, nrec = build(mount_image, make_image)
    frames, zs, doff = snapshot_frames(img)
    work = tmp_path / "case.zns"
    results = []
    for k, (pair, off, end) in enumerate(frames):
        shutil.copyfile(img, work)
        damage_both(work, pair, off, end, zs, doff, k)
        with pytest.raises(DeviceError) as ei:
            _open_store(os.fspath(work), {"readonly": False})
        assert len(str(ei.value).splitlines()) == 1
        try:
            dev, s = _open_store(os.fspath(work), {"readonly": True})
        except DeviceError as e:
            assert k == 0, f"frame {k}: read-only refused: {e}"
            results.append((k, "refused"))
            continue
        try:
            served = {}
            for ino in list(s.inodes.values()):
                if ino.is_reg:
                    data = s.read(ino.ino, 0, ino.size)
                    served[s.path_of(ino.ino)] = sha(data)
            own, lost = check_served(served, want)
            results.append((k, own, lost, s.replayed_records))
            # every record after the snapshot was read: applied, or skipped as unprovable
            assert s.replayed_records + s.recovered_partial["records_skipped"] == nrec
            assert s.meta_corrupt and s.recovered_partial["adopted"] == lost
            assert not s.check(), "the partial namespace is not self-consistent"
        finally:
            dev.close()
    print("\n", results)
