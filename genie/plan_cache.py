"""Plan cache: a program that repeats its structure is planned (and compiled) once.

A *plan* is a tape with the values taken out: ops, argument trees, non-float constants, output
metadata, slot wiring, frees, outputs, kept slots, and the metadata of its inputs and host tensors.
Each materialization finds its exact slice (by :func:`match`, or by
:func:`~genie.planner.slice_nodes`; see Lookup), then matches it against the cached plans: one
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

Lookup, fast path first: :func:`match` finds the slice *from the plan*: it walks the plan's
instructions backwards from the requested values, taking each instruction's node from the
argument references of the targets and of later nodes, and checks every reference (in-plan ones
must point at the pending node of that position, in record order; inputs at executed nodes with
kept values), so the nodes it finds are exactly the slice. Nodes are compared by their interned
meta-cache entry (``Node.entry``; identity stands for op, argument tree, input metadata and
non-float constants), leaf by leaf where it has none (an upload); the checks run column by
column, natively (csrc/match.cpp); the tape's ``slots`` are built only when read. A slice that
writes (a training step's optimizer updates) is found the same way: an in-place update is
reached through the pending writes of the storages the plan's nodes read (or the requested
values'), at the sites the plan names, and every such list must be exactly the plan's, with no
pending reader before one of its writes outside it (:func:`_write_sites`), so the nodes found
are ``slice_nodes``' closure over writes. Anything else (or no match) slices with
:func:`~genie.planner.slice_nodes` and uses :func:`instantiate`: plans there are bucketed by a
cheap prefix (node count, first/last op, requested outputs) and matched by full structural
comparison, which is cheaper than hashing the structure every step.
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
import os
import weakref
from collections import OrderedDict
from itertools import islice, repeat
from operator import attrgetter, eq, getitem, is_, itemgetter, lt
from typing import Any

import torch

from ._C import _instantiate as _native_instantiate
from ._C import _inputs_differ, _match_core, _match_init, _rebuild_instrs, _slice_init
from .config import config
from .graph import MetaArg, Node, Ref, Storage, TensorMeta, gc_paused, pending_total
from .graph import same_const as _same_const
from .meta import states_seen
from .planner import (Instr, PendingSlots, Slot, Tape, build_tape, held_after,
                      slice_nodes)
from .stats import _counts
from .tape_io import _meta_data, op_to_name, spec_to_data

UPLOAD = "genie.upload"


_NO_ENTRY = object()  # a plan's entry for nodes recorded without one: matches no node's


class _HostMeta:
    """Stand-in for a host tensor inside a cached plan: its metadata only (values are params)."""

    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = (tuple(t.shape), t.stride(), t.dtype,
                                                            t.device)

    def matches(self, t: torch.Tensor, generic: bool = False) -> bool:
        if generic:
            return t.dtype == self.dtype and t.dim() == len(self.shape) and t.device == self.device
        return (t.dtype == self.dtype and tuple(t.shape) == self.shape
                and t.stride() == self.stride and t.device == self.device)

    def __repr__(self) -> str:
        return f"<host {str(self.dtype).removeprefix('torch.')}{list(self.shape)}>"


_slice_init({"HostMeta": _HostMeta})  # the native instantiate (csrc/slice.cpp) compares with it


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
                 "index", "artifacts", "uses", "_key", "entries", "guide", "produced", "fast",
                 "prefix", "guide_key", "flat", "no_where", "klasses", "rngs", "span", "states",
                 "writes", "wsite", "changed")

    def __init__(self, tape: Tape, nodes: list[Node],
                 targets: list[tuple[Node, int]] | None = None) -> None:
        self.metas = [n.metas for n in nodes]
        self.specs = [n.spec for n in nodes]
        self.wheres = [n.where for n in nodes]
        self.no_where = all(w is None for w in self.wheres)
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
        self.span = -1  # nodes recorded since the previous lookup, at its last use (PlanCache.match)
        # (changed float columns, their instructions) of the last hit whose floats changed and
        # that had no host tensor or other shapes: params' answer when the next one's are the same
        self.changed: tuple[list[int], list[int]] = ([], [])
        self._key: str | None = None
        self.prefix: Any = None
        self._build_guide(nodes, targets)

    def _build_guide(self, nodes: list[Node], targets: list[tuple[Node, int]] | None) -> None:
        """What :func:`match` needs to find and check a slice from its targets alone.

        ``entries``: each node's meta-cache entry (identity stands for op, argument tree, input
        metadata and non-float constants). ``guide[i]``: ``(refs, params, outs, nref)`` with
        ``refs`` = ``(leaf position, producing instruction or -1 for an input, its output,
        slot)``, ``params`` = the positions of float and host-tensor leaves, ``outs`` =
        ``(output, slot, must be kept: True/False, or None for a requested value)``, ``nref`` = how
        many argument references to the node come from inside the slice. ``produced``: slot ->
        ``(instruction, output)``. ``fast``: no node of the slice writes (the match only handles
        slices that are pure data closures; the others go through :func:`instantiate`).
        ``flat``: the same as columns (:func:`_flatten`) for :func:`match`'s common case.
        """
        self.entries = [n.entry if n.entry is not None else _NO_ENTRY for n in nodes]
        self.klasses = [_klass(e) for e in self.entries]
        # the global state words its nodes were recorded under (entries hold them, and equal
        # entries or shape classes mean equal states): the executor runs the tape under them
        self.states = frozenset(e.state for e in self.entries if e is not _NO_ENTRY)
        # the random ops' positions: a node's op is the plan's there (entries say so), and only
        # random ops carry a (seed, offset), so these are the instructions a step's rng rebuilds
        self.rngs = [i for i, ins in enumerate(self.instrs) if ins.rng is not None]
        pos = {n.index: i for i, n in enumerate(nodes)}
        nref = [0] * len(nodes)
        produced: dict[int, tuple[int, int]] = {}
        guide = []
        want = set(self.outputs)
        for i, (n, ins) in enumerate(zip(nodes, self.instrs, strict=True)):
            refs, floats, hosts = [], [], []
            for p, (x, y) in enumerate(zip(n.leaves or (), ins.leaves, strict=True)):
                if type(x) is Ref:
                    j = pos.get(x.node.index, -1)
                    if j >= 0:
                        nref[j] += 1
                    elif (m := x.node.metas[x.out]) is not None and self.inputs.get(y.id) == m:
                        # the input's own metadata object: the match compares identity first,
                        # and a weight is the same node at every step (no field compare of a
                        # cold TensorMeta per input and step)
                        self.inputs[y.id] = m
                    refs.append((p, j, x.out, y.id))
                elif type(x) is float:
                    floats.append(p)
                elif isinstance(x, torch.Tensor):
                    hosts.append(p)
            outs = []
            for k, s in enumerate(ins.outs):
                if s is not None:
                    produced[s] = (i, k)
                    outs.append((k, s, None if s in want else s in self.keep))
            guide.append((tuple(refs), tuple(floats + hosts), tuple(outs)))
        self.guide = [(*g, c) for g, c in zip(guide, nref, strict=True)]
        self.produced = produced
        self.writes = any(n.writes for n in nodes)
        self.wsite = None
        if self.writes and targets is not None:
            self.wsite = _write_sites(self, nodes, targets)
        self.fast = not self.writes or self.wsite is not None
        self.flat = _flatten(self)

    def step_instrs(self, tmpl: list[Instr], nodes: list[Node],
                    stale: tuple[list[int], list[int]]) -> list[Instr]:
        """The instructions of a hit (:func:`match`) on ``nodes``, from the plan's ``tmpl``:
        those of ``stale = (plain, shaped)`` rebuilt from their nodes (``plain``: this step's host
        tensors and floats; ``shaped``: all constants of a node whose shapes differ), and the
        random ops' with this step's ``(seed, offset)``; the others are the plan's own. Read
        before the nodes are bound (binding drops their leaves)."""
        plain, shaped = stale
        instrs = list(tmpl)
        _rebuild(instrs, nodes, tmpl, plain, False)
        _rebuild(instrs, nodes, tmpl, shaped, True)
        for i in self.rngs:  # random ops: this step's (seed, offset)
            n, t = nodes[i], tmpl[i]
            instrs[i] = Instr(n.op, list(instrs[i].leaves), t.spec, t.outs, n.rng, t.free,
                              n.uid, n.where, t.device)
        return instrs

    def replay_source(self, tmpl: list[Instr], nodes: list[Node],
                      stale: tuple[list[int], list[int]]) -> list[Any]:
        """What a native replay (genie.backends.native_replay) reads a hit's per-step leaves and
        ``(seed, offset)`` from, without building its instructions: the plan's instruction where
        the step's is the plan's own, else its node, whose ``leaves`` and ``rng`` hold the values
        :meth:`step_instrs` would put there (at the positions a replay reads: floats, host
        tensors, ints and metadata arguments; argument references are registers)."""
        plain, shaped = stale
        if not plain and not shaped and not self.rngs:
            return tmpl
        src = list(tmpl)
        for i in (*plain, *shaped, *self.rngs):
            src[i] = nodes[i]
        return src

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
        self._by_targets: dict[Any, list[Plan]] = {}  # what :meth:`match` tries, newest first
        # requested ops whose last hit was a plan that writes and that the column match cannot
        # take (a node only a write reaches: Plan.fast), so its cached plans are not tried first
        self._writes: set[Any] = set()
        self._size = 0
        self._last = -1  # the newest requested node's index at the previous lookup

    def span(self, targets: list[tuple[Node, int]]) -> int:
        """How many nodes were recorded between the previous lookup's newest requested node and
        these targets' (-1 at the first lookup): a cheap fingerprint of the step that asks.
        Several plans for the same requested ops (a generate's prefill and its decode steps end
        in the same ops) are tried with the ones last used at this span first: a plan that
        fails costs a walk of the slice before it is rejected."""
        top = targets[0][0].index if len(targets) == 1 else max(n.index for n, _ in targets)
        span = top - self._last if self._last >= 0 else -1
        self._last = top
        return span

    def __len__(self) -> int:
        return self._size

    def clear(self) -> None:
        self._buckets.clear()
        self._by_targets.clear()
        self._writes.clear()
        self._size = 0

    def writes_last(self, targets: list[tuple[Node, int]], key: Any = None) -> bool:
        """Whether the last hit for these requested ops was a plan the column match cannot take
        (``key``: their :func:`_target_key`, when the caller has it)."""
        return bool(self._writes) and (key or _target_key(targets)) in self._writes

    def note_hit(self, targets: list[tuple[Node, int]], plan: Plan, key: Any = None) -> None:
        """Remember whether a hit found through the slice was a plan the column match cannot
        take."""
        if not plan.fast:
            self._writes.add(key or _target_key(targets))
        elif self._writes:
            self._writes.discard(key or _target_key(targets))

    def match(self, targets: list[tuple[Node, int]], generic: bool = False,
              span: int = -1, key: Any = None, found: bool = False
              ) -> Tape | tuple[Plan, Any, bool, Any] | None:
        """A hit found from the targets alone (no :func:`~genie.planner.slice_nodes`): the
        cached plans for these requested ops are tried with :func:`match`, those last used at
        ``span`` (:meth:`span`) first, then most recently used first. ``found``: as
        :func:`plan`'s."""
        plans = self._by_targets.get(key or _target_key(targets))
        if not plans:
            return None
        order = plans
        if len(plans) > 1 and span >= 0 and plans[0].span != span:
            order = [p for p in plans if p.span == span] + [p for p in plans if p.span != span]
        for plan in order:
            tape = match(plan, targets, generic, found)
            if tape is not None:
                plan.span = span
                k = plans.index(plan) if plans[0] is not plan else 0
                if k:  # most recently used first: a loop's plan is tried before the others
                    plans.insert(0, plans.pop(k))
                bucket = self._buckets.get(plan.prefix)
                if bucket is not None:
                    self._buckets.move_to_end(plan.prefix)
                plan.uses += 1
                return tape
        return None

    def _forget(self, plans: list[Plan]) -> None:
        for p in plans:
            if p.fast:
                lst = self._by_targets.get(p.guide_key)
                if lst is not None and p in lst:
                    lst.remove(p)
                    if not lst:
                        del self._by_targets[p.guide_key]

    def plans(self) -> list[Plan]:
        """Every cached plan, least recently used first."""
        return [p for b in self._buckets.values() for p in reversed(b)]

    def lookup(self, targets: list[tuple[Node, int]], nodes: list[Node], generic: bool = False
               ) -> Tape | None:
        bucket = self._buckets.get(_prefix(targets, nodes))
        if bucket is None:
            return None
        for plan in bucket:
            tape = instantiate(plan, targets, nodes, generic)
            if tape is not None:
                self._buckets.move_to_end(_prefix(targets, nodes))
                plan.uses += 1
                return tape
        return None

    def insert(self, targets: list[tuple[Node, int]], nodes: list[Node], tape: Tape) -> Plan:
        plan = Plan(tape, nodes, targets)
        pre = plan.prefix = _prefix(targets, nodes)
        bucket = self._buckets.setdefault(pre, [])
        bucket.insert(0, plan)
        self._buckets.move_to_end(pre)
        self._size += 1
        if plan.fast:
            plan.guide_key = _target_key(targets)
            lst = self._by_targets.setdefault(plan.guide_key, [])
            lst.insert(0, plan)
        if len(bucket) > 8:  # a structure that varies in every step: keep the recent ones
            self._forget([bucket.pop()])
            self._size -= 1
        while self._size > self.capacity:
            _, old = self._buckets.popitem(last=False)
            self._forget(old)
            self._size -= len(old)
        return plan


