"""Command-line entry points.

Importing this package makes sure file descriptors 0, 1 and 2 are open (on /dev/null when a
caller closed them: ``mount.retainzfs img /ckpt <&- >&- 2>&-``, as some supervisors and init
scripts start daemons).  Otherwise the next file opened takes the number: the mount's log
became fd 0 and its readiness pipe fds 1 and 2, the daemon's redirection of its standard
streams then closed both, the caller was told the daemon had exited while it went on to
mount, and its log stayed empty; in the foreground, what libfuse writes to standard error
would have gone into whatever file held fd 2 -- the device."""
from __future__ import annotations

import os
import sys


def _ensure_std_fds() -> None:
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)     # the lowest free number: ``fd`` itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    # Python leaves sys.stdout / sys.stderr None when it started with the fd closed
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")


_ensure_std_fds()
