"""Split an optimizer's ``_foreach_*`` update into groups of parameters under a memory budget.

``torch.optim`` updates every parameter with one ``_foreach_*`` call per step of the formula;
AdamW's ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`` makes a fresh temporary of every
parameter's size at once, alive until ``_foreach_addcdiv_`` reads it: a training step's peak is
then parameters + gradients + both moments + one more copy of the parameters. This pass runs such
a chain group by group (``sqrt``, ``div_``, ``add_``, ``addcdiv_`` of the first parameters, then
of the next ...), so that only one group's temporaries are alive: groups of consecutive
parameters whose temporaries add up to at most the largest one's.

Active only with a budget (``GENIE_MEMORY_BUDGET``, :func:`genie.passes.set_memory_budget`)
that the tape's peak (held + high-water mark) passes. Values are bit-equal: each group runs the
same op, with the same constants, on the same elements (the ``_foreach_*`` kernels compute every
element from the same index of their lists).

A group's instruction is its origin with the list elements of the other parameters replaced by
a zero-size placeholder of the same dtype (a new tape input, reported in
:attr:`PassReport.placeholders`): its op, spec and constants are the step's own, so the edit
script takes each step's constants (AdamW's bias corrections change every step) and the origin
is not frozen. Functional outputs of the other positions are not bound.

Applied to a run of consecutive ``_foreach_*`` instructions over lists of one length ``n``,
from its first functional one (the ``in-place`` updates before it make no temporaries and stay
whole), when: every non-list argument is a plain constant (not a tensor: ``lr`` as a tensor,
``capturable``, stays whole), every list element is a tape value, and no storage appears at
two positions (a group must not read what another group writes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import optree
import torch

from .. import memory
from ..device import real_device
from ..meta import policy
from ..planner import Instr, Slot, Tape
from . import PassReport, rebuild
from .budget import memory_budget

MIN_GAIN = 0.05  # a run is split only to save at least this share of the tape's high-water mark


def split_foreach(tape: Tape) -> tuple[Tape, PassReport]:
    """Run the ``_foreach_*`` chains that make temporaries one group of parameters at a time."""
    budget = memory_budget()
    if budget is None or not tape.instrs:
        return tape, PassReport("split_foreach", 0)
    high_water = memory.tape_high_water(tape)
    if memory.memory_allocated(tape.index) + high_water <= budget:
        return tape, PassReport("split_foreach", 0)
    a = _Aliases(tape)
    out: list[Instr] = []
    inputs = dict(tape.inputs)
    holders: dict[tuple[int, torch.dtype], int] = {}  # (device index, dtype) -> placeholder slot
    top = [max([*tape.inputs, *(s for ins in tape.instrs for s in ins.outs if s is not None)],
               default=-1)]

    def holder(device: int, dtype: torch.dtype) -> int:
        s = holders.get((device, dtype))
        if s is None:
            top[0] += 1
            s = holders[(device, dtype)] = top[0]
            inputs[s] = torch.empty(0, dtype=dtype, device=real_device(device))
        return s

    i, n_instrs, added = 0, len(tape.instrs), 0
    dtypes: dict[int, torch.dtype] | None = None
    while i < n_instrs:
        run = _run_at(tape, i)
        if run is None:
            out.append(tape.instrs[i])
            i += 1
            continue
        j, n, lists = run  # instructions [i, j), lists of length n, their list leaf positions
        first = next((k for k in range(i, j) if _makes(tape.instrs[k])), None)
        groups = _groups(tape, first, j, n, high_water * MIN_GAIN) if first is not None \
            else None
        if groups is None or not a.disjoint(tape.instrs[first:j], lists[first - i:]):
            out.extend(tape.instrs[i:j])
            i = j
            continue
        out.extend(tape.instrs[i:first])
        if dtypes is None:
            dtypes = _dtypes(tape)
        for g in groups:
            for k in range(first, j):
                out.append(_piece(tape, k, lists[k - i], g, dtypes, holder))
        added += (len(groups) - 1) * (j - first)
        i = j
    if not added:
        return tape, PassReport("split_foreach", 0)
    new = rebuild(replace(tape, inputs=inputs), out, {})
    return new, PassReport("split_foreach", -added, placeholders=frozenset(holders.values()))


def _is_foreach(ins: Instr) -> bool:
    op = ins.op
    return isinstance(op, torch._ops.OpOverload) and op._schema.name.startswith("aten::_foreach_") \
        and ins.rng is None


def _makes(ins: Instr) -> bool:
    """Whether ``ins`` makes values (``_foreach_sqrt``), not only updates its lists in place."""
    return any(s is not None for s in ins.outs)


def _lists(ins: Instr) -> tuple[int, list[list[int]]] | None:
    """``(n, leaf positions of each list argument)`` when every list has length ``n`` and every
    other argument is a plain constant; None otherwise."""
    positions: list[list[int]] = []
    n = None
    args, kwargs = optree.tree_unflatten(ins.spec, list(range(len(ins.leaves))))
    for a in (*args, *kwargs.values()):
        if isinstance(a, list):
            if n is None:
                n = len(a)
            if len(a) != n or not all(isinstance(p, int) for p in a):
                return None
            positions.append(list(a))
        else:
            for p in optree.tree_leaves(a, none_is_leaf=True):
                if isinstance(ins.leaves[p], (Slot, torch.Tensor)):
                    return None  # a tensor shared by all positions (lr as a tensor, ...)
    if n is None or n < 2:
        return None
    tensor_lists = [ps for ps in positions if all(type(ins.leaves[p]) is Slot for p in ps)]
    if not tensor_lists or any(
            ps not in tensor_lists and any(isinstance(ins.leaves[p], (Slot, torch.Tensor))
                                           for p in ps) for ps in positions):
        return None  # a list mixing tape values with host tensors
    if _makes(ins) and len(ins.outs) != n:
        return None
    return n, tensor_lists


def _run_at(tape: Tape, i: int) -> tuple[int, int, list[list[list[int]]]] | None:
    """The run of splittable ``_foreach_*`` instructions starting at ``i``: ``(end, n, each
    one's tensor-list leaf positions)``."""
    lists = []
    n = None
    j = i
    while j < len(tape.instrs):
        ins = tape.instrs[j]
        got = _lists(ins) if _is_foreach(ins) and ins.device == tape.instrs[i].device else None
        if got is None or (n is not None and got[0] != n):
            break
        n = got[0]
        lists.append(got[1])
        j += 1
    return (j, n, lists) if n is not None else None


def _groups(tape: Tape, first: int, end: int, n: int, min_gain: float
            ) -> list[list[int]] | None:
    """Consecutive positions whose temporaries add up to at most the largest one's; None when
    splitting would save less than ``min_gain`` bytes (``clip_grad_norm_``'s
    ``_foreach_norm`` makes one scalar per gradient: not worth n instructions)."""
    size = [0] * n
    for k in range(first, end):
        if not _makes(tape.instrs[k]):
            continue
        for p, m in enumerate(tape.nodes[k].metas):
            if m is not None:
                size[p] = max(size[p], memory._nbytes(m))
    cap = max(size)
    if cap == 0 or sum(size) - cap < max(min_gain, 1):
        return None
    groups: list[list[int]] = [[]]
    acc = 0
    for p in range(n):
        if groups[-1] and acc + size[p] > cap:
            groups.append([])
            acc = 0
        groups[-1].append(p)
        acc += size[p]
    return groups if len(groups) > 1 else None


def _piece(tape: Tape, k: int, lists: list[list[int]], group: list[int],
           dtypes: dict[int, torch.dtype], holder: Any) -> Instr:
    """Instruction ``k`` restricted to the positions in ``group``."""
    ins = tape.instrs[k]
    leaves = list(ins.leaves)
    keep = set(group)
    for ps in lists:
        for pos, p in enumerate(ps):
            if pos not in keep:
                leaves[p] = Slot(holder(ins.device, dtypes[leaves[p].id]))
    outs = tuple(s if pos in keep else None for pos, s in enumerate(ins.outs)) if _makes(ins) \
        else ins.outs
    return replace(ins, leaves=leaves, outs=outs)


def _dtypes(tape: Tape) -> dict[int, torch.dtype]:
    """Each tape value's dtype (inputs' and what the instructions make)."""
    out = {s: t.dtype for s, t in tape.inputs.items()}
    for ins, node in zip(tape.instrs, tape.nodes):
        for s, m in zip(ins.outs, node.metas):
            if s is not None and m is not None:
                out[s] = m.dtype
    return out


class _Aliases:
    """Which storage each tape value lives in: an input's real storage, else the fresh value
    its chain of views and in-place results starts from."""

    def __init__(self, tape: Tape) -> None:
        self.root: dict[int, Any] = {}
        for s, t in tape.inputs.items():
            try:
                self.root[s] = ("storage", t.untyped_storage().data_ptr())
            except Exception:
                self.root[s] = ("slot", s)
        for ins in tape.instrs:
            rets = policy(ins.op).returns if isinstance(ins.op, torch._ops.OpOverload) else ()
            src = next((x.id for x in ins.leaves if type(x) is Slot), None)
            for p, s in enumerate(ins.outs):
                if s is None:
                    continue
                r = rets[0] if len(rets) == 1 else (rets[p] if p < len(rets) else None)
                self.root[s] = self.root.get(src, ("slot", src)) if r is not None and \
                    src is not None else ("slot", s)

    def disjoint(self, instrs: list[Instr], lists: list[list[list[int]]]) -> bool:
        """Whether no storage is read or written at two positions of these instructions' lists."""
        at: dict[Any, int] = {}
        for ins, ls in zip(instrs, lists, strict=True):
            for ps in ls:
                for pos, p in enumerate(ps):
                    r = self.root[ins.leaves[p].id]
                    if at.setdefault(r, pos) != pos:
                        return False
        return True
