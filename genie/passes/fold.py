"""Constant folding: values computed only from constants are computed once, when the plan is
optimized, and become inputs of every later run of the plan.

Foldable: an instruction of a pure op (no written argument, not random, not data-dependent)
whose arguments are constants that are structure, not per-step parameters - ints, bools,
dtypes, devices, metadata arguments (``zeros_like``), other folded values - and no float (floats
are per-step parameters of a plan) and no host tensor; its values are not kept (a tensor the
program holds must be its own). A folded value that unfolded instructions read (the
*frontier*) becomes a tape input holding its value, computed here with the eager interpreter;
the folded instructions are dropped. A frontier value is only folded when no instruction
writes it and no reader returns a view of it (either would expose the plan's own tensor), and
when the frontier of a plan stays under :data:`MAX_BYTES` (the plan holds these tensors).

A shape-generic hit whose folded instructions carry other constants runs unoptimized (the
pipeline compares them), so a folded ``arange(n)`` never serves another ``n``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..backends.eager import run_instr
from ..device import real_device
from ..meta import policy
from ..planner import Instr, MetaArg, Slot, Tape
from . import PassReport, rebuild

MAX_BYTES = 1 << 20

_CONST = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, MetaArg)


def fold(tape: Tape) -> tuple[Tape, PassReport]:
    """Compute constant subgraphs once; their values read elsewhere become inputs."""
    blocked: set[int] = set()  # instructions whose value must stay the program's own
    while True:
        const: dict[int, int] = {}  # folded slot -> its instruction
        folded: list[int] = []
        for i, ins in enumerate(tape.instrs):
            if i in blocked or ins.device != tape.index or \
                    not _foldable(ins, const, tape.keep):
                continue
            folded.append(i)
            const.update((s, i) for s in ins.outs if s is not None)
        fset = set(folded)
        frontier: set[int] = set()
        bad: set[int] = set()
        for i, ins in enumerate(tape.instrs):
            if i in fset:
                continue
            reads = [x.id for x in ins.leaves if type(x) is Slot and x.id in const]
            pol = policy(ins.op) if isinstance(ins.op, torch._ops.OpOverload) else None
            if reads and (pol is None or pol.writes or pol.inplace_view or
                          any(r is not None for r in pol.returns)):
                bad.update(const[s] for s in reads)  # written or viewed: it would be exposed
            frontier.update(reads)
        if not bad:
            break
        blocked |= bad
    if not folded or not frontier:
        return tape, PassReport("fold", 0)
    dev = real_device(tape.index)
    env: dict[int, Any] = {}
    with _disable_current_modes(), torch.no_grad():
        for i in folded:
            ins = tape.instrs[i]
            for s, v in zip(ins.outs, run_instr(ins, env, dev), strict=False):
                if s is not None:
                    env[s] = v
    values = {s: env[s] for s in frontier}
    if sum(v.untyped_storage().nbytes() for v in values.values()) > MAX_BYTES:
        return tape, PassReport("fold", 0)
    instrs = [ins for i, ins in enumerate(tape.instrs) if i not in fset]
    new = rebuild(replace(tape, inputs={**tape.inputs, **values}), instrs, {})
    return new, PassReport("fold", len(folded))


def _foldable(ins: Instr, const: dict[int, int], keep: set[int]) -> bool:
    if ins.rng is not None or not isinstance(ins.op, torch._ops.OpOverload):
        return False
    pol = policy(ins.op)
    if pol.writes or pol.dynamic or pol.random or pol.inplace_view:
        return False
    if any(s is not None and s in keep for s in ins.outs):
        return False
    for x in ins.leaves:
        if type(x) is Slot:
            if x.id not in const:
                return False
        elif not isinstance(x, _CONST):
            return False
    return bool(ins.outs) and all(s is not None for s in ins.outs[:1])
