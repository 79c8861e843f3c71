"""Where and how a mount's daemon logs: the log's place unless ``-o log=`` (root's
/var/log/retainzfs, a user's state directory, last a private directory in /tmp), its name
for a mount point, and one line per record whatever a name holds."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time

from .common import die

LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC


def log_dirs() -> list[tuple[str, bool]]:
    """Where a daemon's log goes unless ``-o log=``, each with whether it is the shared-/tmp
    fallback: /var/log/retainzfs for root; the user's state directory (``$XDG_STATE_HOME``,
    ``~/.local/state``: a user mounting an image of their own cannot write /var/log, nor can
    "root" in a user namespace -- rootless podman, Apptainer); last, a directory of the
    user's own in /tmp."""
    dirs = []
    if os.geteuid() == 0:
        dirs.append(("/var/log/retainzfs", False))
    state = os.environ.get("XDG_STATE_HOME") or ""
    if not os.path.isabs(state):            # (the spec: a relative value is to be ignored)
        home = os.path.expanduser("~")
        state = os.path.join(home, ".local", "state") if os.path.isabs(home) else ""
    if state:
        dirs.append((os.path.join(state, "retainzfs"), False))
    dirs.append((f"/tmp/retainzfs-{os.geteuid()}", True))
    return dirs


def private_tmp_dir(path: str) -> bool:
    """``path`` is a directory of ours, not a symlink, that no one else may write: /tmp is
    shared, and a name there made by another user could point a daemon's log elsewhere."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def log_name(real_mnt: str) -> str:
    """The log's name for a mount point: its path with ``-`` for ``/``; a path too long for
    one name (NAME_MAX is 255 bytes; a pod's volume path under /var/lib/kubelet can near it)
    keeps its end and a hash of the whole, so two deep mount points never share a log."""
    name = real_mnt.strip("/").replace("/", "-") or "root"
    raw = os.fsencode(name)
    if len(raw) <= 200:
        return f"{name}.log"
    import hashlib
    tail = os.fsdecode(raw[-160:]).lstrip("-")
    return f"{hashlib.sha256(raw).hexdigest()[:16]}-{tail}.log"


def open_default_log(mnt: str) -> tuple[str, int]:
    """(path, fd) of the mount's log in the first of ``log_dirs`` that takes it."""
    name = log_name(os.path.realpath(mnt))
    errors = []
    for base, shared_tmp in log_dirs():
        path = os.path.join(base, name)
        try:
            if shared_tmp:
                if not private_tmp_dir(base):
                    raise OSError(errno.EPERM, "not a private directory of this user")
            else:
                os.makedirs(base, exist_ok=True)
            return path, os.open(path, LOG_FLAGS | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
    die("cannot open a log file (" + "; ".join(errors) + "); name one with -o log=PATH")
    raise AssertionError("unreachable")


#: control characters a log message may carry in a name, escaped (tab kept)
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127) if c != 9}


class OneLineFormatter(logging.Formatter):
    """Each record one line, whatever it names: a file or directory name may hold a newline
    (Linux allows any byte but ``/`` and NUL), and one logged in a message split its line in
    two -- and could forge a line of its own (``d\\n... ERROR ...``).  Tracebacks, appended
    after the message, keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_CONTROL)


class RepeatFilter(logging.Filter):
    """A record like one written less than ``window`` seconds ago is counted, not written;
    the next one written after the window says how many it stood for, and ``flush`` says
    the rest.  Why: a failing disk answers every request with the same error, and the
    handler's report of it (a traceback, ~1.5 KB) was written per request -- one reader
    retrying a bad spot of an image whose host answered EIO wrote 14 MB of log in 10 s,
    enough to fill /var/log in hours.  libfuse's own messages are counted the same way (in
    C, ``rz_fuse_log``).  "Like": the same logger, level, message and exception type and
    errno.  Thread-safe (FUSE handlers log from libfuse's threads)."""

    def __init__(self, window: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self.lock = threading.Lock()
        #: key -> [when last written (clock), records counted since, wall time of the first]
        self.seen: dict[tuple, list] = {}

    @staticmethod
    def key(r: logging.LogRecord) -> tuple:
        exc = r.exc_info[1] if r.exc_info else None
        return (r.name, r.levelno, r.getMessage(), type(exc).__name__ if exc else None,
                getattr(exc, "errno", None))

    def filter(self, record: logging.LogRecord) -> bool:
        k = self.key(record)
        now = self.clock()
        with self.lock:
            e = self.seen.get(k)
            if e is not None and now - e[0] < self.window:
                if not e[1]:
                    e[2] = record.created
                e[1] += 1
                return False
            if e is not None and e[1]:
                record.msg = "%s (and %d more like it since %s, not written)" % (
                    record.getMessage(), e[1], _hms(e[2]))
                record.args = None
            self.seen[k] = [now, 0, 0.0]
            if len(self.seen) > 4096:          # forget what is quiet and owes no count
                self.seen = {q: v for q, v in self.seen.items()
                             if v[1] or now - v[0] < self.window}
        return True

    def flush(self) -> list[tuple[str, int, str]]:
        """The counts not yet said, as (logger, level, line) to log without tracebacks."""
        out = []
        with self.lock:
            for (name, level, msg, _, _), e in self.seen.items():
                if e[1]:
                    out.append((name, level, "%s (%d more like it since %s, not written)"
                                % (msg, e[1], _hms(e[2]))))
                    e[1] = 0
        return out


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


#: the daemon's filter (``log_to``), for ``flush_repeats``
_repeats: RepeatFilter | None = None


def log_to(stream, level: int) -> None:
    global _repeats
    h = logging.StreamHandler(stream)
    h.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _repeats = RepeatFilter()
    h.addFilter(_repeats)
    logging.basicConfig(level=level, handlers=[h])


def flush_repeats() -> None:
    """Say the repeats counted and not yet said (at unmount: a flood that stopped within
    its last minute would otherwise go uncounted)."""
    if _repeats is None:
        return
    for name, level, line in _repeats.flush():
        logging.getLogger(name).log(level, "%s", line)
