#!/usr/bin/env python3
"""End-to-end retainzfs check on a real Linux zoned block device, inside one guest boot.

Run inside the guest of scripts/qemu_zns.py (RETAINZ_ZNS_DEV names the ZNS namespace)::

    python scripts/qemu_zns.py --size 256M --zone-size 4M --max-open 8 --max-active 8 \\
        -- python scripts/zns_guest_check.py [--gens 30] [--gen-mib 6] [--keep 3]

One Python process drives everything (python startup over 9p costs seconds in the TCG
guest): mkfs/mount/status/fsck mains are imported and called in-process (mount forks its
daemon from this process); only blkzone, losetup, modprobe and umount are subprocesses.

Steps: one-line errors (non-zoned loop device, too few zones on a zoned null_blk, device in
use); mkfs + mount with no options; a latest-K checkpoint loop with rm; the device's zone
report against retainzfs status (zones reset); umount/remount and sha256 of every retained
byte; kill -9 of the daemon mid-write, remount, every fsynced file verified; fsck clean;
``retainzfs scrub`` clean, then one zone of the active metadata pair reset (BLKRESETZONE) and
remounted: every byte intact from the mirror, the problem reported and repaired, fsck clean.
Prints ``RESULT {json}`` as its last line; exit status 0 only if every check passed.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from retainzfs.cli import main as cli_main  # noqa: E402
from retainzfs.cli import mkfs as cli_mkfs  # noqa: E402
from retainzfs.cli import mount as cli_mount  # noqa: E402

MiB = 1 << 20
T0 = time.monotonic()
FAILS: list[str] = []
RES: dict = {}
DAEMONS: list[int] = []

_real_fork = os.fork


def _fork_recording() -> int:
    pid = _real_fork()
    if pid > 0:
        DAEMONS.append(pid)
    return pid


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def check(ok: bool, what: str) -> bool:
    log(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILS.append(what)
    return ok


def call(fn, argv: list[str]) -> tuple[int, str, str]:
    """Run a CLI main in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            r = fn(argv)
            code = r or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def run(*cmd: str, check_rc: bool = True) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check_rc and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: rc {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def mount(dev: str, mnt: str) -> int:
    os.fork = _fork_recording           # mount.main forks the daemon from this process
    try:
        code, out, err = call(cli_mount.main, [dev, mnt])
    finally:
        os.fork = _real_fork
    if code:
        raise RuntimeError(f"mount.retainzfs {dev} {mnt} failed: {err.strip()}")
    return DAEMONS[-1]


def _gone(pid: int) -> bool:
    try:
        return bool(os.waitpid(pid, os.WNOHANG)[0])
    except ChildProcessError:             # not our child (helper mount): look in /proc
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True


def umount(mnt: str, pid: int | None) -> None:
    run("umount", mnt)
    if pid:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if _gone(pid):
                return
            time.sleep(0.1)
        raise RuntimeError(f"daemon {pid} did not exit after umount")


def holder_pid(dev: str) -> int | None:
    """The process holding ``dev`` open (the daemon of a helper-started mount)."""
    real = os.path.realpath(dev)
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                if os.readlink(f"/proc/{p}/fd/{fd}") == real:
                    return int(p)
        except OSError:
            continue
    return None


def helper_mount(dev: str, mnt: str) -> int:
    """Mount through the mount(8)/fstab helper, called the way mount(8) calls it."""
    code, out, err = call(cli_main.main, ["install-helper", "--prefix", "/tmp"])
    if code:
        raise RuntimeError(f"retainzfs install-helper: {err.strip()}")
    p = subprocess.run(["sh", "/tmp/mount.fuse.retainzfs", dev, mnt, "-o", "rw"],
                       capture_output=True, text=True)
    check(p.returncode == 0 and os.path.ismount(mnt),
          f"fstab helper: mount.fuse.retainzfs {dev} {mnt} -o rw (rc {p.returncode}"
          f"{': ' + p.stderr.strip() if p.stderr.strip() else ''})")
    pid = holder_pid(dev)
    if pid is None:
        raise RuntimeError("no process holds the device after the helper mount")
    return pid


ZLINE = re.compile(r"start: (0x[0-9a-f]+), len (0x[0-9a-f]+), cap (0x[0-9a-f]+), "
                   r"wptr (0x[0-9a-f]+) .*zcond:\s*(\d+)")
COND = {1: "EMPTY", 2: "IMP_OPEN", 3: "EXP_OPEN", 4: "CLOSED", 14: "FULL", 13: "READONLY",
        15: "OFFLINE", 0: "NOT_WP"}


def blkzone(dev: str) -> list[tuple[int, int, int, int, str]]:
    """(start, len, cap, wp, cond) per zone in sectors, from util-linux blkzone."""
    zones = []
    for line in run("blkzone", "report", dev).splitlines():
        m = ZLINE.search(line)
        if m:
            s, ln, cap, wp = (int(m.group(i), 16) for i in range(1, 5))
            zones.append((s, ln, cap, wp, COND.get(int(m.group(5)), m.group(5))))
    return zones


def sectors_written(dev: str) -> int:
    with open(f"/sys/block/{os.path.basename(dev)}/stat") as f:
        return int(f.read().split()[6])


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(MiB)
            if not b:
                return h.hexdigest()
            h.update(b)


def payload(gen: int, n: int) -> bytes:
    """Deterministic, incompressible-looking bytes for generation ``gen`` (cheap to make)."""
    seed = hashlib.sha256(f"gen-{gen}".encode()).digest() * 32       # 1 KiB
    blk = bytearray(seed * 64)                                        # 64 KiB
    blk[:8] = gen.to_bytes(8, "little")
    out = bytearray()
    i = 0
    while len(out) < n:
        blk[8:16] = i.to_bytes(8, "little")
        out += blk
        i += 1
    return bytes(out[:n])


def write_file(path: str, data: bytes, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(data)
        for off in range(0, len(data), MiB):
            os.write(fd, mv[off:off + MiB])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def status(mnt: str) -> dict:
    code, out, err = call(cli_main.main, ["status", "--json", mnt])
    if code:
        raise RuntimeError(f"retainzfs status failed: {err.strip()}")
    return json.loads(out)


def expect_error(what: str, fn, argv: list[str], needle: str) -> None:
    code, _out, err = call(fn, argv)
    lines = [ln for ln in err.strip().splitlines() if ln]
    ok = code != 0 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err
    check(ok, f"{what}: {lines[0] if lines else '(no message)'} (rc {code})")


def error_checks(dev: str) -> None:
    # A regular (non-zoned) block device: a loop device over a /tmp file.
    img = "/tmp/plain.img"
    with open(img, "wb") as f:
        f.truncate(64 * MiB)
    subprocess.run(["modprobe", "loop"], capture_output=True)
    plain = os.environ.get("RETAINZ_CONV_DEV")      # qemu_zns.py --conv-size, if given
    loop = None
    if not plain:
        p = subprocess.run(["losetup", "-f", "--show", img], capture_output=True, text=True)
        if p.returncode:
            FAILS.append(f"losetup: {p.stderr.strip()}")
            log(f"FAIL losetup: {p.stderr.strip()}")
        else:
            plain = loop = p.stdout.strip()
    if plain:
        try:
            expect_error(f"non-zoned block device {plain}", cli_mkfs.main, [plain],
                         "not a host-managed zoned")
        finally:
            if loop:
                run("losetup", "-d", loop, check_rc=False)
    # Too few zones: a zoned null_blk with 2 zones of 512 MiB.
    p = subprocess.run(["modprobe", "null_blk", "nr_devices=1", "zoned=1", "zone_size=512",
                        "gb=1"], capture_output=True, text=True)
    if p.returncode == 0 and os.path.exists("/dev/nullb0"):
        try:
            expect_error("too few zones", cli_mkfs.main, ["/dev/nullb0"], "zones")
        finally:
            subprocess.run(["rmmod", "null_blk"], capture_output=True)
    else:
        log(f"skip too-few-zones check (null_blk: {p.stderr.strip()})")


def checkpoint_loop(mnt: str, dev: str, gens: int, gen_bytes: int, keep: int,
                    hashes: dict[int, str]) -> None:
    run_dir = os.path.join(mnt, "run")
    os.mkdir(run_dir)
    with open(os.path.join(run_dir, ".retainz"), "w") as f:
        f.write(f"keep_latest = {keep}\ncadence = 1\ngeneration = 'step-(\\d+)'\n")
    s0 = sectors_written(dev)
    t = time.monotonic()
    for g in range(gens):
        d = os.path.join(run_dir, f"step-{g}")
        os.mkdir(d)
        data = payload(g, gen_bytes)
        write_file(os.path.join(d, "model.bin"), data)
        hashes[g] = hashlib.sha256(data).hexdigest()
        old = g - keep
        if old >= 0:
            shutil.rmtree(os.path.join(run_dir, f"step-{old}"))
            del hashes[old]
        if g % 5 == 4:
            st = status(mnt)
            log(f"gen {g}: free {st['free_bytes'] >> 20} MiB, resets {st['zone_resets']}, "
                f"zones {st['zones']}")
    dt = time.monotonic() - t
    dev_bytes = (sectors_written(dev) - s0) * 512
    logical = gens * gen_bytes
    RES["loop"] = {"gens": gens, "gen_bytes": gen_bytes, "keep": keep, "seconds": round(dt, 1),
                   "MiB_per_s": round(logical / MiB / dt, 2), "device_bytes": dev_bytes,
                   "device_per_logical": round(dev_bytes / logical, 4)}
    log(f"loop: {RES['loop']}")


def zone_report_check(mnt: str, dev: str, zone_size: int, zone_cap: int) -> None:
    st = status(mnt)
    zs = blkzone(dev)
    counts: dict[str, int] = {}
    for z in zs:
        counts[z[4]] = counts.get(z[4], 0) + 1
    RES["blkzone"] = counts
    RES["status_zones"] = st["zones"]
    RES["zone_resets"] = st["zone_resets"]
    log(f"blkzone conditions {counts}; retainzfs status zones {st['zones']}, "
        f"resets {st['zone_resets']}")
    check(len(zs) == st["nr_zones"], f"blkzone reports {len(zs)} zones = status nr_zones {st['nr_zones']}")
    check(all(z[1] * 512 == zone_size and z[2] * 512 == zone_cap for z in zs),
          f"every zone is {zone_size >> 20} MiB with capacity {zone_cap >> 20} MiB")
    norm = {k.upper(): v for k, v in st["zones"].items()}
    dev_open = counts.get("IMP_OPEN", 0) + counts.get("EXP_OPEN", 0)
    fs_open = norm.get("IMP_OPEN", 0) + norm.get("EXP_OPEN", 0) + norm.get("OPEN", 0)
    check(counts.get("EMPTY", 0) == norm.get("EMPTY", -1) and counts.get("FULL", 0) == norm.get("FULL", -1)
          and counts.get("CLOSED", 0) == norm.get("CLOSED", 0) and dev_open == fs_open,
          "device zone conditions match retainzfs status")
    check(st["zone_resets"] > 0, f"zones were reset ({st['zone_resets']} resets)")
    # Written zones on the device: bounded by the retained generations, not the whole history.
    written = sum(1 for z in zs if z[4] != "EMPTY")
    RES["written_zones"] = written
    total_mib = RES["loop"]["gens"] * RES["loop"]["gen_bytes"] / MiB
    check(written * zone_cap / MiB < total_mib, f"{written} non-empty zones after writing "
          f"{total_mib:.0f} MiB (older generations' zones were reset)")
    max_open = st["max_open"] or 10 ** 9
    check(dev_open <= max_open, f"{dev_open} open zones on the device <= max_open {st['max_open']}")


def verify(mnt: str, hashes: dict[int, str], extra: dict[str, str]) -> None:
    run_dir = os.path.join(mnt, "run")
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("step-"))
    want = sorted(f"step-{g}" for g in hashes)
    check(names == want, f"retained generations {names} == {want}")
    bad = [g for g, h in hashes.items() if sha(os.path.join(run_dir, f"step-{g}", "model.bin")) != h]
    bad += [p for p, h in extra.items() if sha(os.path.join(mnt, p)) != h]
    n = len(hashes) + len(extra)
    check(not bad, f"sha256 of {n} files after remount" + (f": mismatched {bad}" if bad else ""))


def kill_test(dev: str, mnt: str, pid: int, hashes: dict[int, str]) -> tuple[int, dict[str, str]]:
    """fsync some files, kill -9 the daemon during a write, remount, return the new pid."""
    os.makedirs(os.path.join(mnt, "durable"), exist_ok=True)
    synced: dict[str, str] = {}
    for i in range(3):
        data = payload(1000 + i, 3 * MiB + 4096 * i + 123)
        rel = f"durable/f{i}.bin"
        write_file(os.path.join(mnt, rel), data, fsync=True)
        synced[rel] = hashlib.sha256(data).hexdigest()
    rfd, wfd = os.pipe()
    child = _real_fork()
    if child == 0:                       # writer: keeps writing until the daemon dies
        os.close(rfd)
        n = 0
        try:
            fd = os.open(os.path.join(mnt, "durable", "inflight.bin"), os.O_WRONLY | os.O_CREAT)
            blk = payload(2000, MiB)
            os.write(wfd, b"S")
            while True:
                n += os.write(fd, blk)
        except OSError as e:
            os.write(wfd, f"{n} {e.errno}".encode())
        os._exit(0)
    os.close(wfd)
    os.read(rfd, 1)                      # the writer is running
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    while not _gone(pid):
        time.sleep(0.05)
    os.waitpid(child, 0)
    msg = os.read(rfd, 100).decode().split()
    os.close(rfd)
    check(len(msg) == 2 and int(msg[0]) > 0,
          f"killed daemon {pid} with SIGKILL while a writer was writing "
          f"({int(msg[0]) >> 20 if msg else '?'} MiB written, then errno {msg[1:] or '?'})")
    new = mount(dev, mnt)                # mount clears the stale (ENOTCONN) mountpoint itself
    check(True, "remounted after kill -9")
    return new, synced


def scrub_check(mnt: str, what: str) -> dict:
    code, out, err = call(cli_main.main, ["scrub", "--json", mnt])
    try:
        rep = json.loads(out)
    except ValueError:
        rep = {}
    check(code == 0 and rep.get("errors") == [],
          f"retainzfs scrub {what}: exit {code}, {rep.get('bytes_verified')} bytes in "
          f"{rep.get('files')} files, errors {rep.get('errors', err.strip()[-200:])}")
    return {"rc": code, "bytes_verified": rep.get("bytes_verified"), "files": rep.get("files"),
            "errors": len(rep.get("errors") or [])}


def _meta_state(dev: str) -> tuple[int, list[int], list[tuple[int, int]], list[str]]:
    """(zone size, live pairs, wp of each metadata zone, problems) read from the device."""
    from retainzfs import _journal as J
    from retainzfs.device import open_device
    d = open_device(dev)
    try:
        sb = J.probe_superblock(d)
        ls = J.load(d, sb)
        return (d.zone_size, list(ls.live), [(z, d.zone(z).wp) for z in range(sb.meta_zones)],
                list(ls.problems))
    finally:
        d.close()


def integrity_check(dev: str, mnt: str, hashes: dict[int, str], synced: dict[str, str]) -> None:
    """scrub clean; then lose one copy of the active metadata pair (BLKRESETZONE: a zoned
    device cannot be overwritten in place, so a reset is the damage we can inject) and remount:
    everything intact from the mirror, the problem reported, and repaired (both copies again)."""
    res: dict = {}
    RES["integrity"] = res
    pid = mount(dev, mnt)
    res["scrub"] = scrub_check(mnt, "after the kill test")
    st = status(mnt)
    res["before"] = {"checksum_errors": st["checksum_errors"],
                     "metadata_problems": st["metadata_problems"]}
    check(st["checksum_errors"] == 0 and st["metadata_problems"] == [],
          f"status: checksum_errors {st['checksum_errors']}, metadata_problems "
          f"{st['metadata_problems']}")
    umount(mnt, pid)
    zsize, live, wps, _ = _meta_state(dev)
    pair = live[-1]
    zone = 2 * pair
    res["reset"] = {"live_pairs": live, "zone": zone, "wp_before": dict(wps)[zone]}
    run("blkzone", "reset", "-o", str(zone * zsize // 512), "-c", "1", dev)
    zs = blkzone(dev)
    check(zs[zone][4] == "EMPTY" and dict(wps)[zone] > 0,
          f"blkzone reset of metadata zone {zone} (active pair {pair}, wp was "
          f"{dict(wps)[zone]}): now {zs[zone][4]}")
    code, out, err = call(cli_main.main, ["fsck", dev])
    res["fsck_before_mount"] = code
    check(code != 0, f"fsck reports the lost copy before the mount repairs it (exit {code}: "
                     f"{(out + err).strip().splitlines()[-1:]})")
    pid = mount(dev, mnt)
    st = status(mnt)
    res["after"] = {"metadata_problems": st["metadata_problems"],
                    "metadata_corrupt": st["metadata_corrupt"],
                    "journal_rolls": st["journal_rolls"], "checksum_errors": st["checksum_errors"]}
    verify(mnt, hashes, synced)
    check(not st["metadata_corrupt"] and st["journal_rolls"] >= 1,
          f"mount after the reset: metadata repaired from the mirror (roll: "
          f"{st['journal_rolls']}, corrupt: {st['metadata_corrupt']})")
    check(bool(st["metadata_problems"]),
          f"status reports the repaired metadata problem: {st['metadata_problems']}")
    res["scrub_after"] = scrub_check(mnt, "after the repair")
    umount(mnt, pid)
    _, live2, wps2, probs2 = _meta_state(dev)
    w = dict(wps2)
    even = all(w[2 * p] == w[2 * p + 1] > 0 for p in live2)
    res["repaired"] = {"live_pairs": live2, "wps": {z: w[z] for p in live2 for z in (2 * p, 2 * p + 1)},
                       "problems": probs2}
    check(even and not probs2, f"both copies of every live metadata pair again: "
                               f"{res['repaired']['wps']}, problems {probs2}")
    code, out, err = call(cli_main.main, ["fsck", dev])
    res["fsck_after"] = code
    check(code == 0, f"fsck after the repair: {(out + err).strip().splitlines()[-1:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dev", default=os.environ.get("RETAINZ_ZNS_DEV"))
    ap.add_argument("--mnt", default="/tmp/retainz-mnt")
    ap.add_argument("--gens", type=int, default=30)
    ap.add_argument("--gen-mib", type=float, default=6)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--no-error-checks", action="store_true")
    args = ap.parse_args()
    dev, mnt = args.dev, args.mnt
    if not dev:
        print("no device: set RETAINZ_ZNS_DEV or --dev", file=sys.stderr)
        return 2
    os.makedirs(mnt, exist_ok=True)
    q = f"/sys/block/{os.path.basename(dev)}/queue"
    zone_size = int(open(f"{q}/chunk_sectors").read()) * 512
    zcap = blkzone(dev)[0][2] * 512
    RES.update(dev=dev, kernel=os.uname().release, zone_size=zone_size, zone_capacity=zcap)
    log(f"{dev}: zone size {zone_size >> 20} MiB, capacity {zcap / MiB:g} MiB")
    pid = None
    try:
        if not args.no_error_checks:
            error_checks(dev)
        # The runner selects mq-deadline; undo that so BlockZonedDevice must select it itself.
        with contextlib.suppress(OSError), open(f"{q}/scheduler", "w") as f:
            f.write("none")
        log(f"scheduler before mkfs: {open(f'{q}/scheduler').read().strip()}")
        code, out, err = call(cli_mkfs.main, [dev])
        check(code == 0, f"mkfs.retainzfs {dev}: {(out or err).strip()}")
        if code:
            return 1
        check(open(f"{q}/scheduler").read().count("[mq-deadline]") == 1 or
              tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 10),
              f"scheduler: {open(f'{q}/scheduler').read().strip()}")
        pid = mount(dev, mnt)
        check(True, f"mount.retainzfs {dev} {mnt} (daemon {pid})")
        if not args.no_error_checks:
            expect_error("device in use (mkfs)", cli_mkfs.main, ["--force", dev], "mounted")
            mnt2 = mnt + "2"
            os.makedirs(mnt2, exist_ok=True)
            expect_error("device in use (mount)", cli_mount.main, [dev, mnt2], dev)
        hashes: dict[int, str] = {}
        checkpoint_loop(mnt, dev, args.gens, int(args.gen_mib * MiB) // 4096 * 4096, args.keep,
                        hashes)
        zone_report_check(mnt, dev, zone_size, zcap)
        umount(mnt, pid)
        pid = helper_mount(dev, mnt)
        verify(mnt, hashes, {})
        pid, synced = kill_test(dev, mnt, pid, hashes)
        verify(mnt, hashes, synced)
        umount(mnt, pid)
        pid = None
        code, out, err = call(cli_main.main, ["fsck", dev])
        check(code == 0, f"retainzfs fsck: {(out + err).strip().splitlines()[-1:]}")
        integrity_check(dev, mnt, hashes, synced)
    except Exception as e:  # noqa: BLE001 -- report and fail
        import traceback
        traceback.print_exc()
        FAILS.append(f"exception: {e}")
    finally:
        if pid or os.path.ismount(mnt):
            subprocess.run(["umount", mnt], capture_output=True)
    RES["fails"] = FAILS
    RES["seconds"] = round(time.monotonic() - T0, 1)
    print("RESULT " + json.dumps(RES), flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
