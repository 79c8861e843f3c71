"""`retainzfs status --zones [--png FILE] MOUNTPOINT|TARGET`: a map of every zone.

One cell per zone in the terminal (rich): the character is the zone's live share (full block:
all live ... dot: nothing live), the colour its reclaim epoch (zones that retire together share a
colour; anchors white), metadata zones `M`, zones out of service `X`, empty zones dim. Devices
with more zones than fit are aggregated: each cell then stands for `k` consecutive zones (their
mean live share, the commonest reclaim epoch). `--png` draws the same as a picture (matplotlib):
live / invalid / tail share per zone, and the reclaim epoch.
"""
from __future__ import annotations

import json
import math
import shutil

import xattr

from .. import hints as H
from .common import die

PAGE_XATTR = H.XATTR_ZONEMAP.decode()
PALETTE = ["cyan", "green", "yellow", "magenta", "blue", "bright_red", "bright_green",
           "bright_cyan", "bright_magenta", "bright_yellow", "bright_blue", "red"]
SHADES = "·░▒▓█"


def fetch(path: str, is_mount: bool) -> dict:
    """{"nr_zones", "capacity", "rows": [[cond, W, L, R, kind], ...]} of a mount or target."""
    if is_mount:
        rows, first, out = [], 0, None
        while True:
            try:
                page = json.loads(xattr.getxattr(path, PAGE_XATTR + str(first)))
            except OSError as e:
                die(f"{path}: cannot read the zone map from the mount: {e.strerror}")
            out = out or page
            rows += page["rows"]
            first += len(page["rows"])
            if not page["rows"] or first >= page["nr_zones"]:
                break
        return {"nr_zones": out["nr_zones"], "capacity": out["capacity"], "rows": rows}
    from .main import _open_offline
    dev, store = _open_offline(path)
    try:
        return store.zone_map()
    finally:
        dev.close()


def _shade(live: int, cap: int) -> str:
    if cap <= 0 or live <= 0:
        return SHADES[0]
    return SHADES[1 + min(3, int(4 * live / cap - 1e-9))]


def cells(zm: dict, max_cells: int) -> tuple[int, list[tuple[str, str]]]:
    """(zones per cell, [(char, style)]) — aggregated when the device has more zones."""
    rows, cap = zm["rows"], zm["capacity"]
    k = max(1, math.ceil(len(rows) / max(1, max_cells)))
    epochs = sorted({r[3] for r in rows if r[3] is not None and r[3] >= 0})
    colour = {e: PALETTE[i % len(PALETTE)] for i, e in enumerate(epochs)}
    out = []
    for i in range(0, len(rows), k):
        grp = rows[i:i + k]
        kinds = {r[4] for r in grp}
        if "b" in kinds:
            out.append(("X", "bold white on red"))
            continue
        if kinds == {"m"}:
            out.append(("M", "bold white on grey23"))
            continue
        written = [r for r in grp if r[1]]
        if not written:
            out.append(("·", "grey35"))
            continue
        live = sum(r[2] for r in grp) / len(grp)
        rs = [r[3] for r in written]
        common = max(set(rs), key=rs.count)
        style = "white" if common == -1 else colour.get(common, "white")
        if any(r[0] in ("imp_open", "exp_open", "closed") for r in grp):
            style += " underline"
        out.append((_shade(int(live), cap), style))
    return k, out


def render(zm: dict, path: str) -> None:
    from rich.console import Console
    from rich.text import Text
    con = Console()
    width = max(20, min(con.width, shutil.get_terminal_size((100, 40)).columns) - 2)
    k, cs = cells(zm, width * 40)
    rows = zm["rows"]
    con.print(f"[bold]zone map of {path}[/]: {zm['nr_zones']} zones"
              + (f", {k} zones per cell" if k > 1 else ""))
    line = Text()
    for i, (ch, style) in enumerate(cs):
        line.append(ch, style=style)
        if (i + 1) % width == 0:
            con.print(line)
            line = Text()
    if line:
        con.print(line)
    epochs = sorted({r[3] for r in rows if r[3] is not None})
    legend = Text("live share: · none  ░ <25%  ▒ <50%  ▓ <75%  █ >=75%   M metadata  "
                  "X out of service  underline: open/active   colour = reclaim epoch: ")
    pal = [e for e in epochs if e >= 0]
    for i, e in enumerate(pal[:12]):
        legend.append(f"{e:g} ", style=PALETTE[i % len(PALETTE)])
    if len(pal) > 12:
        legend.append(f"... ({len(pal)} epochs) ")
    if -1 in epochs:
        legend.append("anchor", style="white")
    con.print(legend)


def png(zm: dict, out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows, cap = zm["rows"], max(1, zm["capacity"])
    n = len(rows)
    k = max(1, math.ceil(n / 4096))                    # at most 4096 cells in the picture
    cells_n = math.ceil(n / k)
    cols = max(8, int(math.ceil(math.sqrt(cells_n * 2))))
    nrows = math.ceil(cells_n / cols)
    img = np.ones((nrows, cols, 3))
    ep = np.full((nrows, cols), np.nan)
    for c in range(cells_n):
        grp = rows[c * k:(c + 1) * k]
        y, x = divmod(c, cols)
        if any(r[4] == "b" for r in grp):
            img[y, x] = (0.85, 0.1, 0.1)
            continue
        if all(r[4] == "m" for r in grp):
            img[y, x] = (0.25, 0.25, 0.25)
            continue
        w = sum(r[1] for r in grp) / (cap * len(grp))
        live = sum(r[2] for r in grp) / (cap * len(grp))
        if w == 0:
            img[y, x] = (0.93, 0.93, 0.93)
            continue
        # green = live share, orange = invalid (dead, not reset), light = tail (unwritten)
        inv, tail = max(0.0, w - live), max(0.0, 1 - w)
        img[y, x] = np.clip(np.array((0.1, 0.6, 0.2)) * live + np.array((0.95, 0.55, 0.1)) * inv
                            + np.array((0.85, 0.9, 0.85)) * tail, 0, 1)
        rs = [r[3] for r in grp if r[3] is not None]
        if rs:
            common = max(set(rs), key=rs.count)
            ep[y, x] = common if common >= 0 else np.nan
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    axes[0].imshow(img, interpolation="nearest", aspect="equal")
    axes[0].set_title("live (green) / invalid (orange) / tail (light); metadata dark, failed red",
                      fontsize=8)
    im = axes[1].imshow(ep, interpolation="nearest", aspect="equal", cmap="viridis")
    axes[1].set_title("reclaim epoch of the zone's data (anchors blank)", fontsize=8)
    fig.colorbar(im, ax=axes[1], fraction=0.046)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title + (f" ({k} zones per cell)" if k > 1 else ""), fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        die(f"cannot write {out}: {e.strerror}")
    plt.close(fig)
