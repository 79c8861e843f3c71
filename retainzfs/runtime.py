"""A small API for training runtimes that declare reclaim hints explicitly.

Why: a `.retainz` policy lets the filesystem *derive* hints from directory names, which needs no
code at all.  A runtime that knows its retention rule (and its milestones) can instead say it
directly, before it writes anything: tag the generation directory with its birth epoch and the
epoch of the event that makes it deletable, then write files as usual.  Files created below a
tagged directory inherit the tag (DESIGN §5), and the hint is known before the first byte is
placed, so nothing has to be guessed.

    from retainzfs.runtime import tag_generation, latest_k_hint, RetainzWriter

    d = tag_generation(f"/mnt/ckpt/run/step-{step}", birth=step,
                       reclaim=latest_k_hint(step, cadence=100, k=3))       # or None = anchor
    torch.save(state, os.path.join(d, "model.pt"))

    # PyTorch DCP: the writer tags the checkpoint directory itself
    dcp.save(state, storage_writer=RetainzWriter(f"/mnt/ckpt/run/step-{step}", birth=step,
                                                 cadence=100, keep_latest=3))

Everything here is plain xattr calls (the ``xattr`` package), so it works from any process, any
rank, and on any filesystem that supports user xattrs (elsewhere the hints are just metadata).
"""
from __future__ import annotations

import errno
import json
import math
import os
from typing import Any

import xattr as _xattr

from . import hints as _H                 # the only place the names are defined

XATTR_BIRTH = _H.XATTR_BIRTH.decode()
XATTR_RECLAIM = _H.XATTR_RECLAIM.decode()
XATTR_STREAM = _H.XATTR_STREAM.decode()
XATTR_HINT = _H.XATTR_HINT.decode()       # read-only, resolved hint (JSON), on files
XATTR_ZONES = _H.XATTR_ZONES.decode()     # read-only, zones holding the file's data

__all__ = ["tag_generation", "tag_path", "latest_k_hint", "hint_of", "zones_of", "RetainzWriter"]


def latest_k_hint(birth: int, cadence: int, k: int) -> int:
    """Reclaim epoch of a generation born at ``birth`` under latest-``k`` retention with one save
    every ``cadence`` epochs: it becomes deletable when generation ``birth + cadence*k`` is saved.
    """
    if cadence <= 0 or k <= 0:
        raise ValueError("cadence and k must be positive")
    if birth < 0:
        raise ValueError("birth must be >= 0")
    return int(birth) + int(cadence) * int(k)


def _reclaim_value(reclaim: int | float | None) -> bytes:
    if reclaim is None or (isinstance(reclaim, float) and math.isinf(reclaim)):
        return b"inf"
    if isinstance(reclaim, bool) or int(reclaim) != reclaim:
        raise ValueError(f"reclaim must be an integer epoch, inf or None, got {reclaim!r}")
    return str(int(reclaim)).encode()


def _check(birth: int, reclaim: int | float | None, stream: int) -> bytes:
    if birth < 0 or stream < 0:
        raise ValueError("birth and stream must be >= 0")
    r = _reclaim_value(reclaim)
    if r != b"inf" and int(r) < birth:
        raise ValueError(f"reclaim {int(r)} precedes birth {birth}")
    return r


def tag_path(path: str | os.PathLike, birth: int, reclaim: int | float | None,
             stream: int = 0) -> None:
    """Set the hint xattrs on an existing file or directory (before its data are written)."""
    r = _check(birth, reclaim, stream)
    path = os.fspath(path)
    _xattr.setxattr(path, XATTR_BIRTH, str(int(birth)).encode())
    _xattr.setxattr(path, XATTR_STREAM, str(int(stream)).encode())
    _xattr.setxattr(path, XATTR_RECLAIM, r)   # reclaim last: it is what makes the hint complete


def tag_generation(path: str | os.PathLike, birth: int, reclaim: int | float | None,
                   stream: int = 0) -> str:
    """Create the generation directory ``path`` (parents too) and tag it: every file written below
    it is placed with birth ``birth`` and reclaim epoch ``reclaim`` (``None``/``inf`` = anchor,
    a milestone kept beyond the retention window).  Call it before writing; returns ``path``.
    """
    _check(birth, reclaim, stream)
    os.makedirs(path, exist_ok=True)
    tag_path(path, birth, reclaim, stream)
    return os.fspath(path)


def hint_of(path: str | os.PathLike) -> dict | None:
    """The hint the filesystem resolved for a file (``{"birth", "reclaim", "stream", "source"}``,
    reclaim ``"inf"`` for anchors), or None when the file has none / is not on retainzfs."""
    try:
        return json.loads(_xattr.getxattr(os.fspath(path), XATTR_HINT))
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return None
        raise


def zones_of(path: str | os.PathLike) -> list[int]:
    """Zones holding a file's data (empty when it has none or is not on retainzfs)."""
    try:
        raw = _xattr.getxattr(os.fspath(path), XATTR_ZONES).decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return []
        raise
    return [int(z) for z in raw.split(",") if z.strip()]


def _writer_base():
    from torch.distributed.checkpoint import FileSystemWriter
    return FileSystemWriter


def __getattr__(name: str) -> Any:
    """``RetainzWriter`` is built on first use: importing this module does not import torch."""
    if name == "RetainzWriter":
        cls = _make_writer_class()
        globals()["RetainzWriter"] = cls
        return cls
    raise AttributeError(name)


def _make_writer_class():
    FileSystemWriter = _writer_base()

    class RetainzWriter(FileSystemWriter):
        """``torch.distributed.checkpoint.FileSystemWriter`` that tags the checkpoint directory
        with its hint before any rank writes a byte.

        ``birth``: the generation's epoch (e.g. the step).  The reclaim epoch is ``reclaim`` when
        given, else ``latest_k_hint(birth, cadence, keep_latest)`` when both are given, else the
        generation is an anchor.  ``milestone=True`` forces an anchor (kept beyond the window).
        Other keyword arguments go to ``FileSystemWriter``.  Works with ``dcp.save`` and
        ``dcp.async_save``; with ``checkpoint_id=`` the directory it names is tagged.
        """

        def __init__(self, path: str | os.PathLike, birth: int, reclaim: int | float | None = None,
                     *, cadence: int | None = None, keep_latest: int | None = None,
                     milestone: bool = False, stream: int = 0, **kwargs: Any) -> None:
            super().__init__(path, **kwargs)
            if milestone:
                reclaim = None
            elif reclaim is None and cadence and keep_latest:
                reclaim = latest_k_hint(birth, cadence, keep_latest)
            self.retainz_birth = int(birth)
            self.retainz_reclaim = reclaim
            self.retainz_stream = int(stream)

        def _tag(self) -> None:
            tag_generation(self.path, self.retainz_birth, self.retainz_reclaim, self.retainz_stream)

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
            self._tag()

        def prepare_local_plan(self, plan):
            self._tag()            # every rank, before it opens a file in the directory
            return super().prepare_local_plan(plan)

    RetainzWriter.__module__ = __name__
    RetainzWriter.__qualname__ = "RetainzWriter"
    return RetainzWriter
