"""The server's request queue: fair across sessions, in order within one.

``genie-server`` runs requests on ``--workers`` threads. :class:`FairQueue` hands them out so
that

- requests of one session (one *key*) run one at a time, in arrival order (a session's store and
  skeleton cache are never touched by two workers at once);
- sessions take turns: after a worker takes a request of a session, that session goes to the
  back of the line, so a client that queued many requests, or whose long tape occupies a
  worker, cannot keep the others' short requests waiting while a worker is free;
- the queued requests of a client that disconnected are dropped (:meth:`drop`), never run.

Invariant: an item is returned by :meth:`get` at most once; :meth:`done` must follow each
:meth:`get` (it frees the key for the next request of that session).

:class:`LoadMeter` measures how busy the workers are with each session's requests; ping replies
carry, to each session, the load of the *other sessions of the same client key* (the same
tenant: one program's sessions, a pool's clients sharing one key file), and a client's placement
sends compute-heavy tapes where compute is free. A session never learns anything of another
tenant's activity from it (the server's own timing is what any tenant can measure anyway).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


class FairQueue:
    """Round-robin over keys; one item per key in flight."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._q: collections.OrderedDict[Hashable, collections.deque[Any]] = \
            collections.OrderedDict()
        self._running: set[Hashable] = set()
        self._n = 0
        self._closed = False

    def qsize(self) -> int:
        return self._n

    def put(self, key: Hashable, item: Any) -> None:
        with self._cv:
            self._q.setdefault(key, collections.deque()).append(item)
            self._n += 1
            self._cv.notify()

    def get(self) -> tuple[Hashable, Any] | None:
        """The next (key, item) whose key is not in flight; blocks; None once closed."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                for key, items in self._q.items():
                    if key in self._running:
                        continue
                    item = items.popleft()
                    if items:
                        self._q.move_to_end(key)  # its next request waits for the others' turn
                    else:
                        del self._q[key]
                    self._n -= 1
                    self._running.add(key)
                    return key, item
                self._cv.wait()

    def done(self, key: Hashable) -> None:
        with self._cv:
            self._running.discard(key)
            if key in self._q:
                self._cv.notify()

    def drop(self, match: Callable[[Any], bool]) -> int:
        """Remove the queued items for which ``match(item)`` holds; how many."""
        with self._cv:
            n = 0
            for key in list(self._q):
                items = self._q[key]
                keep = collections.deque(x for x in items if not match(x))
                n += len(items) - len(keep)
                if keep:
                    self._q[key] = keep
                else:
                    del self._q[key]
            self._n -= n
            return n

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class LoadMeter:
    """How busy the workers were, per session, over the last ``window`` seconds.

    Workers call :meth:`begin` and :meth:`end` around each request; :meth:`load` gives the
    seconds of work that *other* sessions' requests of the same principal (:meth:`bind`: the
    client key that opened them) had running in the window (requests still running count up to
    now), divided by the window: 0 for an idle server, 1 for one worker busy all the time for
    them, 2 for two. Sessions of other principals, and requests of no session (hello), never
    count. A client's placement reads it from ping replies (``ld``) to send compute-heavy work
    where compute is free.
    """

    def __init__(self, window: float = 1.0) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._done: collections.deque[tuple[float, float, Hashable]] = collections.deque()
        self._running: dict[int, tuple[float, Hashable]] = {}
        self._principal: dict[Hashable, Any] = {}

    def bind(self, key: Hashable, principal: Any, alive: Any = None) -> None:
        """Session ``key`` belongs to ``principal`` (None: to no one, it never counts); keys
        not in ``alive`` (the live sessions) are forgotten."""
        with self._lock:
            if alive is not None:
                for k in [k for k in self._principal if k not in alive]:
                    del self._principal[k]
            if principal is not None:
                self._principal[key] = principal

    def begin(self, key: Hashable) -> None:
        with self._lock:
            self._running[threading.get_ident()] = (time.monotonic(), key)

    def end(self) -> None:
        now = time.monotonic()
        with self._lock:
            got = self._running.pop(threading.get_ident(), None)
            if got is not None:
                self._done.append((got[0], now, got[1]))
            while self._done and self._done[0][1] < now - self.window:
                self._done.popleft()

    def load(self, exclude: Hashable = None) -> float:
        """Busy seconds of the requests of ``exclude``'s principal's other sessions in the
        window, per second of it (0 when ``exclude`` has no principal)."""
        now = time.monotonic()
        lo = now - self.window
        busy = 0.0
        with self._lock:
            who = self._principal.get(exclude)
            if who is None:
                return 0.0
            mine = self._principal
            for start, end, key in self._done:
                if key != exclude and end > lo and mine.get(key) == who:
                    busy += end - max(start, lo)
            for start, key in self._running.values():
                if key != exclude and mine.get(key) == who:
                    busy += now - max(start, lo)
        return round(busy / self.window, 3)