_cache = PlanCache()
_enabled = os.environ.get("GENIE_PLAN_CACHE", "1").strip() != "0"
_generic = os.environ.get("GENIE_SHAPE_GENERIC", "1").strip() != "0"


def set_shape_generic(on: bool = True) -> None:
    """Let a cached plan serve slices that differ from it only in shapes (the default;
    ``GENIE_SHAPE_GENERIC=0`` starts with it off). See Shapes as parameters."""
    global _generic
    _generic = on


def shape_generic() -> bool:
    return _generic


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


@gc_paused
def plan(targets: list[tuple[Node, int]], generic: bool = True, found: bool = False,
         known: tuple[Any, ...] | None = None) -> Tape | tuple[Plan, Any, bool, Any]:
    """A :class:`~genie.planner.Tape` for ``targets``: a cached plan's when the structure
    matches one (a hit), else a freshly built one, whose plan is cached (a miss).

    ``generic``: the backend that will run the tape takes any shapes (eager, remote: see
    :func:`genie.backends.shape_generic`), so a plan that differs only in shapes is a hit too
    (when :func:`shape_generic` is on). ``found``: a hit the column match finds comes back as
    ``(plan, the match, generic, its params)`` instead, its tape not made: the executor's fused
    hit path runs it from that, or makes the tape with :func:`hit_tape`. ``known``: ``(span,
    key)`` of a lookup ``genie._C._read`` made (csrc/read.cpp) whose column match found no hit;
    ``(span, key, False)`` where it left the match to this function (the Python match).
    """
    generic = generic and _generic
    if known is not None:
        span, key = known[0], known[1]
        tried = len(known) == 2
    else:
        span = _cache.span(targets) if targets else -1
        # the requested ops' key, once: a training step's targets hold every parameter, gradient
        # and optimizer state it updates (33 for a 4-layer MLP's AdamW step)
        key = _target_key(targets) if _enabled and targets else None
        tried = False
    if key is not None and not tried and not _cache.writes_last(targets, key):
        tape = _cache.match(targets, generic, span, key, found)
        if tape is not None:
            _counts["plan_cache_hits"] += 1
            if type(tape) is tuple:  # the caller runs it (executor's fused hit) or asks hit_tape
                return tape
            if tape.generic:
                _counts["plan_cache_generic_hits"] += 1
            return tape
    nodes = slice_nodes(targets)
    if not _enabled or not nodes:
        return build_tape(targets, nodes)
    tape = _cache.lookup(targets, nodes, generic)
    if tape is not None:
        _cache.note_hit(targets, tape.plan, key)
        tape.plan.span = span
        _counts["plan_cache_hits"] += 1
        if tape.generic:
            _counts["plan_cache_generic_hits"] += 1
        return tape
    _counts["plan_cache_misses"] += 1
    tape = build_tape(targets, nodes)
    tape.plan = _cache.insert(targets, nodes, tape)
    tape.plan.span = span
    return tape


