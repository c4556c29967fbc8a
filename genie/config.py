"""Genie's settings, read from ``GENIE_*`` environment variables once at import.

| variable | meaning | default |
|---|---|---|
| ``GENIE_DEVICE`` | real device that ``remote_accelerator:N`` runs on in process: ``cpu``, ``cuda`` (index N), or ``cuda:K`` (all indices on K) | ``cuda`` if available, else ``cpu`` |
| ``GENIE_DEVICE_COUNT`` | how many ``remote_accelerator`` indices exist | number of CUDA devices, at least 1 |
| ``GENIE_META_CACHE`` | ``0`` disables the meta-inference cache (for debugging) | ``1`` |
| ``GENIE_RECORD_SOURCE`` | ``1`` records the user's source line on every node (slower; used in error messages) | ``0`` |
| ``GENIE_DEBUG`` | logging level for the ``genie`` logger: ``0`` warnings, ``1`` info, ``2`` debug | ``0`` |
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


config = Config()

logger = logging.getLogger("genie")
if config.debug:
    logging.basicConfig()
    logger.setLevel(logging.DEBUG if config.debug >= 2 else logging.INFO)
