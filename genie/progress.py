"""Progress of what makes a user wait: compilations and large transfers, through ``logging``.

Messages go to the ``genie.progress`` logger at INFO: silent unless logging is configured to show
them (``GENIE_DEBUG=1`` does, as any ``logging.basicConfig(level=logging.INFO)``), so tests and
quiet programs print nothing. A wait announces itself when it starts (what, and how big) and
reports its duration (and rate, for transfers) when it ends; waits known to be short (transfers
under :data:`LARGE` bytes) log nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("genie.progress")

#: transfers at least this large (bytes) are reported
LARGE = 64 << 20


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MB"


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """Log ``what`` when it starts and its duration when it ends (INFO, ``genie.progress``)."""
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    logger.info("genie: %s...", what)
    t = time.perf_counter()
    yield
    logger.info("genie: %s: done in %.1f s", what, time.perf_counter() - t)


@contextlib.contextmanager
def transfer(direction: str, nbytes: int, where: str) -> Iterator[None]:
    """Report a transfer of ``nbytes`` (``direction``: "upload"/"download") if it is large."""
    if nbytes < LARGE or not logger.isEnabledFor(logging.INFO):
        yield
        return
    logger.info("genie: %s of %s %s %s...", direction, _mb(nbytes),
                "to" if direction == "upload" else "from", where)
    t = time.perf_counter()
    yield
    dt = max(time.perf_counter() - t, 1e-9)
    logger.info("genie: %s of %s done in %.1f s (%s/s)", direction, _mb(nbytes), dt,
                _mb(int(nbytes / dt)))