def _prefix(targets: list[tuple[Node, int]], nodes: list[Node]) -> tuple[Any, ...]:
    # ops by schema name (``_name``): no object hashes, even in an in-process key
    return (len(nodes), _opname(nodes[0].op), _opname(nodes[-1].op), len(targets),
            _opname(targets[-1][0].op), targets[-1][1])


def _opname(op: Any) -> str:
    return getattr(op, "_name", op)


def _target_key(targets: list[tuple[Node, int]]) -> tuple[Any, ...]:
    return tuple([(getattr(n.op, "_name", n.op), out) for n, out in targets])  # as _opname


(_index, _entry, _rng, _leaves, _node, _out, _storages, _pending, _outputs, _consumers,
 _executed, _where) = (
    attrgetter(a) for a in ("index", "entry", "rng", "leaves", "node", "out", "storages",
                            "pending_writes", "outputs", "n_consumers", "executed", "where"))


def _counted(r: Any) -> bool:
    """Whether an output's liveness (:meth:`Node.output`) counts a live holder (default graph)."""
    return type(r) is int and r > 0


def _maybe_held(r: Any) -> bool:
    """Whether an output's liveness may be a live tensor's: a holder counted, or a capture graph's
    weak reference whose tensor lives (:func:`held_after` decides whether it is still the
    node's)."""
    return r() is not None if type(r) is weakref.ref else _counted(r)


