"""Recomputation under a memory budget: activations are freed after their forward use and
recomputed before their backward use (checkpointing, Chen et al. 2016, chosen from sizes).

Active only with a budget (``GENIE_MEMORY_BUDGET``, :func:`genie.passes.set_memory_budget`) and
only when the tape's peak - what the device holds when it starts plus the high-water mark of
the values it creates (:func:`genie.memory.tape_high_water`) - exceeds it, and when that peak is
not set by what the device holds after the run anyway (held values plus the values the tape
keeps: parameters and gradients of a training step; no schedule lowers that floor).

Candidates: fresh values (not views) that no one writes, that the program does not keep, made
by a pure op (no written argument, not data-dependent; random ops qualify: a copy replays the
same ``(seed, offset)``, so its values are bit-equal), and whose reads (through any view) fall
in two clusters - the largest gap between uses, "forward" and "backward" - around the tape's
peak. A dropped value is freed after its last early read; its first
late read recomputes it right before, from its producer's arguments: those alive then are read,
those dropped or freed are recomputed in turn (a chain back to the nearest value that is alive:
a checkpoint). A recomputed copy serves every later read. Where a chain cannot be recomputed
(an op that is not pure, an argument written since the producer ran), the read takes the
original value, which then stays alive: that candidate is simply not dropped.

Schedules tried: no chains (only the *cheap* candidates, whose arguments are alive anyway), all
candidates, and Chen's greedy segments (walking forward, a candidate is kept as a checkpoint
once the bytes dropped since the last checkpoint reach a segment size, tried around
sqrt(total bytes x the largest value)), over all candidates and over the others with the cheap
ones dropped too. The least work within budget wins (recomputed output elements, times the
reduced dimension for matrix products), else the lowest peak.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import optree
import torch

from .. import memory
from ..meta import policy
from ..planner import Instr, Slot, Tape
from . import PassReport, rebuild
from .budget import memory_budget

MIN_BYTES = 1 << 10  # values smaller than this are not worth a recomputation
_aten = torch.ops.aten
_BIAS_FIRST = frozenset({_aten.addmm.default, _aten.baddbmm.default})
_MATMUL = frozenset({_aten.mm.default, _aten.bmm.default, *_BIAS_FIRST})


def recompute(tape: Tape) -> tuple[Tape, PassReport]:
    """Free and recompute activations so that the tape's peak fits the memory budget."""
    budget = memory_budget()
    if budget is None or not tape.instrs:
        return tape, PassReport("recompute", 0)
    held = memory.memory_allocated(tape.index)
    a = _Analysis(tape)
    before = held + a.peak
    # what the device holds after the run (what it held, plus the values the tape keeps) is a
    # floor no schedule lowers: a peak made of parameters and gradients is not an activation's
    floor = held + a.kept_bytes()
    if before <= budget or floor >= before * 0.95:
        return tape, PassReport("recompute", 0)
    target = budget - held
    cands = a.candidates(target)
    if not cands:
        return tape, PassReport("recompute", 0)
    cheap = {c for c in cands if a.no_chain(c)}  # recomputed from values alive anyway
    tries: list[set[int]] = [cheap, set(cands)]
    # Chen's greedy: walking forward, a candidate becomes a checkpoint (kept) once the bytes
    # dropped since the last one reach ``seg``; segment sizes around sqrt(total) and beyond
    # (checkpoints only among the largest values: a small one, a dropout mask, rarely ends a
    # chain of recomputation), over all candidates and over those that are not cheap (with the
    # cheap ones dropped anyway: a GELU's output recomputed from its input alive for backward)
    for pool, extra in ((cands, set()), ([c for c in cands if c not in cheap], cheap)):
        if not pool:
            continue
        total = sum(a.size[c] for c in pool)
        big = max(a.size[c] for c in pool)
        root = math.isqrt(total * big)
        for f in (0.25, 0.5, 1, 2, 4):
            for phase in (0.0, 0.5):
                seg = root * f
                acc, r = seg * phase, set(extra)
                for c in pool:
                    if acc >= seg and 2 * a.size[c] >= big:
                        acc = 0  # c is a checkpoint
                        continue
                    acc += a.size[c]
                    r.add(c)
                tries.append(r)
    # checkpoints at the forward's cuts (a transformer's residual stream between blocks):
    # every candidate dropped but every k-th cut, so that each chain stops at the cut before it
    cuts = a.cuts(cands)
    for k in (1, 2, 3):
        if len(cuts) >= k:
            tries.append(set(cands) - set(cuts[k - 1::k]))
    best: tuple[Any, ...] | None = None
    seen: set[frozenset[int]] = set()
    for r in tries:
        key = frozenset(r)
        if not r or key in seen:
            continue
        seen.add(key)
        got = a.schedule(r)
        if got is None:
            continue
        new, added = got
        peak = max(held + memory.tape_high_water(new), floor)
        fits = peak <= budget
        score = (not fits, a.work(new, added) if fits else peak, peak)
        if best is None or score < best[0]:
            best = (score, new, added, peak)
    if best is None or best[3] >= before * 0.95:  # less than 5% lower: not worth the time
        return tape, PassReport("recompute", 0)
    _, new, added, _ = best
    return new, PassReport("recompute", -added)


