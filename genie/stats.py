"""Counters users read in one call: ``genie.stats()``.

Counters are plain integers in one dict, bumped on the hot path without locks (the GIL makes a
single ``+=`` on a dict entry effectively atomic for our purposes; counts are diagnostics).
"""

from __future__ import annotations

from collections import Counter

_counts: Counter[str] = Counter()


def bump(name: str, n: int = 1) -> None:
    _counts[name] += n


def stats() -> dict[str, int]:
    """Return a snapshot of Genie's counters.

    Keys: ``ops_recorded``, ``factories_recorded``, ``meta_cache_hits``, ``meta_cache_misses``,
    ``materializations`` and ``materializations.<trigger>`` (``item``, ``cpu``, ``repr``, ``explicit``,
    ``data_dependent`` ...), ``nodes_executed``, ``values_freed``, ``uploads``.

    Example:
        >>> import torch, genie
        >>> genie.reset_stats()
        >>> x = torch.ones(2, device="remote_accelerator")
        >>> genie.stats()["factories_recorded"]
        1
    """
    return dict(sorted(_counts.items()))


def reset_stats() -> None:
    """Zero every counter."""
    _counts.clear()