def _flatten(plan: Plan) -> tuple[Any, ...]:
    """``guide`` as flat columns, so that :func:`match` checks the common case with C-level
    ``map`` calls instead of a Python loop per node: in-plan references ``(i, p, j, k)``
    (consumer, leaf, producer, output; consumers from the last instruction back), input
    references grouped by slot ``(slot, [i], [p])`` (in the order met), float leaves
    ``(i, p, value)``, host tensor leaves ``([i], [p], [_HostMeta])``, outputs that must not be held
    ``(i, k, nref)``, outputs that must be held ``(i, k)``, the instructions no in-plan
    reference comes from, ops, output slots, and ``Plan.wsite`` (None for a plan that does not
    write)."""
    ei, ep, ej, ek, inrefs, fi, fp, fv, hi, hk, hn, other = ([] for _ in range(12))
    ei_, ep_, ej_, ek_, hi_, hk_, hn_ = ei.append, ep.append, ej.append, ek.append, hi.append, \
        hk.append, hn.append
    hosts: tuple[list[int], list[int], list[Any]] = ([], [], [])  # (i, p, _HostMeta) columns
    instrs = plan.instrs
    i = len(instrs)
    for refs, params, outs, nref in reversed(plan.guide):
        i -= 1
        for p, j, k, y in refs:
            if j >= 0:
                ei_(i), ep_(p), ej_(j), ek_(k)
            else:
                inrefs.append((i, p, y))
        if params:
            tl = instrs[i].leaves
            for p in params:
                if type(tl[p]) is float:
                    fi.append(i), fp.append(p), fv.append(tl[p])
                else:
                    hosts[0].append(i), hosts[1].append(p), hosts[2].append(tl[p])
        for k, s, held in outs:
            if held is False:
                hi_(i), hk_(k), hn_(nref)
            elif held is True:
                other.append((i, k))
    roots = sorted(set(range(len(plan.instrs))) - set(ei))
    by_slot: dict[int, tuple[list[int], list[int]]] = {}
    for i, p, y in inrefs:  # in the order met (the slow path binds inputs in that order too)
        gi, gp = by_slot.setdefault(y, ([], []))
        gi.append(i)
        gp.append(p)
    ingroups = [(y, gi, gp) for y, (gi, gp) in by_slot.items()]
    return (ei, ep, ej, ek, ingroups, fi, fp, fv, hosts, hi, hk, hn, other, roots,
            [t.op for t in plan.instrs], [t.outs for t in plan.instrs], plan.wsite)


_WriteSites = tuple[list[int], list[int], list[int], list[int], list[tuple[int, ...]]]


def _write_sites(plan: Plan, nodes: list[Node], targets: list[tuple[Node, int]]
                 ) -> _WriteSites | None:
    """Where :func:`match` finds the writers of a plan whose nodes write, and what it checks so
    that the nodes it finds are exactly :func:`~genie.planner.slice_nodes`' (None: some node
    cannot be found that way; the plan goes through :func:`instantiate`).

    An in-place update is reached by no argument reference (its result is its argument's own
    tensor, whose node ran): the slice takes it through ``Storage.pending_writes``, those of a
    requested value's storage (all of them) and those of a storage a slice node reads (the ones
    recorded before the read), with the storage's pending readers recorded before such a write.
    ``wsite`` says that per *site*: ``(wi, wp, wstart, wpos, tw)``, with every argument reference
    of every instruction ``wi[k]`` (leaf ``wp[k]``; from the last instruction back) and the
    plan positions ``wpos[wstart[k]:wstart[k + 1]]`` of the pending writes recorded before that
    read, in order; ``tw[t]``: those of requested value ``t``'s storage. A match takes the
    writers from these lists (:func:`_writes_exact`), then checks every list is that exactly: the
    writes a site expects and no other before its read (a storage shared with another value,
    aliased otherwise than in the plan, has other writes there), and no pending reader before a
    write of the slice outside it. Every closure rule of ``slice_nodes`` is then checked from
    the found nodes, so they are its slice."""
    pos = {n.index: i for i, n in enumerate(nodes)}

    def before(s: Storage | None, upto: int) -> list[int] | None:
        out: list[int] = []
        for w in (s.pending_writes if s is not None else ()):
            if w.index >= upto:
                break
            j = pos.get(w.index)
            if j is None:
                return None  # not in the slice: not a slice_nodes closure (never seen)
            out.append(j)
        return out

    tw: list[tuple[int, ...]] = []
    reach = [False] * len(nodes)
    for (node, out), want in zip(targets, plan.outputs, strict=True):
        e = before(node.storage(out), 1 << 62)
        if e is None:
            return None
        tw.append(tuple(e))
        for j in e:
            reach[j] = True
        if want in plan.produced:
            reach[plan.produced[want][0]] = True
    wi: list[int] = []
    wp: list[int] = []
    wstart = [0]
    wpos: list[int] = []
    for i in range(len(nodes) - 1, -1, -1):
        if not reach[i]:
            return None  # reached only as a reader before a write: the slice finds it
        n = nodes[i]
        lv = n.leaves or ()  # (a new list on each read: read once)
        read = {id(x.node.storage(x.out)) for x in lv if type(x) is Ref}
        if any(id(w) not in read for w in n.writes):
            return None  # a write the sites do not see (not through an argument reference)
        for p, x in enumerate(lv):
            if type(x) is not Ref:
                continue
            if x.node.index in pos:
                reach[pos[x.node.index]] = True
            e = before(x.node.storage(x.out), n.index)
            if e is None:
                return None
            for j in e:
                reach[j] = True
            wi.append(i)
            wp.append(p)
            wpos += e
            wstart.append(len(wpos))
    return wi, wp, wstart, wpos, tw