class _Fail(Exception):
    """A value that cannot be recomputed where it is needed (``why``)."""

    def __init__(self, root: int, why: str = "") -> None:
        self.root = root
        self.why = why


class _Analysis:
    """Producers, reads, sizes, alias roots and writes of a tape's slots."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.prod: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.root: dict[int, int] = {}
        self.reads: dict[int, list[int]] = {}
        self.written: dict[int, list[int]] = {}
        self.pure: list[bool] = []
        live = 0
        self.live: list[int] = []
        for i, (ins, node) in enumerate(zip(tape.instrs, tape.nodes, strict=True)):
            for x in ins.leaves:
                if type(x) is Slot:
                    self.reads.setdefault(x.id, []).append(i)
            op = ins.op
            if not isinstance(op, torch._ops.OpOverload):  # uploads: fresh, not recomputable
                self.pure.append(False)
                for k, s in enumerate(ins.outs):
                    if s is not None:
                        self._fresh(s, i, node.metas[k])
                        live += self.size[s]
            else:
                pol = policy(op)
                args, kwargs = optree.tree_unflatten(ins.spec, ins.leaves)
                for pos in pol.writes:
                    for s in _slots(pol.arg(pos, args, kwargs)):
                        self.written.setdefault(self.root.get(s, s), []).append(i)
                self.pure.append(not pol.writes and not pol.dynamic and not pol.inplace_view
                                 and not any(isinstance(x, torch.Tensor) for x in ins.leaves))
                rets = pol.returns
                for k, s in enumerate(ins.outs):
                    if s is None:
                        continue
                    r = rets[0] if len(rets) == 1 else (rets[k] if k < len(rets) else None)
                    if r is None:
                        self._fresh(s, i, node.metas[k])
                        live += self.size[s]
                    else:
                        src = _slots(pol.arg(r[1], args, kwargs))
                        self.prod[s] = i
                        self.root[s] = self.root.get(src[0], src[0]) if src else s
            self.live.append(live)
            for s in ins.free:
                live -= self.size.get(s, 0)
        self.peak = max(self.live, default=0)
        self.first_new = max([*self.prod, *tape.inputs], default=-1) + 1  # recomputed slots
        self.last = {s: p[-1] for s, p in self.reads.items()}
        self.groups: dict[int, list[int]] = {}
        for s, r in self.root.items():
            self.groups.setdefault(r, []).append(s)
        self.split: dict[int, tuple[int, int]] = {}  # root -> (last early read, first late read)

    def work(self, new: Tape, added: int) -> int:
        """Rough cost of the recomputed instructions of ``new`` (its extra ``added`` ones):
        output elements, times the reduced dimension for matrix products."""
        total = 0
        for ins, node in zip(new.instrs, new.nodes, strict=True):
            if added == 0:
                break
            if not any(s is not None and s >= self.first_new for s in ins.outs):
                continue
            added -= 1
            m = next((m for m in node.metas if m is not None), None)
            n = math.prod(m.shape) if m is not None else 1
            if ins.op in _MATMUL:
                n *= self._inner(ins)
            total += n
        return total

    def _inner(self, ins: Instr) -> int:
        """The reduced dimension of a matrix product: the last of its first matrix argument."""
        slots = [x.id for x in ins.leaves if type(x) is Slot]
        x = slots[1] if ins.op in _BIAS_FIRST and len(slots) > 1 else (slots[0] if slots else None)
        m = self.meta_of(x) if x is not None else None
        return m.shape[-1] if m is not None and len(m.shape) else 1

    def meta_of(self, s: int) -> Any:
        v = self.tape.inputs.get(s)
        if v is not None:
            return v
        i = self.prod.get(s)
        if i is None:
            return None
        ins, node = self.tape.instrs[i], self.tape.nodes[i]
        return node.metas[ins.outs.index(s)]

    def kept_bytes(self) -> int:
        """Bytes of the fresh values the tape keeps (through views: their bases)."""
        roots = {self.root.get(s, s) for s in self.tape.keep}
        return sum(self.size.get(r, 0) for r in roots)

    def _fresh(self, s: int, i: int, meta: Any) -> None:
        self.prod[s] = i
        self.root[s] = s
        self.size[s] = memory._nbytes(meta) if meta is not None else 0

    def candidates(self, target: int) -> list[int]:
        peak_at = self.live.index(self.peak)  # a candidate must be dead-able across the peak
        t = self.tape
        out = []
        for v, group in self.groups.items():
            if self.root.get(v) != v or self.size.get(v, 0) < MIN_BYTES or v in t.inputs or \
                    not self.pure[self.prod[v]] or self.written.get(v) or \
                    any(s in t.keep for s in group):
                continue
            pos = sorted({self.prod[v], *(p for s in group for p in self.reads.get(s, ()))})
            if len(pos) < 2:
                continue
            g = max(range(len(pos) - 1), key=lambda j: pos[j + 1] - pos[j])
            early, late = pos[g], pos[g + 1]
            if not early < peak_at < late:
                continue
            self.split[v] = (early, late)
            out.append(v)
        out.sort(key=self.prod.__getitem__)
        return out

    def cuts(self, cands: list[int]) -> list[int]:
        """The candidates (in forward order) that no other candidate's forward reads cross: once
        one is made, the forward reads no earlier candidate again, so a chain recomputing a value
        after it stops there when it is kept (the values between two blocks of a network)."""
        out, reach = [], -1  # the last early read of the candidates made so far
        i = 0
        while i < len(cands):
            p = self.prod[cands[i]]
            same = [c for c in cands[i:] if self.prod[c] == p]
            if reach <= p and len(same) == 1:
                out.append(cands[i])
            for c in same:
                reach = max(reach, self.split[c][0])
            i += len(same)
        return out

    def no_chain(self, v: int) -> bool:
        """Whether ``v``'s producer's arguments are all alive at its first late read."""
        late = self.split[v][1]
        ins = self.tape.instrs[self.prod[v]]
        return all(self._alive(x.id, late, frozenset()) for x in ins.leaves if type(x) is Slot)

    def _alive(self, y: int, t: int, dropped: frozenset[int] | set[int]) -> bool:
        tape = self.tape
        if y in tape.inputs or y in tape.keep:
            return True
        r = self.root.get(y, y)
        if r in dropped:
            return t <= self.split[r][0]
        return t <= self.last.get(y, -1)

    def schedule(self, dropped: set[int]) -> tuple[Tape, int] | None:
        """The tape with ``dropped`` (roots) recomputed at their late reads, and how many
        instructions that adds (None when nothing is dropped)."""
        if not dropped:
            return None
        s = _Scheduler(self, dropped)
        for t, ins in enumerate(self.tape.instrs):
            s.emit(t, ins)
        added = len(s.out) - len(self.tape.instrs)
        new = rebuild(self.tape, s.out, {})
        return replace(new, nodes=[self.tape.nodes[i] for i in s.src]), added


class _Scheduler:
    """One schedule being built: the instructions so far, and which copy holds a value now.

    A read of a dropped value that cannot be recomputed (a chain reaches a value that is not
    pure, or whose argument was written since) reads the original instead: that value is then
    simply not dropped (it is never written, so it still holds what it did).
    """

    def __init__(self, a: _Analysis, dropped: set[int]) -> None:
        self.a = a
        self.dropped = dropped
        self.cur: dict[int, int] = {}  # original slot -> the recomputed copy that holds it
        self.out: list[Instr] = []
        self.src: list[int] = []  # per instruction of out, the tape instruction it copies
        self.nxt = max([*a.prod, *a.tape.inputs], default=-1) + 1
        self.failed: set[int] = set()

    def emit(self, t: int, ins: Instr) -> None:
        a, dropped = self.a, self.dropped
        leaves = ins.leaves
        if any(type(x) is Slot and not a._alive(x.id, t, dropped) for x in leaves):
            new = []
            for x in leaves:
                if type(x) is Slot and x.id not in self.failed:
                    mark, added = len(self.out), []
                    try:
                        x = Slot(self.get(x.id, t, added))
                    except _Fail:  # not recomputable from here: the original stays alive
                        del self.out[mark:], self.src[mark:]
                        for k in added:
                            del self.cur[k]
                        self.failed.add(x.id)
                new.append(x)
            ins = replace(ins, leaves=new)
        self.out.append(ins)
        self.src.append(t)

    def get(self, y: int, t: int, added: list[int]) -> int:
        if self.a._alive(y, t, self.dropped):
            return y
        c = self.cur.get(y)
        return c if c is not None else self.materialize(y, t, added)

    def extend(self, y: int, r: int, i: int | None, t: int) -> bool:
        """Whether a chain may read the original ``y`` at ``t`` though it is not recomputable
        (an upload: an empty KV cache's ``torch.tensor([])``): when its storage is small, kept
        (not dropped) and not written since it was made, the original lives on until ``t``
        (the tape's frees follow the last read) instead of failing the whole chain."""
        a = self.a
        return (i is not None and r not in self.dropped and 0 <= a.size.get(r, -1) < MIN_BYTES
                and not any(a.prod[r] < q < t for q in a.written.get(r, ())))

    def materialize(self, y: int, t: int, added: list[int]) -> int:
        a = self.a
        r = a.root.get(y, y)
        i = a.prod.get(y)
        if i is None or not a.pure[i]:
            if self.extend(y, r, i, t):
                return y
            raise _Fail(r, f"%{y} (made by {i}) is not recomputable")
        view = r != y  # a view reads its base's storage as it is now, as the original does
        if not view and any(i < q < t for q in a.written.get(y, ())):
            raise _Fail(r, f"%{y} is written before {t}")
        ins = a.tape.instrs[i]
        leaves = list(ins.leaves)
        for p, x in enumerate(leaves):
            if type(x) is Slot:
                w = () if view else a.written.get(a.root.get(x.id, x.id), ())
                if any(i < q < t for q in w):  # its argument changed since: not the value
                    raise _Fail(r, f"%{x.id} read by {i} is written before {t}")
                leaves[p] = Slot(self.get(x.id, t, added))
        outs: list[int | None] = []
        for s in ins.outs:
            if s is None:
                outs.append(None)
            else:
                outs.append(self.nxt)
                self.cur[s] = self.nxt
                added.append(s)
                self.nxt += 1
        self.out.append(replace(ins, leaves=leaves, outs=tuple(outs), free=()))
        self.src.append(i)
        return self.cur[y]


def _slots(x: Any) -> list[int]:
    if type(x) is Slot:
        return [x.id]
    if isinstance(x, (list, tuple)):
        return [y.id for y in x if type(y) is Slot]
    return []
