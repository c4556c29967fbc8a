"""Per-op random streams of a replay: the bottom of the backends (imports nothing from Genie), shared
by the interpreter, generated replay, export and the server's guard. ``csrc/replay.cpp`` computes
the same (``seed_from``, ``generator_for``) natively."""

from __future__ import annotations

import torch


def seed_from(seed: int, offset: int) -> int:
    """splitmix64 of (seed, offset): a well-mixed, deterministic per-op seed."""
    z = (seed + 0x9E3779B97F4A7C15 * (offset + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def generator_for(dev: torch.device) -> torch.Generator:
    if dev.type == "cuda":
        if not torch.cuda.is_initialized():  # its generators exist once CUDA is initialized: a
            torch.cuda.init()  # process whose first CUDA work is a replayed random op got ()
        return torch.cuda.default_generators[dev.index or 0]
    return torch.default_generator
