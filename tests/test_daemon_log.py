"""The daemon's log under an error that repeats at every request: counted, not written each
time (``daemonlog.RepeatFilter``).  Found at stop 53: an image whose host file system answered
EIO for one spot, read in a loop by one retrying reader, wrote 14 MB of tracebacks in 10 s
(the mount test of that is in test_host_eio.py)."""
from __future__ import annotations

import io
import logging
import re

from hypothesis import given, settings, strategies as st

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
