"""Plan cache: a program that repeats its structure is planned (and compiled) once.

A *plan* is a tape with the values taken out: ops, argument trees, non-float constants, output
metadata, slot wiring, frees, outputs, kept slots, and the metadata of its inputs and host tensors.
Each materialization slices the graph exactly (:func:`~genie.planner.slice_nodes`, so correctness
never rests on the cache), then matches the slice against the cached plans of the same shape: one
pass over the nodes that compares each against the plan and, at the same time, collects this
step's *parameters* - input values, the host tensors of uploads and host constants, the
``(seed, offset)`` of random ops, float arguments. On a match the plan's instructions are reused
as they are (only those that carry parameters are rebuilt), so the step skips lowering and, on
the ``compiled`` backend, compilation: backends memoize their work on :attr:`Plan.artifacts`.

What is part of the structure (a different value is a different plan): ops, argument trees,
ints, bools, dtypes, devices and strings passed as arguments (they can decide shapes), the *type*
of float arguments, every output's shape/stride/dtype, input and host tensor metadata, which
values the program still holds (they decide frees), the source line when it is recorded. What is
not: tensor values, float values (a decaying learning rate, Adam's bias correction), random
offsets, node ids. Nothing depends on ``id()`` or object hashes; :attr:`Plan.key` is a
deterministic digest of the structure (the same program gives the same key in any process).

Lookup: plans are bucketed by a cheap prefix (node count, first/last op, requested outputs) and
matched by full structural comparison, which is cheaper than hashing the structure every step.
Counters: ``plan_cache_hits``, ``plan_cache_misses`` in :func:`genie.stats`.

Example:
    >>> import torch, genie
    >>> from genie import plan_cache
    >>> w = torch.ones(4, device="remote_accelerator")
    >>> _ = genie.materialize(w)
    >>> genie.reset_stats()
    >>> for step in range(3):
    ...     x = torch.full((4,), float(step)).to("remote_accelerator")  # new values: parameters
    ...     _ = (w * x + 0.5 * step).sum().item()
    >>> genie.stats()["plan_cache_misses"], genie.stats()["plan_cache_hits"]
    (1, 2)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import OrderedDict
from typing import Any

import torch

from .graph import Node, Ref, TensorMeta
from .planner import Instr, MetaArg, Slot, Tape, build_tape, held_after, slice_nodes
from .stats import _counts

UPLOAD = "genie.upload"


class _HostMeta:
    """Stand-in for a host tensor inside a cached plan: its metadata only (values are params)."""

    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = (tuple(t.shape), t.stride(), t.dtype,
                                                            t.device)

    def matches(self, t: torch.Tensor) -> bool:
        return (t.dtype == self.dtype and tuple(t.shape) == self.shape
                and t.stride() == self.stride and t.device == self.device)

    def __repr__(self) -> str:
        return f"<host {str(self.dtype).removeprefix('torch.')}{list(self.shape)}>"


class Plan:
    """A cached tape structure.

    Attributes:
        instrs: template instructions. Those that carry per-step parameters (host tensors, here
            as :class:`_HostMeta`; random offsets; floats that changed) are rebuilt for each
            tape; the others are shared by every tape of this plan and must not be mutated.
        metas / specs / wheres: per instruction, what a node must have to match.
        inputs: input slot -> :class:`~genie.graph.TensorMeta` of its value.
        outputs / keep: as in :class:`~genie.planner.Tape`.
        floats: ``(instr, leaf)`` of float arguments seen with another value than the plan's
            (a learning rate that decays, Adam's bias correction): backends that bake constants
            in make these inputs.
        artifacts: what backends memoize for this structure (``"compiled"`` -> compiled module).
        uses: how many tapes this plan produced.
    """

    __slots__ = ("instrs", "metas", "specs", "wheres", "inputs", "outputs", "keep", "floats",
                 "index", "artifacts", "uses", "_key")

    def __init__(self, tape: Tape, nodes: list[Node]) -> None:
        self.metas = [n.metas for n in nodes]
        self.specs = [n.spec for n in nodes]
        self.wheres = [n.where for n in nodes]
        self.instrs: list[Instr] = []
        for ins in tape.instrs:
            if any(isinstance(x, torch.Tensor) for x in ins.leaves):  # values are not kept
                ins = Instr(ins.op, [_HostMeta(x) if isinstance(x, torch.Tensor) else x
                                     for x in ins.leaves], ins.spec, ins.outs, ins.rng, ins.free,
                            ins.uid, ins.where, ins.device)
            self.instrs.append(ins)
        self.inputs = {s: TensorMeta.of(v, tape.index) for s, v in tape.inputs.items()}
        self.outputs = list(tape.outputs)
        self.keep = frozenset(tape.keep)
        self.index = tape.index
        self.floats: set[tuple[int, int]] = set()
        self.artifacts: dict[str, Any] = {}
        self.uses = 1
        self._key: str | None = None

    @property
    def key(self) -> str:
        """Deterministic digest (BLAKE2b-128, hex) of the structure: same program, same key."""
        if self._key is None:
            self._key = structure_key(self)
        return self._key

    def __repr__(self) -> str:
        return f"Plan({len(self.instrs)} instrs, {len(self.inputs)} inputs, uses={self.uses})"


class PlanCache:
    """Plans bucketed by a cheap prefix, least recently used evicted beyond ``capacity``."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._buckets: OrderedDict[Any, list[Plan]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def clear(self) -> None:
        self._buckets.clear()
        self._size = 0

    def plans(self) -> list[Plan]:
        """Every cached plan, least recently used first."""
        return [p for b in self._buckets.values() for p in reversed(b)]

    def lookup(self, targets: list[tuple[Node, int]], nodes: list[Node]) -> Tape | None:
        bucket = self._buckets.get(_prefix(targets, nodes))
        if bucket is None:
            return None
        for plan in bucket:
            tape = instantiate(plan, targets, nodes)
            if tape is not None:
                self._buckets.move_to_end(_prefix(targets, nodes))
                plan.uses += 1
                return tape
        return None

    def insert(self, targets: list[tuple[Node, int]], nodes: list[Node], tape: Tape) -> Plan:
        plan = Plan(tape, nodes)
        pre = _prefix(targets, nodes)
        bucket = self._buckets.setdefault(pre, [])
        bucket.insert(0, plan)
        self._buckets.move_to_end(pre)
        self._size += 1
        if len(bucket) > 8:  # a structure that varies in every step: keep the recent ones
            bucket.pop()
            self._size -= 1
        while self._size > self.capacity:
            _, old = self._buckets.popitem(last=False)
            self._size -= len(old)
        return plan


_cache = PlanCache()
_enabled = os.environ.get("GENIE_PLAN_CACHE", "1").strip() != "0"


def enable(on: bool = True) -> None:
    """Turn the plan cache on or off (``GENIE_PLAN_CACHE=0`` starts with it off)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def cache() -> PlanCache:
    """The process-wide plan cache."""
    return _cache


def clear() -> None:
    """Forget every cached plan (and what backends compiled for them)."""
    _cache.clear()


def plan(targets: list[tuple[Node, int]]) -> Tape:
    """A :class:`~genie.planner.Tape` for ``targets``: a cached plan's when the structure
    matches one (a hit), else a freshly built one, whose plan is cached (a miss)."""
    nodes = slice_nodes(targets)
    if not _enabled or not nodes:
        return build_tape(targets, nodes)
    tape = _cache.lookup(targets, nodes)
    if tape is not None:
        _counts["plan_cache_hits"] += 1
        return tape
    _counts["plan_cache_misses"] += 1
    tape = build_tape(targets, nodes)
    tape.plan = _cache.insert(targets, nodes, tape)
    return tape


def _prefix(targets: list[tuple[Node, int]], nodes: list[Node]) -> tuple[Any, ...]:
    # ops by schema name (``_name``): no object hashes, even in an in-process key
    return (len(nodes), _opname(nodes[0].op), _opname(nodes[-1].op), len(targets),
            _opname(targets[-1][0].op), targets[-1][1])


def _opname(op: Any) -> str:
    return getattr(op, "_name", op)


def instantiate(plan: Plan, targets: list[tuple[Node, int]], nodes: list[Node]) -> Tape | None:
    """The tape ``build_tape(targets)`` would build, from ``plan``; None if the structure differs.

    One pass: each node is compared with the plan's instruction at its position (op, argument
    tree, constants, output metadata, slot wiring) while its parameters are collected.
    """
    from .lazy_tensor import Alive

    tmpl = plan.instrs
    if len(tmpl) != len(nodes):
        return None
    changed: list[int] | None = None  # instructions whose float arguments differ from the plan's
    pin, keep, want_out = plan.inputs, plan.keep, plan.outputs
    slots: dict[tuple[int, int], int] = {}
    inputs: dict[int, torch.Tensor] = {}
    instrs = list(tmpl)
    in_run = {n.index for n in nodes}
    i = -1
    for n, t, meta, spec, where in zip(nodes, tmpl, plan.metas, plan.specs,
                                         plan.wheres, strict=True):
        i += 1
        if n.op is not t.op or (n.rng is None) is not (t.rng is None):
            return None
        if (n.metas is not meta and n.metas != meta) or (n.spec is not spec and n.spec != spec) \
                or (n.where is not where and n.where != where):
            return None
        leaves = n.leaves
        tl = t.leaves
        if leaves is None or len(leaves) != len(tl):
            return None
        params = False
        for x, y in zip(leaves, tl, strict=True):
            tx = type(x)
            if tx is Ref:
                if type(y) is not Slot:
                    return None
                key = (x.node.index, x.out)
                s = slots.get(key)
                if s is None:  # not produced in this run: an input
                    m = pin.get(y.id)
                    xn = x.node
                    if m is None or y.id in inputs or not xn.executed or xn.values is None:
                        return None
                    v = xn.values[x.out]
                    if v is None or (xn.metas[x.out] is not m and xn.metas[x.out] != m):
                        return None
                    slots[key] = y.id
                    inputs[y.id] = v
                elif s != y.id:
                    return None
            elif tx is float:  # a parameter: only its type is structure
                if type(y) is not float:
                    return None
                if x is not y and not _same_const(x, y):
                    params = True
                    if changed is None:
                        changed = []
                    changed.append(i)
            elif tx is MetaArg:
                if type(y) is not MetaArg or x.meta != y.meta:
                    return None
            elif isinstance(x, torch.Tensor):
                if type(y) is not _HostMeta or not y.matches(x):
                    return None
                params = True
            elif not _same_const(x, y):
                return None
        outs = t.outs
        idx = n.index
        k = 0
        for s in outs:
            if s is not None:
                slots[(idx, k)] = s
                # Which values the program still holds decides the frees: must be the plan's.
                r = n.outputs[k]
                held = (r is not None and type(r()) is Alive) or held_after(n, k, in_run)
                if held is not (s in keep) and s not in want_out:
                    return None
            k += 1
        if params or n.rng is not None:
            instrs[i] = Instr(n.op, [x if isinstance(x, (torch.Tensor, float)) else y
                                     for x, y in zip(leaves, tl, strict=True)],
                              t.spec, outs, n.rng, t.free, n.uid, n.where, t.device)
    outputs = []
    for (node, out), want in zip(targets, want_out, strict=False):  # lengths: below
        s = slots.get((node.index, out))
        if s is None:  # a requested value that is already materialized: an input slot
            m = pin.get(want)
            if m is None or want in inputs or not node.executed or node.values is None or \
                    node.values[out] is None or node.metas[out] != m:
                return None
            slots[(node.index, out)] = want
            inputs[want] = node.values[out]
            s = want
        if s != want:
            return None
        outputs.append(s)
    if len(outputs) != len(want_out) or len(inputs) != len(pin):
        return None
    if changed is not None:
        for i in changed:
            for j, (x, y) in enumerate(zip(instrs[i].leaves, tmpl[i].leaves, strict=True)):
                if type(x) is float and not _same_const(x, y):
                    plan.floats.add((i, j))
    return Tape(instrs, inputs, outputs, set(keep), nodes, slots, plan.index, plan)


def _same_const(a: Any, b: Any) -> bool:
    """Equality that tells 1 from True from 1.0, and -0.0 from 0.0; NaN equals NaN."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is float:
        if a != a:
            return b != b
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    try:
        return bool(a == b)
    except Exception:
        return False


