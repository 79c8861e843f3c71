"""Hints that survive rename (write-temp-then-rename: nvidia-resiliency-ext, torch.save wrappers,
HF tmp-checkpoint-N, DCP .metadata.tmp)."""
from __future__ import annotations

import json
import os

import xattr

from conftest import RETAINZFS, run
from retainzfs import hints as H

MiB = 1 << 20


def _hint(p) -> dict:
    return json.loads(xattr.getxattr(p, H.XATTR_HINT))


def test_nvrx_preset_covers_dirty_and_final_names(mounted):
    d = mounted / "local"
    d.mkdir()
    (d / ".retainz").write_text('preset = "nvrx"\nkeep_latest = 2\ncadence = 50\n')
    for it in (50, 100, 150):
        tmp = d / f"iter_{it:07d}_0_local.dirty.pt"
        with open(tmp, "wb") as f:
            f.write(os.urandom(2 * MiB))
            os.fsync(f.fileno())
        final = d / f"iter_{it:07d}_0_local.pt"
        os.rename(tmp, final)
        h = _hint(final)
        assert (h["birth"], h["reclaim"], h["source"]) == (it, it + 100, "policy"), h
        assert "placed" not in h
    os.unlink(d / "iter_0000050_0_local.pt")
    mounted.remount()
    assert _hint(d / "iter_0000150_0_local.pt")["reclaim"] == 250


def test_rename_rederives_the_hint_and_reports_placed_data(mounted):
    d = mounted / "ck"
    d.mkdir()
    (d / ".retainz").write_text("generation = '^iter_(\\d+)_local\\.pt$'\nkeep_latest = 2\n"
                                "cadence = 10\n")
    # data placed under the temp name (not a generation: an anchor) ...
    tmp = d / "iter_0000020_local.dirty.pt"
    with open(tmp, "wb") as f:
        f.write(os.urandom(MiB))
        os.fsync(f.fileno())
    assert _hint(tmp)["source"] == "policy-nongeneration"
    os.rename(tmp, d / "iter_0000020_local.pt")
    h = _hint(d / "iter_0000020_local.pt")
    assert (h["birth"], h["reclaim"]) == (20, 40)                 # re-derived from the new name
    assert h["placed"]["reclaim"] == "inf" and h["name"].endswith("iter_0000020_local.pt")
    # ... a file renamed before any data reached a zone places everything with the new hint
    tmp2 = d / "iter_0000030_local.dirty.pt"
    # (one descriptor: with a create-and-close first, that handle's RELEASE, which the
    # kernel sends asynchronously, could commit the bytes below before the rename -- it did
    # once in CI -- and the test would race the kernel, not check the rename)
    fd = os.open(tmp2, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"x" * 4096)                                     # still buffered
    os.rename(tmp2, d / "iter_0000030_local.pt")
    os.fsync(fd)
    os.close(fd)
    h = _hint(d / "iter_0000030_local.pt")
    assert (h["birth"], h["reclaim"]) == (30, 50) and "placed" not in h, h
    mounted.remount()                                              # persisted
    assert _hint(d / "iter_0000020_local.pt")["placed"]["reclaim"] == "inf"
    out = run(RETAINZFS, "hints", "--json", d).stdout
    rows = json.loads(out)["generations"]
    flagged = [r["path"] for r in rows if r.get("placed_mismatch")]
    assert flagged and all("iter_0000020" in p for p in flagged), rows
    assert any("iter_0000030" in r["path"] and not r["placed_mismatch"] for r in rows), rows
