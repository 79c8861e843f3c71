#!/usr/bin/env python3
"""Run a command inside a QEMU guest that has a real Linux zoned block device.

The guest boots Debian's kernel (``linux-image-amd64``) under TCG (no KVM) with
virtme-ng (``vng``), which shares the host's root filesystem read-only over 9p,
so the command sees the host's userspace (python, pyfuse3, the work tree).
The guest gets an emulated ZNS NVMe namespace (``-device nvme-ns,zoned=true``)
backed by a fresh sparse image in a temporary directory.

Usage::

    python scripts/qemu_zns.py [--zone-size 4M] [--zone-capacity 4M] [--size 256M]
        [--max-open 8] [--max-active 8] [--mem 2G] [--timeout 600] -- COMMAND...

COMMAND runs as ``bash -c COMMAND`` (several words are shell-quoted and joined)
as root in the guest, with cwd = the host's cwd. Inside, RETAINZ_ZNS_DEV names
the zoned namespace (e.g. /dev/nvme0n1; mq-deadline is selected on it), with
--conv-size RETAINZ_CONV_DEV a regular namespace, and with --zns2-capacity
RETAINZ_ZNS_DEV2 a second zoned namespace (its own zone capacity; the same size,
zone size and limits): two geometries for the price of one boot. The guest's / is read-only;
the cwd is shared read-write unless --ro-cwd; /tmp is a guest-private overlay.
Output is streamed; the exit status is COMMAND's. Runner failures: 124 timeout,
125 the guest never reported a status (boot failure, panic), 127 prerequisites
missing (qemu, kernel, vng, busybox: see scripts/install_qemu_deps.sh).

Notes: KVM does not work on this host (nested KVM hangs or fails an MSR), so
this is TCG: ~30 s to boot on an idle 2-core machine, and guest code runs
~25x slower than native; a python startup over 9p costs seconds (/usr and the
python prefix are overmounted with 9p cache=loose to help). Zone state is not
persisted by QEMU across boots. btrfs -O zoned on the 6.1 guest kernel
deadlocks with max_active=8 after a few tens of MB (fine with --max-active 0).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

DEPS_HINT = "run scripts/install_qemu_deps.sh"
SERIAL = "retainzns"
ENV_NAMES = {"PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "CI", "TERM"}
ENV_PREFIXES = ("RETAINZ", "PYTHON", "PYTEST", "PYENV", "LC_", "COV_")

EXIT_TIMEOUT = 124
EXIT_NO_STATUS = 125
EXIT_BOOT_FAILED = -1          # internal: the guest never started the command (retried)
EXIT_PREREQ = 127


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4M, 256M, 2G)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(m.group(1)) * mult[m.group(2).upper()]


def fmt_size(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def kernel_version(path: str) -> str:
    return os.path.basename(path)[len("vmlinuz-"):]


def find_kernel(explicit: str | None) -> str | None:
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    cands = [k for k in glob.glob("/boot/vmlinuz-*")
             if os.path.isdir(f"/lib/modules/{kernel_version(k)}")]

    def key(path):
        return [int(x) if x.isdigit() else x
                for x in re.split(r"(\d+)", kernel_version(path))]
    cands.sort(key=key)
    return cands[-1] if cands else None


def find_vng() -> str | None:
    sibling = os.path.join(os.path.dirname(sys.executable), "vng")
    if os.access(sibling, os.X_OK):
        return sibling
    return shutil.which("vng")


def check_prereqs(args) -> tuple[str, str] | None:
    """Return (kernel, vng), or print a one-line error and return None."""
    problems = []
    if not shutil.which("qemu-system-x86_64"):
        problems.append("qemu-system-x86_64 missing (apt-get install -y qemu-system-x86)")
    kernel = find_kernel(args.kernel)
    if not kernel:
        problems.append("no /boot/vmlinuz-* with /lib/modules/<ver> "
                        "(apt-get install -y linux-image-amd64)")
    elif not os.access(kernel, os.R_OK):
        problems.append(f"{kernel} not readable (run as root)")
    vng = find_vng()
    if not vng:
        problems.append("vng missing (pip install virtme-ng)")
    if not shutil.which("busybox"):
        problems.append("busybox missing (apt-get install -y busybox-static)")
    if problems:
        print("qemu_zns: prerequisites missing: " + "; ".join(problems)
              + f"; or {DEPS_HINT}", file=sys.stderr)
        return None
    return kernel, vng


def cached_dirs(cwd: str) -> list[str]:
    """Read-only host trees worth a cache=loose 9p mount in the guest."""
    out: list[str] = []
    for d in ("/usr", sys.base_prefix, sys.prefix):
        d = os.path.realpath(d)
        if not os.path.isdir(d) or d == "/":
            continue
        if any(d == o or d.startswith(o + "/") for o in out):
            continue
        if cwd == d or cwd.startswith(d + "/") or d.startswith(cwd + "/"):
            continue  # the cwd is shared read-write, keep it coherent
        out.append(d)
    return out


def guest_env(extra: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    # Make the host's interpreter (and its console scripts) come first: pyenv
    # shims need more of the host environment than the guest has.
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = ":".join([bindir, env.get("PATH", ""),
                            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"qemu_zns: --env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


GUEST_SCRIPT = r"""#!/bin/bash
# Generated by scripts/qemu_zns.py; runs inside the guest as its PID-1 script.
{exports}
RUNDIR={rundir}
log() {{ [ -n "$QZ_QUIET" ] || echo "qemu_zns: $*" >&2; }}
modprobe -q nvme 2>/dev/null
# vng's 9p root is mounted cache=none: every lookup and page fault is a round
# trip, which makes exec and python imports crawl under TCG. Overmount the big
# read-only trees with cache=loose (coherence with host changes is not needed).
{cache_mounts}
modprobe -q fuse 2>/dev/null
find_dev() {{  # $1 = want zoned (1) or regular (0); $2 = its namespace id (or any)
    local d z
    for d in /sys/block/nvme*n*; do
        [ -e "$d" ] || continue
        [ "$(cat "$d/device/serial" 2>/dev/null | tr -d ' ')" = {serial} ] || continue
        [ -z "$2" ] || [ ! -e "$d/nsid" ] || [ "$(cat "$d/nsid")" = "$2" ] || continue
        z=$(cat "$d/queue/zoned")
        if [ "$1" = 1 ] && [ "$z" != none ]; then echo "/dev/${{d##*/}}"; return 0; fi
        if [ "$1" = 0 ] && [ "$z" = none ]; then echo "/dev/${{d##*/}}"; return 0; fi
    done
    return 1
}}
for i in $(seq 1 1200); do      # up to 120 s: NVMe probing crawls on a loaded TCG host
    RETAINZ_ZNS_DEV=$(find_dev 1 1) || {{ sleep 0.1; continue; }}
    [ -z "{want_zns2}" ] && break
    RETAINZ_ZNS_DEV2=$(find_dev 1 3) && [ "$RETAINZ_ZNS_DEV2" != "$RETAINZ_ZNS_DEV" ] && break
    RETAINZ_ZNS_DEV2=
    sleep 0.1
