"""Genie's in-process settings, read from ``GENIE_*`` environment variables once at import.

``GENIE_DEVICE``, ``GENIE_DEVICE_COUNT``, ``GENIE_META_CACHE``, ``GENIE_RECORD_SOURCE``,
``GENIE_GC_UNTRACK`` and ``GENIE_DEBUG`` live here; the engine and remote modules read their own (``GENIE_BACKENDS``,
``GENIE_PLAN_CACHE``, ``GENIE_COMPILER``, ``GENIE_SERVER``, ...). docs/env.md is the one table of
all of them, with meanings and defaults.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass


def _flag(name: str, default: str) -> str:
    return os.environ.get(name, default).strip()


@dataclass
class Config:
    """Mutable process-wide settings (tests and users may change them at run time)."""

    device: str | None = _flag("GENIE_DEVICE", "") or None
    device_count: int | None = int(_flag("GENIE_DEVICE_COUNT", "0")) or None
    meta_cache: bool = _flag("GENIE_META_CACHE", "1") != "0"
    record_source: bool = _flag("GENIE_RECORD_SOURCE", "0") == "1"
    debug: int = int(_flag("GENIE_DEBUG", "0") or 0)
    # Output metadata of common ops from genie.shape_rules before meta kernels (0: kernels only).
    shape_rules: bool = _flag("GENIE_SHAPE_RULES", "1") != "0"
    # Take recorded nodes that cannot close a reference cycle off the cyclic GC (genie.graph).
    gc_untrack: bool = _flag("GENIE_GC_UNTRACK", "1") != "0"
    # Bind a run's values to its nodes natively (csrc/bind.cpp; 0: the Python loop, the reference).
    native_bind: bool = _flag("GENIE_NATIVE_BIND", "1") != "0"


config = Config()

logger = logging.getLogger("genie")
if config.debug:
    logging.basicConfig()
    logger.setLevel(logging.DEBUG if config.debug >= 2 else logging.INFO)