def _writes_exact(plan: Plan, found: list[Any], targets: list[tuple[Node, int]]) -> bool:
    """Whether the pending writes of the storages the found nodes read (and the requested
    values') are exactly the plan's (``Plan.wsite``), and no pending reader before a write of
    the slice is outside it: :func:`match`'s check of a plan that writes (the reference of
    csrc/match.cpp's). ``found``: the nodes, writers taken from the sites already."""
    wi, wp, wstart, wpos, tw = plan.wsite
    upto: dict[Storage, int] = {}  # storage -> the last write of the slice a read waits for
    for (node, out), e in zip(targets, tw, strict=True):
        s = node.storage(out)
        pw = s.pending_writes if s is not None else ()
        if len(pw) != len(e) or any(pw[q] is not found[j] for q, j in enumerate(e)):
            return False
        if e:
            upto[s] = max(upto.get(s, -1), pw[-1].index)
    for k, (i, p) in enumerate(zip(wi, wp, strict=True)):
        n = found[i]
        x = n.leaf(p)
        if type(x) is not Ref:
            return False
        s = x.node.storage(x.out)
        pw = s.pending_writes if s is not None else ()
        e = wpos[wstart[k]:wstart[k + 1]]
        if len(pw) < len(e) or any(pw[q] is not found[j] for q, j in enumerate(e)) or \
                (len(pw) > len(e) and pw[len(e)].index < n.index):
            return False
        if e:
            upto[s] = max(upto.get(s, -1), pw[len(e) - 1].index)
    mine = set(map(id, found))
    for s, last in upto.items():
        for r in s.readers:
            rn = r()
            if rn is not None and not rn.executed and rn.index < last and id(rn) not in mine:
                return False
    return True


def match(plan: Plan, targets: list[tuple[Node, int]], generic: bool = False,
          found: bool = False) -> Tape | tuple[Plan, Any, bool, Any] | None:
    """``instantiate(plan, targets, slice_nodes(targets))`` without slicing, or None
    (``found``: ``(plan, the match, generic, its params)`` instead of the tape: see
    :func:`plan`).

    Walks the plan backwards from its outputs: instruction ``i``'s node is the one the targets
    or a later instruction's arguments point at (``guide``; an in-place update: the pending
    writes at the plan's sites, ``Plan.wsite``), so the slice is found and checked in the same
    pass. It is exactly the slice because every argument reference is checked: one the plan
    produces must point at a pending node (the one at that position, in record order), one the
    plan takes as an input at an executed node with a kept value; and every pending write on a
    storage the slice reads before the read, or on a requested value's, is the plan's (none for
    a plan that does not write), with no pending reader before one of its writes outside it.
    A node whose meta-cache entry is the plan's (identity) has the plan's op, argument tree,
    input metadata and non-float constants (``generic``: or its shape class, then its
    instruction takes its constants; see Shapes as parameters); a node recorded without one (an
    upload) is compared leaf by leaf. Host tensors must have the plan's metadata, every value
    the plan keeps must be held (by a live tensor or a pending consumer outside the slice) and
    no other one. Checked column by column (``Plan.flat``), natively (``genie._C._match_core``,
    csrc/match.cpp; :func:`_match_core_py` is the reference). None on any difference: the
    caller then slices and uses :func:`instantiate` (a node whose entry is not the plan's
    identical one, a plan with a node only a write reaches). The tape's ``slots`` are built when
    first read (:class:`~genie.planner.PendingSlots`).
    """
    r = _core(plan, targets, generic)
    if r is None:
        return None
    if not found:
        return _tape_of(plan, targets, generic, r)
    p = params(plan, generic, r)
    return None if p is None else (plan, r, generic, p)


def _core(plan: Plan, targets: list[tuple[Node, int]], generic: bool) -> Any:
    """:func:`match`'s walk and per-node checks (natively: ``genie._C._match_core``): None, or
    what :func:`_match_core_py` returns."""
    want_out = plan.outputs
    if not plan.fast or len(targets) != len(want_out):
        return None
    if config.native_match:
        return _match_core(plan.flat, plan.entries, plan.klasses,
                           None if plan.no_where else plan.wheres, plan.produced, want_out,
                           targets if type(targets) is list else list(targets), generic,
                           bool(pending_total[0]), plan.inputs,
                           lambda i, n: _entryless(plan, i, n, generic))
    return _match_core_py(plan, targets, generic)


def hit_tape(plan: Plan, r: Any, targets: list[tuple[Node, int]], generic: bool,
             p: tuple[list[int], bool], count: bool = True) -> Tape:
    """The tape of a hit :func:`plan` handed back as ``(plan, r, generic, p)`` (``count``:
    counted as a shape-generic hit when it is one)."""
    tape = _tape_of(plan, targets, generic, r, p)
    assert tape is not None  # (p: the params of a match that fits)
    if count and tape.generic:
        _counts["plan_cache_generic_hits"] += 1
    return tape


def _tape_of(plan: Plan, targets: list[tuple[Node, int]], generic: bool, r: Any,
             p: tuple[list[int], bool] | None = None) -> Tape | None:
    """:func:`match`'s tape from the core's answer ``r``; None where a host tensor differs."""
    if p is None:
        p = params(plan, generic, r)
    if p is None:
        return None
    found, shaped, _, islots, inputs = r
    # the instructions are built when the tape's are first read (Tape.instrs, Plan.step_instrs):
    # a native replay reads this step's leaves from the nodes (Plan.replay_source)
    tape = Tape(plan.instrs, inputs, list(plan.outputs), set(plan.keep), found,
                PendingSlots(plan.flat[15], islots), plan.index, plan, p[1])
    tape._stale = (p[0], shaped)
    return tape


def params(plan: Plan, generic: bool, r: Any) -> tuple[list[int], bool] | None:
    """A hit's per-step parameters from the core's answer ``r`` (:func:`_core`): the
    instructions that take this step's host tensors or floats (those whose shapes differ
    aside), and whether the step's shapes differ from the plan's; None where a host tensor does
    not fit the plan."""
    found, shaped, changed, _, inputs = r
    _, _, _, _, _, fi, fp, _, hosts, *_ = plan.flat
    get = found.__getitem__
    differs = bool(shaped)
    hsi, hsp, hsv = hosts
    if hsi:  # host tensors (uploads, host constants): parameters of the plan's metadata
        hx = list(map(getitem, map(_leaves, map(get, hsi)), hsp))
        for x, y in zip(hx, hsv, strict=True):
            if not isinstance(x, torch.Tensor) or not y.matches(x, generic):
                return None
            if generic and not differs and not y.matches(x):
                differs = True
    plain: list[int] = []
    if not hsi and not shaped and changed and changed == plan.changed[0]:
        plain = plan.changed[1]  # the floats of the step before (a training step's: all of them)
    elif hsi or changed:  # instructions that take this step's host tensors or floats
        shaped_set = set(shaped)
        plain = [i for i in dict.fromkeys([*hsi, *(fi[k] for k in changed)])
                 if i not in shaped_set]
        for k in changed:  # as instantiate: backends that bake constants in make these inputs
            plan.floats.add((fi[k], fp[k]))
        if not hsi and not shaped:
            plan.changed = (changed, plain)
    if generic and not differs:
        differs = _inputs_differ(inputs, plan.inputs) if config.native_slice else NotImplemented
        if differs is NotImplemented:
            differs = any_input_differs(inputs, plan.inputs)
    return plain, differs


