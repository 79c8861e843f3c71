"""The daemon's log under an error that repeats at every request: counted, not written each
time (``daemonlog.RepeatFilter``).  Found at stop 53: an image whose host file system answered
EIO for one spot, read in a loop by one retrying reader, wrote 14 MB of tracebacks in 10 s."""
from __future__ import annotations

import io
import logging
import os
import re
import time

from hypothesis import given, settings, strategies as st

from conftest import mkfs
from retainzfs.cli.daemonlog import OneLineFormatter, RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _logger(window: float = 60.0):
    """A private logger writing through a RepeatFilter with a clock the test moves."""
    clock = Clock()
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    f = RepeatFilter(window, clock)
    h.addFilter(f)
    lg = logging.getLogger(f"rz-test-{id(out)}")
    lg.propagate = False
    lg.handlers[:] = [h]
    lg.setLevel(logging.DEBUG)
    return lg, f, clock, out


def _eio() -> OSError:
    try:
        raise OSError(5, "Input/output error")
    except OSError as e:
        return e


def test_a_repeated_error_is_written_once_a_window_with_the_count_and_its_traceback():
    lg, f, clock, out = _logger()
    for _ in range(1000):
        lg.error("I/O error in %s", "read", exc_info=_eio())
        clock.t += 0.01                         # 10 s of a flood
    text = out.getvalue()
    assert text.count("I/O error in read") == 1 and text.count("Traceback") == 1, text
    clock.t += 60
    lg.error("I/O error in %s", "read", exc_info=_eio())
    text = out.getvalue()
    assert "I/O error in read (and 999 more like it since " in text, text
    assert text.count("Traceback") == 2                  # the window's line keeps its own
    lg.error("I/O error in %s", "read", exc_info=_eio())   # counted again
    (owed,) = f.flush()
    assert owed[:2] == (lg.name, logging.ERROR)
    assert re.fullmatch(r"I/O error in read \(1 more like it since \d\d:\d\d:\d\d, "
                        r"not written\)", owed[2]), owed


def test_flush_says_what_was_counted_once_and_only_once():
    lg, f, clock, out = _logger()
    for _ in range(5):
        lg.warning("metadata full")
    lg.error("I/O error in %s", "write", exc_info=_eio())
    owed = f.flush()
    assert len(owed) == 1
    name, level, line = owed[0]
    assert (name, level) == (lg.name, logging.WARNING)
    assert re.fullmatch(r"metadata full \(4 more like it since \d\d:\d\d:\d\d, not written\)",
                        line), line
    assert f.flush() == []                        # said: not owed again


def test_different_messages_errors_and_levels_are_not_like_each_other():
    lg, f, clock, out = _logger()
    lg.error("I/O error in %s", "read", exc_info=_eio())
    lg.error("I/O error in %s", "write", exc_info=_eio())           # another message
    lg.warning("I/O error in %s", "read", exc_info=_eio())          # another level
    try:
        raise ValueError("x")
    except ValueError as e:
        lg.error("I/O error in %s", "read", exc_info=e)             # another exception
    lg.error("I/O error in %s", "read", exc_info=OSError(28, "No space left on device"))
    lg.error("checksum mismatch: file %s offset %d", "/a", 0)
    lg.error("checksum mismatch: file %s offset %d", "/a", 4096)    # another offset
    assert len(out.getvalue().splitlines()) >= 7 and f.flush() == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]),
                          st.floats(min_value=0, max_value=90)), max_size=200))
def test_every_record_is_written_or_counted_exactly_once(events):
    """Over any sequence of messages and gaps: the lines written and the final flush's carry
    every record once (a line stands for itself and the count it names; a flush line for
    its count), and a record goes unwritten only within the window after a line of its
    message was written."""
    lg, f, clock, out = _logger(window=60.0)
    written: list[tuple[float, str]] = []

    class Keep(logging.Handler):
        def emit(self, r):
            written.append((clock.t, r.getMessage()))
    keep = Keep()
    keep.addFilter(f)                    # the same filter instance decides for both handlers
    lg.handlers[:] = [keep]
    last: dict[str, float] = {}
    for msg, gap in events:
        clock.t += gap
        n = len(written)
        lg.info("%s", msg)
        if len(written) > n:
            last[msg] = clock.t
        else:
            assert clock.t - last[msg] < 60.0
    total = 0
    for _, line in written:
        m = re.fullmatch(r"(\w) \(and (\d+) more like it since \S+, not written\)", line)
        total += 1 + (int(m.group(2)) if m else 0)
    for _, _, line in f.flush():
        total += int(re.fullmatch(r"\w \((\d+) more like it since \S+, not written\)",
                                  line).group(1))
    assert total == len(events), (written, events)


def test_a_host_answering_eio_for_one_spot_writes_one_traceback_and_a_count(
        tmp_path, mount_image, request):
    """The image of one mount lives on another mount (so its host answers EIO where the
    host's own bytes are corrupt: the outer mount's checksums refuse them).  One reader
    retries a 4 KiB read of that spot for 3 s: every read fails with EIO, the inner daemon's
    log holds one traceback and, after the unmount, the count of the rest."""
    request.node.allow_daemon_errors = True            # (the one traceback is the point)
    outer_img = mkfs(tmp_path / "outer.zns", "256M", "4M")
    outer = mount_image(outer_img, name="outer")
    inner_img = mkfs(outer.path / "inner.zns", "64M", "4M")
    inner = mount_image(inner_img, name="inner")
    data = os.urandom(4 << 20)
    with open(inner / "f", "wb") as fh:
        fh.write(data)
        os.fsync(fh.fileno())
    os.sync()                                 # (the outer daemon's bytes reach its image)
    raw = outer_img.read_bytes()
    at = raw.find(data[8192:8192 + 4096])
    assert at > 0 and raw.find(data[8192:8192 + 4096], at + 1) < 0
    with open(outer_img, "r+b") as fh:          # the outer image's bytes, behind its daemon
        fh.seek(at + 100)
        fh.write(b"\xff" * 16)
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3")
    failed = reads = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        fd = os.open(inner / "f", os.O_RDONLY)
        try:
            os.pread(fd, 4096, 8192)
        except OSError as e:
            assert e.errno == 5
            failed += 1
        finally:
            os.close(fd)
        reads += 1
        if reads % 20 == 0:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1")
    assert failed == reads and reads > 100, (failed, reads)
    inner.umount()
    log = inner.daemon_log()
    assert log.count("Traceback") == 1 and log.count("ERROR retainzfs: I/O error in read\n") == 1
    m = re.search(r"I/O error in read \((\d+) more like it since \d\d:\d\d:\d\d, not written\)",
                  log)
    assert m and int(m.group(1)) + 1 >= failed, log[-2000:]    # (the kernel may ask twice)
    assert len(log) < 8000, len(log)            # 14 MB in 10 s before
    # the inner image is whole but for that spot: a remount reads the rest
    inner.mount()
    with open(inner / "f", "rb") as fh:
        fh.seek(1 << 20)
        assert fh.read() == data[1 << 20:]
    inner.umount()
    outer.umount()
