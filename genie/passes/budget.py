"""The device-memory budget the memory passes (``recompute``, ``split_foreach``) plan under: the
bottom of :mod:`genie.passes` (imports nothing from it), read by the passes and set through
:func:`genie.passes.set_memory_budget`."""

from __future__ import annotations

import os
import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_bytes(text: str, where: str = "GENIE_MEMORY_BUDGET") -> int:
    """``"512MiB"``, ``"1.5GB"``, ``"1048576"`` -> bytes.

    Example:
        >>> parse_bytes("512MiB")
        536870912
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"[{where}] cannot read {text!r} as a size: expected a number of bytes "
                         "with an optional unit, e.g. 536870912, 512MiB, 1.5GB")
    return int(float(m.group(1)) * _UNITS[unit])


_budget: list[int | None | bool] = [False]  # False: not read yet


def memory_budget() -> int | None:
    """Bytes the ``recompute`` pass keeps a plan's device peak under (None: no budget)."""
    if _budget[0] is False:
        env = os.environ.get("GENIE_MEMORY_BUDGET", "").strip()
        _budget[0] = parse_bytes(env) if env else None
    return _budget[0]  # type: ignore[return-value]