def _rebuild(instrs: list[Instr], found: list[Node], tmpl: list[Instr], indices: list[int],
             shaped: bool) -> None:
    """``instrs[i]`` rebuilt from node ``found[i]`` for each ``i`` of ``indices``: this step's
    host tensors and floats, and (``shaped``) all its constants (natively with
    ``config.native_slice``: csrc/slice.cpp, the same Instr objects)."""
    if not indices:
        return
    if config.native_slice and _rebuild_instrs(instrs, found, tmpl, indices, shaped) is None:
        return
    for i in indices:
        n, t = found[i], tmpl[i]
        instrs[i] = Instr(n.op, _leaves_of(n.leaves, t.leaves, shaped), t.spec, t.outs, n.rng,
                          t.free, n.uid, n.where, t.device)

def _match_core_py(plan: Plan, targets: list[tuple[Node, int]], generic: bool) -> Any:
    """:func:`match`'s per-node part in Python (the reference of ``genie._C._match_core``,
    csrc/match.cpp; ``GENIE_NATIVE_MATCH=0`` uses it): None (not this plan) or ``(found
    nodes, shaped instructions, changed float columns, input slots as a flat ``[node, out,
    slot, ...]`` list (:class:`~genie.planner.PendingSlots`), input values by slot)``."""
    want_out = plan.outputs
    ei, ep, ej, ek, ingroups, fi, fp, fv, hosts, hi, hk, hn, other, roots, ops, outs, _ = \
        plan.flat
    tmpl = plan.instrs
    nn = len(tmpl)
    found: list[Any] = [None] * nn
    produced = plan.produced
    wsite = plan.wsite
    for (node, out), want in zip(targets, want_out, strict=True):
        p = produced.get(want)
        if p is None:
            if wsite is None:
                return None
            continue  # a value that ran, which the plan's writes update: an input, bound below
        if out != p[1] or found[p[0]] not in (None, node):  # (two outputs of one)
            return None
        found[p[0]] = node
    xs: list[Any] = []  # the in-plan argument references, as the walk meets them
    add = xs.append
    try:
        if wsite is None:
            for i, p, j in zip(ei, ep, ej):
                x = found[i].leaf(p)
                add(x)
                found[j] = x.node
        elif not _walk_writes(plan, found, targets, add):
            return None
    except (AttributeError, TypeError, IndexError):
        return None
    get = found.__getitem__
    if any(map(is_, map(get, roots), repeat(None))):
        return None  # an instruction no reference reaches: not this plan's slice
    for (node, _), want in zip(targets, want_out, strict=True):
        # the walk rebinds: every reference agrees
        if want in produced and found[produced[want][0]] is not node:
            return None
    # The plan's interned meta-cache entries, by identity: op, argument tree (so which leaves are
    # Refs, and which write: the op says so), input metadata, int/bool/str
    # constants. Checked first: the passes below read leaves as Refs. Shape-generic: the entries'
    # interned shape classes instead; the nodes whose entries differ are rebuilt below.
    # Nodes recorded without an entry (uploads) are compared leaf by leaf, as instantiate does.
    ents = list(map(_entry, found))
    shaped: list[int] = []
    if not all(map(is_, ents, plan.entries)):
        klasses = plan.klasses
        for i in [i for i, e in enumerate(map(is_, ents, plan.entries)) if not e]:
            e = ents[i]
            if generic and e is not None and _klass(e) is klasses[i]:
                shaped.append(i)
                continue
            n, t = found[i], tmpl[i]
            if e is not None or n.op is not t.op or n.writes:
                return None
            if not _same_node(n, t, plan.metas[i], plan.specs[i]):
                if not generic or not _same_node(n, t, plan.metas[i], plan.specs[i], True):
                    return None
                shaped.append(i)
    if any(map(_executed, found)):
        return None
    xnodes = list(map(_node, xs))
    idx = list(map(_index, found))
    if xnodes != list(map(get, ej)) or list(map(_out, xs)) != ek \
            or not all(map(lt, idx, islice(idx, 1, None))) \
            or (any(map(_where, found)) if plan.no_where
                else list(map(_where, found)) != plan.wheres) \
            or (wsite is None and pending_total[0] and _written_before(found, xs, ei, targets)) \
            or (wsite is not None and not _writes_exact(plan, found, targets)):
        return None
    cons = list(map(_consumers, map(get, hi)))
    if cons != hn:  # consumers outside the slice (dead ones too): held only if one is pending
        in_run = set(idx)
        for i, k, c, n_in in zip(hi, hk, cons, hn, strict=True):
            if c != n_in and held_after(found[i], k, in_run, n_in):
                return None
    changed: list[int] = []  # float arguments with another value than the plan's: parameters
    if fi:
        fx = list(map(getitem, map(_leaves, map(get, fi)), fp))
        if not all(map(is_, fx, fv)):
            changed = [k for k, same in enumerate(map(_same_const, fx, fv)) if not same]
    # outputs that must not be held: no live tensor holds them (a count above 0; a capture
    # graph's weak reference to a tensor is held if that tensor is still this node's)
    if any(map(_maybe_held, map(getitem, map(_outputs, map(get, hi)), hk))):
        in_run = set(idx)
        for i, k in zip(hi, hk, strict=True):
            if _maybe_held(found[i].output(k)) and held_after(found[i], k, in_run):
                return None
    in_run = None
    for i, k in other:  # outputs that must be held: by a live tensor, or a pending consumer
        if not _counted(found[i].output(k)):
            if in_run is None:
                in_run = set(idx)
            if not held_after(found[i], k, in_run):
                return None
    pin = plan.inputs
    islots: dict[tuple[int, int], int] = {}
    inputs: dict[int, torch.Tensor] = {}
    made: list[Any] = []  # the bindings, as PendingSlots.inputs' flat list
    for y, gi, gp in ingroups:  # input references, by plan slot: one value each
        xs = list(map(getitem, map(_leaves, map(get, gi)), gp))
        x = xs[0]
        xn, xo = x.node, x.out
        if len(xs) > 1 and (list(map(_node, xs)).count(xn) != len(xs)
                            or list(map(_out, xs)).count(xo) != len(xs)):
            return None
        if wsite is None and pending_total[0] and (pw := xn.storage(xo).pending_writes) and \
                pw[0].index < max(map(_index, map(get, gi))):
            return None  # a write before a read: the slice would hold it
        if not _bind_input(xn, xo, y, pin, islots, inputs, generic, made):  # also: one value,
            return None                                                       # two slots
    for (node, out), want in zip(targets, want_out, strict=True):  # requested values that ran
        if want not in produced and not _bind_input(node, out, want, pin, islots, inputs,
                                                    generic, made):
            return None
    if len(inputs) != len(pin):
        return None
    return found, shaped, changed, made, inputs


