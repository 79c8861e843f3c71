"""Errors shared by the store's parts (DESIGN §10: one place)."""
from __future__ import annotations

import os


class FsError(OSError):
    """An errno-carrying error the FUSE adapter returns as is."""

    def __init__(self, err: int, msg: str = ""):
        super().__init__(err, msg or os.strerror(err))


class StaleRead(Exception):
    """A lock-free read met a zone whose reset began after its lookup: look up again
    (``ReadPath.read``); never reaches a caller outside the data path."""
