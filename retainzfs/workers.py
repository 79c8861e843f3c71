"""A fixed set of worker threads, started before they are needed.

``concurrent.futures.ThreadPoolExecutor`` starts its threads on demand, at a ``submit``: under a
container's pids limit (``pids.max``; threads count as tasks) the start failed there, in the
middle of a client's write, after the work item was already queued (it ran later, unowned, and
the write answered EIO as an internal error).  These threads start at ``start``, which the
daemon calls once libfuse has its first thread and the periodic sync runs (``fs.Operations.init``),
as many as the limit allows: ``size`` says how many started, and with none ``submit`` returns
None so the caller does the work itself (a flush in the writer's thread, no readahead).  The
queue is drained before ``shutdown`` returns, as the executor's ``shutdown(wait=True)`` does.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger("retainzfs")


class Workers:
    def __init__(self, n: int, name: str) -> None:
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._n = n
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> int:
        """Start the threads (once; later calls return the count): as many as can be."""
        with self._lock:
            if not self._started and not self._closed:
                self._started = True
                for i in range(self._n):
                    t = threading.Thread(target=self._run, name=f"{self.name}_{i}", daemon=True)
                    try:
                        t.start()
                    except RuntimeError as e:  # "can't start new thread": EAGAIN from clone()
                        log.warning("%s: %d of %d threads started (%s: a pids or thread "
                                    "limit; it works with fewer)",
                                    self.name, i, self._n, e)
                        break
                    self._threads.append(t)
            return len(self._threads)

    @property
    def wanted(self) -> int:
        return self._n

    @property
    def size(self) -> int:
        """Threads running work (started on first use when ``start`` was not called)."""
        return self.start()

    def submit(self, fn: Callable, *args) -> Future | None:
        """Queue ``fn(*args)``; None when no thread runs work (none started, or shut down):
        the caller runs it itself."""
        if self._closed or not self.start():
            return None
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:         # the submitter sees it at result()
                fut.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        """No new work; what is queued still runs (before this returns, with ``wait``)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._q.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