def _written_before(found: list[Any], xs: list[Ref], ei: list[int],
                    targets: list[tuple[Node, int]]) -> bool:
    """For a plan that does not write: whether a pending write was recorded before a read of the
    slice (the in-plan references ``xs``, read by instructions ``ei``) or waits on a requested
    value; the slice would hold it (writes recorded after a read are not the read's)."""
    for x, i in zip(xs, ei, strict=True):
        pw = x.node.storage(x.out).pending_writes
        if pw and pw[0].index < found[i].index:
            return True
    return any(node.storage(out).pending_writes for node, out in targets)


def _walk_writes(plan: Plan, found: list[Any], targets: list[tuple[Node, int]], add: Any) -> bool:
    """:func:`_match_core_py`'s walk for a plan that writes: from the last instruction back, each
    node's producers from its argument references (``add`` collects them), and the writers the
    plan's sites name (``Plan.wsite``) from the storages' pending writes. False where two name
    different nodes for one instruction; what the sites name is checked by
    :func:`_writes_exact`."""
    wi, wp, wstart, wpos, tw = plan.wsite
    ei, ep, ej = plan.flat[:3]

    def take(pw: Any, e: Any) -> bool:
        for q, j in enumerate(e):
            if q >= len(pw) or found[j] not in (None, pw[q]):
                return False
            found[j] = pw[q]
        return True

    for (node, out), e in zip(targets, tw, strict=True):
        if e and not take(node.storage(out).pending_writes, e):
            return False
    m = k = 0
    ne, nw = len(ei), len(wi)
    for i in range(len(found) - 1, -1, -1):
        while m < ne and ei[m] == i:
            x = found[i].leaf(ep[m])
            add(x)
            found[ej[m]] = x.node
            m += 1
        while k < nw and wi[k] == i:
            e = wpos[wstart[k]:wstart[k + 1]]
            if e:
                x = found[i].leaf(wp[k])
                if type(x) is not Ref or not take(x.node.storage(x.out).pending_writes, e):
                    return False
            k += 1
    return True


def _entryless_at(plan: Plan, generic: bool, i: int, n: Node) -> int:
    """:func:`_entryless`, its arguments in the order ``functools.partial(_entryless_at, plan,
    generic)`` passes them (csrc/read.cpp's match)."""
    return _entryless(plan, i, n, generic)


def _entryless(plan: Plan, i: int, n: Node, generic: bool) -> int:
    """A found node whose meta-cache entry is not the plan's: 0 (not the plan's node, as far as
    :func:`match` can tell: the caller slices), 1 (the same node), 2 (the same but for shapes).
    Nodes recorded without an entry (uploads) are compared leaf by leaf."""
    e, t = n.entry, plan.instrs[i]
    if e is not None or n.op is not t.op or n.writes:
        return 0
    if _same_node(n, t, plan.metas[i], plan.specs[i]):
        return 1
    if generic and _same_node(n, t, plan.metas[i], plan.specs[i], True):
        return 2
    return 0


def _state(entry: Any) -> Any:
    """An entry's global state word (:attr:`genie.meta.MetaEntry.state`); None without one."""
    return getattr(entry, "state", None)


def _klass(entry: Any) -> Any:
    """An entry's shape class (:attr:`genie.meta.MetaEntry.klass`); a node recorded without an
    entry gets a fresh object, equal to no other (it never matches shape-generically)."""
    return getattr(entry, "klass", None) or object()


def _leaves_of(leaves: list[Any], tl: list[Any], shaped: bool) -> list[Any]:
    """An instruction's leaves for this step: the plan's slots; the node's parameters (host
    tensors, floats) and, for a node whose shapes differ from the plan's, all its constants."""
    if shaped:
        return [y if type(y) is Slot else x for x, y in zip(leaves, tl, strict=True)]
    return [x if isinstance(x, (torch.Tensor, float)) else y
            for x, y in zip(leaves, tl, strict=True)]


def _bind_input(node: Node, out: int, slot: int, pin: dict[int, TensorMeta],
                slots: dict[tuple[int, int], int], inputs: dict[int, torch.Tensor],
                generic: bool = False, made: list[Any] | None = None) -> bool:
    """Bind an already computed value to the plan's input ``slot``, as build_tape would
    (``generic``: its metadata may differ from the plan's in shape and strides); ``made``: a
    new binding is appended there too, as ``node, out, slot``."""
    key = (node.index, out)
    s = slots.get(key)
    if s is not None:
        return s == slot
    m = pin.get(slot)
    if m is None or slot in inputs or not node.executed or node.values is None:
        return False
    v = node.values[out]
    if v is None or (node.metas[out] is not m and node.metas[out] != m and
                     not (generic and same_kind(node.metas[out], m))):
        return False
    slots[key] = slot
    inputs[slot] = v
    if made is not None:
        made += (node, out, slot)
    return True