done
if [ -z "$RETAINZ_ZNS_DEV" ]; then
    echo "qemu_zns: no zoned NVMe namespace appeared in the guest" >&2
    ls -l /sys/block >&2
    touch "$RUNDIR/nodev"; echo 125 > "$RUNDIR/rc"; exit 125
fi
if [ -n "{want_zns2}" ] && [ -z "$RETAINZ_ZNS_DEV2" ]; then
    echo "qemu_zns: the second zoned NVMe namespace (nsid 3) did not appear in the guest" >&2
    ls -l /sys/block >&2
    touch "$RUNDIR/nodev"; echo 125 > "$RUNDIR/rc"; exit 125
fi
export RETAINZ_ZNS_DEV RETAINZ_ZNS_DEV2
# Kernels before 6.10 need mq-deadline (zone write locking) for zoned writes.
for z in $RETAINZ_ZNS_DEV $RETAINZ_ZNS_DEV2; do
    if grep -qw mq-deadline "/sys/block/${{z#/dev/}}/queue/scheduler"; then
        echo mq-deadline > "/sys/block/${{z#/dev/}}/queue/scheduler" 2>/dev/null
    fi
done
q=/sys/block/${{RETAINZ_ZNS_DEV#/dev/}}/queue
if [ -n "{want_conv}" ]; then
    RETAINZ_CONV_DEV=$(find_dev 0); export RETAINZ_CONV_DEV
fi
log "RETAINZ_ZNS_DEV=$RETAINZ_ZNS_DEV (kernel $(uname -r)): $(cat $q/zoned), $(cat $q/nr_zones) zones of $(( $(cat $q/chunk_sectors) / 2 ))K, max_open $(cat $q/max_open_zones), max_active $(cat $q/max_active_zones), lbs $(cat $q/logical_block_size), scheduler $(cat $q/scheduler)${{RETAINZ_ZNS_DEV2:+; second zoned $RETAINZ_ZNS_DEV2}}${{RETAINZ_CONV_DEV:+; conventional $RETAINZ_CONV_DEV}}"
cd {cwd} || {{ echo 125 > "$RUNDIR/rc"; exit 125; }}
touch "$RUNDIR/started"
bash -c {command} </dev/null
rc=$?
echo "$rc" > "$RUNDIR/rc"
sync
exit "$rc"
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qemu_zns.py",
        description="Boot a TCG QEMU guest (Debian kernel, host userspace via 9p) "
                    "with an emulated ZNS NVMe namespace and run COMMAND in it.",
        usage="%(prog)s [options] -- COMMAND...")
    p.add_argument("--zone-size", type=parse_size, default=parse_size("4M"))
    p.add_argument("--zone-capacity", type=parse_size, default=None,
                   help="default: the zone size")
    p.add_argument("--size", type=parse_size, default=parse_size("256M"),
                   help="namespace size (a multiple of the zone size)")
    p.add_argument("--max-open", type=int, default=8, help="0 = unlimited")
    p.add_argument("--max-active", type=int, default=8, help="0 = unlimited")
    p.add_argument("--block-size", type=int, default=4096,
                   help="logical/physical block size")
    p.add_argument("--conv-size", type=parse_size, default=0,
                   help="also add a regular namespace of this size (RETAINZ_CONV_DEV)")
    p.add_argument("--zns2-capacity", type=parse_size, default=None,
                   help="also add a second zoned namespace (nsid 3, RETAINZ_ZNS_DEV2) of the same "
                        "size, zone size and limits with this zone capacity: a second geometry "
                        "in the same boot (a TCG boot costs ~25 s)")
    p.add_argument("--image", default=None,
                   help="use (and keep) this backing image instead of a fresh one; "
                        "created sparse if missing. Only the data persists: QEMU 7.2 "
                        "keeps zone state in memory, so every zone is EMPTY (wp = start) "
                        "at the next boot")
    p.add_argument("--mem", default="2G")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for the whole run, boot(s) included")
    p.add_argument("--boot-attempts", type=int, default=3,
                   help="boots to try when the guest fails before the command starts")
    p.add_argument("--kernel", default=None, help="default: newest /boot/vmlinuz-*")
    p.add_argument("--ro-cwd", action="store_true",
                   help="don't share the cwd read-write with the guest")
    p.add_argument("--rwdir", action="append", default=[],
                   help="extra host directory shared read-write (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for COMMAND (repeatable)")
    p.add_argument("--no-cache", action="store_true",
                   help="don't overmount /usr and the python prefix with 9p cache=loose")
    p.add_argument("--quiet", action="store_true", help="no runner messages")
    p.add_argument("--show-boot", action="store_true", help="show the kernel console")
    p.add_argument("--dry-run", action="store_true", help="print the vng command only")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("qemu_zns: no COMMAND given (usage: qemu_zns.py [options] -- COMMAND...)",
              file=sys.stderr)
        return 2
    command = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    zcap = args.zone_capacity or args.zone_size
    if args.zone_size & (args.zone_size - 1) or args.zone_size % args.block_size:
        print("qemu_zns: --zone-size must be a power of two and a multiple of the "
              "block size", file=sys.stderr)
        return 2
    if not 0 < zcap <= args.zone_size or zcap % args.block_size:
        print("qemu_zns: --zone-capacity must be <= the zone size and a multiple of "
              "the block size", file=sys.stderr)
        return 2
    zcap2 = args.zns2_capacity
    if zcap2 is not None and (not 0 < zcap2 <= args.zone_size or zcap2 % args.block_size):
        print("qemu_zns: --zns2-capacity must be <= the zone size and a multiple of "
              "the block size", file=sys.stderr)
        return 2
    if args.size % args.zone_size:
        print("qemu_zns: --size must be a multiple of the zone size", file=sys.stderr)
        return 2

    found = check_prereqs(args)
    if found is None:
        return EXIT_PREREQ
    kernel, vng = found

    def say(msg):
        if not args.quiet:
            print(f"qemu_zns: {msg}", file=sys.stderr, flush=True)

    def boot_once(timeout: float) -> int:
        """One guest boot; EXIT_BOOT_FAILED when the command never started."""
        rundir = tempfile.mkdtemp(prefix="qemu_zns.")
        proc = None
        try:
            image = args.image or os.path.join(rundir, "zns.img")
            if not os.path.exists(image) or os.path.getsize(image) < args.size:
                with open(image, "ab") as f:
                    f.truncate(args.size)
            def zoned_ns(drive: str, nsid: int, cap: int) -> list[str]:
                return ["-drive", f"file={drive},id=zns{nsid},format=raw,if=none",
                        "-device", ",".join([
                            "nvme-ns", f"drive=zns{nsid}", "bus=nvme0", f"nsid={nsid}",
                            f"logical_block_size={args.block_size}",
                            f"physical_block_size={args.block_size}",
                            "zoned=true",
                            f"zoned.zone_size={fmt_size(args.zone_size)}",
                            f"zoned.zone_capacity={fmt_size(cap)}",
                            f"zoned.max_open={args.max_open}",
                            f"zoned.max_active={args.max_active}"])]

            qemu_opts = ["-cpu", "max", "-device", f"nvme,id=nvme0,serial={SERIAL}",
                         *zoned_ns(image, 1, zcap)]
            if zcap2 is not None:
                zns2 = os.path.join(rundir, "zns2.img")
                with open(zns2, "wb") as f:
                    f.truncate(args.size)
                qemu_opts += zoned_ns(zns2, 3, zcap2)
            if args.conv_size:
                conv = os.path.join(rundir, "conv.img")
                with open(conv, "wb") as f:
                    f.truncate(args.conv_size)
                qemu_opts += [
                    "-drive", f"file={conv},id=conv,format=raw,if=none",
                    "-device", f"nvme-ns,drive=conv,bus=nvme0,nsid=2,"
                    f"logical_block_size={args.block_size},"
                    f"physical_block_size={args.block_size}",
                ]
            cache_dirs = [] if args.no_cache else cached_dirs(os.getcwd())
            for i, d in enumerate(cache_dirs):
                qemu_opts += ["-virtfs", f"local,path={d},mount_tag=qzcache{i},"
                              "security_model=none,readonly=on"]
            cache_mounts = "\n".join(
                f"mount -t 9p -o ro,trans=virtio,version=9p2000.L,cache=loose,msize=524288 "
                f"qzcache{i} {shlex.quote(d)} || log 'cache=loose mount of {d} failed'"
                for i, d in enumerate(cache_dirs))
            env = guest_env(args.env)
            if args.quiet:
                env["QZ_QUIET"] = "1"
            cwd = os.getcwd()
            script = os.path.join(rundir, "guest.sh")
            with open(script, "w") as f:
                f.write(GUEST_SCRIPT.format(
                    exports="\n".join(f"export {k}={shlex.quote(v)}"
                                      for k, v in sorted(env.items())),
                    cache_mounts=cache_mounts, rundir=shlex.quote(rundir), serial=shlex.quote(SERIAL),
                    want_conv="1" if args.conv_size else "",
                    want_zns2="1" if zcap2 is not None else "",
                    cwd=shlex.quote(cwd), command=shlex.quote(command)))
            os.chmod(script, 0o755)

            vng_cmd = [vng, "--run", kernel, "--disable-kvm", "--force-9p",
                       "--memory", args.mem, "--cpus", str(args.cpus),
                       "--rwdir", rundir]
            if not args.ro_cwd and cwd != "/":
                vng_cmd += ["--rwdir", cwd]
            for d in args.rwdir:
                vng_cmd += ["--rwdir", os.path.abspath(d)]
            if args.show_boot:
                vng_cmd += ["--verbose"]
            vng_cmd += ["--qemu-opts=" + " ".join(qemu_opts), "--", f"bash {shlex.quote(script)}"]
            if args.dry_run:
                print(shlex.join(vng_cmd))
                return 0

            say(f"booting {os.path.basename(kernel)} (TCG) with ZNS namespace "
                f"{fmt_size(args.size)}, zone {fmt_size(args.zone_size)} cap {fmt_size(zcap)}, "
                f"max_open {args.max_open}, max_active {args.max_active}"
                + (f"; a second one with cap {fmt_size(zcap2)}" if zcap2 is not None else ""))
            t0 = time.monotonic()
            # Pipes, not the caller's fds: QEMU reopens /proc/self/fd/{1,2} for the
            # guest's stdout and stderr, and two opens of one regular file would
            # overwrite each other's output.
            proc = subprocess.Popen(vng_cmd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=cwd, start_new_session=True)

            def pump(src, dst):
                out = dst.buffer if hasattr(dst, "buffer") else dst
                while True:
                    chunk = os.read(src.fileno(), 65536)
                    if not chunk:
                        break
                    out.write(chunk)
                    out.flush()

            pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout), daemon=True),
                     threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)]
            for t in pumps:
                t.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                say(f"timeout after {timeout:.0f}s; killing the guest")
                kill_group(proc)
            for t in pumps:
                t.join(timeout=5)
            if timed_out:
                return EXIT_TIMEOUT if os.path.exists(os.path.join(rundir, "started")) \
                    else EXIT_BOOT_FAILED
            elapsed = time.monotonic() - t0
            rc_path = os.path.join(rundir, "rc")
            try:
                with open(rc_path) as f:
                    rc = int(f.read().strip())
                if os.path.exists(os.path.join(rundir, "nodev")):
                    return EXIT_BOOT_FAILED
            except (OSError, ValueError):
                started = os.path.exists(os.path.join(rundir, "started"))
                say(f"the guest reported no exit status (vng exited {proc.returncode}"
                    f"{'' if started else ', before the command started'}); "
                    "boot failure or kernel panic? rerun with --show-boot")
                return EXIT_NO_STATUS if started else EXIT_BOOT_FAILED
            say(f"command exited {rc} ({elapsed:.1f}s including boot)")
            return rc
        except KeyboardInterrupt:
            return 130
        finally:
            if proc is not None and proc.poll() is None:
                kill_group(proc)
            shutil.rmtree(rundir, ignore_errors=True)

    # A TCG guest on a loaded host sometimes fails to boot (vng exits 255, or the NVMe
    # namespace shows up late): retry a boot that never started the command, within the budget.
    deadline = time.monotonic() + args.timeout
    for attempt in range(1, args.boot_attempts + 1):
        left = deadline - time.monotonic()
        rc = boot_once(left)
        if rc != EXIT_BOOT_FAILED:
            return rc
        if attempt < args.boot_attempts and deadline - time.monotonic() > 60:
            say(f"boot attempt {attempt} failed before the command started; retrying")
            continue
        break
    return EXIT_NO_STATUS


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":
    sys.exit(main())
