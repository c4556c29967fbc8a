"""How much of a server's log one tenant can write.

A client that holds a valid key can make a server log: each request the front refuses is a line
in the front's log, and each request that fails inside a session's worker is a line (an internal
error is a traceback) in that worker's. Without a bound, one tenant can fill the disk the
server's log goes to, and with it every other tenant's server. So each tenant gets a budget:
:data:`BURST` records at once, refilled by one every :data:`EVERY` seconds. A record over the
budget is dropped and counted, and the tenant's next record that passes says how many were
dropped. A tenant is a session's worker (the whole process: it runs one session) or, in the
front, the client key a record names (``extra={"tenant": key}``). Records that no tenant caused
(the server's start and stop, the zygote's death) carry no tenant and are never dropped.

``GENIE_SERVER_LOG_BUDGET`` sets the budget (``"50/5"``: 50 records at once, then one every 5
seconds) or turns it off (``"off"``, to debug one's own sessions at ``--log-level DEBUG``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

#: records a tenant may log at once
BURST = 50
#: seconds per record after that
EVERY = 5.0
#: tenants whose budgets the front remembers (the least recently heard is forgotten first)
MAX_TENANTS = 4096
ENV = "GENIE_SERVER_LOG_BUDGET"


def budget_from_env() -> tuple[int, float] | None:
    """``(burst, every)`` from ``GENIE_SERVER_LOG_BUDGET``, or None when it is ``off``."""
    v = os.environ.get(ENV, "").strip()
    if not v:
        return BURST, EVERY
    if v.lower() in ("off", "0", "none"):
        return None
    try:
        burst, every = v.split("/")
        b, e = int(burst), float(every)
        if b < 1 or not e > 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"genie-server: {ENV}={v!r} is not a budget: write BURST/SECONDS "
                         f"(e.g. {BURST}/{EVERY:g}: {BURST} log records at once, then one every "
                         f"{EVERY:g} s), or 'off'") from None
    return b, e


class LogBudget(logging.Filter):
    """A token bucket per tenant over log records (see the module's docstring).

    ``keyed``: the tenant is each record's ``tenant`` attribute (records without one always
    pass: the front); otherwise every record is the one tenant's (a session's worker)."""

    def __init__(self, burst: int = BURST, every: float = EVERY, *, keyed: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.every, self.keyed, self.clock = burst, every, keyed, clock
        # tenant -> [tokens, when they were counted, records dropped since the last passed]
        self._buckets: collections.OrderedDict[Any, list[float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "tenant", None) if self.keyed else ""
        if key is None:
            return True
        with self._lock:
            now = self.clock()
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = [float(self.burst), now, 0]
                while len(self._buckets) > MAX_TENANTS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
                b[0] = min(float(self.burst), b[0] + (now - b[1]) / self.every)
                b[1] = now
            if b[0] < 1.0:
                b[2] += 1
                return False
            b[0] -= 1.0
            dropped = int(b[2])
            b[2] = 0
        if dropped:
            who = "this client's" if self.keyed else "this session's"
            record.msg = (f"{record.getMessage()} [and {dropped} earlier log record(s) of {who} "
                          f"dropped: it logged more than {self.burst} at once or more than one "
                          f"every {self.every:g} s ({ENV})]")
            record.args = None
        return True


def install(*, keyed: bool) -> LogBudget | None:
    """Put a :class:`LogBudget` on every handler of the root logger (after it is configured);
    returns it, or None when ``GENIE_SERVER_LOG_BUDGET`` is off."""
    budget = budget_from_env()
    if budget is None:
        return None
    f = LogBudget(*budget, keyed=keyed)
    for h in logging.getLogger().handlers:
        h.addFilter(f)
    return f
