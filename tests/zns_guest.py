"""One QEMU TCG guest boot for every guest-side check of the suite (marked ``qemu``).

A boot costs ~25 s before anything runs, and the checks used to take five of them (the
device checks, retainzfs on two geometries, the block bench on two).  Now one boot has two
zoned namespaces (``qemu_zns.py --zns2-capacity``: 4 MiB zones of capacity 4 MiB and of
3 MiB) and runs each check as a *section*, one after another, with its own exit status and
output; the tests (test_qemu_zns, test_qemu_retainzfs, test_bench_block) read their section
through the session fixture ``zns_guest`` (conftest.py).  ``bench_block.py --qemu``, the
command a user runs, keeps a boot of its own for the 3 MiB-capacity case
(test_bench_block.py).  A section that fails fails only its tests; a boot that fails fails
them all, with the runner's output.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "scripts" / "qemu_zns.py"

#: the guest-side work per boot of ``test_qemu_retainzfs``'s loop: GENS x GEN_MIB through
#: FUSE (several times the namespace's capacity, so zones are reset)
GENS = int(os.environ.get("RETAINZ_QEMU_GENS", "30"))
GEN_MIB = os.environ.get("RETAINZ_QEMU_GEN_MIB", "6")

GEOMETRY = ["--size", "256M", "--zone-size", "4M", "--max-open", "8", "--max-active", "8",
            "--zns2-capacity", "3M"]

#: section name -> the guest command ($RETAINZ_ZNS_DEV: capacity 4 MiB; ..._DEV2: 3 MiB)
SECTIONS = {
    "basics": "python3 scripts/zns_guest_basics.py",
    **{f"retainzfs-{cfg}": f"python3 scripts/zns_guest_check.py --dev \"${var}\" "
                           f"--mnt /tmp/rz-{cfg} --gens {GENS} --gen-mib {GEN_MIB}"
       for cfg, var in (("4M", "RETAINZ_ZNS_DEV"), ("4M-cap3M", "RETAINZ_ZNS_DEV2"))},
    "bench-block-4M": "python3 scripts/bench_block.py --guest --dev \"$RETAINZ_ZNS_DEV\" "
                      "--size 24 --rounds 1",
}

_MARK = re.compile(r"^QZ_(BEGIN|END) (\S+)(?: (-?\d+))?$")


@dataclass
class Section:
    rc: int | None          # None: it never finished (the guest died or timed out first)
    stdout: str


@dataclass
class GuestRun:
    rc: int
    stdout: str
    stderr: str
    sections: dict[str, Section]

    def section(self, name: str) -> Section:
        """The section's result; an AssertionError with the runner's output when it is
        missing."""
        s = self.sections.get(name)
        assert s is not None and s.rc is not None, (
            f"guest section {name!r} did not finish (runner rc {self.rc})\n"
            f"stdout:\n{self.stdout[-6000:]}\nstderr:\n{self.stderr[-3000:]}")
        return s


def missing_prereqs() -> str | None:
    proc = subprocess.run([sys.executable, str(RUNNER), "--dry-run", "--", "true"],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or proc.stdout.strip())


def script(sections: dict[str, str]) -> str:
    """The guest's bash: each section between markers carrying its exit status."""
    lines = ['sec() { local n=$1; shift; echo "QZ_BEGIN $n"; bash -c "$1" </dev/null; '
             'echo "QZ_END $n $?"; }']
    lines += [f"sec {name} {shlex.quote(cmd)}" for name, cmd in sections.items()]
    return "\n".join(lines) + "\n"


def parse(stdout: str) -> dict[str, Section]:
    out: dict[str, Section] = {}
    cur, buf = None, []
    for line in stdout.splitlines():
        m = _MARK.match(line)
        if m and m.group(1) == "BEGIN":
            cur, buf = m.group(2), []
            out[cur] = Section(None, "")
        elif m and cur == m.group(2):
            out[cur] = Section(int(m.group(3)), "\n".join(buf) + "\n")
            cur = None
        elif cur is not None:
            buf.append(line)
    if cur is not None:                     # cut off: keep what it printed
        out[cur] = Section(None, "\n".join(buf) + "\n")
    return out


def boot(sections: dict[str, str] = SECTIONS, timeout: float = 1500) -> GuestRun:
    cmd = [sys.executable, str(RUNNER), "--timeout", str(timeout), *GEOMETRY, "--",
           script(sections)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout + 60)
    return GuestRun(proc.returncode, proc.stdout, proc.stderr, parse(proc.stdout))
