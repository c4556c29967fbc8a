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


def transfer_started(direction: str, nbytes: int, where: str) -> float | None:
    """Announce a transfer of ``nbytes`` if it is large and INFO is shown; its start time for
    :func:`transfer_done`, or None when nothing is reported.

    For transfers whose end is seen elsewhere (a request sent now whose reply comes later)."""
    if nbytes < LARGE or not logger.isEnabledFor(logging.INFO):
        return None
    logger.info("genie: %s of %s %s %s...", direction, _mb(nbytes),
                "to" if direction == "upload" else "from", where)
    return time.perf_counter()


def transfer_done(direction: str, nbytes: int, where: str, start: float | None,
                  note: str = "") -> None:
    """Report the end of a large transfer that began at ``start`` (``time.perf_counter()``;
    None: not reported): size, duration and rate, ``note`` saying what the duration spans."""
    if start is None or nbytes < LARGE or not logger.isEnabledFor(logging.INFO):
        return
    dt = max(time.perf_counter() - start, 1e-9)
    logger.info("genie: %s of %s %s %s done in %.1f s (%s/s%s)", direction, _mb(nbytes),
                "to" if direction == "upload" else "from", where, dt, _mb(int(nbytes / dt)),
                f", {note}" if note else "")


@contextlib.contextmanager
def transfer(direction: str, nbytes: int, where: str) -> Iterator[None]:
    """Report a transfer of ``nbytes`` (``direction``: "upload"/"download") if it is large;
    the block is the whole transfer."""
    start = transfer_started(direction, nbytes, where)
    yield
    transfer_done(direction, nbytes, where, start)
