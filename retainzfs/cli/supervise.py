"""A mount's start and stop as its caller and a service manager see them: stop signals
caught from before the fork (the daemon mounts nothing, or unmounts at once, when told to stop
while starting), the caller's wait that stops its daemon when interrupted, and systemd's
``Type=notify`` readiness."""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

from .common import die

#: the signal(s) that asked the daemon to stop before libfuse's handlers were in place
STOP: list[int] = []
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_signals(handler) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def asked_to_stop(sig: int, frame) -> None:
    """Before serving: remember, so ``serve`` mounts nothing or unmounts at once.  Python's
    defaults were a KeyboardInterrupt traceback (SIGINT) or death between the mount and the
    loop (SIGTERM), which left a dead mount point."""
    STOP.append(sig)


class Interrupted(Exception):
    pass


def interrupt(sig: int, frame) -> None:
    raise Interrupted(sig)


def wait_or_stop(pid: int, r: int, mnt: str, logfile: str) -> str:
    """The daemon's readiness line.  Interrupted (Ctrl-C, or systemd's SIGTERM when a mount
    takes too long): the daemon is stopped too -- before, it went on and mounted what the
    caller had given up on, and the caller printed a KeyboardInterrupt traceback."""
    stop_signals(interrupt)
    try:
        if STOP:                             # (it came before this wait began)
            raise Interrupted(STOP[0])
        with os.fdopen(r, errors="surrogateescape") as f:
            return f.readline().strip()
    except Interrupted as e:
        sig = e.args[0]
        stop_signals(signal.SIG_IGN)         # (a second Ctrl-C: the daemon is told once)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                die(f"interrupted ({signal.Signals(sig).name}): the daemon stopped; nothing is "
                    f"mounted on {mnt}", 128 + sig)
            time.sleep(0.05)
        die(f"interrupted ({signal.Signals(sig).name}): the daemon (pid {pid}) was told to stop "
            f"and has not yet (see {logfile})", 128 + sig)
    raise AssertionError("unreachable")


def sd_notify(state: str) -> None:
    """Tell a service manager (systemd's ``Type=notify``, ``$NOTIFY_SOCKET``) that the mount
    is up (READY=1, only once the kernel has connected) or going down: a unit that starts
    training ``After=`` this one then never writes into the empty directory under the mount
    point.  Nothing without ``$NOTIFY_SOCKET``; a socket that cannot be reached is logged."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where:
        return
    addr = "\0" + where[1:] if where.startswith("@") else where     # (@: abstract namespace)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(os.fsencode(state))
    except OSError as e:
        logging.getLogger("retainzfs").warning("cannot notify %s (NOTIFY_SOCKET): %s", where,
                                               e.strerror or e)
