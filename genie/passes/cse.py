"""Common subexpression elimination: an instruction that repeats an earlier one is dropped.

Two instructions are the same when they call the same overload on the same slots with equal
constants (``1`` is not ``1.0`` nor ``True``; ``0.0`` is not ``-0.0``). Only pure ops qualify:
no written or aliased argument, fresh outputs, not random, no host tensors; and a repeat whose
value the program holds stays (two tensors must not become one). Any instruction that
writes a storage forgets everything seen so far: after ``x.add_(1)`` a second ``x * 2`` reads
another value than the first, through the same slot.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ..meta import policy
from ..planner import Instr, MetaArg, Slot, Tape
from . import PassReport, rebuild

_SIMPLE = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)


def cse(tape: Tape) -> tuple[Tape, PassReport]:
    """Drop repeated pure instructions; later readers use the first one's slots."""
    seen: dict[Any, tuple[int | None, ...]] = {}
    renamed: dict[int, int] = {}
    instrs: list[Instr] = []
    for ins in tape.instrs:
        if renamed and any(type(x) is Slot and x.id in renamed for x in ins.leaves):
            ins = replace(ins, leaves=[Slot(renamed.get(x.id, x.id)) if type(x) is Slot else x
                                       for x in ins.leaves])
        if not isinstance(ins.op, torch._ops.OpOverload):
            instrs.append(ins)
            continue
        pol = policy(ins.op)
        if pol.writes or pol.inplace_view:
            seen.clear()  # values read through any slot may have changed
            instrs.append(ins)
            continue
        key = _key(ins, pol)
        if key is None:
            instrs.append(ins)
            continue
        first = seen.get(key)
        if first is None or any(s in tape.keep for s in ins.outs if s is not None):
            # (a value the program holds stays its own tensor: merging would alias two tensors)
            seen.setdefault(key, ins.outs)
            instrs.append(ins)
            continue
        for a, b in zip(ins.outs, first, strict=True):
            if a is not None and b is not None:
                renamed[a] = b
    removed = len(tape.instrs) - len(instrs)
    return rebuild(tape, instrs, renamed), PassReport("cse", removed, renamed)


def _key(ins: Instr, pol: Any) -> Any:
    if ins.rng is not None or pol.random or pol.dynamic or any(r is not None for r in pol.returns):
        return None
    parts: list[Any] = [ins.op, ins.spec, ins.device]
    for x in ins.leaves:
        t = type(x)
        if t is Slot:
            parts.append(("s", x.id))
        elif t is float:
            if x != x:
                return None  # NaN: equal to nothing, keep both
            parts.append((float, x, math.copysign(1.0, x)))
        elif t is MetaArg:
            parts.append(("m", x.meta))
        elif isinstance(x, _SIMPLE):
            parts.append((t, x))
        else:
            return None
    return tuple(parts)
