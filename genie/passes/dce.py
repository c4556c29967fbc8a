"""Dead code elimination: instructions whose outputs nobody reads or keeps are dropped.

An instruction stays when a later instruction reads one of its outputs, when the tape keeps one
(requested values, values the program holds), when it writes an argument (an in-place update is
its effect), or when its schema returns nothing (it exists for a side effect). A dropped random
op changes no other value: each random op draws from its own ``(seed, offset)``.
"""

from __future__ import annotations

import torch

from ..meta import policy
from ..planner import Instr, Slot, Tape
from . import PassReport, rebuild


def dce(tape: Tape) -> tuple[Tape, PassReport]:
    """Drop instructions with no effect on kept values or arguments."""
    live = set(tape.keep)
    kept: list[Instr] = []
    for ins in reversed(tape.instrs):
        needed = any(s is not None and s in live for s in ins.outs)
        if not needed and isinstance(ins.op, torch._ops.OpOverload):
            needed = bool(policy(ins.op).writes) or not ins.op._schema.returns
        if needed:
            live.update(x.id for x in ins.leaves if type(x) is Slot)
            kept.append(ins)
    kept.reverse()
    return rebuild(tape, kept, {}), PassReport("dce", len(tape.instrs) - len(kept))