# --- deterministic key --------------------------------------------------------------------------

def structure_key(plan: Plan) -> str:
    """BLAKE2b-128 hex digest of a plan's structure (ops by schema name, trees, constants,
    metadata, wiring); independent of ``id()``, object hashes and tensor values."""
    from .tape_io import _meta_data, op_to_name, spec_to_data

    def leaf(x: Any) -> Any:
        if type(x) is Slot:
            return ["slot", x.id]
        if type(x) is _HostMeta:
            return ["host", list(x.shape), list(x.stride), str(x.dtype), str(x.device)]
        if type(x) is MetaArg:
            return ["meta", *_meta_data(x.meta)]
        if x is None or type(x) in (bool, int, str):
            return x
        if type(x) is float:
            return ["float"]  # a parameter: its value is not structure
        return [type(x).__name__, repr(x)]

    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([sorted([s, _meta_data(m)] for s, m in plan.inputs.items()),
                         plan.outputs, sorted(plan.keep), plan.index]).encode())
    for i, ins in enumerate(plan.instrs):
        row = [op_to_name(ins.op), spec_to_data(ins.spec) if ins.spec is not None else None,
               [leaf(x) for x in ins.leaves], list(ins.outs), list(ins.free),
               ins.rng is not None, ins.device, plan.wheres[i],
               [_meta_data(m) if m is not None else None for m in plan.metas[i]]]
        h.update(json.dumps(row).encode())
    return h.hexdigest()