def _same_node(n: Node, t: Instr, meta: Any, spec: Any, generic: bool = False) -> bool:
    """Op, metadata, argument tree and constants of ``n`` are the plan's (wiring aside).

    ``generic``: shapes aside - output and metadata-argument shapes and strides, int constants
    and host tensors' shapes may differ (see Shapes as parameters).
    """
    if n.op is not t.op or (n.rng is None) is not (t.rng is None):
        return False
    if n.spec is not spec and n.spec != spec:
        return False
    if n.metas is not meta and n.metas != meta:
        if not generic or len(n.metas) != len(meta) or \
                not all(a is b or (a is not None and b is not None and same_kind(a, b))
                        for a, b in zip(n.metas, meta, strict=True)):
            return False
    leaves = n.leaves
    if leaves is None or len(leaves) != len(t.leaves):
        return False
    for x, y in zip(leaves, t.leaves, strict=True):
        tx = type(x)
        if tx is Ref:
            if type(y) is not Slot:
                return False
        elif tx is float:
            if type(y) is not float:
                return False
        elif tx is MetaArg:
            if type(y) is not MetaArg or (x.meta != y.meta and
                                          not (generic and same_kind(x.meta, y.meta))):
                return False
        elif isinstance(x, torch.Tensor):
            if type(y) is not _HostMeta:
                return False
        elif generic and tx is int:
            if type(y) is not int:
                return False
        elif type(y) in (Slot, _HostMeta) or not _same_const(x, y):
            return False
    return True


def same_kind(a: TensorMeta, b: TensorMeta) -> bool:
    """Metadata that differ at most in shape, strides and offset (same rank, dtype, device,
    math bits): what a shape-generic plan lets vary."""
    return (a.dtype is b.dtype and a.index == b.index and len(a.shape) == len(b.shape)
            and a.conj is b.conj and a.neg is b.neg)


def instantiate(plan: Plan, targets: list[tuple[Node, int]], nodes: list[Node],
                generic: bool = False) -> Tape | None:
    """The tape ``build_tape(targets)`` would build, from ``plan``; None if the structure differs.

    One pass: each node is compared with the plan's instruction at its position (op, argument
    tree, constants, output metadata, slot wiring) while its parameters are collected.
    ``generic``: shapes may differ, as in :func:`match`.

    Runs natively (csrc/slice.cpp: the same pass, the same tape, with its slots as a
    :class:`~genie.planner.PendingSlots`) unless ``config.native_slice`` is off
    (``GENIE_NATIVE_SLICE=0``); the code below is the reference, and runs for what the native
    pass does not handle.
    """
    if len(states_seen) > 1 and (len(nodes) != len(plan.entries) or not all(
            map(eq, map(_state, map(_entry, nodes)), map(_state, plan.entries)))):
        return None  # a node recorded under another global state than the plan's node
    if config.native_slice:
        tape = _native_instantiate(plan, targets, nodes, generic)
        if tape is not NotImplemented:
            _counts["native_instantiates"] += 1
            return tape
    differs = False
    tmpl = plan.instrs
    if len(tmpl) != len(nodes):
        return None
    changed: list[int] | None = None  # instructions whose float arguments differ from the plan's
    pin, keep, want_out, guide = plan.inputs, plan.keep, plan.outputs, plan.guide
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
        if (n.spec is not spec and n.spec != spec) or (n.where is not where and n.where != where):
            return None
        shaped = False
        if n.metas is not meta and n.metas != meta:
            if not generic or not _same_node(n, t, meta, spec, True):
                return None
            shaped = differs = True
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
                    if v is None or (xn.metas[x.out] is not m and xn.metas[x.out] != m and
                                     not (generic and same_kind(xn.metas[x.out], m))):
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
                    if not generic or type(y) is not MetaArg or not same_kind(x.meta, y.meta):
                        return None
                    shaped = differs = True
            elif isinstance(x, torch.Tensor):
                if type(y) is not _HostMeta or not y.matches(x, generic):
                    return None
                if generic and not differs and not y.matches(x):
                    differs = True
                params = True
            elif not _same_const(x, y):
                if not generic or tx is not int or type(y) is not int:
                    return None
                shaped = differs = True
        outs = t.outs
        idx = n.index
        k = 0
        for s in outs:
            if s is not None:
                slots[(idx, k)] = s
                # Which values the program still holds decides the frees: must be the plan's.
                # (guide[i][3]: the plan's references to the node from inside the slice, which
                # are this slice's once it matches; if it does not, the tape is None anyway)
                held = _counted(n.output(k)) or held_after(n, k, in_run, guide[i][3])
                if held is not (s in keep) and s not in want_out:
                    return None
            k += 1
        if params or shaped or n.rng is not None:
            instrs[i] = Instr(n.op, _leaves_of(leaves, tl, shaped), t.spec, outs, n.rng, t.free,
                              n.uid, n.where, t.device)
    outputs = []
    for (node, out), want in zip(targets, want_out, strict=False):  # lengths: below
        s = slots.get((node.index, out))
        if s is None:  # a requested value that is already materialized: an input slot
            m = pin.get(want)
            if m is None or want in inputs or not node.executed or node.values is None or \
                    node.values[out] is None or (node.metas[out] != m and not (
                        generic and same_kind(node.metas[out], m))):
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
    if generic and not differs:
        differs = any_input_differs(inputs, pin)
    return Tape(instrs, inputs, outputs, set(keep), nodes, slots, plan.index, plan, differs)


def any_input_differs(inputs: dict[int, Any], pin: dict[int, TensorMeta]) -> bool:
    """Whether a value of ``inputs`` (slot -> value) differs in shape or strides from the plan's
    input metadata for its slot (natively: ``genie._C._inputs_differ``, csrc/slice.cpp)."""
    for s, v in inputs.items():  # (a loop, not any() over a generator: once per step)
        m = pin[s]
        if v.shape != m.shape or v.stride() != m.stride:
            return True
    return False


# --- deterministic key --------------------------------------------------------------------------

def structure_key(plan: Plan) -> str:
    """BLAKE2b-128 hex digest of a plan's structure (ops by schema name, trees, constants,
    metadata, wiring); independent of ``id()``, object hashes and tensor values."""

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


_match_init(Node, Ref, Storage, held_after, same_kind)
