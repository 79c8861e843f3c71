"""`retainzfs status --zones` / `--png`: a zone map people can look at, small and huge."""
from __future__ import annotations

import json
import os

from conftest import MKFS, RETAINZFS, run

MiB = 1 << 20


def test_zone_map_of_a_mount_paged_and_png(make_image, mount_image, tmp_path):
    img = make_image("2G", "1M", 8, 8)                  # 2048 zones: two xattr pages
    m = mount_image(img)
    (m / "run").mkdir()
    (m / "run" / ".retainz").write_text("keep_latest = 2\ncadence = 1\n")
    for i in range(1, 6):
        (m / "run" / f"step-{i}").mkdir()
        (m / "run" / f"step-{i}" / "s").write_bytes(os.urandom(3 * MiB))
    (m / "anchor").write_bytes(os.urandom(2 * MiB))
    zm = json.loads(run(RETAINZFS, "status", "--zones", "--json", m.path).stdout)
    assert zm["nr_zones"] == 2048 and len(zm["rows"]) == 2048
    kinds = [r[4] for r in zm["rows"]]
    nm = m.status()["meta_zones"]
    assert kinds[:nm] == ["m"] * nm and set(kinds[nm:]) == {"d"}
    live = sum(r[2] for r in zm["rows"] if r[4] == "d")
    assert live == m.status()["live_bytes"]
    assert {r[3] for r in zm["rows"] if r[1]} >= {-1}          # the anchor's zone
    out = run(RETAINZFS, "status", "--zones", m.path).stdout
    assert "zone map" in out and "M" in out and "live share" in out
    png = tmp_path / "z.png"
    run(RETAINZFS, "status", "--png", png, m.path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_zone_map_of_40000_zones_aggregates(tmp_path):
    img = tmp_path / "huge.zns"
    run(MKFS, "--size", "40000M", "--zone-size", "1M", img, timeout=300)
    out = run(RETAINZFS, "status", "--zones", img, timeout=300,
              env={**os.environ, "COLUMNS": "100"}).stdout
    lines = out.splitlines()
    head = " ".join(lines[:3])
    assert "zones per cell" in head and "40000 zones" in head, head
    assert len(lines) < 60                                # aggregated, not 40000 cells
    png = tmp_path / "h.png"
    run(RETAINZFS, "status", "--png", png, img, timeout=300)
    assert png.stat().st_size > 1000


def test_zone_map_bad_target(tmp_path):
    p = run(RETAINZFS, "status", "--zones", tmp_path / "nope", check=False)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1
