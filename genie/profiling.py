"""Genie's phases as ``torch.profiler`` ranges: ``genie.record``, ``genie.plan``, ``genie.execute``,
``genie.transfer``.

A range costs a profiler event, so it exists only while a profiler is running: :func:`phase` checks
``torch.autograd.profiler._is_profiler_enabled`` (a module attribute the profiler sets) and
otherwise returns a shared no-op context. The recording hot path checks the same flag inline.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.autograd.profiler as _profiler

_NULL = contextlib.nullcontext()


def enabled() -> bool:
    """True while a ``torch.profiler``/``torch.autograd.profiler`` session records."""
    return _profiler._is_profiler_enabled


def phase(name: str) -> Any:
    """``record_function(f"genie.{name}")`` under a profiler, else a no-op context."""
    if _profiler._is_profiler_enabled:
        return _profiler.record_function(f"genie.{name}")
    return _NULL
