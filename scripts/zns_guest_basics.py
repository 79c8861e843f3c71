#!/usr/bin/env python3
"""The zoned block device itself, inside the guest of scripts/qemu_zns.py (no retainzfs):
its sysfs attributes, the zone report, that a direct write advances the write pointer and
one off it fails, that a reset rewinds it, and that /dev/fuse plus pyfuse3 can mount a FUSE
file system.  One Python process (a startup over 9p costs seconds under TCG).  Prints
``QEMU_ZNS_RESULT {json}``; tests/test_qemu_zns.py checks it::

    python3 scripts/qemu_zns.py -- python3 scripts/zns_guest_basics.py
"""
import errno, json, os, re, subprocess, time

dev = os.environ["RETAINZ_ZNS_DEV"]         # the runner names the zoned namespace
q = "/sys/block/%s/queue" % os.path.basename(dev)
res = {"dev": dev, "kernel": os.uname().release, "sysfs": {}}
for a in ("zoned", "chunk_sectors", "nr_zones", "max_open_zones", "max_active_zones",
          "logical_block_size", "physical_block_size", "scheduler"):
    with open(os.path.join(q, a)) as f:
        res["sysfs"][a] = f.read().strip()

ZLINE = re.compile(r"start: (0x[0-9a-f]+), len (0x[0-9a-f]+), cap (0x[0-9a-f]+), "
                   r"wptr (0x[0-9a-f]+) .*zcond:\s*(\d+)")

def report(*extra):
    out = subprocess.run(["blkzone", "report", *extra, dev], check=True,
                         capture_output=True, text=True).stdout
    # blkzone prints wptr relative to the zone start (= len when FULL)
    return [dict(zip(("start", "len", "cap", "wp_rel", "cond"),
                     (int(g, 0) for g in m.groups())))
            for m in map(ZLINE.search, out.splitlines()) if m]

def dd(seek_blocks, count):
    return subprocess.run(["dd", "if=/dev/urandom", "of=" + dev, "bs=4096",
                           "count=%d" % count, "seek=%d" % seek_blocks,
                           "oflag=direct", "status=none"],
                          capture_output=True, text=True)

zones = report()
res["nzones"] = len(zones)
res["zone1_before"] = zones[1]
subprocess.run(["blkzone", "reset", dev], check=True)
z1 = zones[1]["start"]                          # 512-byte sectors
w = dd(z1 // 8, 16)                             # 64 KiB at the zone start
res["write_rc"], res["write_err"] = w.returncode, w.stderr
res["zone1_written"] = report("-o", str(z1), "-c", "1")[0]
bad = dd(z1 // 8 + 100, 1)                       # not at the write pointer
res["bad_write_rc"] = bad.returncode
res["zone1_after_bad"] = report("-o", str(z1), "-c", "1")[0]
subprocess.run(["blkzone", "reset", "-o", str(z1), "-c", "1", dev], check=True)
res["zone1_reset"] = report("-o", str(z1), "-c", "1")[0]

# FUSE: /dev/fuse and a real pyfuse3 mount, served by this process's main thread
# while a second thread reads it (one python process: startup over 9p is slow).
res["dev_fuse"] = os.path.exists("/dev/fuse")
import asyncio, stat, threading
import pyfuse3, pyfuse3.asyncio
pyfuse3.asyncio.enable()
ROOT, INO, NAME, DATA = pyfuse3.ROOT_INODE, pyfuse3.ROOT_INODE + 1, b"hello", b"hello from fuse\n"

class Hello(pyfuse3.Operations):
    async def getattr(self, inode, ctx=None):
        e = pyfuse3.EntryAttributes()
        if inode == ROOT:
            e.st_mode, e.st_size = stat.S_IFDIR | 0o755, 0
        elif inode == INO:
            e.st_mode, e.st_size = stat.S_IFREG | 0o644, len(DATA)
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        e.st_ino = inode
        return e
    async def lookup(self, parent, name, ctx=None):
        if parent != ROOT or name != NAME:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(INO)
    async def opendir(self, inode, ctx):
        return inode
    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, NAME, await self.getattr(INO), 1)
    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode)
    async def read(self, fh, off, size):
        return DATA[off:off + size]

mnt = "/tmp/fusemnt"
os.makedirs(mnt, exist_ok=True)

def client():
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        res["fuse_mounted"] = os.path.ismount(mnt)
        res["fuse_ls"] = os.listdir(mnt)
        with open(os.path.join(mnt, "hello")) as f:
            res["fuse_read"] = f.read()
    except Exception as e:
        res["fuse_error"] = repr(e)
    finally:
        if subprocess.run(["umount", mnt]).returncode:
            subprocess.run(["umount", "-l", mnt])

pyfuse3.init(Hello(), mnt, {"fsname=hellofs"})
t = threading.Thread(target=client)
t.start()
try:
    asyncio.run(pyfuse3.main())
finally:
    pyfuse3.close(unmount=False)
t.join()
print("QEMU_ZNS_RESULT " + json.dumps(res), flush=True)
